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
    # all_gather_object that is safe to destroy the group after on torch < 2.8 (its docstring)
    shutil.copy(Path(__file__).parent / "multinode_apps" / "held_gather.py", target)
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


def _sweep(
    cluster: SlurmCluster, app_dir: Path, *overrides: str, timeout_s: float = SWEEP_TIMEOUT_S
) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(*overrides),
        cwd=app_dir,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
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


def ranks_saw(job: int, world: int) -> List[dict]:
    """What each rank of the submit app's job `job` (`x=job+1`) reports when it runs as under
    the local launcher: RANK from its first line, the job's env_set, its job dir as its cwd,
    the job's Hydra config as its first node has it, its own config."""
    return [
        {
            "rank_at_import": str(rank),
            "job_tag": f"job_{job}",
            "in_job_dir": True,
            "output_subdir": ".hydra",
            "cfg_x": job + 1,
        }
        for rank in range(world)
    ]


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
        # every rank saw what it sees under the local launcher, from its first line
        assert value["ranks_saw"] == ranks_saw(n, world=4), value
        # Hydra's bookkeeping once per job, on its first node
        starts = (app_dir / "sweep" / str(n) / "job_starts.log").read_text().split()
        assert len(starts) == 1 and starts[0] in value["hosts"], starts
    for n in range(3):
        assert f"job #{n} (SLURM job " in output and " started on node" in output, output
        assert (app_dir / "sweep" / str(n) / ".hydra" / "config.yaml").exists()
        assert (app_dir / "sweep" / str(n) / "rerun.sh").exists()
    assert "3 jobs: 3 completed" in output, output
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_a_failing_rank_fails_its_job_with_the_ranks_exception_the_others_complete(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    result = _sweep(
        cluster,
        app_dir,
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=2",
        "fail_rank=1",
        "fail_x=2",
        "x=1,2,3",
    )
    output = result.stdout + result.stderr
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(3)] == ["COMPLETED", "FAILED", "COMPLETED"], output
    assert "ValueError: rank 1 failed on purpose (x=2)" in jobs[1]["error"], jobs[1]["error"]
    assert "rank 1 failed on purpose (x=2)" in output
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_an_impossible_request_fails_at_once_with_slurms_reason(cluster: SlurmCluster, app_dir: Path) -> None:
    started = time.monotonic()
    result = _sweep(cluster, app_dir, "hydra.launcher.partition=nosuch", "x=1,2")
    took = time.monotonic() - started
    output = result.stdout + result.stderr
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["FAILED", "FAILED"], output
    # SLURM's words do not name the value it refused: the line says what the job asked for
    assert "sbatch refused job #0 (" in jobs[0]["error"] and "partition=nosuch" in jobs[0]["error"], jobs[0]
    assert "invalid partition" in jobs[0]["error"].lower(), jobs[0]
    assert "Traceback" not in output, output
    assert "Error executing job with overrides: ['x=1']" in output, output  # the job's own
    assert took < 60, took


