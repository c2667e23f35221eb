"""What `railcc doctor` reads of the host: sysfs and procfs under one root path.

Every read goes through System(root). The root is "/" on a real host; tests point it
(RAILCC_SYSFS_ROOT) at a fake tree holding the same files, so each check runs unchanged
against a DGX-like node, a container, or a broken set-up. Nothing here decides a verdict:
it only turns files into facts.
"""

import os
import re
import socket
import struct
from dataclasses import dataclass, field

NVIDIA = "0x10de"
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
PCI_EXT_CAP_ACS = 0x000D
# ACS control bits that send peer-to-peer requests and completions up to the root complex.
ACS_REDIRECT_BITS = {"ReqRedir": 0x04, "CmpltRedir": 0x08}
ACS_UNREADABLE = -1  # acs_control(): only the first 256 bytes of config space are readable


@dataclass
class PciDevice:
    bdf: str
    vendor: str
    device: str
    cls: str  # "0x030200"
    numa: int  # -1: unknown
    chain: list  # PCI bridges from the root port down to the device's parent, as BDFs
    root: str  # "pci0000:00": the host bridge
    iommu_group: str = ""

    @property
    def is_gpu(self):
        return self.vendor == NVIDIA and self.cls.startswith("0x03")


@dataclass
class Gid:
    index: int
    gid: str  # "fe80:0000:...": as sysfs prints it
    kind: str  # "RoCE v2", "IB/RoCE v1", or "" for InfiniBand
    netdev: str

    @property
    def ipv4(self):
        """The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), or None."""
        h = self.gid.replace(":", "")
        if len(h) == 32 and h[:20] == "0" * 20 and h[20:24] == "ffff":
            return socket.inet_ntoa(bytes.fromhex(h[24:]))
        return None

    @property
    def link_local(self):
        return self.gid.lower().startswith("fe80:")


@dataclass
class Port:
    num: int
    state: str  # "ACTIVE", "DOWN", ...
    phys_state: str  # "LinkUp", ...
    link_layer: str  # "InfiniBand" or "Ethernet"
    rate: str
    gids: list = field(default_factory=list)


@dataclass
class RdmaDevice:
    name: str
    pci: str  # BDF, or "" for a software device (rxe, siw)
    netdevs: list
    ports: list


@dataclass
class Iface:
    name: str
    ifindex: int
    up: bool
    loopback: bool
    mtu: int
    ipv4: list  # addresses, in the order the kernel lists them


def _int(s, default=-1):
    try:
        return int(str(s).strip(), 0)
    except (TypeError, ValueError):
        return default


def _hex_ip(h):
    return socket.inet_ntoa(struct.pack("<I", int(h, 16)))


