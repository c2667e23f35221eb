"""torch 2.14's one-sided windows and abort hooks on railcc (csrc/window.cpp over
csrc/transport/window.cpp; the abort hooks in csrc/backend.h): real processes under env://.
Windows: every rank puts into every rank's window (several dtypes, odd counts, an 8 MiB put,
async puts), signals and waits, on one host (the put read through the kernel) and on fake
hosts (over TCP); misuse is refused by name. Abort hooks: they run on the thread that finds a
dead rank, and again from abort(); pre and post hooks fire around a collective. Needs a torch
with the API (2.14 and later; bash scripts/check_torch.sh 2.15.0 --run runs it); skipped,
saying so, on older ones. The transport itself runs in CI in tests/cpp/window_test.cpp."""

import os
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
