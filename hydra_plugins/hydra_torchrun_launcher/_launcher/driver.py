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
import logging
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Deque, Dict, FrozenSet, Iterator, List, Optional, Protocol, Sequence, Set

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from .._job.launch_config import counted_by_torch, local_world_size, rendezvous_for
from .._job.preempt import JobPreempted
from .._job.process import JobRequest, PickledOnce, encode_request
from .._rank.carried_exception import ended_by_stop
from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.plan import AppScript, JobPlan, JobSettings, RankPayload, stop_signal_of
from .._shared.stop_files import RANKS_STARTED_FILE
from .lock import hold_sweep_lock, holder
from .node_agreement import agree_on_resumption, waiting_for_nodes
from .preempt import (
    StopNotice,
    StoppedBeforeJobs,
    SweepStopped,
    end_preempted,
    exit_if_stopped,
    react_to_stop,
    sigint_ends_the_exit,
)
from .report import COMPLETED, FAILED, PREEMPTED, STOPPED, SweepReport, job_title
from .reproduce import rerun_script, write_rerun_script
from .resume import (
    Record,
    config_targets,
    continuing_in_place,
    fingerprint,
    log_resumption,
    planned_resumption,
    read_record,
    resumption,
    save_return,
    targets_digest,
    task_container,
    task_digest,
)
from .runner import Placement, Runner, SweepDetached
from .settings import shadowed_redirects
from .shared_dir import publish_decision, take_decision
from .sweep_configs import SweepConfigs
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
    sweep_configs: Any


# how long a node that shares node 0's sweep dir waits for its decision (c10d's join_timeout)
_NODE_WAIT_S = 600.0


def launch(
    launcher: SweepLauncher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, runner: Runner
) -> Sequence[JobReturn]:
    """Run the sweep's jobs through `runner`; one JobReturn per job, in job order."""
    try:
        return _launch(launcher, job_overrides, initial_job_idx, runner)
    finally:
        sigint_ends_the_exit()  # before what the launch left to run at exit (its warm server's reaping)


def _launch(
    launcher: SweepLauncher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, runner: Runner
) -> Sequence[JobReturn]:
    exit_if_stopped()
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

    jobs = [PendingJob(initial_job_idx + i, list(overrides)) for i, overrides in enumerate(job_overrides)]
    if not jobs:
        return []
    composer = Composer(launcher, str(sweep_dir.resolve()), runner.job_settings)
    # the first job before anything else: a bad setting common to the sweep stops it here
    first, first_config = composer.compose(jobs[0])
    runner.check_sweep(first)
    conf = first.settings.conf
    if conf.dry_run:
        plans, configs = [first], {first.idx: first_config}
        for job in jobs[1:]:
            plan, configs[job.idx] = composer.compose(job)
            runner.check_job(plan)
            plans.append(plan)
        recorded = planned_resumption(conf.resume, sweep_dir, plans)
        log.info(runner.dry_run(plans, configs, recorded))
        raise SystemExit(0)
    return _Launch(launcher, runner, composer, jobs, (first, first_config), sweep_dir).run()


@dataclass
class PendingJob:
    """A job of the launch before it is composed: what stays of it until it is needed (its
    number and overrides, as the sweeper gave them), not its config."""

    idx: int
    overrides: List[str]
    output_dir: Optional[Path] = None  # known once composed
    fingerprint: str = ""


