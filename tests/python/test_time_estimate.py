"""torch.distributed's time estimator on railcc (engine/algorithms/estimate.cpp): inside
`_time_estimator`, collectives move nothing and return at once, and the estimate comes from the
plans railcc's algorithms run by. Real ranks (harness.py); what is asserted is what the model
promises, never a timing: estimates are positive, grow with the bytes, leave tensors as they
were, take no sequence number (a rank that estimates alone stays in step), and ops run again
after the context."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce", "gather", "scatter",
       "barrier", "send")


def _issue(op, rank, n, count):
    """One op of `count` float elements a rank; returns the tensors it was given."""
    t = torch.full((count,), float(rank + 1))
    if op == "all_reduce":
        dist.all_reduce(t)
        return [t]
    if op == "broadcast":
        dist.broadcast(t, 0)
        return [t]
    if op == "all_gather":
        out = torch.zeros(count * n)
        dist.all_gather_into_tensor(out, t)
        return [t, out]
    if op == "reduce_scatter":
        big, out = torch.full((count * n,), float(rank + 1)), torch.zeros(count)
        dist.reduce_scatter_tensor(out, big)
        return [out]
    if op == "all_to_all":
        ins, outs = [torch.full((count,), float(rank)) for _ in range(n)], [torch.zeros(count) for _ in range(n)]
        dist.all_to_all(outs, ins)
        return outs
    if op == "reduce":
        dist.reduce(t, 0)
        return [t]
    if op == "gather":
        outs = [torch.zeros(count) for _ in range(n)] if rank == 0 else None
        dist.gather(t, outs, 0)
        return outs or []
    if op == "scatter":
        out = torch.zeros(count)
        dist.scatter(out, [torch.full((count,), 9.0) for _ in range(n)] if rank == 0 else None, 0)
        return [out]
    if op == "barrier":
        dist.barrier()
        return []
    if rank == 0:  # send: to rank 1 only, which does not post a receive inside the estimate
        dist.send(t, 1)
    return [t]


def rk_estimates(rank, n):
    backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert backend.supports_time_estimate
    out = {}
    for op in OPS:
        est = []
        for count in (256, 1 << 18):
            with c10d._time_estimator() as cm:
                tensors = _issue(op, rank, n, count)
            est.append(cm.estimated_time)
            untouched = {0.0, 9.0, float(rank), float(rank + 1)}
            for x in tensors:  # nothing moved: each tensor holds what it was made with
                assert set(x.unique().tolist()) <= untouched, (op, x.unique().tolist())
        out[op] = est
    # A real op afterwards runs, in step with the other ranks.
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2))), t
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_time_estimates_follow_the_plans_and_move_nothing(pools, n):
    got = pools(n).run(rk_estimates)
    for rank, est in enumerate(got):
        for op, (small, large) in est.items():
            if op == "barrier" or (op == "send" and rank != 0):
                assert large == small, (rank, op, small, large)  # no bytes: latency only, or nothing
                continue
            assert 0 < small < large, (rank, op, small, large)


def rk_alone(rank, n):
    """Rank 0 alone estimates a few ops; then every rank runs real ones, which must match."""
    if rank == 0:
        with c10d._time_estimator() as cm:
            for _ in range(3):
                dist.all_reduce(torch.ones(64))
        assert cm.estimated_time > 0
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    dist.broadcast(t, 1)
    return t.tolist()


@pytest.mark.timeout(120)
def test_an_estimate_on_one_rank_leaves_the_group_in_step(pools):
    got = pools(2).run(rk_alone)
    assert got == [[1.0] * 3, [1.0] * 3], got


def rk_misuse(rank, n):
    backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
    errors = []
    try:
        backend._end_time_estimate()
    except Exception as e:  # noqa: BLE001  the message is what is checked
        errors.append(str(e))
    backend._start_time_estimate()
    try:
        backend._start_time_estimate()
    except Exception as e:  # noqa: BLE001
        errors.append(str(e))
    backend._end_time_estimate()
    return errors


@pytest.mark.timeout(60)
def test_time_estimate_misuse_is_refused_by_name(pools):
    for errors in pools(2).run(rk_misuse):
        assert len(errors) == 2, errors
        assert "no time estimate was started" in errors[0], errors
        assert "already running" in errors[1], errors
