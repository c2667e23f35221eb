"""railcc: a collective-communication backend for torch.distributed.

    import railcc
    torch.distributed.init_process_group(backend="railcc")
"""

# Imported under private names: the package's public names are exactly __all__.
import json as _json

import torch as _torch
import torch.distributed as _dist

from . import _C
from ._errors import (
    AbortedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerFailureError,
    RailccError,
    StragglerError,
)

__all__ = [
    "AbortedError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerFailureError",
    "RailccError",
    "StragglerError",
    "params",
    "backend_of",
    "dump_trace",
    "straggler_report",
    "abort",
    "cuda_info",
    "failed_ranks",
    "stats",
    "reset_stats",
]

__version__ = "0.1.0"


def _create_backend(dist_backend_opts, backend_options=None):
    o = dist_backend_opts
    # Errors name ranks as the user knows them: by their rank in the default group.
    global_ranks = list(getattr(o, "global_ranks_in_group", None) or [])
    return _C.ProcessGroupRailcc(o.store, o.group_rank, o.group_size, o.timeout, str(o.group_id), global_ranks)


def _register():
    if getattr(_dist.Backend, "RAILCC", None) is not None:
        return
    _dist.Backend.register_backend("railcc", _create_backend, extended_api=True, devices=["cpu", "cuda"])


_register()

# torch.distributed.shrink_group(ranks, group) calls the backend's shrink (see _shrink.py).
from . import _shrink  # noqa: E402

_C.ProcessGroupRailcc.shrink = _shrink.shrink
_shrink.patch_torch()


def params():
    """Every railcc parameter with its effective value and which variable set it."""
    return _C.params()


def stats():
    """How this process's transports moved bytes since start (or reset_stats()), per transport:
    {"shm": {...}, "socket": {...}, "verbs": {...}}, each with
    send_copied_bytes / recv_copied_bytes (the CPU copied them into or out of a FIFO, socket or
    ring; a reduction straight out of one counts as taking them out), single_copied_bytes (read
    once from a same-host peer's buffer by the kernel), rdma_written_bytes (written by the NIC
    from a staging area into the peer's ring), rdma_zero_copy_bytes (read by the NIC straight
    from the sender's buffer into the receiver's), registrations, registration_cache_hits and
    registration_failures (user memory registered with a NIC for rendezvous) and
    registered_bytes (held registered now), and gpu_direct_bytes (GPU memory the NIC read or wrote
    here, GPUDirect RDMA: a CUDA tensor sent or received between hosts without a host copy).
    A "device" row counts what the device layer did with CUDA tensors: host_rounds (rounds
    between the ranks' hosts inside CUDA IPC ops, two per chunk) and device_kernels (one-kernel
    collectives launched, RAILCC_CUDA_SHOTS, which take no host round) and device_in_place (of
    those, the ones whose input the peers read in place, from a tensor of allocate_tensor or
    one of torch's allocator whose segment every peer has mapped, instead of through a copy). Every group of the process adds to the same counts."""
    return _C.stats()


def reset_stats():
    """Zeroes stats() (all but registered_bytes, which says what is held now)."""
    _C.reset_stats()


def cuda_info():
    """What railcc uses for CUDA tensors: {"plugin": loaded?, "runtime": its CUDA runtime,
    "devices": GPUs it sees, "gpu_direct": whether cuda:0's memory exports as a dma-buf (what
    GPUDirect RDMA registers with a NIC), or None without a GPU, "error": why not, or None}.
    Never raises."""
    return _C.cuda_info()


def backend_of(group=None, device="cpu"):
    """The railcc backend object serving `group` (default group if None) on `device`."""
    pg = group if group is not None else _dist.group.WORLD
    if pg is None:
        raise ValueError("railcc: there is no default process group (init_process_group was not called, or the "
                         "group was destroyed); pass group=")
    try:
        backend = pg._get_backend(_torch.device(device))
    except RuntimeError as e:  # a destroyed group, or one without this device
        raise ValueError(f"railcc: the group has no backend for {device} ({str(e).splitlines()[0]}); "
                         "was it destroyed?") from None
    if not isinstance(backend, _C.ProcessGroupRailcc):
        raise TypeError(f"group is served by {type(backend).__name__}, not railcc")
    return backend


def dump_trace(group=None, dir=None):
    """The flight recorder of this rank for `group` (default group if None), as a dict: recent ops
    with their state, times and bytes per peer, this rank's progress, links and arrival lags.

    Also written to `dir`, or to RAILCC_TRACE_DIR when `dir` is None and it is set, as
    railcc-trace-<group>-rank<R>.json; the dict's "path" says where ("" when not written).
    `python -m railcc trace DIR` merges the files of all ranks into one verdict."""
    backend = backend_of(group)
    doc = _json.loads(backend.trace_json())
    doc["path"] = backend.dump_trace(dir or "")
    return doc


def straggler_report(group=None):
    """Straggler report of this rank for `group`, as a dict:

    * "ranks": every rank's arrival lag at collectives over the sliding window, as this rank saw
      it (lag_us_mean, lag_us_max, ops, straggler),
    * "links": this rank's links (src, dst, hosts, transport, gbps) with the median gbps of the
      links of the same transport, and whether each is slow,
    * "stragglers": ranks flagged as stragglers, and "slow_links": slow links flagged here or
      published by other ranks (their progress records, read for 2 s at most: "records_unread"
      counts the ranks not read in that time, 0 unless the store is slow).

    Not a collective: it reads what this rank measured and what the others published."""
    return _json.loads(backend_of(group).straggler_report_json())


def abort(group=None):
    """Aborts `group` from any thread: every pending and later op on it fails at once with
    railcc.AbortedError. The group cannot be used again; destroy it afterwards."""
    backend_of(group).abort_group()


def failed_ranks(group=None, group_ranks=False):
    """The ranks this rank knows to be dead or silent in `group` (default group if None): those
    the error that broke the group blames (a rank that exited, closed its connections, or never
    answered within the timeout), and those another group of this rank saw die since (a
    shrink's new group whose set-up lost a rank, say). Empty while the group is healthy. Global ranks (as
    torch.distributed.get_process_group_ranks gives them), or with group_ranks=True ranks of
    `group` itself, which is what shrink_group takes:

        torch.distributed.shrink_group(railcc.failed_ranks(g, group_ranks=True), g)

    (the two differ for a subgroup, and for a default group that was shrunk before).
    shrink_group checks that every survivor excludes the same ranks.

    Raises TypeError when group is not None or a torch.distributed process group, or group_ranks
    not a bool."""
    if group is not None and not isinstance(group, _dist.ProcessGroup):
        raise TypeError(f"railcc.failed_ranks: group must be None (the default group) or a "
                        f"torch.distributed process group, not {type(group).__name__} ({group!r:.60})")
    if not isinstance(group_ranks, bool):
        raise TypeError(f"railcc.failed_ranks: group_ranks must be True or False, not "
                        f"{type(group_ranks).__name__} ({group_ranks!r:.60})")
    dead = sorted(set(backend_of(group).failed_ranks()))
    if group_ranks:
        g = group if group is not None else _dist.distributed_c10d._get_default_group()
        dead = sorted(_dist.get_group_rank(g, r) for r in dead)
    return dead
