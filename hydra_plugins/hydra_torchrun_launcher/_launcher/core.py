"""The work of `TorchrunLauncher.launch`: every sweep job as one torch elastic job, alone.

First every job is composed and its launcher settings resolved from its own config (so
launcher keys may interpolate swept values) and checked: a bad setting stops the sweep
before any process starts. Then each job runs in a process of its own, forked from the
launcher's warm server (`_server.server`), where Hydra's `run_job` does the job's bookkeeping
and torch's elastic agent runs its ranks (`_job.process`). Up to `parallel_jobs` such
processes run at once (`_launcher.pool`); the same code path runs one at a time.
"""

import contextlib
import copy
import logging
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Set

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from .._job.launch_config import check_supported, local_world_size, rendezvous_for
from .._job.preempt import JobPreempted
from .._job.process import JobRequest, encode_request, without_bookkeeping
from .._server.server import checked_warm_server
from .._shared.errors import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.plan import AppScript, JobPlan, JobSettings, RankPayload, stop_signal_of
from .._shared.signals import ignored_group_signals
from .._shared.stop_files import RANKS_STARTED_FILE
from .cluster import resolve_cluster
from .lock import hold_sweep_lock, holder
from .node_agreement import agree_on_resumption, waiting_for_nodes
from .pool import SweepStopped, react_to_stop, run_jobs
from .preempt import StopNotice, StoppedBeforeJobs, end_preempted, sweep_notice, sweep_stop_signal
from .preload import varying_variables
from .report import COMPLETED, FAILED, PREEMPTED, STOPPED, SweepReport, job_title
from .reproduce import dry_run_plan, write_rerun_script
from .resume import (
    Record,
    continuing_in_place,
    fingerprint,
    log_resumption,
    planned_resumption,
    read_record,
    resumption,
    save_return,
    targets_digest,
    task_digest,
)
from .settings import check_node_rank, resolve_settings, shadowed_redirects
from .shared_dir import publish_decision, take_decision
from .task import app_script, pickle_task

log = logging.getLogger(__name__)


class SweepLauncher(Protocol):
    """What a launch needs of Hydra's launcher object (`TorchrunLauncher`): what Hydra's
    `setup` gave it, and the sweep's report and stop notice, kept there across a sweeper's
    batches. A protocol, so that this module never imports the public module that imports it."""

    config: Optional[DictConfig]
    hydra_context: Optional[HydraContext]
    task_function: Optional[TaskFunction]
    report: Any
    notice: Any


# how long a node that shares node 0's sweep dir waits for its decision (c10d's join_timeout)
_NODE_WAIT_S = 600.0

# after its job_timeout, how long a job process may take beyond its ranks' shutdown
_STOP_MARGIN_S = 30.0

# keys that shape the whole sweep rather than one job: every job must agree on them
_SWEEP_WIDE_KEYS = ("parallel_jobs", "devices", "preload", "dry_run", "stop_signal", "requeue", "resume")


def launch(
    launcher: "SweepLauncher",
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    preload: "tuple[str, ...]",
) -> Sequence[JobReturn]:
    """Run the sweep's jobs; `preload` is what the warm server (already starting) imports."""
    setup_globals()
    assert launcher.config is not None
    assert launcher.hydra_context is not None
    assert launcher.task_function is not None

    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_key = str(sweep_dir.resolve())
    # installed at the launcher's setup, for the whole sweep: a notice while jobs are composed
    # or between a sweeper's batches ends the sweep preempted, as one while jobs run does
    notice = launcher.notice = sweep_notice(
        launcher.notice, sweep_stop_signal(launcher.config), launcher.hydra_context.callbacks
    )
    if notice.received:
        if launcher.report is not None:
            launcher.report.interrupted = True
            launcher.report.write()
        started = "no job of the next batch had started" if launcher.report else "no job had started"
        _end_preempted(notice, started, sweep_dir, launcher.config.hydra.launcher)

    composed = compose_plans(launcher, job_overrides, initial_job_idx, sweep_key, _checked_settings)
    plans, configs, task_error = composed.plans, composed.configs, composed.task_error
    if plans and plans[0].payload.stop_signal == signal.SIGUSR1:
        log.warning(
            "hydra.launcher.stop_signal=SIGUSR1: NCCL may take SIGUSR1 in the ranks' processes for "
            "its own debugging dumps (NCCL_PROXY_DUMP_SIGNAL, torch's NCCL flight recorder); "
            "SIGUSR2 is the stop signal nothing else uses"
        )
    if not plans:
        return []
    parallel_jobs, devices = _sweep_wide(plans)
    if parallel_jobs > 1:
        for plan in plans:
            plan.console_label = f"#{plan.idx} "
    if plans[0].settings.conf.dry_run:
        recorded = planned_resumption(plans[0].settings.conf.resume, sweep_dir, plans)
        log.info(dry_run_plan(plans, configs, parallel_jobs, devices, recorded))
        raise SystemExit(0)
    return _run_plans(launcher, plans, configs, parallel_jobs, devices, preload, task_error, notice)


