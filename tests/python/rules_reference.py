"""An independent reference for railcc's host rules, written again in Python for the tests:
tests/python/test_doctor_rules.py feeds it and railcc._C.rules (the C++ the engine and the
transports run, which `railcc doctor` asks) the same inputs from the fake host trees and fails
on any difference, word for word. It is not part of railcc: the doctor has one source for each
rule. Change a rule in the C++ first, then here:

    path_between         csrc/topology/topology.cpp         pathBetween
    parse_path           csrc/topology/topology.cpp         parsePath
    decide_gdr           csrc/transport/verbs/verbs_rules.cpp decideGdr
    pick_gid             csrc/transport/verbs/verbs_rules.cpp pickGid
    match_spec           csrc/transport/socket/interfaces.cpp matchSpec
    choose_interfaces    csrc/transport/socket/interfaces.cpp chooseInterfaces
    shm_segment_bytes    csrc/transport/shm/shm_segment.cpp Domain::segmentBytes
    verbs_ring_bytes     csrc/transport/verbs/verbs_rules.cpp ringBytes
    verbs_connection_bytes csrc/transport/verbs/verbs_rules.cpp connectionPinnedBytes
"""

import socket

_PATHS = ["LOC", "PIX", "PXB", "PHB", "SYS"]
_PAGE = 4096
VERBS_MAX_RING_BYTES = 1 << 29  # 512 MiB


# -- PCI paths (topology::pathBetween, parsePath) -----------------------------------------------
def path_between(a, b):
    """a, b: (bus_id, numa, chain, root)."""
    a_bus, a_numa, a_chain, a_root = a
    b_bus, b_numa, b_chain, b_root = b
    if a_bus == b_bus:
        return "LOC"
    common = 0
    if a_root and a_root == b_root:
        while common < len(a_chain) and common < len(b_chain) and a_chain[common] == b_chain[common]:
            common += 1
    if common == 0:
        if a_numa >= 0 and b_numa >= 0 and a_numa != b_numa:
            return "SYS"
        if a_numa < 0 and b_numa < 0 and not a_root and not b_root:
            return "SYS"  # nothing known
        return "PHB"
    below = max(len(a_chain), len(b_chain)) - common
    return "PIX" if below <= 1 else "PXB"


def parse_path(level):
    u = "".join(c for c in level if not c.isspace()).upper()
    if len(u) == 1 and "0" <= u <= "5":
        u = ["LOC", "PIX", "PXB", "PHB", "SYS", "SYS"][int(u)]
    if u in _PATHS:
        return u
    raise ValueError(f"path type '{level}': expected one of LOC, PIX, PXB, PHB, SYS or 0..5")


# -- GPUDirect RDMA (verbs::decideGdr) ----------------------------------------------------------
def _path_rank(p):
    return _PATHS.index(p) if p in _PATHS else -1


def _level_rank(level):
    if len(level) == 1 and "0" <= level <= "5":
        return min(int(level), 4)
    r = _path_rank(level)
    return _path_rank("PXB") if r < 0 else r


def decide_gdr(gpu, nic, path, level, dmabuf, peermem):
    pair = f"{gpu} <-> {nic}"
    staged = ": staging through host memory"
    rank = _path_rank(path)
    if rank < 0:
        return {"mode": "staged", "within_level": False,
                "line": f"GPUDirect RDMA disabled for {pair}: the PCI path between them is unknown (no topology){staged}"}
    if rank > _level_rank(level):
        return {"mode": "staged", "within_level": False,
                "line": f"GPUDirect RDMA disabled for {pair}: their path is {path}, beyond "
                        f"RAILCC_NET_GDR_LEVEL/NCCL_NET_GDR_LEVEL={level}{staged}"}
    if dmabuf:
        return {"mode": "dmabuf", "within_level": True, "line": f"GPUDirect RDMA enabled for {pair} (dma-buf, path {path})"}
    if peermem:
        return {"mode": "peermem", "within_level": True,
                "line": f"GPUDirect RDMA enabled for {pair} (nvidia_peermem, path {path})"}
    return {"mode": "staged", "within_level": True,
            "line": f"GPUDirect RDMA disabled for {pair}: nvidia_peermem not loaded and dma-buf unsupported{staged}"}


# -- RoCE GID (verbs::pickGid) ------------------------------------------------------------------
def _zero(raw):
    return not any(raw)


def _link_local(raw):
    return raw[0] == 0xFE and (raw[1] & 0xC0) == 0x80


def _ipv4_mapped(raw):
    return not any(raw[:10]) and raw[10] == 0xFF and raw[11] == 0xFF


def _atoi(s):
    """C's atoi: leading blanks, a sign, digits; 0 when there are none."""
    s = s.lstrip(" \t\n\v\f\r")
    n = 0
    while n < len(s) and (s[n].isdigit() or (n == 0 and s[n] in "+-")):
        n += 1
    try:
        return int(s[:n])
    except ValueError:
        return 0


