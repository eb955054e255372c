"""The SLURM runner of `hydra/launcher=torchrun_slurm`: every sweep job a SLURM job.

The sweep driver (`_launcher.driver`) composes and checks the jobs and keeps the record, as
for the local runner; this runner submits them, an array per group of jobs that share their
sbatch options, and waits on them.
Each job's request lies in the sweep's private `.slurm/` dir; the ids SLURM gives are
recorded there before the launcher waits, so a launcher killed with -9 and started again
takes its jobs back instead of submitting them twice. Waiting reads the result files node 0
writes (the filesystem, not slurmctld) and asks `squeue` about all the jobs in one call, at
intervals that grow to POLL_MAX_S. A job that ends without a result is FAILED with
SLURM's own state and reason. Ctrl-C or SIGTERM cancels the sweep's jobs (`scancel`).
"""

import logging
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import cloudpickle
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from .._job.failure_report import failed_return
from .._job.launch_config import check_supported
from .._job.preempt import JobPreempted
from .._launcher.preempt import SweepStopped
from .._launcher.report import jobs_counted, slurm_ids
from .._launcher.resume import PlannedResumption
from .._launcher.runner import JobEvents, JobFeed, SweepDetached
from .._shared import slurm_commands
from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.plan import JobPlan, JobSettings
from .._shared.signals import handled_by
from .._shared.slurm_commands import ENDED_STATES, JobState, SlurmCommandError
from .batch_script import batch_script
from .files import (
    RUN_TIME_ATTR,
    failure_file,
    latest_runs,
    output_file,
    read_private,
    read_submitted,
    replace_private,
    request_file,
    requeued_file,
    result_file,
    slurm_dir,
    write_submitted,
)
from .never_starts import never_starts
from .options import SlurmOptions, split_launcher_config

log = logging.getLogger(__name__)

# how often the result files are looked at (the filesystem: no load on slurmctld)
RESULT_CHECK_S = 0.5
# squeue's interval: from the first to the last, growing by the factor at every call (a
# sweep's results come from the files, so squeue only tells starts, pending reasons and
# jobs that ended without a result): a few calls a minute, whatever the number of jobs
POLL_FIRST_S = 1.0
POLL_MAX_S = 15.0
POLL_GROWTH = 1.5
# a job seen ended without a result is asked about again this soon, to be sure of it
POLL_CONFIRM_S = 2.0
# jobs are submitted as they are composed: a first chunk at once, then chunks twice as large
FIRST_CHUNK = 8
MAX_CHUNK = 256


class SlurmRunner:
    """`hydra/launcher=torchrun_slurm`'s runner (`_launcher.runner.Runner`)."""

    # the stop signal is SLURM's to send to the jobs' nodes: the launcher takes no notice
    notice = None
    # SLURM names a job's nodes (squeue), not the launcher
    names_hosts = False

    def __init__(self, launcher: Any) -> None:
        self.sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
        # submit every job, record it, end: the jobs run on without the launcher
        self.detach = OmegaConf.select(launcher.config, "hydra.launcher.detach", default=False) is True
        if self.detach:
            _check_detachable(launcher.config)
        # each job's sbatch options, as its config said
        self.options: Dict[int, SlurmOptions] = {}
        self.cancelled = ""
        # the recorded jobs SLURM still has (`_alive`), once asked
        self.alive: Any = _UNKNOWN

    def job_settings(self, config: DictConfig) -> "tuple[JobSettings, Optional[str]]":
        settings, slurm = split_launcher_config(config.hydra.launcher)
        check_supported(settings)
        self.options[int(config.hydra.job.num)] = slurm
        return settings, None

    def check_sweep(self, first: JobPlan) -> None:
        """Every job's sbatch options are its own: nothing to agree on across them."""

    def check_job(self, plan: JobPlan) -> None:
        """As `check_sweep`."""

    def launchers_sharing_dir(self, first: JobPlan) -> int:
        return 1  # the launcher on the login node alone; the nodes write only their job's files

    def dry_run(self, plans: Sequence[JobPlan], configs: Dict[int, DictConfig], recorded: Any) -> str:
        return _dry_run(list(plans), self.options, self.sweep_dir, recorded)

    def held_over(self, plans: Sequence[JobPlan]) -> Set[int]:
        """The recorded SLURM jobs of these plans that `run` takes back (`_Sweep.taken_back`):
        submitted by an earlier command for the same job, still queued or running, or with
        their result in. One `squeue` call, whose answer `run` uses again."""
        submitted = read_submitted(slurm_dir(self.sweep_dir))
        self.alive = _alive(slurm_dir(self.sweep_dir), submitted)
        return {plan.idx for plan in plans if _takes_back(submitted.get(str(plan.idx)), plan, self.alive)}

    def run(self, jobs: JobFeed, events: JobEvents) -> Dict[int, JobReturn]:
        """Submit the jobs in chunks as they are composed (the first within moments, however
        many the sweep has), then wait for them all."""
        sweep = _Sweep(slurm_dir(self.sweep_dir), events, self.detach)
        sweep.alive = self.alive
        with handled_by(sweep.stop, [signal.SIGINT, signal.SIGTERM]):
            try:
                size = FIRST_CHUNK
                while True:
                    chunk = _chunk(jobs, size)
                    if not chunk:
                        break
                    sweep.submit(chunk, self.options, str(self.sweep_dir))
                    size = min(MAX_CHUNK, size * 2)
                if self.detach:
                    raise SweepDetached(sweep.detached_words(shown_path(str(self.sweep_dir))))
                return sweep.wait()
            except SweepStopped:
                self.cancelled = sweep.cancel()
                raise

    def stopped_words(self) -> str:
        return f"cancelled {self.cancelled}; "


