"""A job by hand: its equivalent `torchrun` command, and a script that reruns it.

Every job dir gets `rerun.sh`: `bash <job dir>/rerun.sh` runs that job again outside its
sweep, as a sweep of this one job through this launcher (the app's own command and its
`--config-*` options, the sweep's Hydra overrides, the job's overrides, its devices), into
a dir of its own below the job dir; extra arguments are more overrides. Its header shows
the same job as a plain `torchrun` command line with the environment the job adds, which is
also what a dry run prints, and names the settings such a line cannot express.

Nothing from a config is ever run as shell code: values reach a command only through
`shlex.quote`, and every comment line is made one line (a newline in an override would end
the comment and start a command), whatever the value holds. The torchrun line itself
quotes a value with a newline or another control character as bash's `$'...'`, so that it
stays one line and, pasted into bash, passes the value exactly. Paths go to Hydra's override
parser quoted for its grammar when they are not plain ASCII words.
"""

import argparse
import os
import re
import shlex
import stat
import sys
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from .._job.agent import job_log_dir, script_command, script_path
from .._job.launch_config import means_the_default, prefix_template
from .._shared.plan import JobPlan
from .._shared.torchrun_cli import read_from_pet_variables, torchrun_options
from ..config import TORCHRUN_FLAGS
from .report import jobs_counted
from .resume import PlannedResumption
from .runner import Placement

