#!/usr/bin/env bash
# Checks railcc against another torch release than the installed one.
#
#   bash scripts/check_torch.sh 2.15.0          # the c10d glue compiles against its headers
#   bash scripts/check_torch.sh 2.14.1 --run    # and railcc built against it passes the core set
#
# Without --run: downloads that release's wheel from PyPI (no dependencies), unpacks only its
# headers and compiles the glue (csrc/backend.cpp, module.cpp, reconfigure.cpp, window.cpp) with
# -fsyntax-only. The wheel is kept in ${RAILCC_WHEEL_DIR:-/tmp/railcc-torch-wheels}.
#
# With --run: a venv with that torch (a CUDA build from PyPI, several GB, run on the CPU here),
# a copy of this working tree built against it, and the core set of tests run there: the
# collectives matrix, the watchdog, shrink and split, DDP and FSDP2 on CPU, and torch 2.14's
# reconfigure, windows and abort hooks where it has them (RAILCC_CORE_TESTS
# overrides the list). Everything lives in ${RAILCC_TORCH_RUNS:-/tmp/railcc-torch-runs}/VERSION;
# a second run reuses the venv and the build. Takes 15-30 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: check_torch.sh TORCH_VERSION [--run]}
if [ "${2:-}" = "--run" ]; then
  base=${RAILCC_TORCH_RUNS:-/tmp/railcc-torch-runs}/$version
  venv=$base/venv src=$base/src
  mkdir -p "$base"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # A machine-wide pip constraint (a pinned torch) must not apply to this venv.
  "$venv/bin/python" -c "import torch" 2>/dev/null ||
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q "torch==$version" pytest pytest-timeout numpy setuptools
  # The working tree as it is (tracked and new files), so that its build and tests use nothing
  # of this checkout's build.
  rm -rf "$src" && mkdir -p "$src"
  git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$src"
  (cd "$src" && RAILCC_BUILD_DIR="$base/build" CCACHE_BASEDIR="$src" \
     "$venv/bin/python" -m pip install -q --no-build-isolation -e .)
  tests=${RAILCC_CORE_TESTS:-"tests/python/test_collectives.py tests/python/test_watchdog.py tests/python/test_shrink.py tests/python/test_training.py tests/python/test_reconfigure.py tests/python/test_window.py"}
  echo "torch $version: running the core set: $tests"
  # shellcheck disable=SC2086
  (cd "$src" && "$venv/bin/python" -m pytest -q -p no:cacheprovider $tests)
  exit $?
fi
PY=${PYTHON:-python3}
cache=${RAILCC_WHEEL_DIR:-/tmp/railcc-torch-wheels}
mkdir -p "$cache/$version"
wheel=$(ls "$cache/$version"/torch-"$version"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  # Another release than the installed one: a machine-wide pip constraint (a pinned torch) must
  # not apply to this download.
  PIP_CONSTRAINT=/dev/null "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$cache/$version" "torch==$version"
  wheel=$(ls "$cache/$version"/torch-"$version"-*.whl | head -1)
fi
inc="$cache/$version/include"
if [ ! -d "$inc/torch" ]; then
  rm -rf "$cache/$version/x"
  (cd "$cache/$version" && unzip -q -o "$wheel" 'torch/include/*' -d x && mv x/torch/include "$inc" && rm -rf x)
fi
pyinc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
status=0
for f in csrc/backend.cpp csrc/module.cpp csrc/reconfigure.cpp csrc/window.cpp; do
  if c++ -std=gnu++20 -fsyntax-only -Wall -Wno-unused-parameter -DTORCH_EXTENSION_NAME=_C -DUSE_DISTRIBUTED \
      -DUSE_C10D_GLOO -Icsrc -isystem "$pyinc" -isystem "$inc" -isystem "$inc/torch/csrc/api/include" "$f"; then
    echo "torch $version: $f compiles"
  else
    echo "torch $version: $f does NOT compile" >&2
    status=1
  fi
done
exit $status
