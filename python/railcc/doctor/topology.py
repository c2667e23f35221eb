"""PCI paths between GPUs and NICs, in NCCL's path vocabulary, and which GID a RoCE port
should use. Pure functions over the facts System reads."""

# Path types, nearest first, as NCCL names them (NCCL_NET_GDR_LEVEL takes these or 0..5).
PATHS = ["LOC", "PIX", "PXB", "PHB", "SYS"]
_LEVEL_NUMBERS = {"0": "LOC", "1": "PIX", "2": "PXB", "3": "PHB", "4": "SYS", "5": "SYS"}
DEFAULT_GDR_LEVEL = "PXB"


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


def path_type(a, b):
    """How traffic between PCI devices a and b travels: PIX (through at most one PCIe
    switch), PXB (through several switches, not the host bridge), PHB (through the host
    bridge of one CPU), SYS (across CPU sockets)."""
    if a.bdf == b.bdf:
        return "LOC"
    common = _shared_bridges(a, b)
    if common == 0:
        if a.numa >= 0 and b.numa >= 0 and a.numa != b.numa:
            return "SYS"
        return "PHB"
    below = max(len(a.chain) - common, len(b.chain) - common)
    return "PIX" if below <= 1 else "PXB"


def bridges_between(a, b):
    """The PCI bridges a transfer between a and b passes (below the host bridge)."""
    common = _shared_bridges(a, b)
    if common == 0:
        return list(a.chain) + list(b.chain)
    return sorted(set(a.chain[common - 1:] + b.chain[common - 1:]))


def gdr_level(env):
    """(level, where it came from); raises ValueError on a value NCCL would not take."""
    for var in ("RAILCC_NET_GDR_LEVEL", "NCCL_NET_GDR_LEVEL"):
        v = env.get(var)
        if v:
            v = v.strip().upper()
            v = _LEVEL_NUMBERS.get(v, v)
            if v not in PATHS:
                raise ValueError(f"{var}={env[var]!r}: expected one of {', '.join(PATHS)} or 0..5")
            return v, var
    return DEFAULT_GDR_LEVEL, "default"


def within(path, level):
    return PATHS.index(path) <= PATHS.index(level)


def roce_mtu(netdev_mtu):
    """The RoCE MTU a port gets from its netdev MTU (the kernel subtracts the RoCE v2
    headers, then takes the largest IB MTU that fits)."""
    room = netdev_mtu - (40 + 8 + 12 + 4 + 28 + 4)
    for m in (4096, 2048, 1024, 512, 256):
        if room >= m:
            return m
    return 0


def pick_gid(port, env):
    """(Gid or None, why) for one port. RAILCC_IB_GID_INDEX / NCCL_IB_GID_INDEX force an index;
    otherwise a RoCE v2 GID mapped from an IPv4 address, then any RoCE v2 GID that is not
    link-local, then RoCE v1. InfiniBand ports use index 0."""
    for var in ("RAILCC_IB_GID_INDEX", "NCCL_IB_GID_INDEX"):
        v = env.get(var)
        if v not in (None, ""):
            try:
                idx = int(v)
            except ValueError:
                return None, f"{var}={v!r} is not a number"
            if idx < 0:
                break  # NCCL's -1: choose automatically
            g = next((g for g in port.gids if g.index == idx), None)
            if g is None:
                return None, f"{var}={idx} names an empty GID slot"
            return g, f"forced by {var}"
    if port.link_layer == "InfiniBand":
        g = next((g for g in port.gids if g.index == 0), None)
        return g, "InfiniBand: index 0 (the port GID)"
    v2 = [g for g in port.gids if g.kind.lower().startswith("roce v2")]
    for g in v2:
        if g.ipv4:
            return g, f"RoCE v2 over IPv4 {g.ipv4}"
    for g in v2:
        if not g.link_local:
            return g, "RoCE v2 over IPv6 (no IPv4-mapped GID)"
    for g in port.gids:
        if not g.link_local:
            return g, "RoCE v1: no RoCE v2 GID; v1 is not routable"
    return None, "no routable GID: only link-local entries (the netdev has no IP address)"


def match_spec(name, spec):
    """RAILCC_SOCKET_IFNAME / NCCL_SOCKET_IFNAME matching, as the socket transport does it:
    comma-separated prefixes; a leading ^ excludes, = matches names exactly."""
    exclude = spec.startswith("^")
    s = spec[1:] if exclude else spec
    exact = s.startswith("=")
    s = s[1:] if exact else s
    hit = any(tok and (name == tok if exact else name.startswith(tok)) for tok in s.split(","))
    return not hit if exclude else hit


def resolve_interfaces(ifaces, spec):
    """(chosen, matched, why) as the socket transport picks: the first up interface with an
    IPv4 address that the spec matches (default: not docker*, not lo*), loopback when the
    default finds nothing else. `matched` lists every interface the spec takes."""
    usable = [i for i in ifaces if i.up and i.ipv4]
    matched = [i for i in usable if match_spec(i.name, spec if spec else "^docker,lo")]
    if matched:
        return matched[0], matched, "first up IPv4 interface " + (f"matching {spec!r}" if spec else "that is not lo or docker")
    if not spec:
        lo = next((i for i in usable if i.loopback), None)
        if lo:
            return lo, [lo], "no other up IPv4 interface: loopback (single-host only)"
    return None, [], ""
