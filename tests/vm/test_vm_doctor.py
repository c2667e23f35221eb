"""railcc doctor inside the Soft-RoCE VM (vm.py): real rxe devices, real GID tables, real
verbs probes (active MTU, dma-buf registration). It runs in the boot the verbs tests use (the
`vm` fixture, conftest.py; verbs_job.py runs the doctor in a child of its torch process): the
VM emulates its CPU, and a boot and an import of torch there take minutes."""

import json
import os

import pytest

from vm import vm_available

_OK, _WHY = vm_available()
pytestmark = [pytest.mark.rdma, pytest.mark.timeout(1200), pytest.mark.skipif(not _OK, reason=f"no Soft-RoCE VM: {_WHY}")]


def test_doctor_reads_real_rxe_devices(vm):
    res = vm
    err = os.path.join(res.out_dir, "doctor.err")
    assert not os.path.exists(err), open(err).read()
    with open(os.path.join(res.out_dir, "doctor.json")) as f:
        report = json.load(f)
    by = {c["check"]: c for c in report["checks"]}
    assert report["host"] == "railcc-vm"
    assert open(os.path.join(res.out_dir, "doctor.rc")).read().strip() == "0"  # nothing fails
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
