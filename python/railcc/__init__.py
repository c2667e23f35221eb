"""railcc: a collective-communication backend for torch.distributed.

    import railcc
    torch.distributed.init_process_group(backend="railcc")
"""

import torch
import torch.distributed as dist

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
]

__version__ = "0.1.0"


def _create_backend(dist_backend_opts, backend_options=None):
    o = dist_backend_opts
    return _C.ProcessGroupRailcc(o.store, o.group_rank, o.group_size, o.timeout, str(o.group_id))


def _register():
    if getattr(dist.Backend, "RAILCC", None) is not None:
        return
    dist.Backend.register_backend("railcc", _create_backend, extended_api=True, devices=["cpu", "cuda"])


_register()


def params():
    """Every railcc parameter with its effective value and which variable set it."""
    return _C.params()


def backend_of(group=None, device="cpu"):
    """The railcc backend object serving `group` (default group if None) on `device`."""
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device(device))
    if not isinstance(backend, _C.ProcessGroupRailcc):
        raise TypeError(f"group is served by {type(backend).__name__}, not railcc")
    return backend
