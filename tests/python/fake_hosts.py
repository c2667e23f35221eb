"""Fake sysfs/procfs trees for `railcc doctor` (RAILCC_SYSFS_ROOT). FAKE: no real host has
these files; each tree holds exactly the files the doctor reads on a real one, with the
same formats (PCI links into /sys/devices, binary config space with an ACS capability,
GID tables, /proc/net/fib_trie and route, /proc/self/limits, /proc/mounts).

    root = dgx(tmp_path)                       # healthy: 8 GPUs, 8 NICs, 2 sockets
    root = dgx(tmp_path, peermem=False)        # and the other broken variants below
"""

import os
import socket
import struct

_BRIDGE, _GPU, _NIC, _ETH = "0x060400", "0x030200", "0x020700", "0x020000"
_GID_LINK_LOCAL = "fe80:0000:0000:0000:0a00:00ff:fe00:{:04x}"


def _gid_v4(ip):
    b = socket.inet_aton(ip)
    return "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}".format(*b)


def _config(acs_ctrl=None):
    """4 KiB of PCI config space; with acs_ctrl, an ACS extended capability at 0x100 (behind
    an AER capability, so the walk follows a next pointer)."""
    cfg = bytearray(4096)
    if acs_ctrl is not None:
        struct.pack_into("<I", cfg, 0x100, 0x0001 | (1 << 16) | (0x148 << 20))  # AER -> 0x148
        struct.pack_into("<I", cfg, 0x148, 0x000D | (1 << 16))  # ACS, last
        struct.pack_into("<HH", cfg, 0x14C, 0x001F, acs_ctrl)
    return bytes(cfg)


