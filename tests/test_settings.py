"""The config contract: every torchrun key, the plugin's defaults, checks that name the key."""

from dataclasses import asdict, fields

import pytest
import torch
from omegaconf import OmegaConf

from hydra_plugins.hydra_torchrun_launcher import _launch_config
from hydra_plugins.hydra_torchrun_launcher._settings import LauncherConfigError, resolve_settings
from hydra_plugins.hydra_torchrun_launcher.config import TorchrunLauncherConf

TORCHRUN_KEYS = {
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone",
    "max_restarts", "monitor_interval", "start_method", "role", "module", "no_python", "run_path", "log_dir",
    "redirects", "tee", "local_ranks_filter", "node_rank", "master_addr", "master_port", "local_addr",
    "training_script", "training_script_args", "logs_specs", "numa_binding", "signals_to_handle",
    "shutdown_timeout", "virtual_local_rank", "log_line_prefix_template", "event_log_handler",
    "duplicate_stdout_filters", "duplicate_stderr_filters",
}  # fmt: skip
PLUGIN_KEYS = {"parallel_jobs", "devices", "job_timeout", "launch_prefix", "cluster"}


def settings(**overrides):
    return resolve_settings(OmegaConf.create({**asdict(TorchrunLauncherConf()), **overrides}))


def test_every_torchrun_key_and_the_plugins_own() -> None:
    assert {f.name for f in fields(TorchrunLauncherConf)} == TORCHRUN_KEYS | PLUGIN_KEYS | {"_target_"}


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
        ("cluster", "pbs", "hydra.launcher.cluster='pbs' is invalid: use one of auto, none, slurm"),
        ("devices", [0, 0], "hydra.launcher.devices=['0', '0'] is invalid: list each device id once"),
        (
            "module",
            True,
            "hydra.launcher.module=True is invalid: only applies with hydra.launcher.training_script",
        ),
    ],
)
def test_wrong_values_name_their_key(key: str, value: object, expected: str) -> None:
    with pytest.raises(LauncherConfigError) as refused:
        settings(**{key: value})
    assert str(refused.value).startswith(expected)
    assert "\n" not in str(refused.value)


def test_values_of_the_right_kind_are_taken_as_torchrun_would() -> None:
    job = settings(nnodes="1:2", rdzv_id=5, launch_prefix=["numactl", "--cpunodebind", 0], job_timeout=3)
    assert (job.min_nodes, job.max_nodes) == (1, 2)
    assert job.conf.rdzv_id == "5"
    assert job.conf.launch_prefix == ["numactl", "--cpunodebind", "0"]
    assert job.conf.job_timeout == 3.0
    assert settings(rdzv_conf="join_timeout=10,read_timeout=5").rdzv_conf == {
        "join_timeout": "10",
        "read_timeout": "5",
    }
