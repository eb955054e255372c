"""What a user of `hydra/launcher=torchrun` sees: per-job settings, the ranks' world, returns, errors."""

import functools
import inspect
import os
import subprocess
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.test_utils.test_utils import TSweepRunner
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.hydra_torchrun_launcher._job.failure_report import JobFailedError
from hydra_plugins.hydra_torchrun_launcher._rank.carried_exception import failure_summary
from tests.conftest import assert_gone, run_app

pytestmark = [pytest.mark.usefixtures("hydra_restore_singletons"), pytest.mark.timeout(240)]


@contextmanager
def sweeping(
    runner: TSweepRunner, task: Any, overrides: List[str], tmp_path: Path, config_name: Optional[str] = None
) -> Iterator[List[JobReturn]]:
    """Run a multirun in this process with the torchrun launcher; yields the jobs' JobReturns.

    The sweep dir (tmp_path) is removed when the block ends.
    """
    with runner(
        calling_file=None,
        calling_module="tests.test_launcher",
        task_function=task,
        config_path="configs",
        config_name=config_name,
        overrides=["hydra/launcher=torchrun", *overrides],
        temp_dir=tmp_path,
    ) as result:
        assert result.returns is not None
        yield list(result.returns[0])


def sweep(
    runner: TSweepRunner, task: Any, overrides: List[str], tmp_path: Path, config_name: Optional[str] = None
) -> List[JobReturn]:
    with sweeping(runner, task, overrides, tmp_path, config_name) as returns:
        return returns


