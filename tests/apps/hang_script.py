"""A training script (`hydra.launcher.training_script`) that hangs: rank 0 sleeps in Python,
every other rank waits for it in a gloo barrier (in C). Each rank says on its stderr whether
the launcher's stack hook is still in sight (it must not be: it leaves no trace)."""

import os
import sys
import time

import torch.distributed as dist


def _forever() -> None:
    while True:
        time.sleep(1)


rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
print(f"rank {rank} is up", flush=True)
paths = [*sys.path, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
hook = any("stack_hook" in path for path in paths) or "HYDRA_TORCHRUN_STACK_HOOK" in os.environ
print(f"rank {rank} waits (stack hook in sight: {hook})", file=sys.stderr, flush=True)
if rank == 0:
    _forever()
dist.barrier()
