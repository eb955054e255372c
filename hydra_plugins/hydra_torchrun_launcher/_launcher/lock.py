"""One launcher per sweep dir (and node): a second one is refused before it runs anything.

Two launchers in one sweep dir would run the same jobs in the same job dirs at once and
overwrite each other's record. The launcher holds an exclusive `flock` on a lock file in
the sweep dir for as long as its process lives; the kernel releases it when the process
ends however it ends (kill -9, a node that is requeued), so a lock left by a dead launcher
never blocks the next one. In a multi-node sweep every node has its own lock file: the
nodes of one sweep may share the sweep dir, two launchers of one node may not.
"""

import fcntl
import os
import socket
from pathlib import Path
from typing import Dict

from .._shared.errors import LauncherConfigError
from .._shared.paths import shown_path

LOCK_FILE = ".torchrun_launcher.lock"

# the lock files this process holds, by path: held until the process ends
_HELD: Dict[str, int] = {}


def lock_name(node: int, nodes: int) -> str:
    """The lock file of node `node` of a sweep of `nodes` nodes."""
    return LOCK_FILE if nodes <= 1 else f".torchrun_launcher.node{node}.lock"


def hold_sweep_lock(sweep_dir: Path, name: str = LOCK_FILE) -> None:
    """Hold the sweep dir's lock `name` for the rest of this process's life, or refuse the
    sweep in one line naming the launcher that holds it. Taken again by the same process
    (a sweeper's next batch), it is already held."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / name
    key = str(sweep_dir.resolve() / name)
    if key in _HELD:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by a new program
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise LauncherConfigError(
            f"hydra.sweep.dir={shown_path(str(sweep_dir))} is in use by another launcher ({holder}; "
            f"its lock: {shown_path(str(path))}): wait for it to end, or choose another hydra.sweep.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _HELD[key] = fd
