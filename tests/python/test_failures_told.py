"""Failures told at once, with their reason, to every rank that would otherwise wait: a rank
that fails its own init after its peers finished theirs (its peers' first collective names it
and says why, within seconds, not after torch's 30-minute op timeout); and told right: the
ranks railcc.failed_ranks() names for a shrink are only those still silent. Real processes,
real stores, real signals."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import harness


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting,words", [
    ({"RAILCC_SOCKET_IFNAME": "nosuch0"}, "'nosuch0' matches no up IPv4 interface"),
    ({"RAILCC_AUTH_KEY_FILE": "{dir}"}, "is not a regular file"),
    ({"RAILCC_NET": "IB"}, "forces transport verbs"),
])
def test_a_rank_that_fails_its_own_init_late_is_named_with_its_reason_by_the_first_op(tmp_path, setting, words):
    store = str(tmp_path / "store")
    bad = {k: v.format(dir=tmp_path) for k, v in setting.items()}
    # Rank 0 finishes its init alone (its peer on another host is met at first use) and then
    # runs an all_reduce with torch's default op timeout: only rank 1's report can end it.
    procs = [harness.spawn_worker(r, 2, store, dict({"RAILCC_HOST_ID": f"h{r}", "RAILCC_INIT_TIMEOUT": "60"},
                                                    **(bad if r == 1 else {})))
             for r in range(2)]
    t0 = time.monotonic()
    out1, _ = harness.worker_result(procs[1], 90)
    assert not out1["ok"] and words in out1["error"], out1
    out0, err0 = harness.worker_result(procs[0], 90)
    took = time.monotonic() - t0
    assert not out0["ok"], out0
    msg = out0["error"]
    assert msg.startswith("PeerFailureError"), msg
    assert "rank 1 (host " in msg and "failed its own init, so it never joins the group" in msg and words in msg, msg
    assert took < 30, took  # a second or two after rank 1's failure on a quiet machine


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "failed_ranks_worker.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["stopped", "busy"])
def test_failed_ranks_names_a_rank_only_while_it_is_silent(tmp_path, mode):
    # A timeout blames the rank the others waited for. railcc.failed_ranks(), the recipe's input
    # for shrink_group, names it while it is stopped (SIGSTOP), and never while it is alive and
    # reporting (here: still in Python code before the call), which a shrink must not leave out.
    n = 3
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(n), store, mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(n)]
    try:
        assert procs[-1].stdout.readline().strip() == "ready"
        if mode == "stopped":
            procs[-1].send_signal(signal.SIGSTOP)
        outs = [json.loads([ln for ln in p.communicate(timeout=60)[0].splitlines() if ln.startswith("{")][-1])
                for p in procs[:-1]]
    finally:
        if mode == "stopped":
            procs[-1].send_signal(signal.SIGCONT)
        for p in procs:
            p.kill()
    for o in outs:
        assert o["type"] == "CollectiveTimeoutError" and o["ranks"] == [n - 1], o
        if mode == "stopped":
            assert o["failed"] == [n - 1] and "is frozen" in o["msg"], o
        else:
            assert o["failed"] == [], o
            assert "never called" in o["msg"] and "alive and reporting" in o["msg"], o
