"""Reading one railcc flight-recorder dump (railcc-trace-<group>-rank<R>.json) for `python -m railcc trace`.

A dump comes from a folder anything may have written into: a crashing rank, another job, a careless copy or a
hostile user. read_dump() therefore refuses, with a DumpError whose text is one line naming the field at fault and
what was expected, anything the analysis could trip on:

* a path that is not a regular file (a FIFO would block the read until a writer came, /dev/zero never ends), and a
  file over MAX_DUMP_BYTES (at most that much is read, whatever the size stat reports);
* bytes that are not JSON, or JSON nested deeper than the parser's recursion limit (bytes that are not UTF-8 are
  read as U+FFFD: the engine copies into error messages bytes that other processes sent, and such a message must
  not cost the dump);
* any field the analysis reads with the wrong type (a bool is not an integer) or out of range: a rank or group
  size beyond MAX_GROUP_SIZE (the analysis lists every rank of the group), a time in microseconds that is negative
  or past the year 9999 (it is printed as a date), an integer beyond int64 (the engine's counters are int64).

A field that is absent or null is accepted wherever the analysis has a default for it (dumps of processes that
died while writing them lack some). Fields the analysis does not read (pid, lags, busy_us, ...) are not checked.
It needs only the standard library, as verdict.py beside it does.
"""

from __future__ import annotations

import json
import math
import os
import stat

MAX_DUMP_BYTES = 256 << 20  # a 100,000-rank group's dump (a peer and a lag entry per rank) is about 20 MiB
MAX_GROUP_SIZE = 1 << 20
MAX_US = 253_402_214_400 * 1_000_000  # 9999-12-31 00:00 UTC in microseconds since 1970: still printable as a date
INT64_MAX = (1 << 63) - 1
MAX_NAME = 4096  # host, group, op, dtype, state, transport, ... : names, not texts
RANK = (0, MAX_GROUP_SIZE - 1)
COUNTER = (0, INT64_MAX)
TIME = (0, MAX_US)


class DumpError(ValueError):
    """A file that is not a usable dump; its text says why in one line (the field at fault, what was expected)."""