def rank_facts(cfg: DictConfig) -> Dict[str, Any]:
    """What a rank sees of its world; every rank returns it, the job reports rank 0's."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    dist.destroy_process_group()
    hydra_cfg = HydraConfig.get()
    env_keys = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "MY_ENV",
    ]
    return {
        "env": {k: os.environ.get(k) for k in env_keys},
        "allreduce": total.item(),
        "output_dir": hydra_cfg.runtime.output_dir,
        "job_num": hydra_cfg.job.num,
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "cfg": OmegaConf.to_container(cfg, resolve=True),
    }


def test_launcher_keys_resolve_per_job(hydra_sweep_runner: TSweepRunner, tmp_path: Path) -> None:
    returns = sweep(
        hydra_sweep_runner,
        rank_facts,
        ["hydra.launcher.nproc_per_node=${n}", "n=1,2"],
        tmp_path,
        config_name="compose_n",
    )
    world = [r.return_value["env"]["WORLD_SIZE"] for r in returns]
    assert world == ["1", "2"]
    assert [r.return_value["allreduce"] for r in returns] == [1.0, 3.0]
    assert [r.return_value["job_num"] for r in returns] == [0, 1]
    # every job has a rendezvous and a port of its own
    assert (
        returns[0].return_value["env"]["TORCHELASTIC_RUN_ID"]
        != returns[1].return_value["env"]["TORCHELASTIC_RUN_ID"]
    )
    assert_gone(r.return_value["pid"] for r in returns)


def test_launcher_keys_may_interpolate_keys_added_by_the_sweep(
    hydra_sweep_runner: TSweepRunner, tmp_path: Path
) -> None:
    # Hydra instantiates the launcher from the sweep's base config, where `+n` does not exist
    # yet; oc.select gives it a value there, and each job resolves its own n.
    returns = sweep(
        hydra_sweep_runner,
        rank_facts,
        ["hydra.launcher.nproc_per_node=${oc.select:n,1}", "+n=2,1"],
        tmp_path,
    )
    assert [r.return_value["env"]["WORLD_SIZE"] for r in returns] == ["2", "1"]


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_rank_world(hydra_sweep_runner: TSweepRunner, tmp_path: Path, start_method: str) -> None:
    with sweeping(
        hydra_sweep_runner,
        rank_facts,
        [
            f"hydra.launcher.start_method={start_method}",
            "hydra.launcher.nproc_per_node=2",
            "hydra.job.chdir=True",
            "+hydra.job.env_set.MY_ENV=from_env_set",
            "+x=1,2",
        ],
        tmp_path,
    ) as returns:
        job_files = [(tmp_path / str(num) / ".hydra" / "config.yaml").is_file() for num in range(2)]
    assert job_files == [True, True]
    assert [r.status for r in returns] == [JobStatus.COMPLETED] * 2
    for num, ret in enumerate(returns):
        facts = ret.return_value
        job_dir = tmp_path / str(num)
        assert Path(facts["output_dir"]) == job_dir.resolve()
        assert Path(facts["cwd"]) == job_dir.resolve()
        assert facts["cfg"] == {"x": num + 1}
        env = facts["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            "0",
            "0",
            "2",
            "2",
        )
        assert env["MY_ENV"] == "from_env_set"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert facts["allreduce"] == 3.0
    # env_set applies to the ranks, not to the launcher
    assert "MY_ENV" not in os.environ
    assert_gone(r.return_value["pid"] for r in returns)


def _closure_task(tag: str):
    def task(cfg: DictConfig) -> str:
        return f"{tag}:{cfg.x}:{os.environ['WORLD_SIZE']}"

    return task


def _partial_target(cfg: DictConfig, *, prefix: str) -> str:
    return f"{prefix}:{cfg.x}"


@pytest.mark.parametrize(
    "task, expected",
    [
        (_closure_task("closure"), ["closure:1:2", "closure:2:2"]),
        (lambda cfg: f"lambda:{cfg.x}", ["lambda:1", "lambda:2"]),
        (functools.partial(_partial_target, prefix="partial"), ["partial:1", "partial:2"]),
    ],
    ids=["closure", "lambda", "partial"],
)
def test_task_functions_of_every_kind_travel(
    hydra_sweep_runner: TSweepRunner, tmp_path: Path, task: Any, expected: List[str]
) -> None:
    returns = sweep(hydra_sweep_runner, task, ["hydra.launcher.nproc_per_node=2", "+x=1,2"], tmp_path)
    assert [r.return_value for r in returns] == expected


def _register_resolver(name: str, resolver: Any) -> None:
    """OmegaConf 2.4 registers with `register_resolver` (its `register_new_resolver` warns);
    in 2.3 `register_resolver` is the older, deprecated API."""
    if "annotation_validation" in inspect.signature(OmegaConf.register_resolver).parameters:
        OmegaConf.register_resolver(name, resolver, replace=True, annotation_validation="off")
    else:
        OmegaConf.register_new_resolver(name, resolver, replace=True)


def test_custom_resolver_resolves_in_ranks(hydra_sweep_runner: TSweepRunner, tmp_path: Path) -> None:
    _register_resolver("times_ten", lambda v: int(v) * 10)
    try:
        returns = sweep(
            hydra_sweep_runner,
            lambda cfg: cfg.y,
            ["hydra.launcher.nproc_per_node=2", "+x=1,2", "+y='${times_ten:${x}}'"],
            tmp_path,
        )
    finally:
        OmegaConf.clear_resolver("times_ten")
    assert [r.return_value for r in returns] == [10, 20]


def _fail_on_rank(cfg: DictConfig) -> int:
    rank = int(os.environ["RANK"])
    if cfg.x == 1 and rank == 1:
        try:
            _ = {}["missing_key"]
        except KeyError as e:
            raise ValueError(f"bad value on rank {rank}") from e
    Path(cfg.marker_dir, f"ran_{cfg.x}_{rank}").touch()
    return rank + 100


def test_failed_rank_fails_its_job_and_the_sweep_goes_on(
    hydra_sweep_runner: TSweepRunner, tmp_path: Path
) -> None:
    # Hydra's sweeper re-raises the first failed job's error once the whole batch has run
    # the error is the rank's own exception, as the task raised it: type, message, frames, chain
    with pytest.raises(ValueError) as failure:
        sweep(
            hydra_sweep_runner,
            _fail_on_rank,
            ["hydra.launcher.nproc_per_node=2", "+x=1,2", f"+marker_dir={tmp_path}"],
            tmp_path / "sweep",
        )
    error = failure.value
    assert str(error) == "bad value on rank 1"
    assert any(frame.name == "_fail_on_rank" for frame in traceback.extract_tb(error.__traceback__))
    # (by name: Hydra 1.4 rebuilds a chained exception as a stand-in of the same name)
    assert type(error.__cause__).__name__ == "KeyError" and "missing_key" in str(error.__cause__)
    assert any(frame.name == "_fail_on_rank" for frame in traceback.extract_tb(error.__cause__.__traceback__))
    # and the launcher's account of it names the rank first
    summary = failure_summary(error)
    assert summary.startswith("rank 1 (local_rank 1, pid ") and "ValueError: bad value on rank 1" in summary
    assert error.__notes__[0].startswith("rank 1 (local_rank 1, pid ")
    assert "exited with code 1" in error.__notes__[0] and "bad value" not in error.__notes__[0]
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_1_0", "ran_2_0", "ran_2_1"]


def test_callbacks_fire_once_per_job_in_the_jobs_own_process(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(
        """
