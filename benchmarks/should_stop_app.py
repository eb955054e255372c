"""The rank side of `should_stop_cost.py`: time `preemption.should_stop()` per call.

Each rank joins a gloo world, then makes `calls` calls of `should_stop()` (no stop asked:
the usual case) and, for scale, as many blocking all-reduces of one integer, both back to
back and one "training step" (`step_ms` of computation) apart; rank 0 returns the median
cost per call over `rounds` rounds, in microseconds.
"""

import statistics
import time

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from hydra_plugins.hydra_torchrun_launcher import preemption


def _per_call_us(call, calls: int, step_s: float = 0.0) -> float:
    """How long the rank spends in `call`, per call, with `step_s` between calls."""
    dist.barrier()
    spent = 0.0
    for _ in range(calls):
        if step_s:
            time.sleep(step_s)
        start = time.perf_counter()
        call()
        spent += time.perf_counter() - start
    return spent / calls * 1e6


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> dict:
    dist.init_process_group("gloo")
    flag = torch.zeros(1, dtype=torch.int32)
    preemption.should_stop()  # the first call makes the gloo group (once per job)
    step_s = cfg.step_ms / 1000

    def all_reduce() -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)

    times: dict = {"should_stop": [], "all_reduce": [], "should_stop_in_steps": [], "all_reduce_in_steps": []}
    for _ in range(cfg.rounds):
        times["should_stop"].append(_per_call_us(preemption.should_stop, cfg.calls))
        times["all_reduce"].append(_per_call_us(all_reduce, cfg.calls))
        times["should_stop_in_steps"].append(_per_call_us(preemption.should_stop, cfg.calls, step_s))
        times["all_reduce_in_steps"].append(_per_call_us(all_reduce, cfg.calls, step_s))
    dist.destroy_process_group()
    return {name: statistics.median(values) for name, values in times.items()}


if __name__ == "__main__":
    main()
