"""A job by hand: its equivalent `torchrun` command, and a script that reruns it.

Every job dir gets `rerun.sh`: `bash <job dir>/rerun.sh` runs that job again outside its
sweep, as a sweep of this one job through this launcher (the app's own command, the
sweep's Hydra overrides, the job's overrides, its devices), into a dir of its own below
the job dir; extra arguments are more overrides. Its header shows the same job as a plain
`torchrun` command line with the environment the job adds, which is also what a dry run
prints. Values reach the script only through `shlex.quote`: nothing from a config is ever
run as shell code.
"""

import functools
import os
import re
import shlex
import stat
import sys
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from .._job.agent import job_log_dir
from .._shared.plan import JobPlan

RERUN_SCRIPT = "rerun.sh"
_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# Hydra overrides that belong to the sweep, not to the job: the rerun sets its own
_SWEEP_OVERRIDES = ("hydra.sweep.", "hydra.mode", "hydra.job.num", "hydra.job.id")
# ...and, for the plain torchrun line (Hydra's run mode in every rank), the launcher's too
_LAUNCHER_OVERRIDES = ("hydra/launcher", "hydra.launcher.", "hydra/sweeper", "hydra.sweeper.")
_PLAIN_HYDRA_VALUE = re.compile(r"[\w/.:~+@%-]+")


def app_command() -> List[str]:
    """How the app was started: the interpreter and its script, or `-m` and its module."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", module]
    return [sys.executable, sys.argv[0]]


def job_environment(plan: JobPlan, devices: Optional[List[str]]) -> Dict[str, str]:
    """What the job adds to the launcher's environment before its ranks start."""
    env = dict(plan.env_set)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


def torchrun_command(plan: JobPlan, config: DictConfig) -> List[str]:
    """The job as one `torchrun` command line (the flags this torch's torchrun knows)."""
    conf = plan.settings.conf
    rdzv = plan.rendezvous
    rdzv_conf = {k: v for k, v in rdzv.configs.items() if k != "rank"}
    flags: List[Any] = [
        ("--nnodes", conf.nnodes),
        ("--nproc-per-node", conf.nproc_per_node),
        ("--rdzv-backend", rdzv.backend),
        ("--rdzv-endpoint", rdzv.endpoint),
        ("--rdzv-id", rdzv.run_id),
        ("--rdzv-conf", ",".join(f"{k}={v}" for k, v in rdzv_conf.items()) or None),
        ("--node-rank", conf.node_rank if rdzv.backend == "static" and plan.settings.max_nodes > 1 else None),
        ("--max-restarts", conf.max_restarts),
        ("--monitor-interval", f"{conf.monitor_interval:g}"),
        ("--start-method", conf.start_method),
        ("--role", conf.role if conf.role != "default" else None),
        ("--log-dir", job_log_dir(plan)),
        ("--redirects", conf.redirects if str(conf.redirects) != "0" else None),
        ("--tee", conf.tee if str(conf.tee) != "0" else None),
        ("--local-ranks-filter", conf.local_ranks_filter or None),
        ("--local-addr", conf.local_addr),
        ("--logs-specs", conf.logs_specs),
        ("--numa-binding", conf.numa_binding),
    ]
    known = _torchrun_flags()
    command = ["torchrun"] + [
        f"{flag}={value}" for flag, value in flags if value is not None and (known is None or flag in known)
    ]
    if conf.training_script is not None:
        for flag, on in (
            ("--module", conf.module),
            ("--no-python", conf.no_python),
            ("--run-path", conf.run_path),
        ):
            if on:
                command.append(flag)
        return command + [conf.training_script, *conf.training_script_args]
    app = app_command()
    script = ["--module", app[2]] if app[1] == "-m" else [app[1]]
    overrides = _without(_hydra_overrides(config), _LAUNCHER_OVERRIDES)
    # Hydra's run mode in every rank, in the job's dir, with the job's number
    run = [f"hydra.run.dir={_hydra_value(str(plan.output_dir))}", f"hydra.job.num={plan.idx}"]
    return command + script + overrides + list(plan.overrides) + run


