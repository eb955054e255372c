"""`hydra/launcher=torchrun_ssh`'s keys, split: the hosts' (checked here) and the torchrun
launcher's per-job keys (checked by `_launcher.settings`, as for `hydra/launcher=torchrun`)."""

import sys
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from .._launcher.settings import check_preload, placed_job_settings
from .._shared.config_error import LauncherConfigError
from .._shared.plan import JobSettings
from ..config import SSH_KEYS, TorchrunSshLauncherConf, described
from .hosts import Host, check_patterns, resolve_hosts

# the rendezvous endpoint of a multi-host job until its hosts are known (`_ssh.ssh_runner`)
FIRST_HOST_ENDPOINT = "first-host-of-the-job:0"
# the torchrun launcher's keys that each host's agent has (`preload`): the agents', not a job's
AGENT_KEYS = tuple(described("hosts"))
# the keys that start the sweep's agents or share out its hosts: the same for every job
SWEEP_WIDE = ("hosts", "hostfile", "parallel_jobs", "ssh_options", "python", *AGENT_KEYS)


@dataclass(frozen=True)
class SshOptions:
    """One job's ssh side: where it may run, on how many hosts, what reaches its ranks."""

    hosts: Tuple[Host, ...]
    nodes: int
    parallel_jobs: Optional[int]
    ssh_options: Tuple[str, ...]
    python: str
    env_forward: Tuple[str, ...]
    # what each host's warm server imports besides torch: auto, or a list of modules
    preload: Any
    # the raw sweep-wide values, to compare across jobs
    sweep_wide: Tuple[Any, ...]


def split_launcher_config(launcher_cfg: DictConfig, launch_dir: str) -> "tuple[JobSettings, SshOptions]":
    """A job's `hydra.launcher` (resolved against its own config): its torchrun settings,
    checked as the torchrun launcher's are, and its ssh options, checked here."""
    raw = OmegaConf.to_container(launcher_cfg, resolve=True)
    assert isinstance(raw, dict)
    ssh = {key: raw.pop(key) for key in (*SSH_KEYS, *AGENT_KEYS) if key in raw}
    raw.pop("_target_", None)
    known = sorted(f.name for f in fields(TorchrunSshLauncherConf) if not f.name.startswith("_"))
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise LauncherConfigError(
            f"hydra.launcher.{unknown[0]} is not a key of hydra/launcher=torchrun_ssh "
            f"(keys: {', '.join(known)})"
        )
    options = ssh_options(ssh, launch_dir)
    # what only a host can tell (launch_prefix's program, nproc_per_node=gpu) is its own to decide
    settings = placed_job_settings(raw, options.nodes, FIRST_HOST_ENDPOINT)
    return settings, options


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LauncherConfigError(f"hydra.launcher.{key}={value!r} is invalid: use an int >= {minimum}")
    return value


def ssh_options(ssh: Dict[str, Any], launch_dir: str) -> SshOptions:
    """The ssh keys of one job, checked."""
    hosts = resolve_hosts(ssh.get("hosts"), ssh.get("hostfile"), launch_dir)
    nodes = _int("nodes", ssh.get("nodes", 1), 1)
    if nodes > len(hosts):
        raise LauncherConfigError(
            f"hydra.launcher.nodes={nodes} is more than the sweep's {len(hosts)} host(s) "
            f"({', '.join(host.name for host in hosts)})"
        )
    parallel = ssh.get("parallel_jobs")
    parallel_jobs = None if parallel is None else _int("parallel_jobs", parallel, 1)
    extra = ssh.get("ssh_options") or []
    if not isinstance(extra, list) or not all(isinstance(arg, (str, int)) for arg in extra):
        raise LauncherConfigError(
            f"hydra.launcher.ssh_options={extra!r} is invalid: a list of ssh's arguments, e.g. [-p, '2222']"
        )
    python = ssh.get("python") or sys.executable
    if not isinstance(python, str):
        raise LauncherConfigError(f"hydra.launcher.python={python!r} is invalid: the interpreter's path")
    preload = ssh.get("preload", "auto")
    check_preload(preload)
    return SshOptions(
        hosts=tuple(hosts),
        nodes=nodes,
        parallel_jobs=parallel_jobs,
        ssh_options=tuple(str(arg) for arg in extra),
        python=python,
        env_forward=tuple(check_patterns(ssh.get("env_forward"))),
        preload=preload,
        sweep_wide=tuple(repr(ssh.get(key)) for key in SWEEP_WIDE),
    )
