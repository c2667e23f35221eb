"""Tests of the scale harness (tools/scale_harness.py), end to end at 4 ranks.

The harness is run as a script, as a user runs it, with one rank per fake host (every pair
of ranks over loopback TCP) and two (shared memory inside a host, TCP between the two): it
must finish, every rank must report every metric for railcc and for gloo, the JSON must hold
what the tables were made from, and no rank may outlive the harness. A rank that fails must be
reported with its error, not hang the harness. No test asserts anything about timings.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HARNESS = os.path.join(ROOT, "tools", "scale_harness.py")
NRANKS = 4

# Every per-rank number the tables show; the harness's own list must not drift from it.
METRICS = ["init_ms", "first_op_ms", "cpu_ms", "first_op_cpu_ms", "sys_cpu_ms", "page_faults", "waits", "private_mib", "rss_mib", "heap_kib", "fds", "fds_added", "sockets", "tcp_conns", "store_conns",
           "tcp_listen", "threads", "ar8_us", "bc8_us", "ar1m_ms", "tcp_conns_ops"]
COUNTS = ["fds", "sockets", "store_conns", "tcp_listen", "threads", "page_faults", "waits"]  # whole numbers, at least 1 or 0


def run_harness(args, env=None, timeout=100):
    """Runs the harness as a script; a hang fails this test instead of the whole CI job."""
    try:
        return subprocess.run([sys.executable, HARNESS, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the harness did not finish within {timeout}s:\n{e.stdout}\n{e.stderr}")


def _load_harness():
    """The harness as a module, for its functions that need no ranks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_harness_under_test", HARNESS)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return harness


