"""What `railcc doctor` and `railcc topo` are given, checked before it is used: arguments, torchrun's variables,
files, and what other ranks publish through the job's store. A careless or hostile value is refused at once with
one line naming the argument, variable, file or rank and saying what was expected, never with a traceback, a
wait or an allocation sized by the value."""

import argparse
import errno
import json
import math
import os
import stat

MAX_LOCAL_RANKS = 4096  # ranks on one host: far past any machine's GPUs or cores
MAX_WORLD = 1 << 20  # ranks in a job, as `railcc trace` accepts
MAX_TIMEOUT_S = 7 * 86400.0
MAX_TOPO_BYTES = 64 << 20  # hwloc XML, as the engine's own check of RAILCC_TOPO_FILE (csrc/topology/topology.cpp)
MAX_RAIL_LINE = 64 << 10  # one rank's rail line (topo --all-ranks): a host, a NIC and up to 256 rails
MAX_REPORT_BYTES = 1 << 20  # one rank's doctor report (doctor --all-ranks): a few KiB on a big host


class UsageError(Exception):
    """A careless argument or variable; the text names it and says what was expected."""


class BadReport(Exception):
    """What a rank published through the store is not what that command publishes; the text says why."""


def _whole(text):
    """int(text) for a plain decimal whole number ("8", " 8", "-1"), else None ("1e12", "8.0", "abc", "²")."""
    text = str(text).strip()
    body = text[1:] if text[:1] in "+-" else text
    if not body.isascii() or not body.isdigit() or len(body) > 30:
        return None
    return int(text)


def count(lo, hi):
    """An argparse type: a whole number from lo to hi (argparse names the option in its error)."""

    def parse(text):
        value = _whole(text)
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected a whole number from {lo} to {hi}, not {text!r}")
        return value

    parse.__name__ = "count"
    return parse


def seconds(text):
    """An argparse type: a finite number of seconds, more than 0 and at most MAX_TIMEOUT_S."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected seconds, more than 0 and at most {MAX_TIMEOUT_S:.0f}, not {text!r}")
    return value


def env_count(env, name, lo, hi, default=None):
    """The variable as a whole number from lo to hi, default when it is unset or empty; else UsageError."""
    text = env.get(name)
    if text is None or text.strip() == "":
        return default
    value = _whole(text)
    if value is None or not lo <= value <= hi:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise UsageError(f"{name}={shown!r}: expected a whole number from {lo} to {hi}")
    return value


def torchrun_env(env, command):
    """The job's shape from torchrun's variables: {rank, world, local_rank, local_world, addr, port}.

    UsageError when one is missing (the command is then not run under torchrun) or careless.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(v, "").strip()]
    if missing:
        raise UsageError(f"needs torchrun's {', '.join(missing)} (run it as `torchrun ... -m {command}`)")
    world = env_count(env, "WORLD_SIZE", 1, MAX_WORLD)
    rank = env_count(env, "RANK", 0, MAX_WORLD - 1)
    if rank >= world:
        raise UsageError(f"RANK={rank} is not below WORLD_SIZE={world}")
    local_world = env_count(env, "LOCAL_WORLD_SIZE", 1, MAX_LOCAL_RANKS, default=1)
    local_rank = env_count(env, "LOCAL_RANK", 0, MAX_LOCAL_RANKS - 1, default=0)
    if local_rank >= local_world:
        raise UsageError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world}")
    port = env_count(env, "MASTER_PORT", 1, 65535)
    return {"rank": rank, "world": world, "local_rank": local_rank, "local_world": local_world,
            "addr": env["MASTER_ADDR"].strip(), "port": port}


def topology_file(path, named):
    """UsageError unless path is a regular file of at most MAX_TOPO_BYTES; named is how the user gave it
    ("--topo-file X" or "RAILCC_TOPO_FILE=X"). A device or FIFO would be read without end by hwloc."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UsageError(f"{named}: {'no such file' if e.errno == errno.ENOENT else e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{named}: not a regular file (a device, FIFO or directory); it names an hwloc XML file, "
                         f"as lstopo --of xml writes")
    if st.st_size > MAX_TOPO_BYTES:
        raise UsageError(f"{named}: {st.st_size >> 20} MiB, more than any machine's hwloc XML (at most "
                         f"{MAX_TOPO_BYTES >> 20} MiB)")


def write_file(path, text, named):
    """Writes text to path; OSError becomes a UsageError naming it. A FIFO nobody reads is refused, not waited on."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = "a FIFO nobody reads" if e.errno == errno.ENXIO else e.strerror
        raise UsageError(f"{named}: cannot write it: {why}") from None
    try:
        os.set_blocking(fd, True)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"{named}: cannot write it: {e.strerror}") from None


def decode(raw, limit, what):
    """The store value raw as text: BadReport naming what (e.g. "rank 3's rail line") when it is over limit bytes or
    not UTF-8."""
    if len(raw) > limit:
        raise BadReport(f"{what} is {len(raw)} bytes, more than the {limit} it can be")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadReport(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _need(cond, what, field, expected, value):
    if not cond:
        shown = json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else \
            type(value).__name__
        raise BadReport(f"{what}: {field} is {shown[:40]}, expected {expected}")


def doctor_report(raw, rank):
    """The doctor report rank published (JSON), checked for every field --all-ranks reads; else BadReport."""
    what = f"rank {rank}'s report"
    text = decode(raw, MAX_REPORT_BYTES, what)
    try:
        r = json.loads(text)
    except RecursionError:
        raise BadReport(f"{what} is not a doctor report: its JSON is nested too deeply") from None
    except ValueError as e:
        raise BadReport(f"{what} is not a doctor report: {str(e)[:120]}") from None
    _need(isinstance(r, dict), what, "the report", "a JSON object", r)
    _need(isinstance(r.get("host"), str) and 0 < len(r["host"]) <= 1024, what, "host", "a host name", r.get("host"))
    _need(r.get("rank") == rank and not isinstance(r.get("rank"), bool), what, "rank", str(rank), r.get("rank"))
    for key in ("failed", "warnings"):
        v = r.get(key)
        _need(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1 << 20, what, key, "a count", v)
    checks = r.get("checks")
    _need(isinstance(checks, list), what, "checks", "a list", checks)
    for i, c in enumerate(checks):
        _need(isinstance(c, dict), what, f"checks[{i}]", "an object", c)
        for key in ("check", "verdict"):
            _need(isinstance(c.get(key), str), what, f"checks[{i}].{key}", "a string", c.get(key))
    facts = r.get("facts")
    _need(isinstance(facts, dict), what, "facts", "an object", facts)
    for k, v in facts.items():
        _need(isinstance(v, str), what, f"facts[{json.dumps(k)[:40]}]", "a string", v)
    return r


def rail_fields(raw, rank):
    """(line, fields) of the rail line rank published ("host=...;rank=...;nic=...;rail=...;rails=...;0=..."), with
    the fields `railcc topo --all-ranks` prints checked; else BadReport."""
    what = f"rank {rank}'s rail line"
    line = decode(raw, MAX_RAIL_LINE, what)
    f = dict(kv.split("=", 1) for kv in line.split(";") if "=" in kv)
    _need(bool(f.get("host")), what, "host", "a host name", f.get("host"))
    _need(_whole(f.get("rank", "")) == rank, what, "rank", str(rank), f.get("rank"))
    rail = _whole(f.get("rail", ""))
    _need(rail is not None and -1 <= rail <= 255, what, "rail", "a rail from -1 (none) to 255", f.get("rail"))
    return line, f
