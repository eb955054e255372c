"""A sweep job's launcher settings: resolved from that job's config and checked.

Every check here runs before any process of the sweep starts, and every refusal is one
line naming the key at fault and what it accepts. Nothing here needs torch.
"""

import collections
import functools
import json
import math
import re
import shutil
import signal
import typing
from collections import abc
from dataclasses import fields
from importlib.metadata import entry_points
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from omegaconf import DictConfig, OmegaConf

from .._shared.config_error import LauncherConfigError
from .._shared.plan import JobSettings
from .._shared.signals import signals_named
from ..config import TorchrunLauncherConf
from .preempt import FORBIDDEN_STOP_SIGNALS

START_METHODS = ("forkserver", "spawn", "fork")
# torchrun also takes the name of a registered out-of-tree device backend (counted at launch)
NPROC_WORDS = ("gpu", "cpu", "auto", "xpu")
_DEVICE_WORD = re.compile(r"^[a-z][a-z0-9_]*$")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# torch's own rendezvous backends; others come from the `torchrun.handlers` entry points
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")
# `cluster` values: auto detects in this order (after none); each named one is required
CLUSTERS = ("auto", "none", "slurm", "pet", "mpi", "lsf")
_STD_SPEC = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")


def _refuse(key: str, value: Any, allowed: str) -> LauncherConfigError:
    return LauncherConfigError(f"hydra.launcher.{key}={value!r} is invalid: {allowed}")


def resolve_settings(launcher_cfg: DictConfig, on_hosts: bool = False) -> JobSettings:
    """Resolve `hydra.launcher` of one job's config (its interpolations included) and check it
    (`on_hosts`: but what only each host can tell, see `JobSettings.on_hosts`)."""
    raw = OmegaConf.to_container(launcher_cfg, resolve=True)
    assert isinstance(raw, dict)
    return _settings(raw, on_hosts)  # type: ignore[arg-type]


# the settings of the launcher configs seen last, by their resolved values: the jobs of a
# sweep mostly share theirs, and checking them again cost each job ~10 ms
_SEEN: "collections.OrderedDict[str, JobSettings]" = collections.OrderedDict()
_SEEN_MOST = 64


def _settings(raw: Dict[str, Any], on_hosts: bool) -> JobSettings:
    """`raw` (a resolved `hydra.launcher`) checked and parsed; refused as `_checked` says."""
    key = json.dumps([raw, on_hosts], sort_keys=True, default=repr)
    settings = _SEEN.get(key)
    if settings is None:
        settings = _checked(raw, on_hosts)
        _SEEN[key] = settings
        if len(_SEEN) > _SEEN_MOST:
            _SEEN.popitem(last=False)
    return settings


def _checked(raw: Dict[str, Any], on_hosts: bool) -> JobSettings:
    known = {f.name for f in fields(TorchrunLauncherConf)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise LauncherConfigError(
            f"hydra.launcher.{unknown[0]} is not a key of the torchrun launcher "
            f"(keys: {', '.join(sorted(k for k in known if not k.startswith('_')))})"
        )
    return checked_settings(
        TorchrunLauncherConf(**{key: _typed(key, value) for key, value in raw.items()}), on_hosts
    )


def placed_job_settings(raw: Dict[str, Any], nodes: int, first_node_endpoint: str) -> JobSettings:
    """The settings of a job that a runner places on `nodes` nodes of its own (SLURM's, the
    hosts'): `raw`, the per-job keys, read as the torchrun launcher reads them, the job's
    rendezvous on its first node; a node count refused is named by the launcher's key, `nodes`.
    What only each node can tell is left to it (`JobSettings.on_hosts`): the launcher runs
    elsewhere (a login node without GPUs, a head without the hosts' programs)."""
    raw = dict(raw, nnodes=nodes, cluster="none", preload=[], requeue=False)
    if nodes > 1:
        raw.update(rdzv_backend="c10d", rdzv_endpoint=first_node_endpoint)
    try:
        return _settings(raw, on_hosts=True)
    except LauncherConfigError as e:
        if "nnodes" in str(e):
            raise LauncherConfigError(str(e).replace("nnodes", "nodes")) from None
        raise


def checked_settings(conf: TorchrunLauncherConf, on_hosts: bool = False) -> JobSettings:
    """`conf` checked (every key's value and how keys combine) and parsed into a job's settings
    (`on_hosts`: what only each host can tell is left to it, see `JobSettings.on_hosts`)."""
    min_nodes, max_nodes = parse_nnodes(conf.nnodes)
    _check_nproc(conf.nproc_per_node)
    _check_scalars(conf, on_hosts)
    return JobSettings(
        conf=conf,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        rdzv_conf=parse_rdzv_conf(conf.rdzv_conf),
        local_ranks_filter=parse_local_ranks_filter(conf.local_ranks_filter),
        on_hosts=on_hosts,
    )


_TYPE_HINTS = typing.get_type_hints(TorchrunLauncherConf)
_TYPE_WORDS = {int: "an int", float: "a number", bool: "true or false", str: "a string"}


def _typed(key: str, value: Any) -> Any:
    """The value of a key checked against the key's type in TorchrunLauncherConf.

    Numbers are taken as strings where a string is expected (`rdzv_id=5`), and lists of
    strings take any scalars (`[numactl, --cpunodebind, 0]`) as strings.
    """
    hint = _TYPE_HINTS[key]
    optional = type(None) in typing.get_args(hint)
    if optional:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if value is None and optional or hint is Any:
        return value
    if typing.get_origin(hint) in (list, List):
        if isinstance(value, (list, tuple)) and all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value
        ):
            return [str(v) for v in value]
        raise _refuse(key, value, "use a list of strings" + (" or null" if optional else ""))
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is float and number:
        return float(value)
    if hint is str and number:  # rdzv_id=5, master_addr from YAML
        return str(value)
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise _refuse(
        key, value, f"use {_TYPE_WORDS.get(hint, hint.__name__)}" + (" or null" if optional else "")
    )


