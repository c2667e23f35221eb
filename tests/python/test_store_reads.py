"""How railcc reads the c10d store (csrc/c10d_store.cpp): a read of a few keys is one compare_set
that expects a value no record holds, answered with the stored value or, for a missing key, with
that expected value and nothing stored. These tests hold torch's stores to that, and run a job
over a store written in Python without compare_set, which railcc reads by check and get instead."""

import datetime
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch.distributed as dist

ABSENT = b"\0railcc: no such key\0"  # the expected value railcc's reads send (c10d_store.cpp)


def _stores(tmp):
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    yield "TCPStore", tcp
    yield "TCPStore (no libuv)", dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10),
                                              use_libuv=False)
    yield "PrefixStore over TCPStore", dist.PrefixStore("railcc/", tcp)
    yield "FileStore", dist.FileStore(os.path.join(tmp, "file_store"), 1)
    yield "HashStore", dist.HashStore()


@pytest.mark.timeout(60)
def test_a_read_of_a_missing_key_answers_the_expected_value_and_stores_nothing():
    with tempfile.TemporaryDirectory() as tmp:
        for name, store in _stores(tmp):
            assert store.compare_set("missing", ABSENT, ABSENT) == ABSENT, name
            assert not store.check(["missing"]), f"{name}: a read created the key"
            store.set("there", b"h0|vm\n")
            assert store.compare_set("there", ABSENT, ABSENT) == b"h0|vm\n", name
            assert store.get("there") == b"h0|vm\n", f"{name}: a read changed the value"
            store.set("empty", b"")
            assert store.compare_set("empty", ABSENT, ABSENT) == b"", f"{name}: an empty value reads as missing"


_PY_STORE_RANK = r"""
import datetime, json, sys
import torch, torch.distributed as dist
import railcc

class PlainStore(dist.Store):
    # set/get/add/check/wait over a FileStore: no compare_set, no multi_get
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, {}
    def _count(self, what):
        self.calls[what] = self.calls.get(what, 0) + 1
    def set(self, k, v):
        self._count("set"); self.inner.set(k, v)
    def get(self, k):
        self._count("get"); return self.inner.get(k)
    def add(self, k, d):
        self._count("add"); return self.inner.add(k, d)
    def check(self, keys):
        self._count("check"); return self.inner.check(keys)
    def wait(self, keys, timeout=None):
        self._count("wait"); return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

rank, world, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = PlainStore(dist.FileStore(path, world))
dist.init_process_group("railcc", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
x = torch.arange(1001, dtype=torch.float64) * (rank + 1)
dist.all_reduce(x)
expected = torch.arange(1001, dtype=torch.float64) * sum(r + 1 for r in range(world))
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"exact": bool(torch.equal(x, expected)), "calls": store.calls}))
"""


@pytest.mark.timeout(120)
def test_a_job_over_a_python_store_without_compare_set_reads_by_check_and_get(tmp_path):
    world = 3  # odd, each rank a host of its own: set-up's tree and the first op's endpoints
    procs = [subprocess.Popen([sys.executable, "-c", _PY_STORE_RANK, str(r), str(world), str(tmp_path / "store")],
                              env=dict(os.environ, RAILCC_HOST_ID=f"h{r}"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=100)
        assert p.returncode == 0, f"rank {r}: {err[-3000:]}"
        got = json.loads(out.strip().splitlines()[-1])
        assert got["exact"], f"rank {r}: {got}"
        assert got["calls"].get("check", 0) > 0 and got["calls"].get("get", 0) > 0, f"rank {r}: {got}"
