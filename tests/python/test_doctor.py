"""railcc doctor: the real command against fake host trees (fake_hosts.py, one per failure
the issue lists), on this machine for real, and across two network-namespace "hosts" under
torchrun with one variable set differently."""

import json
import os
import subprocess
import sys

import pytest

import fake_hosts
from netns import netns_available, netns_unavailable_reason, two_hosts

pytestmark = pytest.mark.timeout(120)
HERE = os.path.dirname(os.path.abspath(__file__))


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAILCC_", "NCCL_"))}
    for k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "LOCAL_RANK", "RANK"):
        env.pop(k, None)
    env.update(extra)
    return env


def doctor(*args, root=None, **env):
    argv = [sys.executable, "-m", "railcc", "doctor", "--json", *args] + (["--root", str(root)] if root else [])
    p = subprocess.run(argv, env=_clean_env(**env), capture_output=True, text=True, timeout=60, cwd=HERE)
    assert p.returncode in (0, 1), p.stderr
    report = json.loads(p.stdout)
    assert p.returncode == (1 if report["failed"] else 0), p.stdout
    report["rc"] = p.returncode
    report["by"] = {c["check"]: c for c in report["checks"]}
    return report


def verdicts(report, prefix):
    return {c["check"]: c["verdict"] for c in report["checks"] if c["check"].startswith(prefix)}


def test_healthy_dgx_node_passes(tmp_path):
    r = doctor(root=fake_hosts.dgx(tmp_path))
    bad = [c for c in r["checks"] if c["verdict"] in ("fail", "warn")]
    assert r["rc"] == 0 and not bad, bad
    assert set(verdicts(r, "gdr gpu").values()) == {"ok"} and len(verdicts(r, "gdr gpu")) == 8
    assert "PIX" in r["by"]["gdr gpu0"]["found"] and "mlx5_0" in r["by"]["gdr gpu0"]["found"]
    assert r["by"]["network"]["found"].startswith("eth0 (10.10.0.5")  # not docker0, not lo
    assert r["by"]["numa"]["verdict"] == "ok"
    assert r["facts"]["rdma ports active"] == "8"


def test_missing_peermem_fails_with_the_modprobe(tmp_path):
    r = doctor(root=fake_hosts.dgx(tmp_path, peermem=False))
    assert r["rc"] == 1
    assert r["by"]["nvidia_peermem"]["verdict"] == "fail"
    assert "modprobe nvidia_peermem" in r["by"]["nvidia_peermem"]["fix"]
    assert set(verdicts(r, "gdr gpu").values()) == {"fail"}


def test_iommu_translation_and_acs_redirect_are_named(tmp_path):
    r = doctor(root=fake_hosts.dgx(tmp_path, iommu=True, acs=True))
    iommu, acs = r["by"]["iommu"], r["by"]["pcie acs"]
    assert iommu["verdict"] == "warn" and "DMA-FQ" in iommu["found"] and "iommu=pt" in iommu["fix"]
    assert acs["verdict"] == "warn" and "ReqRedir+CmpltRedir" in acs["found"]
    # Root ports and the switches' downstream ports have ACS on; the upstream ports have none.
    assert "setpci -s 0000:11:00.0 ECAP_ACS+0x6.w=0000" in acs["fix"]
    assert "0000:10:00.0 " not in acs["fix"]


def test_container_default_dev_shm_fails_for_eight_ranks(tmp_path):
    r = doctor(root=fake_hosts.dgx(tmp_path, shm="65536k"))
    shm = r["by"]["shm"]
    assert r["rc"] == 1 and shm["verdict"] == "fail"
    assert "/dev/shm 64 MiB" in shm["found"] and "8 local ranks" in shm["found"]
    assert "--shm-size=" in shm["fix"]
    # Two local ranks fit in 64 MiB with the default FIFO size.
    assert doctor("--local-ranks", "2", root=tmp_path)["by"]["shm"]["verdict"] in ("ok", "warn")


def test_small_memlock_fails(tmp_path):
    r = doctor("--world", "16", root=fake_hosts.dgx(tmp_path, memlock="65536"))
    m = r["by"]["memlock"]
    assert r["rc"] == 1 and m["verdict"] == "fail" and "64 KiB" in m["found"] and "8 remote peer(s)" in m["found"]
    assert "ulimit -l unlimited" in m["fix"] and "memlock=-1:-1" in m["fix"]


