#!/usr/bin/env bash
# Builds the extension (and the CUDA plugin, where nvcc is found) with CMake alone, for
# machines without setuptools, and puts both into a railcc package folder:
#
#   bash scripts/cmake_build.sh BUILD_DIR [DEST_DIR] [-DCMAKE_ARG ...]
#
# DEST_DIR defaults to python/railcc (an in-place build, as setup.py build_ext --inplace).
# RAILCC_BUILD_JOBS sets the build's parallelism (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: cmake_build.sh BUILD_DIR [DEST_DIR] [-DCMAKE_ARG ...]}
shift
dest=python/railcc
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then dest=$1; shift; fi
PY=${PYTHON:-python3}
# The module must share pybind11's internals with torch (as setup.py's pybind_defs).
defs=$("$PY" - <<'PYEOF'
import torch
out = []
for attr, macro in (("_PYBIND11_COMPILER_TYPE", "PYBIND11_COMPILER_TYPE"), ("_PYBIND11_STDLIB", "PYBIND11_STDLIB"),
                    ("_PYBIND11_BUILD_ABI", "PYBIND11_BUILD_ABI")):
    v = getattr(torch._C, attr, None)
    if v is not None:
        out.append(f'{macro}="{v}"')
print(";".join(out))
PYEOF
)
cmake -S . -B "$build" -G Ninja -DPython3_EXECUTABLE="$(command -v "$PY")" -DRAILCC_BUILD_PYTHON=ON \
  -DCMAKE_BUILD_TYPE="${RAILCC_BUILD_TYPE:-Release}" -DRAILCC_PYBIND_DEFS="$defs" "$@"
cmake --build "$build" -j "${RAILCC_BUILD_JOBS:-$(nproc)}"
mkdir -p "$dest"
rm -f "$dest"/_C.*.so "$dest"/librailcc_cuda.so
cp "$build"/_C.*.so "$dest/"
if [ -f "$build/librailcc_cuda.so" ]; then cp "$build/librailcc_cuda.so" "$dest/"; fi
echo "built $(ls "$dest"/_C.*.so) $( [ -f "$dest/librailcc_cuda.so" ] && echo "and $dest/librailcc_cuda.so")"
