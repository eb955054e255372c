"""Build torch's `LaunchConfig` for one job, for whichever torch is installed.

The earlier torchrun launchers broke on torch upgrades because they either passed fields
`LaunchConfig` had dropped or went through `torchrun`'s argparse namespace. Here the fields
of the installed `LaunchConfig` are read off the dataclass itself: a key torch lacks is
ignored while it has its default and refused, by name, when a user sets it.
"""

import dataclasses
import hashlib
import logging
import os
import re
import shutil
from typing import Any, Dict, Optional, Set

import torch
from torch.distributed.launcher.api import LaunchConfig

from .._shared.config_error import LauncherConfigError
from .._shared.plan import JobSettings, Rendezvous
from .._shared.signals import not_ignored, signals_named
from ..config import TorchrunLauncherConf, described
from .torch_adjustments import close_takes_a_timeout

log = logging.getLogger(__name__)

# plugin keys -> the LaunchConfig field that carries each (when torch has it)
_FIELD_OF_KEY: Dict[str, str] = described("launch_config")


_WARNED: Set[str] = set()

_PLACEHOLDER = re.compile(r"(?<!\$)\{(role_name|rank|local_rank)\}")


def launch_config_fields() -> Set[str]:
    return {f.name for f in dataclasses.fields(LaunchConfig)}


def rendezvous_for(settings: JobSettings, sweep_key: str, job_num: int) -> Rendezvous:
    """The rendezvous of one job: never a fixed port, never an id shared with another job.

    A single-node job with no endpoint or port given rendezvouses over c10d on an
    OS-chosen port, as `torchrun --standalone` does, so concurrent jobs and sweeps on a
    host cannot collide; its id comes from this sweep's dir. The nodes of a multi-node job
    must all compute the same id, and each node has its own sweep dir (its own disk, cwd,
    `${now:}` second), so there the id comes from `rdzv_id` or else from the endpoint they
    share; the job number is appended, so nodes cannot join another job's rendezvous.
    """
    conf = settings.conf
    if conf.rdzv_id:
        base_id = conf.rdzv_id
    elif settings.max_nodes > 1:
        shared = conf.rdzv_endpoint or f"{conf.master_addr}:{conf.master_port}"
        base_id = "sweep-" + hashlib.sha1(shared.encode()).hexdigest()[:12]
    else:
        base_id = hashlib.sha1(sweep_key.encode()).hexdigest()[:12]
    run_id = f"{base_id}_{job_num}"
    configs = dict(settings.rdzv_conf)
    single_node_default = (
        conf.rdzv_backend == "static"
        and not conf.rdzv_endpoint
        and conf.master_port is None
        and settings.max_nodes == 1
    )
    if single_node_default and not conf.standalone and conf.master_addr != TorchrunLauncherConf.master_addr:
        # torchrun's static rendezvous would meet at master_addr:29500 and give it to the ranks
        # as MASTER_ADDR; a free port of localhost (c10d) cannot honour the address
        raise LauncherConfigError(
            f"hydra.launcher.master_addr={conf.master_addr} needs hydra.launcher.master_port on a single "
            "node (the ranks meet at master_addr:master_port); leave master_addr at its default for a "
            "rendezvous on a free port of this host"
        )
    if conf.standalone or single_node_default:
        return Rendezvous("c10d", "localhost:0", run_id, configs)
    if conf.rdzv_backend == "static":
        if not conf.rdzv_endpoint and conf.master_port is None:
            raise LauncherConfigError(
                "hydra.launcher.master_port=None is invalid for a multi-node static rendezvous: "
                "set master_port (or rdzv_endpoint), or use rdzv_backend=c10d"
            )
        endpoint = conf.rdzv_endpoint or f"{conf.master_addr}:{conf.master_port}"
        configs["rank"] = conf.node_rank
        return Rendezvous("static", endpoint, run_id, configs)
    if not conf.rdzv_endpoint:
        raise LauncherConfigError(
            f"hydra.launcher.rdzv_endpoint is empty: rdzv_backend={conf.rdzv_backend} needs host:port"
        )
    return Rendezvous(conf.rdzv_backend, conf.rdzv_endpoint, run_id, configs)


def honoured_fields() -> Set[str]:
    """The LaunchConfig fields the installed torch honours: its own, and `shutdown_timeout`
    where torch has no such field (before 2.12) but the job can pass it to `PContext.close`."""
    have = launch_config_fields()
    if "shutdown_timeout" not in have and close_takes_a_timeout():
        have.add("shutdown_timeout")
    return have


