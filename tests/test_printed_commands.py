"""The commands a user is shown are the ones to run: torchrun_ssh's dry run names the hosts'
interpreter, a job dir's rerun.sh runs as `./rerun.sh` for whom the umask lets read it
(real processes, the app written into tmp_path)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_ssh import ssh_dry_run

pytestmark = pytest.mark.timeout(600)

APP = """
import hydra

VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}


@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def main(cfg):
    return cfg.x


if __name__ == "__main__":
    main()
"""


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    target = tmp_path / "app"
    target.mkdir()
    (target / "app.py").write_text(APP)
    (target / "config.yaml").write_text("x: 0\n")
    return target


def test_the_ssh_dry_run_s_torchrun_line_runs_the_hosts_python_under_a_launch_prefix(app_dir: Path) -> None:
    """`hydra/launcher=torchrun_ssh hydra.launcher.python=/opt/envs/train/bin/python
    hydra.launcher.launch_prefix=[nice]`, dry run: each job's `torchrun: on its host: ...`
    line is `... --no-python nice <the head's sys.executable> app.py ...`, an interpreter
    path of this machine that the host may not have (the reason to set `python`); rerun.sh's
    header has the same line. The agent line rightly names /opt/envs/train/bin/python, and the
    host's ranks run under that agent's interpreter. Expected: the host's torchrun line names
    the interpreter the host runs, `hydra.launcher.python`."""
    host_python = "/opt/envs/train/bin/python"
    output = ssh_dry_run(
        app_dir, f"hydra.launcher.python={host_python}", "hydra.launcher.launch_prefix=[nice]", "x=1"
    )
    agent = next(line for line in output.splitlines() if "each host's agent:" in line)
    assert host_python in agent, agent
    line = next(line for line in output.splitlines() if "torchrun:" in line)
    words = shlex.split(line.split("torchrun:", 1)[1].split(":", 1)[1])
    after_prefix = words[words.index("nice") + 1]
    assert after_prefix == host_python, (after_prefix, line)
    assert sys.executable not in words, line


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_rerun_sh_is_executable_by_whom_the_umask_lets_read_it(app_dir: Path, umask: int) -> None:
    """Under `umask 002` (a group's shared sweep dir) every file and dir of the sweep is
    group-writable (664/775) as Hydra's own, but `<job dir>/rerun.sh` is 764: the group
    can read and write it but not run `./rerun.sh`; under 022 it is 744. Expected: the
    mode `chmod +x` gives under that umask (775, 755), as the user's own executable."""
    result = subprocess.run(
        [sys.executable, "app.py", "--multirun", "hydra/launcher=torchrun", "hydra.sweep.dir=sweep", "x=1"],
        cwd=app_dir,
        capture_output=True,
        text=True,
        timeout=240,
        preexec_fn=lambda: os.umask(umask),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    job_dir = app_dir / "sweep" / "0"
    assert (job_dir / ".hydra" / "config.yaml").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (job_dir / "rerun.sh").stat().st_mode & 0o777 == 0o777 & ~umask, oct(
        (job_dir / "rerun.sh").stat().st_mode
    )
