"""Sweeps on a real SLURM cluster: two compute nodes on this machine (`slurm_cluster`).

A batch job starts one launcher per node with `srun`, as the README's recipe does; the
launchers take nnodes, the node rank and the rendezvous from SLURM and run every sweep
job across both nodes. The tests read what a user reads: the job's output file, the
nodes' job dirs, what SLURM says of the job. They skip, saying why (`-rs`), where a cluster
cannot run (not root, SLURM not installed); CI installs SLURM, sets REQUIRE_SLURM=1 (a
cluster that cannot run there fails them) and runs them. The requeue round trip's figure
comes from `benchmarks/slurm_requeue.py`.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator

import pytest

from tests.slurm_cluster import SlurmCluster, skip_or_fail, unavailable

APP_DIR = Path(__file__).parent / "multinode_apps"
PREEMPT_APP_DIR = Path(__file__).parent / "preempt_app"
JOB_TIMEOUT_S = 180

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    skip_or_fail(unavailable())  # every test here uses the cluster
    with SlurmCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


def _install(tmp_path: Path, source: Path = APP_DIR) -> Path:
    app_dir = tmp_path / "app"
    shutil.copytree(source, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return app_dir


def _batch(cluster: SlurmCluster, app_dir: Path, script: str, *options: str) -> Dict[str, str]:
    """Submit `script` with `options`, wait until SLURM ends it; the job's final record."""
    return _ended(cluster, app_dir, _submit(cluster, app_dir, script, *options))


def _submit(cluster: SlurmCluster, app_dir: Path, script: str, *options: str) -> str:
    """Submit `script` with `options`; the job's id."""
    (app_dir / "job.sh").write_text("#!/bin/bash\n" + script)
    submitted = cluster.run(
        [
            "sbatch",
            "--parsable",
            f"--chdir={app_dir}",
            f"--output={app_dir}/slurm-%j.out",
            *options,
            "job.sh",
        ],
        cwd=app_dir,
    )
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def _ended(cluster: SlurmCluster, app_dir: Path, job_id: str) -> Dict[str, str]:
    """Wait until SLURM ends the job (a requeued one runs again first); its final record."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        shown = cluster.run(["scontrol", "show", "job", "-o", job_id]).stdout
        record = dict(re.findall(r"(\w+)=(\S*)", shown))
        if record.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            record["output"] = (app_dir / f"slurm-{job_id}.out").read_text()
            return record
        assert time.monotonic() < deadline, f"SLURM job {job_id} still {record.get('JobState')}"
        time.sleep(0.2)


def _sweep(*overrides: str, app: str = "node_app.py") -> str:
    command = [
        sys.executable,
        app,
        "--multirun",
        "hydra/launcher=torchrun",
        "hydra.launcher.nproc_per_node=2",
        # one sweep dir per node: two hosts would have two disks
        "hydra.sweep.dir=multirun/${oc.env:SLURM_JOB_ID}/node${oc.env:SLURM_NODEID}",
        *overrides,
    ]
    return shlex.join(command)


@pytest.fixture
def busy_machine() -> Iterator[None]:
    """Both cores busy with other work, as on a shared node: one node's agent is then often
    a moment behind the other's at the end of a job, which is when a store's host that left
    first would break the other node's exit."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(5))
        for _ in range(2)
    ]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def test_a_batch_job_sweeps_across_two_nodes_and_ends_cleanly(
    cluster: SlurmCluster, tmp_path: Path, busy_machine: None
) -> None:
    app_dir = _install(tmp_path)
    # six jobs: a store's host that left first would show on some of them
    job = _batch(cluster, app_dir, f"srun {_sweep('+x=0,1,2,3,4,5')}\n", "--nodes=2", "--ntasks-per-node=1")
    output = job["output"]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output
    for node in (0, 1):
        assert f"this is node {node} (node{node + 1}); using nnodes=2, node_rank={node}" in output, output
        summary = json.loads(
            (app_dir / "multirun" / job["JobId"] / f"node{node}/sweep_summary.json").read_text()
        )
        assert [j["status"] for j in summary["jobs"]] == ["COMPLETED"] * 6, summary
    for num in range(6):
        ranks = {}
        for node in (0, 1):
            for path in (app_dir / "multirun" / job["JobId"] / f"node{node}" / str(num) / "ranks").glob(
                "*.json"
            ):
                ranks[path.name] = json.loads(path.read_text())
        # one world of 4 ranks per job, 2 on each node, every rank with this job's x
        assert sorted(ranks) == [f"rank{r}.json" for r in range(4)], (num, sorted(ranks))
        assert {r["env"]["WORLD_SIZE"] for r in ranks.values()} == {"4"}
        assert {r["env"]["GROUP_RANK"] for r in ranks.values()} == {"0", "1"}
        assert all(r["xs"] == [num] * 4 and r["allreduce"] == 10.0 for r in ranks.values())
    # every job ends on both nodes without torch's rendezvous errors (the store's host leaves last)
    for noise in (
        "frame #",
        "Traceback",
        "Error waiting on exit barrier",
        "failed to shutdown the rendezvous",
    ):
        assert noise not in output, output


