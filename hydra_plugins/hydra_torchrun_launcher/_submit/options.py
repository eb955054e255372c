"""`hydra/launcher=torchrun_slurm`'s keys, split: SLURM's (sbatch directives, checked here)
and the torchrun launcher's (checked by `_launcher.settings`, as for `hydra/launcher=torchrun`).

hydra-submitit-launcher's names and meanings, so a `submitit_slurm` config keeps working:
`timeout_min` is `--time`, `mem_gb` is `--mem=<n>G`, `additional_parameters` are more
`--key=value` directives (True: a bare `--key`; None or False: none), and so on. Every value
becomes one `#SBATCH` line, shell-quoted as submitit writes it, which SLURM reads as one
option: a value with a line break in it is refused (it would add directives).
"""

import re
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from .._launcher.settings import placed_job_settings
from .._shared.config_error import LauncherConfigError
from .._shared.plan import JobSettings
from ..config import SLURM_KEYS, TorchrunSlurmLauncherConf

# the rendezvous endpoint of a multi-node job until a node knows it (`_submit.node`)
FIRST_NODE_ENDPOINT = "first-node-of-the-job:0"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# sbatch options the launcher sets itself: given in additional_parameters they would break it
_OWN_OPTIONS = (
    "array",
    "output",
    "error",
    "ntasks-per-node",
    "ntasks",
    "signal",
    "requeue",
    "open-mode",
    "nodes",
)

# SLURM key -> sbatch option, for the keys that are one option each
_SIMPLE = {
    "partition": "partition",
    "qos": "qos",
    "account": "account",
    "comment": "comment",
    "constraint": "constraint",
    "exclude": "exclude",
    "gres": "gres",
    "gpus_per_node": "gpus-per-node",
    "cpus_per_task": "cpus-per-task",
    "cpus_per_gpu": "cpus-per-gpu",
    "gpus_per_task": "gpus-per-task",
    "mem_per_gpu": "mem-per-gpu",
    "mem_per_cpu": "mem-per-cpu",
}


# hydra-submitit-launcher's keys that this launcher has not: what a user does instead
_SUBMITIT_ONLY = {
    "tasks_per_node": "drop it: one task per node runs the job's agent, which starts "
    "hydra.launcher.nproc_per_node ranks (as torchrun does)",
    "submitit_folder": "drop it: the launcher's files lie in <sweep dir>/.slurm",
    "stderr_to_stdout": "drop it: each job's output file (<sweep dir>/.slurm/job<N>.<id>.out) holds "
    "stdout and stderr",
}


@dataclass(frozen=True)
class SlurmOptions:
    """One job's SLURM side: its sbatch directives (without the array; a value None: a bare
    flag), and what runs around srun."""

    directives: Tuple[Tuple[str, Optional[str]], ...]
    nodes: int
    setup: Tuple[str, ...]
    srun_args: Tuple[str, ...]
    array_parallelism: int
    signal_delay_s: int
    max_num_timeout: int


def split_launcher_config(launcher_cfg: DictConfig) -> "tuple[JobSettings, SlurmOptions]":
    """A job's `hydra.launcher` (resolved against its own config): its torchrun settings,
    checked as the torchrun launcher's are, and its SLURM options, checked here."""
    raw = OmegaConf.to_container(launcher_cfg, resolve=True)
    assert isinstance(raw, dict)
    slurm = {key: raw.pop(key) for key in SLURM_KEYS if key in raw}
    raw.pop("_target_", None)
    options = slurm_options(slurm)
    for key in (
        "nnodes",
        "node_rank",
        "rdzv_endpoint",
        "rdzv_backend",
        "cluster",
        "parallel_jobs",
        "devices",
    ):
        if key in raw:  # a `+hydra.launcher.nnodes=2`: not a key of this launcher
            raise LauncherConfigError(
                f"hydra.launcher.{key} is not a key of hydra/launcher=torchrun_slurm: SLURM places every job "
                "(hydra.launcher.nodes sets its node count; its nodes meet on its first node)"
            )
    raw.pop("detach", None)  # the sweep's, not a job's: `_submit.slurm_runner` reads it
    _refuse_unknown(raw)
    settings = placed_job_settings(raw, options.nodes, FIRST_NODE_ENDPOINT)
    return settings, options


