"""The config contract: every torchrun key, the plugin's defaults, checks that name the key."""

from dataclasses import asdict, fields

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.run import get_args_parser

from hydra_plugins.hydra_torchrun_launcher._job import launch_config as _launch_config
from hydra_plugins.hydra_torchrun_launcher._launcher.settings import LauncherConfigError, resolve_settings
from hydra_plugins.hydra_torchrun_launcher.config import TorchrunLauncherConf

# torchrun's own flags, from its own parser (dashes and underscores spelled alike)
_PARSER = get_args_parser()
# flags that print something and exit (`--print-completion`: torch 2.15): nothing a launcher runs
CLI_ONLY = ("help", "print_completion")
TORCHRUN_DEFAULTS = {a.dest: a.default for a in _PARSER._actions if a.dest not in CLI_ONLY}
# where this plugin differs from torchrun on purpose (the README's Configuration reference marks them ★)
ON_PURPOSE = {
    "master_port",
    "rdzv_id",
    "monitor_interval",
    "log_dir",
    "start_method",
    "shutdown_timeout",
    "tee",
}
PLUGIN_KEYS = {
    "parallel_jobs",
    "devices",
    "job_timeout",
    "launch_prefix",
    "cluster",
    "preload",
    "dry_run",
    "stop_signal",
    "stop_timeout",
    "requeue",
    "resume",
}


def settings(**overrides):
    return resolve_settings(OmegaConf.create({**asdict(TorchrunLauncherConf()), **overrides}))


def test_every_torchrun_flag_is_a_key_and_the_plugin_adds_only_its_own() -> None:
    keys = {f.name for f in fields(TorchrunLauncherConf)} - {"_target_"}
    assert set(TORCHRUN_DEFAULTS) - keys == set(), "torchrun flags with no launcher key"
    # a flag of a newer torchrun than the installed one (2.14; an environment variable before)
    newer = {"log_line_prefix_template"}
    assert keys - set(TORCHRUN_DEFAULTS) - newer == PLUGIN_KEYS


def test_defaults_match_torchruns_except_where_documented() -> None:
    conf = asdict(TorchrunLauncherConf())
    # the same value spelt another way: one node is "1" or "1:1"; no event handler is null or "null"
    conf.update(
        nnodes=f"{conf['nnodes']}:{conf['nnodes']}", event_log_handler=conf["event_log_handler"] or "null"
    )
    differ = {
        key
        for key, default in TORCHRUN_DEFAULTS.items()
        if str(conf[key]) != str(default) and not (conf[key] in (None, "", []) and default in (None, "", []))
    }
    assert differ <= ON_PURPOSE, differ - ON_PURPOSE


def test_defaults_that_differ_from_torchrun_on_purpose() -> None:
    conf = TorchrunLauncherConf()
    assert conf.master_port is None and conf.rdzv_id is None and conf.log_dir is None
    assert conf.monitor_interval == 0.1
    assert conf.start_method == "forkserver"
    assert (conf.parallel_jobs, conf.devices, conf.job_timeout, conf.launch_prefix, conf.cluster) == (
        1,
        None,
        None,
        [],
        "auto",
    )


def test_each_job_of_a_sweep_gets_its_own_rendezvous_on_a_free_port() -> None:
    job = settings()
    first = _launch_config.rendezvous_for(job, "/sweeps/a", 0)
    second = _launch_config.rendezvous_for(job, "/sweeps/a", 1)
    other_sweep = _launch_config.rendezvous_for(job, "/sweeps/b", 0)
    assert (first.backend, first.endpoint) == ("c10d", "localhost:0")  # the OS picks the port
    assert len({first.run_id, second.run_id, other_sweep.run_id}) == 3


def test_a_key_the_installed_torch_lacks_is_refused_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    present = _launch_config.launch_config_fields()
    monkeypatch.setattr(_launch_config, "launch_config_fields", lambda: present - {"numa_options"})
    _launch_config.check_supported(settings())  # at its default: ignored
    with pytest.raises(LauncherConfigError) as refused:
        _launch_config.check_supported(settings(numa_binding="node"))
    assert str(refused.value).startswith("hydra.launcher.numa_binding='node' is not supported")
    assert torch.__version__ in str(refused.value)


