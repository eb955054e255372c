"""A torchrun script whose ranks run out of phase and share no collective of their own.

Rank r's step takes `0.01 + 0.15 * r` s, so without `should_stop()`'s own agreement rank 0
would be many calls ahead of rank 1 when the stop file appears. Around every call each rank
notes whether the job's stop file already exists (before and after the call), and prints,
when it stops, the call index at which it stopped and the first calls at which it saw the
file: the test checks every rank stopped at the same call, one call after the first rank
that could see the file (the documented lag).
"""

import os
import time

import torch.distributed as dist

from hydra_plugins.hydra_torchrun_launcher import preemption

dist.init_process_group("gloo")
rank = dist.get_rank()
stop_file = os.environ["HYDRA_TORCHRUN_STOP_FILE"]
seen_before = seen_after = None  # the first call with the file there before / after it
for call in range(1, 100_000):
    time.sleep(0.01 + 0.15 * rank)
    if seen_before is None and os.path.exists(stop_file):
        seen_before = call
    stop = preemption.should_stop()
    if seen_after is None and os.path.exists(stop_file):
        seen_after = call
    print(f"rank {rank}: call {call}", flush=True)
    if stop:
        seen = f"file seen before call {seen_before}, after call {seen_after}"
        print(f"rank {rank}: stopped at call {call}, {seen}", flush=True)
        break
# both ranks out of the loop before the group goes: a rank that destroys it while its peer's
# side of the last collective is in flight can abort in gloo ("terminate called ...")
dist.barrier()
dist.destroy_process_group()
