"""Training libraries nobody here wrote, on railcc: each runs its example (examples/) under
torchrun, 2 ranks on CPU, once with railcc and once with gloo, and the two runs must print the
same loss at every step and the same final parameter checksum. A library that is not installed
is skipped, saying so (scripts/install.sh installs them)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _need(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (scripts/install.sh installs it)")


def _run(script, backend, *args):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(EXAMPLES, script), "--backend", backend, *args]
    for attempt in range(3):
        p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=240)
        # ProcessGroupGloo sometimes aborts a process at teardown after the job has finished
        # ("terminate called without an active exception" from one of its threads: seen in CI on
        # a gloo run of deepspeed_zero.py, 2026-12-07, and before in test_training.py). gloo is
        # only the comparison here, so its run is retried; a railcc run never is.
        if p.returncode == 0 or backend != "gloo" or "terminate called without an active exception" not in p.stdout:
            break
    assert p.returncode == 0, f"{script} --backend {backend} failed (rc={p.returncode}):\n{p.stdout[-6000:]}"
    steps = re.findall(r"^step (\d+) loss (\S+)$", p.stdout, re.M)
    checksum = re.findall(r"^checksum (\S+)$", p.stdout, re.M)
    used = re.findall(r"^backend (\S+)", p.stdout, re.M)
    assert steps and checksum and used, f"{script}: no losses or checksum in its output:\n{p.stdout[-4000:]}"
    assert used[0] == backend, f"{script} --backend {backend} ran on {used[0]}"
    return steps, checksum[0]


def _same_training(script, *args):
    ours = _run(script, "railcc", *args)
    theirs = _run(script, "gloo", *args)
    assert ours == theirs, f"{script} {' '.join(args)}: railcc {ours} but gloo {theirs}"


@pytest.mark.timeout(600)
def test_lightning_ddp_trains_as_with_gloo():
    _need("lightning")
    _same_training("lightning_ddp.py")


@pytest.mark.timeout(600)
def test_deepspeed_zero2_trains_as_with_gloo():
    _need("deepspeed")
    _same_training("deepspeed_zero.py", "--stage", "2")


@pytest.mark.timeout(600)
def test_accelerate_after_init_process_group_trains_as_with_gloo():
    """accelerate refuses backend="railcc" on CPU; a group made before Accelerator() is kept."""
    _need("accelerate")
    _same_training("huggingface_preinit.py", "--api", "accelerate")


@pytest.mark.timeout(600)
def test_transformers_trainer_after_init_process_group_trains_as_with_gloo():
    """transformers' Trainer (through accelerate) keeps a railcc group made before it."""
    _need("transformers")
    _same_training("huggingface_preinit.py", "--api", "trainer")
