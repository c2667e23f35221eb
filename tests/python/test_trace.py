"""Tests of `python -m railcc trace` (python/railcc/trace/verdict.py) on synthetic flight-recorder dumps, and on two real
dump sets of the C++ engine (tests/python/data/trace_*: 3 ranks on one host, allreduce seq 4 hung, 5 s timeout).

The module is loaded by path and the CLI run as a script, so no test needs torch or the built extension.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TRACE = os.path.join(ROOT, "python", "railcc", "trace", "verdict.py")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

_spec = importlib.util.spec_from_file_location("railcc_trace_under_test", TRACE)
trace = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = trace
_spec.loader.exec_module(trace)

T0 = 1_763_740_000_000_000  # dumped_at_us of the synthetic dumps


def op(seq, state="completed", name="allreduce", dtype="float32", count=1 << 20, redop="sum", root=-1, waiting_on=(),
       error=None, sent=None, recv=None):
    """One ring-buffer entry."""
    return {"seq": seq, "op": name, "dtype": dtype, "count": count, "redop": redop, "root": root, "state": state,
            "enqueue_us": T0 - 40_000_000, "start_us": None if state == "queued" else T0 - 30_000_000,
            "end_us": T0 - 29_000_000 if state == "completed" else None,
            "bytes_sent": sent or {}, "bytes_recv": recv or {}, "waiting_on": list(waiting_on), "error": error}


def history(upto, name="allreduce"):
    """Completed entries for seqs 1..upto, the last one named name."""
    return [op(s) for s in range(1, upto)] + [op(upto, name=name)] if upto else []


def err(code, message, ranks=(), seq=17, name="allreduce"):
    return {"code": code, "message": message, "ranks": list(ranks), "hosts": [f"node{r:02d}" for r in ranks],
            "seq": seq, "op": name}


def dump(rank, size=4, progress=(17, 17, 16), ops=(), error=None, group="0", links=(), arrival=None,
         reason="timeout", peer_progress=None):
    """One rank's dump; host of rank r is node<r>, every peer over tcp."""
    d = {"version": 1, "group": group, "rank": rank, "size": size, "host": f"node{rank:02d}", "pid": 1000 + rank,
         "dumped_at_us": T0 + rank * 1000, "reason": reason, "error": error,
         "progress": dict(zip(("enqueued", "started", "completed"), progress)),
         "peers": [{"rank": p, "host": f"node{p:02d}", "transport": "self" if p == rank else "tcp"}
                   for p in range(size)],
         "ops": list(ops), "links": list(links)}
    if arrival is not None:
        d["arrival"] = {"lag_us_mean": arrival, "lag_us_max": arrival * 2, "last_count": 3}
    if peer_progress is not None:
        d["peer_progress"] = {str(k): v for k, v in peer_progress.items()}
    return d


def write(directory, dumps):
    os.makedirs(directory, exist_ok=True)
    for d in dumps:
        with open(os.path.join(directory, f"railcc-trace-{d['group']}-rank{d['rank']}.json"), "w") as f:
            json.dump(d, f)
    return str(directory)


def stalled_on(peers, state="running", error=None):
    """A rank that completed seq 16 (a broadcast) and waits on peers in seq 17 (an allreduce)."""
    return dict(progress=(17, 17, 16), error=error,
                ops=history(16, "broadcast") + [op(17, state, waiting_on=peers, sent={"3": 0}, recv={"3": 0})])


def only_group(tmp_path, dumps, **kw):
    result = trace.analyze(trace.load_dumps(write(tmp_path, dumps)), **kw)
    assert len(result["groups"]) == 1
    return result["groups"][0]


def run_cli(*args):
    return subprocess.run([sys.executable, TRACE, *map(str, args)], capture_output=True, text=True, timeout=60)


