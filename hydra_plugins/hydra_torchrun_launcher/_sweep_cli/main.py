"""`torchrun-sweep`: where a sweep stands, and cancelling its SLURM jobs, from any shell.

    torchrun-sweep status DIR [--json]   where the sweep in DIR stands
    torchrun-sweep cancel DIR            scancel its SLURM jobs still queued or running

DIR is a sweep dir (`hydra.sweep.dir`) of `hydra/launcher=torchrun`, `torchrun_slurm` or
`torchrun_ssh`, running, detached or ended. `status` reads the sweep's record and, for SLURM jobs in flight,
asks `squeue` once; `cancel` asks `squeue` once and `scancel`s once. Neither imports torch.

Exit status: 0; 1 when SLURM refused to cancel (or `cancel` was asked of a local sweep); 2
when DIR holds no record of a sweep (one line naming the file looked for) or the command
line is wrong.

`status --json` prints one JSON object (its shape is kept; keys may be added):

    {"sweep_dir": absolute path, "runner": "local" | "slurm" | "ssh",
     "stage": "running" | "detached" | "unfinished" | "ended",
     "launcher": "pid N on HOST since T" while a launcher runs the sweep, else null,
     "counts": {state: number of jobs}, "varying": [keys of the overrides that vary],
     "squeue_error": null, or why SLURM's states are unknown,
     "jobs": [{"num", "state", "recorded", "slurm_id", "nodes", "elapsed_s", "overrides",
               "return_value", "error", "note", "job_dir"}]}

`nodes`: the nodes SLURM runs a job on, or the hosts an ssh sweep's job runs or ran on
("host1,host2"); null otherwise.

`state` is where the job stands now: the record's status (COMPLETED, FAILED, PREEMPTED,
STOPPED, RUNNING, NOT_STARTED), SLURM's state of a job in flight (PENDING, RUNNING, ...),
ENDED (its nodes wrote its result, not in the record yet), UNFINISHED (RUNNING in the record,
but no launcher runs it any more), GONE (SLURM no longer shows it and it left no result) or
SUBMITTED (squeue could not say); `recorded` is the record's status.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from .._launcher.report import (
    COMPLETED,
    aligned,
    cut_cell,
    failure_cell,
    job_numbers,
    jobs_counted,
    short_cell,
    slurm_ids,
    status_word,
)
from .._shared import slurm_commands
from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.slurm_commands import SlurmCommandError
from .._submit.files import SLURM_DIR
from .state import (
    DETACHED,
    ENDED_STAGE,
    RUNNING_STAGE,
    UNFINISHED_STAGE,
    NoRecord,
    SweepView,
    read_sweep,
    shown_overrides,
)

PROG = "torchrun-sweep"
# a job's keys in `status --json`, in their order (then its job dir)
_JOB_KEYS = "num state recorded slurm_id nodes elapsed_s overrides return_value error note".split()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Where a hydra-torchrun-launcher sweep stands; cancel its SLURM jobs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{status,cancel}")
    status = sub.add_parser("status", help="where the sweep in DIR stands, a line per job")
    status.add_argument("sweep_dir", metavar="DIR", help="the sweep dir (hydra.sweep.dir)")
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    cancel = sub.add_parser("cancel", help="cancel the sweep's SLURM jobs still queued or running")
    cancel.add_argument("sweep_dir", metavar="DIR", help="the sweep dir (hydra.sweep.dir)")
    args = parser.parse_args(argv)
    sweep_dir = Path(args.sweep_dir)
    try:
        if args.command == "status":
            view = read_sweep(sweep_dir)
            print(json.dumps(as_json(view), indent=1, default=repr) if args.json else as_text(view))
            return 0
        line, code = cancel_jobs(sweep_dir)
    except NoRecord as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `torchrun-sweep status DIR | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    print(line if code == 0 else f"{PROG}: {line}", file=sys.stdout if code == 0 else sys.stderr)
    return code


# -- status --------------------------------------------------------------------------------


def as_json(view: SweepView) -> Dict[str, Any]:
    return {
        "sweep_dir": str(view.sweep_dir.resolve()),
        "runner": view.runner,
        "stage": view.stage,
        "launcher": view.launcher,
        "counts": view.counts,
        "varying": view.varying,
        "squeue_error": view.squeue_error,
        "jobs": [
            {**{key: getattr(job, key) for key in _JOB_KEYS}, "job_dir": job.job_dir or None}
            for job in view.jobs
        ],
    }


def as_text(view: SweepView) -> str:
    """The sweep's line, its counts, then a row per job."""
    kind = {"slurm": "a SLURM", "ssh": "an ssh"}.get(view.runner, "a local")
    lines = [f"{shown_path(str(view.sweep_dir))}: {kind} sweep, {_stage(view)}"]
    tally = ", ".join(f"{count} {status_word(state)}" for state, count in view.counts.items())
    lines.append(f"{jobs_counted(len(view.jobs))}: {tally}")
    if view.squeue_error:
        lines.append(f"{view.squeue_error}: where its SLURM jobs stand is not known")
    slurm = any(job.slurm_id for job in view.jobs)
    rows = [["#", "state", *(["SLURM id"] if slurm else []), "elapsed", "overrides", "result"]]
    for job in view.jobs:
        if job.state == COMPLETED:
            result = short_cell(job.return_value)
        elif job.error:
            result = failure_cell(job.error)
        else:
            result = cut_cell(job.note or "")
        rows.append(
            [
                str(job.num),
                job.state,
                *([job.slurm_id or ""] if slurm else []),
                _elapsed(job.elapsed_s),
                cut_cell(" ".join(shown_overrides(job.overrides, view.varying))),
                result,
            ]
        )
    lines += aligned(rows)
    return "\n".join(lines)


