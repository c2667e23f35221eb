#!/usr/bin/env bash
# Builds railcc as the GPU image would: without hwloc's, rdma-core's or GoogleTest's headers,
# libraries and pkg-config files, and without pkg-config itself. Run as root on a machine that
# has them all (the CI machine): a private mount namespace (unshare -m) hides them from this
# build only, so the rest of the machine keeps them. Then the fresh build is imported,
# `railcc topo` must say the topology came from sysfs, and a 2-rank all_reduce runs on it.
#
#   sudo bash scripts/check_bare_build.sh [BUILD_DIR]     # default /tmp/railcc-bare-build
#
# RAILCC_BUILD_JOBS (default: all cores) sets the build's parallelism.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-/tmp/railcc-bare-build}
if [ "${RAILCC_BARE_INSIDE:-}" != 1 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "check_bare_build.sh: needs root (unshare -m)" >&2; exit 2; }
  exec env RAILCC_BARE_INSIDE=1 unshare -m --propagation private bash "$0" "$build"
fi

PY=${PYTHON:-python3}
multi=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
hide_dir() { [ -d "$1" ] && mount -t tmpfs -o size=1m,mode=0755 none "$1" && echo "hidden: $1/"; return 0; }
# A file is replaced by one that cannot be used: a header that stops the compiler, a library
# that is not ELF.
hide_file() {
  [ -e "$1" ] || return 0
  local stub=/tmp/railcc-bare-stub
  printf '#error hidden by check_bare_build.sh\nexit 127\n' > "$stub"
  chmod 755 "$stub"
  mount --bind "$stub" "$1" && echo "hidden: $1"
}
for d in /usr/include/hwloc /usr/include/infiniband /usr/include/rdma /usr/include/gtest /usr/include/gmock \
         /usr/src/googletest /usr/src/gtest /usr/lib/$multi/cmake/GTest /usr/lib/cmake/GTest /usr/share/hwloc; do
  hide_dir "$d"
done
for f in /usr/include/hwloc.h /usr/lib/$multi/libhwloc.so* /usr/lib/$multi/libhwloc.a /usr/lib/$multi/libgtest* \
         /usr/lib/$multi/libgmock* /usr/lib/$multi/pkgconfig/hwloc.pc /usr/lib/$multi/pkgconfig/libibverbs.pc \
         /usr/lib/$multi/libibverbs.so* /usr/bin/pkg-config /usr/bin/pkgconf; do
  hide_file "$f"
done

# Nothing of them must be left that the build could use.
if echo '#include <hwloc.h>' | c++ -x c++ -fsyntax-only - 2>/dev/null; then echo "hwloc.h still usable" >&2; exit 1; fi
if echo '#include <infiniband/verbs.h>' | c++ -x c++ -fsyntax-only - 2>/dev/null; then echo "verbs.h still usable" >&2; exit 1; fi
if echo '#include <gtest/gtest.h>' | c++ -x c++ -fsyntax-only - 2>/dev/null; then echo "gtest still usable" >&2; exit 1; fi

rm -rf "$build"
# The fresh module, imported from a copy of the package next to it.
pkg="$build/pkg"
mkdir -p "$pkg"
cp -r python/railcc "$pkg/"
bash scripts/cmake_build.sh "$build" "$pkg/railcc" | grep -iE "railcc|verbs.h|hwloc.h|error|built" || true
[ -f "$pkg"/railcc/_C.*.so ] || { echo "no module built" >&2; exit 1; }
PYTHONPATH="$pkg" "$PY" - <<'EOF'
import json, subprocess, sys
import railcc
t = subprocess.run([sys.executable, "-m", "railcc", "topo", "--json"], capture_output=True, text=True, check=True)
t = json.loads(t.stdout)
print("imported", railcc.__file__, "| topology:", t["source"])
assert t["method"] == "sysfs", t["source"]
print("cuda:", railcc.cuda_info())
EOF
# And it runs: a 2-rank all_reduce on this build.
PYTHONPATH="$pkg" "$PY" -m railcc bench --nprocs 2 -o all_reduce -b 8 -e 64K -f 64 -n 2 -w 1 | grep -E "^#.*wrong|^ +[0-9]"
echo "bare build OK: no hwloc, rdma-core or GoogleTest headers, libraries or pkg-config"
