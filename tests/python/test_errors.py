"""Bad input, mismatched calls, strangers and dead peers: clear errors, never a hang."""

import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

import harness


def _catch(fn):
    try:
        fn()
    except Exception as e:  # the test inspects what was raised
        return type(e).__name__, str(e)
    return None


def rk_bad_arguments(rank, n):
    got = {}
    got["list_len"] = _catch(lambda: dist.all_gather([torch.empty(2)] * (n + 1), torch.ones(2)))
    got["size"] = _catch(lambda: dist.all_gather_into_tensor(torch.empty(3 * n + 1), torch.ones(3)))
    # an input that shares bytes with a piece of the output other than exactly its own
    out = torch.zeros(3 * n)
    got["overlap_next"] = _catch(lambda: dist.all_gather_into_tensor(out, out[1:4]))
    got["overlap_other"] = _catch(lambda: dist.all_gather_into_tensor(out, out[3 * ((rank + 1) % n):][:3]))
    got["overlap_list"] = _catch(lambda: dist.all_gather([out[3 * i:3 * i + 3] for i in range(n)], out[1:4]))
    got["noncontig"] = _catch(lambda: dist.all_reduce(torch.ones(4, 4).t()))
    got["avg_int"] = _catch(lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG))
    got["bxor_float"] = _catch(lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BXOR))
    got["dtype"] = _catch(lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint16)))
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    opts = dist.BroadcastOptions()
    opts.rootRank = n + 3
    got["root"] = _catch(lambda: be.broadcast([torch.ones(1)], opts))
    # the group is still usable after all of these
    t = torch.ones(2)
    dist.all_reduce(t)
    got["after"] = t.tolist()
    return got


def test_bad_arguments_raise_value_errors_naming_the_problem(pools):
    n = 2
    for got in pools(n).run(rk_bad_arguments):
        assert got["after"] == [float(n)] * 2
        for key, needle in (("list_len", "output list"), ("size", "elements"), ("noncontig", "contiguous"),
                            ("overlap_next", "overlaps"), ("overlap_other", "overlaps"), ("overlap_list", "overlaps"),
                            ("avg_int", "AVG"), ("bxor_float", "BXOR"), ("dtype", "dtype"), ("root", "root")):
            assert got[key] is not None, key
            assert got[key][0] in ("ValueError", "RuntimeError"), (key, got[key])
            assert needle in got[key][1], (key, got[key][1])


def rk_mismatch(rank, n):
    import railcc

    t = torch.ones(8)
    start = time.monotonic()
    try:
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
    except railcc.CollectiveMismatchError as e:
        return {"type": type(e).__name__, "msg": str(e), "ranks": list(e.ranks),
                "is_dist": isinstance(e, dist.DistBackendError), "secs": time.monotonic() - start}
    return {"type": None}


def test_mismatched_collectives_fail_on_every_rank_with_both_calls():
    pool = harness.RankPool(2)
    try:
        got = pool.run(rk_mismatch, timeout=60)
    finally:
        pool.kill()
    for g in got:
        assert g["type"] == "CollectiveMismatchError", g
        assert g["is_dist"]
        assert "allreduce" in g["msg"] and "broadcast" in g["msg"], g["msg"]
        assert sorted(g["ranks"]) in ([0, 1], [0], [1])
        assert g["secs"] < 10, g  # promised well under a second; generous for a loaded CI box


def rk_broadcast_disagreement(rank, n, case):
    import railcc

    t = torch.ones(1 << 18)  # 1 MiB: the broadcast ring (headers checked after the data, or first by the root)
    start = time.monotonic()
    try:
        if case == "root":  # two ranks each believe they are the root
            dist.broadcast(t, src=rank % 2)
        elif case == "count":
            dist.broadcast(t if rank != n - 1 else torch.ones((1 << 18) + 1), src=0)
        elif case == "small_root":  # the root's count takes the FIFO chain, the others' the ring
            dist.broadcast(torch.ones(16) if rank == 0 else t, src=0)
        else:  # one rank calls another collective
            if rank == n - 1:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        # A rank whose own part went through (the root of a FIFO chain) fails at its next call,
        # which here comes late: the others must not wait for it to find out.
        if case == "small_root":
            time.sleep(12)
        dist.barrier()
    except (railcc.CollectiveMismatchError, railcc.PeerFailureError) as e:
        return {"type": type(e).__name__, "msg": str(e), "secs": time.monotonic() - start}
    return {"type": None, "value": t[0].item()}


