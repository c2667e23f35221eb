"""`railcc topo`: the GPU-NIC matrix, rails and GPUDirect verdicts, on this machine and on the
hwloc XML machines in tests/data/topo (see make_topologies.py there)."""

import json
import os
import subprocess
import sys
import time

import pytest

TOPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "topo")


def topo(*args, env=None):
    e = dict(os.environ)
    for k in ("RAILCC_TOPO_FILE", "RAILCC_TOPO_DUMP_FILE", "NCCL_NET_GDR_LEVEL", "RAILCC_NET_GDR_LEVEL"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "railcc", "topo", *args], capture_output=True, text=True, env=e,
                          timeout=120)


@pytest.mark.timeout(180)
def test_this_machine_says_it_has_no_gpu_and_still_shows_numa_and_interfaces():
    r = topo()
    assert r.returncode == 0, r.stderr
    out = r.stdout
    print("\n" + out)
    assert "this machine (hwloc" in out
    assert "NUMA node" in out
    assert "GPUs: none found" in out
    assert "local rank 0: NUMA node" in out
    # Whatever interfaces sit on PCI here are listed with their bus ids.
    for line in out.splitlines():
        if ": interface," in line:
            assert line.split(", ")[1].count(":") == 2, line


@pytest.mark.timeout(180)
def test_without_hwloc_the_machine_comes_from_sysfs_and_says_why():
    """The GPU images may lack hwloc: the same machine, read from sysfs, named as such."""
    with_hwloc = topo("--json")
    r = topo("--json", env={"RAILCC_HWLOC_LIB": "/nonexistent/libhwloc.so.15"})
    assert with_hwloc.returncode == 0 and r.returncode == 0, with_hwloc.stderr + r.stderr
    a, b = json.loads(with_hwloc.stdout), json.loads(r.stdout)
    assert a["method"] == "hwloc" and b["method"] == "sysfs"
    assert b["source"].startswith("this machine (sysfs; hwloc not loaded: cannot load /nonexistent/libhwloc.so.15")
    assert b["numa_nodes"] == a["numa_nodes"]
    assert [(n["name"], n["bus_id"], n["numa"]) for n in b["nics"]] == [(n["name"], n["bus_id"], n["numa"]) for n in a["nics"]]
    assert b["rails"] == a["rails"]
    # An XML file cannot be read without hwloc: one line saying so, exit 1.
    r = topo("--topo-file", os.path.join(TOPO, "dgx_h100.xml"), env={"RAILCC_HWLOC_LIB": "/nonexistent/x.so"})
    assert r.returncode != 0 and "needs hwloc to be read" in r.stderr, r.stderr


@pytest.mark.timeout(180)
def test_dgx_like_file_gives_each_gpu_the_nic_on_its_switch(tmp_path):
    dump = tmp_path / "dump.xml"
    r = topo("--topo-file", os.path.join(TOPO, "dgx_h100.xml"), "--json", "--dump", str(dump))
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)
    assert len(t["gpus"]) == 8 and len(t["nics"]) == 8
    assert [row[0] for row in t["paths"][:4]] == ["PIX", "PIX", "PHB", "PHB"]
    assert t["paths"][0][4] == "SYS"
    assert [r["nic"] for r in t["rails"]] == list(range(8))
    assert all(r["path"] == "PIX" and r["gdr"] for r in t["rails"])
    assert t["gdr_level"] == {"level": "PXB", "from": "default"}
    # The dump is hwloc XML that reads back to the same machine.
    r2 = topo("--topo-file", str(dump), "--json")
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["paths"] == t["paths"]