def test_rank_that_never_called_the_op_is_named(tmp_path):
    dumps = [dump(r, **stalled_on([3])) for r in range(3)]
    dumps.append(dump(3, progress=(16, 16, 16), ops=history(16, "broadcast"), reason="on demand"))
    g = only_group(tmp_path, dumps)
    assert (g["seq"], g["op"], g["dtype"], g["count"], g["hung"]) == (17, "allreduce", "float32", 1 << 20, True)
    assert g["ranks"][3]["state"] == "never_called"
    assert "last called seq 16 broadcast" in g["ranks"][3]["detail"]
    for r in range(3):
        assert g["ranks"][r]["state"] == "stalled" and g["ranks"][r]["waiting_on"] == [3]
    assert g["ranks"][3]["waited_by"] == [0, 1, 2]
    assert g["missing"] == [] and g["suspect_links"] == [] and g["mismatch"] == []
    assert g["status"] == "hung"
    assert g["headline"] == ("railcc trace: group 0, 4 ranks, 4 dumps - rank 3 never called allreduce seq 17 "
                             "(last called seq 16 broadcast)")


def test_frozen_rank_without_dump_that_others_wait_on(tmp_path):
    timeout = err("timeout", "allreduce seq 17 made no progress for 30 s; waiting on rank 3 (node03)\nmore", [3])
    g = only_group(tmp_path, [dump(r, **stalled_on([3], "failed", timeout)) for r in range(3)])
    assert g["missing"] == [3]
    assert g["ranks"][3]["state"] == "missing" and g["ranks"][3]["cause"] == "unresponsive"
    assert g["ranks"][3]["waited_by"] == [0, 1, 2]
    assert "frozen, dead or unreachable" in g["ranks"][3]["detail"]
    assert all(g["ranks"][r]["state"] == "failed" for r in range(3))
    assert "rank 3 left no dump and ranks 0-2 waited on it in allreduce seq 17" in g["headline"]
    assert len(g["errors"]) == 1 and g["errors"][0]["ranks"] == [0, 1, 2]  # identical messages are merged
    assert g["errors"][0]["message"] == "allreduce seq 17 made no progress for 30 s; waiting on rank 3 (node03)"


def test_dead_rank_reported_by_peer_failures(tmp_path):
    dumps = [dump(r, **stalled_on([2], "failed", err("peer_failure", f"rank 2 closed the connection to rank {r}", [2])),
                  reason="failure") for r in (0, 1, 3)]
    g = only_group(tmp_path, dumps)
    assert g["missing"] == [2] and g["ranks"][2]["cause"] == "died"
    assert g["ranks"][2]["reported_by"] == [0, 1, 3]
    assert g["status"] == "failed"
    assert g["headline"].endswith("- rank 2 died (peer failure reported by ranks 0,1,3)")
    assert {e["code"] for e in g["errors"]} == {"peer_failure"} and len(g["errors"]) == 3


def test_mismatch_is_reported_and_alltoall_count_ignored(tmp_path):
    def ops(r):
        five = op(5, "failed", name="broadcast", redop=None, root=0) if r == 3 else op(5, "failed")
        return [op(s) for s in range(1, 4)] + [op(4, name="alltoall", count=0 if r % 2 else 64), five]

    mismatch = err("mismatch", "ranks called different collectives at seq 5", [3], seq=5)
    g = only_group(tmp_path, [dump(r, progress=(5, 5, 4), ops=ops(r), error=mismatch) for r in range(4)])
    assert [m["seq"] for m in g["mismatch"]] == [5]
    calls = g["mismatch"][0]["calls"]
    assert [c["ranks"] for c in calls] == [[0, 1, 2], [3]]
    assert (calls[1]["op"], calls[1]["root"]) == ("broadcast", 0)
    assert "rank 3 called broadcast(float32, count 1048576" in g["headline"]
    assert "mismatch at seq 5: ranks 0-2 called allreduce(" in g["headline"]
    assert g["status"] == "failed"


def ring_links(r, size=4, slow=(2, 3)):
    """Rank r's send link to r+1 and recv link from r-1, 1.0 GB/s except slow (src, dst) at 0.1 GB/s."""
    nxt, prv = (r + 1) % size, (r - 1) % size
    return [{"peer": nxt, "dir": "send", "bytes": 1 << 20, "busy_us": 1000, "gbps": 0.1 if (r, nxt) == slow else 1.0},
            {"peer": prv, "dir": "recv", "bytes": 1 << 20, "busy_us": 1000, "gbps": 0.1 if (prv, r) == slow else 1.0},
            {"peer": prv, "dir": "send", "bytes": 0, "busy_us": 0, "gbps": 0.0}]  # idle: not counted