def parse_nnodes(value: Any) -> Tuple[int, int]:
    allowed = "use N or MIN:MAX with 0 < MIN <= MAX"
    parts = str(value).split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise _refuse("nnodes", value, allowed)
    low, high = int(parts[0]), int(parts[-1])
    if not 0 < low <= high:
        raise _refuse("nnodes", value, allowed)
    return low, high


def _check_nproc(value: Any) -> None:
    allowed = "use a positive int, one of " + ", ".join(NPROC_WORDS) + " or a device backend's name"
    if isinstance(value, bool):
        raise _refuse("nproc_per_node", value, allowed)
    if isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
        if int(value) > 0:
            return
    elif isinstance(value, str) and _DEVICE_WORD.match(value):
        return  # gpu / cpu / auto / xpu or a device backend's name: torch counts it at launch
    raise _refuse("nproc_per_node", value, allowed)


def parse_rdzv_conf(value: Any) -> Dict[str, Any]:
    """torchrun's `key=value,key=value` (or a mapping) as a dict."""
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    config: Dict[str, Any] = {}
    for item in str(value).split(","):
        key, sep, val = item.partition("=")
        if not sep or not key.strip() or not val.strip():
            raise _refuse("rdzv_conf", value, "use key=value,key=value")
        config[key.strip()] = val.strip()
    return config


def parse_local_ranks_filter(value: str) -> Optional[Set[int]]:
    if not value:
        return None
    items = [v.strip() for v in str(value).split(",")]
    if not all(v.isdigit() for v in items):
        raise _refuse("local_ranks_filter", value, "use a comma-separated list of local ranks, e.g. 0,1")
    return {int(v) for v in items}


def check_preload(value: Any) -> None:
    """`preload` is auto or a list of module names (a YAML list, or OmegaConf's ListConfig)."""
    if value == "auto":
        return
    names = not isinstance(value, str) and isinstance(value, abc.Sequence)
    if not names or not all(isinstance(m, str) and _MODULE_NAME.match(m) for m in value):
        raise _refuse("preload", value, "use auto, or a list of module names such as [lightning]")


@functools.cache
def _entry_point_names(group: str, builtin: Tuple[str, ...] = ()) -> Tuple[str, ...]:
    """Names of an entry-point group (how torchrun finds out-of-tree backends and log layouts)."""
    found = entry_points()
    selected = found.select(group=group) if hasattr(found, "select") else found.get(group, [])
    return (*builtin, *sorted({ep.name for ep in selected} - set(builtin)))