import os
import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
from hydra.experimental.callback import Callback

class Record(Callback):
    def on_job_start(self, config, **kwargs):
        with open(os.path.join(config.hydra.sweep.dir, "events.txt"), "a") as f:
            f.write(f"start {config.hydra.job.num} {os.getpid()}\\n")

    def on_job_end(self, config, job_return, **kwargs):
        with open(os.path.join(config.hydra.sweep.dir, "events.txt"), "a") as f:
            f.write(f"end {config.hydra.job.num} {os.getpid()} {job_return.return_value}\\n")

@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    print(f"pid of rank {os.environ['RANK']}: {os.getpid()}", flush=True)
    return int(os.environ["RANK"]) + 7

if __name__ == "__main__":
    main()
"""
    )
    sweep_dir = tmp_path / "sweep"
    result = run_app(
        app,
        [
            "--multirun",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            f"hydra.sweep.dir={sweep_dir}",
            "+hydra.callbacks.record._target_=__main__.Record",
            "+x=1,2",
        ],
        cwd=tmp_path,
    )
    events = (sweep_dir / "events.txt").read_text().split("\n")[:-1]
    assert [line.split()[:2] for line in events] == [
        ["start", "0"],
        ["end", "0"],
        ["start", "1"],
        ["end", "1"],
    ]
    # each job's start and end in one process, the job's own: never a rank's, never another job's
    job_pids = [{line.split()[2] for line in events if line.split()[1] == job} for job in ("0", "1")]
    assert all(len(pids) == 1 for pids in job_pids) and job_pids[0] != job_pids[1]
    rank_pids = {line.rsplit(" ", 1)[1] for line in result.stdout.splitlines() if "pid of rank" in line}
    assert len(rank_pids) == 4 and not rank_pids & (job_pids[0] | job_pids[1])
    assert all(line.split()[3] == "7" for line in events if line.startswith("end"))
    # the console shows every rank's output, prefixed with its rank; files keep it too
    assert "[default0]:pid of rank 0" in result.stdout
    assert "[default1]:pid of rank 1" in result.stdout
    for job in ("0", "1"):
        outs = sorted((sweep_dir / job / "torchrun_logs").glob("*/attempt_0/*/stdout.log"))
        assert [p.parent.name for p in outs] == ["0", "1"]
        assert "pid of rank 1" in outs[1].read_text()
    rank_pids = [int(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines() if "pid of rank" in line]
    assert len(rank_pids) == 4
    assert_gone(rank_pids)


def test_ranks_log_to_files_of_their_own(tmp_path: Path) -> None:
    app = tmp_path / "my_task.py"
    app.write_text(
        """
import logging, os
import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
log = logging.getLogger(__name__)

@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    log.info(f"hello from rank {os.environ['RANK']}")

if __name__ == "__main__":
    main()
"""
    )
    sweep_dir = tmp_path / "sweep"
    run_app(
        app,
        ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=3", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
    )
    job_dir = sweep_dir / "0"
    assert "hello from rank 0" in (job_dir / "my_task.log").read_text()
    for rank in (1, 2):
        text = (job_dir / f"my_task_rank{rank}.log").read_text()
        assert f"hello from rank {rank}" in text
        assert "hello from rank 0" not in text


def test_multirun_exits_non_zero_when_a_job_failed(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(
        """