def rerun_script(plan: JobPlan, config: DictConfig, devices: Optional[List[str]]) -> str:
    """`rerun.sh` of a job: a one-job sweep of it, with its plain torchrun form in the header."""
    overrides = _hydra_overrides(config)
    if OmegaConf.select(config, "hydra.sweeper._target_") != _BASIC_SWEEPER:
        # one job, whatever the sweep's sweeper would have made of these overrides
        overrides = _without(overrides, ("hydra/sweeper", "hydra.sweeper.")) + ["hydra/sweeper=basic"]
    if devices is not None:
        overrides.append(f"hydra.launcher.devices=[{','.join(devices)}]")
    rerun_dir = _hydra_value(os.path.join(str(plan.output_dir), "rerun_"), "${now:%Y-%m-%d_%H-%M-%S}")
    command = [*app_command(), "--multirun", *overrides, *plan.overrides, f"hydra.sweep.dir={rerun_dir}"]
    lines = [
        "#!/usr/bin/env bash",
        f"# Job #{plan.idx} of the sweep in {config.hydra.sweep.dir}: {_listed(plan.overrides)}",
        "# Reruns it outside that sweep, as a sweep of this one job through the torchrun launcher,",
        "# into rerun_<date>_<time>/ beside this script; arguments are more overrides:",
        f"#     bash {shlex.quote(os.path.join(str(plan.output_dir), RERUN_SCRIPT))} [override ...]",
        "#",
        "# The same job under plain torchrun (every rank runs the app in Hydra's run mode):",
        f"#     {plain_torchrun_line(plan, config, devices)}",
        "set -euo pipefail",
        f"cd {shlex.quote(plan.launch_dir)}",
        f'exec {shlex.join(command)} "$@"',
        "",
    ]
    return "\n".join(lines)


def plain_torchrun_line(plan: JobPlan, config: DictConfig, devices: Optional[List[str]]) -> str:
    """The job as a shell line of plain torchrun, the environment the job adds in front."""
    env = [f"{k}={v}" for k, v in job_environment(plan, devices).items()]
    return shlex.join((["env", *env] if env else []) + torchrun_command(plan, config))


def write_rerun_script(plan: JobPlan, config: DictConfig, devices: Optional[List[str]]) -> None:
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    path = plan.output_dir / RERUN_SCRIPT
    path.write_text(rerun_script(plan, config, devices))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _hydra_overrides(config: DictConfig) -> List[str]:
    """The sweep command's Hydra overrides that shape the job (not the sweep's dir or mode)."""
    # as typed: an override's own ${...} is resolved by the rerun, not now
    return _without(
        [str(o) for o in OmegaConf.to_container(config.hydra.overrides.hydra, resolve=False)],
        _SWEEP_OVERRIDES,
    )


def _without(overrides: List[str], keys: "tuple[str, ...]") -> List[str]:
    """`overrides` but those of keys starting with `keys` (`+key=`, `~key` included)."""
    return [o for o in overrides if not o.lstrip("+~").startswith(keys)]


def _listed(overrides: List[str]) -> str:
    return " ".join(overrides) or "(no overrides)"


def _hydra_value(value: str, interpolation: str = "") -> str:
    """`value` as Hydra's override grammar reads it back (quoted when it must be), then
    `interpolation` (`${now:...}`), which Hydra resolves in quoted and plain values alike."""
    if _PLAIN_HYDRA_VALUE.fullmatch(value):
        return value + interpolation
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + interpolation + "'"


@functools.cache
def _torchrun_flags() -> "Optional[frozenset[str]]":
    """The long options of the installed torchrun (names change between torch releases).

    None (every flag shown) where argparse's list of actions, a private name, is missing.
    """
    from torch.distributed.run import get_args_parser

    actions = getattr(get_args_parser(), "_actions", None)
    if actions is None:
        return None
    return frozenset(option for action in actions for option in action.option_strings)


def dry_run_plan(
    plans: List[JobPlan], configs: Dict[int, DictConfig], parallel_jobs: int, devices: Optional[List[str]]
) -> str:
    """What `dry_run: true` prints: every job's plan, as it would run, and its torchrun form."""
    lines = [f"Dry run: {len(plans)} jobs, {parallel_jobs} at a time; nothing is started"]
    for plan in plans:
        conf = plan.settings.conf
        config = configs[plan.idx]
        rdzv = plan.rendezvous
        if devices is None:
            job_devices, shown = None, os.environ.get("CUDA_VISIBLE_DEVICES", "all visible")
        elif parallel_jobs == 1:
            job_devices = devices[: plan.nproc]
            shown = ",".join(job_devices)
        else:
            job_devices, shown = None, f"{plan.nproc} of {','.join(devices)}, shared out as jobs start"
        runs = f"script {conf.training_script}" if conf.training_script is not None else "task function"
        port = " (a free port when the job starts)" if rdzv.endpoint.endswith(":0") else ""
        lines += [
            f"\t#{plan.idx} : {_listed(plan.overrides)}",
            f"\t\tjob dir:    {plan.output_dir}",
            f"\t\tranks:      {plan.nproc} per node x {conf.nnodes} node(s), {conf.start_method}, {runs}",
            f"\t\tdevices:    {shown}",
            f"\t\trendezvous: {rdzv.backend} at {rdzv.endpoint}{port}, id {rdzv.run_id}",
            f"\t\ttorchrun:   {plain_torchrun_line(plan, config, job_devices)}",
        ]
    return "\n".join(lines)