def _show(value) -> str:
    """A short rendering of a bad value for the message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {len(str(abs(value)))} digits"
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__
    if isinstance(value, (list, dict)):
        text = "a list" if isinstance(value, list) else "an object"
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(where: str, value, expected: str):
    raise DumpError(f"{where} is {_show(value)}, expected {expected}")


def _int(obj: dict, key: str, where: str, bounds: tuple[int, int], required: bool = False) -> None:
    value = obj.get(key)
    if value is None and not required:
        return
    lo, hi = bounds
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        _fail(where, value, f"an integer from {lo} to {hi}")


def _num(obj: dict, key: str, where: str) -> None:
    value = obj.get(key)
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        _fail(where, value, "a finite number, 0 or more")


def _str(obj: dict, key: str, where: str, limit: int | None = MAX_NAME) -> None:
    value = obj.get(key)
    if value is None:
        return
    if not isinstance(value, str):
        _fail(where, value, "a string")
    if limit is not None and len(value) > limit:
        raise DumpError(f"{where} is a string of {len(value)} characters, expected at most {limit}")


def _kind(obj: dict, key: str, where: str, kind: type) -> list | dict:
    """obj[key] if it is a kind (list or dict), the empty one when it is absent or null."""
    value = obj.get(key)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        _fail(where, value, "a list" if kind is list else "an object")
    return value


def _items(obj: dict, key: str, where: str) -> list[tuple[str, dict]]:
    """(where, entry) for each entry of the list obj[key], each of which must be an object."""
    out = []
    for i, entry in enumerate(_kind(obj, key, where, list)):
        if not isinstance(entry, dict):
            _fail(f"{where}[{i}]", entry, "an object")
        out.append((f"{where}[{i}]", entry))
    return out


def _ranks(obj: dict, key: str, where: str) -> None:
    for i, r in enumerate(_kind(obj, key, where, list)):
        _int({"r": r}, "r", f"{where}[{i}]", RANK, required=True)


def _check_error(e, where: str = "error") -> None:
    if e is None or isinstance(e, str):
        return
    if not isinstance(e, dict):
        _fail(where, e, "an object, a string or null")
    for key in ("code", "op"):
        _str(e, key, f"{where}.{key}")
    _str(e, "message", f"{where}.message", limit=None)
    _ranks(e, "ranks", f"{where}.ranks")
    for i, h in enumerate(_kind(e, "hosts", f"{where}.hosts", list)):
        _str({"h": h}, "h", f"{where}.hosts[{i}]")
    _int(e, "seq", f"{where}.seq", COUNTER)


def _check_op(o: dict, where: str) -> None:
    _int(o, "seq", f"{where}.seq", COUNTER)
    for key in ("op", "dtype", "redop", "state"):
        _str(o, key, f"{where}.{key}")
    for key in ("count", "root"):
        _int(o, key, f"{where}.{key}", (-INT64_MAX - 1, INT64_MAX))
    for key in ("enqueue_us", "start_us", "end_us"):
        _int(o, key, f"{where}.{key}", TIME)
    for key in ("bytes_sent", "bytes_recv"):
        for peer, n in _kind(o, key, f"{where}.{key}", dict).items():
            _int({"n": n}, "n", f"{where}.{key}[{_show(peer)}]", COUNTER, required=True)
    _ranks(o, "waiting_on", f"{where}.waiting_on")
    _str(o, "error", f"{where}.error", limit=None)


def check_dump(dump) -> None:
    """Raises DumpError when dump (parsed JSON) is not a rank's dump the analysis can read (see the docstring)."""
    if not isinstance(dump, dict):
        _fail("the file", dump, "a JSON object")
    if dump.get("rank") is None:
        raise DumpError("rank is missing: not a rank's dump")
    _int(dump, "rank", "rank", RANK, required=True)
    _int(dump, "size", "size", (1, MAX_GROUP_SIZE))
    _int(dump, "version", "version", (0, INT64_MAX))
    group = dump.get("group")
    if isinstance(group, bool) or not isinstance(group, (str, int, type(None))):
        _fail("group", group, "a string")
    _str(dump, "group", "group")
    for key in ("host", "reason"):
        _str(dump, key, key)
    _int(dump, "dumped_at_us", "dumped_at_us", TIME)
    _check_error(dump.get("error"))
    progress = _kind(dump, "progress", "progress", dict)
    for key in ("enqueued", "started", "completed"):
        _int(progress, key, f"progress.{key}", COUNTER)
    for where, p in _items(dump, "peers", "peers"):
        _int(p, "rank", f"{where}.rank", RANK)
        for key in ("host", "transport"):
            _str(p, key, f"{where}.{key}")
    for where, o in _items(dump, "ops", "ops"):
        _check_op(o, where)
    for where, link in _items(dump, "links", "links"):
        _int(link, "peer", f"{where}.peer", RANK)
        _str(link, "dir", f"{where}.dir")
        for key in ("bytes", "samples"):
            _int(link, key, f"{where}.{key}", COUNTER)
        _num(link, "gbps", f"{where}.gbps")
    _num(_kind(dump, "arrival", "arrival", dict), "lag_us_mean", "arrival.lag_us_mean")
    for key, state in _kind(dump, "peer_progress", "peer_progress", dict).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 7 and int(key) <= RANK[1]):
            raise DumpError(f"peer_progress has the key {_show(key)}, expected ranks from 0 to {RANK[1]}")
        _str({"s": state}, "s", f"peer_progress[{_show(key)}]")


def read_dump(path: str) -> dict:
    """The dump in the file at path, checked (check_dump). Raises DumpError, its text naming what is wrong."""
    too_big = f"larger than {MAX_DUMP_BYTES >> 20} MiB, more than any dump the engine writes"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise DumpError("not a regular file: a dump is a file the engine wrote")
        if st.st_size > MAX_DUMP_BYTES:
            raise DumpError(too_big)
        # O_NONBLOCK: should the path have become a FIFO since the stat, the open does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise DumpError("not a regular file: a dump is a file the engine wrote")
            data = f.read(MAX_DUMP_BYTES + 1)
    except OSError as e:
        raise DumpError(f"cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_DUMP_BYTES:  # it grew after the stat
        raise DumpError(too_big)
    try:
        dump = json.loads(data.decode("utf-8", errors="replace"))
    except RecursionError:
        raise DumpError("not a dump: its JSON is nested too deeply") from None
    except json.JSONDecodeError as e:
        raise DumpError(f"not valid JSON: {e}") from None
    except ValueError:  # Python refuses to parse integers of over 4300 digits
        raise DumpError("not a dump: it holds an integer of thousands of digits") from None
    check_dump(dump)
    return dump