RERUN_SCRIPT = "rerun.sh"
_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# Hydra overrides that belong to the sweep, not to the job: the rerun sets its own
_SWEEP_OVERRIDES = ("hydra.sweep.", "hydra.mode", "hydra.job.num", "hydra.job.id")
# ...and, for the plain torchrun line (Hydra's run mode in every rank), the launcher's too
_LAUNCHER_OVERRIDES = ("hydra/launcher", "hydra.launcher.", "hydra/sweeper", "hydra.sweeper.")
# ...and the rerun, a sweep of its own in a new dir, has no record to resume
_RERUN_DROPS = ("hydra.launcher.resume",)
# what Hydra's override grammar reads unquoted (ASCII only: `józef` or `~` must be quoted)
_PLAIN_HYDRA_VALUE = re.compile(r"[A-Za-z0-9_/.:+@%-]+")
# characters that would end a comment line of a shell script, or hide what follows
_PER_RANK = re.compile(r"\{(local_)?rank\}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def comment(text: str) -> str:
    """`text` as one line of a shell comment: control characters (a newline above all, which
    would end the comment and make the rest a command) are shown escaped (`\\n`)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def bash_word(word: str) -> str:
    """`word` as one bash word on one line: `shlex.quote` where it has no control character,
    else bash's ANSI-C quoting (`$'a\\nb'`), which bash reads back as the exact value."""
    if not _CONTROL.search(word):
        return shlex.quote(word)

    def escaped(char: str) -> str:
        if char in "\\'":
            return "\\" + char
        if _CONTROL.fullmatch(char):
            return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
        return char

    return "$'" + "".join(escaped(c) for c in word) + "'"


def config_options(argv: Optional[List[str]] = None) -> List[str]:
    """The app's `--config-path`, `--config-name` and `--config-dir` as it was started with
    them (`argv`: `sys.argv`), so a rerun composes the same config; a relative
    `--config-dir` is made absolute (the rerun may start elsewhere)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config-path", "-cp")
    parser.add_argument("--config-name", "-cn")
    parser.add_argument("--config-dir", "-cd")
    known, _ = parser.parse_known_args((sys.argv if argv is None else argv)[1:])
    options = []
    if known.config_path is not None:
        options.append(f"--config-path={known.config_path}")
    if known.config_name is not None:
        options.append(f"--config-name={known.config_name}")
    if known.config_dir is not None:
        options.append(f"--config-dir={os.path.abspath(known.config_dir)}")
    return options


def app_command(python: Optional[str] = None) -> List[str]:
    """How the app was started: the interpreter (`python`: another's, as a host runs it) and
    its script, or `-m` and its module."""
    python = python or sys.executable
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [python, "-m", module]
    return [python, sys.argv[0]]


def job_environment(plan: JobPlan, devices: Optional[List[str]]) -> Dict[str, str]:
    """What the job adds to the launcher's environment before its ranks start."""
    env = dict(plan.env_set)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


def torchrun_command(
    plan: JobPlan, config: DictConfig, python: Optional[str] = None
) -> Tuple[List[str], List[str], Dict[str, str]]:
    """The job as one `torchrun` command line (the flags this torch's torchrun knows), the
    job's settings that the line cannot express (named, so nobody takes it for the job), and
    the variables that give torchrun what it takes from its environment for want of a flag."""
    conf = plan.settings.conf
    rdzv = plan.rendezvous
    rdzv_conf = {k: v for k, v in rdzv.configs.items() if k != "rank"}
    # each key's value in the line (None: left out), in the line's order; its flag is the key's
    # own (config.py), the value the job's: its rendezvous, its log dir, ...
    shown: Dict[str, Any] = {
        "nnodes": conf.nnodes,
        "nproc_per_node": conf.nproc_per_node,
        "rdzv_backend": rdzv.backend,
        "rdzv_endpoint": rdzv.endpoint,
        "rdzv_id": rdzv.run_id,
        "rdzv_conf": ",".join(f"{k}={v}" for k, v in rdzv_conf.items()) or None,
        "node_rank": conf.node_rank if rdzv.backend == "static" and plan.settings.max_nodes > 1 else None,
        "max_restarts": conf.max_restarts,
        "monitor_interval": f"{conf.monitor_interval:g}",
        "start_method": conf.start_method,
        "role": conf.role if conf.role != "default" else None,
        "log_dir": job_log_dir(plan),
        "redirects": conf.redirects if str(conf.redirects) != "0" else None,
        "tee": conf.tee if str(conf.tee) != "0" else None,
        "local_ranks_filter": conf.local_ranks_filter or None,
        "local_addr": conf.local_addr,
        "logs_specs": conf.logs_specs,
        "event_log_handler": conf.event_log_handler,
        "log_line_prefix_template": _prefix_template_of(conf),
        "numa_binding": conf.numa_binding,
        "shutdown_timeout": conf.shutdown_timeout,
        "signals_to_handle": conf.signals_to_handle,
        "virtual_local_rank": True if conf.virtual_local_rank else None,
        "duplicate_stdout_filters": ",".join(conf.duplicate_stdout_filters or []) or None,
        "duplicate_stderr_filters": ",".join(conf.duplicate_stderr_filters or []) or None,
    }
    flags = [(TORCHRUN_FLAGS[key], value) for key, value in shown.items()]
    known = torchrun_options()
    command = ["torchrun"]
    missing = []
    through_environment: Dict[str, str] = {}
    for flag, value in flags:
        if value is None:
            continue
        if known is not None and flag not in known:
            if flag in _IN_THE_ENVIRONMENT:
                through_environment[_IN_THE_ENVIRONMENT[flag]] = str(value)
            elif not _as_without_the_option(flag, value):
                missing.append(f"{flag} (this torch's torchrun has no such option)")
        else:
            command.append(flag if value is True else f"{flag}={value}")
    per_rank = [a for a in [*conf.launch_prefix, *conf.training_script_args] if _PER_RANK.search(a)]
    if per_rank:
        missing.append(f"{{rank}}/{{local_rank}} in {' '.join(per_rank)} (replaced per rank by the launcher)")
    return command + _what_runs(plan, config, python), missing, through_environment


def _what_runs(plan: JobPlan, config: DictConfig, python: Optional[str]) -> List[str]:
    """What the torchrun line runs after its flags: the training script, or the app in
    Hydra's run mode (under the launch prefix, if any: by `python`, the interpreter where the
    line runs)."""
    conf = plan.settings.conf
    if conf.training_script is not None:
        if conf.launch_prefix:
            return ["--no-python", *conf.launch_prefix, *script_command(plan)]
        options = (("--module", conf.module), ("--no-python", conf.no_python), ("--run-path", conf.run_path))
        flags = [flag for flag, on in options if on]
        return flags + [script_path(plan), *conf.training_script_args]
    app = app_command(python)
    overrides = _without(_hydra_overrides(config), _LAUNCHER_OVERRIDES)
    # Hydra's run mode in every rank (whatever hydra.mode the config sets), in the job's
    # dir, with the job's number
    run_dir = _hydra_value(str(plan.output_dir))
    run = [f"hydra.run.dir={run_dir}", f"hydra.job.num={plan.idx}", "hydra.mode=RUN"]
    app_args = [*config_options(), *overrides, *plan.overrides, *run]
    if conf.launch_prefix:
        return ["--no-python", *conf.launch_prefix, *app, *app_args]
    script = ["--module", app[2]] if app[1] == "-m" else [app[1]]
    return script + app_args


def rerun_script(
    plan: JobPlan, config: DictConfig, devices: Optional[List[str]], placed: Optional[Placement] = None
) -> str:
    """`rerun.sh` of a job: a one-job sweep of it, with its plain torchrun form in the header;
    on its `devices`, or where `placed` says (a runner's own overrides: the hosts it ran on)."""
    overrides = _without(_hydra_overrides(config), _RERUN_DROPS)
    if OmegaConf.select(config, "hydra.sweeper._target_") != _BASIC_SWEEPER:
        # one job, whatever the sweep's sweeper would have made of these overrides
        overrides = _without(overrides, ("hydra/sweeper", "hydra.sweeper.")) + ["hydra/sweeper=basic"]
    if placed is not None:
        where = [f"{placed.where},"]
    elif devices is not None:
        where = []
        overrides.append(f"hydra.launcher.devices=[{','.join(devices)}]")
    else:
        where = []
    rerun_dir = _hydra_value(os.path.join(str(plan.output_dir), "rerun_"), "${now:%Y-%m-%d_%H-%M-%S}")
    command = [
        *app_command(),
        *config_options(),
        "--multirun",
        *overrides,
        *plan.overrides,
        *(placed.overrides if placed is not None else ()),
        f"hydra.sweep.dir={rerun_dir}",
        # a new dir: there is no record to resume, whatever the sweep's resume said
        "hydra.launcher.resume=false",
    ]
    line, missing = plain_torchrun_line(plan, config, devices, placed.python if placed is not None else None)
    header = [
        f"Job #{plan.idx} of the sweep in {config.hydra.sweep.dir}: {_listed(plan.overrides)}",
        "Reruns it outside that sweep, as a sweep of this one job through the torchrun launcher,",
        *where,
        "into rerun_<date>_<time>/ beside this script; arguments are more overrides:",
        f"    bash {shlex.quote(os.path.join(str(plan.output_dir), RERUN_SCRIPT))} [override ...]",
        "",
        "The same job under plain torchrun (every rank runs the app in Hydra's run mode):",
        f"    {line}",
        *([f"    (it cannot express: {'; '.join(missing)})"] if missing else []),
    ]
    lines = [
        "#!/usr/bin/env bash",
        *(f"# {comment(text)}".rstrip() for text in header),
        "set -euo pipefail",
        f"cd {shlex.quote(plan.launch_dir)}",
        f'exec {shlex.join(command)} "$@"',
        "",
    ]
    return "\n".join(lines)


def plain_torchrun_line(
    plan: JobPlan, config: DictConfig, devices: Optional[List[str]], python: Optional[str] = None
) -> Tuple[str, List[str]]:
    """The job as a shell line of plain torchrun, the environment the job adds in front, run
    where the sweep started (a training script: in its job dir; `python`: the interpreter
    there, where it is not this one's); and what the line cannot express."""
    conf = plan.settings.conf
    env = job_environment(plan, devices)
    # the app's script, and a relative --config-path, are found from where the sweep started
    cd = f"cd {bash_word(plan.launch_dir)} && " if conf.training_script is None else ""
    if conf.training_script is not None:
        job_dir = bash_word(str(plan.output_dir))
        cd = f"mkdir -p {job_dir} && cd {job_dir} && "
        if conf.module:
            path = os.environ.get("PYTHONPATH")
            env["PYTHONPATH"] = plan.launch_dir + (os.pathsep + path if path else "")
    command, missing, through_environment = torchrun_command(plan, config, python)
    env.update(through_environment)
    shown = [word for name in _pet_variables_read_here() for word in ("-u", name)]
    shown += [f"{k}={v}" for k, v in env.items()]
    return cd + " ".join(bash_word(word) for word in (["env", *shown] if shown else []) + command), missing


def write_rerun_script(plan: JobPlan, script: str) -> None:
    """Write `script` (`rerun_script`'s) as the job's rerun.sh."""
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    path = plan.output_dir / RERUN_SCRIPT
    path.write_text(script)
    # executable by whom the umask lets read it, as `chmod +x` makes it
    mode = path.stat().st_mode
    path.chmod(mode | (mode & (stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)) >> 2)


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
    `interpolation` (`${now:...}`), which Hydra resolves in quoted and plain values alike.

    In a quoted value Hydra takes backslashes literally except those before a quote (and at
    the end), which escape; so those are doubled, and each quote escaped."""
    if _PLAIN_HYDRA_VALUE.fullmatch(value):
        return value + interpolation
    quoted = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    if not interpolation:
        quoted = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, quoted)
    return "'" + quoted + interpolation + "'"


# what a torchrun without the option does besides the key's default: before 2.12 torch's
# agent gives stopped ranks 30 s
_WITHOUT_THE_OPTION = {"--shutdown-timeout": 30}
# options an older torchrun takes from a variable instead (torch's agent reads it)
_IN_THE_ENVIRONMENT = {"--log-line-prefix-template": "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"}


def _as_without_the_option(flag: str, value: Any) -> bool:
    """Whether a torchrun without `flag` does what `value` asks: the key's default, however
    spelled (`means_the_default`, as for a key torch lacks), or what torch does anyway."""
    key = flag[2:].replace("-", "_")
    return value == _WITHOUT_THE_OPTION.get(flag) or means_the_default(key, value)


def _prefix_template_of(conf: Any) -> Optional[str]:
    """The job's log line prefix template as torch takes it, where the key sets one (else
    torch reads TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE from the environment, as the job did)."""
    return prefix_template(conf) if conf.log_line_prefix_template else None


def _pet_variables_read_here() -> List[str]:
    """The PET_* variables of this shell that the installed torchrun would read: the line
    unsets them (it gives every setting of the job, and a variable would override torchrun's
    default where the line leaves one out)."""
    read = read_from_pet_variables() or frozenset()
    return sorted(name for key in read if (name := f"PET_{key.upper()}") in os.environ)


def dry_run_plan(
    plans: List[JobPlan],
    configs: Dict[int, DictConfig],
    parallel_jobs: int,
    devices: Optional[List[str]],
    recorded: PlannedResumption,
) -> str:
    """What `dry_run: true` prints: every job's plan, as it would run, and its torchrun form;
    `recorded`: what the run would do with the jobs the sweep dir's record holds."""
    from_record = recorded.in_header("not run")
    lines = [
        f"Dry run: {jobs_counted(len(plans))}, {parallel_jobs} at a time{from_record}; nothing is started"
    ]
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
        line, missing = plain_torchrun_line(plan, config, job_devices)
        lines += [
            f"\t#{plan.idx} : {_listed(plan.overrides)}",
            *([f"\t\trecord:     {recorded.said[plan.idx]}"] if plan.idx in recorded.said else []),
            f"\t\tjob dir:    {plan.output_dir}",
            f"\t\tranks:      {plan.nproc} per node x {conf.nnodes} node(s), {conf.start_method}, {runs}",
            f"\t\tdevices:    {shown}",
            f"\t\trendezvous: {rdzv.backend} at {rdzv.endpoint}{port}, id {rdzv.run_id}",
            f"\t\ttorchrun:   {line}",
            *([f"\t\t            (it cannot express: {'; '.join(missing)})"] if missing else []),
        ]
    return "\n".join(lines)
