"""railcc under torchft: a reconfigurable process group for fault-tolerant training.

torchft (https://github.com/pytorch/torchft) keeps training going while whole replica groups
die and come back: its Manager asks a Lighthouse for a quorum each step and, when the quorum
changes, calls `configure()` on its process group with a fresh store prefix, rank and world
size. `ProcessGroupRailcc` answers that call by building a new railcc backend for the new
quorum (through c10d's backend registry, as `init_process_group(backend="railcc")` would) and
closing the old one, so replicas that left are forgotten and replicas that joined are met.

    from datetime import timedelta
    import torchft
    from railcc.torchft import ProcessGroupRailcc     # imports railcc: backend "railcc" registered

    manager = torchft.Manager(
        pg=ProcessGroupRailcc(timeout=timedelta(seconds=30)),
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        replica_id=f"replica_{i}",        # the group's TCPStore: MASTER_ADDR/PORT or store_addr/port
        lighthouse_addr="http://lighthouse:29510",
    )
    while manager.current_step() < steps:
        manager.start_quorum()
        loss_fn(model(batch())).backward()
        for w in [manager.allreduce(p.grad) for p in model.parameters()]:
            w.wait()
        if manager.should_commit():
            opt.step()
        opt.zero_grad()

torchft.DistributedDataParallel and torchft.Optimizer make the same Manager calls (run on
railcc by hand with one replica only). Tested with torchft 0.2.0 on CPU tensors (tests/python/test_torchft.py).
Importing this module without torchft raises ImportError.
"""

import threading
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as e:  # torchft is an optional dependency of railcc
    _missing = e.name is None or e.name.split(".")[0] == "torchft"
    raise ImportError(
        ("railcc.torchft needs torchft, which is not installed: pip install torchft"
         if _missing else f"railcc.torchft: torchft is installed but its import failed ({e}): "
         "install what it needs (pip install torchft brings its dependencies)")
        + " (railcc is tested with torchft 0.2.0)"
    ) from e

from . import _C

__all__ = ["ProcessGroupRailcc"]

# How long abort() waits for the old backend's shutdown (its progress thread) before leaving it
# to finish on a background thread: shutdown is itself bounded (ops that stop moving for a second
# fail), this only caps what a caller of abort() can be made to wait.
_SHUTDOWN_WAIT_S = 5.0


def _close(backend: "_C.ProcessGroupRailcc", why: Optional[str], wait_s: float) -> None:
    """Fails the backend's pending ops at once when `why` is given (an abort, which railcc logs
    with `why`), then shuts it down, waiting at most wait_s. The shutdown also takes it off
    railcc's list of this process's live groups, so a replica that later comes back under the
    same rank is not taken for the dead one."""
    if why:
        try:
            backend.abort_group(why)
        except Exception:  # an already broken or closed backend: nothing left to fail
            pass

    def shut() -> None:
        try:
            backend.shutdown()
        except Exception:
            pass

    t = threading.Thread(target=shut, name="railcc-torchft-shutdown", daemon=True)
    t.start()
    t.join(wait_s)


class ProcessGroupRailcc(ProcessGroupWrapper):
    """A torchft process group on railcc: each `configure()` (a new quorum) builds a new railcc
    backend on the given store and closes the previous one.

    Args:
        timeout: railcc's timeout for the collectives and set-up of each quorum's backend, and
            torchft's for reaching the quorum's store.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._configures = 0
        self._aborted: Optional[Exception] = None

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        self._configures += 1
        quorum = self._quorum_id if self._quorum_id is not None else f"c{self._configures}"
        name = f"torchft-railcc:q{quorum}:r{self._group_rank or 0}"
        # The ranks torchft derives from replica ids name ranks in railcc's errors; railcc also
        # keys what it knows of dead peers by them, so pass them only when they are distinct.
        ranks = list(self._global_ranks or [])
        if len(ranks) != world_size or len(set(ranks)) != world_size:
            ranks = []
        # The backend as c10d's registry builds it for init_process_group(backend="railcc").
        opts = dist.distributed_c10d._DistributedBackendOptions()
        opts.store = store
        opts.group_rank = rank
        opts.group_size = world_size
        opts.timeout = self._timeout
        opts.group_id = name
        opts.global_ranks_in_group = ranks
        backend = dist.Backend._plugins["RAILCC"].creator_fn(opts, None)
        backend._set_sequence_number_for_group()

        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for device in devices:
            pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend)
        self._aborted = None
        return pg

    def _backend(self) -> Optional["_C.ProcessGroupRailcc"]:
        pg = self._pg
        if pg is None:
            return None
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except RuntimeError:
            return None
        return backend if isinstance(backend, _C.ProcessGroupRailcc) else None

    def abort(self, errored: bool = True) -> None:
        """Fails every pending op of the current quorum's backend and closes it. Bounded (a few
        seconds at most, whatever the peers do) and harmless when unconfigured or repeated."""
        backend = self._backend()
        if errored and backend is not None:
            self._aborted = RuntimeError(f"railcc: the {self.getBackendName()} group was aborted")
        self._pg = None  # torchft's own abort then only logs the error
        super().abort(errored=errored)
        if backend is not None:
            # A new quorum (errored=False) closes quietly: ops still queued finish, or fail once
            # they stop moving for a second.
            _close(backend, "torchft aborted the group" if errored else None, _SHUTDOWN_WAIT_S)

    def shutdown(self) -> None:
        """Closes the current quorum's backend (as abort does, without reporting an error)."""
        self.abort(errored=False)

    def errored(self) -> Optional[Exception]:
        """An error when the current quorum's group was aborted, else None."""
        return self._aborted

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        backend = self._backend()
        if backend is not None:
            backend.set_timeout(timeout)

    def getBackendName(self) -> str:
        return "torchft-railcc"
