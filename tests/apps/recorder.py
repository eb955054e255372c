"""A Hydra callback that records, in the launcher process, what happened to every job.

One JSON line per event in `<sweep dir>/jobs.jsonl`: the job's status and error (or return
value) as the launcher handed them to Hydra, and the launcher's own open fds, threads,
descendant processes and RSS at that moment.
"""

import json
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def _process_stats() -> dict:
    me = psutil.Process()
    return {
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "descendants": sorted(p.pid for p in me.children(recursive=True)),
        "rss": me.memory_info().rss,
    }


def _write(config: DictConfig, record: dict) -> None:
    path = Path(str(config.hydra.sweep.dir)) / "jobs.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _text(error: BaseException) -> str:
    """Its message, or what Python's traceback prints where its `__str__` raises."""
    try:
        return str(error)
    except Exception:
        return "<exception str() failed>"


class Recorder(Callback):
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        _write(config, {"event": "start", "num": config.hydra.job.num, "t": time.time(), **_process_stats()})

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        record = {
            "event": "end",
            "num": config.hydra.job.num,
            "t": time.time(),
            "status": job_return.status.name,
        }
        value = job_return._return_value  # `return_value` re-raises a failed job's error
        if job_return.status == JobStatus.COMPLETED:
            record["value"] = repr(value)
        else:
            record["error"] = f"{type(value).__name__}: {_text(value)}"
            # the launcher's account of it, rank first (kept on a rank's own exception)
            record["summary"] = getattr(value, "hydra_torchrun_summary", None) or _text(value)
            # the error as Python prints it: the failed rank's frames, or its traceback chained
            record["traceback"] = "".join(traceback.format_exception(type(value), value, value.__traceback__))
            # its own attributes, as the job's process has it back from the rank
            own = getattr(value, "__dict__", {})
            record["attributes"] = sorted(name for name in own if not name.startswith("_"))
        _write(config, {**record, **_process_stats()})