@pytest.mark.parametrize("ring", ["fits", "smaller", "tree", "rails"])
@pytest.mark.parametrize("case", ["root", "count", "op", "small_root"])
def test_broadcast_disagreements_fail_on_every_rank(case, ring):
    # A broadcast that fits the ring is written before anyone's header is checked; one larger
    # than the ring (256 KiB here) has the root check every header first. The tree (the small
    # broadcast across hosts, forced here) has the root wait for every subtree's acknowledgement;
    # so does the chain along rails (two fake hosts of two ranks).
    n = 4
    env = {"smaller": {"RAILCC_BUFFSIZE": str(256 << 10)}, "tree": {"RAILCC_ALGO": "tree"}}.get(ring)
    rank_env = (lambda r: {"RAILCC_HOST_ID": f"h{r // 2}"}) if ring == "rails" else None
    pool = harness.RankPool(n, env=env, rank_env=rank_env)
    try:
        got = pool.run(rk_broadcast_disagreement, case, timeout=60)
    finally:
        pool.kill()
    for r, g in enumerate(got):
        assert g["type"] in ("CollectiveMismatchError", "PeerFailureError"), g
        if not (case == "small_root" and r == 0):  # that root's own call succeeded
            assert g["secs"] < 10, g
    assert any(g["type"] == "CollectiveMismatchError" for g in got), got


def _every_rank_fails_fast(pool, fn, case, timeout):
    """Runs a disagreement on every rank: each must raise within 10 s, one naming the mismatch."""
    try:
        got = pool.run(fn, case, timeout=timeout)
    finally:
        pool.kill()
    for g in got:
        assert g["type"] in ("CollectiveMismatchError", "PeerFailureError"), g
        assert g["secs"] < 10, g
    assert any(g["type"] == "CollectiveMismatchError" for g in got), got


@pytest.mark.parametrize("case", ["root", "count"])
def test_tree_broadcast_disagreements_at_16_ranks_fail_on_every_rank(case):
    # 16 ranks on 8 fake hosts: the broadcast tree along rails, where each rank builds its tree
    # from the root it was given, so a rank may wait on a parent that never sends to it; the
    # failures of the ranks that saw the mismatch must still reach every rank within seconds.
    pool = harness.RankPool(16, env={"RAILCC_ALGO": "tree"}, rank_env=lambda r: {"RAILCC_HOST_ID": f"h{r // 2}"})
    _every_rank_fails_fast(pool, rk_broadcast_disagreement, case, timeout=90)


def rk_allreduce_disagreement(rank, n, case):
    import railcc

    t = torch.ones(1 << 18)  # 1 MiB: the two-shot all-reduce through the rings
    start = time.monotonic()
    odd = rank == n - 1
    try:
        if case == "count":
            dist.all_reduce(torch.ones((1 << 18) + 64) if odd else t)
        elif case == "redop":
            dist.all_reduce(t, op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM)
        elif case == "small":  # the odd rank's call is one-shot, the others' go through the rings
            dist.all_reduce(torch.ones(16) if odd else t)
        elif case == "reduce_scatter":  # both through the rings, with different block layouts
            if odd:
                dist.reduce_scatter_tensor(torch.empty(1 << 16), torch.ones(n << 16))
            else:
                dist.all_reduce(t)
        else:  # the odd rank gathers through the same rings
            if odd:
                dist.all_gather_into_tensor(torch.empty(n << 16), torch.ones(1 << 16))
            else:
                dist.all_reduce(t)
        dist.barrier()
    except (railcc.CollectiveMismatchError, railcc.PeerFailureError) as e:
        return {"type": type(e).__name__, "msg": str(e), "secs": time.monotonic() - start}
    return {"type": None, "value": t[0].item()}


@pytest.mark.parametrize("case", ["count", "redop", "small", "allgather", "reduce_scatter"])
def test_allreduce_disagreements_fail_on_every_rank(case):
    n = 4
    pool = harness.RankPool(n)
    _every_rank_fails_fast(pool, rk_allreduce_disagreement, case, timeout=60)


def rk_listen_address(rank, n):
    return dist.group.WORLD._get_backend(torch.device("cpu")).listen_address()


def rk_allreduce_check(rank, n):
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    return t[0].item() == n * (n + 1) / 2 and bool((t == t[0]).all())


