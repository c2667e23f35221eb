"""Tests of railcc-bench (python/railcc/bench/: runner.py and its siblings).

The arithmetic is tested directly; the launcher and the table end to end through a subprocess,
with gloo so they run before the railcc extension exists. The runner file is loaded by path and
run as a script, because `import railcc.bench` (like `python -m railcc.bench`) imports the railcc
package, which needs the built extension. No test asserts
anything about timings.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import harness

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(ROOT, "python", "railcc", "bench", "runner.py")

bench = harness.load_bench_runner("railcc_bench_under_test")
bench_args = sys.modules["railcc_bench_args"]  # its command line (bench/args.py)

needs_railcc = pytest.mark.skipif(not harness.railcc_built(), reason="the railcc extension (railcc._C) is not built")

RESULT_KEYS = {
    "backend", "op", "size", "count", "type", "redop", "root", "inplace", "time_us", "algbw", "busbw", "wrong",
}
META_KEYS = {"world_size", "backends", "op", "dtype", "redop", "hostname", "torch_version", "argv", "device"}
ALL_COLLS = list(bench.COLLS)


def run_bench(args, timeout=180, script=BENCH):
    """Runs the bench as a script; a hang fails this test instead of the whole CI job."""
    try:
        return subprocess.run(
            [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"railcc-bench did not finish within {timeout}s:\n{e.stdout}\n{e.stderr}")


def assert_schema(doc, world_size, backends, colls):
    assert set(doc) >= {"meta", "results", "bound", "peak_rss_kib", "not_run"}
    meta = doc["meta"]
    assert META_KEYS <= set(meta)
    assert meta["device"] == "cpu" or meta["device"].startswith("cuda:")
    assert meta["world_size"] == world_size
    assert meta["backends"] == backends
    assert meta["op"] == colls
    assert isinstance(meta["argv"], list)
    assert len(doc["peak_rss_kib"]) == world_size and all(isinstance(x, int) and x > 0 for x in doc["peak_rss_kib"])
    assert doc["results"]
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS
        assert r["backend"] in backends and r["op"] in colls
        assert isinstance(r["inplace"], bool)
        assert isinstance(r["size"], int) and isinstance(r["count"], int) and r["count"] > 0
        assert r["time_us"] > 0
        # the figures hang together: algbw = size / time, busbw = algbw x factor
        assert math.isclose(r["algbw"], r["size"] / (r["time_us"] * 1e3), rel_tol=1e-9)
        assert math.isclose(r["busbw"], r["algbw"] * bench.busbw_factor(r["op"], world_size), rel_tol=1e-9)
        spec = bench.COLLS[r["op"]]
        assert (r["redop"] == "none") == (not spec.reduces)
        assert (r["root"] == -1) == (not spec.rooted)
        if not spec.inplace:
            assert not r["inplace"]
    for c in colls:
        for b in backends:
            assert any(r["op"] == c and r["backend"] == b for r in doc["results"]), (c, b)


def table_rows(stdout):
    """Data rows of the table, split into cells."""
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


# ------------------------------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize(
    "text,value",
    [
        ("8", 8),
        ("0", 0),
        ("64K", 65536),
        ("64k", 65536),
        ("1M", 1 << 20),
        ("32M", 32 << 20),
        ("2G", 2 << 30),
        ("1.5K", 1536),
        ("4KB", 4096),
        ("4KiB", 4096),
        (" 16 M ", 16 << 20),
        ("1T", 1 << 40),
    ],
)
def test_parse_size(text, value):
    assert bench.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "-1", "1X", "1.3", "12KK", "abc", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        bench.parse_size(text)


def test_sweep_by_factor():
    assert bench.size_sweep(8, 64 << 10, 4) == [8, 32, 128, 512, 2048, 8192, 32768]
    assert bench.size_sweep(8, 128, 2) == [8, 16, 32, 64, 128]
    assert bench.size_sweep(1 << 20, 1 << 20, 2) == [1 << 20]
    # a fractional factor still makes progress from tiny sizes
    sizes = bench.size_sweep(1, 10, 1.5)
    assert sizes[0] == 1 and sizes[-1] <= 10 and sizes == sorted(set(sizes))


def test_sweep_by_bytes():
    assert bench.size_sweep(1024, 4096, stepbytes=1024) == [1024, 2048, 3072, 4096]
    assert bench.size_sweep(100, 350, stepbytes=100) == [100, 200, 300]


@pytest.mark.parametrize(
    "args", [(64, 8, 2), (0, 8, 2), (8, 64, 1), (8, 64, 0.5), (8, 64, 2, 0)]
)
def test_sweep_rejects(args):
    with pytest.raises(ValueError):
        bench.size_sweep(*args)


def test_elem_count_rounds_to_whole_pieces():
    # a plain collective: whole elements
    assert bench.elem_count("all_reduce", 1000, 4, 8) == (250, 1000)
    assert bench.elem_count("all_reduce", 1001, 4, 8) == (250, 1000)
    # per-rank pieces: count is one piece, size the whole array
    assert bench.elem_count("all_gather", 1024, 4, 8) == (32, 1024)
    assert bench.elem_count("reduce_scatter", 1000, 4, 3) == (83, 996)
    assert bench.elem_count("alltoall", 4096, 2, 4) == (512, 4096)
    assert bench.elem_count("all_gather", 8, 4, 4) == (0, 0)
    # coalesced: count per tensor, size over all tensors
    assert bench.elem_count("allreduce_coalesced", 1024, 4, 2, ntensors=256) == (256, 256 * 1024)
    assert bench.elem_count("sendrecv", 8, 8, 2) == (1, 8)


# ------------------------------------------------------------------------------------------------
# Bandwidth arithmetic


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("coll", ALL_COLLS)
def test_busbw_factor(coll, n):
    expected = {
        "all_reduce": 2 * (n - 1) / n,
        "allreduce_coalesced": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "alltoall": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
        "sendrecv": 1.0,
    }[coll]
    assert bench.busbw_factor(coll, n) == pytest.approx(expected)


def test_busbw_factor_known_values():
    assert bench.busbw_factor("all_reduce", 1) == 0
    assert bench.busbw_factor("all_reduce", 2) == 1.0
    assert bench.busbw_factor("all_reduce", 8) == 1.75
    assert bench.busbw_factor("all_gather", 4) == 0.75
    with pytest.raises(ValueError):
        bench.busbw_factor("nope", 2)
    with pytest.raises(ValueError):
        bench.busbw_factor("all_reduce", 0)


def test_bandwidths():
    # 1 GB in 1 s
    algbw, busbw = bench.bandwidths(10**9, 1e6, "all_reduce", 4)
    assert algbw == pytest.approx(1.0)
    assert busbw == pytest.approx(1.5)
    # 32 MiB in 1000 us
    algbw, busbw = bench.bandwidths(32 << 20, 1000.0, "all_gather", 8)
    assert algbw == pytest.approx((32 << 20) / 1e-3 / 1e9)
    assert busbw == pytest.approx(algbw * 7 / 8)
    algbw, busbw = bench.bandwidths(4096, 2.0, "sendrecv", 2)
    assert algbw == busbw == pytest.approx(4096 / 2e3)
    assert bench.bandwidths(8, None, "all_reduce", 2) == (None, None)
    assert bench.bandwidths(8, 0.0, "all_reduce", 2) == (None, None)


def test_shared_device_min_time_us():
    # N ranks read S bytes each and write S bytes each: 2*N*S bytes at B GB/s (read+write)
    assert bench.shared_device_min_time_us(10**9, 2, 100.0) == pytest.approx(40000.0)
    assert bench.shared_device_min_time_us(1000, 1, 1.0) == pytest.approx(2.0)
    for n in (1, 3, 8):
        s, b = 12345, 987.5
        assert bench.shared_device_min_time_us(s, n, b) == pytest.approx(2 * n * s / (b * 1e9) * 1e6)
    assert bench.shared_device_min_time_us(1000, 2, 0.0) is None
    assert bench.shared_device_min_time_us(1000, 2, None) is None
    with pytest.raises(ValueError):
        bench.shared_device_min_time_us(1000, 0, 1.0)


def test_bound_fraction():
    # cpu: busbw against the memcpy rate, whatever the collective
    assert bench.bound_fraction("broadcast", 8, 5.0, 2.0, 8.0) == 0.25
    assert bench.bound_fraction("all_reduce", 8, 5.0, None, 8.0) is None
    assert bench.bound_fraction("all_reduce", 8, 5.0, 2.0, 0.0) is None
    # cuda, 4 ranks on one device: t_min = 2*4*1e6 B / 100 GB/s = 80 us, timed at 160 us
    assert bench.bound_fraction("all_reduce", 10**6, 160.0, 1.0, 100.0, "cuda", 4) == pytest.approx(0.5)
    assert bench.bound_fraction("allreduce_coalesced", 10**6, 80.0, 1.0, 100.0, "cuda", 4) == pytest.approx(1.0)
    # no formula for other collectives, for ranks on several devices, or without a time
    assert bench.bound_fraction("all_gather", 10**6, 160.0, 1.0, 100.0, "cuda", 4) is None
    assert bench.bound_fraction("all_reduce", 10**6, 160.0, 1.0, 100.0, "cuda", None) is None
    assert bench.bound_fraction("all_reduce", 10**6, None, None, 100.0, "cuda", 4) is None


def test_bound_formula():
    assert bench.bound_formula("cpu") == "busbw / memcpy_gbps"
    shared = bench.bound_formula("cuda", 4)
    assert "2*N*S/B" in shared and "N = 4" in shared and "read+write" in shared
    assert bench.bound_formula("cuda", None).startswith("N/A")


def test_cuda_device_index():
    assert [bench.cuda_device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [bench.cuda_device_index(r, 2) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError):
        bench.cuda_device_index(0, 0)


def test_failure_reason():
    nccl = RuntimeError(
        "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details), "
        "NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
        "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"
    )
    assert bench.failure_reason(nccl) == (
        "RuntimeError: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"
    )
    # an empty 'Last error:' keeps the first line
    assert bench.failure_reason(RuntimeError("NCCL error: x\nLast error:\n")) == "RuntimeError: NCCL error: x"
    assert bench.failure_reason(ValueError("bad\nmore")) == "ValueError: bad"
    assert bench.failure_reason(KeyError()) == "KeyError: no message"
    long = bench.failure_reason(RuntimeError("x" * 1000), limit=50)
    assert len(long) == 50 and long.endswith("...") and "\n" not in long


def test_ratio():
    assert bench.ratio(10.0, 5.0) == 2.0
    assert bench.ratio(3.0, 6.0) == 0.5
    assert bench.ratio(1.0, 0.0) is None
    assert bench.ratio(None, 1.0) is None
    assert bench.ratio(1.0, None) is None


def test_average_busbw():
    recs = [
        bench.make_record("a", "all_reduce", 8, 2, "float", "sum", -1, False, 1.0, 1.0, 2.0, 0),
        bench.make_record("a", "all_reduce", 8, 2, "float", "sum", -1, True, 1.0, 1.0, 4.0, 0),
        bench.make_record("b", "all_reduce", 8, 2, "float", "sum", -1, False, 1.0, 1.0, 10.0, 0),
        bench.make_record("a", "all_gather", 8, 1, "float", "none", -1, False, 1.0, 1.0, 100.0, 0),
    ]
    assert bench.average_busbw(recs, "a", "all_reduce") == 3.0
    assert bench.average_busbw(recs, "b", "all_reduce") == 10.0
    assert bench.average_busbw(recs, "c", "all_reduce") is None


def test_iteration_times_slowest_rank():
    # rank 1 leaves the barrier 300 us after rank 0 and both finish together: rank 0 timed the wait
    starts = [[0, 10_000], [300_000, 10_000]]
    ends = [[400_000, 60_000], [400_000, 70_000]]
    assert bench.iteration_times(starts, ends, False) == [400.0, 60.0]
    # on one clock, from the last call to the last return
    assert bench.iteration_times(starts, ends, True) == [100.0, 60.0]


def test_iteration_times_one_rank():
    assert bench.iteration_times([[5_000]], [[7_500]], True) == [2.5]
    assert bench.iteration_times([[5_000]], [[7_500]], False) == [2.5]


@pytest.mark.timeout(60)
def test_store_barrier_holds_everyone_and_cleans_up():
    # Three clients of one real TCPStore, one thread each; the second one is always late. No
    # client may leave barrier k before the late one has arrived at it, and the keys of earlier
    # barriers are deleted as the barriers go.
    import threading
    import time as _time

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    port = server.port
    rounds, world = 5, 3
    arrived = [[None] * rounds for _ in range(world)]
    left = [[None] * rounds for _ in range(world)]
    errors = []

    def run(r):
        try:
            store = server if r == 0 else dist.TCPStore("127.0.0.1", port, world, False)
            bar = bench.StoreBarrier(store, world, prefix="t")
            for k in range(rounds):
                if r == 1:
                    _time.sleep(0.05)
                arrived[r][k] = _time.monotonic()
                bar()
                left[r][k] = _time.monotonic()
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for k in range(rounds):
        last_in = max(arrived[r][k] for r in range(world))
        assert all(left[r][k] >= last_in for r in range(world)), k
    assert not server.check([f"t/{k}" for k in range(1, rounds - 1)])  # only the last one remains
    assert server.check([f"t/{rounds}/done"])


def test_boot_id_names_this_kernel():
    ident = bench.boot_id()
    assert ident and ident == bench.boot_id()


# ------------------------------------------------------------------------------------------------
# Checking results


def test_count_wrong_counts_injected_elements():
    exp = bench.expected_output("all_reduce", 0, 4, 1000, torch.float32, "sum")
    got = exp.clone()
    assert bench.count_wrong(got, exp) == 0
    got[17] += 1
    assert bench.count_wrong(got, exp) == 1
    got[999] = float("nan")
    assert bench.count_wrong(got, exp) == 2
    got[500] = -got[500] - 1
    assert bench.count_wrong(got, exp) == 3
    with pytest.raises(ValueError):
        bench.count_wrong(got[:10], exp)


def test_count_wrong_with_tolerance():
    exp = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    got = torch.tensor([1.001, 2.0, float("nan")], dtype=torch.float32)
    assert bench.count_wrong(got, exp, tol=0.01) == 1  # NaN is wrong whatever the tolerance
    assert bench.count_wrong(got, exp, tol=1e-6) == 2


@pytest.mark.parametrize("dtype", list(bench.DTYPES))
@pytest.mark.parametrize("redop", ["sum", "prod", "min", "max"])
def test_expected_all_reduce_matches_a_plain_reduction(dtype, redop):
    td = getattr(torch, bench.DTYPES[dtype][0])
    n, count = 5, 257
    kind = bench.pattern_kind("all_reduce", redop)
    stack = torch.stack([bench.pattern(r, count, torch.float64, kind) for r in range(n)])
    ref = {
        "sum": stack.sum(0),
        "prod": stack.prod(0),
        "min": stack.min(0).values,
        "max": stack.max(0).values,
    }[redop]
    got = bench.expected_output("all_reduce", 2, n, count, td, redop)
    assert got.dtype == td
    # small n: no wrap-around, so the exact reference in float64 must agree
    assert torch.equal(got.to(torch.float64), ref)


def test_expected_avg_within_tolerance():
    n, count = 3, 64
    exp = bench.expected_output("all_reduce", 0, n, count, torch.bfloat16, "avg")
    parts = [bench.pattern(r, count, torch.bfloat16, "sum") for r in range(n)]
    # a backend that sums in bfloat16 and then divides
    backend = (sum(p.float() for p in parts) / n).to(torch.bfloat16)
    assert bench.count_wrong(backend, exp, bench.avg_tolerance("bfloat16", n)) == 0
    # leaving a rank out is caught
    missing = (sum(p.float() for p in parts[:-1]) / n).to(torch.bfloat16)
    assert bench.count_wrong(missing, exp, bench.avg_tolerance("bfloat16", n)) > 0


def test_expected_data_movement():
    n, count, td = 4, 6, torch.int32

    def pat(r, c=count, off=0):
        return bench.pattern(r, c, td, "data", off)

    # all_gather: everyone's piece in rank order
    assert torch.equal(bench.expected_output("all_gather", 1, n, count, td), torch.cat([pat(r) for r in range(n)]))
    # alltoall: piece j of the result is piece `rank` of rank j's input
    full = [pat(r, count * n) for r in range(n)]
    got = bench.expected_output("alltoall", 2, n, count, td)
    assert torch.equal(got, torch.cat([full[j][2 * count:3 * count] for j in range(n)]))
    # broadcast: the root's data; sendrecv: the left neighbour's
    assert torch.equal(bench.expected_output("broadcast", 0, n, count, td, root=3), pat(3))
    assert torch.equal(bench.expected_output("sendrecv", 0, n, count, td), pat(n - 1))
    # reduce: only the root has a defined result
    assert bench.expected_output("reduce", 1, n, count, td, "sum", root=2) is None
    assert bench.expected_output("reduce", 2, n, count, td, "sum", root=2) is not None
    # the data patterns of different ranks differ everywhere, so a piece from the wrong rank counts
    assert bench.count_wrong(pat(0), pat(1)) == count


def test_expected_reduce_scatter_and_coalesced():
    n, count, td = 3, 5, torch.float32
    full = [bench.pattern(r, count * n, td, "sum") for r in range(n)]
    total = sum(full)
    for rank in range(n):
        got = bench.expected_output("reduce_scatter", rank, n, count, td, "sum")
        assert torch.equal(got, total[rank * count:(rank + 1) * count])
    tensors = 4
    got = bench.expected_output("allreduce_coalesced", 0, n, count, td, "sum", ntensors=tensors)
    flat = sum(bench.pattern(r, count * tensors, td, "sum") for r in range(n))
    assert torch.equal(got, flat)


def test_patterns_fit_every_type():
    for dtype, (attr, _, _) in bench.DTYPES.items():
        td = getattr(torch, attr)
        for kind in ("sum", "prod", "minmax", "data"):
            v = bench.pattern(7, 500, td, kind)
            ref = bench.pattern(7, 500, torch.int64, kind)
            assert torch.equal(v.to(torch.int64), ref), (dtype, kind)


# ------------------------------------------------------------------------------------------------
# Records and report


def test_record_and_report_schema():
    rec = bench.make_record("gloo", "all_gather", 1024, 128, "float", "none", -1, True, 12.5, 0.08, 0.04, 0)
    assert set(rec) == RESULT_KEYS
    assert rec["inplace"] is True and rec["wrong"] == 0
    meta = {
        "world_size": 2, "backends": ["gloo"], "op": ["all_gather"], "dtype": "float", "redop": "sum",
        "hostname": "h", "torch_version": torch.__version__, "argv": ["railcc-bench"], "device": "cpu",
    }
    doc = bench.make_report(meta, [rec], None, [1000, 2000])
    text = json.dumps(doc, allow_nan=False)
    back = json.loads(text)
    assert back["bound"] is None
    assert back["not_run"] == []
    assert back["peak_rss_kib"] == [1000, 2000]
    assert back["results"] == [rec]
    assert META_KEYS <= set(back["meta"])


def test_table_layout():
    hdr = bench.table_header(["gloo"], False)
    assert "out-of-place" in hdr[0] and "in-place" in hdr[0]
    for name in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert name in hdr[1].split()
    assert hdr[1].split().count("time") == 2
    row = bench.table_row(8, 2, "float", "sum", -1, (12.345, 0.001, 0.002, 0), (None, None, None, None))
    cells = row.split()
    assert cells == ["8", "2", "float", "sum", "-1", "12.35", "0.00", "0.00", "0", "N/A", "N/A", "N/A", "N/A"]
    # each header word sits right above its column
    assert len(hdr[1]) == len(row)


def test_table_extra_columns():
    backends = ["railcc", "gloo", "mpi"]
    hdr = bench.table_header(backends, True)[1].split()
    assert hdr[-4:] == ["backend", "railcc/gloo", "railcc/mpi", "bound"]
    first = bench.extra_cells(backends, True, "railcc", {"gloo": 1.5, "mpi": None}, 0.25).split()
    assert first == ["railcc", "1.50", "N/A", "0.250"]
    other = bench.extra_cells(backends, True, "gloo", {"gloo": 1.5, "mpi": None}, None).split()
    assert other == ["gloo", "-", "-", "N/A"]


# ------------------------------------------------------------------------------------------------
# Argument checking


def parse(argv, world=2):
    args = bench.build_parser().parse_args(argv)
    return bench.validate(args, world, argv)


def test_split_ops():
    assert bench.split_ops([]) == (["all_reduce"], "sum")
    assert bench.split_ops(["all_gather,max"]) == (["all_gather"], "max")
    assert bench.split_ops(["alltoall", "sendrecv,ALLTOALL", "prod"]) == (["alltoall", "sendrecv"], "prod")
    with pytest.raises(ValueError, match="unknown operation"):
        bench.split_ops(["allreduce"])
    with pytest.raises(ValueError, match="at most one"):
        bench.split_ops(["sum,max"])


def test_validate_defaults():
    cfg = parse([])
    assert cfg.colls == ["all_reduce"] and cfg.redop == "sum" and cfg.dtype == "float"
    assert cfg.sizes[0] == 8 and cfg.sizes[-1] == 32 << 20
    assert cfg.backends == ["railcc"]


def test_validate_device():
    assert parse([]).device == "cpu"
    assert parse(["--device", "CPU"]).device == "cpu"


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


@no_cuda
def test_validate_cuda_without_cuda():
    with pytest.raises(ValueError, match=re.escape("argument --device:") + ".*cuda"):
        parse(["--device", "cuda"])


@no_cuda
def test_device_cuda_without_cuda_exits_2_before_any_rank():
    p = run_bench(["--device", "cuda", "--nprocs", "2", "--backend", "gloo"], timeout=60)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "error: argument --device:" in p.stderr and "cuda" in p.stderr
    assert "Traceback" not in p.stderr
    assert p.stdout == ""


def test_validate_aliases_and_lists():
    cfg = parse(["-d", "bf16", "-o", "all_gather,reduce_scatter", "-o", "min", "--backend", "railcc, gloo"])
    assert cfg.dtype == "bfloat16" and cfg.colls == ["all_gather", "reduce_scatter"] and cfg.redop == "min"
    assert cfg.backends == ["railcc", "gloo"]


@pytest.mark.parametrize(
    "argv,world,arg",
    [
        (["-b", "1M", "-e", "1K"], 2, "-b/--minbytes"),
        (["-b", "0"], 2, "-b/--minbytes"),
        (["-f", "1"], 2, "-f/--stepfactor"),
        (["-f", "2", "-i", "1K"], 2, "-f/--stepfactor"),
        (["-o", "allgather"], 2, "-o/--op"),
        (["-o", "sum,max"], 2, "-o/--op"),
        (["-d", "float128"], 2, "-d/--datatype"),
        (["-d", "int32", "-o", "avg"], 2, "-o/--op"),
        (["-o", "sendrecv"], 1, "-o/--op"),
        (["-o", "broadcast", "-r", "2"], 2, "-r/--root"),
        (["-n", "0"], 2, "-n/--iters"),
        (["-w", "-1"], 2, "-w/--warmup_iters"),
        (["-c", "2"], 2, "-c/--check"),
        (["--backend", "gloo,gloo"], 2, "--backend"),
        (["--backend", ","], 2, "--backend"),
        (["--backend", "openmpi,gloo"], 2, "--backend"),
        (["--backend", "fake,gloo"], 2, "--backend"),
        (["--ntensors", "0"], 2, "--ntensors"),
    ],
)
def test_validate_rejects(argv, world, arg):
    with pytest.raises(ValueError, match=re.escape(f"argument {arg}:")):
        parse(argv, world)


def test_avg_on_integers_is_fine_for_data_movement():
    # the reduction only matters to collectives that reduce
    cfg = parse(["-d", "int8", "-o", "all_gather,avg"])
    assert cfg.colls == ["all_gather"]


def test_root_only_checked_for_rooted():
    parse(["-o", "all_reduce", "-r", "5"], 2)


def test_check_backends():
    bench.check_backends(["gloo"])
    with pytest.raises(ValueError, match="argument --backend: nosuchbackend"):
        bench.check_backends(["gloo", "nosuchbackend"])


def test_bad_arguments_exit_2_naming_the_argument():
    # errors come before any rank starts, so these are quick
    for argv, needle in [
        (["-b", "64K", "-e", "8", "--backend", "gloo"], "-b/--minbytes"),
        (["-b", "12Q", "--backend", "gloo"], "-b/--minbytes"),
        (["-o", "nosuchop", "--backend", "gloo"], "-o/--op"),
        (["-d", "nosuchtype", "--backend", "gloo"], "-d/--datatype"),
        (["-o", "sendrecv", "--nprocs", "1", "--backend", "gloo"], "-o/--op"),
        (["--backend", "nosuchbackend"], "--backend"),
        (["--device", "gpu", "--backend", "gloo"], "--device"),
    ]:
        p = run_bench(argv, timeout=60)
        assert p.returncode == 2, (argv, p.stdout, p.stderr)
        assert "error: argument " + needle in p.stderr, (argv, p.stderr)
        assert p.stdout == ""


def test_plot_without_matplotlib_is_a_clear_error():
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed")
    p = run_bench(["--backend", "gloo", "--plot", "x.png"], timeout=60)
    assert p.returncode == 2
    assert "argument --plot" in p.stderr and "matplotlib" in p.stderr


# ------------------------------------------------------------------------------------------------
# Supervising ranks


def test_supervise_kills_the_rest_when_a_rank_fails():
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=os._exit, args=(1,)), ctx.Process(target=time.sleep, args=(120,))]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    assert bench.supervise(procs, grace=0.5) == bench.EXIT_FAILED
    assert time.monotonic() - t0 < 60
    assert not any(p.is_alive() for p in procs)


def test_supervise_success_and_wrong_results():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=os._exit, args=(0,)) for _ in range(2)]
    for p in procs:
        p.start()
    assert bench.supervise(procs) == bench.EXIT_OK
    procs = [ctx.Process(target=os._exit, args=(bench.EXIT_WRONG,)) for _ in range(2)]
    for p in procs:
        p.start()
    assert bench.supervise(procs) == bench.EXIT_WRONG


# ------------------------------------------------------------------------------------------------
# One rank in this process: the buffers and the check, without starting processes


@pytest.fixture
def one_rank_gloo():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _cfg(**kw):
    base = dict(
        colls=["all_reduce"], redop="sum", dtype="float", sizes=[64], backends=["gloo"], iters=2, warmup=1,
        check=True, root=0, ntensors=3,
    )
    base.update(kw)
    return bench_args.Config(**base)


@pytest.mark.parametrize("coll", [c for c in ALL_COLLS if bench.COLLS[c].min_ranks == 1])
def test_case_checks_and_catches_a_corrupted_result(one_rank_gloo, coll, monkeypatch):
    group = one_rank_gloo
    cfg = _cfg(colls=[coll], dtype="int32", redop="max")
    case = bench.Case(coll, 16, 0, 1, cfg)
    for inplace in (False, True) if bench.COLLS[coll].inplace else (False,):
        t = bench.time_collective(case, group, inplace, 2, 1, group)
        assert t > 0
        assert case.check(group, inplace) == 0

    real = bench.Case.runner

    def corrupting(self, grp, inplace):
        run = real(self, grp, inplace)

        def go():
            run()
            if self.coll == "allreduce_coalesced":  # result() is a concatenated copy
                (self.ip if inplace else self.res)[0][3] += 1
            else:
                self.result(inplace).view(-1)[3] += 1

        return go

    monkeypatch.setattr(bench.Case, "runner", corrupting)
    for inplace in (False, True) if bench.COLLS[coll].inplace else (False,):
        assert case.check(group, inplace) == 1, inplace


def test_case_buffers_on_the_given_device(one_rank_gloo):
    case = bench.Case("allreduce_coalesced", 8, 0, 1, _cfg(colls=["allreduce_coalesced"]), device="cpu")
    assert case.device == torch.device("cpu")
    assert all(t.device == case.device for t in case.src + case.res + case.ip)
    assert case.check(one_rank_gloo, False) == 0


def test_run_agreed(one_rank_gloo):
    assert bench.run_agreed(lambda: 5, one_rank_gloo, 1) == (5, None)

    def fails():
        raise RuntimeError("no device buffers here\nmore detail")

    # every rank gets the reason, in one line, and no result
    assert bench.run_agreed(fails, one_rank_gloo, 1) == (None, "RuntimeError: no device buffers here")


def test_case_catches_a_collective_that_writes_nothing(one_rank_gloo, monkeypatch):
    group = one_rank_gloo
    case = bench.Case("all_gather", 16, 0, 1, _cfg(colls=["all_gather"]))
    bench.time_collective(case, group, False, 2, 0, group)  # leaves correct results behind
    monkeypatch.setattr(bench.Case, "runner", lambda self, g, inplace: (lambda: None))
    # the check poisons the output first, so stale correct data from the timed runs does not pass
    assert case.check(group, False) == 16


def test_memcpy_bandwidth_restores_threads():
    before = torch.get_num_threads()
    bw = bench.memcpy_bandwidth(1 << 20, repeats=2)
    assert bw > 0
    assert torch.get_num_threads() == before


# ------------------------------------------------------------------------------------------------
# End to end


E2E_COLLS = [
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv", "allreduce_coalesced",
]


HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "out.json"
    # the plot rides along when it can, instead of paying for a run of its own
    plot = ["--plot", str(tmp / "bw.png")] if HAVE_MATPLOTLIB else []
    p = run_bench(
        ["--nprocs", "2", "--backend", "gloo", "-b", "8", "-e", "64K", "-f", "4", "-n", "3", "-w", "1", "-c", "1",
         "--json", str(out), "-o", ",".join(E2E_COLLS), "--ntensors", "4", "-r", "1",
         "--bound", "--bound_bytes", "1M", *plot],
        timeout=240,
    )
    return p, out


def test_e2e_gloo_runs_clean(gloo_run):
    p, _ = gloo_run
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr


def test_e2e_gloo_table(gloo_run):
    p, _ = gloo_run
    rows = table_rows(p.stdout)
    # 8 B still holds one float per rank on two ranks, so every collective keeps all 7 sizes
    assert len(rows) == 7 * len(E2E_COLLS)
    for cells in rows:
        assert len(cells) == 14  # 13 nccl-tests columns + bound
        assert cells[8] == "0", cells  # out-of-place #wrong
        assert cells[12] in ("0", "N/A"), cells
    assert p.stdout.count("# Avg bus bandwidth : ") == len(E2E_COLLS)
    assert "# Peak RSS" in p.stdout
    # alltoall and sendrecv have no in-place form
    assert sum(1 for r in rows if r[9:13] == ["N/A"] * 4) == 2 * 7


def test_e2e_gloo_json(gloo_run):
    p, out = gloo_run
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert_schema(doc, 2, ["gloo"], E2E_COLLS)
    assert all(r["wrong"] == 0 for r in doc["results"])
    assert doc["bound"]["memcpy_gbps"] > 0
    assert doc["bound"]["device"] == "cpu" and doc["bound"]["formula"] == "busbw / memcpy_gbps"
    assert len(doc["bound"]["fractions"]) == 7 * len(E2E_COLLS)
    assert doc["meta"]["device"] == "cpu" and doc["not_run"] == []
    assert doc["meta"]["same_clock"] is True  # both ranks run on this host
    sizes = sorted({r["size"] for r in doc["results"] if r["op"] == "all_reduce"})
    assert sizes == [8, 32, 128, 512, 2048, 8192, 32768]
    coalesced = [r for r in doc["results"] if r["op"] == "allreduce_coalesced"]
    assert all(r["size"] == 4 * r["count"] * 4 for r in coalesced)
    assert {r["root"] for r in doc["results"] if r["op"] in ("broadcast", "reduce")} == {1}


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
def test_e2e_plot(gloo_run):
    p, out = gloo_run
    assert p.returncode == 0, p.stderr
    png = out.parent / "bw.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_e2e_two_backends(tmp_path):
    # A second name for gloo, registered by a wrapper script that every spawned rank re-runs,
    # exercises comparing backends before railcc exists.
    wrapper = tmp_path / "bench_two.py"
    wrapper.write_text(
        textwrap.dedent(
            f"""
            import importlib.util, sys
            import torch.distributed as dist

            def _make(store, rank, size, timeout):
                return dist.ProcessGroupGloo(store, rank, size, timeout)

            dist.Backend.register_backend("gloo2", _make, devices=["cpu"])
            spec = importlib.util.spec_from_file_location("railcc_bench_two", {BENCH!r})
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            if __name__ == "__main__":
                sys.exit(mod.main())
            """
        )
    )
    out = tmp_path / "two.json"
    p = run_bench(
        ["--nprocs", "2", "--backend", "gloo,gloo2", "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1",
         "-c", "1", "-o", "all_reduce,sendrecv", "--json", str(out), "--device", "cpu"],
        timeout=180,
        script=str(wrapper),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = table_rows(p.stdout)
    assert len(rows) == 2 * 2 * 4  # 2 collectives x 2 backends x 4 sizes
    for cells in rows:
        assert len(cells) == 15  # 13 + backend + one ratio
        assert cells[13] in ("gloo", "gloo2")
        if cells[13] == "gloo":
            float(cells[14])
        else:
            assert cells[14] == "-"
    assert "(gloo2)" in p.stdout
    doc = json.loads(out.read_text())
    assert_schema(doc, 2, ["gloo", "gloo2"], ["all_reduce", "sendrecv"])
    assert all(r["wrong"] == 0 for r in doc["results"])
    assert len(doc["ratios"]) == 2 * 4 and all(r["ratio"] > 0 for r in doc["ratios"])


@needs_railcc
def test_e2e_railcc_against_gloo(tmp_path):
    out = tmp_path / "railcc.json"
    colls = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "alltoall", "sendrecv"]
    p = run_bench(
        ["--nprocs", "2", "--backend", "railcc,gloo", "-b", "8", "-e", "64K", "-f", "4", "-n", "3", "-w", "1",
         "-c", "1", "-o", ",".join(colls), "--json", str(out)],
        timeout=240,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert_schema(doc, 2, ["railcc", "gloo"], colls)
    assert all(r["wrong"] == 0 for r in doc["results"] if r["backend"] == "railcc")


@needs_railcc
def test_e2e_railcc_dtypes_and_reductions(tmp_path):
    # one float type with the rounding reduction, one integer type; the collective tests own the rest
    for dtype, redop in [("bfloat16", "avg"), ("int8", "max")]:
        p = run_bench(
            ["--nprocs", "2", "--backend", "railcc", "-b", "4", "-e", "16K", "-f", "64", "-n", "1", "-w", "1",
             "-c", "1", "-d", dtype, "-o", "all_reduce,reduce_scatter,allreduce_coalesced," + redop,
             "--ntensors", "8"],
            timeout=180,
        )
        assert p.returncode == 0, (dtype, redop, p.stdout + p.stderr)


# ------------------------------------------------------------------------------------------------
# References: c10d's dispatch floor (torch's fake process group) and Open MPI through mpi4py


def _mpi_ready():
    # The probe railcc-bench and bench_loop.py run before they launch Open MPI (loaded with the
    # bench file above, so without the railcc package).
    return bench.bench_mpi.missing() == ""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _mpi_ready(), reason="Open MPI and mpi4py are not installed (scripts/install.sh installs them)")
def test_fake_and_openmpi_rows_beside_gloo(tmp_path):
    out = tmp_path / "r.json"
    colls = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv"]
    p = run_bench(["--nprocs", "2", "--backend", "gloo,fake,openmpi", "-o", ",".join(colls), "-b", "8", "-e", "4K",
                   "-f", "512", "-n", "3", "-w", "1", "--json", str(out)], timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert_schema(doc, 2, ["gloo", "fake", "openmpi"], colls)
    assert doc["meta"]["openmpi"]["library"].startswith("Open MPI"), doc["meta"]["openmpi"]
    pages = "transparent huge pages" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "4 KiB pages"
    assert f"numpy buffers on {pages}" in doc["meta"]["openmpi"]["library"], doc["meta"]["openmpi"]
    assert "# openmpi: Open MPI" in p.stdout, p.stdout
    # Both references are ratio columns against the first backend; neither result is checked.
    header = next(ln for ln in p.stdout.splitlines() if "backend" in ln and "gloo/fake" in ln)
    assert "gloo/openmpi" in header, header
    for r in doc["results"]:
        assert (r["wrong"] is None) == (r["backend"] != "gloo"), r
    sizes = {(r["op"], r["size"]) for r in doc["results"] if r["backend"] == "openmpi"}
    assert sizes == {(r["op"], r["size"]) for r in doc["results"] if r["backend"] == "gloo"}


@pytest.mark.parametrize("thp, numpy_thp", [(None, "0"), ("0", "0"), ("1", "1")])
def test_openmpi_buffers_get_the_pages_torch_tensors_get(monkeypatch, thp, numpy_thp):
    # numpy puts large arrays on transparent huge pages unless told not to; torch does so only
    # under THP_MEM_ALLOC_ENABLE=1. The reference must time the same kind of memory.
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1" if numpy_thp == "0" else "0")  # overridden either way
    if thp is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", thp)
    cmd, env = bench.bench_mpi.launch(2, ["x"])
    assert env["NUMPY_MADVISE_HUGEPAGE"] == numpy_thp
    assert cmd[0] == "mpirun" and cmd[-1] == "x"


@pytest.mark.timeout(300)
def test_openmpi_without_mpirun_is_said_and_the_rest_runs(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))  # no mpirun on it
    p = subprocess.run([sys.executable, BENCH, "--nprocs", "2", "--backend", "gloo,openmpi", "-b", "8", "-e", "8",
                        "-n", "2", "-w", "1"], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# openmpi: not run (mpirun not found" in p.stdout, p.stdout
    assert len(table_rows(p.stdout)) == 1, p.stdout  # the gloo row alone


def test_bench_tables_takes_each_cell_whole_from_the_median_run_or_each_backends_best():
    # Three runs of one sweep: each cell comes from the run whose railcc time is the median, so
    # its ratios still compare one run; the bound of that cell is that run's.
    path = os.path.join(ROOT, "tools", "bench_tables.py")
    spec = importlib.util.spec_from_file_location("bench_tables_under_test", path)
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)

    def run(railcc_us, mpi_us, rate):
        res = [{"backend": b, "op": "all_reduce", "size": 1 << 20, "inplace": False, "time_us": t,
                "busbw": (1 << 20) / t / 1e3} for b, t in (("railcc", railcc_us), ("openmpi", mpi_us))]
        return {"results": res, "bound": {"memcpy_gbps": rate, "bytes": 1 << 28}}

    merged = tables.median_runs([run(300, 100, 10.0), run(100, 400, 20.0), run(200, 100, 5.0)])
    cell = {r["backend"]: r for r in merged["results"]}
    assert cell["railcc"]["time_us"] == 200 and cell["openmpi"]["time_us"] == 100  # one run, whole
    md = tables.tables(merged)
    row = [ln for ln in md.splitlines() if ln.startswith("| 1 MiB")][0].split("|")
    assert row[4].strip() == "2.00"  # railcc/MPI of that run
    assert row[5].strip() == f"{(1 << 20) / 200 / 1e3 / 5.0:.2f}"  # against that run's bound
    assert "5.00" in md and "of 3" in md
    assert tables.median_runs([run(300, 100, 10.0)])["results"][0]["time_us"] == 300

    # --best: every backend's own best over the runs, the ratio of those bests.
    best = tables.best_runs([run(300, 100, 10.0), run(100, 400, 20.0), run(200, 90, 5.0)])
    cell = {r["backend"]: r for r in best["results"]}
    assert cell["railcc"]["time_us"] == 100 and cell["openmpi"]["time_us"] == 90
    md = tables.tables(best)
    row = [ln for ln in md.splitlines() if ln.startswith("| 1 MiB")][0].split("|")
    assert row[4].strip() == f"{100 / 90:.2f}"
    assert "best time of 3 runs" in md


# ------------------------------------------------------------------------------------------------
# tools/bench_loop.py: the cost of a steady stream of calls, with each rank's CPU and switches

LOOP = os.path.join(ROOT, "tools", "bench_loop.py")


@needs_railcc
@pytest.mark.timeout(300)
def test_bench_loop_prints_a_row_per_backend_with_a_busy_process_beside():
    backends = ["railcc", "fake"] + (["openmpi"] if _mpi_ready() else [])
    p = run_bench(["--nprocs", "2", "--backend", ",".join(backends), "-o", "all_reduce", "-s", "64", "-n", "200",
                   "-w", "10", "--hog", "1"], timeout=240, script=LOOP)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in p.stdout.splitlines() if ln.strip() and not ln.startswith("#")}
    assert list(rows) == backends, p.stdout
    for name, cols in rows.items():
        # us/call, user us, sys us, involuntary and voluntary switches per call, then the busy process's
        # CPUs during the loop, or "-" and a note where the loop was too short to read them (clock ticks)
        us, user, sys_, invol, vol = map(float, cols[:5])
        assert us > 0 and user >= 0 and sys_ >= 0 and invol >= 0 and vol >= 0, (name, cols)
        if cols[5] == "-":
            assert "loop: -n more" in " ".join(cols[6:]), (name, cols)
        else:
            assert len(cols) == 6 and 0 <= float(cols[5]) <= 1.05, (name, cols)  # one busy process: at most a CPU


@pytest.mark.parametrize("args", [["--nprocs", "0"], ["-s", "-1"], ["--hog", "-2"], ["-o", "gather"],
                                  ["--backend", "railcc,nccl2"]])
def test_bench_loop_rejects_bad_arguments(args):
    p = run_bench(args, timeout=60, script=LOOP)
    assert p.returncode == 2 and "error:" in p.stderr, p.stdout + p.stderr


# ------------------------------------------------------------------------------------------------
# tools/bench_gap.py: a call after a gloo barrier or emptied caches, both ranks on one clock

GAP = os.path.join(ROOT, "tools", "bench_gap.py")


@needs_railcc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [[], ["--thrash", "64K", "--no-pin"]])
def test_bench_gap_prints_both_settings_for_railcc_and_the_fake_group(extra):
    p = run_bench(["-n", "30"] + extra, timeout=240, script=GAP)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.strip() and not ln.startswith("#")][1:]
    assert [r[0] for r in rows] == ["railcc", "railcc", "fake", "fake"], p.stdout
    for r in rows:
        span, skew, own = map(float, r[-3:])
        assert span > 0 and skew >= 0 and own > 0, (r, p.stdout)
    assert ("after writing 65536 bytes" if extra else "after a gloo barrier") in p.stdout


@pytest.mark.parametrize("args", [["-n", "0"], ["-s", "2"], ["--thrash", "-1"], ["--thrash", "lots"]])
def test_bench_gap_rejects_bad_arguments(args):
    p = run_bench(args, timeout=60, script=GAP)
    assert p.returncode == 2 and "error:" in p.stderr, p.stdout + p.stderr
