"""torch 2.14's one-sided windows and abort hooks on railcc (csrc/window.cpp over
csrc/transport/window.cpp; the abort hooks in csrc/backend.h): real processes under env://.
Windows: every rank puts into every rank's window (several dtypes, odd counts, an 8 MiB put,
async puts), signals and waits, on one host (the put read through the kernel), on fake hosts
and between two network namespaces (over TCP); misuse is refused by name. Abort hooks: they
run on the thread that finds a dead rank, and again from abort(); pre and post hooks fire
around a collective. Needs a torch with the API (2.14 and later; bash scripts/check_torch.sh
2.15.0 --run runs it); skipped, saying so, on older ones. The transport itself runs in CI in
tests/cpp/window_test.cpp."""

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from harness import run_env_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "window_worker.py")


def _needs_the_api():
    if not hasattr(dist.distributed_c10d, "_new_window"):
        pytest.skip("this torch has no window API (torch 2.14 and later: scripts/check_torch.sh 2.15.0 --run)")


def _run(n, what, rank_env=None):
    codes, outs = run_env_ranks([sys.executable, WORKER, what], n, timeout=100, rank_env=rank_env)
    explain = "\n".join(f"--- rank {r} (rc={c}):\n{o[-3000:]}" for r, (c, o) in enumerate(zip(codes, outs)))
    return codes, outs, explain


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hosts", ["one host", "fake hosts"])
def test_windows_put_signal_and_refusals(hosts):
    _needs_the_api()
    n = 3
    rank_env = (lambda r: {"RAILCC_HOST_ID": f"fakehost{r}"}) if hosts == "fake hosts" else None
    codes, outs, explain = _run(n, "windows", rank_env)
    assert codes == [0] * n, explain
    assert all(f"rank {r} ok" in outs[r] for r in range(n)), explain


@pytest.mark.timeout(150)
def test_abort_hooks_run_before_the_group_aborts():
    _needs_the_api()
    n = 3
    codes, outs, explain = _run(n, "abort-hooks")
    assert codes == [0] * n, explain
    assert f"rank {n - 1}: leaving" in outs[n - 1], explain
    assert all(f"rank {r} ok" in outs[r] for r in range(n - 1)), explain


@pytest.mark.timeout(150)
def test_windows_between_two_network_namespaces():
    """Two "hosts" (network namespaces joined by a veth pair, tests/python/netns.py): the puts
    and signals cross TCP between separate network stacks."""
    _needs_the_api()
    from netns import netns_available, netns_unavailable_reason, two_hosts

    if not netns_available():
        pytest.skip(f"network namespaces unavailable: {netns_unavailable_reason()}")
    repo = os.path.dirname(os.path.dirname(HERE))
    with two_hosts(prefix="rcw") as h:
        procs = []
        for r in (0, 1):
            env = dict(os.environ, MASTER_ADDR=h.addr_a, MASTER_PORT="29461", WORLD_SIZE="2", RANK=str(r),
                       RAILCC_SOCKET_IFNAME=h.interfaces[r], PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
                       PYTHONPATH=os.path.join(repo, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
            procs.append(subprocess.Popen(h.exec_prefix(r) + [sys.executable, WORKER, "windows"], env=env, cwd=repo,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate()[0] + "\n[test: killed after 120 s]")
    explain = "\n".join(f"--- rank {r} (rc={p.returncode}):\n{o[-3000:]}" for r, (p, o) in enumerate(zip(procs, outs)))
    assert [p.returncode for p in procs] == [0, 0], explain
    assert all(f"rank {r} ok" in outs[r] for r in (0, 1)), explain