class Composer:
    """Each job composed when it is needed: its config as run_job will see it, its launcher
    settings resolved from that config (so launcher keys may interpolate swept values) and
    checked (`settings_of(config)`: the settings and a line to log once), its plan made and
    fingerprinted. A bad setting is refused in one line naming the job."""

    def __init__(
        self,
        launcher: SweepLauncher,
        sweep_key: str,
        settings_of: Callable[[DictConfig], "tuple[JobSettings, Optional[str]]"],
    ) -> None:
        assert launcher.task_function is not None
        self.launcher = launcher
        self.sweep_key = sweep_key
        self.settings_of = settings_of
        self.pickled_task, self.task_error = pickle_task(launcher.task_function)
        self.script = app_script(launcher.task_function)
        if self.script is not None and self.script.task_name is not None:
            self.task_error = None  # each rank finds the task by name in the script it runs
        self.task = task_digest(launcher.task_function)
        self.notes: Set[str] = set()
        self.pickled_state = _launch_state()
        # the digest of the project modules each set of `_target_`s names (`targets_digest`)
        self.targets_digests: Dict[FrozenSet[str], str] = {}

    def compose(self, job: PendingJob) -> "tuple[JobPlan, DictConfig]":
        config = _compose(self.launcher, job.overrides, job.idx)
        # HydraConfig holds this job's config while its settings and state are read
        with _hydra_config(config):
            try:
                settings, note = self.settings_of(config)
                plan = _plan(
                    config, settings, self.pickled_task, self.pickled_state, self.script, self.sweep_key
                )
            except (LauncherConfigError, OmegaConfBaseException) as e:
                # a value that does not resolve for this job (`${oc.env:...}` of a swept name) is
                # refused as a bad one is: one line naming the key, not a traceback
                shown = " ".join(filter_overrides(config.hydra.overrides.task)) or "no overrides"
                raise LauncherConfigError(f"job #{job.idx} ({shown}): {_one_line(e)}") from e
        # with the project's modules that the job's `_target_`s name (instantiate imports them later)
        assert self.launcher.task_function is not None
        task = task_container(config)
        targets = config_targets(task)
        if targets not in self.targets_digests:
            self.targets_digests[targets] = targets_digest(self.launcher.task_function, targets)
        plan.fingerprint = fingerprint(
            self.task + self.targets_digests[targets], task, settings.conf, plan.env_set
        )
        for line in (note, shadowed_redirects(settings.conf)):
            if line and line not in self.notes:  # once a sweep
                self.notes.add(line)
                log.info(line)
        return plan, config


