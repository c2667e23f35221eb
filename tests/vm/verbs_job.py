"""Runs inside the Soft-RoCE VM (test_vm_verbs.py): real torch process groups whose ranks
pretend to be on different hosts (RAILCC_HOST_ID), so every byte between them crosses an rxe
queue pair. torch is imported once and the ranks are forked from it: under emulation an
import takes about a minute and a half.

    python verbs_job.py OUT_DIR [AFTER_FILE]

With AFTER_FILE, the ranks start once that file exists (the transport's GoogleTests, run
once the host says go, whether or not this import is over, are done). Writes
OUT_DIR/<case>.json: per rank, the failures it saw (none when exact), its error, or how long
it took to raise.
"""

import json
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "data", "topo"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import railcc  # noqa: E402
import make_topologies  # noqa: E402
import test_collectives as tc  # noqa: E402

OUT = sys.argv[1]
while len(sys.argv) > 2 and not os.path.exists(sys.argv[2]):  # the VM's owner ends it if this never comes
    time.sleep(0.5)
SWEEP = [tc.rk_allreduce, tc.rk_reduce, tc.rk_reduce_scatter, tc.rk_allgather, tc.rk_broadcast, tc.rk_gather_scatter,
         tc.rk_alltoall, tc.rk_p2p, tc.rk_barrier_and_zero, tc.rk_coalesced, tc.rk_allreduce_large]


def sweep(rank, n):
    bad = []
    for fn in SWEEP:
        bad += [f"{fn.__name__}: {b}" for b in fn(rank, n)]
    return {"bad": bad}


def killed_peer(rank, n):
    t = torch.ones(1 << 20)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        return {"raised": None}
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e)[:3000], "seconds": time.monotonic() - t0}


def never_met(rank, n):
    """Ranks 0 and 1 connect to each other only (a send/recv); rank 2 is SIGKILLed right after
    init, before any pair with it was made, so no queue pair of its breaks. The all_reduce of
    ranks 0 and 1 that needs it fails naming it (its progress record stopped changing)."""
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1000)
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    transports = railcc.backend_of().peer_transports()
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        return {"raised": None}
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e)[:3000], "seconds": time.monotonic() - t0,
                "transports": transports}


