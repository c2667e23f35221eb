"""Builds and runs the GoogleTest binary (engine and transports, no torch), so the one
test command covers the C++ suite as well. The same build compiles the CUDA plugin
(csrc/cuda) with nvcc when the machine has it; without a GPU it is compiled and loaded, and
its kernels are not run."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.join(ROOT, "build", "cpp")


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ninja") is None, reason="cmake/ninja not installed")
def test_googletest_suite():
    subprocess.run(["cmake", "-S", ROOT, "-B", BUILD, "-G", "Ninja", "-DRAILCC_BUILD_PYTHON=OFF",
                    "-DRAILCC_BUILD_TESTS=ON"], check=True, timeout=300, capture_output=True)
    # The suite alone: the CUDA plugin is compiled by the install (and checked below).
    subprocess.run(["cmake", "--build", BUILD, "--target", "railcc_tests"], check=True, timeout=900)
    r = subprocess.run([os.path.join(BUILD, "railcc_tests"), "--gtest_brief=1"], timeout=600,
                       capture_output=True, text=True)
    # The failing tests by name and their assertions first (stdout), then the end of the logs
    # (stderr, which the engine's warnings fill).
    lines = r.stdout.splitlines()
    failed = [ln for ln in lines if ln.startswith("[  FAILED  ]")]
    where = [ln for i, ln in enumerate(lines) if "Failure" in ln or (i and "Failure" in lines[i - 1])]
    tail = "\n".join(failed + where[:40] + r.stdout.splitlines()[-20:] + r.stderr.splitlines()[-10:])
    assert r.returncode == 0, tail
    assert "PASSED" in r.stdout, tail


def _installed_plugin_is_current():
    """Whether the install built python/railcc/librailcc_cuda.so from these sources (nvcc's
    minutes are spent once per CI run, not twice)."""
    plugin = os.path.join(ROOT, "python", "railcc", "librailcc_cuda.so")
    if not os.path.exists(plugin):
        return False
    cuda = os.path.join(ROOT, "csrc", "cuda")
    newest = max(os.path.getmtime(os.path.join(cuda, f)) for f in os.listdir(cuda))
    return os.path.getmtime(plugin) >= newest


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: the CUDA kernels cannot be compiled here")
def test_cuda_plugin_compiles():
    if _installed_plugin_is_current():
        return
    # Otherwise build it here: the GoogleTest build configures the CUDA plugin when nvcc is on PATH.
    cfg = subprocess.run(["cmake", "-S", ROOT, "-B", BUILD, "-G", "Ninja", "-DRAILCC_BUILD_PYTHON=OFF",
                          "-DRAILCC_BUILD_TESTS=ON"], check=True, timeout=300, capture_output=True, text=True)
    if "CUDA runtime library; the CUDA plugin is not built" in cfg.stdout:
        pytest.skip("nvcc is installed without the CUDA runtime library")
    r = subprocess.run(["cmake", "--build", BUILD, "--target", "railcc_cuda_plugin"], timeout=900, capture_output=True,
                       text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
