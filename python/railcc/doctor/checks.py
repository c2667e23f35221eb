"""The checks of `railcc doctor`. Each takes a Context and returns Result rows: a verdict,
what it found, and the exact fix. Each also records facts (ctx.facts) that --all-ranks
compares across hosts."""

import difflib
import re
from dataclasses import dataclass

from . import topology as topo
from .inputs import MAX_LOCAL_RANKS, MAX_WORLD, env_count
from .system import ACS_REDIRECT_BITS, ACS_UNREADABLE, format_cpus

OK, WARN, FAIL, NA = "ok", "warn", "fail", "n/a"

# Kernel side of dma-buf registration for RDMA appeared in Linux 5.12.
DMABUF_KERNEL = (5, 12)
# Interface names that are container or VM bridges, never the fabric.
BRIDGE_PREFIXES = ("docker", "virbr", "br-", "cni", "flannel", "lxcbr", "vnet")
# NCCL variables that railcc's engine does not act on (the doctor reads some of them).
NCCL_KNOWN_IGNORED = {
    "NCCL_NET_GDR_READ", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_PROTO",
    "NCCL_TOPO_FILE", "NCCL_TOPO_DUMP_FILE", "NCCL_IB_SPLIT_DATA_ON_QPS",
    "NCCL_NET_PLUGIN", "NCCL_COLLNET_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE",
    "NCCL_LAUNCH_MODE", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT", "NCCL_DMABUF_ENABLE",
    "NCCL_IGNORE_CPU_AFFINITY", "NCCL_SOCKET_FAMILY", "NCCL_COMM_ID", "NCCL_CHECKS_DISABLE",
    "NCCL_GRAPH_FILE", "NCCL_NTHREADS", "NCCL_WORK_FIFO_DEPTH", "NCCL_PXN_DISABLE",
}
# Variables railcc reads outside the engine's parameter table.
RAILCC_OTHER = {
    "RAILCC_SYSFS_ROOT": "root of the sysfs/procfs tree `railcc doctor` reads (tests point it at a fake host)",
}


@dataclass
class Result:
    check: str
    verdict: str
    found: str
    fix: str = ""


def _mib(n):
    if n is None:
        return "unlimited"
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return f"{n >> 30} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.0f} MiB"
    return f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


class Context:
    """What every check shares: the system, the environment, the job's shape, and probes
    computed once."""

    def __init__(self, system, env, local_ranks=None, world=None, local_rank=None, params=None, cuda=None):
        self.sys = system
        self.env = dict(env)
        self.gpus = system.gpus()
        self.rdma = system.rdma_devices()
        self.ifaces = system.interfaces()
        self.pci = {d.bdf: d for d in system.pci_devices()}
        self.local_ranks, self.local_ranks_from = self._shape(local_ranks, "LOCAL_WORLD_SIZE", "--local-ranks")
        if world or env_count(self.env, "WORLD_SIZE", 1, MAX_WORLD) is not None:
            self.world, self.world_from = self._shape(world, "WORLD_SIZE", "--world")
        else:
            self.world, self.world_from = 2 * self.local_ranks, "assumed 2 hosts; set --world"
        if local_rank is None:  # a careless variable raises inputs.UsageError, naming it
            local_rank = env_count(self.env, "LOCAL_RANK", 0, MAX_LOCAL_RANKS - 1, default=0)
        self.local_rank = local_rank
        self.params = params if params is not None else []
        self.cuda = cuda
        self.facts = {}
        self.verbs = {}
        if not system.fake and self.rdma:
            from .verbs import probe

            self.verbs = probe({d.name: [p.num for p in d.ports] for d in self.rdma})

    def _shape(self, given, var, flag):
        if given:
            return int(given), flag
        value = env_count(self.env, var, 1, MAX_LOCAL_RANKS if var == "LOCAL_WORLD_SIZE" else MAX_WORLD)
        if value is not None:
            return value, var
        if self.gpus:
            return len(self.gpus), "one rank per GPU"
        return 2, "default, no GPU (set --local-ranks)"

    def param(self, name, default):
        for p in self.params:
            if p["env"] == name:
                return p["value"]
        return default

    def nics(self):
        """RDMA devices that sit on the PCI bus (software devices such as rxe have no path)."""
        return [(d, self.pci[d.pci]) for d in self.rdma if d.pci in self.pci]

    def my_gpu(self):
        return self.gpus[self.local_rank % len(self.gpus)] if self.gpus else None

    def nearest_nic(self, gpu):
        best = None
        for dev, pci in self.nics():
            p = topo.path_type(gpu, pci)
            if best is None or topo.PATHS.index(p) < topo.PATHS.index(best[2]):
                best = (dev, pci, p)
        return best