@pytest.mark.parametrize("runtime_connect", ["1", "0"])
def test_stranger_on_the_port_of_a_group(pools, runtime_connect):
    # The listener stays for the group's life (connections at first use; with
    # RAILCC_RUNTIME_CONNECT=0 those its collectives do not meet). A stranger that connects and
    # sends junk, or says nothing, is dropped by the handshake; the group's own connections
    # (made after it knocked, or before) work, and so does the group.
    pool = pools(2, RAILCC_SHM_DISABLE="1", RAILCC_SOCKET_IFNAME="lo", RAILCC_RUNTIME_CONNECT=runtime_connect)
    addrs = pool.run(rk_listen_address)
    assert addrs[0] != "-", addrs  # every rank listens: those it dials knock on it while they wait
    host, port = addrs[1].rsplit(":", 1)
    quiet = socket.create_connection((host, int(port)), timeout=5)
    noisy = socket.create_connection((host, int(port)), timeout=5)
    noisy.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 64)
    try:
        assert pool.run(rk_allreduce_check) == [True, True]
        assert pool.run(rk_allreduce_check) == [True, True]
    finally:
        quiet.close()
        noisy.close()


def rk_peer_dies(rank, n):
    import railcc

    victim = n - 1
    dist.barrier()
    if rank == victim:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1 << 20)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except railcc.PeerFailureError as e:
        detect = time.monotonic() - start - 0.5
        t0 = time.monotonic()
        dist.destroy_process_group()
        return {"ok": True, "ranks": list(e.ranks), "hosts": list(e.hosts), "msg": str(e),
                "detect": detect, "destroy": time.monotonic() - t0}
    except Exception as e:
        return {"ok": False, "msg": f"{type(e).__name__}: {e}"}
    return {"ok": False, "msg": "no error"}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_peer_is_named_within_seconds(transport):
    env = {"RAILCC_SHM_DISABLE": "1"} if transport == "tcp" else {}
    n = 3
    pool = harness.RankPool(n, env=env)
    try:
        got = pool.run_raw(rk_peer_dies, timeout=60, allow_dead=(n - 1,))
    finally:
        pool.kill()
    for r in range(n - 1):
        status, g = got[r]
        assert status == "ok" and g["ok"], (r, got[r])
        assert g["ranks"] == [n - 1], g
        assert f"rank {n - 1}" in g["msg"], g["msg"]
        assert g["detect"] < 10, g  # promise: 2 s; a wide margin for a loaded machine
        assert g["destroy"] < 10, g
        print(f"\nmeasured ({transport}): rank {r} named the dead rank after {g['detect']:.2f} s, "
              f"destroy took {g['destroy'] * 1000:.1f} ms")


def rk_dies_before_anyone_connected(rank, n):
    # Connections are made at first use (the default): rank 1 dies before any pair of it was
    # ever connected. Rank 0 then sends to it (rank 0 dials: its connect is refused), ranks 2
    # and 3 receive from it (they wait for rank 1 to dial, and knock on its listener).
    import railcc

    harness.store_barrier("unconnected-death", n)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    t = torch.ones(1000)
    start = time.monotonic()
    try:
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 1)
    except railcc.PeerFailureError as e:
        return {"ok": True, "ranks": list(e.ranks), "msg": str(e), "detect": time.monotonic() - start}
    except Exception as e:
        return {"ok": False, "msg": f"{type(e).__name__}: {e}"}
    return {"ok": False, "msg": "no error"}


def test_peer_dead_before_its_pair_ever_connected_is_named_within_seconds():
    pool = harness.RankPool(4, env={"RAILCC_SHM_DISABLE": "1"})
    try:
        got = pool.run_raw(rk_dies_before_anyone_connected, timeout=60, allow_dead=(1,))
    finally:
        pool.kill()
    for r in (0, 2, 3):
        status, g = got[r]
        assert status == "ok" and g["ok"], (r, got[r])
        assert g["ranks"] == [1], g
        assert "rank 1 " in g["msg"] and "connect" in g["msg"], g["msg"]
        assert g["detect"] < 10, g  # promise: 0.5 s of refusals either way; margin for a loaded machine
        print(f"\nmeasured: rank {r} named the dead rank after {g['detect']:.2f} s: {g['msg'][:200]}")