@pytest.mark.timeout(180)
def test_nics_on_the_other_socket_are_no_gpudirect_and_the_matrix_says_why():
    r = topo("--topo-file", os.path.join(TOPO, "nics_on_socket1.xml"), env={"NCCL_NET_GDR_LEVEL": "PHB"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    print("\n" + out)
    assert "GPUDirect RDMA within PHB (NCCL_NET_GDR_LEVEL)" in out
    assert "local rank 0: GPU 0000:13:00.0 -> mlx5_0 (rail 0, SYS); no GPUDirect RDMA (SYS is beyond PHB)" in out
    assert "local rank 4: GPU 0000:53:00.0 -> mlx5_0 (rail 0, PIX); GPUDirect RDMA" in out
    header = next(line for line in out.splitlines() if "mlx5_0" in line and "NUMA" in line)
    assert header.split() == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "NUMA"]
    assert out.splitlines()[out.splitlines().index(header) + 1].split() == ["GPU0", "SYS", "SYS", "SYS", "SYS", "0"]


@pytest.mark.timeout(180)
def test_bad_topology_files_are_one_line_errors(tmp_path):
    r = topo("--topo-file", str(tmp_path / "missing.xml"))
    assert r.returncode == 2 and "no such file" in r.stderr, r.stderr
    junk = tmp_path / "junk.xml"
    junk.write_text("this is not xml")
    r = topo("--topo-file", str(junk))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and str(junk) in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- careless input
# Every careless argument, variable or file is refused at once with one line naming it and what was expected: no
# traceback, no wait. The command runs with a cap on its address space, so a value it would allocate for fails
# fast instead of eating the machine.

AS_LIMIT = 3 << 30


def _cap_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def topo_capped(*args, env=None, timeout=60):
    e = dict(os.environ)
    for k in ("RAILCC_TOPO_FILE", "RAILCC_TOPO_DUMP_FILE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "railcc", "topo", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, preexec_fn=_cap_memory)


def assert_one_line_error(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = (r.stderr.strip().splitlines() or [""])[-1]
    for w in words:
        assert w in last, (w, r.stderr)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,words", [
    (["--local-ranks", "1000000000000"], ["--local-ranks", "1 to 4096"]),
    (["--local-ranks", "1e12"], ["--local-ranks", "1 to 4096"]),
    (["--local-ranks", "4097"], ["--local-ranks", "1 to 4096"]),
    (["--local-ranks", "-1"], ["--local-ranks", "1 to 4096"]),
    (["--local-ranks", "many"], ["--local-ranks", "1 to 4096"]),
    (["--timeout", "nan"], ["--timeout"]),
    (["--timeout", "-1"], ["--timeout"]),
    (["--timeout", "inf"], ["--timeout"]),
    (["--timeout", "1e300"], ["--timeout"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v[0].startswith("-") else None)
def test_careless_arguments_are_refused_at_once(args, words):
    assert_one_line_error(topo_capped(*args), 2, *words)


@pytest.mark.timeout(180)
def test_dump_to_a_path_that_cannot_be_written_is_one_line(tmp_path):
    xml = os.path.join(TOPO, "vm_flat.xml")
    target = tmp_path / "no-such-dir" / "dump.xml"
    assert_one_line_error(topo_capped("--topo-file", xml, "--dump", str(target)), 1, "--dump", str(target))
    r = topo_capped("--topo-file", xml, env={"RAILCC_TOPO_DUMP_FILE": str(target)})
    assert_one_line_error(r, 1, "RAILCC_TOPO_DUMP_FILE", str(target))
    fifo = tmp_path / "fifo.xml"
    os.mkfifo(fifo)  # nobody reads it: writing would wait for ever
    assert_one_line_error(topo_capped("--topo-file", xml, "--dump", str(fifo)), 1, "--dump", str(fifo))


@pytest.mark.timeout(180)
def test_topology_file_must_be_a_regular_file_of_sane_size(tmp_path):
    fifo = tmp_path / "fifo.xml"
    os.mkfifo(fifo)
    big = tmp_path / "big.xml"
    with open(big, "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse
    # Each kind once, through the variable and the flag in turn.
    for i, (path, why) in enumerate((("/dev/zero", "not a regular file"), (str(fifo), "not a regular file"),
                                     (str(big), "MiB"), (str(tmp_path), "not a regular file"))):
        if i % 2:
            assert_one_line_error(topo_capped("--topo-file", path), 2, f"--topo-file {path}", why)
        else:
            assert_one_line_error(topo_capped(env={"RAILCC_TOPO_FILE": path}), 2, f"RAILCC_TOPO_FILE={path}", why)


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("var,value,words", [
    ("MASTER_PORT", "abc", ["MASTER_PORT", "1 to 65535"]),
    ("MASTER_PORT", "70000", ["MASTER_PORT", "1 to 65535"]),
    ("WORLD_SIZE", "two", ["WORLD_SIZE"]),
    ("WORLD_SIZE", "0", ["WORLD_SIZE"]),
    ("RANK", "2", ["RANK", "WORLD_SIZE"]),
    ("LOCAL_RANK", "-1", ["LOCAL_RANK"]),
    ("LOCAL_WORLD_SIZE", "1000000000000", ["LOCAL_WORLD_SIZE", "1 to 4096"]),
])
def test_all_ranks_names_a_careless_torchrun_variable(var, value, words):
    r = topo_capped("--all-ranks", "--topo-file", os.path.join(TOPO, "vm_flat.xml"), "--timeout", "5",
                    env=_torchrun_env(1, **{var: value}))
    assert_one_line_error(r, 2, *words)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("line,words", [
    (b"host=evil;rank=1;nic=-;rail=abc;rails=1;0=-", ["rank 1", "rail"]),
    (b"\xff\xfe not text", ["rank 1", "UTF-8"]),
    (b"host=evil;rank=1;" + b"x" * (1 << 20), ["rank 1", "bytes"]),
], ids=["rail=abc", "not-utf8", "1MiB"])
def test_all_ranks_names_a_malformed_rail_line_and_still_gives_a_verdict(line, words):
    store = _agent_store()
    store.set("railcc-topo/careless/1", line)
    r = topo_capped("--all-ranks", "--topo-file", os.path.join(TOPO, "vm_flat.xml"), "--timeout", "10",
                    env=_torchrun_env(store.port))
    assert_one_line_error(r, 1, *words)
    assert store.get("railcc-topo/careless/verdict") == b"1"  # rank 1 is not left waiting for its timeout


def _share_files(d):
    return sorted(f for f in os.listdir(d) if f.startswith(f"railcc-topo-{os.getuid()}-") and not f.endswith(".lock"))


@pytest.mark.timeout(180)
def test_a_job_across_hosts_reads_the_topology_while_its_ranks_gather(tmp_path):
    """Ranks of a group larger than torchrun's LOCAL_WORLD_SIZE read the machine's topology while
    set-up waits for the other ranks' records: ranks 1 and 2 (fake hosts) leave the machine's
    shared discovery behind before rank 0 has even started. Where LOCAL_WORLD_SIZE says one host
    could hold the group, nothing is read until the placement shows other hosts."""
    import harness

    if "this machine (hwloc" not in topo().stdout:
        pytest.skip("hwloc does not load here: no shared discovery to watch")
    for case, per_host in (("across", "1"), ("maybe-one-host", "3")):
        share = tmp_path / case
        share.mkdir()
        store = str(tmp_path / f"store-{case}")

        def env(r):
            return {"TMPDIR": str(share), "RAILCC_HOST_ID": f"h{r}", "LOCAL_WORLD_SIZE": per_host,
                    "RAILCC_SOCKET_IFNAME": "lo", "RAILCC_INIT_TIMEOUT": "60"}

        ranks = [harness.spawn_worker(r, 3, store, env(r), args=("--ops", "1")) for r in (1, 2)]
        try:
            deadline = time.monotonic() + (60 if per_host == "1" else 5)
            while not _share_files(share) and time.monotonic() < deadline:
                time.sleep(0.05)
            before = _share_files(share)
            ranks.append(harness.spawn_worker(0, 3, store, env(0), args=("--ops", "1")))
            results = [harness.worker_result(p, 90) for p in ranks]
        finally:
            for p in ranks:  # none left running when a result never came
                p.kill()
        for res, err in results:
            assert res["ok"], (res, err[-2000:])
        after = _share_files(share)
        if per_host == "1":
            assert before, "no shared topology before rank 0 started: ranks 1 and 2 did not read it early"
        else:
            assert not before, f"{before}: read early though LOCAL_WORLD_SIZE=3 lets one host hold the group"
        assert after, "the job across fake hosts left no shared topology"