@dataclass
class ComposedSweep:
    """The jobs of one launch, composed and checked, before any of them runs."""

    plans: List[JobPlan]
    configs: Dict[int, DictConfig]
    task_error: Optional[str]  # why the task function cannot travel to the ranks


def compose_plans(
    launcher: "SweepLauncher",
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    sweep_key: str,
    settings_of: Callable[[DictConfig], "tuple[JobSettings, Optional[str]]"],
) -> ComposedSweep:
    """Every job composed, its launcher settings resolved from its own config and checked
    (`settings_of(config)`: the settings and a line to log once), and its plan made: a bad
    setting stops the sweep before any process starts. Shared by every way to run jobs."""
    assert launcher.task_function is not None
    pickled_task, task_error = pickle_task(launcher.task_function)
    script = app_script(launcher.task_function)
    if script is not None and script.task_name is not None:
        task_error = None  # each rank finds the task by name in the script it runs
    task = task_digest(launcher.task_function)
    plans: List[JobPlan] = []
    configs: Dict[int, DictConfig] = {}
    notes = set()
    for i, overrides in enumerate(job_overrides):
        config = _compose(launcher, list(overrides), initial_job_idx + i)
        # once per job: HydraConfig holds this job's config while its settings and state are read
        with _hydra_config(config):
            try:
                settings, note = settings_of(config)
                plan = _plan(config, settings, pickled_task, script, sweep_key)
            except LauncherConfigError as e:
                shown = " ".join(filter_overrides(config.hydra.overrides.task)) or "no overrides"
                raise LauncherConfigError(f"job #{initial_job_idx + i} ({shown}): {e}") from e
        # with the project's modules that the job's `_target_`s name (instantiate imports them later)
        code = task + targets_digest(launcher.task_function, plan.payload.task_cfg)
        plan.fingerprint = fingerprint(code, plan.payload.task_cfg, plan.settings.conf, plan.env_set)
        plans.append(plan)
        configs[plan.idx] = config
        notes.update(line for line in (note, shadowed_redirects(settings.conf)) if line)
    for note in sorted(notes):
        log.info(note)
    return ComposedSweep(plans, configs, task_error)


