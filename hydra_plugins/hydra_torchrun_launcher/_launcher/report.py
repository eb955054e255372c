"""What a sweep tells its user as it runs: a line per job as it ends, a table, a file.

As each job ends, the launcher logs one line (job k of N, its overrides, status, duration,
rank 0's return value or the failure), so a failure is seen when it happens. When the
launch ends (all jobs done, or stopped), a table of its jobs follows, and every job's
outcome is kept in `<sweep dir>/sweep_summary.json`, rewritten (whole, durably) as each
job ends, for scripts to read: strict JSON, the jobs this run launched (sweepers that launch
in batches add to it), never a row of an earlier run's other sweep.
"""

import dataclasses
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus, filter_overrides

from .._rank.error import failure_summary
from .._shared.paths import shown_path
from .durable import replace_whole

log = logging.getLogger(__name__)

SUMMARY_FILE = "sweep_summary.json"
COMPLETED, FAILED, STOPPED, NOT_STARTED = "COMPLETED", "FAILED", "STOPPED", "NOT_STARTED"
# started and not ended yet; in a record read later: the launcher died while the job ran
RUNNING = "RUNNING"
# stopped by the stop signal (a preemption notice): it continues when the sweep resumes
PREEMPTED = "PREEMPTED"
_CELL_WIDTH = 60
_RANK_DETAIL = re.compile(r" \(local_rank \d+, pid \d+\)")


@dataclass
class JobOutcome:
    num: int
    overrides: List[str]
    status: str
    duration_s: Optional[float]
    # rank 0's return value: as is when JSON can hold it, else its repr
    return_value: Any
    # the job's error, whole (first line: what failed and how)
    error: Optional[str]
    job_dir: str
    # what the job computes (`_launcher.resume.fingerprint`): a resumed sweep reruns a job whose differs
    fingerprint: str = ""
    # the job dir relative to the sweep dir: a moved sweep dir still finds its jobs
    subdir: str = ""
    # whether the job's ranks have run in its job dir (a preempted job whose ranks never
    # started has no checkpoint to resume from: it simply runs again)
    ranks_ran: bool = False


@dataclass
class Record:
    """The sweep dir's record of an earlier run."""

    jobs: Dict[int, JobOutcome] = field(default_factory=dict)
    # the earlier run was stopped between a sweeper's batches
    interrupted: bool = False

    def finished(self) -> bool:
        """Whether the earlier run reached its end: every job completed or failed."""
        return not self.interrupted and all(job.status in (COMPLETED, FAILED) for job in self.jobs.values())


def job_title(num: int, overrides: Sequence[str]) -> str:
    """ "#3 : lr=0.1 seed=2", or "#3" for a job without overrides."""
    shown = " ".join(filter_overrides(list(overrides)))
    return f"#{num} : {shown}" if shown else f"#{num}"


