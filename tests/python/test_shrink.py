"""torch.distributed.shrink_group on railcc groups (issue 33): real processes, env:// through a
TCPStore, shared memory between the ranks. The elastic example (a rank SIGKILLed mid-step,
the survivors shrink and finish with identical parameters) and shrink's refusals of bad input."""
import os
import sys

import pytest

from harness import run_env_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _launch(script_args, n, timeout=120, host_of=None):
    # host_of(rank): a fake host per rank (RAILCC_HOST_ID), so that ranks of different ones talk TCP.
    rank_env = (lambda r: {"RAILCC_HOST_ID": host_of(r)}) if host_of else None
    return run_env_ranks([sys.executable, *script_args], n, timeout=timeout, rank_env=rank_env)


def _explain(codes, outs):
    return "\n".join(f"--- rank {r} (exit {c}) ---\n{o[-2500:]}" for r, (c, o) in enumerate(zip(codes, outs)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hosts", ["one host", "two fake hosts"])
def test_elastic_ddp_survives_a_killed_rank_with_identical_parameters(hosts):
    # Two fake hosts of two ranks each: the dead rank's host keeps its other rank, and the
    # survivors reach each other over TCP across the hosts and shared memory within them.
    host_of = (lambda r: f"elastic-host-{r // 2}") if hosts == "two fake hosts" else None
    codes, outs = _launch([os.path.join(REPO, "examples", "elastic_ddp.py"), "--kill-step", "4", "--steps", "10"], 4,
                          host_of=host_of)
    assert codes[3] == -9 and codes[:3] == [0, 0, 0], _explain(codes, outs)
    for o in outs[:3]:
        assert "shrinking without ranks [3]" in o and "recovered in" in o, o[-2500:]
        assert "parameters identical on 3 survivors" in o, o[-2500:]
    sums = {line.split("checksum ")[1] for o in outs[:3] for line in o.splitlines() if "checksum " in line}
    assert len(sums) == 1, sums


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,n", [("bad", 3), ("healthy", 4), ("disagree", 4)])
def test_shrink_group(mode, n):
    codes, outs = _launch([os.path.join(HERE, "shrink_worker.py"), mode], n)
    assert codes == [0] * n, _explain(codes, outs)
    if mode == "disagree":
        assert "rank 0 excludes [3] but rank 2 excludes [1, 3]" in outs[0], outs[0][-2500:]
        assert "rank 2 excludes [1, 3] but rank 0 excludes [3]" in outs[2], outs[2][-2500:]
    else:
        survivors = n if mode == "bad" else n - 2
        assert all(f"rank {r} ok" in outs[r] for r in range(survivors)), _explain(codes, outs)


@pytest.mark.timeout(240)
def test_torchrun_restart_sets_up_anew_without_the_failed_attempts_records():
    # torchrun keeps its store across restarts with the failed attempt's keys in it; the
    # restarted ranks must not dial their dead predecessors (gloo does, in torch 2.13).
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import recovery_bench

    took = recovery_bench.run_restart(kill_step=2, steps=5)
    assert took > 0
