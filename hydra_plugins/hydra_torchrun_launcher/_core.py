"""The work of `TorchrunLauncher.launch`: every sweep job as one torch elastic job.

Per job: compose the job's config, read its launcher settings from that config (so launcher
keys may interpolate swept values), capture what its ranks need, and let Hydra's `run_job`
do the job's bookkeeping in this process (output dir, .hydra files, callbacks, logging)
around the job's elastic agent (`_job`). With `parallel_jobs` > 1 the agents of several
jobs run at once (`_pool`) while `run_job` still runs here, in job order.
"""

import copy
import functools
import logging
import multiprocessing
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ._cluster import resolve_cluster
from ._failures import JobFailedError
from ._job import JobPlan, build_agent_job, run_agent_job
from ._launch_config import check_supported, local_world_size, rendezvous_for
from ._pool import ConcurrentJobs
from ._settings import JobSettings, LauncherConfigError, resolve_settings
from ._worker import RankPayload

if TYPE_CHECKING:
    from .torchrun_launcher import TorchrunLauncher

log = logging.getLogger(__name__)

# Imported once by the forkserver, then inherited by every rank it forks: the ranks of a
# sweep's jobs start without paying for an interpreter and a torch import each.
FORKSERVER_PRELOAD = ["hydra_plugins.hydra_torchrun_launcher._forkserver"]

# keys that shape the whole sweep rather than one job: every job must agree on them
_SWEEP_WIDE_KEYS = ("parallel_jobs", "devices")


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
    sweep_key = str(sweep_dir.resolve())

    pickled_task, task_error = _pickle_task(launcher.task_function)
    # every job is composed and checked before the first rank of the sweep starts
    plans: List[JobPlan] = []
    configs: List[DictConfig] = []
    notes = set()
    for i, overrides in enumerate(job_overrides):
        config = _compose(launcher, list(overrides), initial_job_idx + i)
        # once per job: HydraConfig holds this job's config while its settings and state are read
        with _hydra_config(config):
            settings, note = _checked_settings(config)
            plans.append(_plan(config, settings, pickled_task, sweep_key))
        configs.append(config)
        notes.add(note)
    for note in sorted(n for n in notes if n):
        log.info(note)
    if not plans:
        return []
    parallel_jobs, devices = _sweep_wide(plans)
    if any(plan.settings.conf.start_method == "forkserver" for plan in plans):
        _start_forkserver()

    log.info(f"Launching {len(plans)} jobs with torchrun")
    hydra_context = launcher.hydra_context
    returns: List[JobReturn] = []
    if parallel_jobs == 1 or task_error is not None:
        for plan, config in zip(plans, configs):
            job_devices = devices[: plan.nproc] if devices is not None else None
            if task_error is None:
                run = functools.partial(_run_agent, plan, job_devices)
            else:
                run = functools.partial(_fail, task_error)
            returns.append(_run_job(hydra_context, plan, config, run))
            configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
        return returns

    signals = plans[0].settings.conf.signals_to_handle
    with ConcurrentJobs(parallel_jobs, devices, signals) as pool:
        futures = [pool.submit(plan.idx, plan.nproc, functools.partial(_run_agent, plan)) for plan in plans]
        for plan, config, future in zip(plans, configs, futures):
            returns.append(_run_job(hydra_context, plan, config, future.result))
            configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    return returns


def _run_agent(plan: JobPlan, devices: Optional[List[str]]) -> Any:
    return run_agent_job(build_agent_job(plan, devices))


def _run_job(
    hydra_context: HydraContext, plan: JobPlan, config: DictConfig, result: Callable[[], Any]
) -> JobReturn:
    """Hydra's run_job around the job's agent: its return is rank 0's, its failure the job's."""
    log.info(f"\t#{plan.idx} : {' '.join(filter_overrides(plan.overrides))}")

    def distributed_task(task_cfg: DictConfig) -> Any:
        return result()

    return run_job(
        hydra_context=hydra_context,
        task_function=distributed_task,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


def _pickle_task(task_function: Any) -> "tuple[bytes, Optional[str]]":
    """The task function, cloudpickled once per sweep; or why it cannot travel to the ranks."""
    try:
        return cloudpickle.dumps(task_function), None
    except Exception as e:
        return b"", (
            f"the task function cannot be pickled for the ranks ({type(e).__name__}: {e}); "
            "a task holding a lock, an open file or a socket cannot travel to another process"
        )


def _fail(message: str) -> Any:
    raise JobFailedError(message)


def _compose(launcher: "TorchrunLauncher", overrides: List[str], idx: int) -> DictConfig:
    """The job's config as run_job will see it."""
    assert launcher.hydra_context is not None and launcher.config is not None
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(config):
        config.hydra.job.id = idx
        config.hydra.job.num = idx
        # as run_job will set it, so that launcher keys and ranks see ${hydra:runtime.output_dir}
        config.hydra.runtime.output_dir = os.path.abspath(
            os.path.join(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))
        )
    return config