class _Launch:
    """One launch once its first job is composed: the sweep dir held, the record read, the
    jobs that do not come from it handed to the runner as it can take them; the driver's
    side of `JobEvents` and the runner's `JobFeed`.

    Jobs are composed just in time (`next`), ahead of the runner by what it can start, so
    the launcher's cost before the first rank does not grow with the sweep. Where a record
    may give jobs (a resumed sweep) or several nodes share the sweep dir, every job is
    composed first instead: what resumes is decided over the whole sweep, as the nodes
    agree on it (`_launcher.resume`). A job whose own settings are refused ends FAILED with
    its one-line refusal; the sweep goes on."""

    def __init__(
        self,
        launcher: SweepLauncher,
        runner: Runner,
        composer: Composer,
        jobs: List[PendingJob],
        first: "tuple[JobPlan, DictConfig]",
        sweep_dir: Path,
    ) -> None:
        self.launcher = launcher
        self.runner = runner
        self.composer = composer
        self.jobs = jobs
        self.first, first_config = first
        self.configs: Dict[int, DictConfig] = {self.first.idx: first_config}
        self.sweep_dir = sweep_dir
        self.notice = runner.notice
        self.conf = self.first.settings.conf
        self.first_launch = launcher.report is None or launcher.report.path.parent != sweep_dir
        # before the record is read: no other launcher of this node works in this sweep dir
        self.sharing = runner.launchers_sharing_dir(self.first)
        slot = hold_sweep_lock(sweep_dir, self.sharing)
        self.writes = slot == 0  # one node keeps the record of a sweep dir the nodes share
        self.slot = slot
        self.first.node_slot = slot
        self.report = _report_of(launcher, sweep_dir, self.conf.resume is not False)
        self.report.writes = self.writes
        self.report.names_hosts = runner.names_hosts
        # jobs for the runner: composed ones first, then those composed when asked for
        self.ready: Deque[JobPlan] = deque()
        self.pending: Deque[PendingJob] = deque()
        # the JobReturns of jobs refused, or taken from the record
        self.returns: Dict[int, JobReturn] = {}
        # Hydra's context (config loader, callbacks) as every job's request carries it
        self.hydra_context = PickledOnce(launcher.hydra_context)

    def run(self) -> List[JobReturn]:
        """Resume what the record has done, run the rest; a stop signal ends the sweep."""
        report, sweep_dir = self.report, self.sweep_dir
        if self._composes_all_first():
            plans = self._compose_all()
            resumed = self._resumption(plans)
            in_place = continuing_in_place(sweep_dir, plans, resumed)
            for plan in plans:
                plan.resumed = plan.idx in in_place  # where its ranks ran before: a checkpoint may be there
            log_resumption(sweep_dir, resumed, in_place, self.runner.held_over(plans))
            self.returns.update(resumed.completed)
            self.ready.extend(plan for plan in plans if plan.idx not in resumed.completed)
            done, preempted = sorted(resumed.completed), sorted(resumed.preempted)
            composed = {plan.idx: plan for plan in plans}
            report.launching(
                [composed.get(job.idx, job) for job in self.jobs],
                done=done,
                preempted=preempted,
                returned={num: ret.return_value for num, ret in resumed.completed.items()},
            )
            for job in self.jobs:  # the jobs refused as they were composed
                if job.idx not in composed:
                    self._refuse(job, self.returns[job.idx])
        else:
            self.ready.append(self.first)
            self.pending.extend(self.jobs[1:])
            report.launching([self.first, *self.pending])
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if not self.ready and not self.pending:
            shown = shown_path(str(sweep_dir))
            every = "its only job comes" if len(self.jobs) == 1 else f"all {len(self.jobs)} jobs come"
            log.info(f"Nothing to launch: {every} from the record in {shown}")
        exit_if_stopped()  # the last moment before a job may start
        try:
            ran = self.runner.run(self, self) if self.ready or self.pending else {}
        except SweepStopped as stopped:
            report.log_table()
            react_to_stop(stopped, f"{self.runner.stopped_words()}{report.stop_summary()}")
            raise
        except SweepDetached as detached:
            report.write()
            log.info(str(detached))
            raise SystemExit(0) from None
        report.log_table()  # every launch ends with its table, a one-job launch too: it names the job dir
        if self.notice is not None and self.notice.received:
            report.interrupted = True
            report.write()
            _end_preempted(self.notice, report.stop_summary(), sweep_dir, self.conf)
        exit_if_stopped()  # a stop after every job had ended, as the runner let its processes go
        returns = {**self.returns, **ran}
        return [returns[job.idx] for job in self.jobs]

    def _composes_all_first(self) -> bool:
        """Whether what runs is decided over the whole sweep before any job runs: a record
        that may give jobs, or nodes that must agree on it."""
        return (
            self.sharing > 1
            or (self.conf.resume is not False and bool(self.report.recorded.jobs))
            or (self.conf.resume is True)
        )

    def _compose_all(self) -> List[JobPlan]:
        """Every job composed now; a job refused is kept aside (`returns`) to end FAILED."""
        plans = [self.first]
        for job in self.jobs[1:]:
            plan = self._composed(job)
            if plan is not None:
                plans.append(plan)
        return plans

    def _composed(self, job: PendingJob) -> Optional[JobPlan]:
        """The job composed and checked; None when refused (its JobReturn kept aside)."""
        try:
            plan, config = self.composer.compose(job)
            self.runner.check_job(plan)
        except LauncherConfigError as e:
            refused = JobReturn(status=JobStatus.FAILED, overrides=job.overrides)
            refused.return_value = e
            self.returns[job.idx] = refused
            return None
        plan.node_slot = self.slot
        self.configs[plan.idx] = config
        return plan

    def _refuse(self, job: PendingJob, refused: JobReturn) -> None:
        """A job whose settings were refused: FAILED with its one line, the sweep goes on."""
        self.report.started(job.idx)
        self.report.ended(job.idx, refused, FAILED)

    # -- JobFeed: the jobs for the runner, as it can take them ----------------------------

    def next(self) -> Optional[JobPlan]:
        """The next job to run, composed now if it was not; None when there is none left."""
        if self.ready:
            return self.ready.popleft()
        while self.pending:
            job = self.pending.popleft()
            plan = self._composed(job)
            if plan is None:
                self._refuse(job, self.returns[job.idx])
                continue
            self.report.composed(plan)
            return plan
        return None

    def left(self) -> int:
        return len(self.ready) + len(self.pending)

    def _resumption(self, plans: List[JobPlan]) -> Any:
        """What the record has done or stopped of this launch's jobs; the nodes that share a
        sweep dir take node 0's word, and agree on what their own job dirs hold."""
        conf, sweep_dir, notice = self.conf, self.sweep_dir, self.notice
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
        self,
        plan: JobPlan,
        devices: Optional[List[str]],
        environ: Dict[str, str],
        ignored_signals: List[int],
        placed: Optional[Placement] = None,
    ) -> bytes:
        data, write_job_files = self.request_ahead(plan, devices, environ, ignored_signals, placed)
        write_job_files()
        return data

    def request_ahead(
        self,
        plan: JobPlan,
        devices: Optional[List[str]],
        environ: Dict[str, str],
        ignored_signals: List[int],
        placed: Optional[Placement] = None,
    ) -> "tuple[bytes, Callable[[], None]]":
        config = self.configs.pop(plan.idx)  # kept no longer than needed: a sweep may hold thousands
        rerun = rerun_script(plan, config, devices, placed) if self.writes else None

        def write_job_files() -> None:
            if rerun is not None:
                write_rerun_script(plan, rerun)
            if not plan.resumed:  # an earlier run's mark: this run's ranks have not started
                (plan.output_dir / RANKS_STARTED_FILE).unlink(missing_ok=True)

        return encode_request(
            JobRequest(
                plan=plan,
                config=config,
                hydra_context=self.hydra_context,  # type: ignore[arg-type]
                environ=environ,
                cwd=os.getcwd(),
                ignored_signals=ignored_signals,
                devices=devices,
                task_error=self.composer.task_error,
                bookkeeping=self.writes,
            )
        ), write_job_files

    def started(self, plan: JobPlan, detail: Optional[str], hosts: Optional[List[str]] = None) -> None:
        line = f"\t{job_title(plan.idx, plan.overrides)}{detail}" if detail is not None else None
        self.report.started(plan.idx, line=line, hosts=hosts)  # on a terminal, the progress line tells it

    def running(self, plan: JobPlan, since: float) -> None:
        self.report.started(plan.idx, at=since)

    def ended(self, plan: JobPlan, job_return: JobReturn, stopped: bool) -> None:
        if job_return.overrides is None:  # a job whose process died before it could return one
            job_return.overrides = list(plan.overrides)  # Hydra's last word names the job's
        status = _status_of(job_return, stopped)
        if status == COMPLETED and self.writes:
            save_return(plan.output_dir, job_return)
        elif status == PREEMPTED and self.notice is not None:
            self.notice.received = True  # on a node that got no signal, its job tells it
        # a checkpoint may be in the job dir when its ranks ran now, or in the run resumed
        ranks_ran = plan.resumed or (plan.output_dir / RANKS_STARTED_FILE).exists()
        self.configs.pop(plan.idx, None)
        self.report.ended(plan.idx, job_return, status, ranks_ran)


