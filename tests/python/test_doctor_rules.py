"""One source for each host rule: `railcc doctor` asks railcc._C.rules (the C++ the engine and
transports run), and nothing else. The rules are held to an independent reference written
again in Python for the tests (rules_reference.py): both get the same inputs, read from the
fake host trees of fake_hosts.py, and must give the same answers, word for word; a rule changed
on one side only fails here."""

import itertools

import pytest

import fake_hosts
from railcc import _C
import rules_reference as py_rules
from railcc.doctor import topology
from railcc.doctor.system import Gid, Iface, Port, System

cpp_rules = _C.rules


def same(fn, *args, **kwargs):
    """Calls fn on both sides; both must return the same value, or both raise ValueError."""
    out = []
    for side in (cpp_rules, py_rules):
        try:
            out.append(("ok", getattr(side, fn)(*args, **kwargs)))
        except (ValueError, OSError):
            out.append(("error", None))
    assert out[0] == out[1], (fn, args, kwargs, out)
    return out[0][1]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Systems over fake trees: a DGX-like InfiniBand node, the same with RoCE, and a smaller one."""
    out = {}
    for name, kw in (("ib", {}), ("roce", {"roce": True}), ("small", {"gpus": 2, "roce": True})):
        out[name] = System(fake_hosts.dgx(tmp_path_factory.mktemp(name), **kw))
    return out


def test_the_doctor_asks_the_extension_when_it_loads():
    topology._rules = None
    assert topology.rules() is cpp_rules and topology.rules_source() == "railcc._C"


def test_an_extension_without_rules_is_said_by_the_checks_that_need_them(tmp_path, monkeypatch):
    """A stale build of railcc._C (from before its rules submodule): the checks that need a rule
    say the rules are unavailable and how to rebuild; the others still judge the host."""
    import railcc.doctor as doctor

    monkeypatch.delattr(_C, "rules")
    monkeypatch.setattr(topology, "_rules", None)
    monkeypatch.setattr(topology, "_rules_why", "")
    with pytest.raises(topology.RulesUnavailable, match="rebuild railcc"):
        topology.rules()
    assert "AttributeError" in topology.rules_source()
    r = doctor.collect(root=fake_hosts.dgx(tmp_path, roce=True))
    assert r["facts"]["host rules"].startswith("unavailable: railcc._C did not load")
    assert not [c for c in r["checks"] if "the check itself failed" in c["found"]], r["checks"]
    unjudged = [c for c in r["checks"] if c["found"].startswith("cannot judge: railcc's host rules are unavailable")]
    assert unjudged and all(c["verdict"] == "fail" for c in unjudged), r["checks"]
    assert len(unjudged) < len(r["checks"]), r["checks"]


def test_both_sides_offer_the_same_rules():
    public = lambda m: {n for n in dir(m) if not n.startswith("_") and (callable(getattr(m, n)) or n.isupper())}  # noqa: E731
    wanted = {"path_between", "parse_path", "decide_gdr", "pick_gid", "match_spec", "choose_interfaces",
              "shm_segment_bytes", "verbs_ring_bytes", "verbs_connection_bytes", "VERBS_MAX_RING_BYTES"}
    assert wanted <= public(cpp_rules)
    assert wanted <= public(py_rules)
    assert cpp_rules.VERBS_MAX_RING_BYTES == py_rules.VERBS_MAX_RING_BYTES == 512 << 20


def test_pci_path_types_agree_on_every_pair_of_devices(hosts):
    seen = set()
    for system in hosts.values():
        devs = [topology.pci_tuple(d) for d in system.pci_devices()]
        assert len(devs) >= 12
        for a, b in itertools.product(devs, devs):
            seen.add(same("path_between", a, b))
    assert seen == {"LOC", "PIX", "PXB", "PHB", "SYS"}, seen
    # What sysfs may leave unknown: no host bridge, no NUMA node.
    odd = [("0000:01:00.0", -1, [], ""), ("0000:02:00.0", -1, [], ""), ("0000:03:00.0", 0, ["0000:00:01.0"], ""),
           ("0000:04:00.0", -1, ["0000:00:01.0"], "pci0000:00"), ("0000:05:00.0", 1, [], "pci0000:00")]
    for a, b in itertools.product(odd, odd):
        same("path_between", a, b)
    assert cpp_rules.path_between(odd[0], odd[1]) == "SYS"


def test_the_doctors_paths_are_the_engines(hosts):
    system = hosts["ib"]
    gpus, nics = system.gpus(), [system.pci_device(d.pci) for d in system.rdma_devices()]
    assert [topology.path_type(gpus[0], n) for n in nics] == ["PIX", "PHB", "PHB", "PHB", "SYS", "SYS", "SYS", "SYS"]


@pytest.mark.parametrize("level", ["LOC", "PIX", "pxb", " PHB ", "SYS", "0", "1", "2", "3", "4", "5", "6", "", "NVL", "P IX"])
def test_gdr_levels_parse_alike(level):
    same("parse_path", level)


def test_gdr_decisions_agree(hosts):
    system = hosts["roce"]
    paths = {topology.path_type(g, system.pci_device(d.pci)) for g in system.gpus() for d in system.rdma_devices()}
    assert paths == {"PIX", "PHB", "SYS"}
    modes = set()
    for path in sorted(paths) + ["LOC", "PXB", "", "bogus"]:
        for level in ["LOC", "PIX", "PXB", "PHB", "SYS", "0", "2", "5", "", "x"]:
            for dmabuf, peermem in itertools.product((False, True), repeat=2):
                d = same("decide_gdr", "GPU 3", "mlx5_3", path, level, dmabuf, peermem)
                modes.add((d["mode"], d["within_level"]))
    assert modes == {("dmabuf", True), ("peermem", True), ("staged", True), ("staged", False)}


GID_RANGES = ["", "10.20.0.0/16", "10.20.1.0/24", "10.99.0.0/16", "10.20.0.5", "10.20.0.0/0", "10.20.0.0/abc",
              "10.20.0.0/40", "bogus/8", "fe80::/10"]


def test_gid_choice_agrees_on_every_port(hosts):
    picked = set()
    for name, system in hosts.items():
        for dev in system.rdma_devices():
            for port in dev.ports:
                table = topology.gid_table(port)
                for idx, version, family, rng in itertools.product((-1, 0, 1, 2, 3, 4, 9), (1, 2),
                                                                    ("AF_INET", "AF_INET6"), GID_RANGES):
                    i, _ = same("pick_gid", table, idx, version, family, rng, f"{dev.name} port {port.num}")
                    picked.add((name, idx, version, family, rng, i))
    # The RoCE ports' rule: index 3 (RoCE v2, IPv4-mapped) by default, nothing inside another subnet.
    assert ("roce", -1, 2, "AF_INET", "", 3) in picked
    assert ("roce", -1, 2, "AF_INET", "10.99.0.0/16", -1) in picked
    assert ("roce", -1, 1, "AF_INET", "", 2) in picked


def test_gid_choice_agrees_on_tables_sysfs_does_not_hold():
    v4 = fake_hosts._gid_v4
    tables = {
        "link-local only": [Gid(0, "fe80:0000:0000:0000:0a00:00ff:fe00:0001", "IB/RoCE v1", "ens0"),
                            Gid(1, "fe80:0000:0000:0000:0a00:00ff:fe00:0001", "RoCE v2", "ens0")],
        "IPv6 only": [Gid(0, "fe80:0000:0000:0000:0a00:00ff:fe00:0001", "RoCE v2", "ens0"),
                      Gid(1, "fd00:0000:0000:0000:0000:0000:0000:0005", "RoCE v2", "ens0")],
        "two subnets": [Gid(2, v4("192.168.7.9"), "RoCE v2", "ens0"), Gid(5, v4("10.20.3.4"), "RoCE v2", "ens0"),
                        Gid(6, v4("10.20.3.4"), "", "ens0")],
        "empty": [],
    }
    for gids in tables.values():
        table = topology.gid_table(Port(1, "ACTIVE", "LinkUp", "Ethernet", "", gids))
        for idx, version, family, rng in itertools.product((-1, 0, 1, 2, 5, 6), (1, 2), ("AF_INET", "AF_INET6"),
                                                            GID_RANGES):
            same("pick_gid", table, idx, version, family, rng, "rxe0 port 1")


SPECS = ["", "eth", "eth0", "=eth0", "=eth", "^eth", "^=eth0", "docker0", "^docker,lo", "ens", "ens1,ens3", "^ens",
         "lo", "ib9", ",", "^", "=", "e,d", "ens0,eth0"]


def test_interface_matching_agrees(hosts):
    for system in hosts.values():
        ifaces = system.interfaces()
        names = [i.name for i in ifaces] + ["", "docker", "eth", "enp0s3", "lo0"]
        for name, spec in itertools.product(names, SPECS):
            same("match_spec", name, spec)
        addrs = topology.interface_addrs(ifaces)
        assert ("eth0", True, False, "10.10.0.5") in addrs
        for spec in SPECS:
            same("choose_interfaces", addrs, spec)
    assert cpp_rules.choose_interfaces(topology.interface_addrs(hosts["ib"].interfaces()), "") == [("eth0", "10.10.0.5")]


def test_interface_choice_agrees_where_little_is_up():
    lo = Iface("lo", 1, True, True, 65536, ["127.0.0.1"])
    cases = [
        [lo],
        [lo, Iface("eth0", 2, False, False, 1500, ["10.0.0.1"])],
        [lo, Iface("docker0", 3, True, False, 1500, ["172.17.0.1"])],
        [Iface("eth0", 2, True, False, 1500, ["10.0.0.1", "10.0.1.1"]), Iface("eth1", 3, True, False, 9000, ["10.1.0.1"])],
        [],
    ]
    for ifaces in cases:
        for spec in SPECS:
            same("choose_interfaces", topology.interface_addrs(ifaces), spec)
    same("choose_interfaces", [("eth0", True, False, "not an address")], "")


def test_memory_figures_agree():
    sizes = [0, 1, 4095, 4096, 4097, 1 << 20, (4 << 20) + 5, 512 << 20, (512 << 20) + 1, 64 << 30]
    for nslots, fifo, ring in itertools.product((1, 2, 4, 16, 64, 128), sizes, sizes):
        same("shm_segment_bytes", nslots, fifo, ring)
    for b in sizes:
        same("verbs_ring_bytes", b)
        same("verbs_connection_bytes", b)
        same("verbs_connection_bytes", b, True)
    assert cpp_rules.verbs_ring_bytes(1 << 30) == 512 << 20
    assert cpp_rules.verbs_connection_bytes(4 << 20) == 8 << 20
    assert cpp_rules.verbs_connection_bytes(4 << 20, True) == 9 << 20


@pytest.mark.parametrize("variant", [
    {}, {"roce": True}, {"peermem": False}, {"shm": "65536k", "memlock": "65536"}, {"gpus": 2, "roce": True},
])
@pytest.mark.parametrize("env", [
    {}, {"NCCL_SOCKET_IFNAME": "docker0"}, {"RAILCC_SOCKET_IFNAME": "ib9"}, {"NCCL_IB_GID_INDEX": "0"},
    {"RAILCC_NET_GDR_LEVEL": "PHB"}, {"NCCL_NET_GDR_LEVEL": "loc"}, {"RAILCC_IB_ADDR_RANGE": "10.99.0.0/16"},
    {"RAILCC_BUFFSIZE": str(1 << 30), "WORLD_SIZE": "32"},
])
def test_the_whole_report_is_the_same_with_either(tmp_path, monkeypatch, variant, env):
    """The doctor on a fake host with railcc._C.rules and with the test's reference rules: every
    row and fact alike, but the one that says which was used."""
    import railcc.doctor as doctor

    root = fake_hosts.dgx(tmp_path, **variant)
    for k in list(__import__("os").environ):
        if k.startswith(("RAILCC_", "NCCL_")) or k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "LOCAL_RANK", "RANK"):
            monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    reports = []
    for side, why in ((cpp_rules, "railcc._C"), (py_rules, "the test's reference")):
        monkeypatch.setattr(topology, "_rules", side)
        monkeypatch.setattr(topology, "_rules_why", why)
        r = doctor.collect(root=root)
        r["facts"].pop("host rules")
        reports.append(r)
    assert reports[0] == reports[1]
