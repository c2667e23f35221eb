"""railcc's exceptions. All are torch.distributed.DistBackendError, so code that catches that
keeps working; the subclasses say what went wrong, and the attributes say where."""

import torch.distributed as dist


class RailccError(dist.DistBackendError):
    """Base class. Attributes: code, ranks (at fault), hosts (theirs), seq, op."""

    code = None
    ranks = ()
    hosts = ()
    seq = None
    op = None


class CollectiveTimeoutError(RailccError):
    """An op made no progress for its timeout; `ranks` are the peers it was waiting on."""


class PeerFailureError(RailccError):
    """A peer died or closed its connections; `ranks`/`hosts` name it."""


class CollectiveMismatchError(RailccError):
    """Ranks called different collectives (op, count, dtype, root, reduce op) at one seq."""


class StragglerError(RailccError):
    """A rank or link is much slower than its peers (RAILCC_STRAGGLER_ACTION=raise)."""


class AbortedError(RailccError):
    """The group was aborted or shut down while the op was pending."""
