"""A job callback that leaves a line per call in the job dir: Hydra's bookkeeping happens
once per job (on its first node), not once per node."""

import socket
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class CountJobStarts(Callback):
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        with (Path(config.hydra.runtime.output_dir) / "job_starts.log").open("a") as log:
            log.write(f"{socket.gethostname()}\n")
