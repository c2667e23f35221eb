"""Writes the hwloc XML topologies the topology gtests read (run it to regenerate them):

  dgx_h100.xml         2 sockets; 4 PCIe switches, 2 per socket, each holding 2 GPUs and
                       2 RDMA NICs (mlx5_*, with their RoCE netdevs), as on a DGX H100-like box
  nics_on_socket1.xml  2 sockets; 8 GPUs under 4 switches, 2 per socket; 4 RDMA NICs, all under
                       socket 1's switches (socket 0's GPUs reach every NIC across sockets)
  vm_flat.xml          a VM: one socket, one host bridge, 2 GPUs and 2 NICs right under it, no
                       switches (qemu's flat PCI bus)

The PCI class/vendor words follow the PCI IDs (0302 3D controller 10de NVIDIA, 0207
InfiniBand/0200 Ethernet 15b3 Mellanox, 0604 PCI bridge); OS device types follow hwloc
(2 network, 3 OpenFabrics)."""

import os

HERE = os.path.dirname(os.path.abspath(__file__))


class Xml:
    def __init__(self):
        self.lines = []
        self.gp = 0

    def open(self, kind, indent, **attrs):
        self.gp += 1
        a = " ".join(f'{k}="{v}"' for k, v in attrs.items())
        self.lines.append(f'{"  " * indent}<object type="{kind}" gp_index="{self.gp}" {a}>')

    def close(self, indent):
        self.lines.append(f'{"  " * indent}</object>')

    def leaf(self, kind, indent, infos=(), **attrs):
        self.open(kind, indent, **attrs)
        for k, v in infos:
            self.lines.append(f'{"  " * (indent + 1)}<info name="{k}" value="{v}"/>')
        self.close(indent)


def cpuset(first, n):
    return hex(((1 << n) - 1) << first)


def bridge(x, indent, bus, sec, sub, depth):
    x.open("Bridge", indent, bridge_type="1-1", depth=depth, bridge_pci=f"0000:[{sec:02x}-{sub:02x}]",
           pci_busid=f"0000:{bus:02x}:00.0", pci_type="0604 [1000:c030] [0000:0000] 00", pci_link_speed="31.507692")


def device(x, indent, bus, kind, n, names=None):
    """A GPU, or an RDMA NIC named mlx5_<n> with interface ens<n>np0 (or `names`: (rdma, netdev))."""
    if kind == "gpu":
        x.leaf("PCIDev", indent, pci_busid=f"0000:{bus:02x}:00.0", pci_type="0302 [10de:2330] [10de:16c1] a1",
               pci_link_speed="63.015385")
        return
    x.open("PCIDev", indent, pci_busid=f"0000:{bus:02x}:00.0", pci_type="0207 [15b3:1021] [15b3:0041] 00",
           pci_link_speed="63.015385")
    rdma, netdev = names or (f"mlx5_{n}", f"ens{n}np0")
    x.leaf("OSDev", indent + 1, name=rdma, osdev_type="3", infos=[("NodeGUID", f"a088:c203:00{n:02x}:0001")])
    x.leaf("OSDev", indent + 1, name=netdev, osdev_type="2", infos=[("Address", f"a0:88:c2:03:00:{n:02x}")])
    x.close(indent)


def switch(x, indent, base, devices, counters, names=None):
    """A host bridge, its root port and a PCIe switch with one downstream port per device."""
    x.open("Bridge", indent, bridge_type="0-1", depth="0", bridge_pci=f"0000:[{base:02x}-{base + 0x1f:02x}]")
    bridge(x, indent + 1, base, base + 1, base + 0x1f, 1)           # root port
    bridge(x, indent + 2, base + 1, base + 2, base + 0x1f, 2)       # switch upstream port
    for k, kind in enumerate(devices):
        bus = base + 3 + k
        x.open("Bridge", indent + 3, bridge_type="1-1", depth="3", bridge_pci=f"0000:[{bus:02x}-{bus:02x}]",
               pci_busid=f"0000:{base + 2:02x}:{k:02x}.0", pci_type="0604 [1000:c030] [0000:0000] 00",
               pci_link_speed="31.507692")
        device(x, indent + 4, bus, kind, counters[kind], names if kind == "nic" else None)
        counters[kind] += 1
        x.close(indent + 3)
    x.close(indent + 2)
    x.close(indent + 1)
    x.close(indent)


