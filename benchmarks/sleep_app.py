"""A sleep-bound Hydra task for `parallel_jobs.py`: each rank waits, as a job bound on I/O or a GPU would."""

import os
import time

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path=None)
def main(cfg: DictConfig) -> str:
    time.sleep(float(cfg.seconds))
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


if __name__ == "__main__":
    main()
