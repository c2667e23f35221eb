"""python -m railcc topo [--json]: railcc.topo."""

NAME = "topo"
USAGE = "topo [--json]"
SUMMARY = """GPUs, NICs, PCI paths (PIX/PXB/PHB/SYS), NUMA, each local rank's
NIC and rail, GPUDirect RDMA verdicts (--topo-file FILE: hwloc XML)"""


def run(argv):
    from ..topo import main

    return main(argv)
