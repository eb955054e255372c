"""Where a sweep stands, read from outside it: its record, its launcher's lock and, for its
SLURM jobs, one `squeue` call.

The record is read only through `_launcher.resume.read_record` (what the launcher itself
resumes from), the SLURM side only through `_submit.files` (the jobs in flight and the result
files their nodes wrote) and `_shared.slurm_commands` (squeue, scancel). Nothing here imports torch,
nor anything that does: `torchrun-sweep` answers on a login node in a fraction of a second.
"""

import fcntl
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from hydra.core.utils import filter_overrides

from .._launcher.lock import LOCK_FILE, holder
from .._launcher.report import COMPLETED, FAILED, RUNNING, SUMMARY_FILE, Record
from .._launcher.resume import job_dir_of, read_record
from .._shared import slurm_commands
from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.slurm_commands import ENDED_STATES, JobState, SlurmCommandError
from .._submit.files import SLURM_DIR, error_file, latest_runs, read_submitted

# where the sweep stands as a whole
RUNNING_STAGE, DETACHED, UNFINISHED_STAGE, ENDED_STAGE = "running", "detached", "unfinished", "ended"
# a job's state beyond the record's statuses and SLURM's own words (PENDING, RUNNING, ...):
# RUNNING in the record, but no launcher runs it any more (killed, its host lost): the
# sweep's command, run again, resumes it
UNFINISHED = "UNFINISHED"
# a SLURM job whose nodes wrote its result, not in the record yet: the launcher that waits
# collects it at once; a detached sweep's command, run again, collects it
ENDED = "ENDED"
# a SLURM job in flight that squeue no longer shows and that left no result
GONE = "GONE"
# a SLURM job in flight whose state squeue could not give
SUBMITTED = "SUBMITTED"
# the order of the counts' line: what is going on first, what is over last
ORDER = (
    "RUNNING",
    "COMPLETING",
    "CONFIGURING",
    "PENDING",
    "REQUEUED",
    "SUSPENDED",
    SUBMITTED,
    ENDED,
    UNFINISHED,
    "PREEMPTED",
    "STOPPED",
    "NOT_STARTED",
    "COMPLETED",
    "FAILED",
)
# the record's statuses after which a job runs no more
_FINAL = (COMPLETED, FAILED)
# the lock holder's line (`_launcher.lock.hold_sweep_lock` writes it)
_HOLDER = re.compile(r"^pid (\d+) on (\S+) since ")
# the file Hydra writes into a job's dir as the job starts (each time it runs)
_JOB_CONFIG = Path(".hydra") / "config.yaml"


class NoRecord(Exception):
    """The directory holds no record of a sweep that can be read; the message says so, in one line."""


@dataclass
class JobView:
    """One job as `status` shows it."""

    num: int
    # where it stands now (see the module's states); `recorded`: the record's status
    state: str
    recorded: str
    overrides: List[str]
    job_dir: str
    slurm_id: Optional[str] = None
    # the nodes SLURM runs it on (as squeue says them); the hosts an ssh sweep's job runs or
    # ran on (as the record keeps them), comma-separated
    nodes: Optional[str] = None
    elapsed_s: Optional[float] = None
    return_value: Any = None
    # the record's error, whole (its first line says what failed and how)
    error: Optional[str] = None
    # what there is to say of a job with no result yet (a pending reason, ...)
    note: Optional[str] = None
    # submitted to SLURM and not collected into the record yet
    in_flight: bool = False

    def queued_or_running(self) -> bool:
        """A SLURM job in flight that SLURM still queues or runs (or could not say of)."""
        return self.in_flight and self.state not in (*ENDED_STATES, ENDED, GONE)


@dataclass
class SweepView:
    """A sweep as `status` shows it."""

    sweep_dir: Path
    runner: str  # "local", "slurm" or "ssh"
    stage: str
    # who holds the sweep's lock ("pid N on HOST since T") while a launcher runs it
    launcher: Optional[str]
    jobs: List[JobView]
    # the keys of the overrides whose values differ across the sweep's jobs
    varying: List[str]
    # why SLURM's states are not known (squeue failed or is missing); None when they are
    squeue_error: Optional[str] = None
    # who held the sweep's lock, where this host cannot tell whether that launcher still runs
    launcher_unknown: Optional[str] = None
    counts: Dict[str, int] = field(default_factory=dict)


