"""A Hydra callback that marks a job as started and sets a variable, as callbacks do."""

import json
import os
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class JobStart(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # what the launcher process's environment holds once its jobs are over
        seen = {key: os.environ.get(key) for key in ("JOB_TAG", "ONLY_ONE_JOB")}
        (Path(config.hydra.sweep.dir) / "launcher_env.json").write_text(json.dumps(seen))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ["FROM_CALLBACK"] = f"job{config.hydra.job.num}"
        marker = Path(config.hydra.runtime.output_dir) / "on_job_start.txt"
        marker.write_text(f"{time.time()}\n")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        outcome = {"status": job_return.status.name, "value": repr(job_return._return_value)}
        (Path(config.hydra.runtime.output_dir) / "on_job_end.json").write_text(json.dumps(outcome))
