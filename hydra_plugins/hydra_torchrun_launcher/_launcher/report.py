"""What a sweep tells its user as it runs: a line per job as it ends, a table, a file.

As each job ends, the launcher logs one line (job k of N, its overrides, status, duration,
rank 0's return value or the failure), so a failure is seen when it happens. On a terminal
a live progress line (`_launcher.progress`) takes the place of the lines of the jobs that
start and complete; a failure still prints at once, in full. When the launch ends (all
jobs done, or stopped), a table of its jobs follows: its overrides column shows the keys
that vary across the sweep (one line names the overrides every job has); a launch of more
than 20 jobs lists the jobs that did not complete, the rest is in
`<sweep dir>/sweep_table.txt`.

Every job event (launched, started, ended) is appended to the sweep's journal
(`_launcher.journal`), on disk before the launcher goes on: that is what a resumed run reads.
For scripts, `<sweep dir>/sweep_summary.json` holds every job's outcome: strict JSON, the
jobs this run launched (sweepers that launch in batches add to it), never a row of an
earlier run's other sweep. It is replaced whole (a reader never sees half of it), at most
every few seconds while jobs run, and at once when a launch ends or is stopped; a launcher
killed with -9 leaves it behind the journal by those few seconds at most.
"""

import atexit
import dataclasses
import json
import logging
import os
import re
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus, filter_overrides

from .._rank.carried_exception import failure_summary
from .._shared.paths import shown_path
from .durable import replace_whole
from .journal import JOURNAL_FILE, Journal
from .progress import ProgressLine, on_a_terminal

log = logging.getLogger(__name__)