def read_sweep(sweep_dir: Path) -> SweepView:
    """Where the sweep in `sweep_dir` stands; NoRecord when it holds no readable record."""
    record = _record(sweep_dir)
    alive, said = launcher_alive(sweep_dir)
    slurm = sweep_dir / SLURM_DIR
    if slurm.is_dir():
        runner = "slurm"
    else:  # an ssh sweep's record keeps its jobs' hosts (`JobOutcome.hosts`)
        runner = "ssh" if any(outcome.hosts is not None for outcome in record.jobs.values()) else "local"
    in_flight = _in_flight(slurm, record)
    runs = _runs(slurm)
    states: Optional[Dict[str, JobState]] = None
    squeue_error = None
    if in_flight:
        states, squeue_error = squeue(in_flight.values())
    now = time.time()
    jobs = []
    for num in sorted(record.jobs):
        outcome = record.jobs[num]
        job = JobView(
            num=num,
            state=outcome.status,
            recorded=outcome.status,
            overrides=list(outcome.overrides),
            # a job never composed (refused, or not reached) has no dir yet
            job_dir=str(job_dir_of(sweep_dir.resolve(), outcome))
            if outcome.subdir or outcome.job_dir
            else "",
            slurm_id=in_flight.get(num) or _last_slurm_id(num, runs),
            elapsed_s=outcome.duration_s,
            return_value=outcome.return_value,
            error=outcome.error,
        )
        if outcome.hosts:
            job.nodes = ",".join(outcome.hosts)
        if num in in_flight:
            job.in_flight = True
            _as_slurm_shows_it(job, in_flight[num], states, runs, slurm)
        elif outcome.status == RUNNING:
            on = f" on {job.nodes}" if job.nodes else ""
            if alive is False:
                job.state = UNFINISHED
                job.note = f"its launcher ended while it ran{on}"
            else:
                job.elapsed_s = _running_for(Path(job.job_dir), now)
                job.note = f"on {job.nodes}" if job.nodes else None
        jobs.append(job)
    if alive and said:
        stage = RUNNING_STAGE
    elif any(job.queued_or_running() for job in jobs):
        stage = DETACHED
    elif record.finished():
        stage = ENDED_STAGE
    else:
        stage = UNFINISHED_STAGE
    view = SweepView(
        sweep_dir,
        runner,
        stage,
        said if stage == RUNNING_STAGE else None,
        jobs,
        varying([job.overrides for job in jobs]),
        squeue_error,
        launcher_unknown=said if alive is None and said else None,
    )
    view.counts = counts(job.state for job in jobs)
    return view


def _record(sweep_dir: Path) -> Record:
    """The sweep's record, through the launcher's own reader; NoRecord when there is none or
    it cannot be read (what the reader said of it, not its advice to a launcher)."""
    path = sweep_dir / SUMMARY_FILE
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise NoRecord(
            f"{_shown(sweep_dir)}: not a directory (a sweep dir holds the sweep's record, {SUMMARY_FILE})"
        )
    if not sweep_dir.is_dir():
        raise NoRecord(
            f"{_shown(sweep_dir)}: no such directory (looked for the sweep's record, {_shown(path)})"
        )
    said = _Said()
    package = logging.getLogger("hydra_plugins.hydra_torchrun_launcher")
    propagate = package.propagate
    package.addHandler(said)
    package.propagate = False
    try:
        record = read_record(sweep_dir)
    finally:
        package.removeHandler(said)
        package.propagate = propagate
    if record.jobs:
        return record
    if said.lines:
        why = re.search(r" cannot be read as this launcher's record \((.*)\): ", said.lines[0])
        reason = why.group(1) if why else said.lines[0]
        raise NoRecord(f"{_shown(path)} cannot be read as a sweep's record: {reason}")
    raise NoRecord(f"no sweep record in {_shown(sweep_dir)} (looked for {_shown(path)})")


class _Said(logging.Handler):
    """What the record's reader says (a record that cannot be read), kept to be said once."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _shown(path: Path) -> str:
    return shown_path(str(path))


def _in_flight(slurm: Path, record: Record) -> Dict[int, str]:
    """The SLURM id of each job submitted and not collected yet (`.slurm/submitted.json`),
    but those the record holds as ended already."""
    found: Dict[int, str] = {}
    for num, entry in read_submitted(slurm).items():
        if not (isinstance(entry, dict) and "slurm_id" in entry and str(num).isdigit()):
            continue
        outcome = record.jobs.get(int(num))
        if outcome is None or outcome.status not in _FINAL:
            found[int(num)] = str(entry["slurm_id"])
    return found


def _runs(slurm: Path) -> Dict[Tuple[int, str, str], int]:
    try:
        return latest_runs(slurm)
    except OSError:  # no `.slurm/` (a local sweep), or another user's
        return {}


def _last_slurm_id(num: int, runs: Dict[Tuple[int, str, str], int]) -> Optional[str]:
    """The SLURM id of the job's latest submission that left a file (its result or failure)."""
    arrays = [int(array) for (idx, array, _kind) in runs if idx == num]
    return f"{max(arrays)}_{num}" if arrays else None


def squeue(slurm_ids: Iterable[str]) -> Tuple[Optional[Dict[str, JobState]], Optional[str]]:
    """One squeue call for the jobs' arrays: their states by SLURM id, or why there are none."""
    try:
        states = slurm_commands.squeue(slurm_id.split("_")[0] for slurm_id in slurm_ids)
    except (SlurmCommandError, LauncherConfigError) as e:
        return None, str(e)
    if states is None:
        return None, "squeue failed"
    return states, None