def shrunk_after_kill(rank, n):
    """The last rank is SIGKILLed; the others catch the error, shrink the default group without
    it and all_reduce over verbs on the result (issue 33)."""
    t = torch.ones(1 << 16)
    for _ in range(3):
        dist.all_reduce(t)
    store = dist.distributed_c10d._get_default_store()
    if rank == n - 1:
        store.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        raised = type(e).__name__
    for _ in range(100):
        dead = railcc.failed_ranks()
        if dead:
            break
        time.sleep(0.05)
    dist.shrink_group(dead, shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    took = time.time() - float(store.get("killed_at").decode())
    return {"raised": raised, "dead": dead, "size": dist.get_world_size(), "sum_ok": bool(torch.all(x == 3.0)),
            "transports": railcc.backend_of().peer_transports(), "seconds": took}


def zero_copy(rank, n):
    """Rendezvous over verbs (issue 34): each op at 4 and 40 MiB twice on the same tensors (the
    second finds their registrations cached), the second's transport counters recorded; 40 MiB
    is 20 MiB on each of a pair's two channels, read in more than one 16 MiB piece (every MiB
    costs seconds under emulation, so no more than that). Then buffers freed and allocated
    again (at the same address where the allocator hands it back) and all-gathered, which must
    carry the new bytes."""
    out = {"ops": {}, "bad": [], "addrs": []}
    peer = 1 - rank

    def val(r, count, salt=0):
        return torch.arange(count, dtype=torch.float32) * (r + 2) + salt

    for mib in (4, 40):
        count = mib << 18
        mine = val(rank, count)
        cases = {}
        bc = mine.clone() if rank == 0 else torch.empty(count)
        cases["broadcast"] = (lambda: dist.broadcast(bc, 0), lambda: torch.equal(bc, val(0, count)))
        ag = torch.empty(n * count)
        cases["all_gather"] = (lambda: dist.all_gather_into_tensor(ag, mine),
                               lambda: torch.equal(ag, torch.cat([val(r, count) for r in range(n)])))
        a2a = torch.empty(count)
        cases["all_to_all"] = (lambda: dist.all_to_all_single(a2a, mine),
                               lambda: torch.equal(a2a, torch.cat([val(r, count)[rank * count // n:(rank + 1) * count // n]
                                                                   for r in range(n)])))
        got = torch.empty(count)

        def sendrecv():
            for src in (0, 1):
                if rank == src:
                    dist.send(mine, peer)
                else:
                    dist.recv(got, src)
        cases["send_recv"] = (sendrecv, lambda: torch.equal(got, val(peer, count)))
        ar = torch.empty(count)

        def allreduce():
            ar.copy_(mine)
            dist.all_reduce(ar)
        cases["all_reduce"] = (allreduce, lambda: torch.equal(ar, sum(val(r, count) for r in range(n))))
        for name, (fn, ok) in cases.items():
            fn()
            dist.barrier()
            railcc.reset_stats()
            fn()
            st = railcc.stats()["verbs"]
            dist.barrier()
            out["ops"][f"{name}_{mib}MiB"] = st
            if not ok():
                out["bad"].append(f"{name} {mib} MiB")
    # Freed and allocated again: a registration of the old buffer must not serve the new one.
    count = 1 << 20
    for i in range(4):
        railcc.reset_stats()
        t = torch.full((count,), float(10 * i + rank))
        ag = torch.empty(n * count)
        out["addrs"].append([t.data_ptr(), ag.data_ptr()])
        dist.all_gather_into_tensor(ag, t)
        if not torch.equal(ag, torch.cat([torch.full((count,), float(10 * i + r)) for r in range(n)])):
            out["bad"].append(f"reused buffers, round {i}")
        out.setdefault("reuse_stats", []).append(railcc.stats()["verbs"])
        del t, ag
    # A storage resized to nothing and back (FSDP frees its padded parameters so): its memory may
    # come back at the same address with new pages, which reads and writes must reach.
    t, ag = torch.empty(count), torch.empty(n * count)
    out["resize_addrs"] = []
    for i in range(3):
        t.fill_(100.0 * i + rank)
        dist.all_gather_into_tensor(ag, t)
        if not torch.equal(ag, torch.cat([torch.full((count,), 100.0 * i + r) for r in range(n)])):
            out["bad"].append(f"resized storages, round {i}")
        for x, nbytes in ((t, count * 4), (ag, n * count * 4)):
            x.untyped_storage().resize_(0)
            x.untyped_storage().resize_(nbytes)
        out["resize_addrs"].append([t.data_ptr(), ag.data_ptr()])
    # Tensors from railcc's own allocator (backend.allocate_tensor): registered at their first
    # message, found in the cache after.
    b = railcc.backend_of()
    t = b.allocate_tensor(count, dtype=torch.float32, device=torch.device("cpu"))
    ag = b.allocate_tensor(n * count, dtype=torch.float32, device=torch.device("cpu"))
    t.fill_(7.0 + rank)
    out["allocated"] = []
    for _ in range(2):
        railcc.reset_stats()
        dist.all_gather_into_tensor(ag, t)
        out["allocated"].append(railcc.stats()["verbs"])
    if not torch.equal(ag, torch.cat([torch.full((count,), 7.0 + r) for r in range(n)])):
        out["bad"].append("allocate_tensor buffers")
    return out


def limit_pinned_memory(rank):
    """Rank 1 loses CAP_IPC_LOCK (root in the VM pins without limit) and may pin 8 MiB: its
    connections' rings and bounce buffers fit, a 16 MiB tensor does not."""
    if rank != 1:
        return
    import ctypes
    import resource

    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Hdr(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(hdr), data) == 0
    data[0].effective &= ~(1 << 14)  # CAP_IPC_LOCK
    data[0].permitted &= ~(1 << 14)
    assert libc.capset(ctypes.byref(hdr), data) == 0, ctypes.get_errno()
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))


def refused_registration(rank, n):
    """Rank 1 cannot register its tensors (limit_pinned_memory): what it sends goes through the
    rings, what it receives by rendezvous lands in its bounce buffer; every result exact."""
    count = 4 << 20  # 16 MiB of float32
    out = {"bad": []}
    mine = torch.arange(count, dtype=torch.float32) * (rank + 1)
    got = torch.empty(count)
    railcc.reset_stats()
    for src in (0, 1):
        if rank == src:
            dist.send(mine, 1 - rank)
        else:
            dist.recv(got, src)
    if not torch.equal(got, torch.arange(count, dtype=torch.float32) * (2 - rank)):
        out["bad"].append("send/recv")
    ag = torch.empty(n * count)
    dist.all_gather_into_tensor(ag, mine)
    if not torch.equal(ag, torch.cat([torch.arange(count, dtype=torch.float32) * (r + 1) for r in range(n)])):
        out["bad"].append("all_gather")
    out["stats"] = railcc.stats()["verbs"]
    return out


def run(case, n, fn, env, timeout, pre=None):
    store = f"/tmp/store-{case}"
    if os.path.exists(store):
        os.unlink(store)
    pids = {}
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            res = {}
            try:
                os.environ.update(env)
                os.environ["RAILCC_HOST_ID"] = f"vm-host-{r}"
                if pre:
                    pre(r)
                dist.init_process_group("railcc", store=dist.FileStore(store, n), rank=r, world_size=n)
                res = fn(r, n)
                if case != "killed":
                    dist.destroy_process_group()
            except BaseException:  # noqa: BLE001
                res = {"error": traceback.format_exc()[-3000:]}
            with open(os.path.join(OUT, f"{case}-rank{r}.json"), "w") as f:
                json.dump(res, f)
            os._exit(0)
        pids[pid] = r
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.pop(pid, None)
        else:
            time.sleep(0.2)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(f"{case}: {'timed out' if pids else 'done'} in {timeout - (deadline - time.monotonic()):.1f} s", flush=True)