_UNKNOWN = object()


def _asked(slurm: SlurmOptions) -> str:
    """The sbatch options a job asked for, as `key=value` (what SLURM's refusal is about)."""
    asked = [f"nodes={slurm.nodes}"]
    asked += [key if value is None else f"{key}={value}" for key, value in slurm.directives]
    return " ".join(asked)


def _check_detachable(config: DictConfig) -> None:
    """`detach` submits the whole sweep at once and returns nothing to the sweeper: only
    Hydra's basic sweeper, launching every job in one batch, is content with that."""
    sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
    if not sweeper.endswith("BasicSweeper"):
        raise LauncherConfigError(
            f"hydra.launcher.detach=true cannot serve the sweeper {sweeper or '(none)'}: it needs its jobs' "
            "results before it launches more (an Optuna study does), and a detached sweep has none yet; "
            "run it without detach (the launcher then waits on the login node), or use Hydra's basic sweeper"
        )
    if OmegaConf.select(config, "hydra.sweeper.max_batch_size", default=None) is not None:
        raise LauncherConfigError(
            "hydra.launcher.detach=true submits every job of the sweep at once: "
            "unset hydra.sweeper.max_batch_size (its later batches would never be launched)"
        )


def _chunk(jobs: JobFeed, size: int) -> List[JobPlan]:
    """Up to `size` jobs of `jobs`, composed now."""
    chunk: List[JobPlan] = []
    while len(chunk) < size:
        plan = jobs.next()
        if plan is None:
            break
        chunk.append(plan)
    return chunk


