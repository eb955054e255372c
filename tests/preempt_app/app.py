"""A training loop that stops when the launcher is asked to, checkpoints, and resumes."""

import json
import os
import signal
import time

import hydra
import hydra.errors
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from hydra_plugins.hydra_torchrun_launcher import preemption

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}


@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def train(cfg: DictConfig) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checkpoint = cfg.checkpoint  # relative: in the job dir (hydra.job.chdir)
    start = 0
    if preemption.resumed() and not os.path.exists(checkpoint):
        # the README's recipe copes; the tests read this line as a resumed() that lied
        print(f"rank {rank}: resumed without a checkpoint", flush=True)
    if preemption.resumed() and os.path.exists(checkpoint):
        with open(checkpoint) as f:
            start = json.load(f)["step"]
        print(f"rank {rank}: resumed at step {start}", flush=True)
    step = start
    while step < cfg.steps:
        time.sleep(cfg.step_s)
        total = torch.ones(1)
        dist.all_reduce(total)
        step += 1
        print(f"rank {rank}: step {step}", flush=True)
        if rank == 0 and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            _save(checkpoint, step)
        if not cfg.get("ignore_stop") and preemption.should_stop():
            print(f"rank {rank}: stopping after step {step}", flush=True)
            if rank == 0:
                _save(checkpoint, step)
            dist.destroy_process_group()
            return {"stopped_at": step}
    print(f"rank {rank}: done, {step} steps from {start}, pid {os.getpid()}", flush=True)
    dist.destroy_process_group()
    return {"lr": cfg.lr, "steps": step, "from": start}


def _save(checkpoint: str, step: int) -> None:
    """Written whole: a launcher killed at any moment leaves the last checkpoint readable."""
    with open(checkpoint + ".tmp", "w") as f:
        json.dump({"step": step}, f)
    os.replace(checkpoint + ".tmp", checkpoint)


if __name__ == "__main__":
    train()
    # what the app has once the sweep is over: its own handlers, not the launcher's
    print(f"after the sweep: SIGUSR2 -> {signal.getsignal(signal.SIGUSR2)!r}", flush=True)
