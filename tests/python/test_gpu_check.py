"""scripts/gpu_check.sh, the first-GPU run, without a GPU: the scripts parse, and the bench
verdicts it writes (scripts/gpu_check_targets.py) read the reports as railcc-bench writes them.
The whole dry run (bash scripts/gpu_check.sh --dry-run) rebuilds the extension, so it is left
to the command line."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(ROOT, "scripts")


@pytest.mark.parametrize("script", ["gpu_check.sh", "cmake_build.sh", "check_bare_build.sh"])
def test_scripts_parse(script):
    r = subprocess.run(["bash", "-n", os.path.join(SCRIPTS, script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_help_and_bad_arguments():
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--dry-run" in r.stdout and "summary.md" in r.stdout
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument" in r.stderr


def _report(ranks, time_us, fraction, ratio):
    size = 256 << 20
    rows = [{"backend": b, "op": "all_reduce", "size": s, "count": s // 4, "type": "float", "redop": "sum",
             "root": -1, "inplace": False, "time_us": t, "algbw": s / t / 1e3, "busbw": s / t / 1e3, "wrong": 0}
            for b, t in (("railcc", time_us), ("gloo", time_us * ratio)) for s in (1024, size)]
    return {"meta": {"world_size": ranks}, "results": rows, "ratios": [
        {"op": "all_reduce", "size": size, "backend": "railcc", "vs": "gloo", "ratio": ratio}],
        "bound": {"fractions": [{"backend": "railcc", "op": "all_reduce", "size": size, "fraction": fraction},
                                {"backend": "gloo", "op": "all_reduce", "size": size, "fraction": fraction / ratio}]},
        "not_run": []}


def test_targets_read_the_largest_all_reduce(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report(2, 5000.0, 0.55, 12.0)))
    b.write_text(json.dumps(_report(4, 9000.0, 0.31, 7.5)))
    merged = tmp_path / "merged.json"
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check_targets.py"), str(merged), str(a), str(b),
                        str(tmp_path / "missing.json"), "shots=" + str(a)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("- 2 ranks, all_reduce 268435456 B: 5000 us")
    # issue 67's targets: 2 ranks 25% of the bound and 20x gloo, 4 ranks 15%
    assert "55% (meets 25%)" in lines[0] and "12.0x (below 20x)" in lines[0]
    assert "31% (meets 15%)" in lines[1] and lines[1].endswith("vs gloo: 7.5x")
    assert "missing.json: no report" in lines[2]
    assert lines[3].startswith("- shots: 2 ranks, all_reduce 268435456 B: 5000 us")  # a labelled report
    assert [x["meta"]["world_size"] for x in json.loads(merged.read_text())] == [2, 4, 2]


def test_targets_compare_symmetric_memory_with_the_shots_report(tmp_path):
    shots, symm = tmp_path / "shots.json", tmp_path / "symm.json"
    shots.write_text(json.dumps(_report(2, 5000.0, 0.55, 12.0)))
    symm.write_text(json.dumps({"meta": {"world_size": 2}, "results": [
        {"op": op, "size": s, "time_us": t, "busbw": 0.0}
        for op, s, t in (("one_shot_all_reduce", 1024, 30.0), ("two_shot_all_reduce_", 1024, 40.0),
                         ("one_shot_all_reduce", 256 << 20, 9000.0), ("two_shot_all_reduce_", 256 << 20, 4000.0))]}))
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check_targets.py"), str(tmp_path / "m.json"),
                        "shots=" + str(shots), "symm=" + str(symm)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[1]
    # railcc's rows in _report: 5000 us at both sizes
    assert line.startswith("- symm: 2 ranks, torch symmetric memory: 1024 B: one_shot_all_reduce 30.0 us"), line
    assert "symm/railcc 0.01 (below 1.0)" in line and "268435456 B: two_shot_all_reduce_ 4000.0 us" in line, line
    assert "symm/railcc 0.80 (below 1.0)" in line, line


def test_targets_give_all_gather_and_broadcast_their_own_line(tmp_path):
    rep = _report(2, 5000.0, 0.55, 12.0)
    for op, frac in (("all_gather", 0.45), ("broadcast", 0.2)):
        rep["results"] += [dict(r, op=op) for r in rep["results"] if r["op"] == "all_reduce"]
        rep["bound"]["fractions"].append({"backend": "railcc", "op": op, "size": 256 << 20, "fraction": frac})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rep))
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check_targets.py"), str(tmp_path / "m.json"),
                        "shots=" + str(path)], capture_output=True, text=True)
    lines = r.stdout.splitlines()
    assert [ln.split(",")[1].split()[0] for ln in lines] == ["all_reduce", "all_gather", "broadcast"], lines
    assert "45% (meets 40%)" in lines[1] and "20% (below 40%)" in lines[2], lines


def test_targets_hold_eight_byte_ops_to_twice_the_event_round_trip(tmp_path):
    rep = _report(2, 5000.0, 0.55, 12.0)
    rep["results"].append({"backend": "railcc", "op": "all_reduce", "size": 8, "count": 2, "type": "float",
                           "redop": "sum", "root": -1, "inplace": False, "time_us": 50.0, "algbw": 0.0,
                           "busbw": 0.0, "wrong": 0})
    rep["bound"]["event_round_trip_us"] = 20.0
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rep))
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check_targets.py"), str(tmp_path / "m.json"),
                        str(path)], capture_output=True, text=True)
    assert "all_reduce 8 B: 50.0 us, 2.50x one process's event round trip (20.0 us; above 2x)" in r.stdout, r.stdout