def _run_plans(
    launcher: "SweepLauncher",
    plans: List[JobPlan],
    configs: Dict[int, DictConfig],
    parallel_jobs: int,
    devices: Optional[List[str]],
    preload: "tuple[str, ...]",
    task_error: Optional[str],
    notice: StopNotice,
) -> List[JobReturn]:
    """Resume what the record has done, run the rest; a stop signal ends the sweep preempted."""
    assert launcher.config is not None
    conf = plans[0].settings.conf
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    first_launch = launcher.report is None or launcher.report.path.parent != sweep_dir
    # before the record is read: no other launcher of this node works in this sweep dir
    slot = hold_sweep_lock(sweep_dir, plans[0].settings.max_nodes)
    writes = slot == 0  # one node keeps the record of a sweep dir the nodes share
    for plan in plans:
        plan.node_slot = slot
    report = _report_of(launcher, sweep_dir, conf.resume is not False)
    report.writes = writes
    multi_node = plans[0].settings.max_nodes > 1
    if multi_node and first_launch:
        log.info(waiting_for_nodes(plans[0]))
    jobs = [plan.idx for plan in plans]
    # a node that never comes would keep the others waiting: a stop ends the wait at once
    waiting = notice.interrupting() if multi_node else contextlib.nullcontext()
    try:
        with waiting:
            if writes:
                resumed = resumption(conf.resume, sweep_dir, plans, report.recorded, first_launch)
                # only a node that has something to resume asks the others
                asks = multi_node and conf.resume is not False and bool(resumed.recorded)
                if multi_node:  # the nodes that share this sweep dir take node 0's word
                    publish_decision(sweep_dir, holder(sweep_dir), jobs, resumed, asks)
            else:
                timeout_s = float(plans[0].rendezvous.configs.get("join_timeout", _NODE_WAIT_S))
                resumed, asks = take_decision(sweep_dir, holder(sweep_dir), jobs, timeout_s)
                report.recorded.jobs.update(resumed.recorded)
            if asks:
                done, resumed.preempted = agree_on_resumption(
                    plans[0], set(resumed.completed), resumed.preempted
                )
                resumed.completed = {num: ret for num, ret in resumed.completed.items() if num in done}
    except StoppedBeforeJobs as stopped:
        agreeing = "no job had started (the nodes were agreeing on what to resume)"
        if stopped.signum == notice.signum:
            _end_preempted(notice, agreeing, sweep_dir, conf)
        react_to_stop(SweepStopped(stopped.signum), f"the sweep was stopped: {agreeing}")
        raise SweepStopped(stopped.signum) from None
    in_place = continuing_in_place(sweep_dir, plans, resumed)
    for plan in plans:
        plan.resumed = plan.idx in in_place  # where its ranks ran before: a checkpoint may be there
    log_resumption(sweep_dir, resumed, in_place)
    to_run = [plan for plan in plans if plan.idx not in resumed.completed]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    server = checked_warm_server(preload, varying_variables(plans)) if to_run else None
    hydra_context = launcher.hydra_context

    def request_for(plan: JobPlan, job_devices: Optional[List[str]]) -> bytes:
        # the launcher's state as it is now, when the job starts
        return encode_request(
            JobRequest(
                plan=plan,
                config=configs[plan.idx] if writes else without_bookkeeping(configs[plan.idx]),
                hydra_context=hydra_context,
                environ=dict(os.environ),
                cwd=os.getcwd(),
                ignored_signals=ignored_group_signals(),
                devices=job_devices,
                task_error=task_error,
            )
        )

    report.launching(
        plans,
        done=sorted(resumed.completed),
        preempted=sorted(resumed.preempted),
        returned={num: ret.return_value for num, ret in resumed.completed.items()},
    )

    def on_start(plan: JobPlan, job_devices: Optional[List[str]]) -> None:
        on = f" on devices {','.join(job_devices)}" if job_devices is not None else ""
        log.info(f"\t{job_title(plan.idx, plan.overrides)}{on}")
        if writes:
            write_rerun_script(plan, configs[plan.idx], job_devices)
            if not plan.resumed:  # an earlier run's mark: this run's ranks have not started
                (plan.output_dir / RANKS_STARTED_FILE).unlink(missing_ok=True)
        report.started(plan.idx)

    def on_end(plan: JobPlan, job_return: JobReturn, stopped: bool) -> None:
        status = _status_of(job_return, stopped)
        if status == COMPLETED and writes:
            save_return(plan.output_dir, job_return)
        elif status == PREEMPTED:
            notice.received = True  # on a node that got no signal, its job tells it
        # a checkpoint may be in the job dir when its ranks ran now, or in the run resumed
        ranks_ran = plan.resumed or (plan.output_dir / RANKS_STARTED_FILE).exists()
        report.ended(plan.idx, job_return, status, ranks_ran)

    shown_dir = shown_path(str(sweep_dir))
    if to_run:
        log.info(f"Launching {len(to_run)} jobs with torchrun into {shown_dir}")
    else:
        log.info(f"Nothing to launch: all {len(plans)} jobs come from the record in {shown_dir}")
    try:
        ran: Dict[int, JobReturn] = {}
        if server is not None and not notice.received:
            ran = run_jobs(
                server,
                to_run,
                parallel_jobs,
                devices,
                request_for,
                _hard_limit_s,
                on_start,
                on_end,
                notice,
            )
    except SweepStopped as stopped:
        report.log_table()
        react_to_stop(stopped, f"the sweep was stopped: {report.stop_summary()}")
        raise
    report.log_table()  # every launch ends with its table, a one-job launch too: it names the job dir
    if notice.received:
        report.interrupted = True
        report.write()
        _end_preempted(notice, report.stop_summary(), sweep_dir, conf)
    returns = {**resumed.completed, **ran}
    return [returns[plan.idx] for plan in plans]


def _end_preempted(notice: StopNotice, summary: str, sweep_dir: Path, conf: Any) -> None:
    """The sweep ends preempted (`_launcher.preempt.end_preempted`)."""
    assert notice.signum is not None
    end_preempted(notice.signum, summary, shown_path(str(sweep_dir)), conf.resume, conf.requeue, os.environ)


