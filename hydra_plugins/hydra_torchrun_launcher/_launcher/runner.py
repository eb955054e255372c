"""What a way to run jobs gives the sweep driver (`_launcher.driver`), and what it gets.

The driver composes and checks the jobs, holds the sweep dir, reads the record and decides
what resumes, records and reports what comes back, and ends on a stop signal. A `Runner`
knows only how to run jobs somewhere: how a job's launcher config reads (its keys), the
sweep-wide checks of its own, its dry run, and `run`: start the jobs' nodes, tell the
driver as each starts and ends (`JobEvents`), and stop or cancel them on a stop signal. The
local pool of job processes (`_launcher.local_runner`), SLURM (`_submit.slurm_runner`) and
hosts over ssh (`_ssh.ssh_runner`) are the runners; a new one (another scheduler) is one more class,
importing this module and the driver's public pieces, never the driver's internals.
Models: submitit's Executor over one core, Hydra's joblib launcher (`_core.launch` owns the
lifecycle).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from hydra.core.utils import JobReturn
from omegaconf import DictConfig

from .._shared.plan import JobPlan, JobSettings
from .preempt import StopNotice

# after its job_timeout, how long a job process may take beyond its ranks' shutdown
_STOP_MARGIN_S = 30.0


@dataclass(frozen=True)
class Placement:
    """Where a runner put a job, for its rerun.sh to run it there again: the overrides that
    say so (after the sweep's and the job's own) and the words its header gives them."""

    overrides: Tuple[str, ...]
    where: str
    # the interpreter that runs the app there (a host's `hydra.launcher.python`); None: this one
    python: Optional[str] = None


class SweepDetached(Exception):
    """Raised by a runner whose jobs run on without the launcher (SLURM's `detach`): every
    job is handed over and recorded; the message says how to come back. The sweeper gets
    no results (none exist yet): the launcher ends, status 0."""


class JobFeed(Protocol):
    """The jobs a runner runs, composed just in time: ask for the next one when it can start."""

    def next(self) -> Optional[JobPlan]:
        """The next job to run (composed and checked now), or None when there is none left."""

    def left(self) -> int:
        """How many jobs are left to ask for (some may yet be refused as they are composed)."""


class JobEvents(Protocol):
    """What a runner tells the driver as its jobs go (the driver records and reports it)."""

    def request(
        self,
        plan: JobPlan,
        devices: Optional[List[str]],
        environ: Dict[str, str],
        ignored_signals: List[int],
        placed: Optional[Placement] = None,
    ) -> bytes:
        """The job process's encoded request, made just before the job is handed to its nodes
        (the launcher's state as it is now); its rerun.sh is written and an earlier run's
        mark of its ranks cleared (unless it continues in its job dir). `placed`: where the
        runner put the job, for its rerun.sh to run it there again (None: on `devices`)."""

    def request_ahead(
        self,
        plan: JobPlan,
        devices: Optional[List[str]],
        environ: Dict[str, str],
        ignored_signals: List[int],
        placed: Optional[Placement] = None,
    ) -> "tuple[bytes, Callable[[], None]]":
        """`request`'s, for a job whose process starts before the job does (`_launcher.pool`
        forks it ahead): the request, and what `request` writes in the job's dir, to call
        as the job starts (a job that never starts leaves its dir untouched)."""

    def started(self, plan: JobPlan, detail: Optional[str], hosts: Optional[List[str]] = None) -> None:
        """The job is handed to its nodes, or taken back from an earlier run: its time counts
        from now; its line ends with `detail` (None: no line). `hosts`: the hosts its nodes
        run on, in order, for the record (a runner that names hosts: `names_hosts`)."""

    def running(self, plan: JobPlan, since: float) -> None:
        """Its ranks run since `since` (monotonic), where that is known later than `started`."""

    def ended(self, plan: JobPlan, job_return: JobReturn, stopped: bool) -> None:
        """The job's outcome; `stopped`: it ended because the sweep was stopped."""


class Runner(Protocol):
    """One way to run a sweep's jobs (see the module docstring)."""

    # the sweep's stop notice (the stop signal taken as a preemption notice), or None
    notice: Optional[StopNotice]
    # its jobs run on hosts it names (`torchrun_ssh`): the record keeps each job's hosts
    names_hosts: bool

    def job_settings(self, config: DictConfig) -> "tuple[JobSettings, Optional[str]]":
        """A job's launcher settings from its composed config, checked; and a line to log once."""

    def check_sweep(self, first: JobPlan) -> None:
        """What the first job says of the whole launch (how many jobs at once, which devices),
        checked before anything runs: refused in one line, the sweep stops."""

    def check_job(self, plan: JobPlan) -> None:
        """What must hold of a later job against the first (a key that applies to the whole
        sweep, what the runner can give it): refused in one line, that job ends FAILED."""

    def launchers_sharing_dir(self, first: JobPlan) -> int:
        """How many launcher processes (one per node) share this sweep dir."""

    def dry_run(self, plans: Sequence[JobPlan], configs: Dict[int, DictConfig], recorded: Any) -> str:
        """What a run would do, for the user to read; nothing runs."""

    def held_over(self, plans: Sequence[JobPlan]) -> Set[int]:
        """The jobs of `plans` that an earlier command of this sweep handed to what runs them,
        and that still run there (a SLURM job still queued or running, or whose result is in):
        `run` waits for them rather than start them, so the record decides nothing for them."""

    def run(self, jobs: JobFeed, events: JobEvents) -> Dict[int, JobReturn]:
        """Run the jobs of `jobs`, asking for each when it can start it (not all first),
        telling `events`; their JobReturns by number. On a stop signal: stop or cancel what
        runs, tell `events` of each, then raise `SweepStopped`."""

    def stopped_words(self) -> str:
        """After `run` raised SweepStopped: what the stop did, first words of its line."""


def hard_limit_s(plan: JobPlan) -> Optional[float]:
    """After job_timeout, the ranks' shutdown and a margin, the job's process is killed."""
    conf = plan.settings.conf
    if conf.job_timeout is None:
        return None
    return conf.job_timeout + 2 * conf.shutdown_timeout + _STOP_MARGIN_S
