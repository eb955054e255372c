"""A one-rank app whose sweeps the record tests run twice, changing one thing in between.

The task is chosen by TASK (`a` or `b`: two functions of this file), calls the project's
own `helper` module, and fails on the job whose lr equals FAIL_AT (an outside cause that
goes away: the same sweep, resumed, retries it).
"""

import os

import helper
import hydra
import hydra.errors
from omegaconf import DictConfig

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}


def train_a(cfg: DictConfig) -> float:
    if str(cfg.lr) == os.environ.get("FAIL_AT"):
        raise ValueError(f"lr={cfg.lr} failed")
    print(f"rank {os.environ['RANK']}: train_a lr={cfg.lr}", flush=True)
    return helper.scale(cfg.lr)


def train_b(cfg: DictConfig) -> float:
    print(f"rank {os.environ['RANK']}: train_b lr={cfg.lr}", flush=True)
    return -helper.scale(cfg.lr)


TASK = {"a": train_a, "b": train_b}[os.environ.get("TASK", "a")]

if __name__ == "__main__":
    hydra.main(**VERSION_BASE, config_path=".", config_name="config")(TASK)()