import os
import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    if cfg.x == 1 and os.environ["RANK"] == "0":
        raise RuntimeError("job one is broken")
    with open(f"done_{cfg.x}_{os.environ['RANK']}", "w"):
        pass

if __name__ == "__main__":
    main()
"""
    )
    result = run_app(
        app,
        ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "+x=1,2"],
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode != 0
    assert "RuntimeError: job one is broken" in result.stderr
    assert "rank 0 (local_rank 0" in result.stderr
    # the job after the failed one still ran, on both ranks
    assert (tmp_path / "done_2_0").exists() and (tmp_path / "done_2_1").exists()


REFUSED_APP = """
import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    open("a_rank_ran", "w").close()

if __name__ == "__main__":
    main()
"""


def _numa_binding_can_work() -> bool:
    """Whether torch could bind ranks to their GPU's NUMA node here (then it is not refused)."""
    import shutil

    import torch

    return (
        torch.backends.cuda.is_built()
        and torch.cuda.device_count() > 0
        and shutil.which("numactl") is not None
    )


def _refused_before_any_rank(tmp_path: Path, *overrides: str) -> "subprocess.CompletedProcess[str]":
    """A two-job sweep with `overrides`, which the launcher refuses: no rank has run."""
    app = tmp_path / "app.py"
    app.write_text(REFUSED_APP)
    result = run_app(
        app,
        ["-m", "hydra/launcher=torchrun", *overrides, "+x=1,2"],
        cwd=tmp_path,
        check=False,
        full_error=False,
    )
    assert result.returncode != 0
    assert not (tmp_path / "a_rank_ran").exists()
    return result


@pytest.mark.parametrize(
    "override, key",
    [
        ("hydra.launcher.nproc_per_node=0", "nproc_per_node"),
        ("hydra.launcher.nproc_per_node=abc", "nproc_per_node"),
        ("hydra.launcher.start_method=thread", "start_method"),
        ("hydra.launcher.max_restarts=-1", "max_restarts"),
        ("hydra.launcher.nnodes='2:1'", "nnodes"),
        ("hydra.launcher.redirects='9'", "redirects"),
        # refused here, not job by job by torch, nor silently dropped
        ("hydra.launcher.rdzv_backend=etcd3", "rdzv_backend"),
        ("hydra.launcher.logs_specs=nope", "logs_specs"),
        ("hydra.launcher.signals_to_handle='SIGTERM,SIGTERN'", "signals_to_handle"),
        # a program that is not there: not a bare FileNotFoundError in every rank
        ("hydra.launcher.launch_prefix=[no_such_program_xyz]", "launch_prefix"),
        # no CUDA torch, GPU or numactl: not "Torch not compiled with CUDA enabled" in every rank
        pytest.param(
            "hydra.launcher.numa_binding=node",
            "numa_binding",
            marks=pytest.mark.skipif(
                _numa_binding_can_work(), reason="this machine can bind ranks to NUMA nodes"
            ),
        ),
        # past the last node of a static rendezvous: not a wait for a world that never forms
        (
            "hydra.launcher.nnodes=2 hydra.launcher.node_rank=5 hydra.launcher.rdzv_backend=static "
            "hydra.launcher.master_addr=127.0.0.1 hydra.launcher.master_port=29977",
            "node_rank",
        ),
    ],
)
def test_invalid_settings_are_refused_before_any_rank_starts(tmp_path: Path, override: str, key: str) -> None:
    result = _refused_before_any_rank(tmp_path, *override.split())
    # one line naming the key, then Hydra's hint on how to see the full trace
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) <= 3, result.stderr
    assert f"hydra.launcher.{key}" in lines[0] or f"'{key}'" in lines[0], result.stderr


