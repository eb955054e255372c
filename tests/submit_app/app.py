"""A Hydra app for the SLURM submission tests: each rank joins its job's gloo world.

Returns (from global rank 0) the job's `x`, its world size, the hostnames its ranks ran
on, the step it started from, whether it resumed, and what each rank saw (RANK at import,
the job's env_set, its cwd, its Hydra config's output_subdir, its config's x); `fail_rank`
makes that rank raise in the job of `x == fail_x`; `steps` > 0 runs a loop that stops at a
step boundary when the launcher asks, rank 0 writing a checkpoint in the job dir.
"""

import json
import os
import socket
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hydra_plugins.hydra_torchrun_launcher import preemption

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
# the app's module body runs in every rank, as torchrun's ranks run it: RANK is already set
RANK_AT_IMPORT = os.environ.get("RANK")


@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def main(cfg: DictConfig) -> dict:
    import torch.distributed as dist
    from held_gather import all_gather_held  # copied beside this app by the tests

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = all_gather_held(socket.gethostname())
    print(f"rank {rank}/{world} on {socket.gethostname()} x={cfg.x}", flush=True)
    if rank == cfg.fail_rank and cfg.x == cfg.fail_x:
        raise ValueError(f"rank {rank} failed on purpose (x={cfg.x})")
    resumed = preemption.resumed()
    step = json.load(open("checkpoint.json"))["step"] if resumed and os.path.exists("checkpoint.json") else 0
    start = step
    while step < cfg.steps:
        time.sleep(cfg.step_s)
        step += 1
        if rank == 0 and step == 1:
            print(f"rank 0 running x={cfg.x}", flush=True)
        if preemption.should_stop():
            if rank == 0:
                json.dump({"step": step}, open("checkpoint.json", "w"))
            print(f"rank {rank}: stopping after step {step}", flush=True)
            dist.destroy_process_group()
            return {}
    seen = {
        "rank_at_import": RANK_AT_IMPORT,
        "job_tag": os.environ.get("JOB_TAG"),
        "in_job_dir": os.getcwd() == HydraConfig.get().runtime.output_dir,
        # the job's Hydra config, as its first node's ranks see it (only that node writes `.hydra/`)
        "output_subdir": HydraConfig.get().output_subdir,
        "cfg_x": cfg.x,
    }
    views = all_gather_held(seen)
    dist.destroy_process_group()
    return {
        "x": cfg.x,
        "world": world,
        "hosts": sorted(set(hosts)),
        "from": start,
        "resumed": resumed,
        "ranks_saw": views,
    }


if __name__ == "__main__":
    main()
