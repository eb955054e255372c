"""The sweep driver: one launch of every launcher, whatever runs its jobs.

Every launcher (`torchrun`, `torchrun_slurm`) goes through `launch`: compose each job and
resolve its launcher settings from its own config (so launcher keys may interpolate swept
values) and check them, so a bad setting stops the sweep before any process starts; hold
the sweep dir; read the record and decide what resumes; hand the jobs to a runner
(`_launcher.runner`), recording and reporting what comes back; end on a stop signal. The
runner knows only how to run jobs somewhere (the local pool of job processes, SLURM).
Hydra's joblib launcher is the model: its `_core.launch` owns the lifecycle.
"""

import contextlib
import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from .._job.launch_config import local_world_size, rendezvous_for
from .._job.preempt import JobPreempted
from .._job.process import JobRequest, encode_request, without_bookkeeping
from .._shared.errors import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.plan import AppScript, JobPlan, JobSettings, RankPayload, stop_signal_of
from .._shared.stop_files import RANKS_STARTED_FILE
from .lock import hold_sweep_lock, holder
from .node_agreement import agree_on_resumption, waiting_for_nodes
from .preempt import StopNotice, StoppedBeforeJobs, SweepStopped, end_preempted, react_to_stop
from .report import COMPLETED, FAILED, PREEMPTED, STOPPED, SweepReport, job_title
from .reproduce import write_rerun_script
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
from .runner import Runner
from .settings import shadowed_redirects
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


def launch(
    launcher: SweepLauncher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, runner: Runner
) -> Sequence[JobReturn]:
    """Run the sweep's jobs through `runner`; one JobReturn per job, in job order."""
    setup_globals()
    assert launcher.config is not None
    assert launcher.hydra_context is not None
    assert launcher.task_function is not None
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    notice = runner.notice
    if notice is not None and notice.received:
        if launcher.report is not None:
            launcher.report.interrupted = True
            launcher.report.write()
        started = "no job of the next batch had started" if launcher.report else "no job had started"
        _end_preempted(notice, started, sweep_dir, launcher.config.hydra.launcher)

    composed = compose_plans(
        launcher, job_overrides, initial_job_idx, str(sweep_dir.resolve()), runner.job_settings
    )
    plans = composed.plans
    if not plans:
        return []
    runner.check_sweep(plans)
    conf = plans[0].settings.conf
    if conf.dry_run:
        recorded = planned_resumption(conf.resume, sweep_dir, plans)
        log.info(runner.dry_run(plans, composed.configs, recorded))
        raise SystemExit(0)
    return _Launch(launcher, runner, composed, sweep_dir).run()


@dataclass
class ComposedSweep:
    """The jobs of one launch, composed and checked, before any of them runs."""

    plans: List[JobPlan]
    configs: Dict[int, DictConfig]
    task_error: Optional[str]  # why the task function cannot travel to the ranks


def compose_plans(
    launcher: SweepLauncher,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    sweep_key: str,
    settings_of: Callable[[DictConfig], "tuple[JobSettings, Optional[str]]"],
) -> ComposedSweep:
    """Every job composed, its launcher settings resolved from its own config and checked
    (`settings_of(config)`: the settings and a line to log once), and its plan made: a bad
    setting stops the sweep before any process starts."""
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


