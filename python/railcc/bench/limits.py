"""What this host can hold, for the argument checks of railcc-bench and `python -m railcc sim`:
its memory (physical, or less where a cgroup caps it), the tasks its cgroup still allows, and
ranks that die with the process that started them. No torch, no railcc: runner.py loads this by
path when run as a file."""

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
GIB = 1 << 30


def _cgroup_paths():
    """{controller: path} of this process's cgroups ("" for the v2 unified hierarchy)."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                for c in parts[1].split(",") if parts[1] else [""]:
                    out[c] = parts[2]
    except OSError:
        pass
    return out


def _read_limit(paths):
    """The smallest number in the first line of any of these files ('max' and absent: None)."""
    best = None
    for p in paths:
        try:
            with open(p) as f:
                text = f.readline().strip()
        except OSError:
            continue
        if text.isdigit():
            v = int(text)
            best = v if best is None else min(best, v)
    return best


def _cgroup_files(controller_dir, rel, name):
    """The file `name` of the cgroup at `rel` and of every cgroup above it (a limit anywhere up
    the tree applies), under controller_dir; inside a cgroup namespace `rel` is '/', and the
    mount's own root is this process's cgroup."""
    files = []
    rel = (rel or "/").strip("/")
    while True:
        files.append(os.path.join(controller_dir, rel, name) if rel else os.path.join(controller_dir, name))
        if not rel:
            break
        rel = os.path.dirname(rel)
    return files


def memory_limit():
    """(bytes, what limits them): the host's physical memory, or the cgroup's limit where lower."""
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        phys = None
    groups = _cgroup_paths()
    cg = None
    if "" in groups:
        cg = _read_limit(_cgroup_files("/sys/fs/cgroup", groups[""], "memory.max"))
    if cg is None and "memory" in groups:
        cg = _read_limit(_cgroup_files("/sys/fs/cgroup/memory", groups["memory"], "memory.limit_in_bytes"))
    if cg is not None and (phys is None or cg < phys):
        return cg, "the cgroup's memory limit"
    if phys is None:
        return 64 * GIB, "an assumed 64 GiB (the physical memory is unknown)"
    return phys, "the physical memory"


def tasks_left():
    """(tasks this cgroup may still start, its limit), or (None, None) where nothing limits them."""
    groups = _cgroup_paths()
    for base, rel in (("/sys/fs/cgroup", groups.get("")), ("/sys/fs/cgroup/pids", groups.get("pids"))):
        if rel is None:
            continue
        dirs = _cgroup_files(base, rel, "")
        limits = []
        for d in dirs:
            mx = _read_limit([os.path.join(d, "pids.max")])
            cur = _read_limit([os.path.join(d, "pids.current")])
            if mx is not None and cur is not None:
                limits.append((mx - cur, mx))
        if limits:
            return min(limits)
    return None, None


def human(b):
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b} B"


def die_with_parent(parent_pid, sig=signal.SIGKILL):
    """Has the kernel send `sig` to this process when the thread that started it exits
    (prctl PR_SET_PDEATHSIG), and exits at once if that parent is already gone (it died before
    the prctl: this process was handed to another). False where prctl is not there (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        ok = False
    if os.getppid() != parent_pid:
        os._exit(1)
    return ok


def pdeathsig_preexec(sig=signal.SIGTERM):
    """A preexec_fn for subprocess: the child gets `sig` when the process that started it exits."""
    parent = os.getpid()

    def preexec():
        die_with_parent(parent, sig)

    return preexec
