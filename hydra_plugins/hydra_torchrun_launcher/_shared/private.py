"""Every private name of torch, multiprocessing or Hydra the launcher relies on, in one list.

A private name can go in any release. Each use is guarded where it is made: when the name
is missing (or has another shape) the launcher degrades as `PRIVATE_NAMES` says, with one
clear line where a documented promise no longer holds; it never crashes in every rank.
`tests/test_private_names.py` checks every entry against the installed versions, so CI
on the oldest and newest supported releases says when one went away.
"""

import logging
from typing import Any, Callable, NamedTuple, Optional, Type

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
        "hydra.core.utils",
        "_flush_loggers",
        "_rank.worker, _job.process",
        "every handler of Python's logging is flushed here instead",
    ),
    PrivateName(
        "hydra.core.utils",
        "JobReturn._return_value",
        "_launcher.report, _job.process, _rank.error",
        "a dataclass field: the only way to read a failed job's error without raising it",
    ),
    PrivateName(
        "hydra.core.singleton",
        "Singleton._instances",
        "_rank.worker.with_scanned_plugins (the 'instances' key of Singleton.get_state())",
        "every job process and rank scans Hydra's plugins again (a slower start)",
    ),
    PrivateName(
        "hydra._internal.callbacks",
        "Callbacks",
        "_launcher.preempt (the `callbacks` list of HydraContext.callbacks, an instance of it)",
        "the sweep's stop notice ends with the process, not at on_multirun_end (the app gets its own "
        "handler of the stop signal back only then)",
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
