"""The hosts of `hydra/launcher=torchrun_ssh`, and what of the head's environment reaches them.

`hosts` is a list of names as ssh knows them (its config's `Host` aliases too); `hostfile` a
file of one host a line, DeepSpeed's `host slots=N` accepted (N: the devices the jobs
there share out), `#` starting a comment. `env_forward` names variables, or `PREFIX*`
patterns, passed from the head to every job's ranks, as DeepSpeed's runner exports its
NCCL_*, PYTHON*, ... variables.
"""

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .._shared.config_error import LauncherConfigError

# DeepSpeed's hostfile line: `worker-1 slots=4`
_SLOTS = re.compile(r"^(\S+)\s+slots=(\d+)$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.@:\[\]-]+$")


@dataclass(frozen=True)
class Host:
    """A host as ssh knows it; `slots`: its devices to share out (None: one job at a time)."""

    name: str
    slots: Optional[int] = None


def parse_hostfile(text: str, path: str) -> List[Host]:
    """The hosts of a hostfile's text (`path` names it in errors)."""
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        found = _SLOTS.match(line)
        name, slots = (found.group(1), int(found.group(2))) if found else (line, None)
        if not _HOST_NAME.match(name) or name.startswith("-"):
            raise LauncherConfigError(
                f"hydra.launcher.hostfile={path}: line {number} ({line!r}) is not a host: one host a line, "
                "as ssh knows it, optionally followed by slots=N"
            )
        if slots == 0:
            raise LauncherConfigError(
                f"hydra.launcher.hostfile={path}: line {number} ({line!r}) gives the host no slot"
            )
        hosts.append(Host(name, slots))
    return hosts


def resolve_hosts(hosts: Any, hostfile: Any, launch_dir: str) -> List[Host]:
    """The sweep's hosts from `hosts` or `hostfile` (exactly one of them), checked."""
    if hosts and hostfile:
        raise LauncherConfigError(
            "hydra.launcher.hosts and hydra.launcher.hostfile are both set: give the hosts one way"
        )
    if hostfile:
        path = Path(launch_dir, str(hostfile))
        try:
            text = path.read_text()
        except OSError as e:
            raise LauncherConfigError(
                f"hydra.launcher.hostfile={hostfile} cannot be read: {e.strerror}"
            ) from None
        found = parse_hostfile(text, str(hostfile))
        if not found:
            raise LauncherConfigError(f"hydra.launcher.hostfile={hostfile} names no host")
    elif hosts:
        if not isinstance(hosts, (list, tuple)):
            hosts = [hosts]
        found = []
        for name in hosts:
            name = str(name)
            if not _HOST_NAME.match(name) or name.startswith("-"):
                raise LauncherConfigError(
                    f"hydra.launcher.hosts: {name!r} is not a host name as ssh takes it"
                )
            found.append(Host(name))
    else:
        raise LauncherConfigError(
            "hydra/launcher=torchrun_ssh needs its hosts: hydra.launcher.hosts=[host1,host2] "
            "or hydra.launcher.hostfile=<file, one host a line>"
        )
    names = [host.name for host in found]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise LauncherConfigError(f"hydra/launcher=torchrun_ssh: host {twice[0]} is named twice")
    return found


def forwarded(
    patterns: Sequence[str], env_set: Mapping[str, str], environ: Mapping[str, str]
) -> Dict[str, str]:
    """The head's variables that `patterns` (names, `PREFIX*`) name, and every env_set key the
    head has (run_job sets env_set's values on the host in any case)."""
    chosen = {}
    for name, value in environ.items():
        if name in env_set or any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            chosen[name] = value
    return chosen


def check_patterns(value: Any) -> List[str]:
    """`env_forward` as a list of names or patterns."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise LauncherConfigError(
            f"hydra.launcher.env_forward={value!r} is invalid: a list of variable names or PREFIX* patterns"
        )
    return list(value)