def _check_scalars(conf: TorchrunLauncherConf, on_hosts: bool = False) -> None:
    checks = [
        ("start_method", conf.start_method in START_METHODS, "use one of " + ", ".join(START_METHODS)),
        ("max_restarts", conf.max_restarts >= 0, "use an int >= 0"),
        ("monitor_interval", 0 < conf.monitor_interval < math.inf, "use a finite number of seconds > 0"),
        ("shutdown_timeout", conf.shutdown_timeout >= 0, "use a number of seconds >= 0"),
        ("node_rank", 0 <= conf.node_rank, "use an int >= 0"),
        ("redirects", _STD_SPEC.match(str(conf.redirects)) is not None, "use 0-3 or LOCAL_RANK:0-3,..."),
        ("tee", _STD_SPEC.match(str(conf.tee)) is not None, "use 0-3 or LOCAL_RANK:0-3,..."),
        ("parallel_jobs", conf.parallel_jobs >= 1, "use an int >= 1"),
        ("cluster", conf.cluster in CLUSTERS, "use one of " + ", ".join(CLUSTERS)),
        (
            "master_port",
            conf.master_port is None or 0 < conf.master_port < 65536,
            "use null (a free port per job) or a port 1-65535",
        ),
        (
            "job_timeout",
            conf.job_timeout is None or 0 < conf.job_timeout < math.inf,
            "use null (no limit) or a finite number of seconds > 0",
        ),
        (
            "numa_binding",
            conf.numa_binding is None or conf.numa_binding in NUMA_BINDINGS,
            "use null or one of " + ", ".join(NUMA_BINDINGS),
        ),
        (
            "signals_to_handle",
            all(
                isinstance(getattr(signal, s.strip(), None), signal.Signals)
                for s in conf.signals_to_handle.split(",")
            ),
            "use signal names of this system separated by commas, e.g. SIGTERM,SIGINT",
        ),
        (
            "rdzv_backend",
            conf.rdzv_backend in _entry_point_names("torchrun.handlers", RDZV_BACKENDS),
            "use one of " + ", ".join(_entry_point_names("torchrun.handlers", RDZV_BACKENDS)),
        ),
        (
            "logs_specs",
            conf.logs_specs is None or conf.logs_specs in _entry_point_names("torchrun.logs_specs"),
            "use null or the name of a `torchrun.logs_specs` entry point: "
            + (", ".join(_entry_point_names("torchrun.logs_specs")) or "none is installed"),
        ),
        ("module", not (conf.module and conf.no_python), "module and no_python cannot both be true"),
        (
            "launch_prefix",
            # on hosts of their own: on each host's PATH, looked up there (`_job.agent`)
            not conf.launch_prefix or on_hosts or shutil.which(str(conf.launch_prefix[0])) is not None,
            f"{conf.launch_prefix[0] if conf.launch_prefix else ''} is not a program found on PATH",
        ),
    ]
    for key, ok, allowed in checks:
        if not ok:
            raise _refuse(key, getattr(conf, key), allowed)
    if conf.training_script is None:
        for key in ("module", "no_python", "run_path"):
            if getattr(conf, key):
                raise _refuse(key, True, "only applies with hydra.launcher.training_script set")
        if conf.training_script_args:
            raise _refuse(
                "training_script_args",
                conf.training_script_args,
                "only applies with hydra.launcher.training_script set",
            )
    check_preload(conf.preload)
    _check_stop_keys(conf)
    if conf.devices is not None and len(set(map(str, conf.devices))) != len(conf.devices):
        raise _refuse("devices", conf.devices, "list each device id once")


_STREAMS = {1: "stdout", 2: "stderr", 3: "stdout and stderr"}


def shadowed_redirects(conf: TorchrunLauncherConf) -> Optional[str]:
    """One line when `redirects` keeps a stream off the console that `tee` shows there all
    the same (torch tees what both name): with the launcher's tee=3, a torchrun user's
    `redirects=3` alone changes nothing. None otherwise (per-rank specs are taken as given)."""
    redirects, tee = str(conf.redirects), str(conf.tee)
    if not (redirects.isdigit() and tee.isdigit()):
        return None
    shown = int(redirects) & int(tee)
    if not shown:
        return None
    return (
        f"hydra.launcher.redirects={redirects}: the ranks' {_STREAMS[shown]} still "
        f"{'show' if shown == 3 else 'shows'} on the console, as "
        f"hydra.launcher.tee={tee} (the launcher's default is 3) shows them; set tee=0 to keep them in "
        "the files only"
    )


def check_node_rank(settings: JobSettings) -> None:
    """A static rendezvous's node rank is one of its nodes (checked once the cluster's values
    are in: a node rank past the last node would wait for a world that never forms)."""
    conf = settings.conf
    if conf.rdzv_backend == "static" and conf.node_rank >= settings.max_nodes:
        raise _refuse(
            "node_rank", conf.node_rank, f"use 0 to {settings.max_nodes - 1} (nnodes={conf.nnodes})"
        )


def _check_stop_keys(conf: TorchrunLauncherConf) -> None:
    if conf.stop_signal is not None:
        named = signals_named(conf.stop_signal)
        if len(named) != 1 or "," in conf.stop_signal:
            raise _refuse("stop_signal", conf.stop_signal, "use one signal name such as SIGUSR2, or null")
        if named[0] in FORBIDDEN_STOP_SIGNALS:
            raise _refuse(
                "stop_signal",
                conf.stop_signal,
                "SIGINT and SIGTERM stop a sweep at once, SIGKILL/SIGSTOP/SIGCHLD cannot be one; "
                "use SIGUSR2 (SLURM: --signal=USR2@120)",
            )
        if named[0] in signals_named(conf.signals_to_handle):
            raise _refuse(
                "stop_signal",
                conf.stop_signal,
                f"it is also in hydra.launcher.signals_to_handle={conf.signals_to_handle!r}, where "
                "torch's agent would kill the ranks on it; take it out of one of them",
            )
    if not 0 < conf.stop_timeout < math.inf:
        raise _refuse("stop_timeout", conf.stop_timeout, "use a finite number of seconds > 0")
    if conf.requeue not in ("auto", False):
        raise _refuse("requeue", conf.requeue, "use auto or false")
    if conf.resume not in ("auto", True, False):
        raise _refuse("resume", conf.resume, "use auto, true or false")
