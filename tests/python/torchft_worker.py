"""One replica group (one rank) of a torchft job on railcc, for tests/python/test_torchft.py.

    python torchft_worker.py REPLICA_ID LIGHTHOUSE_ADDR WORKDIR

Trains a small model with a torchft Manager over railcc.torchft.ProcessGroupRailcc: each step
asks for a quorum, averages the gradients with manager.allreduce and steps the optimizer when
the Manager commits. Appends one JSON line per step to WORKDIR/log-<id>.jsonl (step after
it, participants, committed, quorum id, time). The test steers it through files in WORKDIR:

* stall-<id>: the replica stops inside its next step, before its all-reduce (and says so in
  stalled-<id>), so that the test kills it while the other replica waits in that all-reduce;
* stop_at: a step number; once the Manager's step reaches it the replica saves its parameters
  to final-<id>.pt and waits (still heartbeating) for
* exit: then it leaves. The wait keeps a replica that finished first from vanishing while the
  other still runs its last all-reduce with it.
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft import Manager

from railcc.torchft import ProcessGroupRailcc

PACE_S = 0.05  # between steps: a survivor alone would otherwise race through hundreds


def main():
    replica, lighthouse, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)  # the same initial model everywhere; a replica that joins late heals anyway
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    def state_dict():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this replica group's
    timeout = timedelta(seconds=10)
    manager = Manager(pg=ProcessGroupRailcc(timeout=timeout), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"replica_{replica}", store_addr="localhost",
                      store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse, hostname="localhost",
                      timeout=timeout, quorum_timeout=timedelta(seconds=30), connect_timeout=timeout)
    log = open(os.path.join(workdir, f"log-{replica}.jsonl"), "a", buffering=1)
    stop_file = os.path.join(workdir, "stop_at")
    while True:
        stop_at = int(open(stop_file).read()) if os.path.exists(stop_file) else None
        if stop_at is not None and manager.current_step() >= stop_at:
            break
        manager.start_quorum()
        # Each replica draws its own batch: only the averaged gradient makes them agree.
        g = torch.Generator().manual_seed(1000 * replica + manager.current_step())
        x = torch.randn(32, 8, generator=g)
        y = torch.sin(x[:, :4]) + 0.1 * torch.randn(32, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if os.path.exists(os.path.join(workdir, f"stall-{replica}")):  # the test kills us here,
            open(os.path.join(workdir, f"stalled-{replica}"), "w").close()  # mid-step
            time.sleep(3600)
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()
        committed = manager.should_commit()
        if committed:
            opt.step()
        log.write(json.dumps({"step": manager.current_step(), "participants": manager.num_participants(),
                              "committed": committed, "quorum": manager._quorum_id,
                              "errored": repr(manager.errored()) if manager.errored() else None,
                              "t": time.time()}) + "\n")
        time.sleep(PACE_S)
    torch.save({"step": manager.current_step(), "params": [p.detach().clone() for p in model.parameters()]},
               os.path.join(workdir, f"final-{replica}.pt.tmp"))
    os.rename(os.path.join(workdir, f"final-{replica}.pt.tmp"), os.path.join(workdir, f"final-{replica}.pt"))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(workdir, "exit")) and time.monotonic() < deadline:
        time.sleep(0.05)
    manager.shutdown(wait=False)
    log.close()
    os._exit(0)  # skip the interpreter's teardown (torchft's and railcc's threads)


if __name__ == "__main__":
    main()