class System:
    def __init__(self, root=None):
        self.root = root or os.environ.get("RAILCC_SYSFS_ROOT") or "/"
        self.fake = os.path.realpath(self.root) != "/"

    # -- raw access ------------------------------------------------------------------------
    def path(self, rel):
        return os.path.join(self.root, rel.lstrip("/"))

    def read(self, rel, default=None):
        try:
            with open(self.path(rel), errors="replace") as f:
                return f.read().strip()
        except OSError:  # missing, or a sysfs attribute the kernel refuses (unused GID slot)
            return default

    def read_bytes(self, rel):
        try:
            with open(self.path(rel), "rb") as f:
                return f.read()
        except OSError:
            return b""

    def listdir(self, rel):
        try:
            return sorted(os.listdir(self.path(rel)))
        except OSError:
            return []

    def exists(self, rel):
        return os.path.exists(self.path(rel))

    def target(self, rel):
        """Where a sysfs link points, relative to the root ("/sys/devices/...")."""
        full = os.path.realpath(self.path(rel))
        base = os.path.realpath(self.root)
        return "/" + os.path.relpath(full, base) if full.startswith(base) else full

    # -- kernel ----------------------------------------------------------------------------
    def osrelease(self):
        return self.read("/proc/sys/kernel/osrelease", "")

    def cmdline(self):
        return self.read("/proc/cmdline", "")

    def module_loaded(self, name):
        return self.exists(f"/sys/module/{name}")

    def nvidia_driver(self):
        v = self.read("/sys/module/nvidia/version")
        if v:
            return v
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9.]+)", self.read("/proc/driver/nvidia/version", ""))
        return m.group(1) if m else ""

    # -- PCI -------------------------------------------------------------------------------
    def pci_device(self, bdf):
        rel = f"/sys/bus/pci/devices/{bdf}"
        if not self.exists(rel):
            return None
        parts = self.target(rel).split("/")
        chain = [p for p in parts[:-1] if _BDF.match(p)]
        root = next((p for p in parts if p.startswith("pci")), "")
        grp = self.target(rel + "/iommu_group") if self.exists(rel + "/iommu_group") else ""
        return PciDevice(
            bdf=bdf,
            vendor=self.read(rel + "/vendor", ""),
            device=self.read(rel + "/device", ""),
            cls=self.read(rel + "/class", ""),
            numa=_int(self.read(rel + "/numa_node"), -1),
            chain=chain,
            root=root,
            iommu_group=os.path.basename(grp),
        )

    def pci_devices(self):
        return [d for d in (self.pci_device(b) for b in self.listdir("/sys/bus/pci/devices")) if d]

    def gpus(self):
        return [d for d in self.pci_devices() if d.is_gpu]

    def acs_control(self, bdf):
        """The ACS control register of a PCI function, None when it has no ACS capability, or
        ACS_UNREADABLE when its extended config space cannot be read (that needs root)."""
        cfg = self.read_bytes(f"/sys/bus/pci/devices/{bdf}/config")
        if len(cfg) <= 0x100:
            return ACS_UNREADABLE
        off, seen = 0x100, set()
        while 0x100 <= off <= len(cfg) - 8 and off not in seen:
            seen.add(off)
            (hdr,) = struct.unpack_from("<I", cfg, off)
            if hdr in (0, 0xFFFFFFFF):
                return None
            if hdr & 0xFFFF == PCI_EXT_CAP_ACS:
                (ctrl,) = struct.unpack_from("<H", cfg, off + 6)
                return ctrl
            off = (hdr >> 20) & 0xFFC
        return None

    def iommu_units(self):
        return self.listdir("/sys/class/iommu")

    def iommu_group_type(self, group):
        return self.read(f"/sys/kernel/iommu_groups/{group}/type", "") if group else ""

    # -- RDMA ------------------------------------------------------------------------------
    def rdma_devices(self):
        out = []
        for name in self.listdir("/sys/class/infiniband"):
            base = f"/sys/class/infiniband/{name}"
            pci = ""
            if self.exists(base + "/device"):
                t = os.path.basename(self.target(base + "/device"))
                pci = t if _BDF.match(t) else ""
            ports, netdevs = [], []
            for p in self.listdir(base + "/ports"):
                pb = f"{base}/ports/{p}"
                gids = []
                for g in sorted(self.listdir(pb + "/gids"), key=lambda s: _int(s, 0)):
                    gid = self.read(f"{pb}/gids/{g}", "")
                    if not gid or gid.replace(":", "").strip("0") == "":
                        continue  # an empty slot
                    kind = self.read(f"{pb}/gid_attrs/types/{g}", "")
                    ndev = self.read(f"{pb}/gid_attrs/ndevs/{g}", "")
                    gids.append(Gid(_int(g, 0), gid, kind, ndev))
                    if ndev and ndev not in netdevs:
                        netdevs.append(ndev)
                state = self.read(pb + "/state", "")
                phys = self.read(pb + "/phys_state", "")
                ports.append(Port(
                    num=_int(p, 0),
                    state=state.split(":")[-1].strip() if state else "",
                    phys_state=phys.split(":")[-1].strip() if phys else "",
                    link_layer=self.read(pb + "/link_layer", ""),
                    rate=self.read(pb + "/rate", ""),
                    gids=gids,
                ))
            parent = self.read(base + "/parent", "")  # software devices name their netdev
            if parent and parent not in netdevs:
                netdevs.append(parent)
            out.append(RdmaDevice(name, pci, netdevs, ports))
        return out

    # -- network ---------------------------------------------------------------------------
    def ipv4_by_iface(self):
        """Local IPv4 addresses per interface, from /proc/net/fib_trie (which addresses are
        local) and /proc/net/route (which interface's subnet holds each)."""
        local = []
        lines = (self.read("/proc/net/fib_trie", "") or "").splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^\s*\|-- (\d+\.\d+\.\d+\.\d+)\s*$", line)
            if m and i + 1 < len(lines) and re.match(r"^\s*/32 host LOCAL", lines[i + 1]) and m.group(1) not in local:
                local.append(m.group(1))
        routes = []
        for line in (self.read("/proc/net/route", "") or "").splitlines()[1:]:
            f = line.split()
            if len(f) >= 8 and not (_int("0x" + f[3], 0) & 0x2):  # RTF_GATEWAY: not a subnet
                routes.append((f[0], _int("0x" + f[1], 0), _int("0x" + f[7], 0)))
        out = {}
        for ip in local:
            (n,) = struct.unpack("<I", socket.inet_aton(ip))
            if ip.startswith("127."):
                out.setdefault("lo", []).append(ip)
                continue
            best = None
            for ifname, dest, mask in routes:
                if mask and (n & mask) == dest and (best is None or bin(mask).count("1") > best[1]):
                    best = (ifname, bin(mask).count("1"))
            if best:
                out.setdefault(best[0], []).append(ip)
        return out

    def interfaces(self):
        """Interfaces in ifindex order (the order getifaddrs lists them in)."""
        addrs = self.ipv4_by_iface()
        out = []
        for name in self.listdir("/sys/class/net"):
            base = f"/sys/class/net/{name}"
            flags = _int(self.read(base + "/flags"), 0)
            out.append(Iface(
                name=name,
                ifindex=_int(self.read(base + "/ifindex"), 0),
                up=bool(flags & 0x1),  # IFF_UP
                loopback=bool(flags & 0x8),  # IFF_LOOPBACK
                mtu=_int(self.read(base + "/mtu"), 0),
                ipv4=addrs.get(name, []),
            ))
        return sorted(out, key=lambda i: (i.ifindex, i.name))

    # -- process ---------------------------------------------------------------------------
    def memlock_limit(self):
        """Soft RLIMIT_MEMLOCK in bytes, None for unlimited, -1 when unknown."""
        for line in (self.read("/proc/self/limits", "") or "").splitlines():
            if line.startswith("Max locked memory"):
                soft = line[len("Max locked memory"):].split()[0]
                return None if soft == "unlimited" else _int(soft, -1)
        return -1

    def shm_size(self):
        """Bytes of the tmpfs on /dev/shm: from its size= mount option, else statvfs on a
        real root. -1 when /dev/shm is not mounted."""
        for line in (self.read("/proc/mounts", "") or "").splitlines():
            f = line.split()
            if len(f) >= 4 and f[1] == "/dev/shm":
                m = re.search(r"(?:^|,)size=(\d+)([kmgKMG%]?)", f[3])
                if m and m.group(2) != "%":
                    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
                if not self.fake:
                    st = os.statvfs("/dev/shm")
                    return st.f_blocks * st.f_frsize
                return -1
        return -1

    def cpus_allowed(self):
        for line in (self.read("/proc/self/status", "") or "").splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpulist(line.split(":", 1)[1])
        return set()

    def numa_nodes(self):
        nodes = {}
        for n in self.listdir("/sys/devices/system/node"):
            if re.match(r"^node\d+$", n):
                nodes[int(n[4:])] = parse_cpulist(self.read(f"/sys/devices/system/node/{n}/cpulist", ""))
        return nodes


def parse_cpulist(text):
    cpus = set()
    for part in (text or "").strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(part))
    return cpus


def format_cpus(cpus):
    """{0,1,2,5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