def test_slow_link_is_named(tmp_path):
    g = only_group(tmp_path, [dump(r, progress=(40, 40, 40), ops=history(40), links=ring_links(r),
                                   reason="on demand") for r in range(4)])
    assert len(g["slow_links"]) == 1
    link = g["slow_links"][0]
    assert (link["src"], link["dst"], link["src_host"], link["dst_host"]) == (2, 3, "node02", "node03")
    assert (link["gbps"], link["median_gbps"], link["reported_by"]) == (0.1, 1.0, [2, 3])
    assert link["text"] == "slow link: rank 2 -> rank 3 (node02 -> node03) 0.10 GB/s vs median 1.00 GB/s"
    assert g["status"] == "degraded"
    assert "no failure: all ranks completed allreduce seq 40; slow link: rank 2 -> rank 3" in g["headline"]


def test_all_completed_says_no_failure(tmp_path):
    g = only_group(tmp_path, [dump(r, progress=(40, 40, 40), ops=history(40), links=ring_links(r, slow=None),
                                   arrival=20.0, reason="on demand") for r in range(4)])
    assert (g["seq"], g["hung"], g["status"]) == (40, False, "ok")
    assert all(info["state"] == "completed" for info in g["ranks"].values())
    assert g["slow_links"] == g["stragglers"] == g["errors"] == g["missing"] == []
    assert g["headline"] == "railcc trace: group 0, 4 ranks, 4 dumps - no failure: all ranks completed allreduce seq 40"


def test_straggler_is_named(tmp_path):
    g = only_group(tmp_path, [dump(r, progress=(40, 40, 40), ops=history(40), arrival=80_000.0 if r == 1 else 10.0 + r)
                              for r in range(4)])
    assert [s["rank"] for s in g["stragglers"]] == [1]
    assert "straggler: rank 1 (node01)" in g["headline"]


def test_mutual_wait_points_at_the_link(tmp_path):
    dumps = [dump(r, size=2, progress=(17, 17, 16),
                  ops=history(16) + [op(17, "running", waiting_on=[1 - r], sent={str(1 - r): 4096},
                                        recv={str(1 - r): 0})]) for r in range(2)]
    g = only_group(tmp_path, dumps)
    assert [link["ranks"] for link in g["suspect_links"]] == [[0, 1]]
    link = g["suspect_links"][0]
    assert link["hosts"] == ["node00", "node01"] and link["transport"] == "tcp"
    assert link["waits"][0] == {"rank": 0, "on": 1, "bytes_sent": 4096, "bytes_recv": 0}
    assert "link rank 0 (node00) <-> rank 1 (node01) suspected broken" in g["headline"]


def test_rank_whose_progress_thread_never_started_the_op(tmp_path):
    dumps = [dump(r, **stalled_on([2])) for r in (0, 1, 3)]
    behind = history(15) + [op(16, "running", name="broadcast"), op(17, "queued")]
    dumps.append(dump(2, progress=(17, 16, 15), ops=behind))
    g = only_group(tmp_path, dumps)
    assert g["seq"] == 16  # rank 2's unfinished broadcast is the lowest unfinished seq
    assert g["ranks"][2]["state"] == "stalled"
    g = only_group(tmp_path / "b", [dump(r, **stalled_on([2])) for r in (0, 1, 3)] + [
        dump(2, progress=(17, 16, 16), ops=history(16, "broadcast") + [op(17, "queued")])])
    assert g["ranks"][2]["state"] == "queued"
    assert "rank 2 called allreduce seq 17 but never started it" in g["headline"]


def test_expected_size_finds_ranks_no_dump_mentions(tmp_path):
    dumps = [dump(r, progress=(40, 40, 40), ops=history(40)) for r in range(2)]
    for d in dumps:
        del d["size"], d["peers"]
    g = only_group(tmp_path, dumps, expected_size=4)
    assert g["size"] == 4 and g["missing"] == [2, 3]
    assert g["ranks"][3]["cause"] == "unknown" and g["status"] == "incomplete"
    assert "ranks 2,3 left no dump" in g["headline"]
    assert run_cli(tmp_path, "--size", "0").returncode == 2


