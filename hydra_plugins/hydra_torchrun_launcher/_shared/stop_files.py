"""The files by which a job's process and its ranks talk about a stop request.

They live in the job process's private directory (0700), named to the ranks by an
environment variable, so they work the same for in-process ranks, scripts and ranks under
a launch prefix, and on every node (each node's job process has its own):
- `stop`: the job's process got the stop signal; the ranks' `should_stop()` reads it;
- `stop.started`: a rank of the job has started (a stop before that interrupts the job's
  rendezvous instead of waiting for ranks that never run);
- `stop.seen`: a rank's `should_stop()` said True: the job stopped at a step boundary.
And `ranks/<pid>` in the same private dir: each rank's process as it starts (its rank,
local rank, attempt, and whether it dumps its stack on `DUMP_SIGNAL`), so that the job's
process can name the ranks still running when it stops them, and ask those that can where
they were (`_job.failure_report.deadline_report`).
And `returned`, a socket of the job's process: a rank whose task returned says so there, and
the job's agent looks at its ranks at once instead of at its next poll
(`_job.torch_adjustments`).
One more lives in the job dir, where it outlasts the job's process (a launcher killed with
-9 takes its jobs with it): `.hydra/ranks_started`, made as the job's first rank starts, so a
resumed sweep knows that the job's ranks ran there (and may have left a checkpoint).
Imports nothing heavy: the rank-side API and `_rank.main`'s exec stage use it.
"""

import json
import os
import signal
import socket
from dataclasses import dataclass
from typing import List, Optional

STOP_FILE_ENV = "HYDRA_TORCHRUN_STOP_FILE"
RESUMED_ENV = "HYDRA_TORCHRUN_RESUMED"
STARTED = ".started"
SEEN = ".seen"
# the job dir's mark that the job's ranks have started there (named to the ranks by env var)
RANKS_STARTED_FILE = os.path.join(".hydra", "ranks_started")
RANKS_STARTED_ENV = "HYDRA_TORCHRUN_RANKS_STARTED_FILE"
# the dir of the ranks' process files (named to the ranks by env var)
RANK_PROCESSES_ENV = "HYDRA_TORCHRUN_RANK_PROCESSES"
# the socket to which a rank says that its task returned (named to the ranks by env var)
RETURNED_SOCKET_ENV = "HYDRA_TORCHRUN_RETURNED_SOCKET"
# a rank of the launcher's dumps its Python stack (all threads) to its stderr on this signal:
# a real-time one, which no library of a training (NCCL, Lightning's SLURM requeue: SIGUSR1)
# takes for its own, and which the job's process sends only to a rank that registered it
DUMP_SIGNAL = signal.SIGRTMIN + 6
# a rank that runs a training script: the folder of the `sitecustomize` that registers its
# dump (`_rank/stack_hook`), put first on its PYTHONPATH by its exec stage, which it removes
STACK_HOOK_ENV = "HYDRA_TORCHRUN_STACK_HOOK"


def stop_file() -> Optional[str]:
    """The stop file of the job this process is a rank of; None outside the launcher."""
    return os.environ.get(STOP_FILE_ENV) or None


def touch(path: str) -> None:
    """Create `path` (owner-only) if it is not there. The job's private dir is gone only
    when its process is, and then nobody is left to read the file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    except FileNotFoundError:
        return
    os.close(fd)


def note_rank_started() -> None:
    """Called by every rank as it starts (before the task or script runs)."""
    path = stop_file()
    if path is not None:
        touch(path + STARTED)
    mark = os.environ.get(RANKS_STARTED_ENV)
    if mark and not os.path.exists(mark):
        os.makedirs(os.path.dirname(mark), exist_ok=True)
        touch(mark)


def tell_task_returned() -> None:
    """Called by a rank whose task returned, just before torch's wrapper queues its value."""
    address = os.environ.get(RETURNED_SOCKET_ENV)
    if not address:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(b"r", address)
        except OSError:
            pass  # the job's process has stopped listening or is not reading: its agent's next poll sees it


@dataclass(frozen=True)
class LiveRank:
    rank: int
    local_rank: int
    pid: int
    dumps: bool  # it dumps its stack on DUMP_SIGNAL


def note_rank_process(dumps: bool) -> None:
    """Called by a rank's process as it starts: it is rank RANK of this attempt, pid N."""
    directory = os.environ.get(RANK_PROCESSES_ENV)
    if not directory:
        return
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "dumps": dumps,
    }
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = os.path.join(directory, str(os.getpid()))
        tmp = f"{path}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)  # whole or not at all
    except OSError:
        pass


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        if os.path.isdir("/proc"):
            return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def ranks_of(directory: str, attempt: int, running: bool = False) -> List[LiveRank]:
    """The ranks of `attempt` (with `running`: those whose process still runs), by rank; one
    per rank: the process that dumps its stack, where a launch prefix runs in one of its own."""
    found = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if record.get("attempt") != attempt or (running and not _alive(int(name))):
            continue
        rank = LiveRank(int(record["rank"]), int(record["local_rank"]), int(name), bool(record["dumps"]))
        known = found.get(rank.rank)
        if known is None or (rank.dumps and not known.dumps):
            found[rank.rank] = rank
    return [found[rank] for rank in sorted(found)]
