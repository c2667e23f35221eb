#!/usr/bin/env bash
# Checks that the c10d glue compiles against another torch release's headers, without
# installing it: downloads that release's wheel from PyPI (no dependencies), unpacks only its
# headers and compiles csrc/backend.cpp and csrc/module.cpp with -fsyntax-only.
#
#   bash scripts/check_torch.sh 2.11.0        # the GPU machines' torch
#
# The wheel is kept in ${RAILCC_WHEEL_DIR:-/tmp/railcc-torch-wheels} for the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: check_torch.sh TORCH_VERSION}
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
for f in csrc/backend.cpp csrc/module.cpp; do
  if c++ -std=gnu++20 -fsyntax-only -Wall -Wno-unused-parameter -DTORCH_EXTENSION_NAME=_C -DUSE_DISTRIBUTED \
      -DUSE_C10D_GLOO -Icsrc -isystem "$pyinc" -isystem "$inc" -isystem "$inc/torch/csrc/api/include" "$f"; then
    echo "torch $version: $f compiles"
  else
    echo "torch $version: $f does NOT compile" >&2
    status=1
  fi
done
exit $status
