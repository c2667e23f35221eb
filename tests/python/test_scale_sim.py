"""The scale simulation (engine/simulate.h, `python -m railcc sim`) against real ranks: for each
op, the bytes every rank sent to every peer, as its flight recorder counted them, are what the
simulation says for the same job. The simulation plays the engine's own rule and step
functions; this checks that the way it strings an algorithm's stages together is the engine's."""

import time

import pytest

import railcc

from harness import RankPool

pytestmark = pytest.mark.timeout(240)

# (op, bytes of the op's whole buffer), float32: sizes where the rule picks each algorithm.
OPS = [("all_reduce", 8), ("all_reduce", 1 << 20), ("reduce_scatter", 1 << 20), ("all_gather", 64 << 10),
       ("broadcast", 1 << 20), ("broadcast", 8)]


def _traffic(rank, world, ops):
    import torch
    import torch.distributed as dist

    seen = []
    for op, nbytes in ops:
        n = nbytes // 4
        # Distinct values per rank and element, so a block that lands in the wrong place shows.
        x = torch.arange(n, dtype=torch.float32) % 251 + rank * 1000
        if op == "all_reduce":
            out = x.clone()
            dist.all_reduce(out)
            want = sum(torch.arange(n, dtype=torch.float32) % 251 + q * 1000 for q in range(world))
        elif op == "reduce_scatter":
            out = torch.empty(n // world)
            dist.reduce_scatter_tensor(out, x)
            want = sum(torch.arange(n, dtype=torch.float32) % 251 + q * 1000 for q in range(world))
            want = want.chunk(world)[rank]
        elif op == "all_gather":
            out = torch.empty(n - n % world)
            dist.all_gather_into_tensor(out, x[: n // world].contiguous())
            want = torch.cat([torch.arange(n // world, dtype=torch.float32) % 251 + q * 1000 for q in range(world)])
        else:
            out = x.clone()
            dist.broadcast(out, 0)
            want = torch.arange(n, dtype=torch.float32) % 251
        assert torch.equal(out, want), f"rank {rank}: {op} of {nbytes} B gave wrong values"
        last = railcc.dump_trace()["ops"][-1]
        seen.append((last["op"], {int(p): b for p, b in last["bytes_sent"].items()}))
    # The barrier: nobody leaves it before the last rank (rank 0, late on purpose) arrives.
    dist.barrier()
    if rank == 0:
        time.sleep(0.5)
    t0 = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - t0
    last = railcc.dump_trace()["ops"][-1]
    seen.append((last["op"], {int(p): b for p, b in last["bytes_sent"].items() if b}, waited))
    return seen


def _block(op, nbytes, world):
    return nbytes // world if op in ("reduce_scatter", "all_gather") else nbytes


@pytest.mark.parametrize("world,per_host,algo,ops", [(16, 1, "", OPS), (8, 2, "", OPS), (8, 2, "hier,ring", OPS),
                                                     (32, 2, "", [OPS[0], OPS[-1]])],
                         ids=["16x1", "8x2", "8x2-hier-ring", "32x2-rail-tree"])
def test_simulation_sends_what_real_ranks_send(world, per_host, algo, ops):
    # 32x2: 16 hosts, where the small all-reduce runs a binary tree along each rail, and the small
    # broadcast a tree along rank 0's rail and then within each host (16x1: one tree of all).
    env = {"RAILCC_ALGO": algo} if algo else {}
    pool = RankPool(world, env=env, rank_env=lambda r: {"RAILCC_HOST_ID": f"h{r // per_host}"})
    try:
        got = pool.run(_traffic, ops, timeout=180)
    finally:
        pool.close()
    rules = railcc._C.rules
    # From 16 ranks across hosts the barrier is a one-byte all-reduce: the 8-byte one's peers.
    small = rules.simulate(world, per_host, "all_reduce", 8, 4, algo=algo, per_rank=True)
    for r in range(world):
        op, peers, waited = got[r][-1]
        assert op == "barrier", got[r][-1]
        assert r == 0 or waited > 0.3, f"rank {r} left the barrier {waited:.3f} s after entering it, before rank 0 came"
        if world >= 16:
            assert set(peers) == {p for p, _ in small["sent"][r]}, (r, peers, small["sent"][r])
    for k, (op, nbytes) in enumerate(ops):
        sim = rules.simulate(world, per_host, op, _block(op, nbytes, world), 4, algo=algo, per_rank=True)
        for r in range(world):
            real_op, real = got[r][k]
            want = dict(sim["sent"][r])
            assert real == want, (f"{op} of {nbytes} B at {world} ranks, {per_host} per host ({sim['algo']}): rank {r} "
                                  f"sent {real} (trace op {real_op}), the simulation says {want}")


def test_simulation_at_4096_ranks_meets_the_scale_targets():
    rules = railcc._C.rules
    n, per_host = 4096, 8
    small = rules.simulate(n, per_host, "all_reduce", 8, 4)
    assert small["algo"] == "tree (rails: binary tree)" and small["steps"] <= 2 * 12 + 4, small
    assert small["net_peers"] <= 2 * 2 + 4, small  # 2 x channels + 4
    from railcc.sim import _setup_reads

    setup = _setup_reads(n, per_host)
    assert setup["store_bytes_read"] <= 64 << 10 and setup["store_reads"] <= 6, setup
    big = rules.simulate(n, per_host, "all_reduce", 256 << 20, 4)
    assert big["algo"] == "hier (rails: ring)" and big["net_peers"] == 2, big
    assert big["bytes_sent"] <= 2 * (n - 1) / n * (256 << 20) * 1.05, big
    bcast = rules.simulate(n, per_host, "broadcast", 8, 4)  # the chain took 4,095 hops
    assert bcast["algo"] == "tree (rails: binary tree)" and bcast["steps"] <= 2 * 12 + 4, bcast
    assert bcast["net_peers"] <= 2 * 2 + 4, bcast
    # RDMA verbs pin rings only for the peers a rank's ops meet (queue pairs made at first use).
    from railcc.sim import parse_args, simulate_job

    job = simulate_job(n, parse_args(["-n", str(n), "--per-host", str(per_host)]))
    assert job["setup"]["verbs_pinned_if_lazy"] <= 256 << 20, job["setup"]
    for op, nbytes in (("reduce_scatter", (256 << 20) // n), ("all_gather", (256 << 20) // n), ("broadcast", 256 << 20)):
        assert rules.simulate(n, per_host, op, nbytes, 4)["net_peers"] <= 2, op


def test_simulation_refuses_what_it_cannot_model():
    rules = railcc._C.rules
    with pytest.raises(Exception, match="whole hosts"):
        rules.simulate(10, 4, "all_reduce", 8, 4)
    with pytest.raises(Exception, match="unknown op"):
        rules.simulate(8, 1, "all_to_all", 8, 4)
    with pytest.raises(Exception, match="not simulated"):
        rules.simulate(8, 8, "all_reduce", 1 << 20, 4)


def test_the_sim_command_prints_tables_and_refuses_bad_input():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "railcc", "sim", "-n", "64", "--per-host", "8", "--ops", "all_reduce",
                          "--sizes", "8,256M"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "## 64 ranks, 8 per host (8 hosts)" in out.stdout
    assert "| all_reduce | 256 MiB | hier (rails: pairwise) |" in out.stdout, out.stdout
    assert "store keys in 5 reads" in out.stdout, out.stdout  # no ready marks: names go on the watchdog
    one_host = subprocess.run([sys.executable, "-m", "railcc", "sim", "-n", "8", "--per-host", "8", "--ops", "all_reduce",
                               "--sizes", "8,1M"], capture_output=True, text=True, timeout=60)
    assert one_host.returncode == 0, one_host.stderr
    assert "| all_reduce | 8 B | oneshot |" in one_host.stdout, one_host.stdout
    assert "| all_reduce | 1 MiB | railcc sim: all_reduce by rings is not simulated" in one_host.stdout, one_host.stdout
    bad = subprocess.run([sys.executable, "-m", "railcc", "sim", "-n", "60", "--per-host", "8"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "whole hosts" in bad.stderr, bad.stderr
