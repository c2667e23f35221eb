"""The command lines of `python -m railcc sim` and railcc-bench refuse what they cannot run, and
say which flag, before anything is allocated or any rank starts (issue 68): exit status 2 and an
argparse message naming the flag and its range, never a traceback, an OOM kill or a silent 0.
Ranks started by railcc-bench --nprocs die with it, even when it is killed by SIGKILL.
railcc.failed_ranks refuses arguments of the wrong type with a TypeError that names them.

The CLIs run as subprocesses; railcc/bench/runner.py is run by path (with gloo), as
tests/python/test_bench.py does, so those cases need no built extension; sim's need railcc._C.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import harness

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(ROOT, "python", "railcc", "bench", "runner.py")

bench = harness.load_bench_runner("railcc_bench_cli_args")
bench_args = sys.modules["railcc_bench_args"]  # its command line (bench/args.py)

needs_railcc = pytest.mark.skipif(not harness.railcc_built(), reason="the railcc extension (railcc._C) is not built")


def run(cmd, timeout=60):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} did not finish within {timeout}s (the check should come first):\n{e.stdout}\n{e.stderr}")


def assert_usage_error(p, flag, *words):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert f"error: argument {flag}" in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)
    assert "Traceback" not in p.stderr and "Invoked with" not in p.stderr, p.stderr
    assert p.stdout == "", p.stdout


# ------------------------------------------------------------------------------------------------
# python -m railcc sim


@needs_railcc
@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,flag,words", [
    (["-n", "16777216"], "-n/--ranks", ["1,048,576"]),
    (["-n", str(10**12)], "-n/--ranks", ["1,048,576"]),
    (["-n", "1"], "-n/--ranks", ["2 to"]),
    (["-n", "1e3"], "-n/--ranks", []),
    (["-n", ","], "-n/--ranks", []),
    (["-n", ",".join(["64"] * 17)], "-n/--ranks", ["16"]),
    # within the static bound, but its simulation would hold several GiB
    (["-n", "65536"], "-n/--ranks", ["GiB", "at most"]),
    (["-n", "4096", "--per-host", "4096"], "-n/--ranks", ["GiB", "fewer ranks per host"]),
    (["--per-host", "0"], "--per-host", ["1 to"]),
    (["-n", "8", "--per-host", "16"], "-n/--ranks", ["whole hosts"]),
    (["--elem-size", "0"], "--elem-size", ["1, 2, 4, 8"]),
    (["--elem-size", "3"], "--elem-size", ["1, 2, 4, 8"]),
    (["--buffsize", "-1"], "--buffsize", ["4,096 to 68,719,476,736"]),
    (["--buffsize", str(1 << 40)], "--buffsize", ["4,096 to 68,719,476,736"]),
    (["--sizes", "-1"], "--sizes", ["0 to"]),
    (["--sizes", "2T"], "--sizes", ["0 to"]),
    (["--sizes", "1.5M"], "--sizes", []),
    (["--sizes", ",".join(["8"] * 65)], "--sizes", ["64"]),
    (["--ops", ","], "--ops", []),
    (["--ops", "all_to_all"], "--ops", ["all_to_all"]),
    (["--channels", "0"], "--channels", ["1 to 64"]),
    (["--oneshot-bytes", "-1"], "--oneshot-bytes", ["0 to 67,108,864"]),
    (["--algo", "bogus"], "--algo", ["bogus"]),
])
def test_sim_refuses_bad_arguments_before_simulating(argv, flag, words):
    assert_usage_error(run([sys.executable, "-m", "railcc", "sim", *argv]), flag, *words)


@needs_railcc
def test_sim_ranges_are_the_engines_parameters():
    import railcc
    from railcc import sim

    allowed = {p["env"]: p["allowed"] for p in railcc.params()}
    assert allowed["RAILCC_BUFFSIZE"] == "%d..%d" % sim.BUFFSIZE_RANGE
    assert allowed["RAILCC_ONESHOT_BYTES"] == "%d..%d" % sim.ONESHOT_RANGE
    lo, hi = map(int, allowed["RAILCC_NCHANNELS"].split(".."))
    assert sim.CHANNELS_RANGE == (max(lo, 1), hi)


@needs_railcc
def test_sim_takes_its_defaults_and_the_largest_jobs_within_the_budget():
    from railcc import sim

    a = sim.parse_args([])
    assert a.ranks == [1024, 4096]
    assert sim.parse_args(["-n", "4096", "--per-host", "8"]).ranks == [4096]
    most = sim._most_ranks(8, sim.OPS, "", sim.SIM_MAX_BYTES)
    assert 4096 < most < 16384  # 16,384 ranks at 8 per host held 3.2 GB here
    assert sim.sim_bytes(most, 8, sim.OPS)[0] <= sim.SIM_MAX_BYTES < sim.sim_bytes(most + 8, 8, sim.OPS)[0]
    # a broadcast alone holds a few KiB per rank, so much larger jobs fit
    assert sim._most_ranks(8, ["broadcast"], "", sim.SIM_MAX_BYTES) > 65536


@needs_railcc
@pytest.mark.timeout(120)
def test_sim_estimate_bounds_what_the_engine_does():
    # sim_cost's peers and messages per rank are upper bounds of what the engine's schedules do,
    # for the rule and for every algorithm --algo may name: a rule that met more peers would
    # need a new estimate (or the sim could be OOM-killed again).
    import railcc
    from railcc import sim

    rules = railcc._C.rules
    for n, L in ((16, 1), (16, 16), (32, 2), (64, 8), (64, 64), (128, 1), (128, 4), (256, 16)):
        for op in sim.OPS:
            for size in (8, 1 << 12, 1 << 16, (1 << 16) + 4, 1 << 20, 1 << 28):
                block = size // n if op in ("reduce_scatter", "all_gather") else size
                block = max(4, block - block % 4)
                for algo in ("", "pairwise", "oneshot", "ring", "direct", "tree", "chain", "hier", "rings"):
                    try:
                        r = rules.simulate(n, L, op, block, 4, algo=algo)
                    except Exception:  # noqa: BLE001 - what the engine cannot simulate it refuses
                        continue
                    peers, messages = sim.sim_cost(n, L, op, algo)
                    what = (n, L, op, size, algo, r)
                    assert r["net_peers"] + r["local_peers"] <= peers, what
                    assert r["messages"] <= messages, what


# ------------------------------------------------------------------------------------------------
# railcc-bench


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,flag,words", [
    (["--nprocs", "2", "-b", "1", "-e", "1G", "-i", "1"], "-i/--stepbytes", ["64 sizes"]),
    (["--nprocs", "2", "-f", "1.0000001"], "-f/--stepfactor", ["64 sizes"]),
    (["--nprocs", "1000000"], "--nprocs", ["per CPU", "256"]),
    (["--nprocs", "0"], "--nprocs", ["1 to"]),
    (["-f", "inf"], "-f/--stepfactor", ["finite"]),
    (["-f", "nan"], "-f/--stepfactor", ["finite"]),
    (["--nprocs", "2", "-e", "64G"], "-e/--maxbytes", ["GiB", "at most"]),
    (["--nprocs", "2", "-o", "allreduce_coalesced", "-e", "1G"], "-e/--maxbytes", ["--ntensors"]),
    (["--timeout", "1e-9"], "--timeout", ["1 to 86400"]),
    (["--timeout", "inf"], "--timeout", ["1 to 86400"]),
    (["--timeout", "nan"], "--timeout", ["1 to 86400"]),
    (["--bound", "--bound_bytes", str(10**15)], "--bound_bytes", ["TiB"]),
    (["-w", str(10**12)], "-w/--warmup_iters", ["1,000,000"]),
    (["-n", str(10**12)], "-n/--iters", ["1,000,000"]),
    (["--ntensors", "100000"], "--ntensors", ["65536"]),
    (["--json", "/proc/railcc-no-such-dir/out.json"], "--json", ["cannot write"]),
    (["--json", "/proc/railcc-test.json"], "--json", ["cannot write"]),
    (["--json", "/"], "--json", ["directory"]),
])
def test_bench_refuses_bad_arguments_before_any_rank(argv, flag, words):
    p = run([sys.executable, BENCH, "--backend", "gloo", *argv])
    assert_usage_error(p, flag, *words)


def test_bench_json_check_leaves_no_file_behind(tmp_path):
    cfg = bench.validate(bench.build_parser().parse_args(["--json", str(tmp_path / "out.json")]), 2)
    bench.check_outputs(cfg)
    assert not (tmp_path / "out.json").exists()
    (tmp_path / "keep.json").write_text("old")
    cfg.json = str(tmp_path / "keep.json")
    bench.check_outputs(cfg)
    assert (tmp_path / "keep.json").read_text() == "old"


def parse(argv, world=2):
    return bench.validate(bench.build_parser().parse_args(argv), world, argv)


def test_bench_sweep_is_counted_before_it_is_made():
    for b, e, f, i in ((8, 32 << 20, 2.0, None), (1, 100, 1.5, None), (1, 1000, None, 7), (3, 3, 2.0, None)):
        want = len(bench.size_sweep(b, e, f or 2.0, i))
        assert bench_args.sweep_length(b, e, f or 2.0, i, 1000) == want
    assert bench_args.sweep_length(1, 1 << 30, 2.0, 1, bench_args.MAX_SIZES) == bench_args.MAX_SIZES + 1
    assert bench_args.sweep_length(1, 1 << 60, 1.0000001, None, bench_args.MAX_SIZES) == bench_args.MAX_SIZES + 1
    assert len(parse(["-b", "1", "-e", "64", "-i", "1"]).sizes) == 64


def test_bench_memory_check_follows_the_hosts_memory(monkeypatch):
    monkeypatch.setattr(bench_args, "memory_limit", lambda: (2 << 30, "a 2 GiB cgroup"))
    assert parse([]).sizes[-1] == 32 << 20  # the defaults run in 2 GiB
    with pytest.raises(ValueError, match="argument -e/--maxbytes:.*2 GiB cgroup"):
        parse(["-e", "256M"])
    with pytest.raises(ValueError, match="argument --nprocs:"):
        parse(["--nprocs", "16", "-e", "8"], 16)
    with pytest.raises(ValueError, match="argument --bound_bytes:"):
        parse(["--bound", "--bound_bytes", "1G"])
    parse(["--bound_bytes", "1G"])  # only --bound allocates it
    # int8 patterns are built from int64 indices: 8 bytes per element
    assert bench_args.rank_bytes("all_reduce", 1 << 20, 1) > bench_args.rank_bytes("all_reduce", 1 << 20, 4)


def test_bench_nprocs_within_the_cgroups_tasks(monkeypatch):
    monkeypatch.setattr(bench_args, "tasks_left", lambda: (30, 64))
    with pytest.raises(ValueError, match=r"argument --nprocs:.*pids.max 64"):
        parse(["--nprocs", "4"], 4)
    parse(["--nprocs", "2"], 2)


def test_bench_limits_read_this_host():
    limits = sys.modules["railcc_bench_limits"]
    mem, what = limits.memory_limit()
    assert mem > 0 and what
    assert mem <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    left, most = limits.tasks_left()
    assert (left is None) == (most is None)
    assert 1 <= bench_args.max_nprocs() <= bench_args.MAX_NPROCS


def _descendants(pid):
    """Every process below pid (from /proc: children of children too)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _alive(pid):
    """Running, not gone and not a zombie waiting for whoever adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_bench_ranks_die_when_the_parent_is_killed(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        parent = subprocess.Popen([sys.executable, BENCH, "--nprocs", "2", "--backend", "gloo", "-b", "8", "-e", "8",
                                   "-n", "1000000", "-w", "0", "--timeout", "30"], stdout=f, stderr=subprocess.STDOUT,
                                  cwd=ROOT)
    kids = []
    try:
        deadline = time.monotonic() + 45
        while "rank   1" not in out.read_text():  # both ranks are up and in the timed loop
            assert parent.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        kids = _descendants(parent.pid)
        assert len(kids) >= 2, kids
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if _alive(k)], ("outlived the parent", kids, out.read_text())
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for k in kids:
            if _alive(k):
                try:
                    os.kill(k, signal.SIGKILL)
                except OSError:
                    pass


# ------------------------------------------------------------------------------------------------
# railcc.failed_ranks


@needs_railcc
@pytest.mark.parametrize("args,kwargs,name", [
    (("x",), {}, "group"),
    ((True,), {}, "group"),  # failed_ranks(group_ranks) by mistake
    ((), {"group": 3}, "group"),
    ((None, "yes"), {}, "group_ranks"),
    ((), {"group_ranks": 1}, "group_ranks"),
])
def test_failed_ranks_names_a_wrong_type(args, kwargs, name):
    import railcc

    with pytest.raises(TypeError, match=rf"railcc.failed_ranks: {name} must be"):
        railcc.failed_ranks(*args, **kwargs)


@needs_railcc
def test_failed_ranks_without_a_group_still_says_so():
    import railcc

    with pytest.raises(ValueError, match="no default process group"):
        railcc.failed_ranks()


# ------------------------------------------------------------------------------------------------
# python -m railcc COMMAND (railcc/cli/): every spelling reaches the command's own parser


@needs_railcc
@pytest.mark.timeout(120)
def test_every_spelling_of_the_command_line_reaches_its_parser():
    p = run([sys.executable, "-m", "railcc", "--help"])
    assert p.returncode == 0, p.stderr
    for cmd in ("env [--markdown]", "bench ...", "trace DIR", "doctor", "topo", "sim"):
        assert f"python -m railcc {cmd}" in p.stdout, p.stdout
    p = run([sys.executable, "-m", "railcc", "no-such-command"])
    assert p.returncode == 2 and "invalid choice" in p.stderr, p.stderr
    # options after the command are the command's, --help included
    for argv, usage in ((["-m", "railcc", "bench", "--help"], "usage: railcc-bench"),
                        (["-m", "railcc.bench", "--help"], "usage: railcc-bench"),
                        (["-m", "railcc", "sim", "--help"], "usage: python -m railcc sim"),
                        (["-m", "railcc", "trace", "--help"], "usage: python -m railcc trace"),
                        (["-m", "railcc", "env", "--help"], "--markdown")):
        p = run([sys.executable, *argv])
        assert p.returncode == 0 and usage in p.stdout, (argv, p.stdout, p.stderr)
    assert_usage_error(run([sys.executable, "-m", "railcc", "bench", "--backend", "gloo", "-n", "0"]), "-n/--iters")