def check_gpus(ctx):
    drv = ctx.sys.nvidia_driver()
    ctx.facts["gpus"] = str(len(ctx.gpus))
    ctx.facts["nvidia driver"] = drv or "(none)"
    if not ctx.gpus:
        return [Result("gpu", NA, "no NVIDIA GPU on the PCI bus" + (f"; driver {drv} loaded" if drv else ""))]
    where = ", ".join(f"{g.bdf} (NUMA {g.numa})" for g in ctx.gpus)
    if not drv:
        return [Result("gpu", FAIL, f"{len(ctx.gpus)} GPU(s): {where}; the nvidia kernel module is not loaded",
                       "modprobe nvidia (install the NVIDIA driver if that fails)")]
    return [Result("gpu", OK, f"{len(ctx.gpus)} GPU(s): {where}; driver {drv}")]


def check_cuda_plugin(ctx):
    if ctx.sys.fake:
        return [Result("cuda plugin", NA, f"not probed: the host is the tree at {ctx.sys.root}, the plugin is this process's")]
    info = ctx.cuda
    if info is None:
        return [Result("cuda plugin", FAIL if ctx.gpus else NA, "railcc's extension did not load, so neither did its CUDA plugin",
                       "reinstall railcc: bash scripts/install.sh")]
    ctx.facts["cuda runtime"] = str(info.get("runtime") or "(none)")
    rt = str(info.get("runtime") or "").replace("cuda runtime ", "")
    if info.get("plugin") and info.get("devices"):
        return [Result("cuda plugin", OK, f"loaded: CUDA runtime {rt}, {info.get('devices')} device(s)")]
    if info.get("plugin"):
        why = info.get("error") or "the runtime sees no device"
        if not ctx.gpus:
            return [Result("cuda plugin", NA, f"loaded (CUDA runtime {rt}); no GPU: {why}")]
        fix = ("install an NVIDIA driver that supports CUDA runtime " + rt if "insufficient" in why else
               "check CUDA_VISIBLE_DEVICES and that /dev/nvidia* exist in the container")
        return [Result("cuda plugin", FAIL, f"loaded (CUDA runtime {rt}) but it sees no GPU: {why}", fix)]
    why = info.get("error") or "not loaded"
    if not ctx.gpus:
        return [Result("cuda plugin", NA, f"no GPU; plugin not loaded: {why}")]
    return [Result("cuda plugin", FAIL, f"{len(ctx.gpus)} GPU(s) but the plugin did not load: {why}",
                   "install a CUDA build of torch and rebuild railcc (bash scripts/install.sh), or fix the error above")]


def _kernel_version(ctx):
    m = re.match(r"(\d+)\.(\d+)", ctx.sys.osrelease())
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_dmabuf(ctx):
    out = []
    for d in ctx.rdma:
        v = ctx.verbs.get(d.name)
        kern = _kernel_version(ctx)
        if v is None or v.get("dmabuf") is None:
            why = ("not probed: fake host tree" if ctx.sys.fake else
                   (v or {}).get("dmabuf_why") or "libibverbs could not open the device")
            out.append(Result(f"dma-buf {d.name}", NA, why))
            continue
        found = v["dmabuf_why"]
        if kern and kern < DMABUF_KERNEL:
            found += f"; kernel {ctx.sys.osrelease()} is older than 5.12 (no dma-buf for RDMA)"
        ok = v["dmabuf"] and not (kern and kern < DMABUF_KERNEL)
        ctx.facts[f"dma-buf {d.name}"] = "yes" if ok else "no"
        if not ctx.gpus:
            out.append(Result(f"dma-buf {d.name}", NA, f"no GPU; the device {'takes' if ok else 'does not take'} dma-buf ({found})"))
        else:
            out.append(Result(f"dma-buf {d.name}", OK if ok else WARN, found,
                              "" if ok else "GPUDirect RDMA then needs nvidia_peermem (see its check)"))
    if len(out) > 1 and all(r.verdict == NA for r in out) and len({r.found for r in out}) == 1:
        return [Result("dma-buf", NA, f"{out[0].found} ({len(out)} devices)")]
    return out or [Result("dma-buf", NA, "no RDMA device")]


