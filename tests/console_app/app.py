"""A small 2-rank app whose sweep output the console tests read as a user would.

Every rank logs a line, writes `rank<R>.txt` (world size, the job's TAG from env_set, lr)
into its job dir and returns lr * 10; in the job whose lr equals `fail_at`, rank 1 raises.
With `+say=TEXT`, every rank prints TEXT once it has waited `hold` seconds.
"""

import logging
import os
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

log = logging.getLogger(__name__)


@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def main(cfg: DictConfig) -> float:
    rank = int(os.environ["RANK"])
    log.info("rank %d of %s starts, lr=%s", rank, os.environ["WORLD_SIZE"], cfg.lr)
    if cfg.fail_at is not None and cfg.lr == cfg.fail_at and rank == 1:
        raise ValueError(f"lr={cfg.lr} diverged")
    time.sleep(cfg.hold)
    if cfg.get("say"):  # a short line of a rank's own, as `print` writes it
        print(cfg.say, flush=True)
    output_dir = HydraConfig.get().runtime.output_dir
    with open(os.path.join(output_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{os.environ['WORLD_SIZE']} {os.environ.get('TAG', '')} {cfg.lr}\n")
    return cfg.lr * 10


if __name__ == "__main__":
    main()
