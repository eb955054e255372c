"""SLURM's own commands, as every part of the launcher uses them: sbatch, squeue, sacct,
scancel and scontrol, here alone.

The layer torchx's SLURM scheduler has: argv lists (never a shell line), `--parsable`
output, and SLURM's own words for every state and error, with one timeout for every
command. Polling reads the whole sweep in one `squeue` call, whatever the number of jobs;
`sacct` is asked only about a job that `squeue` no longer shows (and is not needed where
accounting is off). `scontrol show job` has one reader (`show_job`). The login node's
runner (`_submit`), a launcher inside a SLURM job (`_launcher.preempt`: requeue;
`_launcher.cluster_slurm`: hostlists) and `torchrun-sweep` all come here.
"""

import functools
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from .config_error import LauncherConfigError

# SLURM's commands answer in well under a second; a hung controller must not hang the sweep
COMMAND_TIMEOUT_S = 60.0
# states after which a job runs no more (squeue's and sacct's long names)
ENDED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)


class SlurmCommandError(RuntimeError):
    """A SLURM command failed; the message is SLURM's own last line of error."""


@dataclass(frozen=True)
class JobState:
    """One job as SLURM shows it: its state, the reason (pending or ended), its nodes."""

    state: str
    reason: str
    nodes: str
    restarts: int = 0
    partition: str = ""
    elapsed_s: Optional[float] = None  # how long its current run has run (squeue's %M)