def test_socket_ifname_naming_docker0_is_flagged(tmp_path):
    r = doctor(root=fake_hosts.dgx(tmp_path), NCCL_SOCKET_IFNAME="docker0")
    net = r["by"]["network"]
    assert net["verdict"] == "warn" and net["found"].startswith("docker0") and "bridge" in net["found"]
    assert net["fix"] == "NCCL_SOCKET_IFNAME=eth0"
    assert r["by"]["env NCCL_SOCKET_IFNAME"]["verdict"] == "ok"
    nomatch = doctor(root=tmp_path, RAILCC_SOCKET_IFNAME="ib9")["by"]["network"]
    assert nomatch["verdict"] == "fail" and "matches no up IPv4 interface" in nomatch["found"]
    assert "eth0" in nomatch["found"] and "docker0" in nomatch["found"]


def test_roce_gid_table_with_link_local_index_0(tmp_path):
    root = fake_hosts.dgx(tmp_path, roce=True)
    port = doctor(root=root)["by"]["rdma mlx5_0/1"]
    assert port["verdict"] == "ok"
    assert "GID index 3 (RoCE v2" in port["found"] and "= 10.20.0.5): picked: RoCE v2, IPv4" in port["found"]
    assert "link-local index 0,1 skipped" in port["found"]
    assert "MTU 4096 (from ens0's 4200)" in port["found"]
    forced = doctor(root=root, NCCL_IB_GID_INDEX="0")["by"]["rdma mlx5_0/1"]
    assert forced["verdict"] == "warn" and "link-local" in forced["found"]
    assert forced["fix"] == "unset the variable, or set it to 3"


def test_process_on_the_far_socket_fails_numa(tmp_path):
    r = doctor(root=fake_hosts.dgx(tmp_path, cpus="56-111"), LOCAL_RANK="0")
    numa = r["by"]["numa"]
    assert numa["verdict"] == "fail" and "NUMA node 0" in numa["found"] and "--cpunodebind=0" in numa["fix"]
    assert doctor(root=tmp_path, LOCAL_RANK="5")["by"]["numa"]["verdict"] == "ok"  # GPU 5 is on node 1


def test_environment_variables_are_judged(tmp_path):
    r = doctor(root=fake_hosts.dgx(tmp_path), RAILCC_BUFSIZE="1", RAILCC_SPIN_US="-3", NCCL_IB_HCA="mlx5",
               NCCL_PXN_DISABLE="1", RAILCC_DEBUG="INFO", NCCL_DEBUG="WARN")
    by = r["by"]
    assert by["env RAILCC_BUFSIZE"]["verdict"] == "fail" and "RAILCC_BUFFSIZE" in by["env RAILCC_BUFSIZE"]["fix"]
    assert by["env RAILCC_SPIN_US"]["verdict"] == "fail"
    assert by["env NCCL_IB_HCA"]["verdict"] == "ok" and "RDMA devices and ports" in by["env NCCL_IB_HCA"]["found"]
    assert by["env NCCL_PXN_DISABLE"]["verdict"] == "warn" and "does not act on" in by["env NCCL_PXN_DISABLE"]["found"]
    assert by["env RAILCC_DEBUG"]["verdict"] == "ok"
    assert by["env NCCL_DEBUG"]["verdict"] == "warn" and "overridden by RAILCC_DEBUG" in by["env NCCL_DEBUG"]["found"]


def test_this_machine_for_real():
    """No GPU and no RDMA device here: the table says so, and nothing fails."""
    p = subprocess.run([sys.executable, "-m", "railcc", "doctor"], env=_clean_env(), capture_output=True,
                       text=True, timeout=60, cwd=HERE)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln and not ln.startswith(" ")}
    assert "N/A" in lines["gpu"] and "no NVIDIA GPU" in lines["gpu"]
    assert "N/A" in lines["rdma"] and "no RDMA device" in lines["rdma"]
    assert "OK" in lines["network"]
    assert p.stdout.rstrip().splitlines()[-1].startswith("0 failed")


def test_topology_row_names_where_the_engine_reads_the_machine(tmp_path):
    """hwloc here; with hwloc not loadable (as on GPU images without it) sysfs, and why."""
    r = doctor()
    assert r["by"]["topology"]["verdict"] == "ok", r["by"]["topology"]
    assert "this machine (hwloc 2." in r["by"]["topology"]["found"]
    r = doctor(RAILCC_HWLOC_LIB="/nonexistent/libhwloc.so.15")
    row = r["by"]["topology"]
    assert row["verdict"] == "ok", row
    assert "this machine (sysfs; hwloc not loaded: cannot load /nonexistent/libhwloc.so.15" in row["found"]
    assert "libhwloc15" in row["fix"]
    # A fake host's tree is the doctor's alone: the engine's topology is not asked for.
    assert doctor(root=fake_hosts.dgx(tmp_path))["by"]["topology"]["verdict"] == "n/a"


