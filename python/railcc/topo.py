"""railcc topo: GPUs, NICs and the PCI paths between them, the NUMA affinity, the NIC each
local rank would use (its rail) and the GPUDirect RDMA verdict per GPU-NIC pair.

  railcc topo [--json] [--topo-file FILE] [--local-ranks N] [--dump FILE]
  torchrun ... -m railcc topo --all-ranks

--topo-file (or RAILCC_TOPO_FILE) reads an hwloc XML file instead of this machine (lstopo
--of xml writes one; a regular file of at most 64 MiB); --dump (or RAILCC_TOPO_DUMP_FILE)
writes the topology in use as hwloc XML. --local-ranks sets how many ranks share this host,
1 to 4096 (default: one per GPU, else 1). A careless argument, file or torchrun variable
exits 2 with one line naming it.
--all-ranks (under torchrun): every rank publishes its NIC, rail and rail interfaces through
the job's store; rank 0 prints its host's view, every rank's rail, and the check railcc runs
at init that all hosts agree on the rails (their number, one subnet per rail). Every rank
exits 1 when they disagree."""

import argparse
import json
import os
import sys

from .doctor.inputs import (MAX_LOCAL_RANKS, BadReport, UsageError, count, rail_fields, seconds, topology_file,
                            torchrun_env, write_file)


def _gpu_bus_ids():
    """The GPUs in CUDA's order, by PCI bus id, when torch sees any; else [] (the topology's
    own NVIDIA devices are then listed by bus id)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        ids = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            ids.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
        return ids
    except Exception:
        return []


def _numa_of_this_process(numa_nodes):
    if numa_nodes <= 1:
        return 0
    try:
        cpus = os.sched_getaffinity(0)
        nodes = set()
        base = "/sys/devices/system/node"
        for d in os.listdir(base):
            if d.startswith("node") and d[4:].isdigit():
                with open(os.path.join(base, d, "cpulist")) as f:
                    mine = _cpulist(f.read())
                if mine & cpus:
                    nodes.add(int(d[4:]))
        return nodes.pop() if len(nodes) == 1 else -1
    except OSError:
        return -1


def _cpulist(text):
    out = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def report(topo_file="", local_ranks=0, env=None):
    """The topology as a dict (what --json prints). UsageError when the topology file (topo_file, else
    RAILCC_TOPO_FILE) is not a regular file of a sane size."""
    from . import _C
    from .doctor.topology import gdr_level, within

    env = os.environ if env is None else env
    if topo_file:
        topology_file(topo_file, f"--topo-file {topo_file}")
    elif env.get("RAILCC_TOPO_FILE"):
        topo_file = env["RAILCC_TOPO_FILE"]
        topology_file(topo_file, f"RAILCC_TOPO_FILE={topo_file}")
    gpus = [] if topo_file else _gpu_bus_ids()
    first = _C.topology(topo_file, gpus, [])
    n_gpus = len(first["gpus"])
    ranks = local_ranks or max(n_gpus, 1)
    places = []
    for i in range(ranks):
        if n_gpus:
            places.append((i % n_gpus, -1))
        else:
            places.append((-1, _numa_of_this_process(first["numa_nodes"])))
    t = _C.topology(topo_file, gpus, places)
    level, level_from = gdr_level(env)
    t["gdr_level"] = {"level": level, "from": level_from}
    t["gdr"] = [[(t["nics"][n]["rdma"] and within(t["paths"][g][n], level)) for n in range(len(t["nics"]))]
                for g in range(len(t["gpus"]))]
    for i, r in enumerate(t["rails"]):
        r["local_rank"] = i
        g = places[i][0]
        r["gdr"] = bool(g >= 0 and r["nic"] >= 0 and t["gdr"][g][r["nic"]])
    return t


def format_report(t):
    out = [f"railcc topo: {t['source']}, host {t['hostname'] or '?'}, {t['numa_nodes']} NUMA node"
           + ("s" if t["numa_nodes"] != 1 else "")]
    nics, gpus = t["nics"], t["gpus"]
    if not gpus:
        out.append("GPUs: none found (no NVIDIA device on PCI, and torch sees no CUDA device)")
    if not nics:
        out.append("NICs: none on PCI (no RDMA device and no PCI network interface)")
    if gpus and nics:
        names = [n["name"] for n in nics]
        width = max(6, max(len(n) for n in names) + 2)
        out.append("")
        out.append(" " * 8 + "".join(f"{n:<{width}}" for n in names) + "NUMA")
        for g, gpu in enumerate(gpus):
            cells = "".join(f"{t['paths'][g][n]:<{width}}" for n in range(len(nics)))
            numa = gpu["numa"] if gpu["numa"] >= 0 else "?"
            tag = "" if gpu["found"] else f"   ({gpu['bus_id']} is not in the topology: paths unknown)"
            out.append(f"GPU{g:<5}" + cells + f"{numa}{tag}")
        out.append("")
        out.append("  PIX: one PCIe switch  PXB: several switches  PHB: through a CPU's host bridge  SYS: across sockets")
    out.append("")
    for g, gpu in enumerate(gpus):
        out.append(f"GPU{g}: {gpu['bus_id']}, NUMA {gpu['numa'] if gpu['numa'] >= 0 else '?'}")
    for n in nics:
        kind = "RDMA" if n["rdma"] else "interface"
        nd = f", netdevs {','.join(n['netdevs'])}" if n["rdma"] and n["netdevs"] else ""
        speed = f", PCIe {n['link_gbs']:.1f} GB/s" if n["link_gbs"] > 0 else ""
        out.append(f"{n['name']}: {kind}, {n['bus_id']}, NUMA {n['numa'] if n['numa'] >= 0 else '?'}{nd}{speed}")
    out.append("")
    lvl = t["gdr_level"]
    out.append(f"rails ({len(t['rails'])} local rank{'s' if len(t['rails']) != 1 else ''}; GPUDirect RDMA within "
               f"{lvl['level']} ({lvl['from']})):")
    for r in t["rails"]:
        gdr = ""
        if r["nic"] >= 0 and nics[r["nic"]]["rdma"] and gpus:
            gdr = "; GPUDirect RDMA" if r["gdr"] else f"; no GPUDirect RDMA ({r['path']} is beyond {lvl['level']})"
        out.append(f"  local rank {r['local_rank']}: {r['why']}{gdr}")
    return "\n".join(out)


def _subnet(ifname):
    """"10.77.0.0/24" for the interface's IPv4 address, "" when it has none."""
    import fcntl
    import ipaddress
    import socket
    import struct

    req = struct.pack("256s", ifname[:15].encode())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, req)[20:24])  # SIOCGIFNETMASK
        except OSError:
            return ""
    return str(ipaddress.ip_network(f"{addr}/{mask}", strict=False))