def machine(name, sockets, io):
    """`io(x, socket, indent)` writes the I/O objects of one socket."""
    x = Xml()
    cores = 4
    n = sockets * cores
    x.lines += ['<?xml version="1.0" encoding="UTF-8"?>', '<!DOCTYPE topology SYSTEM "hwloc2.dtd">',
                '<topology version="2.0">']
    full = cpuset(0, n)
    nodes = hex((1 << sockets) - 1)
    x.open("Machine", 1, os_index="0", cpuset=full, complete_cpuset=full, allowed_cpuset=full, nodeset=nodes,
           complete_nodeset=nodes, allowed_nodeset=nodes)
    x.lines.append(f'    <info name="HostName" value="{name}"/>')
    for s in range(sockets):
        cs, ns = cpuset(s * cores, cores), hex(1 << s)
        x.open("Package", 2, os_index=s, cpuset=cs, complete_cpuset=cs, nodeset=ns, complete_nodeset=ns)
        x.leaf("NUMANode", 3, os_index=s, cpuset=cs, complete_cpuset=cs, nodeset=ns, complete_nodeset=ns,
               local_memory="1073741824")
        for c in range(cores):
            pu = s * cores + c
            x.open("Core", 3, os_index=pu, cpuset=cpuset(pu, 1), complete_cpuset=cpuset(pu, 1), nodeset=ns,
                   complete_nodeset=ns)
            x.leaf("PU", 4, os_index=pu, cpuset=cpuset(pu, 1), complete_cpuset=cpuset(pu, 1), nodeset=ns,
                   complete_nodeset=ns)
            x.close(3)
        io(x, s, 3)
        x.close(2)
    x.close(1)
    x.lines.append("</topology>")
    return "\n".join(x.lines) + "\n"


def dgx(x, s, indent):
    counters = dgx.counters
    for k in range(2):
        switch(x, indent, 0x10 + (2 * s + k) * 0x20, ["gpu", "nic", "gpu", "nic"], counters)


def nics_on_socket1(x, s, indent):
    counters = nics_on_socket1.counters
    for k in range(2):
        kinds = ["gpu", "gpu"] + (["nic", "nic"] if s == 1 else [])
        switch(x, indent, 0x10 + (2 * s + k) * 0x20, kinds, counters)


def vm_flat(x, s, indent):
    x.open("Bridge", indent, bridge_type="0-1", depth="0", bridge_pci="0000:[00-00]")
    for k, kind in enumerate(["gpu", "gpu", "nic", "nic"]):
        if kind == "gpu":
            x.leaf("PCIDev", indent + 1, pci_busid=f"0000:00:{k + 4:02x}.0",
                   pci_type="0302 [10de:2330] [10de:16c1] a1", pci_link_speed="0.000000")
        else:
            x.open("PCIDev", indent + 1, pci_busid=f"0000:00:{k + 4:02x}.0",
                   pci_type="0200 [15b3:101e] [15b3:0061] 00", pci_link_speed="0.000000")
            x.leaf("OSDev", indent + 2, name=f"mlx5_{k - 2}", osdev_type="3")
            x.leaf("OSDev", indent + 2, name=f"eth{k - 1}", osdev_type="2")
            x.close(indent + 1)
    x.close(indent)


def rail_host(name, netdevs):
    """A one-socket host whose NIC k (mlx5_k) has the network interface netdevs[k], all under
    one host bridge: the multi-rail network-namespace tests write one per "host", naming its
    veth interfaces, so that local rank k is placed on rail k."""
    def io(x, s, indent):
        x.open("Bridge", indent, bridge_type="0-1", depth="0", bridge_pci="0000:[00-00]")
        for k, dev in enumerate(netdevs):
            x.open("PCIDev", indent + 1, pci_busid=f"0000:00:{k + 4:02x}.0",
                   pci_type="0200 [15b3:101e] [15b3:0061] 00", pci_link_speed="0.000000")
            x.leaf("OSDev", indent + 2, name=f"mlx5_{k}", osdev_type="3")
            x.leaf("OSDev", indent + 2, name=dev, osdev_type="2")
            x.close(indent + 1)
        x.close(indent)
    return machine(name, 1, io)


def gpu_rdma_host(name, nics):
    """One socket; PCIe switch k holds GPU k and the RDMA NIC nics[k] = (rdma name, interface):
    GPU k reaches NIC k through one switch (PIX) and the others across host bridges (PHB). The
    Soft-RoCE VM test names its rxe devices here to see railcc's GPUDirect decisions."""
    def io(x, s, indent):
        counters = {"gpu": 0, "nic": 0}
        for k, names in enumerate(nics):
            switch(x, indent, 0x10 + k * 0x20, ["gpu", "nic"], counters, names)
    return machine(name, 1, io)


if __name__ == "__main__":
    dgx.counters = {"gpu": 0, "nic": 0}
    nics_on_socket1.counters = {"gpu": 0, "nic": 0}
    for name, sockets, io in (("dgx_h100", 2, dgx), ("nics_on_socket1", 2, nics_on_socket1), ("vm_flat", 1, vm_flat)):
        with open(os.path.join(HERE, name + ".xml"), "w") as f:
            f.write(machine(name, sockets, io))