def check_supported(settings: JobSettings) -> None:
    """Refuse, by name, a key the user set that the installed torch cannot honour; say once
    where a default of the launcher's cannot hold on it."""
    have = honoured_fields()
    for key, value in settings.changed_from_default().items():
        field_name = _FIELD_OF_KEY.get(key)
        if field_name is not None and field_name not in have and not means_the_default(key, value):
            raise LauncherConfigError(
                f"hydra.launcher.{key}={value!r} is not supported by the installed torch "
                f"{torch.__version__}; leave it at its default or upgrade torch"
            )
    if not settings.on_hosts:  # else each host decides it (`_job.agent`): its GPUs, its numactl
        check_numa_binding(settings)
    signals = settings.conf.signals_to_handle
    ignored = sorted(set(signals_named(signals)) - set(signals_named(not_ignored(signals))))
    if "signals_to_handle" not in have and ignored:
        # torch before 2.10 handles SIGTERM, SIGINT, SIGHUP and SIGQUIT whatever the launcher says,
        # in the job's process: a `kill` of that process reaches it, a terminal's signal does not
        _warn_once(
            "signals_to_handle",
            f"{', '.join(sig.name for sig in ignored)}, which this process ignores, stops a job's ranks "
            "if it is sent to the job's own process (the terminal's does not reach it: jobs run in a "
            "process group of their own)",
        )
    if "shutdown_timeout" not in have:
        _warn_once(
            "shutdown_timeout",
            "stopped ranks get torch's 30 s, not hydra.launcher.shutdown_timeout, before SIGKILL",
        )


def means_the_default(key: str, value: Any) -> bool:
    """A value spelled otherwise than the key's default that does what the default does,
    which a torch without the field does anyway: the same signals in another order, no
    filters as an empty list, torch's own name of its default event handler."""
    if key == "signals_to_handle":
        return set(signals_named(value)) == set(signals_named(TorchrunLauncherConf.signals_to_handle))
    if key in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        return not value
    if key == "event_log_handler":
        return value == "null"
    return False


def _warn_once(field_name: str, broken: str) -> None:
    if field_name not in _WARNED:
        _WARNED.add(field_name)
        log.warning(f"torch {torch.__version__} has no LaunchConfig.{field_name}: {broken}")


def check_numa_binding(settings: JobSettings) -> None:
    """`numa_binding` binds each rank to the NUMA node of its GPU (torch.numa.binding), which
    needs a CUDA build of torch, a visible GPU and the `numactl` program: without them every
    rank would fail at start ("Torch not compiled with CUDA enabled"), so refuse it here."""
    value = settings.conf.numa_binding
    if value is None:
        return
    if not torch.backends.cuda.is_built():
        why = f"the installed torch {torch.__version__} is not built with CUDA"
    elif torch.cuda.device_count() == 0:  # torch counts without initialising CUDA here
        why = "no GPU is visible"
    elif shutil.which("numactl") is None:
        why = "torch needs the numactl program, which is not found on PATH"
    else:
        return
    raise LauncherConfigError(
        f"hydra.launcher.numa_binding={value!r} is invalid here: it binds each rank to its GPU's "
        f"NUMA node, and {why}; leave it null"
    )


def counted_by_torch(settings: JobSettings) -> bool:
    """Whether nproc_per_node is a word torch counts (gpu / cpu / auto / xpu, a backend's name)."""
    value = settings.conf.nproc_per_node
    return not (isinstance(value, int) or str(value).isdigit())


def local_world_size(settings: JobSettings) -> int:
    """nproc_per_node as torchrun reads it (gpu / cpu / auto / xpu counted by torch itself)."""
    value = settings.conf.nproc_per_node
    if not counted_by_torch(settings):
        return int(value)
    from torch.distributed.run import determine_local_world_size

    try:
        return int(determine_local_world_size(str(value)))
    except (ValueError, RuntimeError) as e:  # no such device here, or a backend not registered
        reason = str(e).splitlines()[0]
        raise LauncherConfigError(f"hydra.launcher.nproc_per_node={value!r} is invalid here: {reason}") from e


def agent_environment(settings: JobSettings) -> Dict[str, str]:
    """What torch's `launch_agent` puts into its own process's environment before it starts
    the ranks (torch/distributed/launcher/api.py), for ranks that come from a forkserver
    started earlier: they inherit the server's environment, not the agent's later one."""
    if "signals_to_handle" not in launch_config_fields():
        return {}
    return {"TORCHELASTIC_SIGNALS_TO_HANDLE": not_ignored(settings.conf.signals_to_handle)}


