"""What runs in every rank: rebuild the job's Hydra world, run the task, hand back its value.

The elastic agent starts `run_rank` in each worker process (forked from the warm
forkserver, spawned, or forked from the launcher). Everything the rank needs travels as
one cloudpickled `RankPayload`, passed in memory, so tasks defined in `__main__`, closures,
lambdas and partials all survive, and so do the app's custom OmegaConf resolvers (they are
part of Hydra's Singleton state).
"""

import ctypes
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import _flush_loggers, configure_log, setup_globals
from omegaconf import DictConfig, OmegaConf

_PR_SET_PDEATHSIG = 1


@dataclass
class RankPayload:
    task_function: Callable[[DictConfig], Any]
    task_cfg: DictConfig
    singleton_state: Dict[Any, Any]
    working_dir: str
    env: Dict[str, str] = field(default_factory=dict)


def run_rank(sys_path: List[str], payload: bytes) -> Optional[bytes]:
    """Entry point of a rank. Returns local rank 0's return value, cloudpickled.

    `sys_path` comes apart from the payload: unpickling a task function that lives in an
    importable module needs the app's import path first.
    """
    _die_with_parent()
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    job: RankPayload = cloudpickle.loads(payload)
    os.environ.update(job.env)
    if "OMP_NUM_THREADS" in job.env and "torch" in sys.modules:
        # the forkserver imported torch before this rank's environment existed
        sys.modules["torch"].set_num_threads(int(job.env["OMP_NUM_THREADS"]))
    setup_globals()
    Singleton.set_state(job.singleton_state)
    os.chdir(job.working_dir)
    rank = int(os.environ.get("RANK", "0"))
    hydra_cfg = HydraConfig.get()
    configure_log(rank_log_config(hydra_cfg.job_logging, rank), hydra_cfg.verbose)
    try:
        value = job.task_function(job.task_cfg)
    finally:
        _flush_loggers()
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    try:
        return cloudpickle.dumps(value)
    except Exception as e:
        raise TypeError(
            f"the task function's return value ({type(value).__name__}) cannot be pickled "
            f"to send it back to the launcher: {e}"
        ) from e


def rank_log_config(job_logging: Optional[DictConfig], rank: int) -> Optional[DictConfig]:
    """Rank 0 logs to the job's `<job_name>.log`; rank N to `<job_name>_rank<N>.log` beside it.

    Ranks sharing one file would interleave and, with rotation, clobber each other.
    """
    if job_logging is None or rank == 0:
        return job_logging
    config = OmegaConf.to_container(job_logging, resolve=True)
    assert isinstance(config, dict)
    for handler in (config.get("handlers") or {}).values():
        if isinstance(handler, dict) and handler.get("filename"):
            path = Path(handler["filename"])
            handler["filename"] = str(path.with_name(f"{path.stem}_rank{rank}{path.suffix}"))
    return OmegaConf.create(config)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank when the process that started it dies.

    The agent stops ranks itself; this is the backstop for when the launcher is killed
    outright (SIGKILL, OOM) or a second Ctrl-C interrupts the agent's own shutdown, so a
    rank never outlives its sweep holding GPU memory.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logging.getLogger(__name__).warning(
            "could not ask the kernel to stop this rank with its parent: %s",
            os.strerror(ctypes.get_errno()),
        )
    if os.getppid() == 1:
        # the parent died before the request above was in place
        os._exit(1)
