"""An objective for Hydra's Optuna sweeper whose every trial is a 2-rank gloo job.

    python optuna_app.py --multirun hydra/sweeper=optuna hydra/launcher=torchrun \
        hydra.launcher.nproc_per_node=2 'x=interval(-5.0, 5.0)'

Rank 0's value is (x - 2)^2 plus the all-reduced world size (2 with two ranks); rank 1's
would be far lower, so a sweeper that saw rank 1's value would report a negative best.
Every rank writes what it would return to `<job dir>/rank<R>.json`; the `RecordReturn`
callback (add it with `+hydra.callbacks.record._target_=__main__.RecordReturn`) writes the
JobReturn the sweeper gets to `<job dir>/job_return.json`, in the launching process.
"""

import json
import os
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

ConfigStore.instance().store(name="config", node={"x": 0.0})


class RecordReturn(Callback):
    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        record = {
            "status": job_return.status.name,
            "return_value": job_return._return_value,
            "job_num": config.hydra.job.num,
            "pid": os.getpid(),
        }
        (Path(config.hydra.runtime.output_dir) / "job_return.json").write_text(json.dumps(record))


@hydra.main(**VERSION_BASE, config_path=None, config_name="config")
def objective(cfg: DictConfig) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        world = torch.ones(1)
        dist.all_reduce(world)
        value = (cfg.x - 2.0) ** 2 + world.item() if rank == 0 else (cfg.x - 2.0) ** 2 - 1000.0
    finally:
        dist.destroy_process_group()
    record = {
        "rank": rank,
        "x": cfg.x,
        "world": world.item(),
        "value": value,
        "job_num": HydraConfig.get().job.num,
        "pid": os.getpid(),
    }
    (Path(HydraConfig.get().runtime.output_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    return value


if __name__ == "__main__":
    objective()
