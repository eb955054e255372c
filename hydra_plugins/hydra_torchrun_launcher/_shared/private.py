"""What is private to the launcher: the names of others it relies on, and its own directories.

Private names. Every private name of torch, multiprocessing, Hydra or OmegaConf the
launcher relies on, in one list. A private name can go in any release. Each use is guarded
where it is made: when the name is missing (or has another shape) the launcher degrades as
`PRIVATE_NAMES` says, with one clear line where a documented promise no longer holds; it
never crashes in every rank. `tests/test_private_names.py` checks every entry against the
installed versions, so CI on the oldest and newest supported releases says when one went
away.

Private directories. Each job's process keeps its stop files, its ranks' payload and its
forkserver's socket in a directory of its own in the temp dir (0700), removed when the job
ends (`private_dir`). A process killed with SIGKILL cannot remove it, so its name says whose
it is, `hydra_torchrun_<pid>-<start time>-<boot>_XXXXXXXX` (`<boot>`: the start of the
machine's boot id, so that a temp dir shared by several hosts never has one host judge
another's pids), and whoever outlives that process (the warm server that forked it, the next
run's, a SLURM node's next job) removes the directories of this user whose owner is gone
(`remove_dead_private_dirs`); one whose owner still runs, another user's, one made on another
host or boot, or one whose name says no owner, is never touched.
"""

import logging
import os
import shutil
import stat
import tempfile
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Tuple, Type

# the releases every entry was checked on
CHECKED_ON = (
    "torch 2.6.0, 2.8.0, 2.10.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0; hydra-core 1.3.2, 1.3.8, 1.4.0rc3; "
    "CPython 3.11"
)


class PrivateName(NamedTuple):
    module: str
    name: str  # an attribute path below `module`
    used_in: str
    without_it: str
    # the releases that have it, where not all do (`tests/test_private_names.py` checks it there)
    only_in: str = ""


PRIVATE_NAMES = (
    PrivateName(
        "multiprocessing.forkserver",
        "_forkserver._forkserver_address",
        "_rank.forkserver",
        "ranks come from multiprocessing's own forkserver (cold: torch imported per job), with a warning",
    ),
    *(
        PrivateName("multiprocessing.forkserver", f"_forkserver.{name}", "_rank.forkserver", "as above")
        for name in ("_forkserver_alive_fd", "_forkserver_pid")
    ),
    PrivateName(
        "torch.distributed.run",
        "_get_logs_specs_class",
        "_job.launch_config (logs_specs)",
        "the `torchrun.logs_specs` entry points are read directly, as torch does",
    ),
    PrivateName(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "_delay",
        "_job.torch_adjustments",
        "single-node c10d jobs keep torch's random 0-0.3 s start-up skew",
    ),
    PrivateName(
        "torch.distributed.elastic.agent.server.api",
        "time",  # the module it imported: its one `time.sleep` is the agent's wait between checks
        "_job.torch_adjustments",
        "a job ends at torch's agent's next check of its ranks (up to monitor_interval after they return)",
    ),
    PrivateName(
        "hydra.core.utils",
        "_flush_loggers",
        "_rank.worker, _job.process",
        "every handler of Python's logging is flushed here instead",
    ),
    PrivateName(
        "hydra.core.utils",
        "JobReturn._return_value",
        "_launcher.report, _job.process, _rank.carried_exception",
        "a dataclass field: the only way to read a failed job's error without raising it",
    ),
    PrivateName(
        "hydra.core.singleton",
        "Singleton._instances",
        "_rank.worker.with_scanned_plugins (the 'instances' key of Singleton.get_state())",
        "every job process and rank scans Hydra's plugins again (a slower start)",
    ),
    PrivateName(
        "omegaconf.basecontainer",
        "BaseContainer._resolvers",
        "_rank.worker (what Singleton.get_state() and set_state() read and write)",
        "ranks unpickle Hydra's state from their payload, as where they do not fork from the job's process",
    ),
    PrivateName(
        "hydra._internal.callbacks",
        "Callbacks",
        "_launcher.preempt (the `callbacks` list of HydraContext.callbacks, an instance of it)",
        "the sweep's stop notice ends with the process, not at on_multirun_end (the app gets its own "
        "handler of the stop signal back only then)",
    ),
    PrivateName(
        "hydra._internal.config_loader_impl",
        "ConfigLoaderImpl._apply_overrides_to_config",
        "_launcher.sweep_configs (with the loader's `repository.group_exists`, checked there)",
        "Hydra composes every job from scratch (about 0.1 s a job)",
    ),
    PrivateName(
        "hydra._internal.config_loader_impl",
        "get_overrides_dirname",
        "_launcher.sweep_configs",
        "Hydra composes every job from scratch (about 0.1 s a job); Hydra 1.4 has none: its "
        "`${hydra_override_dirname:}` resolver makes override_dirname as the job runs",
        only_in="hydra-core 1.3",
    ),
    PrivateName(
        "hydra._internal.core_plugins.basic_sweeper",
        "BasicSweeper",
        "_launcher.reproduce (compared as a string only)",
        "rerun.sh names the sweeper's overrides as Hydra gave them",
    ),
)


