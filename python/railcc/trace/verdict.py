"""python -m railcc trace DIR [--json] [--size N]: merge railcc flight-recorder dumps into a verdict.

Every rank of a railcc process group writes `railcc-trace-<group>-rank<R>.json` when an op fails, times out,
or on demand. This module reads all of them in DIR, analyzes each group on its own, and prints one section per
group, worst first: a one-sentence headline, the op in question, one line per rank (ranks with the same
verdict share a line), suspect and slow links, stragglers, and each rank's error (first line). `--json` prints
the analysis dict instead. It needs only the standard library, so it runs wherever the dump files are:

    python -m railcc trace /shared/traces
    python path/to/railcc/trace/verdict.py /shared/traces --json

Exit status: 0 when a verdict was printed (whatever it says); 2 when DIR is missing or holds no readable dump.
A file that is not a rank's dump (not a regular file, over 256 MiB, not JSON, or a field of the wrong type or
out of range, such as a size over 2^20: see load.py) is skipped with a one-line warning on stderr naming it
and the field at fault; the verdict is made from the others.

How a group is judged (N = its size: `--size`, or else the largest `size` in its dumps):

* The op in question, S, is the lowest seq that some rank has not finished: the lowest seq among collective
  entries (seq > 0) in state queued, running or failed, or `completed + 1` on a rank whose progress shows
  enqueued > completed. When there is none, nothing hung and S is the highest seq seen anywhere. Its name,
  dtype and count come from the first rank whose ring buffer still holds it.
* Each rank with a dump is, for S, one of (first match wins):
  failed       its entry for S failed, or its error names seq S;
  completed    progress.completed >= S;
  never_called progress.enqueued < S: still in user code before that collective (compute, data loading) or
               out of step; the detail gives its last called seq and that op;
  queued       enqueued >= S but started < S: the progress thread is stuck in an earlier op;
  stalled      started >= S, completed < S: it joined and waits on the peers in its entry's waiting_on.
* The ranks that timed out tell what the others were doing, and that beats a rank's own later dump. Each dump's
  `peer_progress` ({"2": "never_called" | "frozen" | "joined"}) is what that rank concluded, when its op timed
  out, from the progress records every rank publishes through the store; it counts for S when its error (else
  its failed entry) is for S. "never_called" or "frozen" from any reporter beats "joined"; between the two the
  one more reporters saw wins, "frozen" on a tie. A rank that did not complete S becomes
  never_called  "was alive but had not called seq S when ranks A,B timed out", with "(it called it N s later)"
                when its own entry for S was enqueued N s after the first of them gave up (end_us, else dumped_at_us);
  frozen        "frozen (process stopped or stopped reporting) when ranks A,B timed out in seq S".
  Without peer_progress about it, a rank whose own entry for S was enqueued after the ranks that timed out on it
  (their timeout error or waiting_on names it) had given up is never_called too ("basis" timing, not
  peer_progress): it called S too late. Such a rank's error (typically peer_failure) is a consequence.
* A rank with no dump is `missing`, with a cause: "frozen" when peer_progress says so (which explains the missing
  dump); "died" when another rank's peer_failure error names it; "never_called" when peer_progress says it was
  alive before S; "unresponsive" when ranks wait on it in S (waiting_on, or a timeout error naming it) - a frozen
  (SIGSTOPped), dead or unreachable process writes no dump; otherwise "unknown" (it died before writing one or
  never reached init).
* A peer_failure error is a consequence, not a cause, when it names a rank whose own dump failed first with
  another error (a timeout, say): the rank raising it got to the op after that rank had given up. It blames no
  one (no "lost its connections") and its waits make no suspect link. Waits of never_called or frozen ranks count
  for nothing either (no waited_by, no suspect link).
* Mismatch: entries for one seq that differ across ranks in op, dtype, count (ignored for alltoall, whose count
  is 0), redop (case-insensitive; printed lower case) or root; and errors with code "mismatch" not already
  explained by the entries.
* Suspect link: a stalled or failed rank waits on a peer that joined S too (stalled, failed or even completed,
  after the peer_progress evidence above): both are in the op yet data does not flow between them, so the link
  between their hosts is the likely culprit. There is none when some rank never called S, is frozen, or is
  missing and waited on: that rank explains every wait, directly or down the chain.
* Slow link: each `links` entry that moved bytes is a directed edge (send: rank -> peer, recv: peer -> rank);
  an edge whose gbps is below a quarter of the median gbps of the entries with the same transport and dir is slow. Both ends may
  report one edge; it is listed once, at the lower rate. gbps is printed as GB/s, the unit railcc-bench uses.
* Straggler: a rank whose arrival.lag_us_mean exceeds 4x the median of the other ranks' and 50 ms (the engine's
  defaults).
* The headline names the most likely root cause, in this order: mismatch; a dead rank (named by a peer_failure
  that is not a consequence, with no dump and no frozen evidence); ranks that never called S (seen by
  peer_progress, then by timing, then by their own progress); frozen ranks; a rank blamed by peer_failure
  errors (two ranks that blame each other: their connection broke); a missing rank others wait on; ranks whose
  progress thread never started S; ranks failed with another error than timeout/peer_failure; a suspect link;
  stalled or timed out ranks; missing ranks nobody waits on; pending point-to-point ops; slow links and
  stragglers; no failure.
* Errors: one line per distinct error (ranks with the same one share it), its first line; under a timeout, the
  lines of its message saying a rank never called the op or is frozen, each once across all ranks.
* Group status, which orders the sections: failed (an error, a mismatch or a dead rank), hung (S unfinished
  somewhere, or a rank waits on a missing one), incomplete (dumps missing), degraded (slow links or
  stragglers), ok.

The analysis dict (`analyze`), also what `--json` prints:

    {"version": 1, "groups": [{
        "group": "0", "size": 4, "dumps": 3, "status": "hung", "headline": "railcc trace: group 0, ...",
        "seq": 17, "hung": true, "op": "allreduce", "dtype": "float32", "count": 1048576, "redop": "sum",
        "root": -1,
        "ranks": {0: {"state": "stalled", "detail": "joined seq 17 and stalled, waiting on rank 3",
                      "host": "node01", "enqueued": 17, "started": 17, "completed": 16, "waiting_on": [3],
                      "stalled_s": 30.2, "error": null, "cause": null, "basis": null, "seen_by": [],
                      "late_s": null, "reported_by": [], "waited_by": []},
                  ...},   # every rank 0..N-1; "cause" is for missing ranks; "basis" ("peer_progress" | "timing")
                          # and "seen_by" (the ranks that timed out) for never_called/frozen verdicts of evidence;
                          # "late_s": how long after they gave up the rank called S
        "missing": [3],
        "mismatch": [{"seq": 17, "calls": [{"ranks": [0, 1], "op": ..., "dtype": ..., "count": ..., "redop": ...,
                      "root": ...}, ...], "text": "mismatch at seq 17: ..."}],
        "suspect_links": [{"ranks": [0, 1], "hosts": ["node01", "node02"], "transport": "tcp", "seq": 17,
                           "waits": [{"rank": 0, "on": 1, "bytes_sent": 4096, "bytes_recv": 0}], "text": ...}],
        "slow_links": [{"src": 2, "dst": 3, "src_host": ..., "dst_host": ..., "gbps": 0.1, "median_gbps": 1.0,
                        "reported_by": [2, 3], "text": ...}],
        "stragglers": [{"rank": 2, "host": ..., "lag_us_mean": 5200.0, "median_us": 12.0, "text": ...}],
        "errors": [{"ranks": [0, 1], "code": "timeout", "message": "first line",
                    "progress": ["rank 3 (host node03) never called seq 17: ..."], "seq": 17, "op": "allreduce",
                    "text": ...}],
        "dumped_at_us": [first, last], "reasons": {"timeout": 3}, "notes": ["..."]}]}

`ranks` keys are ints in Python and strings in the JSON output.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import statistics
import sys

try:
    from . import load as trace_load
except ImportError:  # run as a script or loaded by path (no package): load the module beside this file by path
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "railcc_trace_load", os.path.join(os.path.dirname(os.path.abspath(__file__)), "load.py"))
    trace_load = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = trace_load
    _spec.loader.exec_module(trace_load)

DUMP_GLOB = "railcc-trace-*.json"
FORMAT_VERSION = 1
PENDING = ("queued", "running", "failed")
PEER_STATES = ("never_called", "frozen", "joined")
# the lines of a timeout message that say a peer never called the op or is frozen
PROGRESS_LINE = re.compile(r"^rank \d+\b.*\b(never called seq|is frozen)")
STATUS_ORDER = ("failed", "hung", "incomplete", "degraded", "ok")
ERROR_LINE_MAX = 160
SLOW_FRACTION = 0.25  # as RAILCC_STRAGGLER_LINK_PCT's default
STRAGGLER_FACTOR = 4.0  # as the engine's check
STRAGGLER_MIN_US = 50_000.0  # RAILCC_STRAGGLER_LAG_MS's default: a few ms of lag is scheduling noise
# at most this many lines per list in the printed verdict; the rest is counted, and all of it is in --json
MAX_RANK_LINES = 12
MAX_LIST_LINES = 4
MAX_ERROR_LINES = 5

EXIT_OK, EXIT_USAGE = 0, 2
MAX_GROUP_SIZE = trace_load.MAX_GROUP_SIZE
MAX_DUMP_BYTES = trace_load.MAX_DUMP_BYTES


def _warn(message: str) -> None:
    print(f"railcc trace: warning: {message}", file=sys.stderr)


def _int(value, default: int | None = 0) -> int | None:
    """value if it is an int (and not a bool), else default: dumps come from crashing processes."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _first_line(text) -> str:
    lines = str(text).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= ERROR_LINE_MAX else line[: ERROR_LINE_MAX - 3] + "..."


