"""What a fresh warm server saw when it imported the app's packages, kept for later runs.

A forked server (`_server.fork`) inherits imports that ran in the launcher, where nothing
watched them. It may serve jobs only when a fresh server has watched the same imports
(`_server.watch`): what each module read from the environment, whether one started a
thread, seeded a generator, initialised CUDA. That is remembered here, per interpreter
and preload list, with each module's file identity (path, size, modification time), so a
package upgraded since is watched afresh. JSON, not pickle: the file holds no code. It
lives in the user's cache directory (`$XDG_CACHE_HOME`, else `~/.cache`), owner-only.
"""

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

_VERSION = 1
_FILE = "preload-watch.json"


def _path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hydra-torchrun-launcher" / _FILE


def identity(name: str) -> Optional[List[Any]]:
    """[file, size, mtime_ns] of an imported module; None for one without a file."""
    module = sys.modules.get(name)
    origin = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(module, "__file__", None)
    if not isinstance(origin, str) or not os.path.isabs(origin):
        return None
    try:
        stat = os.stat(origin)
    except OSError:
        return None
    return [origin, stat.st_size, stat.st_mtime_ns]


def modules_of(packages: Tuple[str, ...]) -> Dict[str, Optional[List[Any]]]:
    """The imported modules of `packages` (their submodules too), each with its identity."""
    tops = set(packages)
    return {
        name: identity(name)
        for name, module in list(sys.modules.items())
        if module is not None and name.split(".")[0] in tops
    }


def _key(preload: Tuple[str, ...]) -> str:
    return json.dumps([sys.executable, list(preload)])


def _read() -> Dict[str, Any]:
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):  # none yet, or unreadable: everything is watched afresh
        return {}
    return data.get("entries", {}) if isinstance(data, dict) and data.get("version") == _VERSION else {}


def remember(preload: Tuple[str, ...], report: Dict[str, Any]) -> None:
    """Keep a fresh server's report of a clean preload (nothing skipped, nothing unsafe)."""
    if report.get("unsafe") is not None or report.get("skipped") or "modules" not in report:
        return
    entries = _read()
    entries[_key(preload)] = {
        "modules": report["modules"],
        "reads": report["reads"],
        "threads": report["threads"],
    }
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"version": _VERSION, "entries": entries}, f)
    os.replace(partial, path)


def recall(preload: Tuple[str, ...]) -> "Tuple[Optional[Dict[str, Any]], str]":
    """(the remembered report, "") when it covers every module of `preload` the launcher
    has imported now, unchanged; else (None, why not)."""
    entry = _read().get(_key(preload))
    if entry is None:
        return None, "the imports of the app's packages have not been watched yet (this run does)"
    watched = entry["modules"]
    for name, now in modules_of(preload).items():
        if name not in watched:
            return None, f"the app imported {name}, which no warm server has watched yet (this run does)"
        if watched[name] != now:
            return None, f"{name} changed since its import was watched (this run watches it again)"
    return entry, ""