def _dmabuf_ok(ctx, name):
    """The NIC takes dma-buf registrations (probed) and the kernel has dma-buf for RDMA."""
    kern = _kernel_version(ctx)
    return bool(ctx.verbs.get(name, {}).get("dmabuf")) and not (kern and kern < DMABUF_KERNEL)


def _dmabuf_everywhere(ctx):
    vals = [ctx.verbs.get(d.name, {}).get("dmabuf") for d, _ in ctx.nics()]
    return bool(vals) and all(vals)


def _peermem_loaded(ctx):
    return ctx.sys.module_loaded("nvidia_peermem") or ctx.sys.module_loaded("nv_peer_mem")


def check_peermem(ctx):
    loaded = _peermem_loaded(ctx)
    ctx.facts["nvidia_peermem"] = "loaded" if loaded else "not loaded"
    if not ctx.gpus or not ctx.nics():
        return [Result("nvidia_peermem", NA, ("loaded" if loaded else "not loaded") + "; GPUDirect RDMA needs a GPU and an RDMA NIC")]
    if loaded:
        return [Result("nvidia_peermem", OK, "loaded (/sys/module/nvidia_peermem): NICs can read and write GPU memory")]
    if _dmabuf_everywhere(ctx):
        return [Result("nvidia_peermem", OK, "not loaded, not needed: every NIC takes dma-buf registration")]
    return [Result("nvidia_peermem", FAIL,
                   "not loaded and dma-buf is not available on every NIC: GPUDirect RDMA is off, "
                   "inter-host traffic of GPU tensors goes through host memory",
                   "modprobe nvidia_peermem; to keep it: echo nvidia_peermem > /etc/modules-load.d/nvidia-peermem.conf")]


def check_topology(ctx):
    """Where railcc's engine gets the machine's topology (rails, GPU-NIC paths): hwloc when it
    loads, else sysfs. The doctor's own PCI checks always read sysfs (under its root), and ask
    railcc's rules (railcc._C.rules) what the engine would decide."""
    ctx.facts["host rules"] = topo.rules_source()
    if ctx.sys.fake:
        return [Result("topology", NA, f"the doctor reads the PCI tree of {ctx.sys.root}; railcc's engine reads this "
                                        "process's machine")]
    try:
        from .. import _C

        t = _C.topology(ctx.env.get("RAILCC_TOPO_FILE", ""), [], [])
    except Exception as e:  # noqa: BLE001 - the engine would go without a topology too
        return [Result("topology", WARN, f"unknown ({e}): railcc picks interfaces and rails without it",
                       "install hwloc 2.x (libhwloc15) or make /sys readable")]
    found = f"from {t['source']}: {len(t['gpus'])} GPU(s), {len(t['nics'])} NIC(s), {t['numa_nodes']} NUMA node(s)"
    if t.get("method") == "sysfs":
        return [Result("topology", OK, found + "; the same facts hwloc gives, without XML dumps (RAILCC_TOPO_DUMP_FILE)",
                       "optional: install hwloc 2.x (libhwloc15) or set RAILCC_HWLOC_LIB, for hwloc's view and dumps")]
    return [Result("topology", OK, found)]