def _in_range(raw, rng):
    if not rng:
        return True
    if not _ipv4_mapped(raw):
        return False
    slash = rng.find("/")
    try:
        net = socket.inet_pton(socket.AF_INET, rng if slash < 0 else rng[:slash])
    except OSError:
        return False
    bits = 32 if slash < 0 else _atoi(rng[slash + 1:])
    if bits < 0 or bits > 32:
        return False
    mask = 0 if bits == 0 else (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF
    return int.from_bytes(raw[12:16], "big") & mask == int.from_bytes(net, "big") & mask


def _describe(entry):
    index, raw, version, netdev = entry
    return (f"{index} {socket.inet_ntop(socket.AF_INET6, bytes(raw))}" + (f" RoCE v{version}" if version else "")
            + (f" on {netdev}" if netdev else ""))


def pick_gid(table, gid_index=-1, roce_version=2, addr_family="AF_INET", addr_range="", where="the port"):
    """table: [(index, raw 16 bytes, RoCE version 0|1|2, netdev)] -> (index or -1, why)."""
    table = [(i, bytes(raw), v, nd) for i, raw, v, nd in table]
    for _, raw, _, _ in table:
        if len(raw) != 16:
            raise ValueError(f"a GID is 16 bytes, got {len(raw)}")
    listing = "".join("\n  " + _describe(e) for e in table if not _zero(e[1])) or \
        "\n  (no GID at all: the port's interface has no address)"
    v4 = addr_family != "AF_INET6"
    family = "IPv4" if v4 else "IPv6"

    def wanted(e):
        _, raw, version, _ = e
        return (not _zero(raw) and not _link_local(raw) and _ipv4_mapped(raw) == v4
                and (version == 0 or version == roce_version) and _in_range(raw, addr_range))

    best = next((e[0] for e in table if wanted(e)), -1)
    if gid_index >= 0:
        for index, raw, version, _ in table:
            if index != gid_index or _zero(raw):
                continue
            why = f"GID index {index} forced by RAILCC_IB_GID_INDEX/NCCL_IB_GID_INDEX"
            if _link_local(raw) or (version and version != roce_version):
                why += ("; it is " + ("link-local" if _link_local(raw) else f"not RoCE v{roce_version}")
                        + ", so traffic may not route" + (f" (index {best} would)" if best >= 0 else ""))
            return index, why
        return -1, (f"{where} has no GID at index {gid_index} (RAILCC_IB_GID_INDEX/NCCL_IB_GID_INDEX={gid_index}); "
                    f"its table:{listing}" + (f"\nset it to {best}, or unset it to pick automatically" if best >= 0 else ""))
    if best >= 0:
        return best, (f"GID index {best} picked: RoCE v{roce_version}, {family}"
                      + (f" inside {addr_range}" if addr_range else "") + ", not link-local")
    return -1, (f"{where} has no RoCE v{roce_version} {family} GID"
                + (f" inside RAILCC_IB_ADDR_RANGE={addr_range}" if addr_range else "") + f"; its table:{listing}"
                + "\ngive its interface an address (ip addr add ADDR/PREFIX dev NETDEV), or force one with RAILCC_IB_GID_INDEX")


# -- socket interfaces (socket::matchSpec, chooseInterfaces) ------------------------------------
def match_spec(name, spec):
    s = spec
    exclude = s.startswith("^")
    s = s[1:] if exclude else s
    exact = s.startswith("=")
    s = s[1:] if exact else s
    hit = any(tok and (name == tok if exact else name.startswith(tok)) for tok in s.split(","))
    return not hit if exclude else hit


def choose_interfaces(addrs, spec):
    """addrs: [(name, up, loopback, ipv4)] in getifaddrs order -> [(name, ipv4)]."""
    chosen, loopback = [], None
    for name, up, is_lo, ip in addrs:
        socket.inet_pton(socket.AF_INET, ip)  # an OSError, as the binding's ValueError, on a non-address
        if not up:
            continue
        ok = match_spec(name, "^docker,lo") if not spec else match_spec(name, spec)
        dup = any(c[0] == name for c in chosen)
        if ok and not dup and (not chosen or spec):
            chosen.append((name, ip))
        if is_lo and loopback is None:
            loopback = (name, ip)
    if not chosen and not spec and loopback is not None:
        chosen.append(loopback)
    return chosen


# -- memory (shm::Domain::segmentBytes, verbs::ringBytes, connectionPinnedBytes) ---------------
def _up(n):
    return (n + _PAGE - 1) // _PAGE * _PAGE


def shm_segment_bytes(nslots, fifo_bytes, ring_bytes):
    """A header page, a FIFO (header page + data) per slot, the broadcast ring's header (a
    cache line for its tail and one per consumer) and its data."""
    return _PAGE + nslots * (_PAGE + _up(fifo_bytes)) + _up(64 * (1 + nslots)) + _up(ring_bytes)


def verbs_ring_bytes(buffsize):
    return min(buffsize, VERBS_MAX_RING_BYTES)


VERBS_RNDV_BOUNCE_BYTES = 1 << 20


def verbs_connection_bytes(buffsize, rendezvous=False):
    return 2 * verbs_ring_bytes(buffsize) + (VERBS_RNDV_BOUNCE_BYTES if rendezvous else 0)