def test_more_than_one_task_per_node_is_refused_with_one_line(cluster: SlurmCluster, tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    job = _batch(cluster, app_dir, f"srun {_sweep('+x=0')}\n", "--nodes=2", "--ntasks-per-node=2")
    output = job["output"]
    assert job["JobState"] == "FAILED", output
    assert "this srun step runs more than one task per node" in output, output
    assert "srun --ntasks-per-node=1" in output and "Traceback" not in output, output
    assert not list((app_dir / "multirun").glob("*/*/0/ranks")), "a rank started"


def test_a_launcher_in_an_allocation_without_a_step_runs_on_its_own_node(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    # the batch script itself (as in an salloc shell): SLURM_JOB_* set, no srun step
    app_dir = _install(tmp_path)
    job = _batch(cluster, app_dir, f"{_sweep('+x=0')}\n", "--nodes=2", "--ntasks-per-node=1")
    output = job["output"]
    assert job["JobState"] == "COMPLETED", output
    ranks = list((app_dir / "multirun").glob("*/*/0/ranks/rank*.json"))
    assert sorted(p.name for p in ranks) == ["rank0.json", "rank1.json"], output
    assert {json.loads(p.read_text())["env"]["WORLD_SIZE"] for p in ranks} == {"2"}


def test_a_preempted_batch_job_stops_on_every_rank_requeues_and_resumes(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    app_dir = _install(tmp_path, PREEMPT_APP_DIR)
    # the checkpoint where every node reads it (one machine here; a shared disk on a cluster)
    sweep = _sweep(
        "lr=0.1,0.2,0.3",
        "steps=8",
        "step_s=0.3",
        "checkpoint=${hydra:runtime.cwd}/checkpoint_${hydra:job.num}.json",
        app="app.py",
    )
    options = ("--nodes=2", "--ntasks-per-node=1", "--open-mode=append")
    job_id = _submit(cluster, app_dir, f"srun {sweep}\n", *options)
    output_file = app_dir / f"slurm-{job_id}.out"

    def job_1_at_step_2() -> bool:
        text = output_file.read_text() if output_file.exists() else ""
        return "rank 0: step 2" in text[text.find("#1 : lr=0.2") :] if "#1 : lr=0.2" in text else False

    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not job_1_at_step_2():
        assert time.monotonic() < deadline, output_file.read_text() if output_file.exists() else "no output"
        time.sleep(0.1)
    # what SLURM's --signal=USR2@T does at T seconds before the end: USR2 to every task
    assert cluster.run(["scancel", "--signal=USR2", job_id]).returncode == 0
    job = _ended(cluster, app_dir, job_id)
    output = job["output"]
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", output
    first, second = output.split("is requeued", 1)

    # the first run: all 4 ranks stopped after one step, rank 0 checkpointed, node 0 requeued
    stops = re.findall(r"^\[default\d\]:rank (\d): stopping after step (\d+)$", first, re.M)
    assert sorted(rank for rank, _ in stops) == ["0", "1", "2", "3"], first
    assert len({step for _, step in stops}) == 1, first
    stopped_at = int(stops[0][1])
    assert f"SLURM job {job_id} is requeued" in output, output
    assert "#2 : lr=0.3" not in first and "#1 : lr=0.2" in first, first

    # the requeued run: job 0 from the record, job 1 from its checkpoint on all ranks, job 2 runs
    assert re.search(r"#0 : lr=0.1 .* : COMPLETED in an earlier run", second), second
    for rank in range(4):
        assert f"rank {rank}: resumed at step {stopped_at}" in second, second
    assert second.count(f"done, 8 steps from {stopped_at}") == 4, second
    assert second.count("done, 8 steps from 0") == 4, second  # job 2
    for node in (0, 1):
        summary = json.loads((app_dir / "multirun" / job_id / f"node{node}/sweep_summary.json").read_text())
        assert [j["status"] for j in summary["jobs"]] == ["COMPLETED"] * 3, summary
        assert summary["jobs"][1]["return_value"]["from"] == stopped_at, summary
    for noise in ("frame #", "Traceback", "Error waiting on exit barrier"):
        assert noise not in output, output


def test_a_preempted_job_submitted_no_requeue_says_so_and_loses_nothing(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    app_dir = _install(tmp_path, PREEMPT_APP_DIR)
    sweep = _sweep("lr=0.1,0.2", "steps=50", "step_s=0.2", app="app.py")
    job_id = _submit(cluster, app_dir, f"srun {sweep}\n", "--nodes=2", "--ntasks-per-node=1", "--no-requeue")
    output_file = app_dir / f"slurm-{job_id}.out"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while "rank 0: step 2" not in (output_file.read_text() if output_file.exists() else ""):
        assert time.monotonic() < deadline, output_file.read_text() if output_file.exists() else "no output"
        time.sleep(0.1)
    assert cluster.run(["scancel", "--signal=USR2", job_id]).returncode == 0
    job = _ended(cluster, app_dir, job_id)
    output = job["output"]
    assert job["JobState"] == "FAILED" and job["Restarts"] == "0", output
    assert (
        f"SLURM job {job_id} was not requeued: it was submitted with --no-requeue "
        "(hydra.launcher.requeue=auto); submit it again with the same hydra.sweep.dir to resume"
    ) in output, output
    assert "Traceback" not in output, output
    # nothing lost: each node's record says job 0 is preempted (it continues in its job dir)
    for node in (0, 1):
        summary = json.loads((app_dir / "multirun" / job_id / f"node{node}/sweep_summary.json").read_text())
        assert [j["status"] for j in summary["jobs"]] == ["PREEMPTED", "NOT_STARTED"], summary