def check_gdr(ctx):
    if not ctx.gpus or not ctx.nics():
        return [Result("gdr path", NA, "needs a GPU and an RDMA NIC on the PCI bus")]
    try:
        level, src = topo.gdr_level(ctx.env)
    except ValueError as e:
        return [Result("gdr path", FAIL, str(e), "use LOC, PIX, PXB, PHB or SYS")]
    peermem = _peermem_loaded(ctx)
    out = []
    for i, g in enumerate(ctx.gpus):
        dev, pci, path = ctx.nearest_nic(g)
        others = sorted({topo.path_type(g, p) for d, p in ctx.nics() if d is not dev})
        found = f"GPU {i} ({g.bdf}) -> {dev.name} ({pci.bdf}): {path}; GDR level {level} ({src})"
        if others:
            found += f"; other NICs at {'/'.join(others)}"
        # The verbs transport's own decision (decideGdr), from this host's facts.
        d = topo.decide_gdr(f"GPU {i}", dev.name, path, level, _dmabuf_ok(ctx, dev.name), peermem)
        if not d["within_level"]:
            out.append(Result(f"gdr gpu{i}", WARN, found + ": beyond the level, its traffic is staged through host memory",
                              f"put a NIC under the same PCIe switch as GPU {i}, or raise NCCL_NET_GDR_LEVEL to {path} if the "
                              "platform handles P2P through that path well"))
        elif d["mode"] == "staged":
            out.append(Result(f"gdr gpu{i}", FAIL, found + ": in reach, but neither nvidia_peermem nor dma-buf is there",
                              "modprobe nvidia_peermem"))
        else:
            how = "dma-buf" if d["mode"] == "dmabuf" else "nvidia_peermem"
            out.append(Result(f"gdr gpu{i}", OK, found + f": GPUDirect RDMA ({how})"))
    return out


def check_iommu(ctx):
    units = ctx.sys.iommu_units()
    cmd = ctx.sys.cmdline()
    flags = " ".join(w for w in cmd.split() if "iommu" in w) or "no iommu option"
    devices = list(ctx.gpus) + [p for _, p in ctx.nics()]
    if not units:
        ctx.facts["iommu"] = "off"
        return [Result("iommu", OK if devices else NA, f"no IOMMU unit active (/sys/class/iommu is empty; cmdline: {flags})")]
    types = [(d.bdf, ctx.sys.iommu_group_type(d.iommu_group)) for d in devices]
    translated = [(b, t) for b, t in types if t.startswith("DMA")]
    ctx.facts["iommu"] = "translated" if translated else "passthrough"
    if not devices:
        return [Result("iommu", NA, f"{len(units)} IOMMU unit(s); no GPU or RDMA NIC (cmdline: {flags})")]
    if translated:
        which = ", ".join(f"{b} ({t})" for b, t in translated)
        return [Result("iommu", WARN,
                       f"the IOMMU translates DMA for {which} (cmdline: {flags}): GPUDirect RDMA and P2P may fail or slow down",
                       "add iommu=pt (Intel: intel_iommu=on iommu=pt) to GRUB_CMDLINE_LINUX, update-grub, reboot")]
    return [Result("iommu", OK, f"{len(units)} IOMMU unit(s) in passthrough for GPUs and NICs (cmdline: {flags})")]


def check_acs(ctx):
    if not ctx.gpus:
        return [Result("pcie acs", NA, "no GPU: no peer-to-peer path to check")]
    peers = list(ctx.gpus) + [p for _, p in ctx.nics()]
    bridges = set()
    for i, a in enumerate(peers):
        for b in peers[i + 1:]:
            bridges.update(topo.bridges_between(a, b))
    bad, unread = [], 0
    for br in sorted(bridges):
        ctrl = ctx.sys.acs_control(br)
        if ctrl == ACS_UNREADABLE:
            unread += 1
            continue
        on = [n for n, bit in ACS_REDIRECT_BITS.items() if ctrl and ctrl & bit]
        if on:
            bad.append((br, on))
    ctx.facts["acs redirect bridges"] = str(len(bad))
    if bad:
        which = ", ".join(f"{b} ({'+'.join(on)})" for b, on in bad)
        fix = "; ".join(f"setpci -s {b} ECAP_ACS+0x6.w=0000" for b, _ in bad) + " (or disable ACS in the BIOS)"
        return [Result("pcie acs", WARN, f"ACS redirects peer-to-peer traffic up to the root complex on {which}", fix)]
    note = f"; {unread} bridge(s) unreadable (extended config space needs root)" if unread else ""
    return [Result("pcie acs", OK, f"{len(bridges)} bridge(s) between GPUs and NICs, none redirects P2P{note}")]