@pytest.mark.parametrize("field_name", ["signals_to_handle", "shutdown_timeout"])
def test_a_default_promise_the_installed_torch_cannot_keep_is_said_by_name(
    field_name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    present = _launch_config.launch_config_fields()
    assert field_name in present  # every torch setup.py allows has it: the warning is for a later one
    monkeypatch.setattr(_launch_config, "launch_config_fields", lambda: present - {field_name})
    monkeypatch.setattr(_launch_config, "_WARNED", set())
    with caplog.at_level("WARNING"):
        _launch_config.check_supported(settings())
        _launch_config.check_supported(settings())
    said = [r.getMessage() for r in caplog.records if f"LaunchConfig.{field_name}" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"torch {torch.__version__} has no "), said


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("max_restarts", "abc", "hydra.launcher.max_restarts='abc' is invalid: use an int"),
        ("standalone", "yes", "hydra.launcher.standalone='yes' is invalid: use true or false"),
        (
            "launch_prefix",
            "numactl",
            "hydra.launcher.launch_prefix='numactl' is invalid: use a list of strings",
        ),
        ("monitor_interval", 0, "hydra.launcher.monitor_interval=0.0 is invalid"),
        # before any rank starts, not as a bare FileNotFoundError in every rank
        (
            "launch_prefix",
            ["no_such_program_xyz", "--flag"],
            "hydra.launcher.launch_prefix=['no_such_program_xyz', '--flag'] is invalid: "
            "no_such_program_xyz is not a program found on PATH",
        ),
        (
            "cluster",
            "pbs",
            "hydra.launcher.cluster='pbs' is invalid: use one of auto, none, slurm, pet, mpi, lsf",
        ),
        # no limit is null (job_timeout), not inf: a timer cannot be set to inf
        (
            "job_timeout",
            float("inf"),
            "hydra.launcher.job_timeout=inf is invalid: use null (no limit) or a finite",
        ),
        ("stop_timeout", float("inf"), "hydra.launcher.stop_timeout=inf is invalid: use a finite number"),
        ("monitor_interval", float("nan"), "hydra.launcher.monitor_interval=nan is invalid"),
        ("devices", [0, 0], "hydra.launcher.devices=['0', '0'] is invalid: list each device id once"),
        (
            "module",
            True,
            "hydra.launcher.module=True is invalid: only applies with hydra.launcher.training_script",
        ),
        # refused here, before any rank starts, not job by job by torch
        ("rdzv_backend", "etcd3", "hydra.launcher.rdzv_backend='etcd3' is invalid: use one of static, c10d"),
        ("logs_specs", "nope", "hydra.launcher.logs_specs='nope' is invalid: use null or the name of a"),
        (
            "signals_to_handle",
            "SIGTERM,SIGTERN",
            "hydra.launcher.signals_to_handle='SIGTERM,SIGTERN' is invalid: use signal names",
        ),
    ],
)
def test_wrong_values_name_their_key(key: str, value: object, expected: str) -> None:
    with pytest.raises(LauncherConfigError) as refused:
        settings(**{key: value})
    assert str(refused.value).startswith(expected)
    assert "\n" not in str(refused.value)


def test_values_of_the_right_kind_are_taken_as_torchrun_would() -> None:
    job = settings(nnodes="1:2", rdzv_id=5, launch_prefix=["env", "--unset", 0], job_timeout=3)
    assert (job.min_nodes, job.max_nodes) == (1, 2)
    assert job.conf.rdzv_id == "5"
    assert job.conf.launch_prefix == ["env", "--unset", "0"]
    assert job.conf.job_timeout == 3.0
    assert settings(rdzv_conf="join_timeout=10,read_timeout=5").rdzv_conf == {
        "join_timeout": "10",
        "read_timeout": "5",
    }


def test_documented_values_are_taken() -> None:
    # null is the documented default of event_log_handler; torch gets its "null" handler
    assert settings(event_log_handler=None).conf.event_log_handler is None
    # torchrun takes a registered device backend's name for nproc_per_node; torch counts it at launch
    assert settings(nproc_per_node="privateuseone").conf.nproc_per_node == "privateuseone"
    with pytest.raises(LauncherConfigError, match="nproc_per_node='privateuseone' is invalid here"):
        _launch_config.local_world_size(settings(nproc_per_node="privateuseone"))
