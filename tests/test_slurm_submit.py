"""`hydra/launcher=torchrun_slurm` on a real SLURM cluster: four compute nodes on this machine.

The sweep is started on the host, outside every node, as a user starts it on a login node:
each job becomes a SLURM job of its own, its ranks run on the nodes SLURM gives it. The
tests read what a user reads: the launcher's console, the sweep's files, `squeue`. They
skip where a cluster cannot run (not root, no SLURM) and fail there under REQUIRE_SLURM=1.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List

import pytest

from tests.conftest import kill_tree
from tests.slurm_cluster import SlurmCluster, skip_or_fail, unavailable

APP_DIR = Path(__file__).parent / "submit_app"
SWEEP_TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    skip_or_fail(unavailable())
    with SlurmCluster(tmp_path_factory.mktemp("cluster"), nodes=4) as running:
        yield running


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    target = tmp_path / "app"
    shutil.copytree(APP_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def _command(*overrides: str) -> List[str]:
    return [
        sys.executable,
        "app.py",
        "--multirun",
        "hydra/launcher=torchrun_slurm",
        "hydra.sweep.dir=sweep",
        *overrides,
    ]


def _sweep(cluster: SlurmCluster, app_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(*overrides),
        cwd=app_dir,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
    )


def _start(cluster: SlurmCluster, app_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        _command(*overrides),
        cwd=app_dir,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _summary(app_dir: Path) -> dict:
    return {
        job["num"]: job for job in json.loads((app_dir / "sweep" / "sweep_summary.json").read_text())["jobs"]
    }


def _queue(cluster: SlurmCluster) -> List[str]:
    shown = cluster.run(["squeue", "--noheader", "--format=%i %T"])
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.split("\n")[:-1]


def _wait_for(predicate, what: str, timeout_s: float = SWEEP_TIMEOUT_S):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        found = predicate()
        if found:
            return found
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.2)


def test_three_two_node_jobs_run_as_slurm_jobs_with_rank_0s_values_in_order(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    result = _sweep(cluster, app_dir, "hydra.launcher.nodes=2", "hydra.launcher.nproc_per_node=2", "x=1,2,3")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(3)] == ["COMPLETED"] * 3, output
    for n in range(3):
        value = jobs[n]["return_value"]
        assert value["x"] == n + 1 and value["world"] == 4, value
        assert len(value["hosts"]) == 2 and set(value["hosts"]) <= set(cluster.nodes), value
    for n in range(3):
        assert f"job #{n} (SLURM job " in output and " started on node" in output, output
        assert (app_dir / "sweep" / str(n) / ".hydra" / "config.yaml").exists()
        assert (app_dir / "sweep" / str(n) / "rerun.sh").exists()
    assert "3 jobs: 3 completed" in output, output
    assert not _queue(cluster)
