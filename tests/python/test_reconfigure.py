"""torch 2.14's reconfigure API on railcc (csrc/reconfigure.cpp): real processes under env://
take a new membership in place: one rank leaves (the others reconfigure among themselves and
all-reduce), then rejoins (every rank, handles as a set), and bad calls are refused by name.
Needs a torch with the API (2.14 and later; bash scripts/check_torch.sh 2.14.1 --run runs it);
skipped, saying so, on older ones."""

import os
import sys

import pytest
import torch.distributed as dist

from harness import run_env_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [3])
def test_a_rank_leaves_and_rejoins_by_reconfigure(n):
    if not hasattr(dist, "_reconfigure"):
        pytest.skip("this torch has no reconfigure API (torch 2.14 and later: scripts/check_torch.sh 2.14.1 --run)")
    codes, outs = run_env_ranks([sys.executable, os.path.join(HERE, "reconfigure_worker.py")], n, timeout=150)
    explain = "\n".join(f"--- rank {r} (rc={c}):\n{o[-3000:]}" for r, (c, o) in enumerate(zip(codes, outs)))
    assert codes == [0] * n, explain
    assert all(f"rank {r} ok" in outs[r] for r in range(n)), explain
    assert all(f"rank {r}: first reconfigure ok" in outs[r] for r in range(n - 1)), explain