VERBS = {"RAILCC_NET": "verbs", "RAILCC_DEBUG": "INFO", "RAILCC_DEBUG_SUBSYS": "INIT,IB",
         "RAILCC_CHANNEL_MIN_BYTES": "65536"}
# One dtype of each element size and kind: the reductions are the engine's, not the transport's
# (every dtype is swept over shm and TCP outside the VM); each minute counts under emulation.
tc.DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.uint8, torch.int64, torch.bool]
run("n2", 2, sweep, VERBS, 400)
# Three ranks over two queue pairs each, on one dtype (the transport's GoogleTests sweep 3 ranks
# x 2 QPs too): the schedules that differ at 3 ranks, with the ring (RAILCC_ALGO) where it runs.
SWEEP = [tc.rk_allreduce, tc.rk_reduce_scatter, tc.rk_allgather, tc.rk_broadcast, tc.rk_alltoall]
tc.DTYPES = [torch.float32]
# Rendezvous: what the transport counters say about copies and registrations.
run("zero_copy", 2, zero_copy, VERBS, 300)
run("refused_registration", 2, refused_registration, dict(VERBS, RAILCC_BUFFSIZE="65536"), 200, pre=limit_pinned_memory)
# This one connects at init the pairs its collectives meet (RAILCC_RUNTIME_CONNECT=0: with 3
# ranks, all of them); the others at first use (the transport's GoogleTests run 3 ranks x 2 QPs
# at first use).
run("n3_qps2", 3, sweep, dict(VERBS, RAILCC_IB_QPS_PER_CONNECTION="2", RAILCC_ALGO="ring", RAILCC_RUNTIME_CONNECT="0"), 400)
# The same sweep with rendezvous forced off: every message through the rings.
run("n3_eager", 3, sweep, dict(VERBS, RAILCC_IB_RNDV_BYTES="0"), 400)
# Verbs and TCP both open (RAILCC_NET unset, as on an RDMA cluster by default): set-up reads no
# other host's endpoint, and each pair chooses verbs when it first meets.
SWEEP = [tc.rk_allreduce, tc.rk_allgather, tc.rk_broadcast]
run("both_nets", 3, sweep, {k: v for k, v in VERBS.items() if k != "RAILCC_NET"}, 300)
# A dead peer is found by the empty writes that probe it: 1 ms a try, 3 tries. With a topology
# that puts GPU k and rxe<k> under PCIe switch k, each rank also logs the GPUDirect decisions
# for its rail's device (the VM has no GPU: the topology file stands in for the PCI tree).
topo = "/tmp/gpu_rxe.xml"
with open(topo, "w") as f:
    f.write(make_topologies.gpu_rdma_host("railcc-vm", [("rxe0", "vrail0"), ("rxe1", "vrail1")]))
# A rank killed and the survivors shrinking the group without it (verbs between the survivors).
run("shrink", 3, shrunk_after_kill, dict(VERBS, RAILCC_IB_TIMEOUT="8", RAILCC_IB_RETRY_CNT="2"), 200)
# A rank killed before any pair with it was made (connections at first use, the default): no
# queue pair breaks; its peers learn of it from its progress record, which stops.
run("never_met", 3, never_met, VERBS, 120)
run("killed", 2, killed_peer, dict(VERBS, RAILCC_IB_TIMEOUT="8", RAILCC_IB_RETRY_CNT="2", RAILCC_TOPO_FILE=topo), 120)


# railcc doctor against the same real rxe devices (test_vm_doctor.py reads what it wrote), in
# a child of this process, which has imported torch already: a process of its own would spend
# another minute and a half importing it under emulation. NCCL_IB_GID_INDEX=0 forces rxe's
# link-local index 0, which the doctor must warn about.
def doctor():
    pid = os.fork()
    if pid == 0:
        rc = 1
        try:
            os.environ["NCCL_IB_GID_INDEX"] = "0"
            fd = os.open(os.path.join(OUT, "doctor.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            sys.stdout = os.fdopen(1, "w", closefd=False)
            from railcc.doctor import main as doctor_main
            rc = doctor_main(["--json", "--local-ranks", "2", "--world", "4"]) or 0
            sys.stdout.flush()
            # Without the variable, the doctor's reader and railcc's own rule pick an index of the
            # same real table.
            del os.environ["NCCL_IB_GID_INDEX"]
            from railcc.doctor import system, topology
            with open(os.path.join(OUT, "auto.txt"), "w") as f:
                for d in system.System("/").rdma_devices():
                    g, _ = topology.pick_gid(d.ports[0], {})
                    print(d.name, g.index, g.ipv4, file=f)
        except BaseException:  # noqa: BLE001
            with open(os.path.join(OUT, "doctor.err"), "w") as f:
                f.write(traceback.format_exc())
        with open(os.path.join(OUT, "doctor.rc"), "w") as f:
            f.write(f"{rc}\n")
        os._exit(0)
    os.waitpid(pid, 0)


doctor()
