"""Resuming a sweep from its record: which jobs are done, which continue, which run.

The record is the sweep dir's `sweep_summary.json` (`_launcher.report`) plus, for every completed
job, its pickled `JobReturn` in `<job dir>/.hydra/job_return.pkl` (beside Hydra's own
account of the job; owner-only: a pickle is code, and only this user may have written it).
When the same sweep runs again in the same sweep dir (a requeued SLURM job, a user running
the command again), a job the record holds with the same overrides and fingerprint is:
- COMPLETED: not run; its JobReturn (return value included) comes from the record;
- PREEMPTED: run in its same job dir, with `preemption.resumed()` True;
- anything else (FAILED, STOPPED, NOT_STARTED): run.
Hydra's default sweep dirs carry a timestamp, so a new run never resumes by accident.
"""

import hashlib
import inspect
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence, Set

import cloudpickle
from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf

from .._shared.errors import LauncherConfigError
from .._shared.paths import shown_path
from .report import COMPLETED, PREEMPTED, SUMMARY_FILE, JobOutcome

log = logging.getLogger(__name__)

RETURN_FILE = Path(".hydra") / "job_return.pkl"


@dataclass
class Resumption:
    """What the record says of this launch's jobs."""

    # jobs the record holds with the same overrides, by number
    recorded: Dict[int, JobOutcome] = field(default_factory=dict)
    # completed jobs and their JobReturns, from the record
    completed: Dict[int, JobReturn] = field(default_factory=dict)
    # preempted jobs: they continue in their job dir
    preempted: Set[int] = field(default_factory=set)


def read_record(sweep_dir: Path) -> Dict[int, JobOutcome]:
    """The jobs of the sweep dir's record; empty when there is none."""
    path = sweep_dir / SUMMARY_FILE
    if not path.is_file():
        return {}
    try:
        rows = json.loads(path.read_text())["jobs"]
        return {int(row["num"]): JobOutcome(**row) for row in rows}
    except (ValueError, KeyError, TypeError) as e:
        raise LauncherConfigError(
            f"{shown_path(str(path))} is not a sweep record of this launcher ({type(e).__name__}: {e}); "
            "move it away, or set hydra.launcher.resume=false to run every job again"
        ) from e


def resumption(mode: Any, sweep_dir: Path, jobs: Sequence[Any], record: Dict[int, JobOutcome]) -> Resumption:
    """What of `jobs` (plans with `.idx` and `.overrides`) the record has done or stopped.

    A recorded job is the same job when its overrides are the same and so is its
    fingerprint (the task's source and config). `mode` is `hydra.launcher.resume`: false
    ignores the record; true takes a job with the same overrides whatever changed in the
    code or config (say, a fix), and refuses to start when the record holds none.
    """
    found = Resumption()
    if mode is False:
        return found
    changed = []
    for job in jobs:
        outcome = record.get(job.idx)
        if outcome is None or list(outcome.overrides) != list(job.overrides):
            continue
        if outcome.fingerprint != job.fingerprint:
            changed.append(job.idx)
            if mode is not True:
                continue
        found.recorded[job.idx] = outcome
    if changed and mode is True:
        log.warning(
            f"hydra.launcher.resume=true: the task's source or config changed since the record of "
            f"job(s) {_listed(changed).strip(' ()')}; resuming them all the same"
        )
    if mode is True and not found.recorded:
        raise LauncherConfigError(
            f"hydra.launcher.resume=true: {shown_path(str(sweep_dir))} holds no record of this sweep "
            f"(no {SUMMARY_FILE} with these jobs' overrides)"
        )
    for num, outcome in found.recorded.items():
        if outcome.status == COMPLETED:
            returned = load_return(Path(outcome.job_dir), num)
            if returned is not None:
                found.completed[num] = returned
        elif outcome.status == PREEMPTED:
            found.preempted.add(num)
    return found


def log_resumption(sweep_dir: Path, found: Resumption) -> None:
    """One line when the launch resumes a recorded sweep: what comes from the record."""
    if not found.recorded:
        return
    done = sorted(found.completed)
    log.info(
        f"Resuming the sweep in {shown_path(str(sweep_dir))}: "
        f"{len(done)} completed job(s) come from its record{_listed(done)}, "
        f"{len(found.preempted)} preempted job(s) continue{_listed(sorted(found.preempted))} "
        "(hydra.launcher.resume=false runs every job again)"
    )


def source_digest(task_function: Any, pickled_task: bytes) -> str:
    """The task's source file, digested: another app, or an edited one, is another task.

    A task without a source file (made interactively) is known by its pickled form.
    """
    target = inspect.unwrap(getattr(task_function, "func", task_function))
    try:
        source = inspect.getsourcefile(target)
    except TypeError:
        source = None
    data = Path(source).read_bytes() if source and os.path.isfile(source) else pickled_task
    return hashlib.sha1(data).hexdigest()


def fingerprint(source: str, task_cfg: DictConfig) -> str:
    """What a job computes: its task's source digest and its config (as composed, unresolved,
    so that `${now:}` and the like do not make a requeued run another job)."""
    text = OmegaConf.to_yaml(task_cfg, resolve=False)
    return hashlib.sha1(f"{source}\n{text}".encode()).hexdigest()[:16]


def _listed(nums: List[int]) -> str:
    return f" ({', '.join(f'#{n}' for n in nums)})" if nums else ""


def save_return(job_dir: Path, job_return: JobReturn) -> None:
    """Keep a completed job's JobReturn for a later resume (owner-only, replaced whole)."""
    path = job_dir / RETURN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(cloudpickle.dumps(job_return))
    os.replace(partial, path)


def load_return(job_dir: Path, num: int) -> "JobReturn | None":
    """A completed job's JobReturn from the record; None (the job runs again) when it is
    missing. One that another user could have written is refused by name."""
    path = job_dir / RETURN_FILE
    if not path.is_file():
        shown = shown_path(str(path))
        log.warning(f"job #{num} is completed in the record but {shown} is missing: it runs again")
        return None
    for checked in (path.parent, path):
        info = checked.stat()
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise LauncherConfigError(
                f"{shown_path(str(checked))} is not private to this user (owner uid {info.st_uid}, mode "
                f"{stat.filemode(info.st_mode)}): the sweep's record is not resumed from it; "
                "set hydra.launcher.resume=false to run every job again"
            )
    with open(path, "rb") as f:
        return cloudpickle.load(f)
