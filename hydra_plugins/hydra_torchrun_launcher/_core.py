"""The work of `TorchrunLauncher.launch`: every sweep job as one torch elastic job.

Per job: compose the job's config, read its launcher settings from that config (so launcher
keys may interpolate swept values), let Hydra's `run_job` do the job's bookkeeping in this
process (output dir, .hydra files, callbacks, logging), and inside it run torch's elastic
agent, whose ranks run the task function through `_worker.run_rank`.
"""

import logging
import multiprocessing
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from . import _signals
from ._cluster import resolve_cluster
from ._failures import JobFailedError, describe
from ._launch_config import (
    build_launch_config,
    check_supported,
    local_world_size,
    rendezvous_for,
)
from ._settings import JobSettings, resolve_settings
from ._worker import RankPayload, run_rank

if TYPE_CHECKING:
    from .torchrun_launcher import TorchrunLauncher

log = logging.getLogger(__name__)

# Imported once by the forkserver, then inherited by every rank it forks: the ranks of a
# sweep's jobs start without paying for an interpreter and a torch import each.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing",
    "hydra_plugins.hydra_torchrun_launcher._worker",
]


@dataclass
class PreparedJob:
    idx: int
    overrides: List[str]
    config: DictConfig
    settings: JobSettings
    cluster_note: Optional[str]


def launch(
    launcher: "TorchrunLauncher",
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
) -> Sequence[JobReturn]:
    setup_globals()
    assert launcher.config is not None
    assert launcher.hydra_context is not None
    assert launcher.task_function is not None

    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)

    # every job's settings are checked before the first rank of the sweep starts
    jobs = [
        _prepare(launcher, list(overrides), initial_job_idx + i) for i, overrides in enumerate(job_overrides)
    ]
    cluster_notes = sorted({job.cluster_note for job in jobs if job.cluster_note})
    for note in cluster_notes:
        log.info(note)
    if any(job.settings.conf.start_method == "forkserver" for job in jobs):
        _start_forkserver()

    log.info(f"Launching {len(jobs)} jobs with torchrun")
    returns: List[JobReturn] = []
    for job in jobs:
        log.info(f"\t#{job.idx} : {' '.join(filter_overrides(job.overrides))}")
        returns.append(_run(launcher, job, str(sweep_dir.resolve())))
        configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    return returns


def _prepare(launcher: "TorchrunLauncher", overrides: List[str], idx: int) -> PreparedJob:
    assert launcher.hydra_context is not None and launcher.config is not None
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(config):
        config.hydra.job.id = idx
        config.hydra.job.num = idx
        # as run_job will set it, so launcher keys may interpolate ${hydra:runtime.output_dir}
        config.hydra.runtime.output_dir = os.path.abspath(
            os.path.join(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))
        )
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        settings = resolve_settings(config.hydra.launcher)
    finally:
        HydraConfig.instance().cfg = previous
    settings, cluster_note = resolve_cluster(settings, os.environ)
    check_supported(settings)
    rendezvous_for(settings, "", idx)  # refuses an unusable rendezvous now
    return PreparedJob(
        idx=idx, overrides=overrides, config=config, settings=settings, cluster_note=cluster_note
    )


def _start_forkserver() -> None:
    """Start the forkserver now, from the launcher's own environment.

    Started lazily it would inherit whatever the first job's `env_set` put in os.environ;
    started here it also imports torch while this process composes the first job.
    """
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _run(launcher: "TorchrunLauncher", job: PreparedJob, sweep_key: str) -> JobReturn:
    assert launcher.hydra_context is not None

    def distributed_task(task_cfg: DictConfig) -> Any:
        return _run_agent(launcher, job, task_cfg, sweep_key)

    return run_job(
        hydra_context=launcher.hydra_context,
        task_function=distributed_task,
        config=job.config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


def _run_agent(launcher: "TorchrunLauncher", job: PreparedJob, task_cfg: DictConfig, sweep_key: str) -> Any:
    """Runs inside run_job: HydraConfig holds this job's config with its output dir set."""
    settings = job.settings
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    nproc = local_world_size(settings)
    launch_config = build_launch_config(
        settings,
        rendezvous_for(settings, sweep_key, job.idx),
        nproc_per_node=nproc,
        log_dir=settings.conf.log_dir or str(output_dir / "torchrun_logs"),
    )
    payload = RankPayload(
        task_function=launcher.task_function,  # type: ignore[arg-type]
        task_cfg=task_cfg,
        singleton_state=Singleton.get_state(),
        working_dir=os.getcwd(),
        env=_rank_env(hydra_cfg.job.env_set, nproc),
    )
    try:
        pickled = cloudpickle.dumps(payload)
    except Exception as e:
        raise JobFailedError(
            f"the task function or its config cannot be pickled for the ranks: {type(e).__name__}: {e}"
        ) from e

    caught: Optional[int] = None
    with _signals.preserved_handlers(settings.conf.signals_to_handle):
        try:
            with _signals.deadline(settings.conf.job_timeout):
                outputs = elastic_launch(launch_config, run_rank)(list(sys.path), pickled)
        except ChildFailedError as e:
            raise describe(e) from None
        except _signals.JobDeadline as e:
            raise JobFailedError(f"{e}; its ranks were stopped") from None
        except SignalException as e:
            caught = e.sigval
    if caught is not None:
        # the agent has stopped the ranks; now the launcher reacts as it would have alone
        _signals.redeliver(caught)
        raise JobFailedError(f"stopped by signal {caught}")
    return _node_return_value(outputs)


def _rank_env(env_set: DictConfig, nproc: int) -> Dict[str, str]:
    env = {str(k): str(v) for k, v in OmegaConf.to_container(env_set, resolve=True).items()}  # type: ignore[union-attr]
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env:
        # as torchrun: ranks sharing a node do not each start a thread per core
        env["OMP_NUM_THREADS"] = "1"
    return env


def _node_return_value(outputs: Dict[int, Optional[bytes]]) -> Any:
    """Global rank 0's value; on the other nodes of a multi-node job, their first rank's."""
    first_rank = min(outputs)
    pickled = outputs[first_rank]
    return None if pickled is None else cloudpickle.loads(pickled)
