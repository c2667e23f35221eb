"""torch.distributed.shrink_group on railcc groups (issue 33): real processes, env:// through a
TCPStore, shared memory between the ranks. The elastic example (a rank SIGKILLed mid-step,
the survivors shrink and finish with identical parameters) and shrink's refusals of bad input."""
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script_args, n, timeout=120, **extra):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), WORLD_SIZE=str(n),
               PYTHONPATH=os.path.join(REPO, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    procs = [subprocess.Popen([sys.executable, *script_args], env=dict(env, RANK=str(r)), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(n)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


def _explain(codes, outs):
    return "\n".join(f"--- rank {r} (exit {c}) ---\n{o[-2500:]}" for r, (c, o) in enumerate(zip(codes, outs)))


@pytest.mark.timeout(180)
def test_elastic_ddp_survives_a_killed_rank_with_identical_parameters():
    codes, outs = _launch([os.path.join(REPO, "examples", "elastic_ddp.py"), "--kill-step", "4", "--steps", "10"], 4)
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