def test_multiple_groups_worst_first(tmp_path):
    ok = [dump(r, progress=(40, 40, 40), ops=history(40), reason="on demand") for r in range(4)]
    hung = [dump(r, size=2, group="tp_1", **stalled_on([1])) for r in range(1)]
    hung.append(dump(1, size=2, group="tp_1", progress=(16, 16, 16), ops=history(16, "broadcast")))
    result = trace.analyze(trace.load_dumps(write(tmp_path, ok + hung)))
    assert [g["group"] for g in result["groups"]] == ["tp_1", "0"]
    assert [g["status"] for g in result["groups"]] == ["hung", "ok"]
    text = trace.format_verdict(result)
    assert text.index("group tp_1, 2 ranks") < text.index("group 0, 4 ranks")
    assert "rank 1 never called allreduce seq 17" in text


def test_empty_or_missing_dir_exits_2(tmp_path):
    for target in (tmp_path, tmp_path / "nope"):
        proc = run_cli(target)
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert str(target) in proc.stderr


def test_malformed_file_is_skipped_with_a_warning(tmp_path, capsys):
    d = write(tmp_path, [dump(r, **stalled_on([3])) for r in range(3)])
    bad = os.path.join(d, "railcc-trace-0-rank3.json")
    with open(bad, "w") as f:
        f.write('{"version": 1, "rank": 3,')
    dumps = trace.load_dumps(d)
    assert sorted(x["rank"] for x in dumps) == [0, 1, 2]
    assert bad in capsys.readouterr().err
    proc = run_cli(d)
    assert proc.returncode == 0
    assert bad in proc.stderr and "warning" in proc.stderr
    assert "rank 3 left no dump and ranks 0-2 waited on it" in proc.stdout


