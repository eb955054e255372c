"""A Hydra callback writing the JobReturn of every job to `<job output dir>/job_return.json`
(`job_return<RECORD_SUFFIX>.json`: nodes that share a sweep dir write one each)."""

import json
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class RecordReturns(Callback):
    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        record: dict = {"job_num": HydraConfig.get().job.num, "status": job_return.status.name}
        if job_return.status == JobStatus.COMPLETED:
            record["return_value"] = job_return.return_value
        else:
            error = job_return._return_value
            record["error"] = f"{type(error).__name__}: {error}"
        name = f"job_return{os.environ.get('RECORD_SUFFIX', '')}.json"
        out = Path(HydraConfig.get().runtime.output_dir) / name
        out.write_text(json.dumps(record))