class _Sweep:
    """The sweep's SLURM jobs: submitted, watched, collected, or cancelled."""

    def __init__(self, directory: Path, events: JobEvents, detach: bool = False) -> None:
        self.directory = directory
        self.events = events
        self.detach = detach
        # jobs taken back from an earlier command, and those of them it submitted detached
        self.taken_back: Set[int] = set()
        self.detached: Set[int] = set()
        # the jobs of this launch, by number
        self.plans: Dict[int, JobPlan] = {}
        # job number -> SLURM id (`<array>_<number>`) of the jobs not collected yet
        self.slurm_ids: Dict[int, str] = {}
        self.submitted = read_submitted(directory)
        # jobs ended since `submitted` was last written, to report once it is (`_report_ended`)
        self.ended: List[Tuple[int, JobReturn, bool]] = []
        # the recorded jobs of an earlier run that SLURM still has (`_still_there`), asked once
        self.alive: Any = _UNKNOWN
        self.stop_signum: Optional[int] = None
        # every job's JobReturn as it ends (one sbatch refused, at once)
        self.returns: Dict[int, JobReturn] = {}
        # what the last line said of each job (state, and reason or nodes)
        self.shown: Dict[int, Tuple[str, str]] = {}
        # jobs a poll saw ended (or gone) without a result: the next poll decides
        self.ending: Set[int] = set()
        # jobs seen running: seen running again, they were requeued
        self.ran: Set[int] = set()
        # what each job's requeue file said when last read
        self.requeues: Dict[int, str] = {}
        # each job's overrides: the JobReturn of a job that ended without a result names them
        self.overrides: Dict[int, List[str]] = {}
        # each job's latest run whose failure SLURM superseded by requeueing the job itself
        self.superseded: Dict[int, int] = {}
        # when a job's result is looked at again, where scontrol could not say if it is final
        self.judge_after: Dict[int, float] = {}
        # each job's node count (a pending reason may say it is more than its partition has)
        self.nodes: Dict[int, int] = {}

    def _array(self, idx: int) -> str:
        """The SLURM array the job was submitted in: its run's files are named by it."""
        return self.slurm_ids[idx].split("_")[0]

    def stop(self, signum: int, frame: Any) -> None:
        if self.stop_signum is None:
            self.stop_signum = signum

    def _check_stop(self) -> None:
        if self.stop_signum is not None:
            raise SweepStopped(self.stop_signum)

    # -- submission -----------------------------------------------------------------------

    def submit(self, plans: List[JobPlan], options: Dict[int, SlurmOptions], sweep_dir: str) -> None:
        """Submit what is not in flight already; record every id before waiting."""
        fresh: List[JobPlan] = []
        stale: List[str] = []
        gone: List[str] = []
        if self.alive is _UNKNOWN:  # one squeue for the whole sweep's recorded jobs
            self.alive = _alive(self.directory, self.submitted)
        alive = self.alive
        for plan in plans:
            self.plans[plan.idx] = plan
            self.overrides[plan.idx] = list(plan.overrides)
            self.nodes[plan.idx] = options[plan.idx].nodes
            known = self.submitted.get(str(plan.idx))
            if _same_job(known, plan):
                assert known is not None
                if not _takes_back(known, plan, alive):
                    gone.append(known["slurm_id"])  # cancelled or lost: it runs again
                    fresh.append(plan)
                    continue
                self.slurm_ids[plan.idx] = known["slurm_id"]
                self.taken_back.add(plan.idx)
                if known.get("detached"):
                    self.detached.add(plan.idx)
                self.events.started(plan, f" : SLURM job {known['slurm_id']}, submitted before")
                continue
            if known:
                stale.append(known["slurm_id"])
            fresh.append(plan)
        if stale:
            said = slurm_commands.scancel(stale)
            log.info(
                f"Cancelled SLURM job(s) {', '.join(stale)} of an earlier run of another sweep{_said(said)}"
            )
        if gone:
            log.info(
                f"SLURM job(s) {', '.join(gone)} of an earlier run ended without a result: submitted again"
            )
        if fresh:
            log.info(f"Submitting {jobs_counted(len(fresh))} to SLURM into {shown_path(sweep_dir)}")
        for plan in fresh:
            # each node's own environment, as sbatch exported this one's; SLURM's devices
            replace_private(request_file(self.directory, plan.idx), self.events.request(plan, None, {}, []))
        for slurm, group in arrays(fresh, options).items():
            self._check_stop()
            jobs = [plan.idx for plan in group]
            script = self.directory / f"jobs{jobs[0]}.sbatch"
            replace_private(script, batch_script(slurm, jobs, self.directory, sweep_dir).encode())
            try:
                array_id = slurm_commands.sbatch(script)
            except (SlurmCommandError, OSError) as e:
                asked = _asked(slurm)  # SLURM's words do not say which value it refused
                for plan in group:
                    self.events.started(plan, None)
                    self._end(plan.idx, failed_return(f"sbatch refused job #{plan.idx} ({asked}): {e}"))
                self._report_ended()
                continue
            for plan in group:
                slurm_id = f"{array_id}_{plan.idx}"
                self.slurm_ids[plan.idx] = slurm_id
                self.submitted[str(plan.idx)] = {"slurm_id": slurm_id, "fingerprint": plan.fingerprint}
                if self.detach:  # never cancelled by a later command's Ctrl-C
                    self.submitted[str(plan.idx)]["detached"] = True
                    self.detached.add(plan.idx)
            # recorded before anything else: a launcher killed from here on leaves no job unrecorded
            write_submitted(self.directory, self.submitted)
            for plan in group:  # until SLURM starts it, its time counts from here
                self.events.started(plan, f" : SLURM job {self.slurm_ids[plan.idx]}")

    # -- waiting --------------------------------------------------------------------------

    def wait(self) -> Dict[int, JobReturn]:
        """Every job's JobReturn (those sbatch refused included), collected as each ends."""
        by_idx = self.plans
        interval = POLL_FIRST_S
        next_poll = time.monotonic()
        while self.slurm_ids:
            self._check_stop()
            runs = latest_runs(self.directory)
            try:
                for idx in list(self.slurm_ids):
                    attempt = self._new_run(runs, idx, "result")
                    if attempt is not None:
                        self._judge(by_idx[idx], attempt)
                    else:
                        self._note_requeue(idx)
                if self.slurm_ids and time.monotonic() >= next_poll:
                    self._poll(by_idx)
                    interval = min(POLL_MAX_S, interval * POLL_GROWTH)
                    wait_s = min(interval, POLL_CONFIRM_S) if self.ending else interval
                    next_poll = time.monotonic() + wait_s
            finally:
                self._report_ended()
            if self.slurm_ids:
                time.sleep(RESULT_CHECK_S)
        return self.returns

    def _new_run(self, runs: Dict[Tuple[int, str, str], int], idx: int, kind: str) -> Optional[int]:
        """The latest run of the job that wrote a `kind` file, unless SLURM ran it again since."""
        attempt = runs.get((idx, self._array(idx), kind))
        return attempt if attempt is not None and attempt > self.superseded.get(idx, -1) else None

    def _judge(self, plan: JobPlan, attempt: int) -> None:
        """The result a run of the job wrote: the job's, unless it failed and SLURM requeued
        the job itself (a node failure, `scontrol requeue`, a preemption): then the job runs
        again, continuing in its job dir, and the launcher follows it."""
        idx = plan.idx
        if time.monotonic() < self.judge_after.get(idx, 0.0):
            return
        path = result_file(self.directory, idx, self._array(idx), attempt)
        job_return = self._read(path)
        if job_return.status == JobStatus.COMPLETED or self._run_is_over(idx, attempt):
            self._collect(plan, job_return)

    def _run_is_over(self, idx: int, attempt: int) -> bool:
        """Whether run `attempt` of the job is its last: SLURM did not requeue the job after it.
        SLURM counts a requeue (Restarts) before it stops the run's processes, so a run that
        failed because SLURM stopped it to requeue it shows a higher count already."""
        slurm_id = self.slurm_ids[idx]
        try:
            found = slurm_commands.job_run(slurm_id)
        except SlurmCommandError as e:  # the result is judged again a little later
            log.warning(f"scontrol show job {slurm_id}: {e}; asking again later")
            self.judge_after[idx] = time.monotonic() + POLL_CONFIRM_S
            return False
        if found is None:  # SLURM no longer knows the job: it ended
            return True
        state, restarts = found
        if restarts <= attempt:
            return True
        self.superseded[idx] = attempt
        self.shown.pop(idx, None)  # its next state is news
        self.ran.add(idx)
        log.info(
            f"job #{idx} (SLURM job {slurm_id}): SLURM requeued it (restart {restarts}, now {state.lower()}) "
            "as its run was stopped: it runs again, continuing in its job dir"
        )
        return False

    def _read(self, path: Path) -> JobReturn:
        try:
            job_return: JobReturn = cloudpickle.loads(read_private(path))
        except Exception as e:  # a result that cannot be read is the job's failure, said so
            job_return = failed_return(f"its result ({shown_path(str(path))}) could not be read: {e}")
        return job_return

    def _note_requeue(self, idx: int) -> None:
        """A line when the job's node 0 has requeued it after a stop (its file says how often,
        then how the run was stopped)."""
        path = requeued_file(self.directory, idx, self._array(idx))
        try:
            count, _, how = path.read_text().strip().partition("\n")
        except FileNotFoundError:
            return
        if count and self.requeues.get(idx) != count:
            self.requeues[idx] = count
            log.info(
                f"job #{idx} (SLURM job {self.slurm_ids[idx]}) {how or 'stopped at a step boundary'} "
                f"and is requeued (requeue {count}): it continues in its job dir when SLURM runs it again"
            )

    def _poll(self, by_idx: Dict[int, JobPlan]) -> None:
        """One squeue call for the whole sweep: a line for what changed; a job that ended
        without a result (seen so in two polls in a row: SLURM shows a requeued job's end for
        a moment, and a result may land between) is FAILED with SLURM's words."""
        try:
            states = slurm_commands.squeue(slurm_id.split("_")[0] for slurm_id in self.slurm_ids.values())
        except SlurmCommandError as e:
            log.warning(f"squeue: {e}; asking again later")
            return
        if states is None:
            return
        runs = latest_runs(self.directory)  # one listing of the dir for the whole poll
        for idx, slurm_id in list(self.slurm_ids.items()):
            state = states.get(slurm_id)
            if state is None or state.state in ENDED_STATES:
                attempt = self._new_run(runs, idx, "result")
                if attempt is not None:
                    self._judge(by_idx[idx], attempt)
                elif idx in self.ending:
                    if state is None:
                        state = slurm_commands.sacct(slurm_id) or JobState(
                            "UNKNOWN", "SLURM no longer shows it", ""
                        )
                    self._lost(by_idx[idx], slurm_id, state, runs)
                else:
                    self.ending.add(idx)
                continue
            self.ending.discard(idx)
            now = (state.state, state.reason if state.state == "PENDING" else state.nodes)
            before = self.shown.get(idx)
            if before == now:
                continue
            self.shown[idx] = now
            title = f"job #{idx} (SLURM job {slurm_id})"
            if state.state == "RUNNING":
                # its time counts from when SLURM started this run (the launcher sees it later)
                ran_s = state.elapsed_s or 0.0
                self.events.running(self.plans[idx], time.monotonic() - ran_s)
                again = idx in self.ran  # a run of it ended before: SLURM requeued it
                self.ran.add(idx)
                log.info(f"{title} {'was requeued and runs again' if again else 'started'} on {state.nodes}")
            elif state.state == "PENDING":
                if self._never_starts(idx, slurm_id, state):
                    continue
                reason = f" ({state.reason})" if state.reason not in ("", "None") else ""
                log.info(f"{title} is {'requeued: pending' if idx in self.ran else 'pending'}{reason}")
            else:
                log.info(f"{title} is {state.state.lower()}")

    def _never_starts(self, idx: int, slurm_id: str, state: JobState) -> bool:
        """A job pending for a reason SLURM never lifts for it: cancelled, and FAILED with
        SLURM's reason (instead of a sweep that waits for ever)."""
        why = never_starts(
            state.reason, self.nodes.get(idx, 1), lambda: slurm_commands.partition_nodes(state.partition)
        )
        if why is None:
            return False
        said = slurm_commands.scancel([slurm_id])
        message = (
            f"SLURM job {slurm_id} can never start ({state.reason}): {why}; it was cancelled{_said(said)}"
        )
        self._end(idx, failed_return(message))
        return True

    def _collect(self, plan: JobPlan, job_return: JobReturn) -> None:
        """The job's result, as its node 0 wrote it (or a node's failure). A job this launcher
        never saw running (it ended while no launcher waited: detached, or a launcher killed)
        takes its time from its node 0's word (`RUN_TIME_ATTR`), not from when it was read."""
        ran_s = getattr(job_return, RUN_TIME_ATTR, None)
        if plan.idx not in self.ran and isinstance(ran_s, (int, float)):
            self.events.running(plan, time.monotonic() - ran_s)
        self._end(plan.idx, job_return)

    def _lost(
        self, plan: JobPlan, slurm_id: str, state: JobState, runs: Dict[Tuple[int, str, str], int]
    ) -> None:
        """A job that ended without a result: SLURM's words for it, and where its output is
        (`runs`: the poll's listing of the runs' files)."""
        out = output_file(self.directory, plan.idx, slurm_id.split("_")[0])
        attempt = self._new_run(runs, plan.idx, "failure")
        if attempt is not None:  # a node of its last run recorded why before SLURM ended the job
            failed_first = failure_file(self.directory, plan.idx, self._array(plan.idx), attempt)
            self._collect(plan, _named_by_slurm(self._read(failed_first), slurm_id, state.state, out))
            return
        started = plan.idx in self.ran or out.exists()
        # a job cancelled while pending keeps the reason it was pending for: not why it ended
        shown = state.reason and state.reason != "None" and (started or state.state != "CANCELLED")
        reason = f" ({state.reason})" if shown else ""
        where = f"its output: {shown_path(str(out))}" if out.exists() else "it never started (no output)"
        self._end(
            plan.idx,
            failed_return(f"SLURM job {slurm_id} ended {state.state}{reason} without a result; {where}"),
        )

    def _end(self, idx: int, job_return: JobReturn, stopped: bool = False) -> None:
        """The job's outcome to the driver (`stopped`: cancelled as the launcher was stopped);
        it is no longer in flight."""
        if job_return.overrides is None:  # SLURM's failure, not one the job returned
            job_return.overrides = self.overrides.get(idx)
        self.ended.append((idx, job_return, stopped))
        self.returns[idx] = job_return
        self.ending.discard(idx)
        if self.slurm_ids.pop(idx, None) is not None:
            self.submitted.pop(str(idx), None)

    def _report_ended(self) -> None:
        """The jobs ended in this round of polls to the driver, once `submitted.json` no longer
        lists them: the file is rewritten whole and fsync'd, once a round rather than once a
        job (a thousand-job sweep would write a million entries); and first, so that a command
        killed in between leaves a job neither taken back nor recorded: it runs again."""
        if not self.ended:
            return
        write_submitted(self.directory, self.submitted)
        ended, self.ended = self.ended, []
        for idx, job_return, stopped in ended:
            self.events.ended(self.plans[idx], job_return, stopped)

    # -- cancel ---------------------------------------------------------------------------

    def cancel(self) -> str:
        """scancel every job of the sweep still in flight but those submitted detached (they
        run on: this command only waited for them); what to say of it."""
        detached = sorted(self.slurm_ids[idx] for idx in self.detached if idx in self.slurm_ids)
        ids = sorted(slurm_id for idx, slurm_id in self.slurm_ids.items() if idx not in self.detached)
        on = ""
        if detached:
            directory = shown_path(str(self.directory.parent))
            on = (
                f"; SLURM job(s) {slurm_ids(detached)}, submitted detached, run on "
                f"(torchrun-sweep cancel {directory} cancels them; the same command submits the rest)"
            )
            for idx in [idx for idx in self.slurm_ids if idx in self.detached]:
                self.slurm_ids.pop(idx)  # left out of the record's ending: still running
        if not ids:
            return f"no SLURM job (none of this command's was in flight){on}"
        said = slurm_commands.scancel(ids)
        for idx, slurm_id in list(self.slurm_ids.items()):
            message = f"SLURM job {slurm_id} was cancelled (scancel) when the launcher was stopped"
            self._end(idx, failed_return(message), stopped=True)
        self._report_ended()
        return f"SLURM job(s) {slurm_ids(ids)}{_said(said)}{on}"

    def detached_words(self, sweep_dir: str) -> str:
        """What a detached submission says: what runs on, where to look, how to come back."""
        fresh = sorted(set(self.slurm_ids) - self.taken_back)
        before = sorted(set(self.slurm_ids) & self.taken_back)
        arrays = sorted({self.slurm_ids[idx].split("_")[0] for idx in self.slurm_ids})
        if fresh:
            what = f"Detached: {len(fresh)} job(s) submitted to SLURM (job array(s) {', '.join(arrays)})"
            if before:
                what += f", {len(before)} submitted before"
        elif before:
            what = (
                f"Detached: all {len(before)} job(s) of this sweep were submitted before and run on "
                f"(job array(s) {', '.join(arrays)}): nothing submitted"
            )
        else:
            what = "Detached: no job of this sweep is in flight"
        return (
            f"{what}; they run on without this command.\n"
            f"\tWhere the sweep stands: torchrun-sweep status {sweep_dir}\n"
            "\tIts results, when they are in: the same command without hydra.launcher.detach=true "
            "(it waits for the jobs and submits none twice)\n"
            f"\tTo cancel them: torchrun-sweep cancel {sweep_dir}"
        )


