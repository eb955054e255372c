"""A torchrun script (not a Hydra task) that asks the launcher whether to stop."""

import time

import torch.distributed as dist

from hydra_plugins.hydra_torchrun_launcher import preemption

dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(1, 1000):
    time.sleep(0.1)
    print(f"rank {rank}: step {step}", flush=True)
    if preemption.should_stop():
        print(f"rank {rank}: stopping after step {step}", flush=True)
        break
dist.destroy_process_group()
