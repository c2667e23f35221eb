"""PCI paths between GPUs and NICs, in NCCL's path vocabulary, the GPUDirect RDMA decision,
which GID a RoCE port uses and which interfaces the socket transport takes: what railcc
would decide from the facts System reads.

The rules are railcc's own C++ (railcc._C.rules, the functions the engine and transports
run); this module asks them, and only them: a rule has one source. Where the extension does
not load (a broken or stale build), every check that needs a rule says so and how to rebuild;
the checks that only read the host still run."""

_rules = None  # railcc._C.rules, once loaded
_rules_why = ""


class RulesUnavailable(RuntimeError):
    """railcc._C (and so its rules) did not load."""


def rules():
    """railcc._C.rules; RulesUnavailable, saying why and how to rebuild, where it does not load."""
    global _rules, _rules_why
    if _rules is None:  # asked again each time until it loads (a failed import is not cached by Python)
        try:
            from .. import _C

            _rules, _rules_why = _C.rules, "railcc._C"
        except Exception as e:  # noqa: BLE001 - no extension, or one without rules
            _rules_why = f"unavailable: railcc._C did not load ({type(e).__name__}: {e})"
    if _rules is None:
        raise RulesUnavailable(f"railcc's host rules are {_rules_why}; rebuild railcc (bash scripts/install.sh)")
    return _rules


def rules_source():
    """Where the rules come from: "railcc._C", or "unavailable: ..." and why."""
    try:
        rules()
    except RulesUnavailable:
        pass
    return _rules_why


# Path types, nearest first, as NCCL names them (NCCL_NET_GDR_LEVEL takes these or 0..5).
PATHS = ["LOC", "PIX", "PXB", "PHB", "SYS"]
DEFAULT_GDR_LEVEL = "PXB"


def pci_tuple(d):
    """A System PciDevice as the rules take it: (bus id, NUMA node, bridges, host bridge)."""
    return (d.bdf, d.numa, list(d.chain), d.root)


def path_type(a, b):
    """How traffic between PCI devices a and b travels: LOC (the same device), PIX (through at
    most one PCIe switch), PXB (through several switches, not the host bridge), PHB (through
    the host bridge of one CPU), SYS (across CPU sockets)."""
    return rules().path_between(pci_tuple(a), pci_tuple(b))


def _shared_bridges(a, b):
    """How many PCI bridges, from the root port down, devices a and b have in common (0 when
    they hang off different host bridges)."""
    if a.root != b.root:
        return 0
    common = 0
    for x, y in zip(a.chain, b.chain):
        if x != y:
            break
        common += 1
    return common


def bridges_between(a, b):
    """The PCI bridges a transfer between a and b passes (below the host bridge): the doctor's
    own question (which bridges' ACS to read), not a rule railcc's engine has."""
    common = _shared_bridges(a, b)
    if common == 0:
        return list(a.chain) + list(b.chain)
    return sorted(set(a.chain[common - 1:] + b.chain[common - 1:]))


def gdr_level(env):
    """(level, where it came from); raises ValueError on a value railcc would not take."""
    for var in ("RAILCC_NET_GDR_LEVEL", "NCCL_NET_GDR_LEVEL"):
        v = env.get(var)
        if v:
            try:
                return rules().parse_path(v), var
            except ValueError:
                raise ValueError(f"{var}={v!r}: expected one of {', '.join(PATHS)} or 0..5") from None
    return DEFAULT_GDR_LEVEL, "default"


def within(path, level):
    """Whether GPUDirect RDMA reaches over `path` at `level` (the verbs transport's decision)."""
    return rules().decide_gdr("GPU", "NIC", path, level, False, False)["within_level"]


def decide_gdr(gpu, nic, path, level, dmabuf, peermem):
    """The verbs transport's decision for one GPU and NIC: {mode, within_level, line}."""
    return rules().decide_gdr(gpu, nic, path, level, bool(dmabuf), bool(peermem))


def roce_mtu(netdev_mtu):
    """The RoCE MTU a port gets from its netdev MTU (the kernel subtracts the RoCE v2
    headers, then takes the largest IB MTU that fits). The kernel's rule, not railcc's."""
    room = netdev_mtu - (40 + 8 + 12 + 4 + 28 + 4)
    for m in (4096, 2048, 1024, 512, 256):
        if room >= m:
            return m
    return 0


