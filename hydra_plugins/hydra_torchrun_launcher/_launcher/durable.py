"""Files of the sweep's record, replaced whole and on disk before the launcher goes on.

A reader (a resumed run, a script, another node) never sees half a file: the data goes to
a partial file beside it, which replaces it in one rename. Both the file and its directory
are fsync'd, so a node that loses power or is requeued right after a job ended does not
come back with an empty or missing record of a job it reported.
"""

import itertools
import os
from pathlib import Path

# each rewrite its own partial file: a rewrite that interrupts another (a signal's handler)
# never writes into the file the other one renames
_PARTIALS = itertools.count()


def replace_whole(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write `data` as `path`, replacing it whole, durably. `mode` is the file's (0o666: as
    the umask makes it; 0o600: owner-only whatever the umask, for what only this user may
    have written)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.{next(_PARTIALS)}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        if mode == 0o600:
            os.fchmod(fd, mode)  # a partial file left by an earlier process kept its mode
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    """The directory's entries (a rename into it) on disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