def rk_death_seen_in_another_group(rank, n):
    # Rank 1 dies inside an op of the subgroup [1, 2]. Rank 2 raises there and stops, as a
    # training script would; rank 0 meanwhile waits in a world broadcast from rank 1, which
    # reaches it through rank 2 only. It never talks to rank 1 in that op, so it learns of the
    # death from rank 2's world group, which the subgroup's failure must fail too.
    import railcc

    sub = dist.new_group([1, 2])
    dist.barrier()
    big = torch.zeros(1 << 18)
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if rank == 2:
            dist.all_reduce(big, group=sub)
        else:
            dist.broadcast(big, src=1)
    except railcc.PeerFailureError as e:
        return {"ok": True, "ranks": list(e.ranks), "msg": str(e), "detect": time.monotonic() - start - 0.5}
    except Exception as e:
        return {"ok": False, "msg": f"{type(e).__name__}: {e}"}
    return {"ok": False, "msg": "no error"}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_death_found_in_one_group_fails_the_rank_s_other_groups(transport):
    env = {"RAILCC_SHM_DISABLE": "1", "RAILCC_ALGO": "chain"} if transport == "tcp" else {"RAILCC_ALGO": "chain"}
    pool = harness.RankPool(3, env=env)
    try:
        got = pool.run_raw(rk_death_seen_in_another_group, timeout=60, allow_dead=(1,))
    finally:
        pool.kill()
    for r in (0, 2):
        status, g = got[r]
        assert status == "ok" and g["ok"], (r, got[r])
        assert g["ranks"] == [1], g
        assert "rank 1 " in g["msg"], g["msg"]
        assert g["detect"] < 10, g  # promise: 2 s; a wide margin for a loaded machine
        print(f"\nmeasured ({transport}): rank {r} named the dead rank after {g['detect']:.2f} s: {g['msg'][:160]}")


def test_the_configuration_doc_table_matches_the_parameter_table():
    import subprocess
    import sys

    table = subprocess.run([sys.executable, "-m", "railcc", "env", "--markdown"], check=True, capture_output=True,
                           text=True, timeout=60).stdout.strip()
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configuration.md")).read()
    assert table in doc, "docs/configuration.md's table is stale: regenerate with python -m railcc env --markdown"


def test_shared_memory_too_small_fails_init_with_a_message():
    # 64 GiB FIFOs cannot fit in /dev/shm here: init must say so, not crash with SIGBUS later.
    with pytest.raises(harness.TaskError) as info:
        harness.RankPool(2, env={"RAILCC_BUFFSIZE": str(64 << 30)}, init_timeout=60)
    assert "/dev/shm large enough" in str(info.value), str(info.value)[-2000:]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"railcc-{os.getuid()}-")], "segment left behind"


@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_shared_memory_filled_after_init_is_an_error_not_a_sigbus(op):
    # FIFO and broadcast ring pages are reserved by their writer at first use (not all at init):
    # a /dev/shm that another process fills in the meantime must fail the op with a message on
    # every rank.
    # A tmpfs of its own on /dev/shm, in a mount namespace, so nothing else on the machine fills.
    import json
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private /dev/shm")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m none /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no private /dev/shm here: {probe.stderr.strip()[:200]}")
    worker = os.path.join(os.path.dirname(__file__), "shm_full_worker.py")
    # 2 ranks' segments (4 FIFOs of 4 MiB and a 4 MiB ring each) fit in 48 MiB, empty; the
    # broadcast's 3 ranks' (6 FIFOs and a ring each) in 96 MiB.
    size, arg = ("48m", "") if op == "all_reduce" else ("96m", "broadcast")
    got = subprocess.run(["unshare", "-m", "sh", "-c",
                          f"mount -t tmpfs -o size={size} none /dev/shm && exec {sys.executable} {worker} --launch {arg}"],
                         capture_output=True, text=True, timeout=100)
    line = next((ln for ln in got.stdout.splitlines() if ln.startswith("LAUNCH ")), None)
    assert line is not None, (got.stdout[-3000:], got.stderr[-3000:])
    res = json.loads(line[len("LAUNCH "):])
    for r, (code, out) in enumerate(zip(res["codes"], res["outs"])):
        assert code == 0, f"rank {r} exited with {code} (-7: SIGBUS):\n{out[-3000:]}"
        result = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), "")
        assert result.startswith("RESULT error"), f"rank {r}: {result or out[-3000:]}"
    assert "FILLED" in res["outs"][0], res["outs"][0][-2000:]
    assert any("/dev/shm is full: no room for the next" in out for out in res["outs"]), [o[-1500:] for o in res["outs"]]
    if op == "broadcast":
        assert "broadcast ring" in res["outs"][0], res["outs"][0][-1500:]