def build_launch_config(
    settings: JobSettings,
    rendezvous: Rendezvous,
    nproc_per_node: int,
    log_dir: str,
    console: Optional[Any] = None,
    console_label: str = "",
) -> LaunchConfig:
    """torch's LaunchConfig for the job; `console` (a RankConsole) prints the ranks' output.

    `console_label` goes before each rank's default prefix (the job's number, when jobs overlap).
    """
    conf = settings.conf
    have = launch_config_fields()
    kwargs: Dict[str, Any] = dict(
        min_nodes=settings.min_nodes,
        max_nodes=settings.max_nodes,
        nproc_per_node=nproc_per_node,
        run_id=rendezvous.run_id,
        role=conf.role,
        rdzv_endpoint=rendezvous.endpoint,
        rdzv_backend=rendezvous.backend,
        rdzv_configs=rendezvous.configs,
        max_restarts=conf.max_restarts,
        monitor_interval=conf.monitor_interval,
        start_method=conf.start_method,
    )
    optional = {
        "local_addr": conf.local_addr,
        "event_log_handler": conf.event_log_handler or "null",
        "signals_to_handle": not_ignored(conf.signals_to_handle),
        "duplicate_stdout_filters": conf.duplicate_stdout_filters,
        "duplicate_stderr_filters": conf.duplicate_stderr_filters,
        "virtual_local_rank": conf.virtual_local_rank,
        "shutdown_timeout": conf.shutdown_timeout,
        "log_line_prefix_template": _labelled(prefix_template(conf), console_label),
    }
    kwargs.update({name: value for name, value in optional.items() if name in have})
    if "numa_options" in have and conf.numa_binding is not None:
        kwargs["numa_options"] = _numa_options(conf.numa_binding)
    if "logs_specs" in have:
        kwargs["logs_specs"] = _logs_specs(settings, log_dir, console, console_label)
    else:
        from torch.distributed.elastic.multiprocessing import Std

        kwargs.update(
            log_dir=log_dir,
            redirects=Std.from_str(str(conf.redirects)),
            tee=Std.from_str(str(conf.tee)),
        )
    return LaunchConfig(**kwargs)


def _logs_specs(settings: JobSettings, log_dir: str, console: Optional[Any], console_label: str) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    conf = settings.conf
    specs_class: Any = DefaultLogsSpecs
    common = dict(
        log_dir=log_dir,
        redirects=Std.from_str(str(conf.redirects)),
        tee=Std.from_str(str(conf.tee)),
        local_ranks_filter=settings.local_ranks_filter,
    )
    # torch's own tee stays in charge where something else reads its tee streams
    torch_tees = conf.logs_specs is not None or conf.duplicate_stdout_filters or conf.duplicate_stderr_filters
    if console is not None and not torch_tees:
        from .console import ConsoleLogsSpecs

        return ConsoleLogsSpecs(
            **common, console=console, prefix_template=prefix_template(conf), label=console_label
        )
    if conf.logs_specs is not None:
        from .._shared.private import logs_specs_class

        try:
            specs_class = logs_specs_class(conf.logs_specs)
        except ValueError as e:
            raise LauncherConfigError(f"hydra.launcher.logs_specs={conf.logs_specs!r} is invalid: {e}") from e
    return specs_class(**common)


def prefix_template(conf: Any) -> Optional[str]:
    """torch's prefix template; in Hydra config `{rank}` stands for torch's `${rank}`.

    Hydra resolves `${...}` in launcher keys (and cannot pass an escaped one through to
    the launcher), so the config spells torch's placeholders without the `$`.
    """
    if conf.log_line_prefix_template:
        return _PLACEHOLDER.sub(r"${\1}", conf.log_line_prefix_template)
    return os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")


def _labelled(template: Optional[str], label: str) -> Optional[str]:
    """torch's prefix template with the job's label in front, for where torch's own tee
    prints the ranks' lines (duplicate filters, a logs_specs): with jobs at once, every line
    still says its job. torch's own default prefix is `[${role_name}${local_rank}]:`."""
    if not label:
        return template
    return label + (template or "[${role_name}${local_rank}]:")


def _numa_options(binding: str) -> Optional[Any]:
    from torch.numa.binding import AffinityMode, NumaOptions

    return NumaOptions(affinity_mode=AffinityMode(binding))