def test_bad_arguments_are_refused():
    for args, msg in ((["--root", "/nonexistent-root"], "is not a directory"), (["--local-ranks", "0"], "from 1 to 4096"),
                      (["--all-ranks"], "needs torchrun's")):
        p = subprocess.run([sys.executable, "-m", "railcc", "doctor", *args], env=_clean_env(), capture_output=True,
                           text=True, timeout=60, cwd=HERE)
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)


@pytest.mark.skipif(not netns_available(), reason=f"network namespaces unavailable: {netns_unavailable_reason()}")
def test_all_ranks_under_torchrun_names_what_differs_between_hosts(tmp_path):
    with two_hosts(prefix="rcd") as h:
        port = 29811
        procs = []
        for node in (0, 1):
            env = _clean_env(OMP_NUM_THREADS="1", RAILCC_SOCKET_IFNAME=h.interfaces[node])
            if node == 1:
                env["RAILCC_BUFFSIZE"] = "8388608"  # the difference that hangs mixed clusters
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{h.addr_a}:{port}",
                    "--rdzv-id", "doc", "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                    "--local-addr", h.addresses[node], "--max-restarts", "0", "--monitor-interval", "0.2",
                    "-m", "railcc", "doctor", "--all-ranks", "--timeout", "60"]
            out = open(tmp_path / f"node{node}.log", "w+")
            procs.append((h.popen(h.names[node], argv, own_hostname=True, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, cwd=HERE), out))
        try:
            codes = [p.wait(timeout=100) for p, _ in procs]
        finally:
            h.kill_all()
        logs = []
        for _, out in procs:
            out.seek(0)
            logs.append(out.read())
            out.close()
    text = "\n".join(logs)
    assert "2 ranks on 2 host(s)" in text and "fact(s) differ between ranks" in text, text
    diff = [ln.split() for ln in text.splitlines() if ln.startswith("  env RAILCC_BUFFSIZE ")]
    assert sorted(d[2] for d in diff) == ["(absent)", "8388608"], text
    host_of = {d[2]: d[4] for d in diff}
    assert host_of == {"(absent)": h.names[0], "8388608": h.names[1]}, text  # hosts named by their hostname
    assert "rank 1 on " + h.names[1] in text
    assert codes == [1, 1], (codes, text[-3000:])  # a difference fails the job, on every node


def rk_mapped_segments(rank, n):
    # Sizes of the railcc segments this rank maps (its own and its peers'; names already unlinked).
    sizes = []
    for line in open("/proc/self/maps"):
        if "/railcc-" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            sizes.append(hi - lo)
    return sizes


@pytest.mark.parametrize("n", [2, 4])
def test_shm_need_matches_the_segments_a_real_group_maps(n):
    # What the shm check counts per rank is what the transport really maps.
    import harness
    from railcc.doctor.checks import shm_bytes_per_rank

    buff = 4 << 20
    want = shm_bytes_per_rank(n, buff, buff)
    pool = harness.RankPool(n)
    try:
        got = pool.run(rk_mapped_segments, timeout=60)
    finally:
        pool.kill()
    for sizes in got:
        assert sorted(set(sizes)) == [want] and len(sizes) == n, (sizes, want)


# ---------------------------------------------------------------------------------------------- careless input
# A careless argument, torchrun variable or rank report is refused with one line naming it and what was expected:
# no traceback, no wait for a timeout. The command runs with a cap on its address space, so a value it would
# allocate for fails fast instead of eating the machine.

AS_LIMIT = 3 << 30


def _cap_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def doctor_capped(*args, **env):
    e = _clean_env(**env)
    for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        if k not in env:
            e.pop(k, None)
    return subprocess.run([sys.executable, "-m", "railcc", "doctor", *args], env=e, capture_output=True, text=True,
                          timeout=90, cwd=HERE, preexec_fn=_cap_memory)


def assert_one_line_error(p, code, *words):
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    last = (p.stderr.strip().splitlines() or [""])[-1]
    for w in words:
        assert w in last, (w, p.stderr)


