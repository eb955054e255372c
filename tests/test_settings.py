"""The config contract: every torchrun key, the plugin's defaults, checks that name the key."""

import signal
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
    # flags of a newer torchrun than the installed one: log_line_prefix_template (2.14; an
    # environment variable before), and every key whose LaunchConfig field this torch lacks (the
    # launcher refuses them when set: the tests below)
    have = _launch_config.launch_config_fields()
    newer = {"log_line_prefix_template"} | {
        key for key, field_name in _launch_config._FIELD_OF_KEY.items() if field_name not in have
    }
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


def test_a_single_nodes_master_addr_is_honoured_with_its_port_and_refused_without() -> None:
    """torchrun gives a single node's ranks its --master-addr (a static rendezvous there); a
    free port of localhost cannot honour an address, so the address alone is refused."""
    with pytest.raises(
        LauncherConfigError,
        match=r"^hydra\.launcher\.master_addr=127\.0\.0\.3 needs hydra\.launcher\.master_port",
    ):
        _launch_config.rendezvous_for(settings(master_addr="127.0.0.3"), "/sweeps/a", 0)
    static = _launch_config.rendezvous_for(
        settings(master_addr="127.0.0.3", master_port=29577), "/sweeps/a", 0
    )
    assert (static.backend, static.endpoint) == ("static", "127.0.0.3:29577")
    # --standalone: torchrun's own localhost rendezvous, whatever master_addr says
    alone = _launch_config.rendezvous_for(settings(master_addr="127.0.0.3", standalone=True), "/sweeps/a", 0)
    assert (alone.backend, alone.endpoint) == ("c10d", "localhost:0")


# a value other than the default for every key that a LaunchConfig field carries
SET_VALUES = {
    "log_line_prefix_template": "[{rank}]",
    "event_log_handler": "console",
    "signals_to_handle": "SIGTERM",
    "duplicate_stdout_filters": ["loss"],
    "duplicate_stderr_filters": ["loss"],
    "virtual_local_rank": True,
    "shutdown_timeout": 7,
    "numa_binding": "node",
    "local_addr": "127.0.0.1",
    "local_ranks_filter": "0",
}


def test_every_key_a_launch_config_field_carries_has_a_value_here() -> None:
    # logs_specs: its value must name an installed entry point; the test above names one's absence
    assert set(SET_VALUES) | {"logs_specs"} == set(_launch_config._FIELD_OF_KEY)


@pytest.mark.parametrize("key", sorted(SET_VALUES))
def test_every_key_is_refused_by_name_where_torch_lacks_its_field(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever torch is installed: take the field away, and the key is refused when set."""
    field_name = _launch_config._FIELD_OF_KEY[key]
    present = _launch_config.launch_config_fields()
    monkeypatch.setattr(_launch_config, "launch_config_fields", lambda: present - {field_name})
    monkeypatch.setattr(_launch_config, "close_takes_a_timeout", lambda: False)
    _launch_config.check_supported(settings())  # at its default: harmless
    with pytest.raises(LauncherConfigError) as refused:
        _launch_config.check_supported(settings(**{key: SET_VALUES[key]}))
    assert str(refused.value).startswith(f"hydra.launcher.{key}={SET_VALUES[key]!r} is not supported")
    assert f"torch {torch.__version__}" in str(refused.value)


def test_shutdown_timeout_without_its_field_goes_to_torchs_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch before 2.12 has no LaunchConfig.shutdown_timeout; its PContext.close takes the timeout."""
    present = _launch_config.launch_config_fields()
    monkeypatch.setattr(_launch_config, "launch_config_fields", lambda: present - {"shutdown_timeout"})
    assert _launch_config.close_takes_a_timeout()  # every torch setup.py allows
    _launch_config.check_supported(settings(shutdown_timeout=7))  # honoured: not refused


def test_a_default_the_installed_torch_cannot_keep_is_said_once_by_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    present = _launch_config.launch_config_fields()
    monkeypatch.setattr(_launch_config, "launch_config_fields", lambda: present - {"shutdown_timeout"})
    monkeypatch.setattr(_launch_config, "close_takes_a_timeout", lambda: False)
    monkeypatch.setattr(_launch_config, "_WARNED", set())
    with caplog.at_level("WARNING"):
        _launch_config.check_supported(settings())
        _launch_config.check_supported(settings())
    said = [r.getMessage() for r in caplog.records if "LaunchConfig.shutdown_timeout" in r.getMessage()]
    assert said == [
        f"torch {torch.__version__} has no LaunchConfig.shutdown_timeout: stopped ranks get torch's 30 s, "
        "not hydra.launcher.shutdown_timeout, before SIGKILL"
    ]


def test_without_signals_to_handle_an_ignored_signal_is_said_by_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch before 2.10 handles its four signals whatever the launcher says: said when it matters,
    i.e. when the launcher runs with one of them ignored (nohup), and only then."""
    present = _launch_config.launch_config_fields()
    monkeypatch.setattr(_launch_config, "launch_config_fields", lambda: present - {"signals_to_handle"})
    monkeypatch.setattr(_launch_config, "_WARNED", set())
    # torch's four, at their defaults whatever this test runs under (nohup: SIGHUP ignored; a
    # background job of a shell: SIGINT and SIGQUIT ignored)
    defaults = {
        signal.SIGTERM: signal.SIG_DFL,
        signal.SIGINT: signal.default_int_handler,
        signal.SIGHUP: signal.SIG_DFL,
        signal.SIGQUIT: signal.SIG_DFL,
    }
    previous = {sig: signal.getsignal(sig) for sig in defaults}
    try:
        with caplog.at_level("WARNING"):
            for sig, default in defaults.items():
                signal.signal(sig, default)
            _launch_config.check_supported(settings())
            assert not caplog.records
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            _launch_config.check_supported(settings())
            _launch_config.check_supported(settings())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert [r.getMessage() for r in caplog.records] == [
        f"torch {torch.__version__} has no LaunchConfig.signals_to_handle: SIGHUP, which this process "
        "ignores, stops a job's ranks if it is sent to the job's own process (the terminal's does not "
        "reach it: jobs run in a process group of their own)"
    ]


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


@pytest.mark.parametrize(
    "key, same, other",
    [
        ("signals_to_handle", "SIGINT, SIGTERM,SIGQUIT,SIGHUP", "SIGTERM"),
        ("duplicate_stdout_filters", [], ["loss"]),
        ("duplicate_stderr_filters", [], ["loss"]),
        ("event_log_handler", "null", "console"),
    ],
)
def test_where_torch_lacks_a_key_its_default_spelled_otherwise_is_taken_another_value_refused(
    monkeypatch: pytest.MonkeyPatch, key: str, same: object, other: object
) -> None:
    """A config shared between torch releases may spell the default its own way (the same
    signals in another order, no filters as an empty list, torch's name of its default
    handler): that is what a torch without the field does, so it is no reason to refuse."""
    present = _launch_config.launch_config_fields()
    monkeypatch.setattr(_launch_config, "launch_config_fields", lambda: present - {key})
    _launch_config.check_supported(settings(**{key: same}))
    with pytest.raises(
        LauncherConfigError, match=rf"^hydra\.launcher\.{key}=.* is not supported by the installed"
    ):
        _launch_config.check_supported(settings(**{key: other}))
