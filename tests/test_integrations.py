"""The launcher under other Hydra plugins and training frameworks, run as users run them.

- Hydra's Optuna sweeper asks for trials in batches (so the launcher is called with
  initial_job_idx > 0) and learns from each job's return value, which must be rank 0's.
- PyTorch Lightning's DDP joins the world the launcher made and starts no process of its own.

Both packages are optional (the `test` extra installs them); without them the tests skip.
"""

import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from tests.conftest import assert_gone, run_app

APPS = Path(__file__).resolve().parent / "integration_apps"
MP_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker", "_server.server")


def requires(module: str, requirement: str) -> None:
    """Skip unless `module` is installed. Not imported here: importing optuna 2.x warns
    (SQLAlchemy 2 deprecations, errors under this suite's filterwarnings) and importing
    lightning costs seconds; the apps import them in their own processes."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {requirement} (pip install '{requirement}')")


def read_json(path: Path) -> Dict[str, Any]:
    return json.loads(path.read_text())


def job_dirs(sweep_dir: Path) -> List[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


N_TRIALS = 5
N_JOBS = 2


@pytest.mark.timeout(300)
def test_optuna_sweeper_learns_rank0_values(tmp_path: Path) -> None:
    requires("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper")
    sweep_dir = tmp_path / "sweep"
    result = run_app(
        APPS / "optuna_app.py",
        [
            "--multirun",
            "hydra/sweeper=optuna",
            "hydra/sweeper/sampler=tpe",
            "hydra.sweeper.sampler.seed=123",
            f"hydra.sweeper.n_trials={N_TRIALS}",
            f"hydra.sweeper.n_jobs={N_JOBS}",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "x=interval(-5.0, 5.0)",
            "+hydra.callbacks.record._target_=__main__.RecordReturn",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr

    # the sweeper called the launcher with batches of 2, 2, 1 jobs, numbered on from batch to batch
    assert re.findall(r"Launching (\d+) jobs? with torchrun", output) == ["2", "2", "1"], output
    assert [int(n) for n in re.findall(r"\[HYDRA\] \t#(\d+) : x=", output)] == list(range(N_TRIALS)), output
    dirs = job_dirs(sweep_dir)
    assert [d.name for d in dirs] == [str(n) for n in range(N_TRIALS)]

    rank0_values = []
    xs = []
    for num, job_dir in enumerate(dirs):
        hydra_yaml = yaml.safe_load((job_dir / ".hydra" / "hydra.yaml").read_text())
        assert hydra_yaml["hydra"]["job"]["num"] == num
        (override,) = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())
        x = float(override.removeprefix("x="))
        rank0 = read_json(job_dir / "rank0.json")
        rank1 = read_json(job_dir / "rank1.json")
        # both ranks ran this job's config, in a real 2-rank world
        assert (rank0["job_num"], rank1["job_num"]) == (num, num)
        assert (rank0["x"], rank1["x"]) == (x, x)
        assert (rank0["world"], rank1["world"]) == (2.0, 2.0)
        assert rank0["value"] == (x - 2.0) ** 2 + 2.0
        assert rank1["value"] != rank0["value"]
        # what the sweeper got for this trial (recorded by a callback in the launching process)
        job_return = read_json(job_dir / "job_return.json")
        assert job_return["status"] == "COMPLETED"
        assert job_return["job_num"] == num
        assert job_return["return_value"] == rank0["value"]
        assert job_return["pid"] not in (rank0["pid"], rank1["pid"])
        rank0_values.append(rank0["value"])
        xs.append(x)
        assert_gone([rank0["pid"], rank1["pid"]])
    assert len(set(xs)) == N_TRIALS  # the sampler proposed a new point every trial

    # the study's result is rank 0's best; had rank 1's values counted, it would be below -990
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = min(range(N_TRIALS), key=lambda i: rank0_values[i])
    assert results["name"] == "optuna"
    assert results["best_value"] == rank0_values[best]
    assert results["best_params"] == {"x": xs[best]}


@pytest.mark.timeout(300)
def test_lightning_ddp_uses_the_launchers_ranks(tmp_path: Path) -> None:
    requires("lightning", "lightning==2.6.6")
    sweep_dir = tmp_path / "sweep"
    run_app(
        APPS / "lightning_app.py",
        [
            "--multirun",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
    )
    assert [d.name for d in job_dirs(sweep_dir)] == ["0"]
    records = [read_json(sweep_dir / "0" / f"rank{rank}.json") for rank in range(2)]

    for rank, rec in enumerate(records):
        # Lightning's ranks are the launcher's
        assert (rec["env_rank"], rec["global_rank"]) == (rank, rank)
        assert (rec["env_local_rank"], rec["local_rank"]) == (rank, rank)
        assert rec["world_size"] == rec["process_group_world"] == 2
        assert rec["strategy"] == "DDPStrategy"
        assert rec["cluster_environment"] == "TorchElasticEnvironment"
        assert rec["creates_processes_externally"] is True
        assert rec["strategy_launcher_procs"] == 0, "Lightning started scripts of its own"
        # Lightning (preloaded by the warm server) knows the rank before any Trainer exists
        assert rec["rank_zero_only_before_trainer"] == rank
        # it trained
        assert rec["last_epoch_loss"] < rec["first_epoch_loss"] / 2, rec["losses"]
        assert rec["train_loss_metric"] > 0
    # one DDP world: each rank trained on a shard of its own, and the weights stayed in sync
    assert records[0]["losses"] != records[1]["losses"]
    assert records[0]["weights"] == records[1]["weights"]
    assert records[0]["train_loss_metric"] == records[1]["train_loss_metric"]

    # no process beyond the launcher's: exactly 2 ranks (siblings, forked by their job's
    # forkserver, which its job process forked, which the warm server forked), no child of
    # any rank, and no second copy of the app anywhere
    rank_pids = {rec["tree_while_training"]["pid"] for rec in records}
    assert len(rank_pids) == 2
    for rec in records:
        tree = rec["tree_while_training"]
        assert tree["children"] == [] and rec["children_after_fit"] == []
        under_launcher = {p["pid"]: p for p in tree["under_launcher"]}
        assert rank_pids <= set(under_launcher)
        others = [p for pid, p in under_launcher.items() if pid not in rank_pids]
        assert all(any(h in " ".join(p["cmdline"]) for h in MP_HELPERS) for p in others), others
        job_forkserver = under_launcher[tree["ppid"]]
        job_process = under_launcher[job_forkserver["ppid"]]
        warm_server = under_launcher[job_process["ppid"]]
        assert all(
            "_server.server" in " ".join(p["cmdline"]) for p in (job_forkserver, job_process, warm_server)
        )
        assert warm_server["ppid"] == tree["launcher"]["pid"]
    assert len({rec["tree_while_training"]["ppid"] for rec in records}) == 1
    assert len({rec["tree_while_training"]["launcher"]["pid"] for rec in records}) == 1
    assert_gone(rank_pids)