class FakeHost:
    def __init__(self, root):
        self.root = str(root)
        self.ifaces = []  # (name, ip, prefix)
        self.next_ifindex = 1

    def write(self, rel, content, mode="w"):
        path = os.path.join(self.root, rel.lstrip("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, mode) as f:
            f.write(content)
        return path

    def link(self, rel, target_rel):
        path = os.path.join(self.root, rel.lstrip("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        target = os.path.join(self.root, target_rel.lstrip("/"))
        os.symlink(os.path.relpath(target, os.path.dirname(path)), path)

    def pci(self, devpath, vendor, cls, numa=-1, acs_ctrl=None, iommu_group=None):
        """devpath: "pci0000:00/0000:00:01.0/0000:01:00.0": the device is its last part."""
        bdf = devpath.rsplit("/", 1)[-1]
        d = f"/sys/devices/{devpath}"
        self.write(f"{d}/vendor", vendor + "\n")
        self.write(f"{d}/device", "0x0001\n")
        self.write(f"{d}/class", cls + "\n")
        self.write(f"{d}/numa_node", f"{numa}\n")
        self.write(f"{d}/config", _config(acs_ctrl), mode="wb")
        self.link(f"/sys/bus/pci/devices/{bdf}", d)
        if iommu_group is not None:
            self.write(f"/sys/kernel/iommu_groups/{iommu_group}/type", self.iommu_type + "\n")
            self.link(f"{d}/iommu_group", f"/sys/kernel/iommu_groups/{iommu_group}")
        return d

    def netdev(self, name, mtu=1500, up=True, ip=None, prefix=24, device=None, loopback=False):
        b = f"/sys/class/net/{name}"
        self.write(f"{b}/mtu", f"{mtu}\n")
        self.write(f"{b}/ifindex", f"{self.next_ifindex}\n")
        self.next_ifindex += 1
        self.write(f"{b}/flags", hex((0x1 if up else 0) | (0x8 if loopback else 0) | 0x1000) + "\n")
        self.write(f"{b}/operstate", ("up" if up else "down") + "\n")
        if device:
            self.link(f"{b}/device", device)
        if ip:
            self.ifaces.append((name, ip, prefix))

    def ib(self, name, device, link_layer="InfiniBand", state="4: ACTIVE", gids=(), netdev=None):
        """gids: [(index, gid, type)]: type "RoCE v2", "IB/RoCE v1" or "" for InfiniBand."""
        b = f"/sys/class/infiniband/{name}"
        if device:
            self.link(f"{b}/device", device)
        p = f"{b}/ports/1"
        self.write(f"{p}/state", state + "\n")
        self.write(f"{p}/phys_state", ("5: LinkUp" if "ACTIVE" in state else "3: Disabled") + "\n")
        self.write(f"{p}/link_layer", link_layer + "\n")
        self.write(f"{p}/rate", ("400 Gb/sec (4X NDR)" if link_layer == "InfiniBand" else "200 Gb/sec (4X HDR)") + "\n")
        for idx, gid, kind in gids:
            self.write(f"{p}/gids/{idx}", gid + "\n")
            if kind:
                self.write(f"{p}/gid_attrs/types/{idx}", kind + "\n")
            if netdev:
                self.write(f"{p}/gid_attrs/ndevs/{idx}", netdev + "\n")
        # Unused slots read as zeros, as the kernel shows them.
        for idx in range(len(gids), len(gids) + 2):
            self.write(f"{p}/gids/{idx}", "0000:0000:0000:0000:0000:0000:0000:0000\n")

    def finish_network(self):
        trie = ["Main:", "  +-- 0.0.0.0/0 3 0 5", "Local:", "  +-- 0.0.0.0/0 3 0 5"]
        route = ["Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"]
        for name, ip, prefix in self.ifaces:
            trie += [f"     |-- {ip}", "        /32 host LOCAL"]
            if name == "lo":
                continue
            mask = (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF
            (n,) = struct.unpack("!I", socket.inet_aton(ip))
            le = lambda v: "%08X" % struct.unpack("<I", struct.pack("!I", v))[0]  # noqa: E731
            route.append(f"{name}\t{le(n & mask)}\t00000000\t0001\t0\t0\t0\t{le(mask)}\t0\t0\t0")
        self.write("/proc/net/fib_trie", "\n".join(trie) + "\n")
        self.write("/proc/net/route", "\n".join(route) + "\n")


def dgx(root, *, peermem=True, iommu=False, acs=False, shm="512g", memlock="unlimited", roce=False,
        cpus="0-55", gpus=8):
    """A DGX-like node: 2 sockets (NUMA 0: CPUs 0-55, NUMA 1: 56-111), 8 GPUs and 8 NICs,
    each GPU sharing a PCIe switch with one NIC (PIX), 4 switches per socket. NICs are
    InfiniBand, or RoCE (netdevs ens<i>, GID index 0 link-local) with roce=True. Management
    interface eth0 (10.10.0.5), a docker0 bridge that is up (172.17.0.1)."""
    h = FakeHost(root)
    h.iommu_type = "DMA-FQ" if iommu else "identity"
    acs_ctrl = 0x001D if acs else 0x0000
    group = 0
    nics = []
    for i in range(gpus):
        sock = 0 if i < gpus // 2 else 1
        dom = f"pci0000:{'00' if sock == 0 else '80'}"
        bus = (0x00 if sock == 0 else 0x80) + 0x10 * (i % (gpus // 2) + 1)
        rp = f"{dom}/0000:{(0x00 if sock == 0 else 0x80):02x}:{i % 4 + 1:02x}.0"
        h.pci(rp, "0x8086", _BRIDGE, numa=sock, acs_ctrl=acs_ctrl)
        up = f"{rp}/0000:{bus:02x}:00.0"
        h.pci(up, "0x1000", _BRIDGE, numa=sock, acs_ctrl=None)
        dn_g, dn_n = f"{up}/0000:{bus + 1:02x}:00.0", f"{up}/0000:{bus + 1:02x}:01.0"
        h.pci(dn_g, "0x1000", _BRIDGE, numa=sock, acs_ctrl=acs_ctrl)
        h.pci(dn_n, "0x1000", _BRIDGE, numa=sock, acs_ctrl=acs_ctrl)
        h.pci(f"{dn_g}/0000:{bus + 2:02x}:00.0", "0x10de", _GPU, numa=sock, iommu_group=group)
        nic = h.pci(f"{dn_n}/0000:{bus + 3:02x}:00.0", "0x15b3", _NIC if not roce else _ETH, numa=sock,
                    iommu_group=group + 1)
        group += 2
        nics.append(nic)
    for i, nic in enumerate(nics):
        if roce:
            ip = f"10.20.{i}.5"
            h.netdev(f"ens{i}", mtu=4200, ip=ip, device=nic)
            h.ib(f"mlx5_{i}", nic, link_layer="Ethernet", netdev=f"ens{i}", gids=[
                (0, _GID_LINK_LOCAL.format(i), "IB/RoCE v1"), (1, _GID_LINK_LOCAL.format(i), "RoCE v2"),
                (2, _gid_v4(ip), "IB/RoCE v1"), (3, _gid_v4(ip), "RoCE v2")])
        else:
            h.ib(f"mlx5_{i}", nic, gids=[(0, f"fe80:0000:0000:0000:a088:c203:00{i:02x}:1234", "")])
    h.netdev("lo", mtu=65536, ip="127.0.0.1", prefix=8, loopback=True)
    h.netdev("eth0", mtu=1500, ip="10.10.0.5")
    h.netdev("docker0", mtu=1500, ip="172.17.0.1", prefix=16)
    h.finish_network()
    for n, c in ((0, "0-55"), (1, "56-111")):
        h.write(f"/sys/devices/system/node/node{n}/cpulist", c + "\n")
    h.write("/sys/module/nvidia/version", "550.54.15\n")
    if peermem:
        h.write("/sys/module/nvidia_peermem/refcnt", "0\n")
    if iommu:
        os.makedirs(os.path.join(h.root, "sys/class/iommu/dmar0"), exist_ok=True)
        h.write("/proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on\n")
    else:
        h.write("/proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/sda1 iommu=pt\n")
    h.write("/proc/sys/kernel/osrelease", "5.15.0-105-generic\n")
    h.write("/proc/mounts", f"shm /dev/shm tmpfs rw,nosuid,nodev,noexec,relatime,size={shm} 0 0\n")
    h.write("/proc/self/limits", "Limit                     Soft Limit           Hard Limit           Units     \n"
            f"Max locked memory         {memlock:<20} {memlock:<20} bytes     \n")
    h.write("/proc/self/status", f"Name:\tpython\nCpus_allowed_list:\t{cpus}\n")
    return h.root