def _as_slurm_shows_it(
    job: JobView,
    slurm_id: str,
    states: Optional[Dict[str, JobState]],
    runs: Dict[Tuple[int, str, str], int],
    slurm: Path,
) -> None:
    """A job in flight: SLURM's state of it (one squeue call for the sweep), or what its nodes
    left (a result the record does not hold yet, and a failed run's error)."""
    job.error = job.return_value = None
    job.elapsed_s = None
    if states is None:
        job.state, job.note = SUBMITTED, "squeue could not say where it stands"
        return
    shown = states.get(slurm_id)
    # a job cancelled while pending keeps the reason it was pending for: not why it ended
    told = shown is not None and shown.reason not in ("", "None") and shown.state != "CANCELLED"
    reason = f" ({shown.reason})" if told and shown is not None else ""
    if shown is not None and shown.state not in ENDED_STATES:
        job.state = shown.state
        if shown.state == "PENDING":
            job.note = f"pending{reason}"
        else:
            job.nodes = shown.nodes or None
            job.elapsed_s = shown.elapsed_s
            job.note = f"on {shown.nodes}" if shown.nodes else None
        return
    array_id = slurm_id.split("_")[0]
    if (job.num, array_id, "result") in runs:
        job.state = ENDED
        job.elapsed_s = shown.elapsed_s if shown is not None else None
        said = f"SLURM: {shown.state}{reason}; " if shown is not None else ""
        job.note = f"{said}its result is not in the record yet"
        try:
            job.error = error_file(slurm, job.num, array_id, runs[(job.num, array_id, "result")]).read_text()
        except FileNotFoundError:  # it completed (or its nodes wrote no error)
            pass
    elif shown is not None:
        job.state = shown.state
        job.elapsed_s = shown.elapsed_s
        job.note = f"SLURM ended it {shown.state}{reason}, without a result"
    else:
        job.state = GONE
        job.note = "SLURM no longer shows it, and it left no result"


def _running_for(job_dir: Path, now: float) -> Optional[float]:
    """How long a job the record says runs has run: since Hydra wrote its config into its job
    dir as it started (the record keeps no start time)."""
    try:
        return round(max(now - (job_dir / _JOB_CONFIG).stat().st_mtime, 0.0), 3)
    except OSError:
        return None


def launcher_alive(sweep_dir: Path) -> Tuple[Optional[bool], str]:
    """Whether a launcher holds the sweep dir's lock (None: this host cannot tell), and who
    holds or last held it ("pid N on HOST since T"; "" when no launcher ever did).

    On the lock holder's host the kernel's table of locks says so without touching the lock
    (a launcher starting at that moment is never refused because of this look); from another
    host (a shared filesystem), a shared lock is tried and let go at once."""
    path = sweep_dir / LOCK_FILE
    said = holder(sweep_dir)
    if not path.is_file():
        return False, ""
    found = _HOLDER.match(said)
    if found and found.group(2) == socket.gethostname():
        held = _in_lock_table(path)
        if held is not None:
            return held, said
    return _try_lock(path), said


def _in_lock_table(path: Path) -> Optional[bool]:
    """Whether /proc/locks lists a flock on `path`; None where there is no such table."""
    try:
        info = path.stat()
        with open("/proc/locks") as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    for line in lines:
        words = line.split()
        if "FLOCK" not in words or "->" in words:  # "->": a process waiting for the lock
            continue
        for word in words:
            parts = word.split(":")
            if len(parts) == 3 and all(parts):
                try:
                    major, minor, inode = int(parts[0], 16), int(parts[1], 16), int(parts[2])
                except ValueError:
                    continue
                if (major, minor, inode) == (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino):
                    return True
    return False


def _try_lock(path: Path) -> Optional[bool]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # lets go of the lock, if it was taken
    return False


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def varying(overrides: List[List[str]]) -> List[str]:
    """The keys whose value differs across the jobs (set in some jobs only counts), in the
    order they first appear; Hydra's own `hydra.` keys are left out."""
    values: Dict[str, Set[Optional[str]]] = {}
    order: List[str] = []
    per_job = [{_key(o): o for o in filter_overrides(job)} for job in overrides]
    for job in per_job:
        for key in job:
            if key not in values:
                values[key] = set()
                order.append(key)
    for job in per_job:
        for key in order:
            values[key].add(job.get(key))
    return [key for key in order if len(values[key]) > 1]


def shown_overrides(overrides: List[str], keys: List[str]) -> List[str]:
    """The job's overrides of the keys that vary; all of them (but Hydra's) when none does."""
    mine = list(filter_overrides(overrides))
    return [o for o in mine if _key(o) in keys] if keys else mine


def counts(states: Iterable[str]) -> Dict[str, int]:
    found: Dict[str, int] = {}
    for state in states:
        found[state] = found.get(state, 0) + 1
    rank = {state: i for i, state in enumerate(ORDER)}
    return {state: found[state] for state in sorted(found, key=lambda s: (rank.get(s, len(ORDER)), s))}