class _Launch:
    """One launch after its jobs are composed: the sweep dir held, the record read, the jobs
    that do not come from it handed to the runner; the driver's side of `JobEvents`."""

    def __init__(self, launcher: SweepLauncher, runner: Runner, composed: ComposedSweep, sweep_dir: Path):
        self.launcher = launcher
        self.runner = runner
        self.plans = composed.plans
        self.configs = composed.configs
        self.task_error = composed.task_error
        self.sweep_dir = sweep_dir
        self.notice = runner.notice
        self.conf = self.plans[0].settings.conf
        self.first_launch = launcher.report is None or launcher.report.path.parent != sweep_dir
        # before the record is read: no other launcher of this node works in this sweep dir
        self.sharing = runner.launchers_sharing_dir(self.plans[0])
        slot = hold_sweep_lock(sweep_dir, self.sharing)
        self.writes = slot == 0  # one node keeps the record of a sweep dir the nodes share
        for plan in self.plans:
            plan.node_slot = slot
        self.report = _report_of(launcher, sweep_dir, self.conf.resume is not False)
        self.report.writes = self.writes

    def run(self) -> List[JobReturn]:
        """Resume what the record has done, run the rest; a stop signal ends the sweep."""
        plans, report, sweep_dir = self.plans, self.report, self.sweep_dir
        resumed = self._resumption()
        in_place = continuing_in_place(sweep_dir, plans, resumed)
        for plan in plans:
            plan.resumed = plan.idx in in_place  # where its ranks ran before: a checkpoint may be there
        log_resumption(sweep_dir, resumed, in_place)
        to_run = [plan for plan in plans if plan.idx not in resumed.completed]
        sweep_dir.mkdir(parents=True, exist_ok=True)
        report.launching(
            plans,
            done=sorted(resumed.completed),
            preempted=sorted(resumed.preempted),
            returned={num: ret.return_value for num, ret in resumed.completed.items()},
        )
        if not to_run:
            shown = shown_path(str(sweep_dir))
            log.info(f"Nothing to launch: all {len(plans)} jobs come from the record in {shown}")
        try:
            ran = self.runner.run(to_run, self) if to_run else {}
        except SweepStopped as stopped:
            report.log_table()
            react_to_stop(stopped, f"{self.runner.stopped_words()}{report.stop_summary()}")
            raise
        report.log_table()  # every launch ends with its table, a one-job launch too: it names the job dir
        if self.notice is not None and self.notice.received:
            report.interrupted = True
            report.write()
            _end_preempted(self.notice, report.stop_summary(), sweep_dir, self.conf)
        returns = {**resumed.completed, **ran}
        return [returns[plan.idx] for plan in plans]

    def _resumption(self) -> Any:
        """What the record has done or stopped of this launch's jobs; the nodes that share a
        sweep dir take node 0's word, and agree on what their own job dirs hold."""
        plans, conf, sweep_dir, notice = self.plans, self.conf, self.sweep_dir, self.notice
        multi_node = self.sharing > 1
        if multi_node and self.first_launch:
            log.info(waiting_for_nodes(plans[0]))
        jobs = [plan.idx for plan in plans]
        # a node that never comes would keep the others waiting: a stop ends the wait at once
        waiting = notice.interrupting() if multi_node and notice is not None else contextlib.nullcontext()
        try:
            with waiting:
                if self.writes:
                    recorded = self.report.recorded
                    resumed = resumption(conf.resume, sweep_dir, plans, recorded, self.first_launch)
                    # only a node that has something to resume asks the others
                    asks = multi_node and conf.resume is not False and bool(resumed.recorded)
                    if multi_node:  # the nodes that share this sweep dir take node 0's word
                        publish_decision(sweep_dir, holder(sweep_dir), jobs, resumed, asks)
                else:
                    timeout_s = float(plans[0].rendezvous.configs.get("join_timeout", _NODE_WAIT_S))
                    resumed, asks = take_decision(sweep_dir, holder(sweep_dir), jobs, timeout_s)
                    self.report.recorded.jobs.update(resumed.recorded)
                if asks:
                    done, resumed.preempted = agree_on_resumption(
                        plans[0], set(resumed.completed), resumed.preempted
                    )
                    resumed.completed = {num: ret for num, ret in resumed.completed.items() if num in done}
        except StoppedBeforeJobs as stopped:
            agreeing = "no job had started (the nodes were agreeing on what to resume)"
            if notice is not None and stopped.signum == notice.signum:
                _end_preempted(notice, agreeing, sweep_dir, conf)
            react_to_stop(SweepStopped(stopped.signum), f"the sweep was stopped: {agreeing}")
            raise SweepStopped(stopped.signum) from None
        return resumed

    # -- JobEvents: what the runner tells of its jobs ---------------------------------------

    def request(
        self, plan: JobPlan, devices: Optional[List[str]], environ: Dict[str, str], ignored_signals: List[int]
    ) -> bytes:
        config = self.configs[plan.idx]
        if self.writes:
            write_rerun_script(plan, config, devices)
        if not plan.resumed:  # an earlier run's mark: this run's ranks have not started
            (plan.output_dir / RANKS_STARTED_FILE).unlink(missing_ok=True)
        assert self.launcher.hydra_context is not None
        return encode_request(
            JobRequest(
                plan=plan,
                config=config if self.writes else without_bookkeeping(config),
                hydra_context=self.launcher.hydra_context,
                environ=environ,
                cwd=os.getcwd(),
                ignored_signals=ignored_signals,
                devices=devices,
                task_error=self.task_error,
            )
        )

    def started(self, plan: JobPlan, detail: Optional[str]) -> None:
        if detail is not None:
            log.info(f"\t{job_title(plan.idx, plan.overrides)}{detail}")
        self.report.started(plan.idx)

    def running(self, plan: JobPlan, since: float) -> None:
        self.report.started(plan.idx, at=since)

    def ended(self, plan: JobPlan, job_return: JobReturn, stopped: bool) -> None:
        status = _status_of(job_return, stopped)
        if status == COMPLETED and self.writes:
            save_return(plan.output_dir, job_return)
        elif status == PREEMPTED and self.notice is not None:
            self.notice.received = True  # on a node that got no signal, its job tells it
        # a checkpoint may be in the job dir when its ranks ran now, or in the run resumed
        ranks_ran = plan.resumed or (plan.output_dir / RANKS_STARTED_FILE).exists()
        self.report.ended(plan.idx, job_return, status, ranks_ran)


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


def _report_of(launcher: SweepLauncher, sweep_dir: Path, resuming: bool) -> SweepReport:
    """The launcher's report: one per sweep dir, so a sweeper's batches add up in one file;
    when it may resume, it starts from the record the sweep dir holds."""
    if launcher.report is None or launcher.report.path.parent != sweep_dir:
        record = read_record(sweep_dir) if resuming else Record()
        launcher.report = SweepReport(sweep_dir, record)
    return launcher.report


def _compose(launcher: SweepLauncher, overrides: List[str], idx: int) -> DictConfig:
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


@contextlib.contextmanager
def _hydra_config(config: DictConfig) -> Iterator[None]:
    """HydraConfig set to one job's config for a moment (interpolations, state capture)."""
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = previous