def _env(env, names, default):
    for n in names:
        if env.get(n) not in (None, ""):
            return env[n]
    return default


def gid_table(port):
    """A port's GIDs as pickGid takes them: (index, raw bytes, RoCE version, netdev)."""
    out = []
    for g in port.gids:
        kind = g.kind or ""
        version = 2 if "v2" in kind else 1 if "v1" in kind else 0  # as the verbs transport reads gid_attrs/types
        out.append((g.index, bytes.fromhex(g.gid.replace(":", "")), version, g.netdev))
    return out


def pick_gid(port, env, where="the port", forced=True):
    """(Gid or None, why) for one port, as the verbs transport picks it: RAILCC_IB_GID_INDEX /
    NCCL_IB_GID_INDEX forces an index; otherwise the first RoCE v2 (RAILCC_IB_ROCE_VERSION_NUM)
    IPv4-mapped (RAILCC_IB_ADDR_FAMILY) GID that is not link-local, inside RAILCC_IB_ADDR_RANGE.
    InfiniBand ports address by LID; they report index 0 (the port GID) unless one is forced.
    forced=False: what the rule picks with no index forced."""
    idx = -1
    for var in ("RAILCC_IB_GID_INDEX", "NCCL_IB_GID_INDEX"):
        v = env.get(var) if forced else None
        if v not in (None, ""):
            try:
                idx = int(v)
            except ValueError:
                return None, f"{var}={v!r} is not a number"
            break
    by_index = {g.index: g for g in port.gids}
    if port.link_layer == "InfiniBand":
        if idx >= 0:
            g = by_index.get(idx)
            return (g, "forced by RAILCC_IB_GID_INDEX/NCCL_IB_GID_INDEX") if g else \
                (None, f"no GID at index {idx} (RAILCC_IB_GID_INDEX/NCCL_IB_GID_INDEX)")
        return by_index.get(0), "InfiniBand: index 0 (the port GID)"
    try:
        version = int(_env(env, ("RAILCC_IB_ROCE_VERSION_NUM", "NCCL_IB_ROCE_VERSION_NUM"), "2"))
    except ValueError:
        version = 2
    family = _env(env, ("RAILCC_IB_ADDR_FAMILY", "NCCL_IB_ADDR_FAMILY"), "AF_INET")
    rng = _env(env, ("RAILCC_IB_ADDR_RANGE", "NCCL_IB_ADDR_RANGE"), "")
    i, why = rules().pick_gid(gid_table(port), idx, version, family, rng, where)
    return (by_index.get(i) if i >= 0 else None), why


def match_spec(name, spec):
    """RAILCC_SOCKET_IFNAME / NCCL_SOCKET_IFNAME matching, as the socket transport does it:
    comma-separated prefixes; a leading ^ excludes, = matches names exactly."""
    return rules().match_spec(name, spec)


def interface_addrs(ifaces):
    """The interfaces' IPv4 addresses as getifaddrs lists them: (name, up, loopback, ipv4)."""
    return [(i.name, i.up, i.loopback, ip) for i in ifaces for ip in i.ipv4]


def resolve_interfaces(ifaces, spec):
    """(chosen, matched, why) as the socket transport picks: the first up interface with an
    IPv4 address that the spec matches (default: not docker*, not lo*), loopback when the
    default finds nothing else. `matched` lists every interface the spec takes."""
    picked = rules().choose_interfaces(interface_addrs(ifaces), spec)
    if not picked:
        return None, [], ""
    by_name = {i.name: i for i in ifaces}
    chosen = by_name[picked[0][0]]
    if chosen.loopback and not spec:
        return chosen, [chosen], "no other up IPv4 interface: loopback (single-host only)"
    # With a spec the transport takes every match; without one only the first, but the doctor
    # still lists the others the default would allow (to compare their MTUs).
    names = [n for n, _ in picked] if spec else \
        [i.name for i in ifaces if i.up and i.ipv4 and match_spec(i.name, "^docker,lo")]
    matched = [by_name[n] for n in dict.fromkeys(names)]
    return chosen, matched, "first up IPv4 interface " + (f"matching {spec!r}" if spec else "that is not lo or docker")
