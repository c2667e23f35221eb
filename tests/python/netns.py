"""Two "hosts" on one machine: a pair of network namespaces joined by a veth pair.

    with two_hosts() as h:
        h.ns_a, h.ns_b          # namespace names
        h.addr_a, h.addr_b      # 10.213.X.1 and 10.213.X.2 (a /24 private to the pair)
        h.if_a, h.if_b          # the veth end inside each namespace
        subprocess.run(h.exec_prefix(h.ns_a) + [sys.executable, ...])
        h.slow_link("100mbit")  # tbf on one end, for straggler tests

Each namespace has only `lo` and its veth end, so traffic between the two addresses never
leaves the machine, and nothing outside the pair is reachable from inside it. Every
subprocess call here has a timeout. Namespaces are deleted on exit (also when the body
raises), from an atexit hook as a backstop, and namespaces left behind by dead processes
(their pid is in the name) are deleted when a new pair is made.

With hosts_file=True (default) /etc/netns/NS/hosts is written (`ip netns exec` bind-mounts
it over /etc/hosts) so that each namespace's hostname resolves to its veth address;
exec_prefix(ns, own_hostname=True) also gives the command that hostname (`unshare --uts`).
"""

import atexit
import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import threading
import time

DEFAULT_PREFIX = "rcc"
_ETC_NETNS = "/etc/netns"  # per-namespace /etc overrides used by `ip netns exec`
_CMD_TIMEOUT = 20

_lock = threading.Lock()
_seq = 0
_live = set()  # namespace names this process created and has not deleted yet
_made_etc_netns = False  # whether this process created /etc/netns


class NetnsError(RuntimeError):
    pass


def _run(cmd, timeout=_CMD_TIMEOUT, check=True):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise NetnsError(f"{' '.join(cmd)}: timed out after {timeout}s") from e
    except OSError as e:
        raise NetnsError(f"{' '.join(cmd)}: {e}") from e
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed (rc {p.returncode}): {p.stderr.strip()}")
    return p


def _netns_del(name):
    try:
        _run(["ip", "netns", "del", name], check=False)
    except NetnsError:
        pass
    shutil.rmtree(os.path.join(_ETC_NETNS, name), ignore_errors=True)
    _live.discard(name)
    if _made_etc_netns and not _live:
        try:
            os.rmdir(_ETC_NETNS)  # only if we created it and it is empty again
        except OSError:
            pass


def _list_netns():
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _name_re(prefix):
    return re.compile(rf"^{re.escape(prefix)}-(\d+)-(?:\d+-[ab]|probe)$")


def cleanup_stale(prefix=DEFAULT_PREFIX):
    """Deletes namespaces named by this module whose creating process is gone."""
    pat = _name_re(prefix)
    removed = []
    try:
        etc = os.listdir(_ETC_NETNS)
    except OSError:
        etc = []
    for name in sorted(set(_list_netns()) | set(etc)):
        m = pat.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _netns_del(name)
            removed.append(name)
    return removed