def _stage(view: SweepView) -> str:
    if view.stage == RUNNING_STAGE:
        return f"running (its launcher: {view.launcher})"
    if view.launcher_unknown:
        return f"{view.stage} unless its launcher ({view.launcher_unknown}) still runs: this host cannot tell"
    if view.stage == DETACHED:
        return (
            "detached: no launcher waits for its SLURM jobs (the sweep's command, run again, collects them)"
        )
    if view.stage == UNFINISHED_STAGE:
        return "unfinished: no launcher runs it (the sweep's command, run again, resumes it)"
    assert view.stage == ENDED_STAGE
    return "ended"


def _elapsed(seconds: Optional[float]) -> str:
    """0.95s, 42s, 3m04s, 2h05m, 1d02h."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.0f}s" if float(seconds).is_integer() else f"{seconds:.2f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


# -- cancel --------------------------------------------------------------------------------


def cancel_jobs(sweep_dir: Path) -> "tuple[str, int]":
    """scancel the sweep's SLURM jobs still queued or running (one squeue call says which, one
    scancel call cancels them); the line to say and the exit status."""
    view = read_sweep(sweep_dir)  # NoRecord without a record; asks squeue once for the jobs in flight
    shown = shown_path(str(sweep_dir))
    if view.runner != "slurm":
        how = f"; its launcher is {view.launcher}" if view.launcher else ""
        return (
            f"{shown} is {'an ssh' if view.runner == 'ssh' else 'a local'} sweep (no {SLURM_DIR}/ in it): "
            f"it has no SLURM job to cancel{how}",
            1,
        )
    in_flight = {job.num: str(job.slurm_id) for job in view.jobs if job.queued_or_running()}
    if not in_flight:
        return f"nothing to cancel: no SLURM job of {shown} is queued or running", 0
    ids = sorted(in_flight.values(), key=_id_order)
    try:
        said = slurm_commands.scancel(ids)
    except (LauncherConfigError, SlurmCommandError) as e:
        return str(e), 1
    what = f"{job_numbers(in_flight)} of {shown} (SLURM {_plural(len(ids))} {slurm_ids(ids)})"
    if said is not None:
        return f"scancel could not cancel {what}: {said}", 1
    return f"cancelled {what}", 0


def _plural(count: int) -> str:
    return "job" if count == 1 else "jobs"


def _id_order(slurm_id: str) -> "tuple[int, int]":
    array, _, task = slurm_id.partition("_")
    return (int(array), int(task)) if array.isdigit() and task.isdigit() else (0, 0)


if __name__ == "__main__":
    sys.exit(main())
