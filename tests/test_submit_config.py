"""`hydra/launcher=torchrun_slurm` before anything is submitted: its keys, its refusals and
its dry run, through a real app on any machine (no SLURM needed: nothing reaches sbatch).
What it does on a cluster is tests/test_slurm_submit.py's."""

import shutil
from pathlib import Path
from typing import List

import pytest

from tests.conftest import run_app

APP_DIR = Path(__file__).parent / "submit_app"


@pytest.fixture
def app(tmp_path: Path) -> Path:
    shutil.copytree(APP_DIR, tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "app" / "app.py"


def _sweep(app: Path, *overrides: str, check: bool = True):  # type: ignore[no-untyped-def]
    return run_app(
        app,
        ["-m", "hydra/launcher=torchrun_slurm", "hydra.sweep.dir=sweep", *overrides, "x=1,2"],
        cwd=app.parent,
        check=check,
        full_error=False,
    )


def _scripts(output: str) -> List[str]:
    """Each job array's sbatch script as the dry run prints it."""
    scripts, current = [], None
    for line in output.splitlines():
        if line.startswith("\tsbatch script of "):
            current = []
            scripts.append(current)
        elif current is not None and line.startswith("\t\t"):
            current.append(line[2:])
        else:
            current = None
    return ["\n".join(script) for script in scripts]


def test_the_dry_run_shows_submitits_keys_as_sbatch_directives(app: Path) -> None:
    result = _sweep(
        app,
        "hydra.launcher.dry_run=true",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=4",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.timeout_min=90",
        "hydra.launcher.mem_gb=32",
        "hydra.launcher.gpus_per_node=4",
        "hydra.launcher.signal_delay_s=60",
        "+hydra.launcher.additional_parameters.mail-type=END",
        "hydra.launcher.setup=['module load cuda']",
        "hydra.launcher.srun_args=['--cpu-bind=none']",
        "hydra.launcher.array_parallelism=1",
    )
    output = result.stdout + result.stderr
    scripts = _scripts(output)
    assert len(scripts) == 1, output  # both jobs in one array, as they are submitted
    assert "\tsbatch script of #0, #1:" in output, output
    script = scripts[0]
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in (
        "--job-name=app",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--time=90",
        "--partition=gpu",
        "--gpus-per-node=4",
        "--mem=32G",
        "--mail-type=END",
        "--array=0,1%1",
        "--requeue",
        "--signal=USR2@60",
        "--open-mode=append",
    ):
        assert f"#SBATCH {directive}" in lines, script
    assert lines.index("module load cuda") < len(lines) - 1
    srun = lines[-1]
    assert srun.startswith("exec srun --ntasks-per-node=1 --nodes=2 --kill-on-bad-exit=1 --cpu-bind=none ")
    assert "_submit.node" in srun and srun.endswith(" 60 0"), srun
    assert "ranks:   4 per node x 2 node(s)" in output
    assert not (app.parent / "sweep" / ".slurm").exists()  # nothing written, nothing submitted


def test_each_job_of_a_sweep_is_submitted_with_its_own_sbatch_options(app: Path) -> None:
    # per-job nodes, partition and memory: one array per set of options, each job in its own
    result = _sweep(
        app,
        "hydra.launcher.dry_run=true",
        "hydra.launcher.nodes=${x}",
        "hydra.launcher.partition=part${x}",
        "hydra.launcher.mem_gb=${x}",
    )
    output = result.stdout + result.stderr
    scripts = _scripts(output)
    assert len(scripts) == 2, output
    assert "\tsbatch script of #0:" in output and "\tsbatch script of #1:" in output, output
    for x, script in zip((1, 2), scripts):
        lines = script.splitlines()
        for directive in (f"--nodes={x}", f"--partition=part{x}", f"--mem={x}G", f"--array={x - 1}"):
            assert f"#SBATCH {directive}" in lines, script
        assert lines[-1].startswith(f"exec srun --ntasks-per-node=1 --nodes={x} "), script
    job_0, job_1 = output.split("\t#1 : x=2")
    assert "ranks:   1 per node x 1 node(s)" in job_0 and "ranks:   1 per node x 2 node(s)" in job_1, output


@pytest.mark.parametrize(
    "override, key",
    [
        ("hydra.launcher.nodes=0", "nodes"),
        ("hydra.launcher.timeout_min=0", "timeout_min"),
        ("hydra.launcher.nproc_per_node=0", "nproc_per_node"),
        ("hydra.launcher.start_method=thread", "start_method"),
        # a line break would add directives of its own to the batch script
        ("hydra.launcher.partition='gpu\n#SBATCH --uid=0'", "partition"),
        ("+hydra.launcher.additional_parameters.array=0-9", "additional_parameters.array"),
        ("+hydra.launcher.nnodes=2", "nnodes"),
        ("+hydra.launcher.rdzv_endpoint=host:1", "rdzv_endpoint"),
        ("+hydra.launcher.no_such_key=1", "no_such_key"),
        # the stop notice would come as the job starts
        ("hydra.launcher.timeout_min=2", "signal_delay_s"),
    ],
)
def test_bad_keys_are_refused_in_one_line_naming_the_key(app: Path, override: str, key: str) -> None:
    result = _sweep(app, override, check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) <= 3, result.stderr
    assert f"hydra.launcher.{key}" in lines[0], result.stderr
    assert not (app.parent / "sweep" / ".slurm").exists()


def test_the_dry_run_quotes_values_as_submitit_and_names_every_path_absolutely(app: Path) -> None:
    result = _sweep(
        app,
        "hydra.launcher.dry_run=true",
        "hydra.sweep.dir='a sweep'",
        "hydra.launcher.name='my job'",
        'hydra.launcher.comment="it\'s a $HOME comment"',
        "+hydra.launcher.additional_parameters.exclusive=true",
        "+hydra.launcher.additional_parameters.hold=false",
        "+hydra.launcher.additional_parameters.mail_user=null",
    )
    output = result.stdout + result.stderr
    script = _scripts(output)[0]
    lines = script.splitlines()
    assert "#SBATCH --job-name='my job'" in lines, script
    assert "#SBATCH --comment='it'\"'\"'s a $HOME comment'" in lines, script
    assert "#SBATCH --exclusive" in lines and "hold" not in script and "mail" not in script, script
    absolute = f"{app.parent}/a sweep/.slurm"
    assert f"#SBATCH --output='{absolute}/job%a.%A.out'" in lines, script
    assert f" '{absolute}' " in lines[-1], script


@pytest.mark.parametrize("key", ["tasks_per_node", "submitit_folder"])
def test_a_submitit_key_is_refused_saying_what_to_do_instead(app: Path, key: str) -> None:
    result = _sweep(app, f"+hydra.launcher.{key}=1", check=False)
    assert result.returncode != 0
    line = next(line for line in result.stderr.splitlines() if f"hydra.launcher.{key}" in line)
    assert "hydra/launcher=torchrun_slurm" in line and "drop it" in line, result.stderr


def test_an_unknown_key_is_refused_listing_the_slurm_launchers_own_keys(app: Path) -> None:
    result = _sweep(app, "+hydra.launcher.no_such_key=1", check=False)
    assert result.returncode != 0
    line = next(line for line in result.stderr.splitlines() if "hydra.launcher.no_such_key" in line)
    assert "hydra/launcher=torchrun_slurm" in line, line
    assert "partition" in line and "timeout_min" in line and "master_addr" not in line, line