@functools.lru_cache(maxsize=None)
def _probe():
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) not found"
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) not found"
    name = f"{DEFAULT_PREFIX}-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", name])
        _live.add(name)
        try:
            _run(["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
        finally:
            _netns_del(name)
    except NetnsError as e:
        return f"cannot create network namespaces / veth pairs: {e}"
    return None


def netns_available():
    """True when we are root and `ip netns add` plus a veth pair work here."""
    return _probe() is None


def netns_unavailable_reason():
    """Why netns_available() is False (None when it is True)."""
    return _probe()


def _rate_bits(rate):
    """'100mbit' -> 100e6; accepts bit/kbit/mbit/gbit (and k/m/g), or a number of bit/s."""
    if isinstance(rate, (int, float)):
        return float(rate)
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(bit)?\s*", rate.lower())
    if not m:
        raise ValueError(f"unsupported rate {rate!r}; use e.g. '100mbit'")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


class TwoHosts:
    """Names and helpers for one namespace pair; made by two_hosts()."""

    def __init__(self, prefix, seq):
        pid = os.getpid()
        self.ns_a = f"{prefix}-{pid}-{seq}-a"
        self.ns_b = f"{prefix}-{pid}-{seq}-b"
        self.subnet_id = (pid + seq) % 250 + 1  # isolated anyway; distinct for readable logs
        self.addr_a = f"10.213.{self.subnet_id}.1"
        self.addr_b = f"10.213.{self.subnet_id}.2"
        tag = f"{seq % 1000}"
        self.if_a = f"{prefix[:8]}a{tag}"
        self.if_b = f"{prefix[:8]}b{tag}"
        self._shaped = set()
        self.rails = []  # extra veth pairs from add_rail(): (if_a, if_b, addr_a, addr_b)

    # Convenience views, indexed 0 (= A) and 1 (= B).
    @property
    def names(self):
        return [self.ns_a, self.ns_b]

    @property
    def addresses(self):
        return [self.addr_a, self.addr_b]

    @property
    def interfaces(self):
        return [self.if_a, self.if_b]

    def addr_of(self, ns):
        return self.addresses[self._index(ns)]

    def ifname_of(self, ns):
        return self.interfaces[self._index(ns)]

    def _index(self, ns):
        if ns in (0, "a", "A", self.ns_a):
            return 0
        if ns in (1, "b", "B", self.ns_b):
            return 1
        raise ValueError(f"unknown host {ns!r}; use 0/1, 'a'/'b' or {self.names}")

    def hostname_of(self, ns):
        """A distinct hostname per namespace, for exec_prefix(ns, own_hostname=True)."""
        return self.names[self._index(ns)]

    def exec_prefix(self, ns, own_hostname=False):
        """["ip", "netns", "exec", NS]. Both namespaces share this machine's hostname (and
        /dev/shm); with own_hostname=True the command also gets its own UTS namespace whose
        hostname is hostname_of(ns), as on two real hosts."""
        prefix = ["ip", "netns", "exec", self.names[self._index(ns)]]
        if own_hostname:
            prefix += ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname_of(ns)]
        return prefix

    def run(self, ns, cmd, timeout=_CMD_TIMEOUT, check=True, own_hostname=False):
        """Runs cmd inside ns; returns the CompletedProcess (text, stdout/stderr captured)."""
        return _run(self.exec_prefix(ns, own_hostname) + list(cmd), timeout=timeout, check=check)

    def popen(self, ns, cmd, own_hostname=False, **kwargs):
        """subprocess.Popen of cmd inside ns (`ip netns exec`, unshare and sh all exec, so
        the pid is cmd's)."""
        return subprocess.Popen(self.exec_prefix(ns, own_hostname) + list(cmd), **kwargs)

    def pids(self):
        """Pids of all processes whose network namespace is one of the pair."""
        out = []
        for ns in self.names:
            p = _run(["ip", "netns", "pids", ns], check=False)
            out += [int(x) for x in p.stdout.split() if x.isdigit()]
        return out

    def kill_all(self, sig=signal.SIGKILL):
        """Signals every process left inside the two namespaces (all were started by us:
        the namespaces are private to this TwoHosts). Returns the pids signalled."""
        pids = [p for p in self.pids() if p != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        return pids

    def _setup(self, hosts_file=True):
        _run(["ip", "netns", "add", self.ns_a])
        _live.add(self.ns_a)
        _run(["ip", "netns", "add", self.ns_b])
        _live.add(self.ns_b)
        if hosts_file:
            # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts: inside the
            # pair, each namespace's hostname resolves to its veth address (as on real hosts)
            # and reverse lookups of the peer succeed without DNS.
            text = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
                f"{addr} {self.hostname_of(i)}\n" for i, addr in enumerate(self.addresses))
            global _made_etc_netns
            if not os.path.isdir(_ETC_NETNS):
                os.makedirs(_ETC_NETNS, exist_ok=True)
                _made_etc_netns = True
            for ns in self.names:
                os.makedirs(os.path.join(_ETC_NETNS, ns), exist_ok=True)
                with open(os.path.join(_ETC_NETNS, ns, "hosts"), "w") as f:
                    f.write(text)
        # Created directly inside the namespaces, so the names never touch the root namespace.
        _run(["ip", "link", "add", "name", self.if_a, "netns", self.ns_a, "type", "veth",
              "peer", "name", self.if_b, "netns", self.ns_b])
        for ns, dev, addr in ((self.ns_a, self.if_a, self.addr_a), (self.ns_b, self.if_b, self.addr_b)):
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        self._wait_link()

    def add_rail(self):
        """Joins the pair by one more veth pair on its own /24 (10.{214+k}.X.0): a second NIC
        per host, i.e. a second rail. Returns (if_a, if_b, addr_a, addr_b)."""
        k = len(self.rails) + 1
        tag = self.if_a[len(self.if_a.rstrip("0123456789")):]
        if_a, if_b = f"r{k}a{tag}", f"r{k}b{tag}"
        addr_a, addr_b = f"10.{213 + k}.{self.subnet_id}.1", f"10.{213 + k}.{self.subnet_id}.2"
        _run(["ip", "link", "add", "name", if_a, "netns", self.ns_a, "type", "veth",
              "peer", "name", if_b, "netns", self.ns_b])
        for ns, dev, addr in ((self.ns_a, if_a, addr_a), (self.ns_b, if_b, addr_b)):
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        self.rails.append((if_a, if_b, addr_a, addr_b))
        self._wait_link(links=((self.ns_a, if_a), (self.ns_b, if_b)))
        return self.rails[-1]

    def byte_counters(self, ns, dev):
        """(rx_bytes, tx_bytes) of `dev` inside namespace `ns`, from the kernel's counters
        (`ip netns exec` mounts that namespace's sysfs)."""
        base = f"/sys/class/net/{dev}/statistics"
        out = _run(self.exec_prefix(ns) + ["cat", f"{base}/rx_bytes", f"{base}/tx_bytes"]).stdout.split()
        return int(out[0]), int(out[1])

    def _wait_link(self, timeout=5.0, links=None):
        deadline = time.monotonic() + timeout
        links = links or ((self.ns_a, self.if_a), (self.ns_b, self.if_b))
        while True:
            states = [
                _run(["ip", "-n", ns, "-o", "link", "show", "dev", dev]).stdout
                for ns, dev in links
            ]
            if all("LOWER_UP" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"veth pair did not come up: {states}")
            time.sleep(0.05)

    def slow_link(self, rate="100mbit", side="a", burst=None, latency="50ms", dev=None):
        """Shapes egress of one end (side 'a' or 'b') with a token bucket: `tc qdisc replace
        dev <veth> root tbf rate R burst B latency L`. Only traffic leaving that namespace
        is slowed, so side='a' makes host A the straggler when it sends. `dev` picks another
        interface of that side (a rail from add_rail) instead of the first pair's."""
        i = self._index(side)
        dev = dev or self.interfaces[i]
        if burst is None:
            # At least one timer tick worth of bytes (HZ may be 100), and not below 32 KiB.
            burst = f"{max(32 * 1024, int(_rate_bits(rate) / 8 / 100))}b"
        _run(self.exec_prefix(i) + ["tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                                    "rate", str(rate), "burst", str(burst), "latency", str(latency)])
        self._shaped.add(i)

    def delay_link(self, delay="5ms", side="a"):
        """Adds fixed latency with netem (needs the sch_netem kernel module)."""
        i = self._index(side)
        _run(self.exec_prefix(i) + ["tc", "qdisc", "replace", "dev", self.interfaces[i], "root", "netem",
                                    "delay", str(delay)])
        self._shaped.add(i)

    def clear_link(self, side=None, dev=None):
        """Removes shaping from one end, or from both when side is None (`dev`: as slow_link)."""
        for i in ([0, 1] if side is None else [self._index(side)]):
            _run(self.exec_prefix(i) + ["tc", "qdisc", "del", "dev", dev or self.interfaces[i], "root"], check=False)
            self._shaped.discard(i)

    def cleanup(self):
        try:
            self.kill_all()
        except NetnsError:
            pass
        for ns in (self.ns_a, self.ns_b):
            _netns_del(ns)

    def __repr__(self):
        return (f"TwoHosts({self.ns_a}:{self.if_a}={self.addr_a} <-> "
                f"{self.ns_b}:{self.if_b}={self.addr_b})")


@contextlib.contextmanager
def two_hosts(prefix=DEFAULT_PREFIX, rate=None, delay=None, side="a", hosts_file=True):
    """Yields a TwoHosts. rate= shapes `side` with tbf (slow_link), delay= adds netem delay
    (mutually exclusive: netem is a root qdisc too). hosts_file= writes /etc/netns/NS/hosts
    mapping hostname_of(ns) to its address. Always deletes both namespaces (and those files)."""
    global _seq
    if not re.fullmatch(r"[A-Za-z0-9_]{1,16}", prefix):
        raise ValueError("prefix: 1-16 characters of [A-Za-z0-9_]")
    if rate is not None and delay is not None:
        raise ValueError("give rate or delay, not both")
    reason = _probe()
    if reason is not None:
        raise NetnsError(reason)
    cleanup_stale(prefix)
    with _lock:
        _seq += 1
        seq = _seq
    hosts = TwoHosts(prefix, seq)
    try:
        hosts._setup(hosts_file)
        if rate is not None:
            hosts.slow_link(rate, side=side)
        if delay is not None:
            hosts.delay_link(delay, side=side)
        yield hosts
    finally:
        hosts.cleanup()


@atexit.register
def _cleanup_at_exit():
    for name in list(_live):
        _netns_del(name)