def check_rdma(ctx):
    if not ctx.rdma:
        ctx.facts["rdma ports active"] = "0"
        return [Result("rdma", NA, "no RDMA device (/sys/class/infiniband is empty): inter-host traffic uses TCP")]
    out, active = [], 0
    ndev_mtu = {i.name: i.mtu for i in ctx.ifaces}
    for d in ctx.rdma:
        v = ctx.verbs.get(d.name, {})
        for p in d.ports:
            name = f"rdma {d.name}/{p.num}"
            mtu = v.get("mtu", {}).get(p.num)
            if mtu:
                mtu_s = f"MTU {mtu}"
            elif p.link_layer == "Ethernet" and d.netdevs and d.netdevs[0] in ndev_mtu:
                mtu = topo.roce_mtu(ndev_mtu[d.netdevs[0]])
                mtu_s = f"MTU {mtu} (from {d.netdevs[0]}'s {ndev_mtu[d.netdevs[0]]})"
            else:
                mtu_s = "MTU unknown"
            ctx.facts[f"{name} mtu"] = str(mtu or "?")
            desc = f"{p.state or '?'}, {p.phys_state or '?'}, {p.link_layer or '?'}, {p.rate or '?'}, {mtu_s}"
            if d.netdevs:
                desc += f", netdev {','.join(d.netdevs)}"
            if p.state != "ACTIVE":
                out.append(Result(name, WARN, desc + ": not active, railcc will not use it",
                                  f"check the cable and switch port; for RoCE: ip link set {d.netdevs[0]} up" if d.netdevs else
                                  "check the cable, the switch port and the subnet manager (opensm)"))
                continue
            active += 1
            g = _gid_row(ctx, d, p)
            out.append(Result(name, g.verdict, f"{desc}; GID {g.found}", g.fix))
    ctx.facts["rdma ports active"] = str(active)
    if active == 0:
        out.append(Result("rdma", FAIL, "no active RDMA port: inter-host traffic falls back to TCP",
                          "bring a port up (ibstat / rdma link show)"))
    return out


def _gid_row(ctx, d, p):
    name = f"gid {d.name}/{p.num}"
    g, why = topo.pick_gid(p, ctx.env, where=f"{d.name} port {p.num}")
    why = why.replace("\n  ", "; ").replace("\n", "; ")  # the rule lists the table a line per entry
    skipped = [x.index for x in p.gids if x.link_local and (g is None or x.index < g.index)]
    ctx.facts[f"{name} index"] = str(g.index) if g else "none"
    if g is None:
        return Result(name, FAIL, why, f"give {d.netdevs[0] if d.netdevs else 'the netdev'} an IPv4 address "
                       "(ip addr add ADDR/PREFIX dev NETDEV), or unset NCCL_IB_GID_INDEX")
    why = why[len(f"GID index {g.index} "):] if why.startswith(f"GID index {g.index} ") else why
    found = f"index {g.index} ({g.kind or 'IB'}, {g.gid}" + (f" = {g.ipv4}" if g.ipv4 else "") + f"): {why}"
    forced = "forced" in why
    if skipped and not forced:
        found += f"; link-local index {','.join(map(str, skipped))} skipped"
    if forced and p.link_layer == "Ethernet" and "may not route" in why:
        best, _ = topo.pick_gid(p, ctx.env, forced=False)
        what = "link-local (fe80::, not routable between subnets)" if g.link_local else "not the RoCE version railcc wants"
        return Result(name, WARN, found + f"; that entry is {what}",
                      f"unset the variable, or set it to {best.index}" if best else "unset the variable")
    return Result(name, OK, found)


