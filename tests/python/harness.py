"""Real multi-process test harness.

A `RankPool` starts `world_size` real processes, each of which joins a process
group over a FileStore and then serves tasks: a task names a module-level function that
every rank runs as fn(rank, world_size, *args). Reusing one pool for many tests keeps the
cost of `import torch` out of every test, and a task that does not finish within its
timeout kills the pool, so a hang fails one test instead of hanging CI.

The ranks are forked from multiprocessing's fork server, a clean single-threaded process that
imported torch once: a spawned rank would import it again (about 2 s of CPU each, the larger part
of starting a pool on two cores). Each rank gets this process's environment as it is when the
pool starts, as a spawned one would, and imports railcc itself. What the server set up at its own
start stays the server's for the session: torch's import-time variables (a rank reads
TORCH_DISTRIBUTED_DEBUG again; no other is passed to a pool today), the interpreter's start-up
variables (PYTHONHASHSEED: every rank has the server's), limits, affinity and namespaces.
"""

import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

INIT_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init_worker.py")


def _worker(rank, world_size, backend, store_path, tasks, results, env):
    # The fork server's environment is the one it started with: this pool's replaces it.
    os.environ.clear()
    os.environ.update(env)
    try:
        import torch.distributed as dist

        dist.set_debug_level_from_env()  # read by torch at import, in the fork server

        if backend == "railcc" or "railcc" in backend:
            import railcc  # noqa: F401  (registers the backend)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        results.put((rank, "ready", None))
    except BaseException:  # report init failures instead of dying silently
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        module, name, args = item
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, "ok", fn(rank, world_size, *args)))
        except BaseException as e:  # the test decides what an exception means
            results.put((rank, "raised", (type(e).__name__, str(e), traceback.format_exc())))
    try:
        dist.destroy_process_group()
    except BaseException:
        pass
    results.put((rank, "exited", None))
    # Skip the interpreter's teardown (about half a second of CPU with torch loaded, times every
    # rank of every pool at the end of a session): flush the queue, then leave.
    results.close()
    results.join_thread()
    os._exit(0)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


class TaskError(AssertionError):
    pass


class RankPool:
    def __init__(self, world_size, backend="railcc", env=None, init_timeout=60, rank_env=None):
        self.world_size = world_size
        self.backend = backend
        ctx = _context()
        self._dir = tempfile.TemporaryDirectory(prefix="railcc-test-")
        store_path = os.path.join(self._dir.name, "store")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, backend, store_path, self._tasks[r], self._results,
                      {**os.environ, **(env or {}), **(rank_env(r) if rank_env else {})}),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        got = self._collect("init", init_timeout)
        bad = {r: v for r, (s, v) in got.items() if s != "ready"}
        if bad:
            self.kill()
            raise TaskError(f"process group init failed: {bad}")

    def _collect(self, what, timeout, allow_dead=()):
        got = {r: ("died", None) for r in allow_dead}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(got))
                self.kill()
                raise TaskError(f"{what}: ranks {missing} did not answer within {timeout}s")
            try:
                rank, status, value = self._results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if dead and set(dead) <= set(allow_dead):
                    continue
                if dead:
                    self.kill()
                    raise TaskError(f"{what}: ranks {dead} died")
                continue
            got[rank] = (status, value)
        return got

    def run_raw(self, fn, *args, timeout=60, allow_dead=()):
        """Runs fn on every rank; returns {rank: (status, value)}. Ranks in allow_dead may
        die instead of answering (status "died")."""
        for q in self._tasks:
            q.put((fn.__module__, fn.__name__, args))
        return self._collect(fn.__name__, timeout, allow_dead)

    def run(self, fn, *args, timeout=60):
        """Runs fn on every rank and returns the list of results; any exception fails."""
        got = self.run_raw(fn, *args, timeout=timeout)
        errors = {r: v[2] for r, (s, v) in got.items() if s == "raised"}
        if errors:
            r = min(errors)
            raise TaskError(f"{fn.__name__} raised on ranks {sorted(errors)}; rank {r}:\n{errors[r]}")
        return [got[r][1] for r in range(self.world_size)]

    def alive(self):
        return all(p.is_alive() for p in self._procs)

    def close(self, timeout=20):
        close_all([self], timeout)

    def _ask_to_exit(self):
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass

    def kill(self):
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)


