"""A sweep's record a user can trust, and reruns that reproduce a job, safely.

The apps are copied where a user would have them (a path with `ó`, `~` and a space) and
run as a user runs them: a second command in the same sweep dir, another umask, a moved
sweep dir, a second launcher at once, `bash rerun.sh`, the printed torchrun line. The tests
read what the user reads: the console, `sweep_summary.json`, the job dirs.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import psutil
import pytest

from tests.conftest import assert_gone, wait_for

CONSOLE_APP = Path(__file__).parent / "console_app"
PREEMPT_APP = Path(__file__).parent / "preempt_app"

pytestmark = pytest.mark.timeout(600)


def _install(tmp_path: Path, app: Path = CONSOLE_APP) -> Path:
    """The app in a dir whose path Hydra's override grammar and a shell both have to quote."""
    app_dir = tmp_path / "józef~ó dir" / "app"
    shutil.copytree(app, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return app_dir


def _env(**extra: str) -> "dict[str, str]":
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env.pop("HYDRA_FULL_ERROR", None)
    # torchrun, as a user's activated venv has it
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _run(app_dir: Path, *args: str, umask: "int | None" = None, **env: str) -> subprocess.CompletedProcess:
    """`python app.py ARGS` from the app's dir, stdout and stderr in one stream."""

    def set_umask() -> None:
        if umask is not None:
            os.umask(umask)

    return subprocess.run(
        [sys.executable, "app.py", *args],
        cwd=app_dir,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        preexec_fn=set_umask,
    )


def _summary(sweep_dir: Path) -> List[dict]:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]


def test_rerun_sh_and_the_torchrun_line_reproduce_the_job_and_run_no_config_value(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    pwned = tmp_path / "PWNED"
    note = f'+note="x\ntouch {pwned} #"'
    # a config that sets hydra.mode=MULTIRUN, chosen by --config-name; a value with a newline
    result = _run(app_dir, "--config-name", "single", "hydra.sweep.dir=sweep", "lr=0.5", note)
    assert result.returncode == 0, result.stdout
    job_dir = app_dir / "sweep" / "0"
    script = job_dir / "rerun.sh"
    text = script.read_text()
    # every line of the header is a comment: the newline is shown, not obeyed
    header = text.split("set -euo pipefail")[0].splitlines()
    assert all(line.startswith("#") for line in header), text
    assert "x\\ntouch" in text, text

    rerun = subprocess.run(["bash", str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert not pwned.exists(), "rerun.sh ran a command from a config value"
    (rerun_dir,) = job_dir.glob("rerun_*")
    hydra_yaml = (rerun_dir / "0" / ".hydra" / "hydra.yaml").read_text()
    assert "config_name: single" in hydra_yaml, hydra_yaml
    assert (rerun_dir / "0" / "rank1.txt").read_text() == "2 job0 0.5\n"
    note_value = (rerun_dir / "0" / ".hydra" / "config.yaml").read_text()
    assert "touch" in note_value, note_value  # the value itself reached the task, as data

    # the plain torchrun line of the header: Hydra's run mode in every rank, the same config
    line = next(line for line in header if "torchrun --nnodes" in line)
    command = shlex.split(line.lstrip("# "))
    assert "--config-name=single" in command and "hydra.mode=RUN" in command, command
    for rank in (0, 1):
        (job_dir / f"rank{rank}.txt").unlink()
    torchrun = subprocess.run(
        [c.replace("\\n", "\n") for c in command],
        cwd=app_dir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert torchrun.returncode == 0, torchrun.stdout + torchrun.stderr
    assert not pwned.exists()
    for rank in (0, 1):
        assert (job_dir / f"rank{rank}.txt").read_text() == "2 job0 0.5\n"
    # no nested sweep started in the job dir
    assert not list(job_dir.glob("*/rank0.txt")), list(job_dir.iterdir())