def rail_line(t, rank, local_rank):
    """This rank's rail line, as the engine publishes it at init (engine/rail_check.h)."""
    rail_nics = [i for i, n in enumerate(t["nics"]) if n["rdma"]] or list(range(len(t["nics"])))
    parts = []
    for k, i in enumerate(rail_nics):
        nic = t["nics"][i]
        devs = nic["netdevs"] or [nic["name"]]
        found = next(((d, _subnet(d)) for d in devs if _subnet(d)), None)
        parts.append(f"{k}={found[0]}@{found[1]}" if found else f"{k}=-")
    r = t["rails"][local_rank] if local_rank < len(t["rails"]) else {"nic": -1, "rail": -1}
    nic = t["nics"][r["nic"]]["name"] if r["nic"] >= 0 else "-"
    host = t["hostname"] or os.uname().nodename
    return (f"host={host};rank={rank};nic={nic};rail={r['rail']};rails={len(rail_nics)}"
            + "".join(";" + p for p in parts))


def _verdict(store, key):
    """The verdict rank 0 published (0 or 1), for the other ranks' exit status."""
    try:
        raw = store.get(key)
    except Exception as e:  # noqa: BLE001 - rank 0 gone: say so, fail
        print(f"railcc topo --all-ranks: no verdict from rank 0: {e}", file=sys.stderr)
        return 1
    if raw not in (b"0", b"1"):
        print(f"railcc topo --all-ranks: rank 0's verdict is {raw[:20]!r}, expected 0 or 1", file=sys.stderr)
        return 1
    return int(raw)