def check_memlock(ctx):
    lim = ctx.sys.memlock_limit()
    ctx.facts["memlock"] = _mib(lim) if lim != -1 else "unknown"
    # What the verbs transport registers (csrc/transport/verbs): per peer on another host, per
    # lane (collectives, send/recv) and per channel (active ports x queue pairs per connection),
    # a receive ring and a send staging area of RAILCC_BUFFSIZE (at most 512 MiB) each: the
    # transport's own figures (verbs::ringBytes, connectionPinnedBytes) through topo.rules().
    rules = topo.rules()
    buff = int(ctx.param("RAILCC_BUFFSIZE", 4 << 20))
    ring = rules.verbs_ring_bytes(buff)
    qps = int(ctx.param("RAILCC_IB_QPS_PER_CONNECTION", 1))
    ports = sum(1 for d in ctx.rdma for p in d.ports if p.state == "ACTIVE") or 1
    staging = int(ctx.param("RAILCC_CUDA_STAGING_BYTES", 32 << 20)) if ctx.gpus else 0
    remote = max(ctx.world - ctx.local_ranks, 0)
    # A rank pins rings only for the peers its ops meet, as each pair first meets (or, with
    # RAILCC_RUNTIME_CONNECT=0, its collectives' peers at init): its collectives' at most
    # log2(world) + 3 (as the engine's own fd estimate); send/recv and all_to_all to every peer
    # would pin the rest as they meet them.
    peers = min(remote, max(ctx.world - 1, 1).bit_length() + 3)
    rndv = int(ctx.param("RAILCC_IB_RNDV_BYTES", 65536)) > 0
    need = peers * 2 * ports * qps * rules.verbs_connection_bytes(buff, rndv) + staging
    met = f"{peers} of {remote} remote peer(s), those a rank's collectives meet"
    how = (f"{_mib(need)} for {met} ({ctx.world_from}) x 2 lanes x {ports * qps} channel(s) "
           f"({ports} active port(s) x RAILCC_IB_QPS_PER_CONNECTION {qps}) x 2 rings of RAILCC_BUFFSIZE {_mib(ring)}"
           + (" and a 1 MiB rendezvous bounce buffer" if rndv else "")
           + (f" + CUDA staging {_mib(staging)}" if staging else ""))
    # Rendezvous (RAILCC_IB_RNDV_BYTES) registers the tensors of large messages too, kept up to
    # RAILCC_IB_MR_CACHE_BYTES per port; one refused is copied through the rings instead.
    cache = int(ctx.param("RAILCC_IB_MR_CACHE_BYTES", 1 << 30)) * ports if rndv else 0
    if cache:
        how += (f"; plus up to {_mib(cache)} of tensors kept registered for rendezvous (RAILCC_IB_MR_CACHE_BYTES x "
                f"{ports} port(s); past the limit large messages are copied through the rings)")
    if lim == -1:
        return [Result("memlock", WARN, "RLIMIT_MEMLOCK unknown (/proc/self/limits unreadable)")]
    if not ctx.rdma:
        return [Result("memlock", NA, f"limit {_mib(lim)}; no RDMA device registers memory here")]
    fix = ("ulimit -l unlimited before the job; containers: docker run --ulimit memlock=-1:-1; "
           "systemd/slurm: LimitMEMLOCK=infinity / PropagateResourceLimits")
    if lim is None:
        return [Result("memlock", OK, f"unlimited; railcc registers about {how}")]
    if lim < need:
        return [Result("memlock", FAIL, f"limit {_mib(lim)} < {how}: memory registration will fail", fix)]
    if cache and lim < need + cache:
        return [Result("memlock", WARN, f"limit {_mib(lim)} covers the rings but not all of {how}", fix)]
    return [Result("memlock", WARN, f"limit {_mib(lim)} covers {how}, but user buffers registered later may not fit", fix)]


