"""The files by which a job's process and its ranks talk about a stop request.

They live in the job process's private directory (0700), named to the ranks by an
environment variable, so they work the same for in-process ranks, scripts and ranks under
a launch prefix, and on every node (each node's job process has its own):
- `stop`: the job's process got the stop signal; the ranks' `should_stop()` reads it;
- `stop.started`: a rank of the job has started (a stop before that interrupts the job's
  rendezvous instead of waiting for ranks that never run);
- `stop.seen`: a rank's `should_stop()` said True: the job stopped at a step boundary.
One more lives in the job dir, where it outlasts the job's process (a launcher killed with
-9 takes its jobs with it): `.hydra/ranks_started`, made as the job's first rank starts, so a
resumed sweep knows that the job's ranks ran there (and may have left a checkpoint).
Imports nothing heavy: the rank-side API and `_rank.main`'s exec stage use it.
"""

import os
from typing import Optional

STOP_FILE_ENV = "HYDRA_TORCHRUN_STOP_FILE"
RESUMED_ENV = "HYDRA_TORCHRUN_RESUMED"
STARTED = ".started"
SEEN = ".seen"
# the job dir's mark that the job's ranks have started there (named to the ranks by env var)
RANKS_STARTED_FILE = os.path.join(".hydra", "ranks_started")
RANKS_STARTED_ENV = "HYDRA_TORCHRUN_RANKS_STARTED_FILE"


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
