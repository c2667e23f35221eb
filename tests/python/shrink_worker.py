"""One rank of tests/python/test_shrink.py (env:// from the test: MASTER_ADDR/PORT, RANK,
WORLD_SIZE). Modes:

  bad        every rank: shrink_group with an empty list, a rank out of range, itself, every
             rank, a bad flag: each refused with an error naming it, the group still usable.
  healthy    rank n-2 is excluded (it only waits and exits); the others shrink, check the new
             group's ranks and an all_reduce against torch, then shrink out the last rank by its
             new group rank (torch's bookkeeping of a shrunk default group's ranks is checked).
  disagree   ranks 0 and 1 exclude the last rank, rank 2 excludes rank 1 and the last: every
             survivor's shrink fails naming both views.
  subgroup   4 ranks; g = [1, 2, 3], h = [0, 1]; rank 3 is SIGKILLed. g's next all_reduce fails
             saying how to shrink; ranks 1 and 2 shrink g (not the default group) and all_reduce
             on the result; h, which never held rank 3, keeps working.
  excluded   3 ranks; ranks 0 and 1 shrink rank 2 out (alive, not dead), with SHRINK_ABORT when a
             second argument says "abort"; rank 2 then calls an all_reduce on the group it still
             holds: a railcc error naming the shrink, not a hang.
  wait       3 ranks; rank 2 is SIGKILLed while ranks 0 and 1 have an all_reduce outstanding
             that nobody waits on; shrink_group without SHRINK_ABORT waits for it to fail (the
             watchdog), then builds the new group.
  late       3 ranks, a 4 s group timeout; rank 2 is SIGKILLed; rank 1 calls shrink_group 5.5 s
             after rank 0, whose shrink fails naming it and is retried at once: both meet in the
             retry and all_reduce on the result.
  drain      3 ranks, a 4 s group timeout; rank 2 is left out alive; rank 0 has an all_reduce
             outstanding (60 s op timeout) that nobody else joins, so its SHRINK_DEFAULT cannot
             drain and fails; its retry with SHRINK_ABORT meets rank 1, still in its first call
             (made 2 s after rank 0's).
  apart      4 ranks, a 20 s group timeout; ranks 2 and 3 only wait; rank 0 excludes rank 3 and
             rank 1 excludes rank 2: views that share no rank, each waiting for a rank the other
             left out. Both fail at once naming the other's view, not after the timeout.
  second     4 ranks; rank 3 is SIGKILLed; rank 2 publishes a view that agrees with ranks 0 and 1,
             then is SIGKILLed before the new group's set-up: ranks 0 and 1 are told within
             seconds (not RAILCC_INIT_TIMEOUT), railcc.failed_ranks() names both dead ranks, and
             a shrink without them succeeds.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import railcc

mode = sys.argv[1]
if mode in ("late", "drain", "second", "apart", "disagree"):
    # A group timeout the test can wait out: a rank later than the others to a shrink that
    # failed over views waits a whole one for them in the next attempt ("disagree").
    secs = {"apart": 20, "disagree": 10}.get(mode, 4)
    dist.init_process_group("railcc", timeout=__import__("datetime").timedelta(seconds=secs))
else:
    dist.init_process_group("railcc")
me, n = dist.get_rank(), dist.get_world_size()
c10d = dist.distributed_c10d


def check_sum(tag):
    t = torch.full((1000,), float(me + 1))
    dist.all_reduce(t)
    members = c10d.get_process_group_ranks(c10d._get_default_group())
    want = float(sum(r + 1 for r in members))
    assert torch.all(t == want), (tag, t[:3], want)


def leave(stayers, destroy=False):
    """Says ok and exits; rank 0 hosts the store, so it leaves only once the other `stayers`
    have read what they need from it."""
    print(f"rank {me} ok", flush=True)
    store = c10d._get_default_store()
    store.set(f"left/{me}", "1")
    if me == 0:
        store.wait([f"left/{r}" for r in stayers], __import__("datetime").timedelta(seconds=60))
    if destroy:
        dist.destroy_process_group()
    os._exit(0)


def refused(ranks, flags, exc, words):
    try:
        dist.shrink_group(ranks, shrink_flags=flags)
    except exc as e:
        assert all(w in str(e) for w in words), (ranks, str(e))
        return
    raise AssertionError(f"shrink_group({ranks}) was accepted")


if mode == "bad":
    assert railcc.failed_ranks() == []
    refused([], 0, ValueError, ["empty"])
    refused([n], 0, ValueError, ["out of bounds"])
    refused([me], 0, RuntimeError, ["exclusion list"])
    refused(list(range(n)), 0, (ValueError, RuntimeError), [])
    refused([0 if me else 1], 7, ValueError, ["shrink_flags"])
    # The backend's own checks, for callers that reach it directly.
    b = railcc.backend_of()
    for bad, words in (([], "empty"), ([n], "out of range"), ([me], "this rank"), ([1, 1], "twice")):
        try:
            b.shrink(bad, 0, None)
            raise AssertionError(f"backend shrink({bad}) was accepted")
        except (ValueError, RuntimeError) as e:
            assert words in str(e), (bad, str(e))
    # A destroyed group: refused by railcc before torch's own bookkeeping trips on it.
    g = dist.new_group(list(range(n)))
    dist.destroy_process_group(g)
    try:
        dist.shrink_group([0 if me else 1], group=g)
        raise AssertionError("shrinking a destroyed group was accepted")
    except RuntimeError as e:
        assert "is not a live process group" in str(e), str(e)
    check_sum("after the refused shrinks")
elif mode == "healthy":
    first = n - 2  # not the last rank: the shrunk group's ranks are then not its global ranks
    if me == first:
        time.sleep(3)  # excluded: takes no part; its group is left as it is
        os._exit(0)
    dist.shrink_group([first])
    want_rank = me if me < first else me - 1
    assert dist.get_world_size() == n - 1 and dist.get_rank() == want_rank, (dist.get_rank(), dist.get_world_size())
    # The shrunk group serves CUDA tensors too, as the parent did (torch registers one device).
    pg = c10d._get_default_group()
    assert pg._get_backend(torch.device("cuda")) is pg._get_backend(torch.device("cpu")) is railcc.backend_of()
    check_sum("after the first shrink")
    if n - 1 > 2:
        # The last rank now, by its group rank (n - 2): torch 2.13 alone would drop global rank
        # n - 2, already gone, and keep this one (railcc's patch_torch hands it global ranks).
        if me == n - 1:
            time.sleep(2)
            os._exit(0)
        dist.shrink_group([n - 2])
        assert dist.get_world_size() == n - 2
        assert c10d.get_process_group_ranks(c10d._get_default_group()) == list(range(n - 2)), \
            c10d.get_process_group_ranks(c10d._get_default_group())
        check_sum("after the second shrink")
elif mode == "disagree":
    if me == n - 1:
        time.sleep(3)
        os._exit(0)
    mine = [1, n - 1] if me == 2 else [n - 1]
    try:
        dist.shrink_group(mine)
        raise AssertionError("shrinks that disagree were accepted")
    except RuntimeError as e:
        assert "every rank that stays must exclude the same ranks" in str(e), str(e)
        print(f"rank {me} refused: {e}", flush=True)
    leave(range(n - 1))
elif mode in ("subgroup", "wait", "excluded"):
    store = c10d._get_default_store()

    def expect_failure(fn):
        for _ in range(200):
            try:
                fn()
            except railcc.PeerFailureError as e:
                return e
            time.sleep(0.05)
        raise AssertionError("no PeerFailureError within 10 s of the kill")

    victim = n - 1
    if mode == "excluded":
        dist.all_reduce(torch.ones(4))
        if me == victim:
            store.wait(["shrunk/0", "shrunk/1"])
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(4))
                raise AssertionError("an all_reduce of a rank shrunk out of the group succeeded")
            except railcc.RailccError as e:
                print(f"rank {me}: {type(e).__name__} after {time.monotonic() - t0:.2f} s: {e}", flush=True)
                assert time.monotonic() - t0 < 30, "too slow"
                assert "left out ranks [2]" in str(e), str(e)
            leave([0, 1, 2])
        dist.shrink_group([victim], shrink_flags=c10d.SHRINK_ABORT if sys.argv[2:] == ["abort"] else 0)
        check_sum("after shrinking out a live rank")
        store.set(f"shrunk/{me}", "1")
        leave([0, 1, 2])
    if mode == "subgroup":
        g, h = dist.new_group([1, 2, 3]), dist.new_group([0, 1])
        if me in (1, 2, 3):
            dist.all_reduce(torch.ones(4), group=g)
        if me in (0, 1):
            dist.all_reduce(torch.ones(4), group=h)
        store.set(f"warm/{me}", "1")
        store.wait([f"warm/{r}" for r in range(n)])
        if me == victim:
            os.kill(os.getpid(), __import__("signal").SIGKILL)
        if me in (1, 2):
            e = expect_failure(lambda: dist.all_reduce(torch.ones(4), group=g))
            assert "rank 3" in str(e) and "shrink_group(railcc.failed_ranks(group, group_ranks=True)" in str(e), str(e)
            assert railcc.failed_ranks(g) == [3] and railcc.failed_ranks(g, group_ranks=True) == [2], \
                (railcc.failed_ranks(g), railcc.failed_ranks(g, group_ranks=True))
            g2 = dist.shrink_group(railcc.failed_ranks(g, group_ranks=True), group=g,
                                   shrink_flags=c10d.SHRINK_ABORT)
            assert c10d.get_process_group_ranks(g2) == [1, 2], c10d.get_process_group_ranks(g2)
            t = torch.full((1000,), float(me + 1))
            dist.all_reduce(t, group=g2)
            assert torch.all(t == 5.0), t[:3]
        if me in (0, 1):
            t = torch.full((1000,), float(me + 1))
            dist.all_reduce(t, group=h)
            assert torch.all(t == 3.0), t[:3]
        leave([0, 1, 2])
    else:  # wait
        dist.all_reduce(torch.ones(4))
        if me == victim:
            time.sleep(0.5)  # the others' all_reduce is queued and waiting on this rank
            os.kill(os.getpid(), __import__("signal").SIGKILL)
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
        t0 = time.monotonic()
        dist.shrink_group([victim])  # SHRINK_DEFAULT: waits for `work` to end
        took = time.monotonic() - t0
        assert work.is_completed(), "shrink_group returned with the parent's all_reduce still pending"
        try:
            work.wait()
            raise AssertionError("the parent's all_reduce succeeded without the dead rank")
        except railcc.PeerFailureError:
            pass
        print(f"rank {me}: shrink waited {took:.2f} s for the outstanding all_reduce to fail", flush=True)
        check_sum("after the shrink that waited")
        leave([0, 1])
elif mode == "apart":
    if me >= 2:  # done with the store (init's last read) before rank 0, its host, may leave
        c10d._get_default_store().set(f"left/{me}", "1")
        time.sleep(8)
        os._exit(0)
    t0 = time.monotonic()
    try:
        dist.shrink_group([3 - me])
        raise AssertionError("shrinks that share no view were accepted")
    except RuntimeError as e:
        took = time.monotonic() - t0
        assert f"rank {me} excludes [{3 - me}] but rank {1 - me} excludes [{2 + me}]" in str(e), str(e)
        assert took < 8, took
        print(f"rank {me} refused in {took:.1f} s: {e}", flush=True)
    leave([0, 1, 2, 3])
elif mode in ("late", "drain", "second"):
    store = c10d._get_default_store()
    dist.all_reduce(torch.ones(4))
    victim = n - 1
    if mode == "drain":
        if me == victim:  # left out alive: it takes no part and leaves once the others are done
            store.wait(["shrunk/0", "shrunk/1"], __import__("datetime").timedelta(seconds=60))
            os._exit(0)
        if me == 0:
            opts = dist.AllreduceOptions()
            opts.timeout = __import__("datetime").timedelta(seconds=60)
            pending = railcc.backend_of().allreduce([torch.ones(8)], opts)  # nobody else joins it
            t0 = time.monotonic()
            try:
                dist.shrink_group([victim])
                raise AssertionError("a shrink with an op that cannot drain succeeded")
            except RuntimeError as e:
                assert "did not finish within its timeout" in str(e), str(e)
                print(f"rank 0: first shrink failed after {time.monotonic() - t0:.1f} s: {e}", flush=True)
            dist.shrink_group([victim], shrink_flags=c10d.SHRINK_ABORT)
            print(f"rank 0: retry done {time.monotonic() - t0:.1f} s after the first call", flush=True)
        else:
            # Two seconds after rank 0's first call: its agreement wait (the 4 s group timeout)
            # then spans rank 0's retry (due once the drain has failed, 4 s after its first
            # call) with two seconds to spare either way, on a busy machine too.
            time.sleep(2.0)
            dist.shrink_group([victim])
    else:
        if me == victim:
            os.kill(os.getpid(), __import__("signal").SIGKILL)
        try:  # wait until this rank has seen the death
            while True:
                dist.all_reduce(torch.ones(4))
                time.sleep(0.05)
        except railcc.PeerFailureError:
            pass
        if mode == "late":
            t0 = time.monotonic()
            if me == 1:
                time.sleep(5.5)  # past rank 0's group timeout (4 s), inside its retry's
                dist.shrink_group([victim], shrink_flags=c10d.SHRINK_ABORT)
            else:
                try:
                    dist.shrink_group([victim], shrink_flags=c10d.SHRINK_ABORT)
                    raise AssertionError("a shrink whose peer never came succeeded")
                except RuntimeError as e:
                    assert "did not join the shrink" in str(e) and "[1]" in str(e), str(e)
                    print(f"rank 0: first shrink failed after {time.monotonic() - t0:.1f} s: {e}", flush=True)
                dist.shrink_group([victim], shrink_flags=c10d.SHRINK_ABORT)
                print(f"rank 0: retry done {time.monotonic() - t0:.1f} s after the first call", flush=True)
        else:  # second: rank 2 agrees, then dies before the new group is set up
            name = railcc.backend_of()._group_name()
            if me == 2:
                shrink = dist.PrefixStore(f"railcc-shrink/{name}/", railcc.backend_of()._c10d_store())
                shrink.set("1/view/2", "[3]")
                os.kill(os.getpid(), __import__("signal").SIGKILL)
            t0 = time.monotonic()
            try:
                dist.shrink_group([victim], shrink_flags=c10d.SHRINK_ABORT)
                raise AssertionError("a shrink whose agreeing rank died built a group")
            except railcc.PeerFailureError as e:
                took = time.monotonic() - t0
                assert "rank 2" in str(e) and took < 30, (took, str(e))
                print(f"rank {me}: told of rank 2's death in {took:.1f} s: {e}", flush=True)
            assert railcc.failed_ranks() == [2, 3], railcc.failed_ranks()
            dist.shrink_group(railcc.failed_ranks(), shrink_flags=c10d.SHRINK_ABORT)
    check_sum(f"after the {mode} shrink")
    store = c10d._get_default_store()
    store.set(f"shrunk/{me}", "1")
    leave([0, 1])
leave(c10d.get_process_group_ranks(c10d._get_default_group()), destroy=True)