_MISSING = object()


def _get(module: str, name: str) -> Any:
    import importlib

    try:
        value: Any = importlib.import_module(module)
        for part in name.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError):
        return _MISSING
    return value


def present(module: str, name: str) -> bool:
    """Whether this version has the module and the (dotted) attribute, whatever its value."""
    return _get(module, name) is not _MISSING


def lookup(module: str, name: str) -> Optional[Any]:
    """The private attribute, or None when this version has no such module or name."""
    value = _get(module, name)
    return None if value is _MISSING else value


def _flush_every_handler() -> None:
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            try:
                handler.flush()
            except Exception:
                pass


flush_loggers: Callable[[], None] = lookup("hydra.core.utils", "_flush_loggers") or _flush_every_handler


def logs_specs_class(name: str) -> Type[Any]:
    """torchrun's `--logs-specs NAME`: the class of the `torchrun.logs_specs` entry point NAME.

    ValueError when no installed package provides it.
    """
    torch_lookup = lookup("torch.distributed.run", "_get_logs_specs_class")
    if torch_lookup is not None:
        return torch_lookup(name)
    from importlib.metadata import entry_points

    try:
        group: Any = entry_points(group="torchrun.logs_specs")
    except TypeError:  # Python 3.9: a dict of groups
        group = entry_points().get("torchrun.logs_specs", [])  # type: ignore[attr-defined]
    found = [ep for ep in group if ep.name == name]
    if not found:
        raise ValueError(f"Could not find entrypoint under 'torchrun.logs_specs[{name}]' key")
    return found[0].load()


# ------------------------------------------------------------------ private directories

PRIVATE_DIR_PREFIX = "hydra_torchrun_"
# a socket's dir of its own (the rank forkserver's, the agent's wake-up) when the temp dir's
# path is too long for a socket (`socket_address`)
SOCKET_DIR_PREFIX = "htl-"
SOCKET_DIR_PARENT = "/tmp"
# a Unix socket's path holds at most 107 bytes on Linux (sun_path)
MAX_SOCKET_PATH = 100


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat), which tells it
    from a later process given the same pid; None without /proc or without the process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":
        return None  # ended, not yet reaped: it uses nothing any more
    return fields[19].decode()


def _boot() -> Optional[str]:
    """This machine's boot, as the start of its boot id (pids and start times are its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:8]
    except OSError:
        return None
    return boot if boot.isalnum() else None


def private_dir(prefix: str = PRIVATE_DIR_PREFIX, parent: Optional[str] = None) -> str:
    """A new directory of this process's own (0700), its name saying whose it is."""
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{prefix}{pid}-{_start_time(pid) or 0}-{_boot() or 'x'}_", dir=parent)


def socket_address(directory: str, name: str) -> Tuple[str, Optional[str]]:
    """Where a Unix socket `name` of this process goes: in its private `directory`, or, where
    that path is too long for a socket's (a long TMPDIR), in a short private dir of its own
    under /tmp, returned second for the socket's owner to remove with it."""
    address = os.path.join(directory, name)
    if len(os.fsencode(address)) <= MAX_SOCKET_PATH:
        return address, None
    own_dir = private_dir(SOCKET_DIR_PREFIX, SOCKET_DIR_PARENT)
    return os.path.join(own_dir, name), own_dir


def _owner(name: str, prefix: str) -> Optional[Tuple[int, str]]:
    """(pid, start time) of the process of this machine's boot whose private dir `name` is;
    None if it names none, or one of another host or boot."""
    if not name.startswith(prefix):
        return None
    owner, _, rest = name[len(prefix) :].partition("_")
    pid, started, boot = (owner.split("-") + ["", "", ""])[:3]
    if not rest or not pid.isdigit() or not started.isdigit() or owner.count("-") != 2:
        return None
    if _boot() is None or boot != _boot():
        return None
    return int(pid), started


def _owner_gone(pid: int, started: str) -> bool:
    now = _start_time(pid)
    if now is not None:
        return started != "0" and now != started  # its pid now belongs to a later process
    if os.path.isdir("/proc"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _temp_dir() -> str:
    """The temp dir as a fresh interpreter of this environment finds it (TMPDIR, ...),
    without setting this process's `tempfile.tempdir` (processes forked later read it)."""
    saved = tempfile.tempdir
    tempfile.tempdir = None
    try:
        return tempfile.gettempdir()
    finally:
        tempfile.tempdir = saved


def remove_dead_private_dirs(parents: Optional[Iterable[str]] = None) -> List[str]:
    """Remove this user's private dirs whose owner process is gone; the paths removed.

    Looked for in `parents` (by default the temp dir and, for forkserver sockets, /tmp).
    """
    if parents is None:
        parents = [_temp_dir(), SOCKET_DIR_PARENT]
    removed = []
    uid = os.getuid()
    for parent in dict.fromkeys(parents):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            owner = _owner(name, PRIVATE_DIR_PREFIX) or _owner(name, SOCKET_DIR_PREFIX)
            if owner is None or not _owner_gone(*owner):
                continue
            path = os.path.join(parent, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                continue
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                removed.append(path)
    return removed