def check_network(ctx):
    spec, var = "", ""
    for v in ("RAILCC_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if ctx.env.get(v):
            spec, var = ctx.env[v], v
            break
    chosen, matched, why = topo.resolve_interfaces(ctx.ifaces, spec)
    listing = ", ".join(f"{i.name}{'' if i.up else ' (down)'}" for i in ctx.ifaces)
    if chosen is None:
        down = [i.name for i in ctx.ifaces if topo.match_spec(i.name, spec) and not (i.up and i.ipv4)]
        extra = f"; {', '.join(down)} matches but is down or has no IPv4 address" if down else ""
        ctx.facts["socket interface"] = "(none)"
        return [Result("network", FAIL, f"{var}={spec!r} matches no up IPv4 interface{extra}; interfaces: {listing}",
                       f"set {var or 'RAILCC_SOCKET_IFNAME'} to one of the fabric interfaces")]
    ctx.facts["socket interface mtu"] = str(chosen.mtu)
    ctx.facts["socket interfaces matched"] = str(len(matched))
    found = f"{chosen.name} ({chosen.ipv4[0]}, MTU {chosen.mtu}): {why}" + (f" ({var})" if var else "")
    out = []
    others = [i for i in ctx.ifaces if i.up and i.ipv4 and not i.loopback and i is not chosen]
    if chosen.loopback and others:
        out.append(Result("network", WARN, found + f"; loopback cannot reach other hosts, and {others[0].name} is up",
                          f"{var or 'RAILCC_SOCKET_IFNAME'}={others[0].name}"))
    elif chosen.name.startswith(BRIDGE_PREFIXES):
        good = [i.name for i in others if not i.name.startswith(BRIDGE_PREFIXES)]
        out.append(Result("network", WARN, found + f"; {chosen.name} is a container/VM bridge, not the fabric",
                          f"{var or 'RAILCC_SOCKET_IFNAME'}={good[0] if good else '<fabric interface>'}"))
    else:
        out.append(Result("network", OK, found))
    mtus = {i.name: i.mtu for i in matched if not i.loopback}
    rdma_mtus = {n: next((i.mtu for i in ctx.ifaces if i.name == n), 0) for d in ctx.rdma for n in d.netdevs}
    mtus.update({n: m for n, m in rdma_mtus.items() if m})
    if len(set(mtus.values())) > 1:
        top = max(mtus.values())
        out.append(Result("rail mtu", WARN, "MTUs differ between rails: " + ", ".join(f"{n} {m}" for n, m in sorted(mtus.items())),
                          "; ".join(f"ip link set {n} mtu {top}" for n, m in sorted(mtus.items()) if m != top)))
    return out


def shm_bytes_per_rank(local_ranks, buffsize, fifo, lanes=2):
    """Bytes of one rank's shared-memory segment: shm::Domain::segmentBytes (through
    topo.rules()) for a FIFO per local rank and lane (the engine's 2 lanes: collectives and
    send/recv) and a broadcast ring of RAILCC_BUFFSIZE."""
    return topo.rules().shm_segment_bytes(local_ranks * lanes, fifo, buffsize)


def check_shm(ctx):
    size = ctx.sys.shm_size()
    ctx.facts["/dev/shm"] = _mib(size) if size >= 0 else "missing"
    buff = int(ctx.param("RAILCC_BUFFSIZE", 4 << 20))
    n = ctx.local_ranks
    fifo = int(ctx.param("RAILCC_SHM_FIFO_BYTES", 0)) or buff
    need = n * shm_bytes_per_rank(n, buff, fifo) if n > 1 else 0
    shape = (f"{n} local ranks ({ctx.local_ranks_from}) x RAILCC_BUFFSIZE {_mib(buff)}" if fifo == buff else
             f"{n} local ranks ({ctx.local_ranks_from}), FIFOs of {_mib(fifo)}, broadcast rings of {_mib(buff)}")
    gib = max(1, -(-2 * need // (1 << 30)))
    fix = (f"docker run --shm-size={gib}g; Kubernetes: an emptyDir with medium: Memory on /dev/shm; "
           f"or lower RAILCC_BUFFSIZE or RAILCC_SHM_FIFO_BYTES; on a host: mount -o remount,size={gib}G /dev/shm")
    if size < 0:
        return [Result("shm", FAIL if n > 1 else NA, "/dev/shm is not mounted", fix)]
    if n <= 1:
        return [Result("shm", NA, f"/dev/shm {_mib(size)}; one local rank uses no shared memory")]
    found = f"/dev/shm {_mib(size)}; {shape} needs {_mib(need)} per process group"
    if size < need:
        return [Result("shm", FAIL, found + ": set-up will fail", fix)]
    if size < 2 * need:
        return [Result("shm", WARN, found + ": room for one group only (each new_group takes as much)", fix)]
    return [Result("shm", OK, found)]


def check_numa(ctx):
    nodes = ctx.sys.numa_nodes()
    allowed = ctx.sys.cpus_allowed()
    g = ctx.my_gpu()
    ctx.facts["numa nodes"] = str(len(nodes))
    if len(nodes) <= 1:
        return [Result("numa", NA, f"{len(nodes) or 1} NUMA node; CPUs allowed {format_cpus(allowed)}")]
    dev = g if g is not None else (ctx.nics()[0][1] if ctx.nics() else None)
    if dev is None or dev.numa < 0 or dev.numa not in nodes:
        return [Result("numa", NA, f"{len(nodes)} NUMA nodes; no GPU or NIC with a known NUMA node")]
    what = f"GPU {ctx.gpus.index(g)} ({g.bdf}, local rank {ctx.local_rank})" if g is not None else f"NIC {dev.bdf}"
    near = ctx.nearest_nic(g) if g is not None else None
    nic_s = ""
    if near and near[1].numa >= 0 and near[1].numa != dev.numa:
        nic_s = f"; its nearest NIC {near[0].name} is on NUMA node {near[1].numa}"
    home = nodes[dev.numa]
    found = f"{what} is on NUMA node {dev.numa} (CPUs {format_cpus(home)}); this process may run on {format_cpus(allowed)}{nic_s}"
    fix = f"numactl --cpunodebind={dev.numa} --membind={dev.numa} python ... (or torchrun with per-rank binding)"
    if not allowed & home:
        return [Result("numa", FAIL, found + ": none of them is on that node", fix)]
    if allowed - home:
        return [Result("numa", WARN, found + ": it may also run on other nodes", fix)]
    return [Result("numa", OK, found)]


def check_env(ctx):
    known = {}
    for p in ctx.params:
        known[p["env"]] = p
        if p["fallback"]:
            known[p["fallback"]] = p
    out = []
    for var in sorted(v for v in ctx.env if v.startswith(("RAILCC_", "NCCL_"))):
        val = ctx.env[var]
        ctx.facts[f"env {var}"] = val
        if var in known:
            p = known[var]
            if p["problem"] and p["source"] == var:
                out.append(Result(f"env {var}", FAIL, f"{val!r}: {p['problem']}", f"allowed: {p['allowed'] or 'see railcc env'}"))
            elif var != p["env"] and p["env"] in ctx.env:
                out.append(Result(f"env {var}", WARN, f"{val!r} is overridden by {p['env']}={ctx.env[p['env']]!r}"))
            else:
                out.append(Result(f"env {var}", OK, f"{val!r}: {p['description'].split('.')[0]}"))
        elif var in RAILCC_OTHER:
            out.append(Result(f"env {var}", OK, f"{val!r}: {RAILCC_OTHER[var]}"))
        elif var in NCCL_KNOWN_IGNORED:
            out.append(Result(f"env {var}", WARN, f"{val!r}: an NCCL variable railcc does not act on", "no effect on railcc"))
        else:
            names = list(known) + list(RAILCC_OTHER) + sorted(NCCL_KNOWN_IGNORED)
            close = difflib.get_close_matches(var, names, n=1)
            hint = f"did you mean {close[0]}?" if close else "unset it"
            verdict = FAIL if var.startswith("RAILCC_") else WARN
            out.append(Result(f"env {var}", verdict, f"{val!r}: not a variable railcc knows", hint))
    return out or [Result("env", OK, "no RAILCC_* or NCCL_* variable set: defaults everywhere")]


CHECKS = [check_gpus, check_cuda_plugin, check_topology, check_dmabuf, check_peermem, check_gdr, check_iommu, check_acs,
          check_rdma, check_memlock, check_network, check_shm, check_numa, check_env]


def run_checks(ctx):
    rows = []
    for c in CHECKS:
        try:
            rows.extend(c(ctx))
        except topo.RulesUnavailable as e:  # a broken or stale build: this check cannot judge
            rows.append(Result(c.__name__[6:], FAIL, f"cannot judge: {e}", "bash scripts/install.sh (rebuilds railcc._C)"))
        except Exception as e:  # a check that breaks is reported, never a traceback instead of a table
            rows.append(Result(c.__name__[6:], FAIL, f"the check itself failed: {type(e).__name__}: {e}",
                               "report this as a railcc bug, with the output of railcc doctor --json"))
    return rows
