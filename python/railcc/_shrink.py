"""Shrinking a railcc group: what torch.distributed.shrink_group asks of the backend.

The survivors form a new railcc group among themselves through the parent's c10d store, under
a prefix that names the parent group and the shrink's attempt, so nothing of the dead rank's is
waited for. Before that, each survivor publishes which ranks it excludes under the attempt and
checks that every other survivor excludes the same ones: a rank that disagrees fails the shrink
on every survivor, with both views named, instead of the survivors building different groups
that would hang.

An attempt ends once, for everyone, in one store key (`<attempt>/outcome`, set by compare_set:
the first word wins): "go" (every view there and alike: build the group), "views" (they differ:
every survivor raises) or "absent" (a survivor gave up: its wait ran out, or its shrink failed
before it published). A survivor still waiting when an attempt is "absent" moves on to the next
attempt (waiting a whole timeout again), where the one that gave up comes when it retries; one
that arrives later skips every attempt already ended, except that where the last ended over
views that differ and this process has not seen that end, it fails at once with them (its
retry then meets theirs). So a shrink that failed on one rank can be retried, and the ranks
meet again instead of one of them entering a group the others never build.
"""

import functools as _functools
import json as _json
import threading as _threading
import time as _time

import torch as _torch
import torch.distributed as _dist

SHRINK_ABORT = getattr(_dist.distributed_c10d, "SHRINK_ABORT", 0x01)

_in_flight = set()
_in_flight_mu = _threading.Lock()


def _check_exclusion(ranks, size, me):
    """Group ranks to exclude, sorted, or ValueError/RuntimeError naming the argument."""
    if not isinstance(ranks, (list, tuple)):
        raise TypeError(f"railcc shrink: ranks_to_exclude must be a list of group ranks, not {type(ranks).__name__}")
    if len(ranks) == 0:
        raise ValueError("railcc shrink: ranks_to_exclude is empty; name the ranks to leave out "
                         "(railcc.failed_ranks() lists the ones this rank knows to be dead)")
    out = set()
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"railcc shrink: ranks_to_exclude holds {r!r}, not a group rank (an int)")
        if not 0 <= r < size:
            raise ValueError(f"railcc shrink: rank {r} in ranks_to_exclude is out of range for a group of {size} "
                             f"(0 to {size - 1})")
        if r in out:
            raise ValueError(f"railcc shrink: rank {r} appears twice in ranks_to_exclude")
        out.add(r)
    if me in out:
        raise RuntimeError(f"railcc shrink: this rank ({me}) is in ranks_to_exclude; only the ranks that stay call "
                           "shrink_group")
    if len(out) >= size:
        raise ValueError(f"railcc shrink: ranks_to_exclude names all {size} ranks; at least one must stay")
    return sorted(out)


def _registered(backend):
    """Whether a process group torch.distributed knows serves CPU tensors with `backend`."""
    for pg in list(getattr(_dist.distributed_c10d._world, "pg_map", {})):
        try:
            if pg._get_backend(_torch.device("cpu")) is backend:
                return True
        except RuntimeError:
            pass
    return False


def _first_open_attempt(store):
    """The first attempt of this group's shrink that has not ended (attempts count from 1)."""
    attempt = 1
    while store.check([f"{attempt}/outcome"]):
        attempt += 1
    return attempt


def _give_up(store, attempt, why):
    """Ends `attempt` as "absent" unless it ended already; returns how it ended."""
    return store.compare_set(f"{attempt}/outcome", "", "absent|" + why).decode(errors="replace")


# The attempts of each group's shrink this process has seen end (by group name): a rank that
# comes to an attempt the others ended over views that differ, without having seen that end,
# fails with them at once instead of waiting a whole timeout alone in the next attempt.
_ends_seen = {}