def _checked_settings(config: DictConfig) -> "tuple[JobSettings, Optional[str]]":
    """The job's launcher settings (with what SLURM gives), checked; and the cluster log line."""
    settings, note = resolve_cluster(resolve_settings(config.hydra.launcher), os.environ)
    check_supported(settings)
    return settings, note


def _plan(config: DictConfig, settings: JobSettings, pickled_task: bytes, sweep_key: str) -> JobPlan:
    """What the job's ranks need, captured now: Hydra's global state is this job's only here.

    Called with HydraConfig set to `config`.
    """
    idx = int(config.hydra.job.num)
    output_dir = Path(config.hydra.runtime.output_dir)
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    nproc = local_world_size(settings)
    env = _rank_env(config.hydra.job.env_set, nproc)
    pickled_state = cloudpickle.dumps(Singleton.get_state())
    job_logging = (
        OmegaConf.to_container(config.hydra.job_logging, resolve=True)
        if config.hydra.job_logging is not None
        else None
    )
    overrides = list(config.hydra.overrides.task)
    return JobPlan(
        idx=idx,
        overrides=overrides,
        settings=settings,
        rendezvous=rendezvous_for(settings, sweep_key, idx),
        nproc=nproc,
        output_dir=output_dir,
        payload=RankPayload(
            pickled_task=pickled_task,
            pickled_state=pickled_state,
            task_cfg=task_cfg,
            job_logging=job_logging,  # type: ignore[arg-type]
            working_dir=str(output_dir) if _chdir(config) else os.getcwd(),
            job_num=idx,
            overrides=overrides,
            env=env,
            failure_grace_s=2 * settings.conf.monitor_interval + 0.1,
        ),
    )


@contextmanager
def _hydra_config(config: DictConfig) -> Iterator[None]:
    """HydraConfig set to one job's config for a moment (interpolations, state capture)."""
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = previous


def _chdir(config: DictConfig) -> bool:
    """Whether run_job will enter the job dir (hydra.job.chdir; None means the pre-1.2 default)."""
    from hydra import version

    chdir = config.hydra.job.chdir
    return bool(chdir) if chdir is not None else not version.base_at_least("1.2")


def _sweep_wide(plans: List[JobPlan]) -> "tuple[int, Optional[List[str]]]":
    """parallel_jobs and the devices to share out, checked against every job."""
    first = plans[0].settings.conf
    for plan in plans[1:]:
        for key in _SWEEP_WIDE_KEYS:
            if getattr(plan.settings.conf, key) != getattr(first, key):
                raise LauncherConfigError(
                    f"hydra.launcher.{key} differs between jobs {plans[0].idx} and {plan.idx}: "
                    "it applies to the whole sweep and must be the same for every job"
                )
    parallel_jobs = first.parallel_jobs
    if parallel_jobs > 1 and any(plan.settings.max_nodes > 1 for plan in plans):
        raise LauncherConfigError(
            f"hydra.launcher.parallel_jobs={parallel_jobs} is invalid for a multi-node sweep: "
            "the nodes run the jobs one by one in lockstep"
        )
    devices = [str(d) for d in first.devices] if first.devices is not None else None
    if devices is None and parallel_jobs > 1:
        devices = _visible_devices()
    if devices is not None:
        for plan in plans:
            if plan.nproc > len(devices):
                raise LauncherConfigError(
                    f"hydra.launcher.nproc_per_node={plan.nproc} (job {plan.idx}) is more than the "
                    f"{len(devices)} devices to share out ({','.join(devices) or 'none'}); "
                    "set hydra.launcher.devices or lower nproc_per_node"
                )
    return parallel_jobs, devices


def _visible_devices() -> Optional[List[str]]:
    """All visible GPUs (CUDA_VISIBLE_DEVICES, else the CUDA device count); None without GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()] or None
    import torch

    count = torch.cuda.device_count()
    return [str(i) for i in range(count)] if count else None


def _start_forkserver() -> None:
    """Start the forkserver now, from the launcher's own environment.

    Started lazily it would inherit whatever the first job's `env_set` put in os.environ;
    started here it also imports torch while this process composes the first job.
    """
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _rank_env(env_set: DictConfig, nproc: int) -> Dict[str, str]:
    container = OmegaConf.to_container(env_set, resolve=True)
    assert isinstance(container, dict)
    env = {str(k): str(v) for k, v in container.items()}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env:
        # as torchrun: ranks sharing a node do not each start a thread per core
        env["OMP_NUM_THREADS"] = "1"
    return env