def test_an_unknown_key_is_refused_in_the_launchers_own_line(tmp_path: Path) -> None:
    """The launcher's message, not Python's (a TypeError or KeyError would name the key too):
    which job, which key, and the keys there are."""
    from dataclasses import fields

    from hydra_plugins.hydra_torchrun_launcher.config import TorchrunLauncherConf

    result = _refused_before_any_rank(tmp_path, "+hydra.launcher.no_such_key=1")
    keys = ", ".join(sorted(f.name for f in fields(TorchrunLauncherConf) if not f.name.startswith("_")))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # then Hydra's hint on how to see the whole trace, which Hydra 1.4 leaves out for a short error
    hint = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
    assert [line for line in lines if line != hint] == [
        f"job #0 (+x=1): hydra.launcher.no_such_key is not a key of the torchrun launcher (keys: {keys})",
    ], result.stderr


@pytest.mark.parametrize(
    "key, override, value",
    [
        ("virtual_local_rank", "true", True),
        ("numa_binding", "node", "node"),
        ("event_log_handler", "console", "console"),
        ("duplicate_stdout_filters", "[loss]", ["loss"]),
        ("duplicate_stderr_filters", "[loss]", ["loss"]),
        ("signals_to_handle", "SIGTERM", "SIGTERM"),
        ("shutdown_timeout", "7", 7),
        ("log_line_prefix_template", "'[{rank}]'", "[{rank}]"),
    ],
)
def test_a_key_the_installed_torch_cannot_honour_is_refused_by_name(
    tmp_path: Path, key: str, override: str, value: Any
) -> None:
    """On a torch whose LaunchConfig lacks the key's field (each older release lacks some),
    setting the key is refused, naming it and that torch, before any rank starts: never
    dropped in silence. Where the installed torch honours the key there is nothing to refuse."""
    import torch

    from hydra_plugins.hydra_torchrun_launcher._job.launch_config import _FIELD_OF_KEY, honoured_fields

    if _FIELD_OF_KEY[key] in honoured_fields():
        pytest.skip(f"torch {torch.__version__} honours hydra.launcher.{key}")
    result = _refused_before_any_rank(tmp_path, f"hydra.launcher.{key}={override}")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0] == (
        f"job #0 (+x=1): hydra.launcher.{key}={value!r} is not supported by the installed torch "
        f"{torch.__version__}; leave it at its default or upgrade torch"
    ), result.stderr


def test_return_value_that_cannot_be_pickled_fails_only_its_job(
    hydra_sweep_runner: TSweepRunner, tmp_path: Path
) -> None:
    def task(cfg: DictConfig) -> Any:
        Path(cfg.marker_dir, f"ran_{cfg.x}").touch()
        return threading.Lock() if cfg.x == 1 else "fine"

    with pytest.raises(JobFailedError, match=r"return value \(lock\) cannot be pickled"):
        sweep(hydra_sweep_runner, task, ["+x=1,2", f"+marker_dir={tmp_path}"], tmp_path / "sweep")
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_1", "ran_2"]


WHITELIST_APP = """
import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig


@hydra.main(config_path=None, execution_whitelist=["fractions.Fraction"])
def main(cfg: DictConfig) -> None:
    assert instantiate({"_target_": "fractions.Fraction", "numerator": 1}) == 1
    try:
        instantiate({"_target_": "decimal.Decimal", "value": "1"})
    except Exception as e:
        print(f"REFUSED {type(e).__name__}")
    else:
        print("ALLOWED")


if __name__ == "__main__":
    main()
"""


def test_ranks_check_instantiate_targets_as_hydras_run_job_does(tmp_path: Path) -> None:
    """Hydra 1.4's `@hydra.main(execution_whitelist=...)` holds in every rank, as in Hydra's launchers."""
    import hydra.utils

    if not hasattr(hydra.utils, "execution_whitelist"):
        pytest.skip("this Hydra (< 1.4) has no execution whitelist")
    app = tmp_path / "app.py"
    app.write_text(WHITELIST_APP)
    # spawn: ranks that share no memory with the job's process, where run_job set the whitelist
    overrides = [
        "hydra/launcher=torchrun",
        "hydra.launcher.nproc_per_node=2",
        "hydra.launcher.start_method=spawn",
        f"hydra.sweep.dir={tmp_path}",
    ]
    result = run_app(app, ["-m", *overrides], cwd=tmp_path)
    assert result.stdout.count("REFUSED InstantiationException") == 2, result.stdout
    assert "ALLOWED" not in result.stdout, result.stdout