def _status_of(job_return: JobReturn, stopped: bool) -> str:
    """The job's status in the sweep's record."""
    if job_return.status == JobStatus.COMPLETED:
        return COMPLETED
    if isinstance(job_return._return_value, JobPreempted):
        return PREEMPTED
    return STOPPED if stopped else FAILED


def _report_of(launcher: "SweepLauncher", sweep_dir: Path, resuming: bool) -> SweepReport:
    """The launcher's report: one per sweep dir, so a sweeper's batches add up in one file;
    when it may resume, it starts from the record the sweep dir holds."""
    if launcher.report is None or launcher.report.path.parent != sweep_dir:
        record = read_record(sweep_dir) if resuming else Record()
        launcher.report = SweepReport(sweep_dir, record)
    return launcher.report


def _hard_limit_s(plan: JobPlan) -> Optional[float]:
    """After job_timeout, the ranks' shutdown and a margin, the job's process is killed."""
    conf = plan.settings.conf
    if conf.job_timeout is None:
        return None
    return conf.job_timeout + 2 * conf.shutdown_timeout + _STOP_MARGIN_S


def _compose(launcher: "SweepLauncher", overrides: List[str], idx: int) -> DictConfig:
    """The job's config as run_job will see it."""
    assert launcher.hydra_context is not None and launcher.config is not None
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(config):
        config.hydra.job.id = str(idx)  # a str, as Hydra's own launchers write it
        config.hydra.job.num = idx
        # as run_job will set it, so that launcher keys and ranks see ${hydra:runtime.output_dir}
        config.hydra.runtime.output_dir = os.path.abspath(
            os.path.join(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))
        )
    return config


def _checked_settings(config: DictConfig) -> "tuple[JobSettings, Optional[str]]":
    """The job's launcher settings (with what SLURM gives), checked; and the cluster log line."""
    settings, note = resolve_cluster(resolve_settings(config.hydra.launcher), os.environ, _keys_set(config))
    check_node_rank(settings)
    check_supported(settings)
    return settings, note


def _keys_set(config: DictConfig) -> Set[str]:
    """Launcher keys the user gave on the command line (`hydra.launcher.nnodes=1`, `++...`)."""
    keys = set()
    for override in OmegaConf.to_container(config.hydra.overrides.hydra, resolve=False):  # as typed
        name = str(override).lstrip("+~").split("=", 1)[0]
        if name.startswith("hydra.launcher."):
            keys.add(name[len("hydra.launcher.") :])
    return keys


def _plan(
    config: DictConfig,
    settings: JobSettings,
    pickled_task: bytes,
    script: Optional[AppScript],
    sweep_key: str,
) -> JobPlan:
    """What the job's ranks need, captured now: Hydra's global state is this job's only here.

    Called with HydraConfig set to `config`.
    """
    idx = int(config.hydra.job.num)
    output_dir = Path(config.hydra.runtime.output_dir)
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    nproc = local_world_size(settings)
    job_logging = (
        OmegaConf.to_container(config.hydra.job_logging, resolve=True)
        if config.hydra.job_logging is not None
        else None
    )
    overrides = [
        str(o) for o in OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    ]  # as typed
    return JobPlan(
        idx=idx,
        overrides=overrides,
        settings=settings,
        rendezvous=rendezvous_for(settings, sweep_key, idx),
        nproc=nproc,
        output_dir=output_dir,
        payload=RankPayload(
            pickled_task=pickled_task,
            pickled_state=cloudpickle.dumps(Singleton.get_state()),
            task_cfg=task_cfg,
            job_logging=job_logging,  # type: ignore[arg-type]
            job_num=idx,
            overrides=overrides,
            failure_grace_s=2 * settings.conf.monitor_interval + 0.1,
            stop_signal=stop_signal_of(settings.conf),
            script=script,
        ),
        launch_dir=os.getcwd(),
        env_set={
            str(k): str(v)
            for k, v in (OmegaConf.to_container(config.hydra.job.env_set, resolve=True) or {}).items()
        },
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
    for plan in plans:
        if parallel_jobs > 1 and not plan.rendezvous.endpoint.endswith(":0"):
            key = "rdzv_endpoint" if plan.settings.conf.rdzv_endpoint else "master_port"
            raise LauncherConfigError(
                f"hydra.launcher.{key}={getattr(plan.settings.conf, key)} cannot serve "
                f"parallel_jobs={parallel_jobs}: jobs running at once would join one rendezvous; "
                f"leave {key} unset (each job then gets a free port of its own)"
            )
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
