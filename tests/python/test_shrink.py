"""torch.distributed.shrink_group on railcc groups (issue 33): real processes, env:// through a
TCPStore, shared memory between the ranks. The elastic example (a rank SIGKILLed mid-step,
the survivors shrink and finish with identical parameters) and shrink's refusals of bad input."""
import os
import re
import sys

import pytest

from harness import run_env_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _launch(script_args, n, timeout=90):
    return run_env_ranks([sys.executable, *script_args], n, timeout=timeout)


def _explain(codes, outs):
    return "\n".join(f"--- rank {r} (exit {c}) ---\n{o[-2500:]}" for r, (c, o) in enumerate(zip(codes, outs)))


@pytest.mark.timeout(180)
def test_elastic_ddp_survives_a_killed_rank_with_identical_parameters():
    # One host; across two hosts (network namespaces, TCP) it is test_multihost.py's.
    codes, outs = _launch([os.path.join(REPO, "examples", "elastic_ddp.py"), "--kill-step", "4", "--steps", "10"], 4)
    assert codes[3] == -9 and codes[:3] == [0, 0, 0], _explain(codes, outs)
    for o in outs[:3]:
        assert "shrinking without ranks [3]" in o and "recovered in" in o, o[-2500:]
        assert "parameters identical on 3 survivors" in o, o[-2500:]
    sums = {line.split("checksum ")[1] for o in outs[:3] for line in o.splitlines() if "checksum " in line}
    assert len(sums) == 1, sums


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,n", [("bad", 3), ("healthy", 4), ("disagree", 4), ("subgroup", 4), ("wait", 3),
                                    ("excluded abort", 3), ("excluded default", 3), ("late", 3), ("drain", 3),
                                    ("second", 4), ("apart", 4)])
def test_shrink_group(mode, n):
    codes, outs = _launch([os.path.join(HERE, "shrink_worker.py"), *mode.split()], n)
    if mode == "apart":
        assert codes == [0] * n and all(f"rank {r} refused in" in outs[r] for r in (0, 1)), _explain(codes, outs)
        return
    if mode in ("late", "drain", "second"):  # a shrink that failed on some rank, retried
        dead = {"late": [n - 1], "drain": [], "second": [n - 2, n - 1]}[mode]
        assert [c for r, c in enumerate(codes) if r not in dead] == [0] * (n - len(dead)), _explain(codes, outs)
        assert all(codes[r] == -9 for r in dead), _explain(codes, outs)
        assert all(f"rank {r} ok" in outs[r] for r in (0, 1)), _explain(codes, outs)
        if mode != "second":
            assert "rank 0: first shrink failed" in outs[0] and "rank 0: retry done" in outs[0], outs[0][-2500:]
        else:
            assert all(f"rank {r}: told of rank 2's death" in outs[r] for r in (0, 1)), _explain(codes, outs)
        return
    if mode in ("subgroup", "wait"):  # the last rank is SIGKILLed
        assert codes == [0] * (n - 1) + [-9], _explain(codes, outs)
        assert all(f"rank {r} ok" in outs[r] for r in range(n - 1)), _explain(codes, outs)
        return
    assert codes == [0] * n, _explain(codes, outs)
    if mode.startswith("excluded"):
        assert "rank 2: PeerFailureError after" in outs[2], outs[2][-2500:]
        return
    if mode == "disagree":
        assert "rank 0 excludes [3] but rank 2 excludes [1, 3]" in outs[0], outs[0][-2500:]
        # Rank 2 names the first rank whose view it read (0 or 1: which came first is timing).
        assert re.search(r"rank 2 excludes \[1, 3\] but rank [01] excludes \[3\]", outs[2]), outs[2][-2500:]
    else:
        survivors = n if mode == "bad" else n - 2
        assert all(f"rank {r} ok" in outs[r] for r in range(survivors)), _explain(codes, outs)


@pytest.mark.timeout(240)
def test_torchrun_restart_sets_up_anew_without_the_failed_attempts_records():
    # torchrun keeps its store across restarts with the failed attempt's keys in it; the
    # restarted ranks must not dial their dead predecessors (gloo does, in torch 2.13).
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import recovery_bench

    took = recovery_bench.run_restart(kill_step=2, steps=5)
    assert took > 0


@pytest.mark.timeout(180)
def test_shrink_cycles_leave_nothing_behind():
    # tools/shrink_cycles.py: kill, shrink, destroy, grow back with a fresh rank; what the
    # survivors hold (fds, threads, mappings, /dev/shm) after cycle 3 equals that after cycle 2.
    import subprocess

    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "shrink_cycles.py"), "--cycles", "3"],
                       capture_output=True, text=True, timeout=170)
    assert r.returncode == 0 and "nothing grew from cycle 2 to cycle 3" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