def _rank_list(ranks) -> str:
    """[0, 1, 2, 5, 6] -> "0-2,5,6": runs of three or more become ranges."""
    ranks = sorted(set(ranks))
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(f"{ranks[i]}-{ranks[j]}" if j - i >= 2 else ",".join(map(str, ranks[i:j + 1])))
        i = j + 1
    return ",".join(parts)


def _ranks_word(ranks) -> str:
    """"rank 3" or "ranks 0-2"."""
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + _rank_list(ranks)


def _natural(name: str):
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _utc(us: int) -> str:
    t = datetime.datetime.fromtimestamp(us / 1e6, tz=datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


# ---------------------------------------------------------------------------------------------- loading


def _redop(value):
    """"SUM" -> "sum": the C++ engine writes redops upper case."""
    return value.lower() if isinstance(value, str) else value


def load_dumps(directory: str) -> list[dict]:
    """The dumps in directory (files matching railcc-trace-*.json), each with its path added as "file".

    Raises FileNotFoundError when directory is not a directory. A file that is not a rank's dump (not a regular
    file, too big, not JSON, a field of the wrong type or out of range: see load.py) is skipped with a warning
    on stderr naming it and the field at fault; a version other than 1 is read as version 1, with a warning.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: not a directory")
    dumps = []
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), DUMP_GLOB))):
        try:
            dump = trace_load.read_dump(path)
        except trace_load.DumpError as e:
            _warn(f"skipping {path}: {e}")
            continue
        if dump.get("version") != FORMAT_VERSION:
            _warn(f"{path}: format version {dump.get('version')!r}, reading it as version {FORMAT_VERSION}")
        dump["file"] = path
        dumps.append(dump)
    return dumps


# ---------------------------------------------------------------------------------------------- analysis


def _progress(dump: dict) -> tuple[int, int, int]:
    """(enqueued, started, completed); a field the dump lacks is derived from its ring buffer."""
    p = dump.get("progress") if isinstance(dump.get("progress"), dict) else {}
    ops = [o for o in dump.get("ops") or [] if isinstance(o, dict) and _int(o.get("seq")) > 0]
    derived = {
        "enqueued": max((o["seq"] for o in ops), default=0),
        "started": max((o["seq"] for o in ops if o.get("state") != "queued"), default=0),
        "completed": max((o["seq"] for o in ops if o.get("state") == "completed"), default=0),
    }
    return tuple(_int(p.get(k), derived[k]) for k in ("enqueued", "started", "completed"))


def _error(dump: dict) -> dict | None:
    """The dump's error as {"code", "message" (first line), "progress", "ranks", "hosts", "seq", "op"}, or None.

    "progress" holds the lines of a timeout's message that say another rank never called the op or is frozen.
    """
    e = dump.get("error")
    if not e:
        return None
    if not isinstance(e, dict):
        e = {"message": str(e)}
    message = str(e.get("message") or "")
    progress = []
    if e.get("code") == "timeout":
        progress = [_first_line(line) for line in message.splitlines() if PROGRESS_LINE.match(line.strip())]
    return {
        "code": e.get("code"),
        "message": _first_line(message),
        "progress": progress,
        "ranks": [r for r in e.get("ranks") or [] if isinstance(r, int)],
        "hosts": list(e.get("hosts") or []),
        "seq": _int(e.get("seq"), None),
        "op": e.get("op"),
    }


def _peer_progress(dump: dict) -> dict[int, str]:
    """The dump's peer_progress as rank -> "never_called" | "frozen" | "joined"; other entries are dropped."""
    pp = dump.get("peer_progress")
    if not isinstance(pp, dict):
        return {}
    out = {}
    for key, state in pp.items():
        if str(key).isdigit() and state in PEER_STATES:
            out[int(key)] = state
    return out


def _signature(entry: dict) -> tuple:
    op = entry.get("op")
    return (op, entry.get("dtype"), None if op == "alltoall" else entry.get("count"), _redop(entry.get("redop")),
            entry.get("root"))


def _call_text(call: dict, extra: tuple = ()) -> str:
    """"allreduce(float32, count 1048576, redop sum)": redop for reductions, root when one is set, and the fields
    named in extra always."""
    parts = [str(call.get("dtype")), f"count {call.get('count')}"]
    if "reduce" in str(call.get("op")) or "redop" in extra:
        parts.append(f"redop {_redop(call.get('redop'))}")
    if _int(call.get("root"), -1) >= 0 or "root" in extra:
        parts.append(f"root {call.get('root')}")
    return f"{call.get('op')}({', '.join(parts)})"


def _bytes(entry: dict | None, key: str, peer: int) -> int:
    return _int(((entry or {}).get(key) or {}).get(str(peer)), 0)


class _Group:
    """One process group's dumps, indexed by rank, and the analysis built from them."""

    def __init__(self, name: str, dumps: list[dict], expected_size: int | None):
        self.name = name
        self.notes: list[str] = []
        self.dumps: dict[int, dict] = {}
        for d in dumps:
            r, old = d["rank"], self.dumps.get(d["rank"])
            if old is not None:
                keep = max(old, d, key=lambda x: _int(x.get("dumped_at_us")))
                self.notes.append(f"two dumps for rank {r}; kept the later one, {keep.get('file')}")
                d = keep
            self.dumps[r] = d
        sizes = sorted({_int(d.get("size")) for d in dumps if _int(d.get("size")) > 0})
        self.size = expected_size or max(sizes + [max(self.dumps) + 1])
        if len(sizes) > 1:
            self.notes.append(f"the dumps disagree on the group size ({', '.join(map(str, sizes))}); "
                              f"using {self.size}")
        outside = [r for r in self.dumps if r >= self.size]
        if outside:
            self.notes.append(f"dumps from {_ranks_word(outside)}, outside a group of {self.size}")
        self.hosts: dict[int, str] = {}
        for d in self.dumps.values():
            for p in d.get("peers") or []:
                if isinstance(p, dict) and _int(p.get("rank"), -1) >= 0 and p.get("host"):
                    self.hosts.setdefault(p["rank"], p["host"])
        for r, d in self.dumps.items():
            if d.get("host"):
                self.hosts[r] = d["host"]
        self.ops: dict[int, dict[int, dict]] = {}  # rank -> seq -> entry, collectives only
        self.p2p: dict[int, list[dict]] = {}  # rank -> unfinished send/recv entries
        for r, d in self.dumps.items():
            entries = [o for o in d.get("ops") or [] if isinstance(o, dict)]
            self.ops[r] = {o["seq"]: o for o in entries if _int(o.get("seq")) > 0}
            self.p2p[r] = [o for o in entries if _int(o.get("seq")) == 0 and o.get("state") in PENDING]
        self.progress = {r: _progress(d) for r, d in self.dumps.items()}
        self.errors = {r: _error(d) for r, d in self.dumps.items()}
        self.peer_progress = {r: _peer_progress(d) for r, d in self.dumps.items()}
        # ranks whose peer_failure error is a consequence: it names a rank that failed first with another error
        self.consequences: dict[int, list[int]] = {}
        for r, err in self.errors.items():
            if err and err["code"] == "peer_failure":
                first = [q for q in err["ranks"] if q != r and (self.errors.get(q) or {}).get("code")
                         not in (None, "peer_failure")]
                if first:
                    self.consequences[r] = first

    def host(self, rank: int) -> str:
        return self.hosts.get(rank, "?")

    def transport(self, rank: int, peer: int) -> str | None:
        for p in self.dumps.get(rank, {}).get("peers") or []:
            if isinstance(p, dict) and p.get("rank") == peer:
                return p.get("transport")
        return None

    # -- the op in question

    def pick_seq(self) -> tuple[int, bool]:
        """(S, hung): the lowest unfinished seq, or the highest seq seen when nothing is unfinished."""
        pending = {seq for ops in self.ops.values() for seq, o in ops.items() if o.get("state") in PENDING}
        pending |= {c + 1 for e, _, c in self.progress.values() if c < e}
        if pending:
            return min(pending), True
        seen = [seq for ops in self.ops.values() for seq in ops] + [e for e, _, _ in self.progress.values()]
        return max(seen, default=0), False

    def reference(self, seq: int) -> dict:
        """An entry for seq, preferring a rank that is in it (running or failed)."""
        have = [self.ops[r][seq] for r in sorted(self.ops) if seq in self.ops[r]]
        active = [o for o in have if o.get("state") in ("running", "failed")]
        return (active or have or [{}])[0]

    # -- per-rank verdicts

    def last_called(self, rank: int) -> str:
        """"last called seq 16 broadcast" (with ", which failed" when it did), for a rank behind S."""
        enq = self.progress[rank][0]
        if enq == 0:
            return "has called no collective"
        prev = self.ops[rank].get(enq) or {}
        failed = ", which failed" if prev.get("state") == "failed" else ""
        return f"last called seq {enq} {prev.get('op', '(not in its ring buffer)')}{failed}"

    def stuck_in(self, rank: int) -> str:
        """What holds the progress thread of a rank that has not started S."""
        _, started, completed = self.progress[rank]
        if started > completed:
            return f"stuck in seq {started} {(self.ops[rank].get(started) or {}).get('op', '(not in its ring buffer)')}"
        return f"last started seq {started}"

    def p2p_text(self, rank: int) -> str:
        """"recv waiting on 1, send" for the rank's unfinished point-to-point ops, or ""."""
        return ", ".join(f"{o.get('op')} waiting on {_rank_list(o['waiting_on'])}" if o.get("waiting_on")
                         else str(o.get("op")) for o in self.p2p[rank])

    def classify(self, rank: int, seq: int) -> dict:
        """The rank's state in seq and a one-line detail, with the facts behind them (see the module docstring)."""
        enq, started, completed = self.progress[rank]
        entry = self.ops[rank].get(seq) or {}
        err = self.errors[rank]
        waiting = [p for p in entry.get("waiting_on") or [] if isinstance(p, int)]
        waits = f", waiting on {_ranks_word(waiting)}" if waiting else ""
        out = {"state": None, "detail": None, "host": self.host(rank), "enqueued": enq, "started": started,
               "completed": completed, "waiting_on": waiting, "stalled_s": None,
               "error": err["message"] if err else entry.get("error"), "cause": None, "basis": None, "seen_by": [],
               "late_s": None, "reported_by": [], "waited_by": []}
        if entry.get("state") == "failed" or (err and err["seq"] == seq and completed < seq):
            code = f" ({err['code']})" if err and err["code"] else ""
            if rank in self.consequences:
                code = f" (peer_failure, after {_ranks_word(self.consequences[rank])} had failed first)"
            out.update(state="failed", detail=f"failed in seq {seq}{waits}{code}")
        elif completed >= seq:
            out.update(state="completed", detail=f"completed seq {seq}")
        elif enq < seq:
            out.update(state="never_called", detail=f"never called seq {seq} ({self.last_called(rank)})")
        elif started < seq:
            out.update(state="queued",
                       detail=f"called seq {seq} but the progress thread never started it ({self.stuck_in(rank)})")
        else:
            out.update(state="stalled", detail=f"joined seq {seq} and stalled{waits or ' (waiting on no peer)'}")
        start, dumped = _int(entry.get("start_us"), None), _int(self.dumps[rank].get("dumped_at_us"), None)
        if out["state"] in ("stalled", "failed") and start is not None and dumped is not None:
            out["stalled_s"] = round((dumped - start) / 1e6, 3)
        if self.p2p[rank]:
            out["detail"] += f"; pending p2p: {self.p2p_text(rank)}"
        return out

    # -- what the ranks that timed out saw the others doing

    def fail_time(self, rank: int, seq: int) -> int | None:
        """When rank gave up on seq: the end_us of its entry, else the time of its dump."""
        entry = self.ops[rank].get(seq) or {}
        return _int(entry.get("end_us"), None) or _int(self.dumps[rank].get("dumped_at_us"), None)

    def report_seq(self, rank: int, seq: int) -> int | None:
        """The seq the rank's peer_progress is about: its error's, else its first failed entry's, else seq when
        its entry for seq is unfinished."""
        err = self.errors[rank]
        if err and err["seq"] is not None:
            return err["seq"]
        failed = [s for s, o in self.ops[rank].items() if o.get("state") == "failed"]
        if failed:
            return min(failed)
        return seq if (self.ops[rank].get(seq) or {}).get("state") in PENDING else None

    def peer_evidence(self, seq: int) -> dict[int, tuple[str, list[int]]]:
        """rank -> (state, reporters): what the ranks that timed out in seq saw it doing, from their peer_progress.

        "never_called" or "frozen" from any reporter beats "joined"; between those two the one more reporters
        saw wins, "frozen" on a tie.
        """
        seen: dict[int, dict[str, set]] = {}
        for r in sorted(self.dumps):
            if self.peer_progress[r] and self.report_seq(r, seq) == seq:
                for q, state in self.peer_progress[r].items():
                    if q != r:
                        seen.setdefault(q, {}).setdefault(state, set()).add(r)
        out = {}
        for q, states in seen.items():
            stuck = [s for s in ("frozen", "never_called") if s in states]
            state = max(stuck, key=lambda s: len(states[s])) if stuck else "joined"
            out[q] = (state, sorted(states[state]))
        return out

    def timed_out_on(self, rank: int, seq: int) -> list[int]:
        """The ranks whose timeout in seq names rank (in the error or in their entry's waiting_on)."""
        out = []
        for q in sorted(self.dumps):
            err = self.errors[q]
            if q != rank and err and err["code"] == "timeout" and err["seq"] == seq and (
                    rank in err["ranks"] or rank in ((self.ops[q].get(seq) or {}).get("waiting_on") or [])):
                out.append(q)
        return out

    def late_by(self, rank: int, seq: int, waiters: list[int]) -> float | None:
        """Seconds between the first of waiters giving up on seq and rank calling it, when rank's dump shows it."""
        called = _int((self.ops[rank].get(seq) or {}).get("enqueue_us"), None) if rank in self.dumps else None
        gave_up = [t for t in (self.fail_time(q, seq) for q in waiters) if t is not None]
        if called is None or not gave_up:
            return None
        return round((called - min(gave_up)) / 1e6, 3)

    def apply_evidence(self, seq: int, ranks: dict[int, dict], evidence: dict) -> None:
        """Turns ranks (with a dump) into never_called or frozen in seq on the evidence of the ranks that timed
        out: their peer_progress, or the rank's own entry showing it called seq only after they had given up."""
        for r, info in ranks.items():
            if info["state"] == "completed":
                continue  # it finished seq: whatever the others saw, it did not hang them
            state, by = evidence.get(r, (None, []))
            basis = "peer_progress"
            late = self.late_by(r, seq, by) if by else None
            if state is None:  # no peer_progress about it: did it call seq after the others timed out on it?
                by = self.timed_out_on(r, seq)
                late = self.late_by(r, seq, by) if by else None
                if late is not None and late > 0:
                    state, basis = "never_called", "timing"
            if state == "never_called":
                later = f" (it called it {late:.1f} s later)" if late is not None and late > 0 else ""
                alive = "was alive but " if basis == "peer_progress" else ""
                detail = f"{alive}had not called seq {seq} when {_ranks_word(by)} timed out{later}"
            elif state == "frozen":
                detail = f"frozen (process stopped or stopped reporting) when {_ranks_word(by)} timed out in seq {seq}"
            else:
                continue
            if self.p2p[r]:
                detail += f"; pending p2p: {self.p2p_text(r)}"
            info.update(state=state, detail=detail, basis=basis, seen_by=by, stalled_s=None,
                        late_s=late if late is not None and late > 0 else None)

    def blame(self, seq: int, ranks: dict[int, dict]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """(reported, waited): rank -> the ranks whose peer_failure error names it / that wait on it in seq.

        A peer_failure that is a consequence (see consequences) names no one; a rank that reached seq only after
        the others had given up (never_called or frozen by the evidence) waits on no one.
        """
        reported: dict[int, set] = {}
        waited: dict[int, set] = {}
        for r in self.dumps:
            err = self.errors[r]
            if err and err["code"] == "peer_failure" and r not in self.consequences:
                for bad in err["ranks"]:
                    reported.setdefault(bad, set()).add(r)
            if ranks[r]["state"] in ("never_called", "frozen"):
                continue
            if err and err["code"] == "timeout" and err["seq"] == seq:
                for bad in err["ranks"]:
                    waited.setdefault(bad, set()).add(r)
            entry = self.ops[r].get(seq) or {}
            if entry.get("state") in ("running", "failed"):
                for bad in entry.get("waiting_on") or []:
                    waited.setdefault(bad, set()).add(r)
        return ({k: sorted(v - {k}) for k, v in reported.items()}, {k: sorted(v - {k}) for k, v in waited.items()})

    # -- group-wide findings

    def mismatches(self) -> list[dict]:
        found, seen = [], set()
        for seq in sorted({s for ops in self.ops.values() for s in ops}):
            calls: dict[tuple, list[int]] = {}
            for r in sorted(self.ops):
                if seq in self.ops[r]:
                    calls.setdefault(_signature(self.ops[r][seq]), []).append(r)
            if len(calls) < 2:
                continue
            rows = []
            for (op, dtype, _, redop, root), ranks in sorted(calls.items(), key=lambda kv: (-len(kv[1]), kv[1])):
                entry = self.ops[ranks[0]][seq]
                rows.append({"ranks": ranks, "op": op, "dtype": dtype, "count": entry.get("count"), "redop": redop,
                             "root": root})
            # a field that differs between calls of one op is shown even where _call_text would leave it out
            extra = tuple(k for k in ("redop", "root") if any(
                len({c[k] for c in rows if c["op"] == name}) > 1 for name in {c["op"] for c in rows}))
            text = "; ".join(f"{_ranks_word(c['ranks'])} called {_call_text(c, extra)}" for c in rows)
            found.append({"seq": seq, "calls": rows, "text": f"mismatch at seq {seq}: {text}"})
            seen.add(seq)
        reported: dict[tuple, list[int]] = {}
        for r in sorted(self.dumps):
            err = self.errors[r]
            if err and err["code"] == "mismatch" and err["seq"] not in seen:
                reported.setdefault((err["seq"], err["message"]), []).append(r)
        for (seq, message), ranks in reported.items():
            at = f" at seq {seq}" if seq is not None else ""
            found.append({"seq": seq, "calls": [], "text": f"mismatch{at} reported by {_ranks_word(ranks)}: {message}"})
        return found

    def suspect_links(self, seq: int, ranks: dict[int, dict]) -> list[dict]:
        """Waits between two ranks that both joined seq (per the verdicts, which already weigh peer_progress),
        unless a rank that never called seq, is frozen or is missing and waited on explains the hang."""
        if any(i["state"] in ("never_called", "frozen") or i["cause"] in ("never_called", "frozen", "unresponsive")
               for i in ranks.values()):
            return []
        links: dict[tuple, dict] = {}
        for r in sorted(self.dumps):
            if ranks[r]["state"] not in ("stalled", "failed") or r in self.consequences:
                continue  # a rank that failed on a peer's earlier failure arrived after the hang
            entry = self.ops[r].get(seq)
            for peer in ranks[r]["waiting_on"]:
                if peer == r or ranks.get(peer, {}).get("state") not in ("stalled", "failed", "completed"):
                    continue
                a, b = sorted((r, peer))
                link = links.setdefault((a, b), {
                    "ranks": [a, b], "hosts": [self.host(a), self.host(b)],
                    "transport": self.transport(r, peer) or self.transport(peer, r), "seq": seq, "waits": []})
                link["waits"].append({"rank": r, "on": peer, "bytes_sent": _bytes(entry, "bytes_sent", peer),
                                      "bytes_recv": _bytes(entry, "bytes_recv", peer)})
        for link in links.values():
            (a, b), (ha, hb) = link["ranks"], link["hosts"]
            over = f" [{link['transport']}]" if link["transport"] else ""
            waits = ", ".join(f"{w['rank']} waits on {w['on']} (sent {w['bytes_sent']} B, got {w['bytes_recv']} B)"
                              for w in link["waits"])
            link["text"] = f"suspect link: rank {a} ({ha}) <-> rank {b} ({hb}){over}, both in seq {seq}: {waits}"
        return list(links.values())

    def slow_links(self) -> list[dict]:
        samples = []  # (dir, src, dst, gbps, reporter)
        for r, d in self.dumps.items():
            for link in d.get("links") or []:
                if not isinstance(link, dict) or link.get("dir") not in ("send", "recv"):
                    continue
                gbps, peer = link.get("gbps"), _int(link.get("peer"), -1)
                if not isinstance(gbps, (int, float)) or peer < 0 or _int(link.get("bytes"), 1) <= 0:
                    continue  # an idle link in the window says nothing about its speed
                if _int(link.get("samples"), 3) < 3:
                    continue  # too few transfers to judge (the engine uses the same floor)
                src, dst = (r, peer) if link["dir"] == "send" else (peer, r)
                # Links are compared with links of the same transport and direction: a shm send
                # into a FIFO with room is a memcpy, a socket receive waits on the wire.
                kind = str(self.transport(r, peer) or "").split(" ")[0]
                samples.append(((kind, link["dir"]), src, dst, float(gbps), r))
        slow: dict[tuple, dict] = {}
        for klass in sorted({s[0] for s in samples}):
            rates = [s[3] for s in samples if s[0] == klass]
            if len(rates) < 2:
                continue
            median = statistics.median(rates)
            for _, src, dst, gbps, reporter in (s for s in samples if s[0] == klass):
                if gbps >= SLOW_FRACTION * median:
                    continue
                item = slow.setdefault((src, dst), {"src": src, "dst": dst, "src_host": self.host(src),
                                                    "dst_host": self.host(dst), "gbps": gbps, "median_gbps": median,
                                                    "reported_by": []})
                if gbps < item["gbps"]:
                    item.update(gbps=gbps, median_gbps=median)
                item["reported_by"] = sorted(set(item["reported_by"]) | {reporter})
        for item in slow.values():
            item["text"] = (f"slow link: rank {item['src']} -> rank {item['dst']} ({item['src_host']} -> "
                            f"{item['dst_host']}) {item['gbps']:.2f} GB/s vs median {item['median_gbps']:.2f} GB/s")
        return sorted(slow.values(), key=lambda i: i["gbps"] / i["median_gbps"] if i["median_gbps"] else 0.0)

    def stragglers(self) -> list[dict]:
        lags = {}
        for r, d in self.dumps.items():
            arrival = d.get("arrival")
            if isinstance(arrival, dict) and isinstance(arrival.get("lag_us_mean"), (int, float)):
                lags[r] = arrival
        found = []
        for r in sorted(lags):
            others = [a["lag_us_mean"] for q, a in lags.items() if q != r]
            if not others:
                continue
            lag, median = float(lags[r]["lag_us_mean"]), statistics.median(others)
            if lag > STRAGGLER_FACTOR * median and lag > STRAGGLER_MIN_US:
                found.append({"rank": r, "host": self.host(r), "lag_us_mean": lag, "median_us": median,
                              "text": f"straggler: rank {r} ({self.host(r)}) arrives {lag / 1000:.2f} ms late on "
                                      f"average, the others' median is {median / 1000:.2f} ms"})
        return found

    def error_list(self, ranks: dict[int, dict]) -> list[dict]:
        grouped: dict[tuple, list[int]] = {}
        for r in sorted(self.dumps):
            err = self.errors[r]
            if err:
                grouped.setdefault((err["code"], err["message"], err["seq"], err["op"]), []).append(r)
            elif ranks[r]["error"]:  # no error of its own, but a failed entry carries one
                grouped.setdefault((None, _first_line(ranks[r]["error"]), None, None), []).append(r)
        out, shown = [], set()
        for (code, message, seq, op), rs in grouped.items():
            # where it failed, unless the message says so itself
            where = "" if seq is None or f"seq {seq}" in message else " ".join(str(x) for x in (op, f"seq {seq}") if x)
            text = f"{_ranks_word(rs)}: " + (f"[{code}] " if code else "") + (f"{where}: " if where else "") + message
            progress = []  # the never called / frozen lines of timeouts, each once across the ranks
            for r in rs:
                for line in (self.errors[r] or {}).get("progress") or []:
                    if line not in shown:
                        shown.add(line)
                        progress.append(line)
            out.append({"ranks": rs, "code": code, "message": message, "progress": progress, "seq": seq, "op": op,
                        "text": text})
        return out


def _them(ranks, it: str = "it", them: str = "them") -> str:
    return it if len(set(ranks)) == 1 else them


def _headline(g: dict, grp: _Group) -> str:
    """The single most useful sentence about group g (see the module docstring for the order)."""
    seq, ranks = g["seq"], g["ranks"]
    what = f"{g['op']} seq {seq}" if g["op"] else f"seq {seq}"
    by_state: dict[str, list[int]] = {}
    for r, info in ranks.items():
        by_state.setdefault(info["state"], []).append(r)
    missing = {r: ranks[r] for r in g["missing"]}
    if g["mismatch"]:
        return g["mismatch"][0]["text"]
    dead = [r for r, m in missing.items() if m["cause"] == "died"]
    if dead:
        by = sorted({q for r in dead for q in missing[r]["reported_by"]})
        return f"{_ranks_word(dead)} died (peer failure reported by {_ranks_word(by)})"
    never = [r for r, i in ranks.items() if i["state"] == "never_called" or i["cause"] == "never_called"]
    seen = [r for r in never if ranks[r]["basis"] == "peer_progress"]
    if seen:
        by = sorted({q for r in seen for q in ranks[r]["seen_by"]})
        return (f"{_ranks_word(seen)} never called {what}: {_ranks_word(by)} timed out waiting for {_them(seen)} "
                f"while {_them(seen, 'it was', 'they were')} alive in code before the call")
    late = [r for r in never if ranks[r]["basis"] == "timing"]
    if late:
        by = sorted({q for r in late for q in ranks[r]["seen_by"]})
        first = min(ranks[r]["late_s"] for r in late)
        return (f"{_ranks_word(late)} called {what} too late: {_ranks_word(by)} had timed out waiting for "
                f"{_them(late)} ({_them(late, 'it', 'the first')} called it {first:.1f} s later)")
    if never:
        lasts = {grp.last_called(r) for r in never}
        tail = f" ({lasts.pop()})" if len(lasts) == 1 else ""
        if not g["hung"]:
            return f"nothing pending; {_ranks_word(never)} not yet at {what}{tail}"
        return f"{_ranks_word(never)} never called {what}{tail}"
    frozen = [r for r, i in ranks.items() if i["state"] == "frozen" or i["cause"] == "frozen"]
    if frozen:
        by = sorted({q for r in frozen for q in ranks[r]["seen_by"]})
        return (f"{_ranks_word(frozen)} {_them(frozen, 'was', 'were')} frozen "
                f"({_them(frozen, 'process', 'processes')} stopped) while {_ranks_word(by)} waited for "
                f"{_them(frozen)} in {what}")
    blamed = sorted(r for r, info in ranks.items() if info["reported_by"] and r not in missing)
    for r in blamed:
        mutual = [q for q in ranks[r]["reported_by"] if r in ranks[q]["reported_by"]]
        if mutual:
            q = mutual[0]
            return (f"the connection between rank {r} ({grp.host(r)}) and rank {q} ({grp.host(q)}) broke: "
                    f"each reported a peer failure on the other")
    if blamed:
        r = blamed[0]
        return (f"rank {r} ({grp.host(r)}) lost its connections (peer failure reported by "
                f"{_ranks_word(ranks[r]['reported_by'])}); rank {r} {ranks[r]['detail']}")
    silent = [r for r, m in missing.items() if m["cause"] == "unresponsive"]
    if silent:
        by = sorted({q for r in silent for q in missing[r]["waited_by"]})
        return (f"{_ranks_word(silent)} left no dump and {_ranks_word(by)} waited on {_them(silent)} in {what}: "
                f"frozen, dead or unreachable")
    if "queued" in by_state:
        q = by_state["queued"]
        return f"{_ranks_word(q)} called {what} but never started it (rank {q[0]} {grp.stuck_in(q[0])})"
    odd = [r for r in by_state.get("failed", []) if ranks[r]["error"] and r not in grp.consequences and
           (grp.errors.get(r) or {}).get("code") not in ("timeout", "peer_failure")]
    if odd:
        r = odd[0]
        code = (grp.errors.get(r) or {}).get("code")
        return f"{_ranks_word(odd)} failed in {what}: " + (f"[{code}] " if code else "") + str(ranks[r]["error"])
    if g["suspect_links"]:
        link = g["suspect_links"][0]
        stuck = by_state.get("stalled", []) + by_state.get("failed", [])
        (a, b), (ha, hb) = link["ranks"], link["hosts"]
        return (f"{_ranks_word(stuck)} joined {what} and stalled; link rank {a} ({ha}) <-> rank {b} ({hb}) "
                f"suspected broken")
    stuck = by_state.get("stalled", []) + by_state.get("failed", [])
    if stuck:
        on = sorted({p for r in stuck for p in ranks[r]["waiting_on"]})
        return f"{_ranks_word(stuck)} stalled in {what}" + (f", waiting on {_ranks_word(on)}" if on else "")
    if missing:
        return f"{_ranks_word(list(missing))} left no dump (died before writing one, or never reached init)"
    p2p = sorted(r for r in grp.dumps if grp.p2p[r])
    if p2p:
        return f"{_ranks_word(p2p)} stalled in point-to-point ops (rank {p2p[0]}: {grp.p2p_text(p2p[0])})"
    if seq == 0:
        return "no failure: no collective called yet"
    done = f"no failure: all ranks completed {what}"
    if g["slow_links"]:
        return f"{done}; {g['slow_links'][0]['text']}"
    if g["stragglers"]:
        return f"{done}; {g['stragglers'][0]['text']}"
    return done


def _analyze_group(name: str, dumps: list[dict], expected_size: int | None) -> dict:
    grp = _Group(name, dumps, expected_size)
    seq, hung = grp.pick_seq()
    ref = grp.reference(seq)
    ranks = {r: grp.classify(r, seq) for r in sorted(grp.dumps)}
    evidence = grp.peer_evidence(seq)
    grp.apply_evidence(seq, ranks, evidence)
    reported, waited = grp.blame(seq, ranks)
    missing = [r for r in range(grp.size) if r not in grp.dumps]
    unknown = None  # one entry shared by every missing rank nothing is known about: a group may have 2^20 ranks
    for r in missing:
        if r not in evidence and r not in reported and r not in waited and r not in grp.hosts:
            if unknown is None:
                unknown = {"state": "missing", "detail": "no dump (process died before it could write one, or "
                                                         "never reached init)", "host": None, "enqueued": None,
                           "started": None, "completed": None, "waiting_on": [], "stalled_s": None, "error": None,
                           "cause": "unknown", "basis": None, "seen_by": [], "late_s": None, "reported_by": [],
                           "waited_by": []}
            ranks[r] = unknown
            continue
        info = {"state": "missing", "detail": None, "host": grp.hosts.get(r), "enqueued": None, "started": None,
                "completed": None, "waiting_on": [], "stalled_s": None, "error": None, "cause": None, "basis": None,
                "seen_by": [], "late_s": None, "reported_by": reported.get(r, []), "waited_by": waited.get(r, [])}
        state, by = evidence.get(r, (None, []))
        if state == "frozen":
            info.update(cause="frozen", basis="peer_progress", seen_by=by,
                        detail=f"no dump; frozen (process stopped or stopped reporting) when {_ranks_word(by)} timed "
                               f"out in seq {seq}")
        elif info["reported_by"]:
            info.update(cause="died",
                        detail=f"no dump; {_ranks_word(info['reported_by'])} reported a peer failure on it -> died")
        elif state == "never_called":
            info.update(cause="never_called", basis="peer_progress", seen_by=by,
                        detail=f"no dump; was alive but had not called seq {seq} when {_ranks_word(by)} timed out")
        elif info["waited_by"]:
            info.update(cause="unresponsive", detail=f"no dump; {_ranks_word(info['waited_by'])} waited on it in "
                                                     f"seq {seq} -> frozen, dead or unreachable")
        else:
            info.update(cause="unknown", detail="no dump (process died before it could write one, or never reached "
                                                "init)")
        ranks[r] = info
    for r in grp.dumps:
        ranks[r]["reported_by"] = reported.get(r, [])
        ranks[r]["waited_by"] = waited.get(r, [])
    ranks = dict(sorted(ranks.items()))
    stamps = [_int(d.get("dumped_at_us")) for d in grp.dumps.values() if _int(d.get("dumped_at_us")) > 0]
    reasons: dict[str, int] = {}
    for d in grp.dumps.values():
        reason = str(d.get("reason") or "unknown")
        reasons[reason] = reasons.get(reason, 0) + 1
    g = {
        "group": name, "size": grp.size, "dumps": len(grp.dumps), "status": None, "headline": None,
        "seq": seq, "hung": hung, "op": ref.get("op"), "dtype": ref.get("dtype"), "count": ref.get("count"),
        "redop": _redop(ref.get("redop")), "root": ref.get("root"),
        "ranks": ranks, "missing": missing, "mismatch": (mismatch := grp.mismatches()),
        # Ranks that called different ops wait on each other by design: no link is to blame.
        "suspect_links": [] if mismatch else grp.suspect_links(seq, ranks), "slow_links": grp.slow_links(),
        "stragglers": grp.stragglers(), "errors": grp.error_list(ranks),
        "dumped_at_us": [min(stamps), max(stamps)] if stamps else None, "reasons": reasons, "notes": grp.notes,
    }
    if g["errors"] or g["mismatch"] or any(ranks[r]["cause"] == "died" for r in missing):
        g["status"] = "failed"
    elif hung or any(ranks[r]["waited_by"] for r in missing):
        g["status"] = "hung"
    elif missing:
        g["status"] = "incomplete"
    elif g["slow_links"] or g["stragglers"]:
        g["status"] = "degraded"
    else:
        g["status"] = "ok"
    plural = "" if g["dumps"] == 1 else "s"
    g["headline"] = (f"railcc trace: group {name}, {grp.size} ranks, {g['dumps']} dump{plural} - "
                     f"{_headline(g, grp)}")
    return g


def analyze(dumps: list[dict], expected_size: int | None = None) -> dict:
    """The verdict for dumps (as load_dumps returns them), one entry per group, worst first.

    expected_size, when given, is taken as the size of every group (for dumps that lack it or when the
    missing ranks are the highest ones and no dump says how many there are). The dict is described in the
    module docstring.
    """
    by_group: dict[str, list[dict]] = {}
    for d in dumps:
        by_group.setdefault(str(d.get("group", "")), []).append(d)
    groups = [_analyze_group(name, ds, expected_size) for name, ds in by_group.items()]
    groups.sort(key=lambda g: (STATUS_ORDER.index(g["status"]), _natural(g["group"])))
    return {"version": FORMAT_VERSION, "groups": groups}


# ---------------------------------------------------------------------------------------------- output


def _capped(lines: list[str], limit: int, indent: str = "  ") -> list[str]:
    out = [indent + line for line in lines[:limit]]
    if len(lines) > limit:
        out.append(f"{indent}... {len(lines) - limit} more (see --json)")
    return out


def _format_group(g: dict) -> list[str]:
    out = [g["headline"]]
    op = _call_text(g) if g["op"] else "(none)" if g["seq"] == 0 else "(not in any ring buffer)"
    stalled = [i["stalled_s"] for i in g["ranks"].values() if i["stalled_s"] is not None]
    since = f", running for up to {max(stalled):.1f} s when dumped" if stalled and g["hung"] else ""
    out.append(f"  op: seq {g['seq']} {op}{since}")
    if g["dumped_at_us"]:
        first, last = g["dumped_at_us"]
        reasons = ", ".join(f"{k} x{v}" for k, v in sorted(g["reasons"].items()))
        out.append(f"  dumps: {_utc(first)} (+{(last - first) / 1e6:.1f} s), reason {reasons}")
    lines, by_detail = [], {}
    for r, info in g["ranks"].items():
        by_detail.setdefault(info["detail"], []).append(r)
    for detail, rs in by_detail.items():
        hosts = {g["ranks"][r]["host"] for r in rs}
        where = f" ({hosts.pop()})" if len(hosts) == 1 and None not in hosts else ""
        lines.append(f"{_ranks_word(rs)}{where}: {detail}")
    out += _capped(lines, MAX_RANK_LINES)
    out += _capped([m["text"] for m in g["mismatch"]], MAX_LIST_LINES)
    out += _capped([x["text"] for x in g["suspect_links"] + g["slow_links"]], MAX_LIST_LINES)
    out += _capped([s["text"] for s in g["stragglers"]], MAX_LIST_LINES)
    if g["errors"]:
        out.append("  errors:")
        for e in g["errors"][:MAX_ERROR_LINES]:
            out.append(f"    {e['text']}")
            out += [f"      {line}" for line in e.get("progress") or []]
        if len(g["errors"]) > MAX_ERROR_LINES:
            out.append(f"    ... {len(g['errors']) - MAX_ERROR_LINES} more (see --json)")
    out += _capped([f"note: {n}" for n in g["notes"]], MAX_LIST_LINES)
    return out


def format_verdict(result: dict) -> str:
    """The printed verdict for an analyze() result: one section per group, worst first."""
    return "\n\n".join("\n".join(_format_group(g)) for g in result["groups"])


def main(argv: list[str] | None = None) -> int:
    """python -m railcc trace DIR [--json] [--size N]; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m railcc trace",
                                     description="Merge railcc flight-recorder dumps (railcc-trace-*.json) "
                                                 "and say which rank or link hung the group.")
    parser.add_argument("dir", help="folder holding every rank's dump")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    parser.add_argument("--size", type=int, default=None, help="the group size, when no dump can say it")
    try:
        args = parser.parse_args(argv)
        if args.size is not None and not 1 <= args.size <= MAX_GROUP_SIZE:
            parser.error(f"--size must be from 1 to {MAX_GROUP_SIZE}, not {args.size}")
    except SystemExit as e:  # argparse exits on bad arguments and --help; return its status instead
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        dumps = load_dumps(args.dir)
    except FileNotFoundError as e:
        print(f"railcc trace: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not dumps:
        print(f"railcc trace: no readable dump ({DUMP_GLOB}) in {args.dir}", file=sys.stderr)
        return EXIT_USAGE
    result = analyze(dumps, expected_size=args.size)
    if args.json:  # streamed: a group of 2^20 ranks makes a JSON text of hundreds of MB
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(format_verdict(result))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