def _alive(directory: Path, submitted: Dict[str, Any]) -> Optional[Set[str]]:
    """The recorded jobs (of an earlier run of the launcher) that SLURM still runs or queues,
    or that left a result; None when squeue cannot say (all are taken back)."""
    recorded = {str(job["slurm_id"]) for job in submitted.values() if "slurm_id" in job}
    if not recorded:
        return set()
    try:
        states = slurm_commands.squeue(slurm_id.split("_")[0] for slurm_id in recorded)
    except SlurmCommandError:
        return None
    if states is None:
        return None
    runs = latest_runs(directory)
    return {
        slurm_id
        for slurm_id in recorded
        if (slurm_id in states and states[slurm_id].state not in ENDED_STATES)
        or (int(slurm_id.split("_")[1]), slurm_id.split("_")[0], "result") in runs
    }


def _same_job(known: Optional[Dict[str, Any]], plan: JobPlan) -> bool:
    """Whether the recorded submission is of this very job (same fingerprint), to be taken
    back unless `resume=false`."""
    same = bool(known) and known.get("fingerprint") == plan.fingerprint  # type: ignore[union-attr]
    return same and plan.settings.conf.resume is not False


def _takes_back(known: Optional[Dict[str, Any]], plan: JobPlan, alive: Optional[Set[str]]) -> bool:
    """Whether the recorded submission of this job is waited for rather than submitted again:
    the same job, that SLURM still has or whose result is in (`alive`; None: cannot say)."""
    return _same_job(known, plan) and (alive is None or str(known["slurm_id"]) in alive)  # type: ignore[index]