def _one_line(error: Exception) -> str:
    """A refusal's line: OmegaConf's message names its key on a line of its own."""
    if isinstance(error, LauncherConfigError):
        return str(error)
    key = getattr(error, "full_key", None)
    first = str(error).split("\n", 1)[0].strip()
    return f"{key}: {first}" if key else first


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
    said = ended_by_stop(job_return)  # the job's own word: a stop ended it, or its failure came first
    if said is not None:
        return STOPPED if said else FAILED
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
    if launcher.sweep_configs is None or launcher.sweep_configs.master is not launcher.config:
        launcher.sweep_configs = SweepConfigs(launcher.hydra_context.config_loader, launcher.config)
    config = launcher.sweep_configs.compose(overrides)
    with open_dict(config):
        config.hydra.job.id = str(idx)  # a str, as Hydra's own launchers write it
        config.hydra.job.num = idx
        # as run_job will set it, so that launcher keys and ranks see ${hydra:runtime.output_dir}
        config.hydra.runtime.output_dir = os.path.abspath(
            os.path.join(str(config.hydra.sweep.dir), str(config.hydra.sweep.subdir))
        )
    return config


def _launch_state() -> Optional[bytes]:
    """Hydra's Singleton state but HydraConfig, cloudpickled once for the launch's jobs (each
    job's HydraConfig travels beside it): capturing the whole state for every job cost a
    deep copy of the ConfigStore and its pickling, 0.02 s a job. None where the state is
    not as Hydra 1.3/1.4 keep it (each job's whole state is captured then)."""
    state = Singleton.get_state()
    instances = state.get("instances") if isinstance(state, dict) else None
    if not isinstance(instances, dict):
        return None
    return cloudpickle.dumps(
        {**state, "instances": {k: v for k, v in instances.items() if k is not HydraConfig}}
    )


