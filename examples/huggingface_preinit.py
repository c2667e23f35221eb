#!/usr/bin/env python
"""Hugging Face accelerate and transformers' Trainer on railcc, on CPU.

accelerate picks the backend itself and, for CPU jobs, accepts only gloo (or ccl/mpi):
`InitProcessGroupKwargs(backend="railcc")` raises "Your assigned backend railcc is not
available", and transformers' `TrainingArguments(ddp_backend="railcc")` does the same. Both
keep a process group that already exists, so the way in is to create it first:

    import railcc, torch.distributed as dist
    dist.init_process_group("railcc")          # before Accelerator() or Trainer(...)
    acc = Accelerator(cpu=True)                # uses the group above; acc.state.backend says
                                               # "gloo", but every collective runs on railcc

Run it (--api accelerate: a loop of your own; --api trainer: transformers' Trainer):

    torchrun --nproc-per-node 2 examples/huggingface_preinit.py --backend railcc --api trainer
    torchrun --nproc-per-node 2 examples/huggingface_preinit.py --backend gloo --api trainer   # the same losses

Rank 0 prints ``step N loss X``, the backend every collective ran on, and ``checksum X`` (the
sum of the final parameters).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import railcc  # noqa: F401  registers the "railcc" backend


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x, labels=None):  # the Trainer's calling convention: a dict with the loss
        out = self.net(x)
        return {"logits": out} if labels is None else {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def data(n=256):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def with_accelerate(model, steps):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = acc.prepare(model, opt)  # DistributedDataParallel over the group made first
    x, y = data()
    rank, world = acc.process_index, acc.num_processes
    for step in range(steps):
        mine = slice(8 * (step * world + rank), 8 * (step * world + rank + 1))
        loss = model(x[mine], y[mine])["loss"]
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = acc.reduce(loss.detach(), reduction="mean")
        if acc.is_main_process:
            print(f"step {step} loss {mean.item():.6f}", flush=True)
    return acc.state.backend


def with_trainer(model, steps):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    x, y = data()

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return {"x": x[i], "labels": y[i]}

    class PrintLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                print(f"step {state.global_step} loss {logs['loss']:.6f}", flush=True)

    import tempfile

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=8, max_steps=steps,
                                 logging_steps=1, report_to=[], save_strategy="no", seed=0, learning_rate=0.05,
                                 optim="sgd", lr_scheduler_type="constant", disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[PrintLoss()])
        trainer.train()
        return trainer.accelerator.state.backend


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="railcc")
    p.add_argument("--api", choices=["accelerate", "trainer"], default="accelerate")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    dist.init_process_group(a.backend)  # first: accelerate (and the Trainer through it) keeps it
    torch.manual_seed(0)
    model = Regression()
    said = (with_accelerate if a.api == "accelerate" else with_trainer)(model, a.steps)
    if dist.get_rank() == 0:
        print(f"backend {dist.get_backend()} (accelerate says {said})", flush=True)
        print(f"checksum {sum(q.sum().item() for q in model.parameters()):.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