def _command(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise LauncherConfigError(
            f"hydra/launcher=torchrun_slurm needs SLURM's `{name}` on PATH "
            "(run it on a login node of the cluster)"
        )
    return found


def _run(argv: List[str]) -> "subprocess.CompletedProcess[str]":
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise SlurmCommandError(
            f"`{argv[0]} {argv[1] if len(argv) > 1 else ''}` did not answer in {e.timeout:g}s"
        ) from None


def _said(result: "subprocess.CompletedProcess[str]") -> str:
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {result.returncode}"


def sbatch(script: Path) -> str:
    """Submit the batch script; the job's (the array's) id."""
    result = _run([_command("sbatch"), "--parsable", str(script)])
    if result.returncode != 0:
        raise SlurmCommandError(_said(result))
    return result.stdout.strip().split(";")[0]


def squeue(array_ids: Iterable[str]) -> Optional[Dict[str, JobState]]:
    """Every task of these arrays that SLURM still shows, by `<array id>_<task id>`; None when
    squeue itself fails (the caller polls again later)."""
    ids = sorted(set(array_ids))
    if not ids:
        return {}
    result = _run(
        [
            _command("squeue"),
            "--noheader",
            "--array",
            "--states=all",
            f"--jobs={','.join(ids)}",
            "--format=%i|%T|%r|%N|%P|%M",
        ]
    )
    if result.returncode != 0:
        # every id of the list purged already: squeue refuses the list instead of showing nothing
        return {} if "Invalid job id" in _said(result) else None
    states: Dict[str, JobState] = {}
    for line in result.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 6:
            states[parts[0]] = JobState(
                parts[1], parts[2], parts[3], partition=parts[4], elapsed_s=duration_s(parts[5])
            )
    return states


def duration_s(shown: str) -> Optional[float]:
    """A duration as squeue shows it (`%L`, `%M`: `[days-]hours:minutes:seconds`,
    `minutes:seconds`) in seconds; None for what is no duration (UNLIMITED, NOT_SET, INVALID)."""
    days, _, clock = shown.strip().rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        whole_days = int(days or 0)
    except ValueError:
        return None
    if not 1 <= len(parts) <= 3:
        return None
    while len(parts) < 3:
        parts.insert(0, 0)
    return float((whole_days * 24 + parts[0]) * 3600 + parts[1] * 60 + parts[2])


def _fields(oneliner: str) -> Dict[str, str]:
    """`Key=Value Key=Value ...`, as `scontrol show ... --oneliner` prints a job or partition."""
    return dict(item.split("=", 1) for item in oneliner.split() if "=" in item)


def show_job(job_id: str) -> Optional[Dict[str, str]]:
    """`scontrol show job`'s fields of the job (JobState, Restarts, BatchFlag, Requeue, ...);
    None once SLURM no longer knows it."""
    result = _run([_command("scontrol"), "show", "job", "--oneliner", job_id])
    if result.returncode != 0:
        said = _said(result)
        if "Invalid job id" in said:
            return None
        raise SlurmCommandError(said)
    return _fields(result.stdout)


def requeue(job_id: str) -> Optional[str]:
    """`scontrol requeue` the job; None, or SLURM's words when it would not."""
    result = _run([_command("scontrol"), "requeue", job_id])
    return None if result.returncode == 0 else _said(result)


@functools.lru_cache(maxsize=64)
def hostnames(hostlist: str) -> Tuple[str, ...]:
    """A SLURM hostlist (`node[01-04]`) expanded by `scontrol show hostnames`, in order
    (asked once per list); SlurmCommandError with scontrol's own words when it fails."""
    result = _run([_command("scontrol"), "show", "hostnames", hostlist])
    if result.returncode != 0:
        raise SlurmCommandError(_said(result))
    return tuple(line.strip() for line in result.stdout.splitlines() if line.strip())


def job_run(job_id: str) -> Optional["tuple[str, int]"]:
    """The job's state and how often SLURM requeued it (`Restarts`, counted when it requeues,
    before the job's processes are stopped); None once SLURM no longer knows the job."""
    fields = show_job(job_id)
    if fields is None:
        return None
    state, restarts = fields.get("JobState"), fields.get("Restarts", "")
    if not state or not restarts.isdigit():
        return None
    return state, int(restarts)


def preempting(job_id: str) -> bool:
    """Whether SLURM is preempting the job's current run: it selected the run for preemption
    (`PreemptTime`, at or after the run's `StartTime`) and the run is still on its nodes,
    within its partition's GraceTime. Under PreemptMode=REQUEUE SLURM then stops the run's
    processes with SIGTERM (unless PreemptParameters=send_user_signal sends the job's
    `--signal`) and requeues the job when the grace time ends, but only if the job is still
    running then. False when SLURM does not say, or does not know the job."""
    try:
        fields = show_job(job_id)
    except SlurmCommandError:
        return False
    if not fields or fields.get("JobState") not in ("RUNNING", "COMPLETING"):
        return False
    selected, started = fields.get("PreemptTime", "None"), fields.get("StartTime", "")
    # both as scontrol prints times (2026-11-25T23:06:47): ordered as strings
    return selected[:1].isdigit() and started[:1].isdigit() and selected >= started


def partition_nodes(partition: str) -> Optional[int]:
    """The most nodes one job of `partition` can have (its node count, or its MaxNodes where
    lower); None when SLURM does not say (several partitions, scontrol failing)."""
    if not partition or "," in partition:
        return None
    result = _run([_command("scontrol"), "show", "partition", "--oneliner", partition])
    if result.returncode != 0:
        return None
    fields = _fields(result.stdout)
    limits = [int(fields[key]) for key in ("TotalNodes", "MaxNodes") if fields.get(key, "").isdigit()]
    return min(limits) if limits else None


def sacct(job_id: str) -> Optional[JobState]:
    """How SLURM's accounting saw the job end, or None where accounting is off or silent."""
    if shutil.which("sacct") is None:
        return None
    result = _run(
        [
            shutil.which("sacct") or "sacct",
            "--noheader",
            "--parsable2",
            "--allocations",
            "--jobs",
            job_id,
            "--format=JobID,State,Reason,NodeList",
        ]
    )
    if result.returncode != 0:
        return None
    for line in result.stdout.splitlines():
        parts = line.split("|")
        if len(parts) >= 4 and parts[0] == job_id:
            return JobState(parts[1].split()[0], parts[2], parts[3])
    return None


def scancel(job_ids: Iterable[str]) -> Optional[str]:
    """Cancel the jobs; None, or SLURM's words when it could not."""
    ids = sorted(set(job_ids))
    if not ids:
        return None
    result = _run([_command("scancel"), *ids])
    return None if result.returncode == 0 else _said(result)