def close_all(pools, timeout=20):
    """Closes pools together: every rank is asked to exit first, then all are waited for (up
    to `timeout` in all), and what is left is killed."""
    for pool in pools:
        pool._ask_to_exit()
    deadline = time.monotonic() + timeout
    for pool in pools:
        for p in pool._procs:
            p.join(max(0.1, deadline - time.monotonic()))
    for pool in pools:
        pool.kill()
        pool._dir.cleanup()


def store_barrier(key, n):
    """Every rank of the default group here, through the store alone (no connection of the
    group is made). `key` must be new for each barrier: a pool's store outlives a test."""
    import torch.distributed as dist
    from railcc.bench.timing import StoreBarrier

    StoreBarrier(dist.distributed_c10d._get_default_store(), n, prefix=key)()


def free_port():
    """A TCP port free on 127.0.0.1 now (for a job's MASTER_PORT), below the kernel's ephemeral
    range (ip_local_port_range), so that no socket bound to port 0 meanwhile (a listener or an
    outgoing connection of another test's ranks) takes it before the job's store listens."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env_ranks(cmd, n, timeout=120, env=None, rank_env=None):
    """Runs `cmd` (argv) as ranks 0..n-1 of an env:// job (MASTER_ADDR/PORT on 127.0.0.1, RANK,
    WORLD_SIZE; this tree's railcc first on PYTHONPATH), `env` added for all and rank_env(r) per
    rank. Returns (exit codes, outputs with stderr merged). Ranks still running `timeout` seconds
    after the start are made to print every thread's Python stack (faulthandler, SIGABRT: exit
    code -6) and then killed, so that a hang fails with what each rank was doing; keep `timeout`
    below the test's own timeout for that."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n),
                PYTHONFAULTHANDLER="1",
                PYTHONPATH=os.path.join(repo, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    procs = [subprocess.Popen(cmd, env=dict(base, RANK=str(r), **(rank_env(r) if rank_env else {})), cwd=repo,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(n)]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                hung = [r for r, q in enumerate(procs) if q.poll() is None]
                for r in hung:
                    procs[r].send_signal(signal.SIGABRT)
                note = f"\n[harness: ranks {hung} still running after {timeout} s: SIGABRT for their stacks]\n"
                for q in procs[len(outs):]:
                    try:
                        out = q.communicate(timeout=10)[0]
                    except subprocess.TimeoutExpired:
                        q.kill()
                        out = q.communicate()[0]
                    outs.append(out + note)
                break
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


def spawn_worker(rank, world, store, env=None, args=()):
    """One rank of a job as its own process (init_worker.py over the FileStore `store`), for
    tests that drive set-up from outside the ranks."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.Popen([sys.executable, INIT_WORKER, str(rank), str(world), store, *args], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_result(p, timeout):
    """(the JSON line init_worker.py printed, its stderr)."""
    out, err = p.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return (json.loads(lines[-1]) if lines else {"ok": False, "error": "no result"}), err


def load_bench_runner(alias):
    """python/railcc/bench/runner.py loaded by path under `alias`, as `python path/to/runner.py`
    runs it: without importing the railcc package, which needs the built extension. Its command
    line module is then sys.modules["railcc_bench_args"]."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "railcc", "bench", "runner.py")
    spec = importlib.util.spec_from_file_location(alias, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def railcc_built():
    """Whether railcc._C is there (find_spec of a submodule imports the package, which may fail
    while the build is missing)."""
    try:
        return importlib.util.find_spec("railcc._C") is not None
    except Exception:
        return False
