"""Single copy between ranks of one host (RAILCC_CMA_BYTES): the receiver reads the sender's
buffer with process_vm_readv. Real processes and the real kernel: once where it may read its
peers, and once where every rank has made itself unreadable (no CAP_SYS_PTRACE, not dumpable),
so the kernel refuses and the shared-memory FIFOs must carry everything, said once at INFO."""
import os
import shutil
import sys

import pytest

from harness import run_env_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(n, refuse, timeout=150, env=None):
    cmd = [sys.executable, os.path.join(HERE, "cma_worker.py")] + (["--refuse"] if refuse else [])
    if refuse and os.geteuid() == 0:
        # root reads any process (CAP_SYS_PTRACE): the ranks start without it.
        if not shutil.which("setpriv"):
            pytest.skip("setpriv (util-linux) is needed to start ranks without CAP_SYS_PTRACE as root")
        cmd = ["setpriv", "--bounding-set=-sys_ptrace"] + cmd
    codes, outs = run_env_ranks(cmd, n, timeout=timeout,
                                env={"RAILCC_CMA_BYTES": "4096", "RAILCC_DEBUG": "INFO", "RAILCC_DEBUG_SUBSYS": "SHM",
                                     **(env or {})})
    for r, (code, out) in enumerate(zip(codes, outs)):
        assert code == 0 and f"rank {r} ok" in out, f"rank {r} exited {code}:\n{out[-4000:]}"
    return outs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_single_copy_matches_torch_on_views(n):
    outs = _run(n, refuse=False, timeout=250)
    assert all("single copy (CMA) works" in o for o in outs), outs[0][-3000:]


@pytest.mark.timeout(200)
def test_single_copy_in_the_direct_all_gather_matches_torch():
    # The all-gather whose sends are read by their peers (the rule picks the shm rings on one
    # host): its own piece is copied while the peers read.
    outs = _run(2, refuse=False, env={"RAILCC_ALGO": "direct"})
    assert all("single copy (CMA) works" in o for o in outs), outs[0][-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_single_copy_refused_by_the_kernel_falls_back_to_the_fifos(n):
    outs = _run(n, refuse=True, timeout=250)
    for o in outs:
        assert "single copy (CMA) is off" in o and "Operation not permitted" in o, o[-3000:]
        assert "single copy (CMA) works" not in o


# Where a host's ranks outnumber their CPUs the default (RAILCC_CMA_BYTES=-1) reads messages of
# 64 KiB and up through the kernel; with a CPU per rank those of 16 KiB and up (32 KiB here: one,
# not the other).
_SHARED_CORES_WORKER = """
import os, sys, torch, torch.distributed as dist
import railcc
cpus = sorted(os.sched_getaffinity(0))
rank = int(os.environ["RANK"])
os.sched_setaffinity(0, {cpus[0]} if sys.argv[1] == "shared" else {cpus[rank]})
dist.init_process_group("railcc")
n = dist.get_world_size()
block = 32 << 10
inp = torch.arange(n * block // 4, dtype=torch.float32) + rank * 1000003
got = torch.empty_like(inp)
dist.all_to_all_single(got, inp)
railcc.reset_stats()
dist.all_to_all_single(got, inp)
st = railcc.stats()["shm"]
want = torch.cat([(torch.arange(n * block // 4, dtype=torch.float32) + r * 1000003)[rank * block // 4:(rank + 1) * block // 4]
                  for r in range(n)])
assert torch.equal(got, want)
print("single", st["single_copied_bytes"], "payload", (n - 1) * block, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("placement", ["shared", "own"])
def test_single_copy_threshold_follows_whether_ranks_share_cores(placement):
    n = 3 if placement == "shared" else 2
    if placement == "own" and len(os.sched_getaffinity(0)) < n:
        pytest.skip(f"needs {n} CPUs")
    codes, outs = run_env_ranks([sys.executable, "-c", _SHARED_CORES_WORKER, placement], n, timeout=150)
    for r, (code, out) in enumerate(zip(codes, outs)):
        assert code == 0, f"rank {r} exited {code}:\n{out[-4000:]}"
        line = [ln for ln in out.splitlines() if ln.startswith("single ")][-1].split()
        single, payload = int(line[1]), int(line[3])
        assert single == (payload if placement == "own" else 0), out[-2000:]
