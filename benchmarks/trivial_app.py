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

import os
import time
from typing import Any

import hydra
import trivial_task
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class TimingCallback(Callback):
    """Runs in the launching process: job start, and the moment the JobReturn exists."""

    def on_job_start(self, config: DictConfig, *, task_function: Any, **kwargs: Any) -> None:
        record = {"t": time.time(), "cpu": time.process_time()}
        trivial_task.write_json(config.hydra.runtime.output_dir, "job_start.json", record)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        t, cpu = time.time(), time.process_time()
        record = {"t": t, "cpu": cpu, "status": job_return.status.name, "pid": os.getpid()}
        trivial_task.write_json(config.hydra.runtime.output_dir, "job_end.json", record)


ConfigStore.instance().store(
    name="trivial",
    node={"x": 0, "hydra": {"callbacks": {"timing": {"_target_": "__main__.TimingCallback"}}}},
)


@hydra.main(version_base="1.3", config_name="trivial")
def main(cfg: DictConfig) -> float:
    started, cpu_started = time.time(), time.process_time()
    return trivial_task.run(cfg.x, started, cpu_started, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