def test_dry_run_prints_each_jobs_sbatch_script_and_submits_nothing(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    result = _sweep(
        cluster,
        app_dir,
        "hydra.launcher.nodes=2",
        "hydra.launcher.partition=debug",
        "hydra.launcher.dry_run=true",
        "x=1,2",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("#SBATCH --nodes=2") == 1 and "#SBATCH --array=0,1" in output, output  # one array
    assert "#SBATCH --partition=debug" in output and "#SBATCH --signal=USR2@120" in output, output
    assert "_submit.node" in output and "srun --ntasks-per-node=1" in output, output
    assert not (app_dir / "sweep" / "sweep_summary.json").exists()
    assert not _queue(cluster)


# a job's last processes may take this long after the sweep has its outcome: torch's agent gives
# ranks 30 s (`shutdown_timeout`) after SIGTERM when a peer node's rank failed, then SLURM's
# epilog runs
QUEUE_EMPTIES_S = 90


def _submitted(app_dir: Path, count: int) -> List[str]:
    path = app_dir / "sweep" / ".slurm" / "submitted.json"

    def found() -> List[str]:
        try:
            jobs = json.loads(path.read_text())
        except (OSError, ValueError):
            return []
        return [jobs[str(n)]["slurm_id"] for n in range(count)] if len(jobs) == count else []

    return _wait_for(found, f"{count} submitted jobs in {path}")


def _once_running(app_dir: Path, ids: List[str], job: int, x: int) -> Path:
    """Job `job`'s SLURM output file, once its rank 0 has taken its first step (of `x`)."""
    out = app_dir / "sweep" / ".slurm" / f"job{job}.{ids[job].split('_')[0]}.out"
    _wait_for(lambda: out.exists() and f"rank 0 running x={x}" in out.read_text(), f"job {job}'s first steps")
    return out


def _running(cluster: SlurmCluster, count: int) -> List[str]:
    return _wait_for(
        lambda: len([line for line in _queue(cluster) if line.endswith("RUNNING")]) == count,
        f"{count} running jobs",
    )


def test_ctrl_c_cancels_every_job_of_the_sweep(cluster: SlurmCluster, app_dir: Path) -> None:
    launcher = _start(cluster, app_dir, "steps=1000", "x=1,2,3,4,5")
    try:
        ids = _submitted(app_dir, 5)
        _running(cluster, 4)  # four nodes: the fifth job waits
        os.killpg(launcher.pid, signal.SIGINT)
        output, _ = launcher.communicate(timeout=60)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 130, output
    lines = [line for line in output.splitlines() if line.startswith("[torchrun launcher] SIGINT: cancelled")]
    # every job of the sweep's one array, in SLURM's notation
    array = ids[0].split("_")[0]
    assert sorted(ids) == [f"{array}_{n}" for n in range(5)], ids
    assert len(lines) == 1 and f"cancelled SLURM job(s) {array}_[0-4]" in lines[0], output
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)
    assert {job["status"] for job in _summary(app_dir).values()} == {"STOPPED"}


def test_a_preempted_job_is_requeued_resumes_and_the_sweep_completes(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    launcher = _start(
        cluster, app_dir, "hydra.launcher.nodes=2", "hydra.launcher.nproc_per_node=2", "steps=25", "x=1,2"
    )
    try:
        ids = _submitted(app_dir, 2)
        out = _once_running(app_dir, ids, 0, x=1)
        signalled = cluster.run(["scancel", "--signal=USR2", ids[0]])
        assert signalled.returncode == 0, signalled.stderr
        output, _ = launcher.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 0, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["COMPLETED"] * 2, output
    first = jobs[0]["return_value"]
    assert first["resumed"] is True and 0 < first["from"] < 25, first
    assert jobs[1]["return_value"]["resumed"] is False
    text = out.read_text()
    assert (
        sorted(line for line in text.splitlines() if ": stopping after step" in line)
        and "is requeued" in text
    )
    assert "resource_tracker" not in text and "KeyError" not in text, text  # SLURM's USR2 reached it
    stops = {
        line.split(": stopping after step ")[1]
        for line in text.splitlines()
        if ": stopping after step" in line
    }
    assert len(stops) == 1 and text.count(": stopping after step") == 4, text  # every rank, the same step
    said = [
        line for line in output.splitlines() if f"job #0 (SLURM job {ids[0]}) " in line and "requeued" in line
    ]
    assert said, output


def test_a_launcher_killed_and_started_again_submits_no_job_twice(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    launcher = _start(cluster, app_dir, "steps=20", "x=1,2")
    try:
        ids = _submitted(app_dir, 2)
        launcher.kill()
        launcher.communicate()
    finally:
        kill_tree(launcher)
    result = _sweep(cluster, app_dir, "steps=20", "x=1,2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Submitting" not in output, output
    assert all(f"SLURM job {slurm_id}, submitted before" in output for slurm_id in ids), output
    jobs = _summary(app_dir)
    assert [jobs[n]["return_value"]["x"] for n in range(2)] == [1, 2], jobs


def test_two_one_node_jobs_run_at_once_on_different_nodes(cluster: SlurmCluster, app_dir: Path) -> None:
    result = _sweep(cluster, app_dir, "steps=10", "x=1,2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    jobs = _summary(app_dir)
    hosts = [jobs[n]["return_value"]["hosts"] for n in range(2)]
    assert len(hosts[0]) == 1 and len(hosts[1]) == 1 and hosts[0] != hosts[1], hosts
    lines = output.splitlines()
    first_end = min(i for i, line in enumerate(lines) if " ended: " in line)
    assert len([line for line in lines[:first_end] if " started on " in line]) == 2, output


def test_a_failing_rank_on_the_second_node_fails_its_job_with_that_ranks_exception(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    result = _sweep(
        cluster,
        app_dir,
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=2",
        "fail_rank=3",
        "fail_x=1",
        "x=1",
    )
    output = result.stdout + result.stderr
    job = _summary(app_dir)[0]
    assert job["status"] == "FAILED", output
    assert "rank 3 failed on purpose (x=1)" in job["error"], job["error"]
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_a_job_cancelled_outside_the_launcher_fails_with_slurms_state(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    launcher = _start(cluster, app_dir, "steps=1000", "x=1,2")
    try:
        ids = _submitted(app_dir, 2)
        _running(cluster, 2)
        cancelled = cluster.run(["scancel", ids[0], ids[1]])
        assert cancelled.returncode == 0, cancelled.stderr
        output, _ = launcher.communicate(timeout=120)
    finally:
        kill_tree(launcher)
    jobs = _summary(app_dir)
    for n in range(2):
        assert jobs[n]["status"] == "FAILED", output
        assert f"SLURM job {ids[n]} ended CANCELLED" in jobs[n]["error"], jobs[n]["error"]
        assert f"sweep/.slurm/job{n}." in jobs[n]["error"], jobs[n]["error"]  # where its output is
    assert "Traceback" not in output, output


def test_a_job_at_its_time_limit_stops_and_fails_when_no_requeue_is_left(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    result = _sweep(
        cluster,
        app_dir,
        "hydra.launcher.timeout_min=1",
        "hydra.launcher.signal_delay_s=50",
        "hydra.launcher.max_num_timeout=0",
        "steps=2000",
        "x=1",
    )
    output = result.stdout + result.stderr
    job = _summary(app_dir)[0]
    assert job["status"] == "FAILED", output
    assert "reached its time limit" in job["error"] and "max_num_timeout=0" in job["error"], job["error"]
    out = next((app_dir / "sweep" / ".slurm").glob("job0.*.out")).read_text()
    assert "is requeued" not in out, out
    # SLURM sends the notice up to a minute early (its event resolution): on a busy machine it
    # may come before the ranks run; once they run, they stop at a step boundary
    if "rank 0 running" in out:
        assert "rank 0: stopping after step" in out, out
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_optuna_sweeps_through_slurm_jobs_with_rank_0s_values(cluster: SlurmCluster, tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    app_dir = tmp_path / "optuna"
    shutil.copytree(
        Path(__file__).parent / "integration_apps", app_dir, ignore=shutil.ignore_patterns("__pycache__")
    )
    result = subprocess.run(
        [
            sys.executable,
            "optuna_app.py",
            "--multirun",
            "hydra/sweeper=optuna",
            "hydra.sweeper.sampler.seed=123",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.n_jobs=2",
            "hydra/launcher=torchrun_slurm",
            "hydra.launcher.nproc_per_node=2",
            "x=interval(-5.0, 5.0)",
            "+hydra.callbacks.record._target_=__main__.RecordReturn",
            "hydra.sweep.dir=sweep",
        ],
        cwd=app_dir,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("Submitting 2 jobs to SLURM") == 2, output
    values = []
    for n in range(4):
        rank0 = json.loads((app_dir / "sweep" / str(n) / "rank0.json").read_text())
        returned = json.loads((app_dir / "sweep" / str(n) / "job_return.json").read_text())
        assert returned["status"] == "COMPLETED" and returned["return_value"] == rank0["value"], (
            rank0,
            returned,
        )
        values.append(rank0["value"])
    results = (app_dir / "sweep" / "optimization_results.yaml").read_text()
    assert f"best_value: {min(values)}" in results, results


def test_a_stop_signal_to_the_last_job_of_an_array_requeues_it_and_it_resumes(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    # the raw id of an array's last job is the array's own id: squeue and scontrol must be
    # asked about that one job (`<array>_<task>`), not about every job of the array
    launcher = _start(cluster, app_dir, "steps=40", "x=1,2")
    try:
        ids = _submitted(app_dir, 2)
        out = _once_running(app_dir, ids, 1, x=2)
        signalled = cluster.run(["scancel", "--signal=USR2", ids[1]])
        assert signalled.returncode == 0, signalled.stderr
        output, _ = launcher.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 0, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["COMPLETED"] * 2, output
    last = jobs[1]["return_value"]
    assert last["x"] == 2 and last["resumed"] is True and 0 < last["from"] < 40, last
    assert jobs[0]["return_value"]["resumed"] is False and jobs[0]["return_value"]["from"] == 0
    text = out.read_text()
    assert "_time_left_s" not in text and "is requeued" in text, text
    assert f"job #1 (SLURM job {ids[1]}) stopped at a step boundary and is requeued" in output, output


def test_quoted_values_a_bare_flag_and_a_changed_working_dir_reach_sbatch_as_meant(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    # values sbatch must read whole (a space, a quote, a `$`), `exclusive: true` as the bare
    # flag, and a job that starts elsewhere (`cd` in setup, --chdir) while the sweep dir is relative
    result = subprocess.run(
        [
            sys.executable,
            "app.py",
            "--multirun",
            "hydra/launcher=torchrun_slurm",
            "hydra.sweep.dir='a sweep'",
            "hydra.launcher.name='my job'",
            'hydra.launcher.comment="it\'s a $HOME comment"',
            "+hydra.launcher.additional_parameters.exclusive=true",
            "+hydra.launcher.additional_parameters.chdir=/",
            "hydra.launcher.setup=['cd /']",
            "x=1,2",
        ],
        cwd=app_dir,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    summary = json.loads((app_dir / "a sweep" / "sweep_summary.json").read_text())["jobs"]
    assert [job["status"] for job in summary] == ["COMPLETED"] * 2, output
    assert [job["return_value"]["x"] for job in summary] == [1, 2], summary
    assert len(list((app_dir / "a sweep" / ".slurm").glob("job*.out"))) == 2
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_what_only_a_node_can_tell_is_decided_on_the_node_not_the_login_node(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    """A login node is not a compute node: a `launch_prefix` program that the job's `setup`
    lines put on PATH (`module load` does) and nproc_per_node's words (`gpu`: the login node
    has none) are decided where the job runs, as torchrun decides them there; a node that
    cannot honour one fails its job, naming the key and the node, and the sweep goes on."""
    tools = app_dir / "node_tools"
    tools.mkdir()
    wrap = tools / "wrap"
    wrap.write_text('#!/bin/sh\nhostname >> "$WRAPPED_ON"\nexec "$@"\n')
    wrap.chmod(0o755)
    assert shutil.which("wrap", path=cluster.env.get("PATH")) is None  # not on the login node's PATH
    result = _sweep(
        cluster,
        app_dir,
        f"hydra.launcher.setup=['export PATH={tools}:$PATH','export WRAPPED_ON={app_dir}/wrapped_on']",
        "hydra.launcher.launch_prefix=[wrap]",
        "hydra.launcher.nproc_per_node=${procs}",
        "procs=2,gpu",
        "x=1",
    )
    output = result.stdout + result.stderr
    assert (app_dir / "sweep" / "sweep_summary.json").exists(), output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["COMPLETED", "FAILED"], output
    assert jobs[0]["return_value"]["world"] == 2, jobs[0]
    # each of job 0's ranks started through the wrapper, on the node SLURM gave the job
    wrapped_on = (app_dir / "wrapped_on").read_text().split()
    assert len(wrapped_on) == 2 and set(wrapped_on) == set(jobs[0]["return_value"]["hosts"]), wrapped_on
    error = jobs[1]["error"]
    assert "hydra.launcher.nproc_per_node='gpu' is invalid on host node" in error, error
    assert "Traceback" not in output, output
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_a_changed_sweep_after_a_killed_launcher_cancels_the_old_jobs_and_waits_for_its_own(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    launcher = _start(cluster, app_dir, "steps=1000", "x=1,2")
    try:
        old = _submitted(app_dir, 2)
        _running(cluster, 2)
        launcher.kill()
        launcher.communicate()
    finally:
        kill_tree(launcher)
    result = _sweep(cluster, app_dir, "steps=3", "x=1,2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"Cancelled SLURM job(s) {old[0]}, {old[1]} of an earlier run of another sweep" in output, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["COMPLETED"] * 2, output
    assert [jobs[n]["return_value"]["x"] for n in range(2)] == [1, 2], jobs
    # nothing the old sweep's cancelled jobs wrote is taken for the new ones
    assert "FAILED" not in output and "Error executing job" not in output, output
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_a_job_cancelled_by_ctrl_c_continues_in_place_when_the_same_command_runs_again(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    launcher = _start(cluster, app_dir, "steps=50", "x=1")
    try:
        ids = _submitted(app_dir, 1)
        _once_running(app_dir, ids, 0, x=1)
        assert (app_dir / "sweep" / "0" / ".hydra" / "ranks_started").exists()
        os.killpg(launcher.pid, signal.SIGINT)
        output, _ = launcher.communicate(timeout=60)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 130, output
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)
    # the dry run says what the same command will do with the recorded job
    dry = _sweep(cluster, app_dir, "steps=50", "x=1", "hydra.launcher.dry_run=true")
    assert "record:  STOPPED in the record: runs on in its job dir" in dry.stdout + dry.stderr, dry
    result = _sweep(cluster, app_dir, "steps=50", "x=1")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "1 unfinished job(s) continue (#0)" in output, output
    job = _summary(app_dir)[0]
    assert job["status"] == "COMPLETED" and job["return_value"]["resumed"] is True, job
    # a completed job of the record is in no array
    dry = _sweep(
        cluster, app_dir, "steps=50", "x=1", "hydra.launcher.dry_run=true", "hydra.launcher.resume=true"
    )
    output = dry.stdout + dry.stderr
    assert (
        "1 job, each a SLURM job of a job array (1 of them from the sweep dir's record, not submitted)"
        in output
    )
    assert "record:  COMPLETED in the record: not run" in output and "sbatch script" not in output, output


def test_a_job_asking_for_more_nodes_than_its_partition_has_fails_at_once_with_slurms_reason(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    started = time.monotonic()
    result = _sweep(cluster, app_dir, "hydra.launcher.nodes=5", "x=1")
    took = time.monotonic() - started
    output = result.stdout + result.stderr
    job = _summary(app_dir)[0]
    assert job["status"] == "FAILED", output
    assert "PartitionNodeLimit" in job["error"] or "PartitionConfig" in job["error"], job["error"]
    assert "asks for 5 nodes (hydra.launcher.nodes) and its partition has at most 4" in job["error"], job
    assert "Error executing job with overrides: ['x=1']" in output, output
    assert took < 60, took
    _wait_for(lambda: not _queue(cluster), "empty queue", 10)


def _requeued_by_slurm(cluster: SlurmCluster, app_dir: Path, requeue) -> None:  # type: ignore[no-untyped-def]
    """A sweep of two 2-node jobs, job 0 requeued by SLURM itself (`requeue(its id, its nodes)`)
    once its ranks run: the launcher follows it through the requeue and gets its final result."""
    launcher = _start(
        cluster, app_dir, "hydra.launcher.nodes=2", "hydra.launcher.nproc_per_node=1", "steps=60", "x=1,2"
    )
    try:
        ids = _submitted(app_dir, 2)
        _once_running(app_dir, ids, 0, x=1)
        nodes = cluster.run(["squeue", "--noheader", f"--jobs={ids[0]}", "--format=%N"]).stdout.strip()
        requeue(ids[0], nodes)
        output, _ = launcher.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 0, output
    assert f"job #0 (SLURM job {ids[0]}): SLURM requeued it (restart 1" in output, output
    assert "FAILED" not in output, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["COMPLETED"] * 2, output
    first = jobs[0]["return_value"]
    assert first["x"] == 1 and first["world"] == 2 and first["resumed"] is True, first
    assert jobs[1]["return_value"]["resumed"] is False
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_a_job_scontrol_requeues_is_followed_through_its_requeue_and_continues_in_place(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    def requeue(slurm_id: str, nodes: str) -> None:
        done = cluster.run(["scontrol", "requeue", slurm_id])
        assert done.returncode == 0, done.stderr

    _requeued_by_slurm(cluster, app_dir, requeue)


def test_a_job_requeued_by_slurm_after_a_node_failure_is_followed_and_continues_in_place(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    downed: List[str] = []

    def node_fails(slurm_id: str, nodes: str) -> None:
        host = cluster.run(["scontrol", "show", "hostnames", nodes]).stdout.split()[-1]
        done = cluster.run(["scontrol", "update", f"nodename={host}", "state=down", "reason=test"])
        assert done.returncode == 0, done.stderr
        downed.append(host)

    try:
        _requeued_by_slurm(cluster, app_dir, node_fails)
    finally:
        for host in downed:  # back in service (SLURM may have returned it already)
            state = cluster.run(["sinfo", "--noheader", "--nodes", host, "--format=%T"]).stdout
            if "down" in state or "drain" in state:
                cluster.run(["scontrol", "update", f"nodename={host}", "state=resume"])


def test_a_job_slurm_preempts_with_sigterm_in_its_grace_time_is_requeued_and_followed(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    # partition `preemptible`: PreemptMode=REQUEUE with a GraceTime; a job of partition
    # `urgent` that needs every node preempts the sweep's job. SLURM's SIGTERM stops its ranks
    # at once (they get no stop notice: PreemptParameters has no send_user_signal), and a job
    # that then ended on its own would end FAILED, never requeued: node 0 requeues it
    launcher = _start(
        cluster,
        app_dir,
        "hydra.launcher.partition=preemptible",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=1",
        "steps=40",
        "x=1",
    )
    try:
        (slurm_id,) = _submitted(app_dir, 1)
        out = _once_running(app_dir, [slurm_id], 0, x=1)
        urgent = cluster.run(
            [
                "sbatch",
                "--parsable",
                "--partition=urgent",
                "--nodes=4",
                f"--output={app_dir / 'urgent.out'}",
                "--wrap=hostname",
            ]
        )
        assert urgent.returncode == 0, urgent.stderr
        output, _ = launcher.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 0, output
    said = (
        f"job #0 (SLURM job {slurm_id}) was preempted by SLURM (which stopped its ranks) "
        "and is requeued (requeue 1)"
    )
    assert said in output, output
    assert "FAILED" not in output and "STOPPED" not in output, output
    (job,) = _summary(app_dir).values()
    assert job["status"] == "COMPLETED", output
    # the run SLURM requeued continued in the job dir where the preempted one's ranks ran
    assert job["return_value"]["resumed"] is True and job["return_value"]["world"] == 2, job
    assert (app_dir / "urgent.out").read_text().strip(), "the urgent job never ran"
    assert f"SLURM job {slurm_id} is requeued" in out.read_text(), out.read_text()
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_a_stop_notice_in_a_jobs_first_moment_requeues_it_instead_of_killing_it(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    launcher = _start(cluster, app_dir, "steps=10", "x=1")
    try:
        ids = _submitted(app_dir, 1)
        # as soon as the node's process holds the notice (its first statement), while its
        # imports run; before that, the interpreter's own start-up, the default action would
        # still end it (a window of milliseconds this launcher cannot close: see the note of
        # `_submit.node`)
        _wait_for(lambda: _a_node_holds_usr2(ids[0]), "a node process of the job holding SIGUSR2")
        signalled = cluster.run(["scancel", "--signal=USR2", ids[0]])
        assert signalled.returncode == 0, signalled.stderr
        output, _ = launcher.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        kill_tree(launcher)
    assert launcher.returncode == 0, output
    job = _summary(app_dir)[0]
    assert job["status"] == "COMPLETED" and job["return_value"]["x"] == 1, output
    text = next((app_dir / "sweep" / ".slurm").glob("job0.*.out")).read_text()
    assert "User defined signal 2" not in text and "is requeued" in text, text


def _a_node_holds_usr2(slurm_id: str) -> bool:
    """Whether a node process of SLURM job `<array>_<task>` runs with SIGUSR2 blocked (its
    SigBlk); a node of an earlier test's job may still be ending."""
    array, task = slurm_id.split("_")
    ours = {f"SLURM_ARRAY_JOB_ID={array}".encode(), f"SLURM_ARRAY_TASK_ID={task}".encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:  # ended meanwhile
            continue
        # the node's interpreter itself, not the srun that starts it (its command names the node too)
        is_node = cmdline.startswith(sys.executable.encode() + b"\0") and b"_submit.node" in cmdline
        if not is_node or not ours <= environ:
            continue
        blocked = next((line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), "0")
        if int(blocked, 16) & (1 << (signal.SIGUSR2 - 1)):
            return True
    return False


def test_jobs_cancelled_while_their_launcher_was_dead_run_again_with_the_same_command(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    launcher = _start(cluster, app_dir, "steps=20", "x=1,2")
    try:
        ids = _submitted(app_dir, 2)
        launcher.kill()
        launcher.communicate()
    finally:
        kill_tree(launcher)
    cancelled = cluster.run(["scancel", *ids])
    assert cancelled.returncode == 0, cancelled.stderr
    _wait_for(lambda: not _queue(cluster), "empty queue", 60)
    result = _sweep(cluster, app_dir, "steps=20", "x=1,2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    said = f"SLURM job(s) {ids[0]}, {ids[1]} of an earlier run ended without a result: submitted again"
    assert said in output, output
    assert "Submitting 2 jobs to SLURM" in output, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["COMPLETED"] * 2, output
    assert [jobs[n]["return_value"]["x"] for n in range(2)] == [1, 2], jobs


def test_a_jobs_time_counts_from_when_slurm_started_it_also_after_the_launcher_came_back(
    cluster: SlurmCluster, app_dir: Path
) -> None:
    launcher = _start(cluster, app_dir, "steps=100", "step_s=0.2", "x=1")
    try:
        ids = _submitted(app_dir, 1)
        _once_running(app_dir, ids, 0, x=1)
        launcher.kill()
        launcher.communicate()
    finally:
        kill_tree(launcher)
    result = _sweep(cluster, app_dir, "steps=100", "step_s=0.2", "x=1")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    job = _summary(app_dir)[0]
    # its 100 steps of 0.2 s ran on SLURM's clock, most of them before this launcher started
    assert job["status"] == "COMPLETED" and job["duration_s"] >= 20, job
