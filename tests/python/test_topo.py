"""`railcc topo`: the GPU-NIC matrix, rails and GPUDirect verdicts, on this machine and on the
hwloc XML machines in tests/data/topo (see make_topologies.py there)."""

import json
import os
import subprocess
import sys

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
