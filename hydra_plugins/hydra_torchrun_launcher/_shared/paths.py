"""Paths as the user reads them in the launcher's lines and errors, from every process."""

import os
from typing import Optional


def shown_path(path: str, start: Optional[str] = None) -> str:
    """A path as the user types it from where they launched (`start`, else this process's
    working dir): relative when below it, else as it is."""
    relative = os.path.relpath(path, start)
    return path if relative.startswith("..") else relative
