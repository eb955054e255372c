"""Where a submitted sweep keeps what travels between the login node and the SLURM nodes.

Everything lives in `<sweep dir>/.slurm/`, a directory only its owner can enter (0700): the
pickled job requests (the task function travels in them, so nobody else may read or
replace them), the batch scripts, SLURM's output files, each job's result as its node 0
wrote it, and the ids of the jobs submitted, recorded before the launcher waits on them.
The sweep dir is on a filesystem the nodes share, as with submitit's folder.
"""

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Dict, Tuple

from .._launcher.durable import replace_whole

SLURM_DIR = ".slurm"
SUBMITTED = "submitted.json"


def slurm_dir(sweep_dir: Path) -> Path:
    """The sweep's `.slurm/` dir, made owner-only; refused when someone else could use it."""
    path = sweep_dir / SLURM_DIR
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def request_file(directory: Path, idx: int) -> Path:
    return directory / f"job{idx}.request"


# the attribute of a JobReturn (as node 0 writes it) that holds how long its run took, in
# seconds: a job whose end no launcher saw (detached, or its launcher dead) is timed by it
RUN_TIME_ATTR = "_torchrun_run_s"


def result_file(directory: Path, idx: int, array_id: str, attempt: int) -> Path:
    """The job's result as its node 0 wrote it in run `attempt` (SLURM_RESTART_COUNT). Every
    file a run of the job writes is named by the array SLURM gave it (`array_id`): a job of an
    earlier submission into the same sweep dir (cancelled, or still ending) never writes what
    the launcher reads of this one; and by the run: the failure of a run that SLURM requeued
    itself (a node failure, `scontrol requeue`, preemption) is not taken for the job's end."""
    return directory / f"job{idx}.{array_id}.{attempt}.result"


def failure_file(directory: Path, idx: int, array_id: str, attempt: int) -> Path:
    """The first failure any node of the job's run saw (its JobReturn): the root cause, where a
    rank that failed on one node made SLURM stop the others (`srun --kill-on-bad-exit`)."""
    return directory / f"job{idx}.{array_id}.{attempt}.failure"


def error_file(directory: Path, idx: int, array_id: str, attempt: int) -> Path:
    """A failed run's error as the record says it (its summary, as text), beside its result:
    `torchrun-sweep status` tells it where no launcher has recorded the job's end yet (a
    detached sweep), without unpickling the app's objects the result may hold."""
    return directory / f"job{idx}.{array_id}.{attempt}.error"


_RUN_FILE = re.compile(r"^job(\d+)\.(\d+)\.(\d+)\.(result|failure)$")


def latest_runs(directory: Path) -> Dict[Tuple[int, str, str], int]:
    """The latest run that wrote each kind of file ("result", "failure"), by (job number,
    array id, kind): one listing of the dir for the whole sweep."""
    latest: Dict[Tuple[int, str, str], int] = {}
    for name in os.listdir(directory):
        found = _RUN_FILE.match(name)
        if found:
            key = (int(found[1]), found[2], found[4])
            latest[key] = max(latest.get(key, -1), int(found[3]))
    return latest


def requeued_file(directory: Path, idx: int, array_id: str) -> Path:
    """How many times node 0 requeued the job after a stop (written just before it does)."""
    return directory / f"job{idx}.{array_id}.requeued"


def timeouts_file(directory: Path, idx: int, array_id: str) -> Path:
    """How many times the job was requeued after reaching its time limit (max_num_timeout)."""
    return directory / f"job{idx}.{array_id}.timeouts"


def output_pattern(directory: Path) -> str:
    """SLURM's output file of every job (`%a`: the job's number, `%A`: the array's id)."""
    return str(directory / "job%a.%A.out")


def output_file(directory: Path, idx: int, array_id: str) -> Path:
    return directory / f"job{idx}.{array_id}.out"


def replace_private(path: Path, data: bytes) -> None:
    """Owner-only (0600), replaced whole."""
    replace_whole(path, data, mode=0o600)


def write_first(path: Path, data: bytes) -> bool:
    """Owner-only, and only if no one wrote `path` before (a hard link never replaces): whether
    this call wrote it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    replace_private(partial, data)
    try:
        os.link(partial, path)
        return True
    except FileExistsError:
        return False
    finally:
        partial.unlink()


def read_private(path: Path) -> bytes:
    """A file only this user can have written (ours, not writable by others), else an error."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is not this user's alone: it is not used")
    return path.read_bytes()


def read_submitted(directory: Path) -> Dict[str, Any]:
    """The jobs submitted and not yet collected: {job number: {"slurm_id", "fingerprint"}}."""
    path = directory / SUBMITTED
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def write_submitted(directory: Path, submitted: Dict[str, Any]) -> None:
    replace_whole(directory / SUBMITTED, (json.dumps(submitted, indent=1) + "\n").encode(), mode=0o600)