def _refuse_unknown(raw: Dict[str, Any]) -> None:
    """A key that is none of hydra/launcher=torchrun_slurm's: refused naming this launcher and
    its keys (submitit's own keys: what to do instead)."""
    known = sorted(f.name for f in fields(TorchrunSlurmLauncherConf) if not f.name.startswith("_"))
    unknown = sorted(set(raw) - set(known))
    if not unknown:
        return
    key = unknown[0]
    instead = _SUBMITIT_ONLY.get(key)
    if instead is not None:
        raise LauncherConfigError(
            f"hydra.launcher.{key} (hydra-submitit-launcher's) is not a key of "
            f"hydra/launcher=torchrun_slurm: {instead}"
        )
    raise LauncherConfigError(
        f"hydra.launcher.{key} is not a key of hydra/launcher=torchrun_slurm (keys: {', '.join(known)})"
    )


def _int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LauncherConfigError(f"hydra.launcher.{key}={value!r} is invalid: use an int >= {minimum}")
    return value


def _text(key: str, value: Any) -> str:
    text = str(value)
    if _CONTROL.search(text) or isinstance(value, (dict, list)):
        raise LauncherConfigError(
            f"hydra.launcher.{key}={value!r} is invalid: one line of text (it becomes one #SBATCH directive)"
        )
    return text


def slurm_options(slurm: Dict[str, Any]) -> SlurmOptions:
    """The SLURM keys of one job, checked, as sbatch directives."""
    nodes = _int("nodes", slurm.get("nodes", 1), 1)
    timeout_min = _int("timeout_min", slurm.get("timeout_min", 60), 1)
    directives: List[Tuple[str, Optional[str]]] = [("job-name", _text("name", slurm.get("name") or "hydra"))]
    directives += [("nodes", str(nodes)), ("ntasks-per-node", "1"), ("time", str(timeout_min))]
    for key, option in _SIMPLE.items():
        value = slurm.get(key)
        if value is not None:
            directives.append((option, _text(key, value)))
    if slurm.get("mem_gb") is not None:
        directives.append(("mem", f"{_int('mem_gb', slurm['mem_gb'], 0)}G"))
    extra = slurm.get("additional_parameters") or {}
    if not isinstance(extra, dict):
        raise LauncherConfigError(
            f"hydra.launcher.additional_parameters={extra!r} is invalid: a mapping of sbatch options "
            "to values"
        )
    for key, value in extra.items():
        option = str(key).replace("_", "-")
        if option in _OWN_OPTIONS:
            raise LauncherConfigError(
                f"hydra.launcher.additional_parameters.{key} is set by the launcher itself "
                f"(--{option}); use hydra.launcher.nodes, timeout_min, signal_delay_s instead"
            )
        if value is None or value is False:  # as submitit: no directive
            continue
        flag = _text(f"additional_parameters.{key}", option)
        directives.append((flag, None if value is True else _text(f"additional_parameters.{key}", value)))
    setup = slurm.get("setup") or []
    srun_args = slurm.get("srun_args") or []
    for key, lines in (("setup", setup), ("srun_args", srun_args)):
        if not isinstance(lines, list):
            raise LauncherConfigError(f"hydra.launcher.{key}={lines!r} is invalid: a list of strings")
        for line in lines:
            _text(key, line)
    signal_delay_s = _int("signal_delay_s", slurm.get("signal_delay_s", 120), 0)
    if signal_delay_s >= timeout_min * 60:  # SLURM would send the stop notice as the job starts
        raise LauncherConfigError(
            f"hydra.launcher.signal_delay_s={signal_delay_s} is invalid with timeout_min={timeout_min}: "
            f"the stop notice comes signal_delay_s before the time limit, so it must be below "
            f"{timeout_min * 60} (or 0: no notice)"
        )
    return SlurmOptions(
        directives=tuple(directives),
        nodes=nodes,
        setup=tuple(str(line) for line in setup),
        srun_args=tuple(str(arg) for arg in srun_args),
        array_parallelism=_int("array_parallelism", slurm.get("array_parallelism", 256), 1),
        signal_delay_s=signal_delay_s,
        max_num_timeout=_int("max_num_timeout", slurm.get("max_num_timeout", 0), 0),
    )
