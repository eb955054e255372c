"""Each job's config is the one Hydra's `load_sweep_config` composes: job after job of a grid
is made from an earlier job of the same shape (`_launcher.sweep_configs`), and must not differ
from Hydra's own composition in a single line, nor in an error, on every supported Hydra."""

import copy
import os
import subprocess
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List

import hydra
import pytest
import yaml
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import MISSING, OmegaConf, open_dict, read_write

from hydra_plugins.hydra_torchrun_launcher._launcher.resume import config_targets, fingerprint, task_container
from hydra_plugins.hydra_torchrun_launcher._launcher.sweep_configs import SweepConfigs
from hydra_plugins.hydra_torchrun_launcher.config import TorchrunLauncherConf

VERSION_BASE: Dict[str, Any] = (
    {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
)

CONFIG = """\
defaults:
  - model: small
  - opt: sgd
  - _self_
x: 0
lr: 0.1
name: run
nested:
  a: 1
  b: [1, 2]
  c: {d: 4}
interp: ${lr}
maybe: null
"""

GROUPS = {
    "model/small.yaml": "d: 3\nlayers: 2\n",
    "model/big.yaml": "d: 30\nlayers: 20\nextra: true\n",
    "opt/sgd.yaml": "momentum: 0.9\n",
    "opt/adam.yaml": "betas: [0.9, 0.99]\n",
}

# jobs as a sweeper hands them over, several of each shape, errors among them
JOBS: List[List[str]] = [
    ["x=1"],
    ["x=2"],
    ["x=3", "lr=0.5"],
    ["x=4", "lr=0.7"],
    ["x=5", "lr=0.9"],
    ["model=big", "x=1"],
    ["model=big", "x=2"],
    ["model=big", "x=9"],
    ["+new=1"],
    ["+new=2"],
    ["+new=3"],
    ["++lr=0.2"],
    ["++lr=0.3"],
    ["++lr=0.4"],
    ["~maybe"],
    ["~maybe"],
    ["nested.a=5"],
    ["nested.a=6"],
    ["nested.a=7"],
    ["nested.b=[3]"],
    ["nested.b=[4]"],
    ["nested.c={e:1}"],
    ["nested.c={f:2}"],
    ["nested.c={g:3}"],
    ["x=abc"],
    ["x=1"],
    ["interp=${x}"],
    ["interp=${name}"],
    ["interp=${name}"],
    ["name='a b'"],
    ['name="c,d"'],
    ["name=null"],
    ["hydra.job.env_set.FOO=1"],
    ["hydra.job.env_set.FOO=2"],
    ["hydra.job.env_set.FOO=3"],
    ["opt=adam", "x=1"],
    ["opt=adam", "x=2"],
    ["opt=adam", "x=3"],
    ["opt=adam", "model=big", "x=4"],
    ["missing.key=1"],
    ["missing.key=2"],
    ["missing.key=3"],
    ["nested.a.b=1"],
    ["nested.a.b=2"],
    ["x=1", "x=2"],
    ["x=3", "x=4"],
    ["x=5", "x=6"],
    ["hydra.launcher.nproc_per_node=2", "x=1"],
    ["hydra.launcher.nproc_per_node=2", "x=2"],
    ["hydra.launcher.nproc_per_node=3", "x=3"],
    ["hydra.sweep.subdir=a"],
    ["hydra.sweep.subdir=b"],
    ["hydra.sweep.subdir=c"],
    ["x=7"],
    ["x=8"],
    ["x=9"],
]


def _composed(config: Any) -> str:
    try:
        return OmegaConf.to_yaml(config(), resolve=False)
    except Exception as e:  # the error is part of what must be the same
        return f"{type(e).__name__}: {e}"


def _run_job_task_cfg(config: Any) -> Any:
    """The task's config as Hydra's run_job makes it: a copy of the job's, `hydra` deleted."""
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    return task_cfg


def _task_text(task_cfg: Any) -> str:
    """What the job's fingerprint reads of its task config (`_launcher.resume.fingerprint`)."""
    return fingerprint("task", task_cfg, TorchrunLauncherConf(), {}).split("-")[1]


class Colour(Enum):
    RED = 1
    BLUE = 2


@dataclass
class Schema:
    colour: Colour = Colour.BLUE
    where: Path = Path("out")
    needed: int = MISSING
    twice: int = "${needed}"  # type: ignore[assignment]
    items: List[Any] = field(default_factory=lambda: [1, "${twice}", {"_target_": "pkg.mod.Cls"}])


@pytest.mark.parametrize(
    "config",
    [
        lambda: OmegaConf.structured(Schema),
        lambda: OmegaConf.merge(OmegaConf.structured(Schema), {"colour": "RED", "needed": 3}),
        lambda: OmegaConf.create(
            {"a": r"\${not_an_interpolation}", "b": "${oc.env:HOME}", "c": None, "d": 1e-3}
        ),
        lambda: OmegaConf.create(
            {"model": {"_target_": "models.Net", "layers": [{"_target_": "torch.nn.ReLU"}]}}
        ),
    ],
    ids=["structured", "structured-merged", "escaped-env-none-float", "targets"],
)
def test_a_jobs_fingerprint_reads_its_task_config_as_run_job_makes_it(config: Any) -> None:
    """The launcher fingerprints a job from its config without copying it whole
    (`task_container`): the text, and the `_target_`s, are those of the copy run_job makes."""
    merged = config()
    with open_dict(merged):  # as Hydra adds its node to the app's config
        merged.hydra = {"job": {"name": "app"}}
    expected = _run_job_task_cfg(merged)
    assert _task_text(task_container(merged)) == _task_text(expected)
    assert config_targets(task_container(merged)) == config_targets(
        OmegaConf.to_container(expected, resolve=False)  # type: ignore[arg-type]
    )


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(CONFIG)
    for name, text in GROUPS.items():
        (tmp_path / "conf" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "conf" / name).write_text(text)
    return tmp_path / "conf"


@pytest.mark.parametrize(
    "sweep_overrides",
    [[], ["hydra.job.config.override_dirname.exclude_keys=[lr]", "hydra.job.env_copy=[HOME]"]],
    ids=["defaults", "override_dirname-and-env_copy"],
)
def test_every_job_is_composed_as_hydra_composes_it(config_dir: Path, sweep_overrides: List[str]) -> None:
    with initialize_config_dir(**VERSION_BASE, config_dir=str(config_dir)):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration(
            "config", overrides=["hydra/launcher=torchrun", *sweep_overrides], run_mode=RunMode.MULTIRUN
        )
        HydraConfig.instance().set_config(master)
        composed_by_hydra = 0
        load_sweep_config = loader.load_sweep_config

        def counted(master_config: Any, overrides: List[str]) -> Any:
            nonlocal composed_by_hydra
            composed_by_hydra += 1
            return load_sweep_config(master_config, overrides)

        configs = SweepConfigs(loader, master)
        configs.loader = type("Counted", (), {"load_sweep_config": staticmethod(counted)})()
        for job in JOBS:
            expected = _composed(lambda job=job: load_sweep_config(master, job))
            made: List[Any] = []
            assert (
                _composed(lambda job=job, made=made: made.append(configs.compose(job)) or made[0]) == expected
            ), job
            if made:  # and its fingerprint reads the task config run_job would give the task
                assert _task_text(task_container(made[0])) == _task_text(
                    _run_job_task_cfg(load_sweep_config(master, job))
                ), job
        assert configs.usable
    # most jobs came from a reference (here about 60 of 100 compositions are Hydra's: the
    # shapes are many and short; a grid has one or a few)
    assert composed_by_hydra < 0.75 * len(JOBS), composed_by_hydra


APP = """
import hydra
from hydra.core.hydra_config import HydraConfig

VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}


@hydra.main(**VERSION_BASE, config_path="conf", config_name="config")
def main(cfg):
    return HydraConfig.get().job.override_dirname


if __name__ == "__main__":
    main()
"""


def _job_files(sweep: Path) -> Dict[str, Dict[str, Any]]:
    jobs = {}
    for job_dir in sorted(p for p in sweep.iterdir() if (p / ".hydra").is_dir()):
        hydra_yaml = yaml.safe_load((job_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
        jobs[job_dir.name] = {
            "config": (job_dir / ".hydra" / "config.yaml").read_text(),
            "overrides": (job_dir / ".hydra" / "overrides.yaml").read_text(),
            "override_dirname": hydra_yaml["job"]["override_dirname"],
            "choices": {k: v for k, v in hydra_yaml["runtime"]["choices"].items() if k != "hydra/launcher"},
        }
    return jobs


@pytest.mark.timeout(600)
def test_a_grid_writes_the_job_files_hydras_basic_launcher_writes(config_dir: Path) -> None:
    """What a user reads in each job's .hydra/: the same under this launcher as under Hydra's
    basic launcher, for a grid over a config group and values, with Hydra's own sweeper."""
    app_dir = config_dir.parent
    (app_dir / "app.py").write_text(APP)
    sweep = ["model=small,big", "x=1,2,3", "+tag=a,b", "hydra.job.config.override_dirname.exclude_keys=[tag]"]
    files = {}
    for launcher in ("basic", "torchrun"):
        result = subprocess.run(
            [
                sys.executable,
                "app.py",
                "--multirun",
                f"hydra/launcher={launcher}",
                f"hydra.sweep.dir={launcher}",
                *sweep,
            ],
            cwd=app_dir,
            capture_output=True,
            text=True,
            timeout=500,
            env={**os.environ, "HYDRA_FULL_ERROR": "1"},
        )
        assert result.returncode == 0, result.stdout + result.stderr
        files[launcher] = _job_files(app_dir / launcher)
    assert len(files["basic"]) == 12
    assert files["torchrun"] == files["basic"]