def _said(said: Optional[str]) -> str:
    return f" (scancel: {said})" if said else ""


# states in which SLURM ended a running job for a reason of its own (`scancel`, a node lost,
# memory, a deadline); a time limit and a preemption are told by the job's own stop
_ENDED_BY_SLURM = frozenset({"BOOT_FAIL", "CANCELLED", "DEADLINE", "NODE_FAIL", "OUT_OF_MEMORY", "REVOKED"})


def _named_by_slurm(job_return: JobReturn, slurm_id: str, state: str, out: Path) -> JobReturn:
    """A node's failure of a job SLURM ended, with SLURM's state first: the node saw only the
    signal SLURM sent ("stopped by signal SIGTERM"), which does not say who sent it. The
    node's failure stays the cause (HYDRA_FULL_ERROR prints both)."""
    value = job_return._return_value
    ended_by_job = job_return.status == JobStatus.COMPLETED or isinstance(value, JobPreempted)
    if state not in _ENDED_BY_SLURM or ended_by_job:
        return job_return
    named = failed_return(f"SLURM job {slurm_id} ended {state}: {value}; its output: {shown_path(str(out))}")
    if isinstance(value, BaseException):
        named._return_value.__cause__ = value
    named.overrides = job_return.overrides
    return named


def arrays(plans: List[JobPlan], options: Dict[int, SlurmOptions]) -> Dict[SlurmOptions, List[JobPlan]]:
    """The jobs grouped as they are submitted: one SLURM job array per set of sbatch options."""
    groups: Dict[SlurmOptions, List[JobPlan]] = {}
    for plan in plans:
        groups.setdefault(options[plan.idx], []).append(plan)
    return groups