class SweepReport:
    """The outcomes of one launcher's jobs: progress lines, the table, the summary file.

    One per launcher, so the batches of a sweeper that launches several add up in the file.
    The file holds the jobs this run launched (`outcomes`); the record of an earlier run
    that this one resumes (`recorded`) is kept aside, and a recorded job's outcome enters
    the file only when a batch of this run launches that job.
    """

    def __init__(self, sweep_dir: Path, recorded: Optional["Record"] = None) -> None:
        self.sweep_dir = sweep_dir
        self.path = sweep_dir / SUMMARY_FILE
        self.recorded = recorded or Record()
        self.outcomes: Dict[int, JobOutcome] = {}
        # the run was stopped between a sweeper's batches: it did not reach its end
        self.interrupted = False
        # this launcher keeps the record (node 0 of the nodes that share the sweep dir)
        self.writes = True
        self._started: Dict[int, float] = {}
        self._batch: List[int] = []
        # of this batch: the jobs that run now (not from the record), and those that have ended
        self._to_run: List[int] = []
        self._ended: List[int] = []

    def launching(
        self,
        jobs: Sequence[Any],
        done: Sequence[int] = (),
        preempted: Sequence[int] = (),
        returned: Optional[Mapping[int, Any]] = None,
    ) -> None:
        """A new batch: `jobs` are plans with `.idx`, `.overrides`, `.output_dir` and
        `.fingerprint` (a job not composed yet has no output dir: `composed` gives it); those of
        `done` completed in an earlier run, those of `preempted` were stopped in one: their
        outcome stays the record's until they end in this run (killed before, they still
        resume). `returned`: the return values of `done` jobs as their kept JobReturns hold
        them (what the sweeper gets), shown and written in place of the summary's copy."""
        self._batch = [job.idx for job in jobs]
        self._to_run = [job.idx for job in jobs if job.idx not in done]
        self._ended = []
        for job in jobs:
            subdir = os.path.relpath(job.output_dir, self.sweep_dir) if job.output_dir is not None else ""
            if job.idx in done or job.idx in preempted:
                # as recorded, where this sweep dir is now
                recorded = self.recorded.jobs[job.idx]
                outcome = dataclasses.replace(recorded, job_dir=str(job.output_dir), subdir=subdir)
                if returned is not None and job.idx in returned:
                    outcome.return_value = _json_or_repr(returned[job.idx])
            else:
                outcome = JobOutcome(
                    job.idx,
                    list(job.overrides),
                    NOT_STARTED,
                    None,
                    None,
                    None,
                    str(job.output_dir) if job.output_dir is not None else "",
                    job.fingerprint,
                    subdir,
                )
            self.outcomes[job.idx] = outcome
        for num in done:
            outcome = self.outcomes[num]
            log.info(
                f"\t{job_title(num, outcome.overrides)} : COMPLETED in an earlier run, "
                f"returned {_short(outcome.return_value)}"
            )
        self.write()

    def composed(self, job: Any) -> None:
        """A job composed just before it runs: its job dir and fingerprint are known now."""
        outcome = self.outcomes[job.idx]
        outcome.job_dir = str(job.output_dir)
        outcome.subdir = os.path.relpath(job.output_dir, self.sweep_dir)
        outcome.fingerprint = job.fingerprint

    def started(self, num: int, at: Optional[float] = None) -> None:
        """The job starts (`at`: when, on the monotonic clock, if before now): RUNNING in the
        summary file until it ends, so that a record left by a launcher that died (kill -9, a
        node failure) says the job did not end."""
        self._started[num] = time.monotonic() if at is None else at
        self.outcomes[num].status = RUNNING
        self.write()

    def ended(self, num: int, job_return: JobReturn, status: str, ranks_ran: bool = False) -> None:
        """Record the job's outcome (`status`: one of this module's; `ranks_ran`: its ranks
        have run in its job dir, now or in the run this one resumes), log its line and
        rewrite the summary file."""
        outcome = self.outcomes[num]
        outcome.duration_s = round(time.monotonic() - self._started[num], 3)
        outcome.status = status
        outcome.ranks_ran = ranks_ran
        if job_return.status == JobStatus.COMPLETED:
            outcome.return_value = _json_or_repr(job_return._return_value)
            outcome.error = None
        else:
            outcome.return_value = None
            outcome.error = failure_summary(job_return._return_value)
        self.write()
        self._ended.append(num)
        line = (
            f"job {len(self._ended)} of {len(self._to_run)} ended: {job_title(num, outcome.overrides)} : "
            f"{outcome.status} in {outcome.duration_s:.2f}s"
        )
        if outcome.status == COMPLETED:
            log.info(f"{line}, returned {_short(outcome.return_value)}")
        else:
            first, *rest = (outcome.error or "").splitlines() or [""]
            log.error("\n\t".join([f"{line}: {first}", *rest]))

    def write(self) -> None:
        """The summary file, replaced whole and durably: a reader never sees half of it."""
        if not self.writes:
            return
        jobs = [asdict(self.outcomes[num]) for num in sorted(self.outcomes)]
        record: Dict[str, Any] = {"jobs": jobs}
        if self.interrupted:
            record["interrupted"] = True
        text = json.dumps(record, indent=1, default=repr, allow_nan=False) + "\n"
        replace_whole(self.path, text.encode())

    def table(self) -> str:
        """This launch's jobs, a row each: number, status, time, overrides, result, job dir."""
        rows = [["#", "status", "time", "overrides", "result", "job dir"]]
        for num in self._batch:
            outcome = self.outcomes[num]
            if outcome.status == COMPLETED:
                result = _short(outcome.return_value)
            else:
                # the failure's first line, without the pid and local rank the progress line gave
                result = _cut(_RANK_DETAIL.sub("", (outcome.error or "").split("\n", 1)[0]))
            duration = "" if outcome.duration_s is None else f"{outcome.duration_s:.2f}s"
            rows.append(
                [
                    str(num),
                    outcome.status,
                    duration,
                    _cut(_overrides(outcome)),
                    result,
                    shown_path(outcome.job_dir) if outcome.job_dir else "-",
                ]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

    def log_table(self) -> None:
        counts: Dict[str, int] = {}
        for num in self._batch:
            counts[self.outcomes[num].status] = counts.get(self.outcomes[num].status, 0) + 1
        tally = ", ".join(f"{count} {_word(status)}" for status, count in counts.items())
        log.info(f"{len(self._batch)} jobs: {tally} (summary: {shown_path(str(self.path))})\n{self.table()}")

    def stop_summary(self) -> str:
        """One line after a stop: which jobs finished, which were stopped, where their logs are."""
        parts = []
        for status in (COMPLETED, FAILED, PREEMPTED, STOPPED, RUNNING, NOT_STARTED):
            nums = [n for n in self._batch if self.outcomes[n].status == status]
            if not nums:
                continue
            listed = job_numbers(nums)
            if status == PREEMPTED:
                dirs = ", ".join(shown_path(self.outcomes[n].job_dir) for n in nums)
                parts.append(f"preempted {listed} (continues in {dirs})")
            elif status == STOPPED:
                dirs = ", ".join(shown_path(self.outcomes[n].job_dir) for n in nums)
                parts.append(f"stopped {listed} (logs in {dirs})")
            else:
                parts.append(f"{_word(status)} {listed}")
        return "; ".join(parts) + f"; summary in {shown_path(str(self.path))}"


def job_numbers(nums: Iterable[int]) -> str:
    """Job numbers as a line says them, runs shortened: "#0, #2-#299" (a stopped sweep of
    300 jobs says so in a few words, not 299 numbers)."""
    runs: List[List[int]] = []
    for num in sorted(nums):
        if runs and num == runs[-1][1] + 1:
            runs[-1][1] = num
        else:
            runs.append([num, num])
    return ", ".join(f"#{a}" if a == b else f"#{a}, #{b}" if b == a + 1 else f"#{a}-#{b}" for a, b in runs)


def _word(status: str) -> str:
    """NOT_STARTED -> "not started", as the console's sentences say it."""
    return status.lower().replace("_", " ")


def _overrides(outcome: JobOutcome) -> str:
    return " ".join(filter_overrides(outcome.overrides))


def strict_json(text: str) -> Any:
    """`text` parsed as strict JSON: NaN and Infinity are not JSON, and are refused."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _json_or_repr(value: Any) -> Any:
    """`value` when strict JSON holds it; else its repr (a NaN or infinite float: "nan", "inf":
    JSON has no such number, and a file with NaN in it is not JSON)."""
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _short(value: Any) -> str:
    return _cut(value if isinstance(value, str) else json.dumps(value, default=repr))


def _cut(text: str) -> str:
    return text if len(text) <= _CELL_WIDTH else text[: _CELL_WIDTH - 1] + "…"
