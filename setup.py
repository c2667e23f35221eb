"""Builds railcc with CMake against the installed torch.

    pip install --no-build-isolation -e .

Build isolation must stay off: an isolated build would fetch a fresh torch instead of
compiling against the one installed here.
"""

import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def pybind_defs(torch):
    # The module must share pybind11's internals with torch, or c10d types do not convert.
    defs = []
    for attr, macro in (
        ("_PYBIND11_COMPILER_TYPE", "PYBIND11_COMPILER_TYPE"),
        ("_PYBIND11_STDLIB", "PYBIND11_STDLIB"),
        ("_PYBIND11_BUILD_ABI", "PYBIND11_BUILD_ABI"),
    ):
        val = getattr(torch._C, attr, None)
        if val is not None:
            defs.append(f'{macro}="{val}"')
    return defs


class CMakeBuild(build_ext):
    # The CUDA plugin is a plain shared library beside _C: listed among the outputs (wheels)
    # and copied with _C into the source tree (editable installs).
    def _plugin(self):
        return os.path.join(os.path.dirname(self.get_ext_fullpath("railcc._C")), "librailcc_cuda.so")

    def get_outputs(self):
        outs = super().get_outputs()
        return outs + [self._plugin()] if os.path.exists(self._plugin()) else outs

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        inplace_c, built_c = self._get_inplace_equivalent(build_py, self.extensions[0])
        built = os.path.join(os.path.dirname(built_c), "librailcc_cuda.so")
        inplace = os.path.join(os.path.dirname(inplace_c), "librailcc_cuda.so")
        if os.path.exists(built):
            self.copy_file(built, inplace, level=self.verbose)
        elif os.path.exists(inplace):
            os.remove(inplace)

    def build_extension(self, ext):
        import torch

        build_dir = os.environ.get("RAILCC_BUILD_DIR") or os.path.join(ROOT, "build", "py")
        os.makedirs(build_dir, exist_ok=True)
        cfg = [
            "cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DRAILCC_BUILD_PYTHON=ON",
            "-DCMAKE_BUILD_TYPE=" + os.environ.get("RAILCC_BUILD_TYPE", "Release"),
            "-DRAILCC_PYBIND_DEFS=" + ";".join(pybind_defs(torch)),
        ]
        # More CMake settings, e.g. RAILCC_CMAKE_ARGS="-DRAILCC_CUDA_ARCHS=90" (scripts/gpu_check.sh).
        cfg += shlex.split(os.environ.get("RAILCC_CMAKE_ARGS", ""))
        subprocess.check_call(cfg)
        jobs = os.environ.get("RAILCC_BUILD_JOBS", str(os.cpu_count() or 2))
        # Everything the build defines: the _C module and, where nvcc was found, the CUDA plugin.
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs])
        built = [f for f in os.listdir(build_dir) if f.startswith("_C.") and f.endswith(".so")]
        if not built:
            raise RuntimeError(f"CMake built no _C module in {build_dir}")
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(os.path.join(build_dir, built[0]), dest)
        # The engine looks for the plugin beside _C; a stale one from an earlier build goes.
        plugin = os.path.join(build_dir, "librailcc_cuda.so")
        plugin_dest = os.path.join(os.path.dirname(dest), "librailcc_cuda.so")
        if os.path.exists(plugin):
            shutil.copyfile(plugin, plugin_dest)
        elif os.path.exists(plugin_dest):
            os.remove(plugin_dest)


setup(
    name="railcc",
    version="0.1.0",
    description="A collective-communication backend for torch.distributed",
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[CMakeExtension("railcc._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    entry_points={"console_scripts": ["railcc-bench = railcc.bench:main", "railcc = railcc.cli:main"]},
    zip_safe=False,
)
