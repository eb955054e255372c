"""The trivial app of `scale.py`: its module imports torch, as training apps do; the task
returns `cfg.x`. The first task to start in a sweep writes when it started (time.time())
into `<sweep dir>/first_task_started`.

    python scale_app.py --multirun hydra/launcher=torchrun 'x=range(0,1000)'
"""

import os
import time

import hydra
import torch  # noqa: F401  (what a training app pays at import)
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

ConfigStore.instance().store(name="scale", node={"x": 0})


@hydra.main(version_base="1.3", config_path=None, config_name="scale")
def main(cfg: DictConfig) -> int:
    started = time.time()
    path = os.path.join(HydraConfig.get().sweep.dir, "first_task_started")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(f"{started}\n")
    return int(cfg.x)


if __name__ == "__main__":
    main()