def _all_ranks(a, job):
    from datetime import timedelta

    from . import _C
    from .doctor.across import _store

    rank, world, local_rank = job["rank"], job["world"], job["local_rank"]
    t = report(a.topo_file, a.local_ranks or job["local_world"])
    # Under torchrun every process of a node has the node's hostname; RAILCC_HOST_ID-style
    # overrides aside, the kernel's name is what the init log uses too.
    t["hostname"] = os.uname().nodename
    line = rail_line(t, rank, local_rank)
    prefix = f"railcc-topo/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/"
    store = _store(job, a.timeout)
    store.set(f"{prefix}{rank}", line)
    if rank != 0:
        print(f"rank {rank} on {t['hostname']}: {line} (rank 0 prints the comparison)")
        return _verdict(store, f"{prefix}verdict")
    store.set_timeout(timedelta(seconds=a.timeout))
    fields = [dict(kv.split("=", 1) for kv in line.split(";") if "=" in kv)]
    lines = [line]
    try:
        for r in range(1, world):
            ln, f = rail_fields(store.get(f"{prefix}{r}"), r)
            lines.append(ln)
            fields.append(f)
    except BadReport as e:  # another rank's record: said, and the others get a verdict instead of a timeout
        print(f"railcc topo --all-ranks: {e}", file=sys.stderr)
        store.set(f"{prefix}verdict", "1")
        return 1
    check = _C.check_rails(lines)
    if a.json:
        t.pop("xml", None)
        print(json.dumps({"rank0": t, "ranks": lines, "check": check}, indent=2))
    else:
        t.pop("xml", None)
        print(format_report(t))
        print()
        print(f"railcc topo --all-ranks: {world} ranks on {check['hosts']} host(s)")
        for f in fields:
            rail = int(f.get("rail", "-1"))
            dev = f.get(str(rail), "-").split("@")[0] if rail >= 0 else "-"
            print(f"  rank {f.get('rank')} on {f.get('host')}: {f.get('nic')} (rail {rail}, interface {dev})")
        if check["problems"]:
            for p in check["problems"]:
                print(f"rail check: {p}")
        elif check["rails"]:
            print(f"rail check: {check['hosts']} hosts agree on {check['rails']} rails ({check['agreed']})")
        else:
            print("rail check: no host has a rail NIC")
    code = 1 if check["problems"] else 0
    store.set(f"{prefix}verdict", str(code))
    return code


def _why(e):
    """An exception's text, or its kind when it has none (MemoryError)."""
    return str(e) or type(e).__name__


def main(argv=None):
    ap = argparse.ArgumentParser(prog="railcc topo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--topo-file", default="", help="read this hwloc XML instead of the machine")
    ap.add_argument("--local-ranks", type=count(1, MAX_LOCAL_RANKS), default=None,
                    help=f"ranks on this host, 1 to {MAX_LOCAL_RANKS} (default: one per GPU, else 1)")
    ap.add_argument("--dump", default="", help="write the topology in use as hwloc XML to this file")
    ap.add_argument("--all-ranks", action="store_true",
                    help="under torchrun: gather every rank's rail and check that the hosts agree")
    ap.add_argument("--timeout", type=seconds, default=120.0, help="--all-ranks: seconds to wait for the ranks")
    a = ap.parse_args(argv)
    try:
        if a.all_ranks:
            job = torchrun_env(os.environ, "railcc topo --all-ranks")
            return _all_ranks(a, job)
        t = report(a.topo_file, a.local_ranks)
    except UsageError as e:  # a careless argument or variable: named, exit 2
        print(f"railcc topo{' --all-ranks' if a.all_ranks else ''}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the store, a bad XML file, hwloc failing: one line, no traceback
        print(f"railcc topo{' --all-ranks' if a.all_ranks else ''}: {_why(e)}", file=sys.stderr)
        return 1
    dump = a.dump or os.environ.get("RAILCC_TOPO_DUMP_FILE", "")
    if dump and not t["xml"]:
        print(f"railcc topo: --dump {dump} not written: the topology came from {t['source']}, and only hwloc "
              "writes XML", file=sys.stderr)
    elif dump:
        try:
            write_file(dump, t["xml"], f"--dump {dump}" if a.dump else f"RAILCC_TOPO_DUMP_FILE={dump}")
        except UsageError as e:
            print(f"railcc topo: {e}", file=sys.stderr)
            return 1
    t.pop("xml")
    print(json.dumps(t, indent=2) if a.json else format_report(t))
    return 0
