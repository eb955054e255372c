"""The trivial Hydra app that `sweep_overhead.py` sweeps under the torchrun launcher.

Every rank imports torch, joins a gloo group from torchrun's environment, does one
all_reduce, leaves the group and returns. Timestamps (time.time()) go into the job's output
dir as JSON, so the benchmark can tell launcher time from task time:

- `rank<R>.json` (each rank): process creation, task start, after `import torch`, after
  `init_process_group`, and task end (taken just before the task returns), plus the rank's
  CPU time (time.process_time()) at task start and end;
- `job_start.json` / `job_end.json` (the launching process, from a Hydra Callback): when
  `run_job` calls `on_job_start`, and when it has the job's `JobReturn` (`on_job_end`), plus
  the launching process's CPU time then.

    python trivial_app.py --multirun hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 x=0,1,2
"""

import json
import os
import time
from pathlib import Path
from typing import Any, Dict

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from proc_clock import process_created


def write_json(directory: str, name: str, record: Dict[str, Any]) -> None:
    path = Path(directory) / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


class TimingCallback(Callback):
    """Runs in the launching process: job start, and the moment the JobReturn exists."""

    def on_job_start(self, config: DictConfig, *, task_function: Any, **kwargs: Any) -> None:
        record = {"t": time.time(), "cpu": time.process_time()}
        write_json(config.hydra.runtime.output_dir, "job_start.json", record)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        t, cpu = time.time(), time.process_time()
        record = {"t": t, "cpu": cpu, "status": job_return.status.name, "pid": os.getpid()}
        write_json(config.hydra.runtime.output_dir, "job_end.json", record)


ConfigStore.instance().store(
    name="trivial",
    node={"x": 0, "hydra": {"callbacks": {"timing": {"_target_": "__main__.TimingCallback"}}}},
)


@hydra.main(version_base=None, config_name="trivial")
def main(cfg: DictConfig) -> float:
    started, cpu_started = time.time(), time.process_time()
    import torch
    import torch.distributed as dist

    imported = time.time()
    dist.init_process_group("gloo")
    joined = time.time()
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    record = {
        "x": cfg.x,
        "rank": int(os.environ["RANK"]),
        "pid": os.getpid(),
        "created": process_created(),
        "start": started,
        "imported": imported,
        "joined": joined,
        "cpu_start": cpu_started,
    }
    record["cpu_end"] = time.process_time()
    record["end"] = time.time()
    write_json(HydraConfig.get().runtime.output_dir, f"rank{record['rank']}.json", record)
    return float(value.item())


if __name__ == "__main__":
    main()
