"""`hydra.launcher.detach=true` on a real SLURM cluster: submit, end, come back.

A user submits a sweep from a login node and logs out; the jobs run on. Later the same
command without `detach` waits for them and hands Hydra every job's result, submitting
nothing twice; a Ctrl-C there stops the waiting only. Read as a user reads it: the
console, the sweep's files, `squeue`.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List

import pytest

from tests.conftest import kill_tree
from tests.slurm_cluster import SlurmCluster, skip_or_fail, unavailable
from tests.test_slurm_submit import (
    QUEUE_EMPTIES_S,
    SWEEP_TIMEOUT_S,
    _command,
    _once_running,
    _queue,
    _start,
    _summary,
    _sweep,
    _wait_for,
    app_dir,  # noqa: F401  (the fixture)
)
from tests.test_sweep_cli import _env, _tool

pytestmark = pytest.mark.timeout(900)
# composing and submitting a thousand jobs (Hydra's validation, then the launcher's)
THOUSAND_JOBS_TIMEOUT_S = 800


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    skip_or_fail(unavailable())
    with SlurmCluster(tmp_path_factory.mktemp("cluster"), nodes=2) as running:
        yield running


def _submitted_ids(directory: Path) -> "dict[str, str]":
    submitted = json.loads((directory / "sweep" / ".slurm" / "submitted.json").read_text())
    return {num: job["slurm_id"] for num, job in submitted.items()}


def test_a_detached_sweep_runs_on_and_the_same_command_comes_back_for_its_results(
    cluster: SlurmCluster,
    app_dir: Path,  # noqa: F811
) -> None:
    sweep = ("steps=20", "step_s=0.25", "x=1,2")
    started = time.monotonic()
    result = _sweep(cluster, app_dir, "hydra.launcher.detach=true", *sweep)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # it ends at once, the jobs still running or queued: it did not wait for their 5 s of steps
    assert time.monotonic() - started < SWEEP_TIMEOUT_S
    assert "Detached: 2 job(s) submitted to SLURM" in output, output
    assert "torchrun-sweep status sweep" in output and "torchrun-sweep cancel sweep" in output, output
    assert "without hydra.launcher.detach=true" in output, output
    ids = _submitted_ids(app_dir)
    assert sorted(ids) == ["0", "1"], ids
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["RUNNING", "RUNNING"], jobs

    # detach again while they run: nothing submitted twice
    again = _sweep(cluster, app_dir, "hydra.launcher.detach=true", *sweep)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said
    assert "Submitting" not in said and "submitted before" in said, said
    assert _submitted_ids(app_dir) == ids

    # come back: the same command waits and returns every job's result, submitting nothing
    back = _sweep(cluster, app_dir, *sweep)
    said = back.stdout + back.stderr
    assert back.returncode == 0, said
    assert "Submitting" not in said, said
    for n, slurm_id in ids.items():
        assert (
            f"#{n} : steps=20 step_s=0.25 x={int(n) + 1} : SLURM job {slurm_id}, submitted before" in said
        ), said
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(2)] == ["COMPLETED", "COMPLETED"], jobs
    assert [jobs[n]["return_value"]["x"] for n in range(2)] == [1, 2], jobs
    assert "2 jobs: 2 completed" in said, said
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_status_tells_why_a_detached_job_failed_before_any_launcher_came_back(
    cluster: SlurmCluster,
    app_dir: Path,  # noqa: F811
) -> None:
    """A detached job that failed while no launcher waited: `torchrun-sweep status` names its
    error as the sweep's record will (its nodes wrote it beside their result), and the
    command run again records the same."""
    sweep = ("fail_rank=0", "fail_x=2", "x=1,2")
    result = _sweep(cluster, app_dir, "hydra.launcher.detach=true", *sweep)
    assert result.returncode == 0, result.stdout + result.stderr
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)

    shown = _tool(app_dir, "status", "sweep", "--json", env=_env(cluster.env))
    assert shown.returncode == 0, shown.stderr
    jobs = json.loads(shown.stdout)["jobs"]
    assert [job["state"] for job in jobs] == ["ENDED", "ENDED"], jobs
    assert jobs[0]["error"] is None, jobs[0]
    assert "ValueError: rank 0 failed on purpose (x=2)" in jobs[1]["error"], jobs[1]
    table = _tool(app_dir, "status", "sweep", env=_env(cluster.env))
    assert "1  ENDED  " in table.stdout and "ValueError: rank 0 failed on pur" in table.stdout, table.stdout

    back = _sweep(cluster, app_dir, *sweep)
    recorded = _summary(app_dir)
    assert [recorded[n]["status"] for n in range(2)] == ["COMPLETED", "FAILED"], back.stdout + back.stderr
    assert recorded[1]["error"] == jobs[1]["error"], (recorded[1]["error"], jobs[1]["error"])


def test_a_detached_job_preempted_while_no_launcher_runs_requeues_resumes_and_is_collected(
    cluster: SlurmCluster,
    app_dir: Path,  # noqa: F811
) -> None:
    """SLURM's stop notice reaches a job submitted detached: its nodes stop it at a step
    boundary with a checkpoint and requeue it, it runs again from there and completes, all
    with no launcher attached; status shows it ended, and the command run again collects it."""
    sweep = ("steps=40", "step_s=0.25", "x=1")
    result = _sweep(cluster, app_dir, "hydra.launcher.detach=true", *sweep)
    assert result.returncode == 0, result.stdout + result.stderr
    slurm_id = _submitted_ids(app_dir)["0"]
    out = _once_running(app_dir, [slurm_id], 0, x=1)
    signalled = cluster.run(["scancel", "--signal=USR2", slurm_id])
    assert signalled.returncode == 0, signalled.stderr
    _wait_for(lambda: "is requeued" in out.read_text(), "the job's requeue by its own nodes")
    _wait_for(lambda: not _queue(cluster), "the requeued job's end", SWEEP_TIMEOUT_S)
    shown = json.loads(_tool(app_dir, "status", "sweep", "--json", env=_env(cluster.env)).stdout)
    (job,) = shown["jobs"]
    assert job["state"] == "ENDED" and "its result is not in the record yet" in job["note"], shown

    back = _sweep(cluster, app_dir, *sweep)
    said = back.stdout + back.stderr
    assert back.returncode == 0, said
    assert "Submitting" not in said and f"SLURM job {slurm_id}, submitted before" in said, said
    # the job SLURM still had (its result in) is waited for: neither resumed nor run again
    assert "1 submitted earlier are waited for (#0) (hydra.launcher.resume=false" in said, said
    assert "afresh" not in said and "unfinished" not in said, said
    (collected,) = _summary(app_dir).values()
    assert collected["status"] == "COMPLETED", collected
    value = collected["return_value"]
    assert value["resumed"] is True and 0 < value["from"] < 40 and value["x"] == 1, value
    # its time is its run's (steps after the checkpoint, 0.25 s each, and its start-up on the
    # node), not the moment the command that came back read its result
    assert collected["duration_s"] >= (40 - value["from"]) * 0.25, collected
    text = out.read_text()
    stops = {
        line.split(": stopping after step ")[1]
        for line in text.splitlines()
        if ": stopping after step" in line
    }
    assert len(stops) == 1, text  # every rank at the same step


def test_ctrl_c_while_coming_back_leaves_detached_jobs_running(
    cluster: SlurmCluster,
    app_dir: Path,  # noqa: F811
) -> None:
    sweep = ("steps=200", "step_s=0.25", "x=1")
    result = _sweep(cluster, app_dir, "hydra.launcher.detach=true", *sweep)
    assert result.returncode == 0, result.stdout + result.stderr
    slurm_id = _submitted_ids(app_dir)["0"]
    waiting = _start(cluster, app_dir, *sweep)
    try:
        _wait_for(
            lambda: slurm_id in " ".join(_queue(cluster)) and _summary(app_dir)[0]["status"] == "RUNNING",
            "the job in the queue",
        )
        # the come-back command has taken the job back once its line says so
        lines = []
        assert waiting.stdout is not None
        while True:
            line = waiting.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if "submitted before" in line:
                break
        waiting.send_signal(signal.SIGINT)
        rest, _ = waiting.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        kill_tree(waiting)
    output = "".join(lines) + rest
    assert waiting.returncode == 128 + signal.SIGINT, output
    assert f"SLURM job(s) {slurm_id}, submitted detached, run on" in output, output
    assert "torchrun-sweep cancel sweep" in output, output
    assert "Traceback" not in output, output
    # still there, not cancelled
    assert any(line.startswith(slurm_id) and "CANCELLED" not in line for line in _queue(cluster)), _queue(
        cluster
    )
    cancelled = cluster.run(["scancel", slurm_id])
    assert cancelled.returncode == 0, cancelled.stderr
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)


def test_detach_refuses_a_sweeper_that_needs_results_between_batches(
    cluster: SlurmCluster,
    app_dir: Path,  # noqa: F811
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "app.py",
            "--multirun",
            "hydra/launcher=torchrun_slurm",
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.n_jobs=2",
            "hydra.sweep.dir=sweep",
            "hydra.launcher.detach=true",
            "x=range(1,5)",
        ],
        cwd=app_dir,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "hydra.launcher.detach=true cannot serve the sweeper" in output, output
    assert "Optuna" in output or "optuna" in output, output
    assert "Traceback" not in output, output
    assert not (app_dir / "sweep" / ".slurm").exists()
    assert not _queue(cluster)


def _interrupted(
    cluster: SlurmCluster, directory: Path, overrides: "tuple[str, ...]", signum: int, recorded: int
) -> "tuple[int, str]":
    """The sweep started as a user starts it, sent `signum` once it has recorded at least
    `recorded` SLURM jobs (a Ctrl-C reaches the terminal's process group; a `kill -9 <pid>`
    the launcher alone); its exit status and console."""
    log = directory / f"interrupted-{signum}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _command(*overrides),
            cwd=directory,
            env=cluster.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for(
            lambda: proc.poll() is not None or len(_recorded(directory)) >= recorded,
            f"{recorded} jobs recorded",
            THOUSAND_JOBS_TIMEOUT_S,
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signum)
        return proc.wait(timeout=SWEEP_TIMEOUT_S), log.read_text()
    finally:
        kill_tree(proc)


def _recorded(directory: Path) -> "dict[str, str]":
    """The SLURM jobs the sweep has recorded so far (the file is replaced whole)."""
    try:
        return _submitted_ids(directory)
    except FileNotFoundError:
        return {}


class _SummaryReader(threading.Thread):
    """A user's script reading the sweep's summary over and over while the sweep's commands
    run: every read must parse, whole, and list every job."""

    def __init__(self, path: Path, jobs: int) -> None:
        super().__init__(daemon=True)
        self.path, self.jobs = path, jobs
        self.done = threading.Event()
        self.reads = 0
        self.errors: List[str] = []

    def run(self) -> None:
        while not self.done.is_set():
            try:
                text = self.path.read_text()
            except FileNotFoundError:  # not written yet
                pass
            else:
                try:
                    listed = len(json.loads(text)["jobs"])
                except ValueError as e:
                    self.errors.append(f"{e}: {text[-200:]!r}")
                else:
                    self.reads += 1
                    if listed != self.jobs:
                        self.errors.append(f"{listed} jobs listed")
            self.done.wait(0.05)

    def end(self) -> None:
        self.done.set()
        self.join()
        assert not self.errors and self.reads, (self.errors[:3], self.reads)


def test_a_thousand_one_node_jobs_interrupted_by_ctrl_c_and_kill_9_are_all_submitted_once(
    cluster: SlurmCluster,
    app_dir: Path,  # noqa: F811
) -> None:
    """A sweep of a thousand jobs submitted detached, as from a login node, stopped by a
    Ctrl-C, then by a `kill -9`, each time part way through its submission, then run to its
    end: every job is in SLURM's queue exactly once (nothing lost, nothing submitted twice),
    the sweep's summary parses whenever it is read, `torchrun-sweep status` reads the whole
    sweep, `cancel` cancels every job. The jobs are
    submitted held (`sbatch --hold`), so that none takes this small machine's CPU; what the
    submission costs against Hydra's own validation is measured by
    benchmarks/slurm_submit.py --detach --hold (docs/login-node.md)."""
    jobs = 1000
    sweep = (
        "hydra.launcher.detach=true",
        "+hydra.launcher.additional_parameters.hold=true",
        f"x=range(0,{jobs})",
    )

    def queued() -> "list[str]":
        shown = cluster.run(["squeue", "--noheader", "--array", "--format=%i %T %r"])
        assert shown.returncode == 0, shown.stderr
        return shown.stdout.splitlines()

    def held_once(ids: "dict[str, str]") -> None:
        """SLURM queues each recorded job, held, and no other."""
        lines = queued()
        assert sorted(line.split()[0] for line in lines) == sorted(ids.values()), (len(lines), len(ids))
        assert all(line.endswith("PENDING JobHeldUser") for line in lines), lines[:5]

    reader = _SummaryReader(app_dir / "sweep" / "sweep_summary.json", jobs)
    reader.start()
    code, output = _interrupted(cluster, app_dir, sweep, signal.SIGINT, 24)
    assert code == 130, output[-3000:]
    stopped = _recorded(app_dir)
    assert 24 <= len(stopped) < jobs, len(stopped)
    # what runs on, in SLURM's words (`1_[0-7], 2_[8-23]`), and how to go on
    arrays = sorted({slurm_id.split("_")[0] for slurm_id in stopped.values()}, key=int)
    assert f"SLURM job(s) {arrays[0]}_[0-7], {arrays[1]}_[8-23]" in output, output[-3000:]
    assert "submitted detached, run on" in output and "the same command submits the rest" in output, output[
        -3000:
    ]
    held_once(stopped)

    code, output = _interrupted(cluster, app_dir, sweep, signal.SIGKILL, len(stopped) + 200)
    assert code == -signal.SIGKILL, output[-3000:]
    killed = _recorded(app_dir)
    assert {n: killed[n] for n in stopped} == stopped and len(stopped) < len(killed) < jobs, len(killed)
    held_once(killed)

    result = _sweep(cluster, app_dir, *sweep, timeout_s=THOUSAND_JOBS_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    fresh = jobs - len(killed)
    assert f"Detached: {fresh} job(s) submitted to SLURM" in output, output[-3000:]
    assert f", {len(killed)} submitted before; they run on" in output, output[-3000:]
    ids = _submitted_ids(app_dir)
    assert sorted(int(n) for n in ids) == list(range(jobs)), len(ids)
    assert {n: ids[n] for n in killed} == killed
    held_once(ids)
    reader.end()

    shown = _tool(app_dir, "status", "sweep", "--json", env=_env(cluster.env))
    assert shown.returncode == 0, shown.stderr
    states = [job["state"] for job in json.loads(shown.stdout)["jobs"]]
    assert states == ["PENDING"] * jobs, sorted(set(states))

    cancelled = _tool(app_dir, "cancel", "sweep", env=_env(cluster.env))
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith(f"cancelled #0-#{jobs - 1} of sweep (SLURM jobs "), cancelled.stdout
    _wait_for(lambda: not _queue(cluster), "empty queue", QUEUE_EMPTIES_S)
