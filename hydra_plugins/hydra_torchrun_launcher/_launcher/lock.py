"""One launcher per sweep dir (and node): a second one is refused before it runs anything.

Two launchers in one sweep dir would run the same jobs in the same job dirs at once and
overwrite each other's record. The launcher holds an exclusive `flock` on a lock file in
the sweep dir for as long as its process lives; the kernel releases it when the process
ends however it ends (kill -9, a node that is requeued), so a lock left by a dead launcher
never blocks the next one. A sweep of N nodes has N lock files: the nodes of one sweep may
share the sweep dir, each holding one (its slot; slot 0 keeps the record), and a launcher
beyond N is refused.
"""

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Dict

from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path

LOCK_FILE = ".torchrun_launcher.lock"

# the lock files this process holds, by path: held until the process ends
_HELD: Dict[str, int] = {}


def lock_name(slot: int) -> str:
    """The lock file of a sweep's node `slot` (0 for a single-node sweep)."""
    return LOCK_FILE if slot == 0 else f".torchrun_launcher.node{slot}.lock"


def holder(sweep_dir: Path, slot: int = 0) -> str:
    """Who holds (or last held) the lock of node `slot`: "pid N on host since T"."""
    try:
        return (sweep_dir / lock_name(slot)).read_text().strip()
    except FileNotFoundError:
        return ""


def hold_sweep_lock(sweep_dir: Path, nodes: int = 1) -> int:
    """Hold a lock of the sweep dir for the rest of this process's life, or refuse the sweep
    in one line naming the launcher that holds it. A sweep of `nodes` nodes has that many
    locks, one per node sharing the sweep dir: this launcher takes the first free one, and
    its number (the node's slot: slot 0 keeps the record) is returned. Taken again by the
    same process (a sweeper's next batch), the slot it holds is returned."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    for slot in range(max(nodes, 1)):
        if str(sweep_dir.resolve() / lock_name(slot)) in _HELD:
            return slot
    holders = []
    for slot in range(max(nodes, 1)):
        path = sweep_dir / lock_name(slot)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by a new program
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holders.append(os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process")
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())  # as the user reads it
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)
        _HELD[str(sweep_dir.resolve() / lock_name(slot))] = fd
        return slot
    path = sweep_dir / LOCK_FILE
    which = "another launcher" if nodes <= 1 else f"the sweep's {nodes} nodes' launchers"
    raise LauncherConfigError(
        f"hydra.sweep.dir={shown_path(str(sweep_dir))} is in use by {which} ({'; '.join(holders)}; "
        f"its lock: {shown_path(str(path))}): wait for it to end, or choose another hydra.sweep.dir"
    )