def _agree(store, name, glob, me, survivors, view, timeout):
    """Meets the other survivors in an attempt whose views all match this rank's, within
    `timeout`; returns that attempt's number, or raises naming the views that differ or the
    ranks that never came."""
    deadline = _time.monotonic() + timeout.total_seconds()
    attempt, seen, nap = 0, set(), 0.001

    def decide(word):  # the attempt's outcome: `word` if it had none yet
        return store.compare_set(f"{attempt}/outcome", "", word).decode(errors="replace")

    def views_of(ranks):  # {global rank: view} of `ranks`, each published under this attempt
        return {r: v.decode(errors="replace") for r, v in zip(ranks, store.multi_get([f"{attempt}/view/{r}" for r in ranks]))}

    def disagreement(views):
        for r, theirs in views.items():
            if theirs != view:
                return (f"railcc shrink of group '{name}': rank {glob[me]} excludes {view} but rank {r} excludes "
                        f"{theirs} (ranks of the default group); every rank that stays must exclude the same ranks")
        return ""

    def who_of(n):  # every rank that published a view under attempt `n`, this one left out
        who = store.get(f"{n}/who").decode(errors="replace")
        return sorted({int(w) for w in who.split(",") if w.strip().isdigit()} - {glob[me]})

    ended = _ends_seen.setdefault(name, set())
    kept = [glob[r] for r in survivors]
    while True:
        if not attempt:  # (re)join: the first attempt not ended yet, for a whole timeout from now
            attempt, seen, nap = _first_open_attempt(store), set(), 0.001
            before = store.get(f"{attempt - 1}/outcome").decode(errors="replace") if attempt > 1 else ""
            if before.startswith("views|") and attempt - 1 not in ended:
                # The others ended the attempt before over views that differ, before this rank
                # came: it fails with them now (its retry meets theirs in the next attempt).
                ended.add(attempt - 1)
                attempt -= 1
                raise RuntimeError(disagreement(views_of(who_of(attempt))) or before[6:])
            store.set(f"{attempt}/view/{glob[me]}", view)
            store.append(f"{attempt}/who", f",{glob[me]}")  # every rank that published, kept or not
        outcome = store.get(f"{attempt}/outcome").decode(errors="replace") if store.check([f"{attempt}/outcome"]) else ""
        if not outcome:
            # Any rank's view, not only those of the ranks this one keeps: views that share no
            # rank would otherwise each wait for a rank the other left out, saying "did not join".
            who = store.get(f"{attempt}/who").decode(errors="replace")
            new = sorted({int(w) for w in who.split(",") if w.strip().isdigit()} - seen - {glob[me]})
            seen |= set(new)
            why = disagreement(views_of(new)) if new else ""
            if why:
                outcome = decide("views|" + why)
            elif store.check([f"{attempt}/view/{r}" for r in kept]):
                why = disagreement(views_of(kept))
                outcome = decide("views|" + why if why else "go")
            elif _time.monotonic() >= deadline:
                missing = [r for r in kept if not store.check([f"{attempt}/view/{r}"])]
                why = f"rank {glob[me]} waited for ranks {missing} for the group's timeout"
                outcome = decide("absent|" + why)
                if outcome == "absent|" + why:  # this rank ended the attempt; its retry meets the others
                    raise RuntimeError(f"railcc shrink of group '{name}': ranks {missing} (of the default group), "
                                       f"which this rank keeps, did not join the shrink within the group's timeout "
                                       f"({timeout}); every rank that stays must call shrink_group with the same "
                                       "ranks (a retry meets the others again)" +
                                       (f"; the attempt before ended: {before[6:]}" if before.startswith("views|") else ""))
        if outcome == "go" or outcome.startswith("views|"):
            # "go" was set by a rank whose kept ranks' views all matched its own: where this
            # rank's kept ranks have published and agree, that is the same group. Otherwise (this
            # rank left out, or differing) it says the disagreement as it sees it.
            ended.add(attempt)
            if outcome == "go" and store.check([f"{attempt}/view/{r}" for r in kept]) and not disagreement(views_of(kept)):
                return attempt
            why = disagreement(views_of(who_of(attempt)))
            raise RuntimeError(why or outcome.partition("|")[2] or
                               f"railcc shrink of group '{name}': the other ranks built their group without this "
                               f"rank's view ({view}); every rank that stays must exclude the same ranks")
        if outcome:  # "absent": a rank gave up on this attempt; meet its retry in the next
            ended.add(attempt)
            attempt = 0
            deadline = _time.monotonic() + timeout.total_seconds()
            continue
        _time.sleep(nap)
        nap = min(nap * 2, 0.05)