SUMMARY_FILE = "sweep_summary.json"
# the full table of a large launch's jobs, beside the summary
TABLE_FILE = "sweep_table.txt"
# while jobs run, the summary is rewritten at most this often (the journal has every event)
SUMMARY_INTERVAL_S = 5.0
# a launch of more jobs than this lists only those that did not complete on the console
LARGE_TABLE = 20
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
    # the hosts its nodes run or ran on, in order, where the launcher names them
    # (`torchrun_ssh`: [] until the job is placed); None: a job of another launcher
    hosts: Optional[List[str]] = None


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
    """The outcomes of one launcher's jobs: progress lines, the table, the record's files.

    One per launcher, so the batches of a sweeper that launches several add up in the record.
    The record holds the jobs this run launched (`outcomes`); the record of an earlier run
    that this one resumes (`recorded`) is kept aside, and a recorded job's outcome enters
    the record only when a batch of this run launches that job. The run's first event
    starts the journal afresh: an earlier run's rows never mix with this run's.
    """

    def __init__(self, sweep_dir: Path, recorded: Optional["Record"] = None) -> None:
        self.sweep_dir = sweep_dir
        self.path = sweep_dir / SUMMARY_FILE
        self.journal_path = sweep_dir / JOURNAL_FILE
        self.table_path = sweep_dir / TABLE_FILE
        self.recorded = recorded or Record()
        self.outcomes: Dict[int, JobOutcome] = {}
        # the run was stopped between a sweeper's batches: it did not reach its end
        self.interrupted = False
        # this launcher keeps the record (node 0 of the nodes that share the sweep dir)
        self.writes = True
        # its runner names each job's hosts (`torchrun_ssh`): the record keeps them
        self.names_hosts = False
        self._started: Dict[int, float] = {}
        self._batch: List[int] = []
        # of this batch: the jobs that run now (not from the record), and those that have ended
        self._to_run: List[int] = []
        self._ended: List[int] = []
        # this batch's table has been shown: the launch is over
        self._told = False
        # the record on disk: this run's journal (opened by its first event) and each job's row
        # as the summary shows it, a new dict at each event (so that a copy of `_rows` is a
        # snapshot another thread may write out while this one goes on)
        self._journal: Optional[Journal] = None
        self._rows: Dict[int, Dict[str, Any]] = {}
        self._journaled_interrupted = False
        self._summary_lock = threading.RLock()
        self._summary_at: Optional[float] = None  # when it was last rewritten (monotonic)
        self._summary_behind = False  # an event the summary does not show yet
        self._timer: Optional[threading.Timer] = None
        self._progress: Optional[ProgressLine] = None
        self._pid = os.getpid()
        _LIVE.add(self)

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
        self._end_progress()
        self._batch = [job.idx for job in jobs]
        self._to_run = [job.idx for job in jobs if job.idx not in done]
        self._ended = []
        self._told = False
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
                    hosts=[] if self.names_hosts else None,
                )
            self.outcomes[job.idx] = outcome
        for num in done:
            outcome = self.outcomes[num]
            log.info(
                f"\t{job_title(num, outcome.overrides)} : COMPLETED in an earlier run, "
                f"returned {short_cell(outcome.return_value)}"
            )
        self._event(self._batch)
        if self._to_run and on_a_terminal(log):
            self._progress = ProgressLine(len(self._to_run), log)
            self._progress.start()

    def composed(self, job: Any) -> None:
        """A job composed just before it runs: its job dir and fingerprint are known now (in
        the record from its next event on, its start)."""
        outcome = self.outcomes[job.idx]
        outcome.job_dir = str(job.output_dir)
        outcome.subdir = os.path.relpath(job.output_dir, self.sweep_dir)
        outcome.fingerprint = job.fingerprint

    def started(
        self,
        num: int,
        at: Optional[float] = None,
        line: Optional[str] = None,
        hosts: Optional[List[str]] = None,
    ) -> None:
        """The job starts (`at`: when, on the monotonic clock, if before now): RUNNING in the
        record until it ends, so that a record left by a launcher that died (kill -9, a node
        failure) says the job did not end. `line`: what to say of it (its title, where it
        runs), logged; on a terminal the progress line counts it instead. `hosts`: the
        hosts it runs on, kept in its row (`torchrun_ssh`)."""
        self._started[num] = time.monotonic() if at is None else at
        outcome = self.outcomes[num]
        outcome.status = RUNNING
        if hosts is not None:
            outcome.hosts = list(hosts)
        # a job resumed from the record runs again: its earlier run's end is not its own now
        outcome.error = outcome.return_value = outcome.duration_s = None
        if self._progress is not None:
            self._progress.job_started(num)
        elif line is not None:
            log.info(line)
        self._event([num])

    def ended(self, num: int, job_return: JobReturn, status: str, ranks_ran: bool = False) -> None:
        """Record the job's outcome (`status`: one of this module's; `ranks_ran`: its ranks
        have run in its job dir, now or in the run this one resumes) and log its line (on a
        terminal, a completed job's line is the progress line's count)."""
        outcome = self.outcomes[num]
        outcome.duration_s = round(time.monotonic() - self._started[num], 3)
        outcome.status = status
        outcome.ranks_ran = ranks_ran
        if job_return.status == JobStatus.COMPLETED:
            outcome.return_value = _json_or_repr(job_return._return_value)
            outcome.error = None
        else:
            outcome.return_value = None
            outcome.error = failure_summary(job_return)
        self._ended.append(num)
        # the launch's last job: the summary is rewritten now, whatever the time
        last = len(self._ended) >= len(self._to_run)
        self._event([num], now=last)
        if self._progress is not None:
            self._progress.job_ended(num, failed=outcome.status == FAILED)
        line = (
            f"job {len(self._ended)} of {len(self._to_run)} ended: {job_title(num, outcome.overrides)} : "
            f"{outcome.status} in {outcome.duration_s:.2f}s"
        )
        if outcome.status == COMPLETED:
            if self._progress is None:
                log.info(f"{line}, returned {short_cell(outcome.return_value)}")
        else:
            first, *rest = (outcome.error or "").splitlines() or [""]
            log.error("\n\t".join([f"{line}: {first}", *rest]))
        if last:
            self._end_progress()

    def write(self) -> None:
        """The record on disk now, as the launch ends (stopped, preempted, detached): the
        journal (and whether the run was interrupted), and the summary file, replaced whole
        (a reader never sees half of it). No progress line is left drawn."""
        self._end_progress()
        self._event([], now=True)

    def _event(self, nums: Sequence[int], now: bool = False) -> None:
        """Jobs `nums` changed: their rows in the journal, on disk before this returns; in the
        summary at once when `now`, else within SUMMARY_INTERVAL_S."""
        if not self.writes:
            return
        for num in nums:
            self._rows[num] = asdict(self.outcomes[num])
        lines: List[Dict[str, Any]] = [{"job": self._rows[num]} for num in nums]
        if self._journal is None:
            # the run's first event: its journal starts afresh, with every job of the run
            lines = [{"job": self._rows[num]} for num in sorted(self._rows)]
        if self._journal is None or self.interrupted != self._journaled_interrupted:
            if self.interrupted or self._journal is not None:
                lines.append({"interrupted": self.interrupted})
            self._journaled_interrupted = self.interrupted
        if self._journal is None:
            self._journal = Journal.fresh(self.journal_path, lines)
            self.table_path.unlink(missing_ok=True)  # an earlier run's
        else:
            self._journal.append(lines)
        self._summary_behind = True
        self._rewrite_summary(now)

    def _rewrite_summary(self, now: bool = False) -> None:
        """The summary rewritten if an event is not in it yet: at once when `now` or when the
        last rewrite is SUMMARY_INTERVAL_S old; else by a timer, when it is."""
        if not self.writes or not self._summary_behind:
            return
        wait = 0.0
        if not now and self._summary_at is not None:
            wait = self._summary_at + SUMMARY_INTERVAL_S - time.monotonic()
        if wait <= 0:
            self._write_summary()
        elif self._timer is None:
            self._timer = threading.Timer(wait, self._on_timer)
            self._timer.daemon = True
            self._timer.start()

    def _write_summary(self) -> None:
        with self._summary_lock:  # one rewrite at a time, each of a later snapshot
            self._summary_behind = False
            # a timer still waiting (the timer's own rewrite has let go of it in `_on_timer`):
            # what it would have written is in this rewrite
            timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()
            rows, interrupted = self._rows.copy(), self.interrupted
            record: Dict[str, Any] = {"jobs": [rows[num] for num in sorted(rows)]}
            if interrupted:
                record["interrupted"] = True
            text = json.dumps(record, indent=1, default=repr, allow_nan=False) + "\n"
            replace_whole(self.path, text.encode())
            self._summary_at = time.monotonic()

    def _on_timer(self) -> None:
        self._timer = None
        self._rewrite_quietly()

    def _at_exit(self) -> None:
        """The process ends (however the sweep ended): no line left drawn, the summary whole."""
        if os.getpid() != self._pid:
            return
        self._end_progress()
        if self._timer is not None:
            self._timer.cancel()
        self._rewrite_quietly(now=True)

    def _rewrite_quietly(self, now: bool = False) -> None:
        """The summary rewritten where it can be (away from the launcher's own steps, which
        an error here must not end): a full disk is said, a sweep dir removed is not."""
        try:
            self._rewrite_summary(now)
        except Exception as e:  # the journal has every event; the next rewrite may work
            if self.sweep_dir.is_dir():
                log.warning(f"{shown_path(str(self.path))} could not be rewritten ({type(e).__name__}: {e})")

    def _end_progress(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.close()

    def table(self, nums: Optional[Sequence[int]] = None) -> str:
        """The jobs' rows (this launch's, or `nums`): number, status, time, overrides (those
        that vary across the sweep), result, job dir."""
        shown = _varying_overrides([outcome.overrides for outcome in self.outcomes.values()])
        rows = [["#", "status", "time", "overrides", "result", "job dir"]]
        for num in self._batch if nums is None else nums:
            outcome = self.outcomes[num]
            if outcome.status == COMPLETED:
                result = short_cell(outcome.return_value)
            else:
                result = failure_cell(outcome.error)
            duration = "" if outcome.duration_s is None else f"{outcome.duration_s:.2f}s"
            job_dir = shown_path(outcome.job_dir) if outcome.job_dir else "-"
            rows.append(
                [str(num), outcome.status, duration, cut_cell(shown(outcome.overrides)), result, job_dir]
            )
        return "\n".join(aligned(rows))

    def all_ended_untold(self) -> bool:
        """Whether every job of this batch has ended and its table is still to be shown: the
        runner is only letting its processes go (a stop now does not interrupt the sweep)."""
        return bool(self._batch) and not self._told and len(self._ended) >= len(self._to_run)

    def log_table(self) -> None:
        """The launch's end: the summary up to date, then the tally and the table (of a large
        launch: the jobs that did not complete; every job's row in TABLE_FILE). Told once the
        table is out: a stop while it is written lets it end (`all_ended_untold`)."""
        self._end_progress()
        self._rewrite_summary(now=True)
        counts: Dict[str, int] = {}
        for num in self._batch:
            counts[self.outcomes[num].status] = counts.get(self.outcomes[num].status, 0) + 1
        tally = ", ".join(f"{count} {status_word(status)}" for status, count in counts.items())
        lines = [f"{jobs_counted(len(self._batch))}: {tally} (summary: {shown_path(str(self.path))})"]
        common = _common_overrides([outcome.overrides for outcome in self.outcomes.values()])
        every = [f"overrides every job has: {' '.join(common)}"] if common else []
        if len(self._batch) > LARGE_TABLE and self.writes:
            replace_whole(
                self.table_path, "\n".join([self.table(sorted(self.outcomes)), *every, ""]).encode()
            )
            listed = [n for n in self._batch if self.outcomes[n].status not in (COMPLETED, NOT_STARTED)]
            said = f"every job's row is in {shown_path(str(self.table_path))}"
            if listed:
                first = f", the first {LARGE_TABLE}" if len(listed) > LARGE_TABLE else ""
                said += f"; below, the {len(listed)} that did not complete{first}"
                lines += [said, self.table(listed[:LARGE_TABLE])]
            else:
                lines.append(said)
        else:
            lines.append(self.table())
        log.info("\n".join(lines + every))
        self._told = True

    def stop_summary(self) -> str:
        """One line after a stop: which jobs finished, which were stopped, where their logs are."""
        parts = []
        for status in (COMPLETED, FAILED, PREEMPTED, STOPPED, RUNNING, NOT_STARTED):
            nums = [n for n in self._batch if self.outcomes[n].status == status]
            if not nums:
                continue
            listed = job_numbers(nums)
            if status in (PREEMPTED, STOPPED):
                dirs = ", ".join(shown_path(self.outcomes[n].job_dir) for n in nums)
                listed += f" (continues in {dirs})" if status == PREEMPTED else f" (logs in {dirs})"
            parts.append(f"{status_word(status)} {listed}")
        return "; ".join(parts) + f"; summary in {shown_path(str(self.path))}"


# the reports of this process: at its exit, each one's summary is made whole
_LIVE: "weakref.WeakSet[SweepReport]" = weakref.WeakSet()


@atexit.register
def _reports_at_exit() -> None:
    for report in list(_LIVE):
        report._at_exit()


def _common_overrides(overrides: Iterable[Sequence[str]]) -> List[str]:
    """The overrides (Hydra's own left out) that every one of the jobs has, in the first
    one's order; none for fewer than two jobs or when no job differs from another: then the
    table shows every override."""
    lists = [filter_overrides(list(o)) for o in overrides]
    if len(lists) < 2:
        return []
    common = [o for o in lists[0] if all(o in other for other in lists[1:])]
    return [] if all(len(other) == len(common) for other in lists) else common


def _varying_overrides(overrides: Iterable[Sequence[str]]) -> Callable[[Sequence[str]], str]:
    """What the table's overrides column shows of a job: the overrides that vary across
    the jobs (a key swept, or set in some jobs only), not those every job has."""
    common = set(_common_overrides(overrides))
    return lambda own: " ".join(o for o in filter_overrides(list(own)) if o not in common)


def jobs_counted(count: int) -> str:
    """ "1 job", "3 jobs": a count of jobs as a line says it."""
    return "1 job" if count == 1 else f"{count} jobs"


def job_numbers(nums: Iterable[int]) -> str:
    """Job numbers as a line says them, runs shortened: "#0, #2-#299" (a stopped sweep of
    300 jobs says so in a few words, not 299 numbers)."""
    runs = number_runs(nums)
    return ", ".join(f"#{a}" if a == b else f"#{a}, #{b}" if b == a + 1 else f"#{a}-#{b}" for a, b in runs)


def number_runs(nums: Iterable[int]) -> List[List[int]]:
    """The numbers sorted, in runs of consecutive ones as [first, last]: 0, 2, 3, 4 -> [0, 0], [2, 4]."""
    runs: List[List[int]] = []
    for num in sorted(nums):
        if runs and num == runs[-1][1] + 1:
            runs[-1][1] = num
        else:
            runs.append([num, num])
    return runs


def slurm_ids(ids: List[str]) -> str:
    """SLURM ids as SLURM writes an array's tasks: `12_[0-2,5]`, `12_3`, one array after another."""
    tasks: Dict[str, List[int]] = {}
    others = []
    for slurm_id in ids:
        array, _, task = slurm_id.partition("_")
        if task.isdigit():
            tasks.setdefault(array, []).append(int(task))
        else:
            others.append(slurm_id)
    shown = []
    for array, numbers in tasks.items():
        parts = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in number_runs(numbers))
        shown.append(f"{array}_{parts}" if len(numbers) == 1 else f"{array}_[{parts}]")
    return ", ".join(shown + others)


def status_word(status: str) -> str:
    """NOT_STARTED -> "not started", as the console's sentences say it."""
    return status.lower().replace("_", " ")


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


def short_cell(value: Any) -> str:
    """A return value as a table's cell (`torchrun-sweep status`'s too): JSON, cut to its width."""
    return cut_cell(value if isinstance(value, str) else json.dumps(value, default=repr))


def cut_cell(text: str) -> str:
    return text if len(text) <= _CELL_WIDTH else text[: _CELL_WIDTH - 1] + "…"


def failure_cell(error: Optional[str]) -> str:
    """A job's error as a table's cell: its first line, without the pid and local rank the
    progress line gave."""
    return cut_cell(_RANK_DETAIL.sub("", (error or "").split("\n", 1)[0]))


def aligned(rows: List[List[str]]) -> List[str]:
    """A table's lines: each column as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