def test_json_output_parses(tmp_path):
    dumps = [dump(r, **stalled_on([3])) for r in range(3)]
    dumps.append(dump(3, progress=(16, 16, 16), ops=history(16, "broadcast")))
    proc = run_cli(write(tmp_path, dumps), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    g = result["groups"][0]
    assert g["ranks"]["3"]["state"] == "never_called"
    assert g["seq"] == 17 and g["headline"].startswith("railcc trace: group 0")


def test_runs_without_torch(tmp_path):
    d = write(tmp_path, [dump(r, **stalled_on([3])) for r in range(3)])
    # torch set to None in sys.modules makes any `import torch` fail
    code = (f"import runpy, sys; sys.modules['torch'] = None; sys.argv = [{TRACE!r}, {d!r}]; "
            f"runpy.run_path({TRACE!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "rank 3 left no dump" in proc.stdout


def test_big_group_fits_one_screen(tmp_path):
    dumps = [dump(r, size=64, **stalled_on([37])) for r in range(64) if r != 37]
    dumps.append(dump(37, size=64, progress=(16, 16, 16), ops=history(16, "broadcast")))
    proc = run_cli(write(tmp_path, dumps))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) <= 40
    assert "rank 37 never called allreduce seq 17" in lines[0]
    assert any(line.startswith("  ranks 0-36,38-63") for line in lines)


def test_real_rank_that_never_called_and_failed_late(tmp_path):
    """Rank 2 slept 9 s before seq 4; ranks 0,1 timed out and saw it alive before the call (peer_progress); rank 2
    then called seq 4, found rank 0 failed and raised peer_failure naming it: a consequence, not a broken rank 0."""
    g = only_group(tmp_path, trace.load_dumps(os.path.join(DATA, "trace_never")))
    assert (g["seq"], g["op"], g["redop"], g["status"]) == (4, "allreduce", "sum", "failed")
    assert g["headline"] == ("railcc trace: group 0, 3 ranks, 3 dumps - rank 2 never called allreduce seq 4: ranks 0,1 "
                             "timed out waiting for it while it was alive in code before the call")
    r2 = g["ranks"][2]
    assert (r2["state"], r2["basis"], r2["seen_by"], r2["late_s"]) == ("never_called", "peer_progress", [0, 1], 3.991)
    assert r2["detail"] == "was alive but had not called seq 4 when ranks 0,1 timed out (it called it 4.0 s later)"
    assert r2["waited_by"] == [0, 1] and r2["stalled_s"] is None
    assert g["ranks"][0]["reported_by"] == []  # rank 2's peer_failure blames no one
    assert [g["ranks"][r]["state"] for r in (0, 1)] == ["failed", "failed"]
    assert g["suspect_links"] == [] and g["missing"] == [] and g["mismatch"] == []
    timeout = next(e for e in g["errors"] if e["code"] == "timeout")
    assert timeout["ranks"] == [0, 1]
    assert timeout["progress"] == ["rank 2 (host vm) never called seq 4: its last call was seq 3 (allreduce); it is "
                                   "alive and reporting, so it is still in code before this call"]
    proc = run_cli(os.path.join(DATA, "trace_never"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == g["headline"]
    assert "  op: seq 4 allreduce(float32, count 1000, redop sum), running for up to 5.0 s when dumped" in lines
    assert "lost its connections" not in proc.stdout and "suspect link" not in proc.stdout
    assert "  rank 2 (vm): was alive but had not called seq 4 when ranks 0,1 timed out (it called it 4.0 s later)" \
        in lines
    # the never-called line of the timeout, once though both ranks 0 and 1 wrote it
    assert sum(line.startswith("      rank 2 (host vm) never called seq 4: ") for line in lines) == 1
    assert "progress of the other ranks" not in proc.stdout and "joined seq 4 but has not finished" not in proc.stdout


def test_real_frozen_rank_without_dump(tmp_path):
    """Rank 2 was SIGSTOPped during seq 4 and killed later, so it left no dump; ranks 0,1 saw it frozen."""
    g = only_group(tmp_path, trace.load_dumps(os.path.join(DATA, "trace_stop")))
    assert g["headline"] == ("railcc trace: group 0, 3 ranks, 2 dumps - rank 2 was frozen (process stopped) while "
                             "ranks 0,1 waited for it in allreduce seq 4")
    r2 = g["ranks"][2]
    assert (r2["state"], r2["cause"], r2["seen_by"], r2["waited_by"]) == ("missing", "frozen", [0, 1], [0, 1])
    assert r2["detail"] == "no dump; frozen (process stopped or stopped reporting) when ranks 0,1 timed out in seq 4"
    assert g["missing"] == [2] and g["suspect_links"] == [] and g["status"] == "failed"
    proc = run_cli(os.path.join(DATA, "trace_stop"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == g["headline"]
    assert sum("rank 2 (host vm) is frozen: its process 11435 is stopped" in line for line in lines) == 1
    assert "redop sum" in proc.stdout and "SUM" not in proc.stdout


def frozen_timeout(r, seq=17):
    return err("timeout", f"allreduce (seq {seq}) made no progress for 5000 ms; waiting on:\n"
                          f"  receiving from rank 3 (host node03, tcp), 0 of 4096 bytes moved\n"
                          f"progress of the other ranks:\n  rank {1 - r} (host node0{1 - r}) joined seq {seq} but has "
                          f"not finished it\n  rank 3 (host node03) is frozen: its process 1003 is stopped (SIGSTOP or "
                          f"a debugger); its last report, 5.0 s ago, said its last call was seq {seq - 1}",
               [3], seq=seq)


def test_peer_progress_frozen_explains_missing_dump_and_beats_peer_failure(tmp_path):
    # ranks 0,1 wait on each other and on 3, which they saw frozen; rank 2 later reports a peer failure on rank 3
    # (it was killed): the frozen evidence explains the missing dump, so rank 3 did not simply die, and the waits
    # between ranks 0 and 1 are no suspect link
    dumps = [dump(r, error=frozen_timeout(r), peer_progress={1 - r: "joined", 2: "joined", 3: "frozen"},
                  ops=history(16) + [op(17, "failed", waiting_on=[1 - r, 3])]) for r in (0, 1)]
    dumps.append(dump(2, error=err("peer_failure", "rank 3 (host node03) closed the connection", [3]),
                      ops=history(16) + [op(17, "failed", waiting_on=[3])], reason="failure"))
    g = only_group(tmp_path, dumps)
    r3 = g["ranks"][3]
    assert (r3["state"], r3["cause"], r3["seen_by"], r3["reported_by"]) == ("missing", "frozen", [0, 1], [2])
    assert g["headline"].endswith("- rank 3 was frozen (process stopped) while ranks 0,1 waited for it in "
                                  "allreduce seq 17")
    assert g["suspect_links"] == []
    text = trace.format_verdict({"groups": [g]})
    assert text.count("rank 3 (host node03) is frozen: its process 1003 is stopped") == 1
    # without the peer_progress the same dumps read as a dead rank 3
    for d in dumps:
        d.pop("peer_progress", None)
    g = only_group(tmp_path / "b", dumps)
    assert g["ranks"][3]["cause"] == "died" and "rank 3 died" in g["headline"]


def test_peer_progress_frozen_rank_with_its_own_later_dump(tmp_path):
    # rank 3 was stopped, then continued: it called seq 17 after the others had timed out and failed on them
    dumps = [dump(r, error=frozen_timeout(r), peer_progress={1 - r: "joined", 2: "joined", 3: "frozen"},
                  ops=history(16) + [op(17, "failed", waiting_on=[3])]) for r in (0, 1)]
    dumps.append(dump(2, error=frozen_timeout(0), peer_progress={0: "joined", 1: "joined", 3: "frozen"},
                      ops=history(16) + [op(17, "failed", waiting_on=[3])]))
    dumps.append(dump(3, error=err("peer_failure", "rank 0 (host node00) failed earlier", [0]), reason="failure",
                      ops=history(16) + [op(17, "failed", waiting_on=[0])]))
    g = only_group(tmp_path, dumps)
    assert g["ranks"][3]["state"] == "frozen" and g["ranks"][3]["seen_by"] == [0, 1, 2]
    assert g["ranks"][3]["detail"] == ("frozen (process stopped or stopped reporting) when ranks 0-2 timed out in "
                                       "seq 17")
    assert g["ranks"][0]["reported_by"] == [] and g["suspect_links"] == []
    assert g["headline"].endswith("- rank 3 was frozen (process stopped) while ranks 0-2 waited for it in "
                                  "allreduce seq 17")


def late_arrival(enqueue_us):
    """Ranks 0,1 time out on rank 2 in seq 17 with no peer_progress; rank 2 then fails with peer_failure naming
    rank 0, its entry for seq 17 enqueued at enqueue_us and waiting on rank 0."""
    timeout = err("timeout", "allreduce (seq 17) made no progress for 5000 ms; waiting on:", [2])
    dumps = [dump(r, size=3, error=timeout, peer_progress={},
                  ops=history(16) + [op(17, "failed", waiting_on=[2], sent={"2": 4096}, recv={"2": 0})])
             for r in (0, 1)]
    late = op(17, "failed", waiting_on=[0])
    late["enqueue_us"] = enqueue_us
    dumps.append(dump(2, size=3, error=err("peer_failure", "rank 0 (host node00) failed earlier", [0]),
                      ops=history(16) + [late], reason="failure"))
    return dumps


def test_late_arriver_peer_failure_is_not_headlined(tmp_path):
    g = only_group(tmp_path, late_arrival(T0 + 4_000_000))  # 4 s after rank 0 gave up (dumped at T0)
    r2 = g["ranks"][2]
    assert (r2["state"], r2["basis"], r2["seen_by"], r2["late_s"]) == ("never_called", "timing", [0, 1], 4.0)
    assert r2["detail"] == "had not called seq 17 when ranks 0,1 timed out (it called it 4.0 s later)"
    assert g["ranks"][0]["reported_by"] == [] and g["suspect_links"] == []
    assert "lost its connections" not in g["headline"]
    assert g["headline"].endswith("- rank 2 called allreduce seq 17 too late: ranks 0,1 had timed out waiting for it "
                                  "(it called it 4.0 s later)")
    # called in time (40 s before the timeout): its peer_failure is still a consequence of rank 0's timeout and
    # blames no one, but rank 0's wait on it, both in the op, makes a suspect link; rank 2's own wait does not
    g = only_group(tmp_path / "b", late_arrival(T0 - 40_000_000))
    assert g["ranks"][2]["state"] == "failed"
    assert g["ranks"][2]["detail"] == ("failed in seq 17, waiting on rank 0 (peer_failure, after rank 0 had failed "
                                       "first)")
    assert g["ranks"][0]["reported_by"] == [] and "lost its connections" not in g["headline"]
    assert [(w["rank"], w["on"]) for link in g["suspect_links"] for w in link["waits"]] == [(0, 2), (1, 2)]
    assert "link rank 0 (node00) <-> rank 2 (node02) suspected broken" in g["headline"]


def test_peer_progress_never_called_without_own_dump(tmp_path):
    dumps = [dump(r, error=err("timeout", "allreduce (seq 17) made no progress", [3]),
                  peer_progress={3: "never_called"}, ops=history(16) + [op(17, "failed", waiting_on=[3])])
             for r in range(3)]
    g = only_group(tmp_path, dumps)
    assert (g["ranks"][3]["cause"], g["ranks"][3]["seen_by"]) == ("never_called", [0, 1, 2])
    assert g["ranks"][3]["detail"] == "no dump; was alive but had not called seq 17 when ranks 0-2 timed out"
    assert g["headline"].endswith("- rank 3 never called allreduce seq 17: ranks 0-2 timed out waiting for it while "
                                  "it was alive in code before the call")


def test_redop_case_is_ignored(tmp_path):
    dumps = [dump(r, progress=(40, 40, 40), ops=history(39) + [op(40, redop="SUM" if r else "sum")])
             for r in range(4)]
    g = only_group(tmp_path, dumps)
    assert g["mismatch"] == [] and g["redop"] == "sum"


@pytest.mark.parametrize("ranks,text", [([0, 1, 2, 5, 6], "0-2,5,6"), ([6, 5], "5,6"), ([3], "3"), ([], "")])
def test_rank_list(ranks, text):
    assert trace._rank_list(ranks) == text


# ---------------------------------------------------------------------------------------------- hostile dumps
# A dump is read from a shared folder that anything may have written into: each malformed one must be refused with
# one line that names the file and the field at fault, in bounded time and memory, never with a traceback.

LIMIT_AS = 1 << 30  # the CLI runs with this much address space: a dump must not make it allocate without bound


def _limit_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))


def run_limited(*args, timeout=20):
    return subprocess.run([sys.executable, TRACE, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_limit_memory)


def good_dump():
    """Rank 0 of a 2-rank group, stalled in seq 17 waiting on rank 1: every field the analysis reads is present."""
    timeout = err("timeout", "allreduce seq 17 made no progress", [1])
    return dump(0, size=2, **stalled_on([1], "failed", timeout), links=ring_links(0, size=2), arrival=10.0,
                peer_progress={1: "frozen"})


def _set(path, value):
    """A good dump with the field at path ("ops.17.start_us": key, list index, key) set to value."""
    d = good_dump()
    *parents, last = path.split(".")
    node = d
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return json.dumps(d)


HOSTILE_FIELDS = [
    ("peers", 7, "peers"),
    ("size", 10 ** 10, "size"),
    ("rank", 10 ** 10, "rank"),
    ("rank", True, "rank"),
    ("dumped_at_us", 10 ** 30, "dumped_at_us"),
    ("host", {"a": 1}, "host"),
    ("error.hosts", 5, "error.hosts"),
    ("error.ranks", "0,1", "error.ranks"),
    ("progress.enqueued", "17", "progress.enqueued"),
    ("ops.16.op", ["allreduce"], "ops[16].op"),
    ("ops.16.start_us", 10 ** 400, "ops[16].start_us"),
    ("ops.16.waiting_on", "ab", "ops[16].waiting_on"),
    ("ops.16.bytes_sent", [1], "ops[16].bytes_sent"),
    ("ops.3", "completed", "ops[3]"),
    ("links.0.gbps", "fast", "links[0].gbps"),
    ("arrival", [1], "arrival"),
    ("peer_progress", {"\u00b2": "frozen"}, "peer_progress"),
    ("peer_progress", {"1" * 5000: "frozen"}, "peer_progress"),
]


def assert_refused(proc, path, field):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if str(path) in line]
    assert any(field in line for line in lines), (field, proc.stderr)
    assert max(len(line) for line in proc.stderr.splitlines()) < 400, proc.stderr  # one short line each


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,value,field", HOSTILE_FIELDS, ids=[f"{p}={str(v)[:20]}" for p, v, _ in HOSTILE_FIELDS])
def test_malformed_field_is_refused_naming_file_and_field(tmp_path, path, value, field):
    bad = tmp_path / "railcc-trace-0-rank0.json"
    bad.write_text(_set(path, value))
    assert_refused(run_limited(tmp_path), bad, field)


@pytest.mark.timeout(60)
def test_the_good_dump_of_the_hostile_tests_is_read(tmp_path):
    (tmp_path / "railcc-trace-0-rank0.json").write_text(json.dumps(good_dump()))
    proc = run_limited(tmp_path)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert "rank 1 was frozen" in proc.stdout


@pytest.mark.timeout(60)
def test_malformed_dump_among_good_ones_is_skipped_and_named(tmp_path):
    d = write(tmp_path, [dump(r, **stalled_on([3])) for r in range(3)])
    bad = os.path.join(d, "railcc-trace-0-rank3.json")
    with open(bad, "w") as f:
        f.write(json.dumps(dict(dump(3), peers=7)))
    proc = run_limited(d)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert any(bad in line and "peers" in line for line in proc.stderr.splitlines()), proc.stderr
    assert "rank 3 left no dump and ranks 0-2 waited on it" in proc.stdout


@pytest.mark.timeout(60)
def test_deeply_nested_json_is_refused(tmp_path):
    bad = tmp_path / "railcc-trace-0-rank0.json"
    bad.write_text('{"version": 1, "rank": 0, "ops": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert_refused(run_limited(tmp_path), bad, "nested")


@pytest.mark.timeout(60)
def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "railcc-trace-0-rank0.json"
    os.mkfifo(fifo)
    assert_refused(run_limited(tmp_path), fifo, "not a regular file")


@pytest.mark.timeout(60)
def test_device_is_refused_without_reading_it(tmp_path):
    link = tmp_path / "railcc-trace-0-rank0.json"
    os.symlink("/dev/zero", link)
    assert_refused(run_limited(tmp_path), link, "not a regular file")


@pytest.mark.timeout(60)
def test_oversized_file_is_refused_without_reading_it(tmp_path):
    big = tmp_path / "railcc-trace-0-rank0.json"
    with open(big, "wb") as f:
        f.truncate(trace.MAX_DUMP_BYTES + 1)  # sparse: no disk used
    assert_refused(run_limited(tmp_path), big, "MiB")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", ["0", "-3", "1e12", str(10 ** 12), "many"])
def test_bad_size_argument_is_refused(tmp_path, size):
    write(tmp_path, [dump(0, **stalled_on([1]))])
    proc = run_limited(tmp_path, "--size", size)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--size" in proc.stderr and proc.stdout == ""


@pytest.mark.timeout(120)
def test_largest_group_is_analyzed_in_bounded_memory(tmp_path):
    # one dump of a group of the largest size accepted: every other rank is missing, and that must stay cheap
    d = dump(0, size=trace.MAX_GROUP_SIZE, progress=(17, 17, 17), ops=history(17))
    d["peers"] = d["peers"][:2]
    write(tmp_path, [d])
    proc = run_limited(tmp_path, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert f"{trace.MAX_GROUP_SIZE} ranks, 1 dump" in proc.stdout
    assert len(proc.stdout.splitlines()) <= 40


@pytest.mark.timeout(120)
def test_python_m_railcc_trace_refuses_a_fifo_too(tmp_path):
    # the installed package reads its dumps through the same loader as the script (load.py beside verdict.py)
    if importlib.util.find_spec("railcc") is None:
        pytest.skip("railcc is not installed")
    fifo = tmp_path / "railcc-trace-0-rank0.json"
    os.mkfifo(fifo)
    (tmp_path / "railcc-trace-0-rank1.json").write_text(_set("peers", 7).replace('"rank": 0', '"rank": 1', 1))
    proc = subprocess.run([sys.executable, "-m", "railcc", "trace", str(tmp_path)], capture_output=True, text=True,
                          timeout=100, cwd=tmp_path)
    assert_refused(proc, fifo, "not a regular file")
    assert any(str(tmp_path / "railcc-trace-0-rank1.json") in line and "peers is 7" in line
               for line in proc.stderr.splitlines()), proc.stderr


@pytest.mark.timeout(60)
def test_stray_byte_in_a_message_does_not_lose_the_dump(tmp_path):
    # the engine copies bytes it did not make (a peer's failure record) into error messages as they are: one that
    # is not UTF-8 must not cost the dump, which may be the only one that saw the hang
    raw = _set("error.message", "peer said XSTRAYX and closed").encode().replace(b"XSTRAYX", b"\xff\xfe")
    (tmp_path / "railcc-trace-0-rank0.json").write_bytes(raw)
    proc = run_limited(tmp_path)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert "peer said \ufffd\ufffd and closed" in proc.stdout