def shrink(self, ranks_to_exclude, shrink_flags=0, opts_override=None):
    """ProcessGroupRailcc.shrink: the survivors' new backend (this rank's part of it)."""
    from . import _C

    size, me = self.size(), self.rank()
    name = self._group_name() or "group"
    if not _registered(self):
        raise RuntimeError(f"railcc shrink: group '{name}' is not a live process group "
                           "(destroy_process_group was called on it, or it was shrunk already); nothing to shrink")
    excluded = _check_exclusion(list(ranks_to_exclude), size, me)
    if shrink_flags not in (0, SHRINK_ABORT):
        raise ValueError(f"railcc shrink: shrink_flags={shrink_flags!r}; expected SHRINK_DEFAULT (0) or "
                         f"SHRINK_ABORT ({SHRINK_ABORT})")
    key = id(self)
    with _in_flight_mu:
        if key in _in_flight:
            raise RuntimeError("railcc shrink: another shrink of this group is in flight on this rank; "
                               "wait for it and shrink the group it returns")
        _in_flight.add(key)
    try:
        timeout = self._timeout()
        glob = list(self._global_ranks())
        flag = "SHRINK_ABORT" if shrink_flags & SHRINK_ABORT else "SHRINK_DEFAULT"
        why = (f"shrink_group({flag}) on rank {glob[me]} left out ranks {[glob[r] for r in excluded]} (of the default "
               "group); this group is aborted, the ranks that stay go on in the shrunk one")
        # _c10d_store() is already this torchrun attempt's (backend.cpp): no key of an earlier attempt.
        store = _dist.PrefixStore(f"railcc-shrink/{name}/", self._c10d_store())
        if shrink_flags & SHRINK_ABORT:
            # Every pending and queued op of the parent fails now (AbortedError): nothing here
            # waits on a dead rank.
            self.abort_group(why)
        elif not self._drain(timeout.total_seconds()):
            # SHRINK_DEFAULT: the parent's outstanding ops end first (done, or failed by the
            # watchdog when they need a dead rank), within the group's timeout. Survivors waiting
            # in this attempt hear at once that this rank gave up, and wait for its retry.
            _give_up(store, _first_open_attempt(store),
                     f"rank {glob[me]}'s shrink failed before it joined: its outstanding ops did not finish")
            raise RuntimeError(f"railcc shrink of group '{name}': the group's outstanding "
                               f"ops did not finish within its timeout ({timeout}); shrink with "
                               "shrink_flags=SHRINK_ABORT to abort them instead of waiting")
        survivors = [r for r in range(size) if r not in excluded]
        view = _json.dumps([glob[r] for r in excluded])
        attempt = _agree(store, name, glob, me, survivors, view, timeout)
        if not shrink_flags & SHRINK_ABORT:
            # The views agree; torch destroys the parent next. Aborting it tells a rank that was
            # left out alive why, at its next op on the parent, instead of letting it wait there.
            self.abort_group(why)
        return _C.ProcessGroupRailcc(_dist.PrefixStore(f"{attempt}/", store), survivors.index(me), len(survivors),
                                     timeout, f"{name}:shrink{attempt}", [glob[r] for r in survivors])
    finally:
        with _in_flight_mu:
            _in_flight.discard(key)


def patch_torch():
    """Two fixes to torch's (2.13) handling of a shrunk group, applied to railcc groups only,
    through torch's private helpers where they exist (nothing otherwise):

    * _finalize_shrunk_group drops the excluded ranks from the group's *global* ranks although
      they are *group* ranks: shrinking rank 2 of new_group([1, 2, 3]) would record the new
      group as global ranks [1, 3] (railcc's backend is [1, 2]); so would a second shrink of a
      default group whose first shrink left out a rank other than the last. The excluded ranks
      are handed to it as global ranks, which is what it compares with.
    * _create_shrunk_process_group registers the new backend for one device only (the parent's
      bound device, else the CPU). A railcc group serves CPU and CUDA tensors alike, as the
      group it came from did, so it is registered for the other device too."""
    c10d = _dist.distributed_c10d
    from . import _C

    finalize = getattr(c10d, "_finalize_shrunk_group", None)
    if finalize is not None and not getattr(finalize, "_railcc", False):
        @_functools.wraps(finalize)
        def finalize_global(group_info, excluded, new_backend, *args, **kwargs):
            if isinstance(new_backend, _C.ProcessGroupRailcc):
                ranks = c10d.get_process_group_ranks(group_info["process_group"])
                excluded = {ranks[r] for r in excluded}
            return finalize(group_info, excluded, new_backend, *args, **kwargs)

        finalize_global._railcc = True
        c10d._finalize_shrunk_group = finalize_global

    create = getattr(c10d, "_create_shrunk_process_group", None)
    if create is not None and not getattr(create, "_railcc", False):
        @_functools.wraps(create)
        def create_every_device(new_backend, *args, **kwargs):
            pg = create(new_backend, *args, **kwargs)
            if isinstance(new_backend, _C.ProcessGroupRailcc):
                for dev in ("cpu", "cuda"):
                    try:
                        pg._get_backend(_torch.device(dev))
                    except RuntimeError:  # no backend for it yet
                        pg._register_backend(_torch.device(dev), _dist.ProcessGroup.BackendType.CUSTOM, new_backend)
            return pg

        create_every_device._railcc = True
        c10d._create_shrunk_process_group = create_every_device
