#!/usr/bin/env bash
# Installs everything railcc needs on a fresh Debian machine and builds it in place.
# Safe to run again: finished steps are quick.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
pkgs=(cmake ninja-build ccache g++ pkgconf libgtest-dev libhwloc-dev libibverbs-dev iproute2)
# The Soft-RoCE VM of the RDMA tests (tests/vm): a kernel with rdma_rxe, qemu, busybox for
# its initrd, and rdma-core's tools and providers (rxe) for the verbs library.
pkgs+=(qemu-system-x86 linux-image-amd64 busybox-static rdma-core ibverbs-providers ibverbs-utils cpio xz-utils)
# Open MPI, the CPU reference of railcc-bench (--backend railcc,openmpi, through mpi4py).
pkgs+=(openmpi-bin libopenmpi-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
# torch first and pinned, so nothing below pulls a different one; the build then runs
# without isolation against this torch.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q pytest pytest-timeout matplotlib mpi4py numpy
"$PY" -m pip install -q --no-build-isolation -e .
# Training libraries the client tests run (tests/python/test_clients.py, test_torchft.py), held to the torch
# above; where they cannot be installed those tests skip, saying so.
torch_now=$("$PY" -c "import torch; print(torch.__version__)")
"$PY" -m pip install -q lightning deepspeed accelerate transformers "torchft==0.2.0" "torch==$torch_now" ||
  echo "install.sh: lightning/deepspeed/accelerate/transformers/torchft not installed; their tests will be skipped" >&2
# The newest torch's wheel (its headers only are used): tests/python/test_torch_versions.py
# compiles the c10d glue against them, so that CI sees an API change before users do.
newest=2.15.0
ls "${RAILCC_WHEEL_DIR:-/tmp/railcc-torch-wheels}/$newest"/torch-$newest-*.whl >/dev/null 2>&1 ||
  PIP_CONSTRAINT=/dev/null "$PY" -m pip download -q --no-deps --only-binary=:all: \
    -d "${RAILCC_WHEEL_DIR:-/tmp/railcc-torch-wheels}/$newest" "torch==$newest" ||
  echo "install.sh: torch $newest's wheel not downloaded; the glue's compile against it will be skipped" >&2
"$PY" -c "import railcc, torch; print('railcc', railcc.__version__, 'built against torch', torch.__version__)"