def _plan(
    config: DictConfig,
    settings: JobSettings,
    pickled_task: bytes,
    launch_state: Optional[bytes],
    script: Optional[AppScript],
    sweep_key: str,
) -> JobPlan:
    """What the job's ranks need, captured now: Hydra's global state is this job's only here.

    Called with HydraConfig set to `config`.
    """
    idx = int(config.hydra.job.num)
    output_dir = Path(config.hydra.runtime.output_dir)
    # 0: counted by each host's torch as the node starts there (`JobSettings.on_hosts`)
    nproc = 0 if settings.on_hosts and counted_by_torch(settings) else local_world_size(settings)
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
            pickled_state=launch_state or cloudpickle.dumps(Singleton.get_state()),
            task_cfg=None,  # with HydraConfig, the job's process makes it as run_job does
            job_logging=job_logging,  # type: ignore[arg-type]
            job_num=idx,
            overrides=overrides,
            failure_grace_s=2 * settings.conf.monitor_interval + 0.1,
            stop_signal=stop_signal_of(settings.conf),
            script=script,
        ),
        launch_dir=os.getcwd(),
        env_set=_env_set(config),
    )


def _env_set(config: DictConfig) -> Dict[str, str]:
    """`hydra.job.env_set`, resolved where Hydra's run_job resolves it: in HydraConfig's copy
    of the `hydra` node alone, where a value naming a key of the task's config (`${lr}`) is
    not found, and the basic launcher's sweep stops on it. The copy is made only for a value
    that interpolates at all."""
    env_set = config.hydra.job.env_set
    if any(OmegaConf.is_interpolation(env_set, key) for key in env_set):
        env_set = OmegaConf.masked_copy(config, "hydra").hydra.job.env_set
    return {str(k): str(v) for k, v in (OmegaConf.to_container(env_set, resolve=True) or {}).items()}


@contextlib.contextmanager
def _hydra_config(config: DictConfig) -> Iterator[None]:
    """HydraConfig holding one job's config for a moment, so that `${hydra:...}` in its
    launcher keys reads the job's. The config itself, not the read-only copy of its `hydra`
    node that `HydraConfig.set_config` makes (a deep copy, every job): the job's process
    sets HydraConfig as run_job does."""
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().cfg = config  # type: ignore[assignment]
    try:
        yield
    finally:
        HydraConfig.instance().cfg = previous