def assert_no_rank_left(doc):
    # Every rank recorded its pid; the harness reaps its ranks before it exits, so none exists
    # any more (a leaked rank would be reparented and still answer signal 0).
    for run in doc["runs"]:
        for d in run["ranks"]:
            with pytest.raises(ProcessLookupError):
                os.kill(d["pid"], 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("per_host", [1, 2])
def test_every_rank_reports_every_metric(tmp_path, per_host):
    out = tmp_path / "scale.json"
    proc = run_harness(["-n", str(NRANKS), "--per-host", str(per_host), "--backends", "railcc,gloo",
                        "--iters", "3", "--timeout", "60", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["metrics"] == METRICS
    assert [(r["backend"], r["nranks"], r["per_host"]) for r in doc["runs"]] == [
        ("railcc", NRANKS, per_host), ("gloo", NRANKS, per_host)]
    hosts = sorted({f"h{r // per_host}" for r in range(NRANKS)})
    for run in doc["runs"]:
        where = f"{run['backend']}, per-host {per_host}"
        assert run["ok"] and not run["errors"] and not run["problems"] and not run["killed"], (where, run)
        assert [d["rank"] for d in run["ranks"]] == list(range(NRANKS)), where
        for d in run["ranks"]:
            assert d["host"] == f"h{d['rank'] // per_host}", (where, d)
            missing = [k for k in METRICS if not isinstance(d.get(k), (int, float)) or not math.isfinite(d[k])]
            assert not missing, (where, d["rank"], missing, d)
            bad = [k for k in COUNTS if not isinstance(d[k], int) or d[k] < 0]
            assert not bad, (where, d["rank"], bad, d)
            # The rank's own store client is open before init and still after it.
            assert d["store_conns"] >= 1, (where, d)
            # Connections made by the end of the timed ops include those made by init.
            assert d["tcp_conns_ops"] >= d["tcp_conns"], (where, d)
        assert sorted(run["shm_per_host"]) == hosts, (where, run["shm_per_host"])
        # The machine's CPU time over the job's init, by kind, as shares of that time.
        m = run["machine"]
        assert m is not None and m["window_ms"] > 0 and m["ticks"] >= 0, (where, m)
        shares = [m[f"{k}_pct"] for k in ("user", "sys", "idle", "steal")]
        assert all(0 <= x <= 100 for x in shares), (where, m)
        assert m["ticks"] == 0 or sum(shares) == pytest.approx(100), (where, m)
    # Shared-memory accounting: railcc's ranks of one host map the host's segments (counted once
    # per host); a rank alone on its host has no peer to share with, and gloo maps none.
    railcc, gloo = doc["runs"]
    for host, shm in railcc["shm_per_host"].items():
        assert (shm["segments"] > 0) == (per_host > 1), (host, shm)
        if shm["segments"] and shm.get("reserved_mib") is not None:
            # FIFO pages are reserved as they are first written: after one small all_reduce a
            # host holds its segments' headers and rings and the FIFOs' first pieces, not all.
            assert 0 < shm["reserved_mib"] < shm["mib"], (host, shm)
    assert all(s["segments"] == 0 for s in gloo["shm_per_host"].values()), gloo["shm_per_host"]
    # One table per backend, then the side-by-side summary with the ratio columns.
    text = proc.stdout
    assert f"## {NRANKS} ranks, {per_host} per fake host" in text, text
    for backend in ("railcc", "gloo"):
        assert f"### {backend}: ok, {NRANKS}/{NRANKS} ranks measured" in text, text
    assert "railcc/gloo median" in text and "railcc/gloo max" in text, text
    assert text.count("| **median** |") == 2 and text.count("| **max** |") == 2, text
    assert_no_rank_left(doc)


@pytest.mark.timeout(120)
def test_jobs_split_the_ranks_into_independent_groups_started_together(tmp_path):
    # Four processes as two jobs of two: each rank's process group has two ranks (the harness
    # checks every all_reduce against its own job's size, so a rank in a group of four fails).
    out = tmp_path / "scale.json"
    proc = run_harness(["-n", "4", "--jobs", "2", "--backends", "railcc,gloo", "--iters", "2", "--timeout", "60",
                        "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["jobs"] == 2
    for run in doc["runs"]:
        assert run["ok"] and run["jobs"] == 2 and not run["errors"], run
        assert [d["rank"] for d in run["ranks"]] == [0, 1, 2, 3], run
        # Distinct fake hosts across the jobs: every rank's host is its own.
        assert len({d["host"] for d in run["ranks"]}) == 4, run
    assert "## 4 ranks, 1 per fake host (4 hosts), as 2 jobs of 2 ranks started together" in proc.stdout, proc.stdout
    assert_no_rank_left(doc)
    bad = run_harness(["-n", "4", "--jobs", "3"])
    assert bad.returncode == 2 and "4 ranks do not split into 3 jobs" in bad.stderr, bad.stderr


@pytest.mark.timeout(120)
def test_failing_ranks_are_reported_not_waited_for(tmp_path):
    # A value railcc refuses makes every rank fail in init_process_group: the harness must name
    # each rank's error, exit non-zero at once (not at its timeout) and leave no rank behind.
    out = tmp_path / "scale.json"
    proc = run_harness(["-n", "2", "--backends", "railcc", "--timeout", "60", "--json", str(out)],
                       env={"RAILCC_BUFFSIZE": "abc"})
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAILED: railcc n=2 per-host=1" in proc.stderr, proc.stderr
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert not run["ok"] and sorted(run["errors"]) == ["0", "1"], run
    for rank, error in run["errors"].items():
        assert "RAILCC_BUFFSIZE" in error, error
        assert f"- rank {rank}: {error}" in proc.stdout, proc.stdout
    assert "Traceback of rank 0:" in proc.stdout, proc.stdout
    # Both ranks exited on their own: none was killed, and the job did not run into --timeout.
    assert not run["killed"] and not run["problems"], run
    assert_no_rank_left(doc)


def test_topology_share_is_set_the_same_way_before_every_railcc_job(tmp_path, monkeypatch):
    # Whether a job's ranks discover the topology or read a neighbour's must not depend on how
    # long ago the last railcc job ran: cold removes the shared files, warm refreshes them.
    harness = _load_harness()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    prefix = f"railcc-topo-{os.getuid()}-boot"
    share = [tmp_path / f"{prefix}.txt", tmp_path / f"{prefix}.xml"]
    kept = [tmp_path / f"{prefix}.lock", tmp_path / "railcc-topo-someone-else.txt", tmp_path / "unrelated.txt"]
    for f in share + kept:
        f.write_text("x")
        os.utime(f, (1_000_000, 1_000_000))
    args = harness.parse_args(["-n", "2", "--topology", "warm"])
    assert args.topology == "warm" and harness.parse_args(["-n", "2"]).topology == "cold"
    harness.set_topology_share("warm", args)  # the files exist: refreshed, no job run
    assert all(f.stat().st_mtime > 1_000_000 for f in share)
    assert all(f.stat().st_mtime == 1_000_000 for f in kept)
    harness.set_topology_share("cold", args)
    assert not any(f.exists() for f in share)
    assert all(f.exists() for f in kept)


def test_growth_is_each_repeats_ratio_of_median_inits():
    harness = _load_harness()

    def run(backend, n, rep, inits, ok=True):
        return {"backend": backend, "nranks": n, "per_host": 1, "repeat": rep, "ok": ok,
                "ranks": [{"rank": i, "init_ms": v} for i, v in enumerate(inits)]}

    runs = [run("railcc", 2, 0, [10, 12, 99]), run("railcc", 4, 0, [20, 24, 25, 26]),
            run("railcc", 4, 1, [30, 31, 33, 90]), run("railcc", 2, 1, [14, 15, 16]),
            run("gloo", 2, 0, [5, 5]), run("gloo", 4, 0, [7, 7, 7, 7], ok=False)]
    (g,) = harness.growth_rows(runs)  # gloo's larger job failed: no ratio for it
    assert (g["backend"], g["from"], g["to"]) == ("railcc", 2, 4)
    assert g["ratios"] == pytest.approx([24.5 / 12, 32 / 15])
    assert g["median"] == pytest.approx((24.5 / 12 + 32 / 15) / 2)
    assert g["of_medians"] == pytest.approx(((24.5 + 32) / 2) / ((12 + 15) / 2))
    assert g["stolen_pct"] == [None, None]  # no machine reading: nothing said
    table = harness.growth_table([g], 2)
    assert "| railcc | 1 | 2 -> 4 | 2.00 | 2.04, 2.13 | 2.09 | 2.09 | -, - |" in table, table
    # With the machine read: the larger steal of each repeat's two jobs.
    runs[0]["machine"], runs[1]["machine"] = {"steal_pct": 3.0}, {"steal_pct": 12.5}
    runs[2]["machine"], runs[3]["machine"] = {"steal_pct": 0.0}, None
    (g,) = harness.growth_rows(runs)
    assert g["stolen_pct"] == [12.5, 0.0]
    assert "| 2.09 | 2.09 | 12, 0 |" in harness.growth_table([g], 2)
    with pytest.raises(SystemExit):
        harness.parse_args(["-n", "2", "--repeat", "0"])


def test_machine_share_is_each_kind_of_cpu_time_over_the_window():
    harness = _load_harness()
    before = (10.0, {"user": 100, "sys": 50, "idle": 1000, "steal": 0})
    after = (10.25, {"user": 120, "sys": 70, "idle": 1005, "steal": 5})
    m = harness._machine_share(before, after)
    assert m["window_ms"] == pytest.approx(250) and m["ticks"] == 50
    assert (m["user_pct"], m["sys_pct"], m["idle_pct"], m["steal_pct"]) == pytest.approx((40, 40, 10, 10))
    assert "stolen by the hypervisor 10%" in harness._machine_text(m)
    assert harness._machine_share(None, after) is None
    assert "not read" in harness._machine_text(None)
    # A real reading: the kinds the machine has, in ticks that never go back.
    t0, ticks0 = harness._cpu_ticks()
    t1, ticks1 = harness._cpu_ticks()
    assert t1 >= t0 and sorted(ticks0) == ["idle", "steal", "sys", "user"]
    assert all(ticks1[k] >= ticks0[k] >= 0 for k in ticks0)


@pytest.mark.timeout(120)
def test_repeats_alternate_the_order_of_sizes(tmp_path):
    out = tmp_path / "scale.json"
    proc = run_harness(["-n", "2,3", "--backends", "railcc", "--iters", "1", "--repeat", "2", "--summary-only",
                        "--timeout", "60", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert [(r["nranks"], r["repeat"]) for r in doc["runs"]] == [(2, 0), (3, 0), (3, 1), (2, 1)]
    (g,) = doc["growth"]
    assert (g["backend"], g["from"], g["to"], len(g["ratios"])) == ("railcc", 2, 3, 2)
    assert "## growth of the median init from size to size (2 repeats)" in proc.stdout, proc.stdout
    assert_no_rank_left(doc)
