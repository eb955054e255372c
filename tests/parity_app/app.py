"""A Hydra app whose every rank records what it sees, for the parity suite (tests/test_parity.py).

Run under plain `torchrun` (Hydra's run mode) and under the launcher, each rank writes
`<out>/rank<R>_x<x>.json`: its environment, argv, __main__, cwd, sys.path head, default
dtype, seeded and unseeded random draws, logging set-up, HydraConfig fields, a registry
filled at import, a spawn DataLoader over a Dataset defined here, and what an installed
package read at import.
"""

import json
import logging
import os
import random
import sys

import hydra
import numpy
import parity_probe
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

# module-level set-up, as real training scripts do it
torch.set_default_dtype(torch.float64)
REGISTRY = {"filled_at_import": True, "rank_at_import": os.environ.get("RANK")}
SEEDED = torch.Generator().manual_seed(1234)
SEEDED_DRAW = torch.rand(1, generator=SEEDED).item()
UNSEEDED_AT_IMPORT = {
    "random": random.random(),
    "numpy": float(numpy.random.random()),
    "torch": torch.rand(1).item(),
    "torch_initial_seed": str(torch.initial_seed()),
}
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
log = logging.getLogger(__name__)


class Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i * i


def _logging() -> dict:
    root = logging.getLogger()
    return {
        "root_level": root.level,
        "handlers": sorted(
            (type(h).__name__, h.level, os.path.basename(getattr(h, "baseFilename", "")))
            for h in root.handlers
        ),
        "app_logger_level": log.getEffectiveLevel(),
    }


@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def main(cfg: DictConfig) -> int:
    import __main__

    hc = HydraConfig.get()
    loader = torch.utils.data.DataLoader(
        Squares(), batch_size=2, num_workers=1, multiprocessing_context="spawn"
    )
    record = {
        "env": dict(os.environ),
        "argv": sys.argv,
        "main": {
            "name": __main__.__name__,
            "file": getattr(__main__, "__file__", None),
            "has_squares": hasattr(__main__, "Squares"),
        },
        # the task runs with its script module's own globals
        "task_globals": globals()["__name__"],
        "cwd": os.getcwd(),
        "sys_path_0": sys.path[0],
        "default_dtype": str(torch.get_default_dtype()),
        "seeded_draw": SEEDED_DRAW,
        "unseeded_at_import": UNSEEDED_AT_IMPORT,
        "unseeded_in_task": {"random": random.random(), "torch": torch.rand(1).item()},
        "logging": _logging(),
        "hydra": {
            "job_name": hc.job.name,
            "output_dir": hc.runtime.output_dir,
            "cwd_is_output_dir": os.getcwd() == hc.runtime.output_dir,
            "chdir": hc.job.chdir,
            "env_set": dict(hc.job.env_set),
        },
        "registry": REGISTRY,
        "loader": [batch.tolist() for batch in loader],
        "installed_package": {
            "rank": parity_probe.RANK_AT_IMPORT,
            "local_rank": parity_probe.LOCAL_RANK_AT_IMPORT,
            "job_var": parity_probe.JOB_VAR_AT_IMPORT,
        },
    }
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, f"rank{os.environ['RANK']}_x{cfg.x}.json"), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    return cfg.x


if __name__ == "__main__":
    main()