CARELESS = [
    (["--local-ranks", "1000000000000"], {}, ["--local-ranks", "from 1 to 4096"]),
    (["--local-ranks", "-1"], {}, ["--local-ranks"]),
    (["--local-ranks", "eight"], {}, ["--local-ranks"]),
    (["--world", "0"], {}, ["--world", "from 1 to 1048576"]),
    (["--world", str(10 ** 30)], {}, ["--world"]),
    (["--timeout", "nan"], {}, ["--timeout"]),
    (["--timeout", "-1"], {}, ["--timeout"]),
    (["--timeout", "inf"], {}, ["--timeout"]),
    ([], {"LOCAL_RANK": "abc"}, ["LOCAL_RANK", "from 0 to 4095"]),
    ([], {"LOCAL_RANK": "-1"}, ["LOCAL_RANK"]),
    ([], {"LOCAL_WORLD_SIZE": "0"}, ["LOCAL_WORLD_SIZE", "from 1 to 4096"]),
    ([], {"LOCAL_WORLD_SIZE": "\u00b2"}, ["LOCAL_WORLD_SIZE"]),
    ([], {"WORLD_SIZE": "99999999999999999999"}, ["WORLD_SIZE"]),
    ([], {"RANK": "x"}, ["RANK"]),
]


@pytest.mark.parametrize("args,env,words", CARELESS,
                         ids=[" ".join(a) + " ".join(f"{k}={v}" for k, v in e.items()) for a, e, _ in CARELESS])
def test_careless_arguments_and_variables_are_refused_at_once(args, env, words):
    assert_one_line_error(doctor_capped(*args, **env), 2, *words)


def _agent_store():
    """A store this test serves, as torchrun's agent does: the command connects to it as a client."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)


def _torchrun_env(port, **extra):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "true", "TORCHELASTIC_RUN_ID": "careless"}
    env.update(extra)
    return env


@pytest.mark.parametrize("var,value,words", [
    ("MASTER_PORT", "abc", ["MASTER_PORT", "from 1 to 65535"]),
    ("MASTER_PORT", "0", ["MASTER_PORT"]),
    ("MASTER_PORT", "70000", ["MASTER_PORT"]),
    ("WORLD_SIZE", "two", ["WORLD_SIZE"]),
    ("RANK", "2", ["RANK=2", "WORLD_SIZE=2"]),
    ("LOCAL_RANK", "1", ["LOCAL_RANK=1", "LOCAL_WORLD_SIZE=1"]),
])
def test_all_ranks_names_a_careless_torchrun_variable(var, value, words):
    p = doctor_capped("--all-ranks", "--timeout", "5", **_torchrun_env(1, **{var: value}))
    assert_one_line_error(p, 2, *words)


def _report(**change):
    r = {"host": "evil", "rank": 1, "checks": [{"check": "gpu", "verdict": "ok", "found": "", "fix": ""}],
         "facts": {"gpus": "0"}, "failed": 0, "warnings": 0}
    r.update(change)
    return json.dumps(r).encode()


MALFORMED = [
    ("not-json", b"not json", ["rank 1's report", "not a doctor report"]),
    ("nested", b"[" * 100_000 + b"]" * 100_000, ["rank 1's report", "nested too deeply"]),
    ("not-utf8", b"\xff\xfe", ["rank 1's report", "UTF-8"]),
    ("too-big", b" " * (2 << 20), ["rank 1's report", "bytes"]),
    ("list", b"[1, 2]", ["rank 1's report", "JSON object"]),
    ("facts-7", _report(facts=7), ["rank 1's report", "facts"]),
    ("fact-list", _report(facts={"gpus": [1]}), ["rank 1's report", "facts[\"gpus\"]"]),
    ("checks-str", _report(checks="all ok"), ["rank 1's report", "checks"]),
    ("failed-str", _report(failed="0"), ["rank 1's report", "failed"]),
    ("other-rank", _report(rank=5), ["rank 1's report", "rank"]),
]


@pytest.mark.parametrize("raw,words", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_all_ranks_names_a_malformed_report_and_still_gives_a_verdict(raw, words):
    store = _agent_store()
    store.set("railcc-doctor/careless/1", raw)
    p = doctor_capped("--all-ranks", "--timeout", "10", **_torchrun_env(store.port))
    assert_one_line_error(p, 1, *words)
    assert store.get("railcc-doctor/careless/verdict") == b"1"  # rank 1 is not left waiting for its timeout


def test_all_ranks_accepts_a_well_formed_report():
    store = _agent_store()
    store.set("railcc-doctor/careless/1", _report())
    p = doctor_capped("--all-ranks", "--timeout", "10", **_torchrun_env(store.port))
    assert "Traceback" not in p.stderr and p.returncode in (0, 1), p.stderr
    assert "2 ranks on 2 host(s)" in p.stdout, p.stdout
    assert store.get("railcc-doctor/careless/verdict") == str(p.returncode).encode()
