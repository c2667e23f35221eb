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
that arrives later skips every attempt already ended. So a shrink that failed on one rank can be retried, and the ranks meet
again instead of one of them entering a group the others never build.
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


def _agree(store, name, glob, me, survivors, view, timeout):
    """Meets the other survivors in an attempt whose views all match this rank's, within
    `timeout`; returns that attempt's number, or raises naming the views that differ or the
    ranks that never came."""
    deadline = _time.monotonic() + timeout.total_seconds()
    attempt = _first_open_attempt(store)
    store.set(f"{attempt}/view/{glob[me]}", view)
    nap = 0.001
    while True:
        keys = [f"{attempt}/view/{glob[r]}" for r in survivors]
        outcome = ""
        if store.check(keys):
            views = {glob[r]: v.decode(errors="replace") for r, v in zip(survivors, store.multi_get(keys))}
            differ = [(r, v) for r, v in views.items() if v != view]
            if differ:
                r, theirs = differ[0]
                msg = (f"railcc shrink of group '{name}': rank {glob[me]} excludes {view} but rank {r} excludes "
                       f"{theirs} (ranks of the default group); every rank that stays must exclude the same ranks")
                store.compare_set(f"{attempt}/outcome", "", "views|" + msg)
                raise RuntimeError(msg)
            outcome = store.compare_set(f"{attempt}/outcome", "", "go").decode(errors="replace")
        elif _time.monotonic() >= deadline:
            missing = [glob[r] for r in survivors if not store.check([f"{attempt}/view/{glob[r]}"])]
            mine = f"rank {glob[me]} waited for ranks {missing} for the group's timeout"
            outcome = _give_up(store, attempt, mine)
            if outcome == "absent|" + mine:  # this rank ended the attempt (another's "absent": its retry is next)
                raise RuntimeError(f"railcc shrink of group '{name}': ranks {missing} (of the default group), which "
                                   f"this rank keeps, did not join the shrink within the group's timeout ({timeout}); "
                                   "every rank that stays must call shrink_group with the same ranks (a retry meets "
                                   "the others again)")
        elif store.check([f"{attempt}/outcome"]):
            outcome = store.get(f"{attempt}/outcome").decode(errors="replace")
        if outcome == "go":
            return attempt
        if outcome.startswith("views|"):
            raise RuntimeError(outcome[len("views|"):])
        if outcome:  # "absent": a survivor gave up on this attempt; meet its retry in the next,
            # for a whole timeout from now (it gave up about when this rank would have)
            attempt = _first_open_attempt(store)
            store.set(f"{attempt}/view/{glob[me]}", view)
            deadline = _time.monotonic() + timeout.total_seconds()
            nap = 0.001
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
