"""railcc doctor inside the Soft-RoCE VM (vm.py): real rxe devices, real GID tables, real
verbs probes (active MTU, dma-buf registration). One boot: the VM emulates its CPU, and
importing torch there takes about a minute and a half."""

import json
import os
import sys

import pytest

from vm import run_in_vm, vm_available

_OK, _WHY = vm_available()
DOCTOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "railcc", "doctor")
pytestmark = [pytest.mark.rdma, pytest.mark.timeout(600), pytest.mark.skipif(not _OK, reason=f"no Soft-RoCE VM: {_WHY}")]


def test_doctor_reads_real_rxe_devices(tmp_path):
    script = (f"cd /tmp && {sys.executable} -m railcc doctor --json --local-ranks 2 --world 4 > $OUT/doctor.json; "
              "echo $? > $OUT/rc; "
              f"{sys.executable} -c \"import sys; sys.path.insert(0, '{DOCTOR}'); import system, topology\n"
              "for d in system.System('/').rdma_devices():\n"
              "    g, why = topology.pick_gid(d.ports[0], {})\n"
              "    print(d.name, g.index, g.ipv4)\" > $OUT/auto.txt")
    res = run_in_vm(script, tmp_path, rails=2, timeout=480, env={"NCCL_IB_GID_INDEX": "0"})
    assert res.rc == 0, res.log + res.console[-3000:]
    with open(os.path.join(res.out_dir, "doctor.json")) as f:
        report = json.load(f)
    by = {c["check"]: c for c in report["checks"]}
    assert report["host"] == "railcc-vm"
    assert open(os.path.join(res.out_dir, "rc")).read().strip() == "0"  # nothing fails
    for r, ip in ((0, "10.77.0.1"), (1, "10.78.0.1")):
        port = by[f"rdma rxe{r}/1"]
        assert port["found"].startswith("ACTIVE, LinkUp, Ethernet"), port
        # ibv_query_port answered: a 1500-byte netdev gives RoCE MTU 1024.
        assert "MTU 1024," in port["found"] and f"netdev vrail{r}" in port["found"], port
        # NCCL_IB_GID_INDEX=0 forces rxe's index 0, which is link-local: warned, with the index to use.
        assert port["verdict"] == "warn" and "link-local" in port["found"], port
        assert port["fix"] == "unset the variable, or set it to 1", port
        assert report["facts"][f"gid rxe{r}/1 index"] == "0"
    # The dma-buf probe ran against the real devices: rxe does not take dma-buf.
    assert "does not take dma-buf" in by["dma-buf"]["found"], by["dma-buf"]
    assert by["memlock"]["verdict"] == "ok" and by["memlock"]["found"].startswith("unlimited")
    assert report["facts"]["rdma ports active"] == "2"
    # Without the variable, the doctor's reader and rule (no torch needed) pick index 1 of the
    # same real table: RoCE v2 over the IPv4 address.
    with open(os.path.join(res.out_dir, "auto.txt")) as f:
        assert f.read().split() == ["rxe0", "1", "10.77.0.1", "rxe1", "1", "10.78.0.1"], res.log