def _dry_run(
    plans: List[JobPlan], options: Dict[int, SlurmOptions], sweep_dir: Path, recorded: PlannedResumption
) -> str:
    """Each job, and the batch script of each array of them, as it would be submitted (the
    jobs a run would take from the sweep dir's record are in no array); nothing is."""
    directory = sweep_dir / ".slurm"
    from_record = recorded.in_header("not submitted")
    counted = jobs_counted(len(plans))
    lines = [f"Dry run: {counted}, each a SLURM job of a job array{from_record}; nothing is submitted"]
    for slurm, group in arrays(plans, options).items():
        for plan in group:
            conf = plan.settings.conf
            lines += [
                f"\t#{plan.idx} : {' '.join(plan.overrides)}",
                *([f"\t\trecord:  {recorded.said[plan.idx]}"] if plan.idx in recorded.said else []),
                f"\t\tjob dir: {plan.output_dir}",
                f"\t\tranks:   {plan.nproc or f'{conf.nproc_per_node} (counted on each node)'} per node "
                f"x {slurm.nodes} node(s), {conf.start_method}",
            ]
        jobs = [plan.idx for plan in group if plan.idx not in recorded.completed]
        if jobs:
            lines += [
                f"\tsbatch script of {', '.join(f'#{idx}' for idx in jobs)}:",
                *(
                    f"\t\t{line}"
                    for line in batch_script(slurm, jobs, directory, str(sweep_dir)).splitlines()
                ),
            ]
    return "\n".join(lines)
