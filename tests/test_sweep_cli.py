"""`torchrun-sweep status|cancel DIR`, typed as a user types it: the console script installed
with the package, found on the environment's PATH, run on real sweeps (a local one with a
failed job, one whose launcher runs and is then killed, and SLURM jobs on the test cluster).

The tests read what the user reads (the console, `--json`, `squeue`) and check that neither
command imports torch, and that a SLURM sweep costs one `squeue` call (and `cancel` one
`scancel`).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from tests.conftest import kill_tree
from tests.slurm_cluster import SlurmCluster, skip_or_fail, unavailable

RECORD_APP = Path(__file__).parent / "record_app"
SUBMIT_APP = Path(__file__).parent / "submit_app"
BIN = Path(sys.executable).parent
COMMAND_TIMEOUT_S = 60
SWEEP_TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(600)

JOB_KEYS = {
    "num",
    "state",
    "recorded",
    "slurm_id",
    "nodes",
    "elapsed_s",
    "overrides",
    "return_value",
    "error",
    "note",
    "job_dir",
}
SWEEP_KEYS = {"sweep_dir", "runner", "stage", "launcher", "counts", "varying", "squeue_error", "jobs"}


def _env(base: Optional[Dict[str, str]] = None, **extra: str) -> Dict[str, str]:
    """The environment of a user's shell with the venv activated: its `bin` first on PATH."""
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1", **extra)
    env.pop("HYDRA_FULL_ERROR", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    return env


def _tool(
    cwd: Path, *args: str, env: Optional[Dict[str, str]] = None, importtime: bool = False
) -> subprocess.CompletedProcess:
    """`torchrun-sweep ARGS` in `cwd`, as typed in a shell (or under `python -X importtime`)."""
    env = env or _env()
    script = shutil.which("torchrun-sweep", path=env["PATH"])
    assert script == str(BIN / "torchrun-sweep"), f"the installed console script, not {script}"
    argv = [sys.executable, "-X", "importtime", script] if importtime else ["torchrun-sweep"]
    return subprocess.run(
        [*argv, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )


def _imported(importtime_stderr: str) -> List[str]:
    """The modules `-X importtime` says were imported."""
    found = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", importtime_stderr, re.M)
    assert found, importtime_stderr[-2000:]
    return found


def _no_torch(result: subprocess.CompletedProcess) -> None:
    torch = [m for m in _imported(result.stderr) if m == "torch" or m.startswith("torch.")]
    assert not torch, torch[:5]


def _rows(stdout: str) -> List[List[str]]:
    """The table's rows (header first), cells split on the column gaps."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  state"))
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start:]]


# -- a local sweep ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished local sweep of three jobs, the second failed: its app dir (sweep in `sweep`)."""
    app_dir = tmp_path_factory.mktemp("local") / "app"
    shutil.copytree(RECORD_APP, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "app.py", "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2,0.3", "+seed=7"],
        cwd=app_dir,
        env=_env(FAIL_AT="0.2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
    )
    assert result.returncode == 1, result.stdout  # the failed job's error, as Hydra ends a sweep
    return app_dir


def test_status_of_an_ended_local_sweep_with_a_failed_job(local_sweep: Path) -> None:
    result = _tool(local_sweep, "status", "sweep")
    assert result.returncode == 0 and result.stderr == "", result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["sweep: a local sweep, ended", "3 jobs: 2 completed, 1 failed"], result.stdout
    rows = _rows(result.stdout)
    # no SLURM id column; the overrides column shows what varies (lr), not what all share (seed)
    assert rows[0] == ["#", "state", "elapsed", "overrides", "result"], rows
    summary = json.loads((local_sweep / "sweep" / "sweep_summary.json").read_text())["jobs"]
    assert [row[:2] + row[3:] for row in rows[1:]] == [
        ["0", "COMPLETED", "lr=0.1", "1.0"],
        ["1", "FAILED", "lr=0.2", "rank 0 exited with code 1: ValueError: lr=0.2 failed"],
        ["2", "COMPLETED", "lr=0.3", "3.0"],
    ], result.stdout
    for row, job in zip(rows[1:], summary):
        assert row[2] == f"{job['duration_s']:.2f}s", (row, job)  # as the launcher's table says it


def test_status_json_of_an_ended_local_sweep(local_sweep: Path) -> None:
    result = _tool(local_sweep, "status", "sweep", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    shown = json.loads(result.stdout)
    assert set(shown) == SWEEP_KEYS, shown
    sweep_dir = local_sweep / "sweep"
    assert shown["sweep_dir"] == str(sweep_dir.resolve())
    assert (shown["runner"], shown["stage"], shown["launcher"]) == ("local", "ended", None), shown
    assert shown["counts"] == {"COMPLETED": 2, "FAILED": 1} and shown["varying"] == ["lr"], shown
    assert shown["squeue_error"] is None
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert [set(job) for job in shown["jobs"]] == [JOB_KEYS] * 3, shown["jobs"]
    for job, recorded in zip(shown["jobs"], summary):
        assert job["num"] == recorded["num"] and job["overrides"] == recorded["overrides"]
        assert job["state"] == job["recorded"] == recorded["status"]
        assert job["elapsed_s"] == recorded["duration_s"] and job["return_value"] == recorded["return_value"]
        assert job["error"] == recorded["error"] and job["slurm_id"] is None and job["nodes"] is None
        assert job["job_dir"] == str((sweep_dir / str(job["num"])).resolve())
    assert [job["return_value"] for job in shown["jobs"]] == [1.0, None, 3.0]
    assert shown["jobs"][1]["error"].startswith("rank 0 (local_rank 0, pid "), shown["jobs"][1]
    assert "ValueError: lr=0.2 failed" in shown["jobs"][1]["error"]


def test_neither_command_imports_torch(local_sweep: Path) -> None:
    status = _tool(local_sweep, "status", "sweep", importtime=True)
    assert status.returncode == 0, status.stderr[-2000:]
    _no_torch(status)
    # what it does import: the launcher's record reader, SLURM's commands
    imported = _imported(status.stderr)
    assert "hydra_plugins.hydra_torchrun_launcher._launcher.resume" in imported
    assert "hydra_plugins.hydra_torchrun_launcher._shared.slurm_commands" in imported
    cancel = _tool(local_sweep, "cancel", "sweep", importtime=True)
    _no_torch(cancel)


def test_cancel_of_a_local_sweep_says_there_is_no_slurm_job(local_sweep: Path) -> None:
    result = _tool(local_sweep, "cancel", "sweep")
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr == (
        "torchrun-sweep: sweep is a local sweep (no .slurm/ in it): it has no SLURM job to cancel\n"
    ), result.stderr


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_a_dir_without_a_record_is_one_line_naming_the_file_looked_for(tmp_path: Path, command: str) -> None:
    (tmp_path / "empty").mkdir()
    result = _tool(tmp_path, command, "empty")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr == (
        "torchrun-sweep: no sweep record in empty (looked for empty/sweep_summary.json)\n"
    ), result.stderr
    missing = _tool(tmp_path, command, "nowhere")
    assert missing.returncode == 2 and missing.stdout == "", missing.stdout
    assert missing.stderr == (
        "torchrun-sweep: nowhere: no such directory (looked for the sweep's record, "
        "nowhere/sweep_summary.json)\n"
    ), missing.stderr
    # a record that cannot be read: said once, as such, in one line
    (tmp_path / "empty" / "sweep_summary.json").write_text('{"jobs": [')
    broken = _tool(tmp_path, command, "empty")
    assert broken.returncode == 2 and broken.stdout == "", broken.stdout
    assert (
        broken.stderr.startswith(
            "torchrun-sweep: empty/sweep_summary.json cannot be read as a sweep's record: JSONDecodeError: "
        )
        and broken.stderr.count("\n") == 1
    ), broken.stderr
    # valid JSON of another shape: a list, a job that is not an object
    for text, why in [
        ("[1, 2]", "not a JSON object with a list of jobs"),
        ('{"jobs": [3]}', "a job in it is not a JSON object"),
    ]:
        (tmp_path / "empty" / "sweep_summary.json").write_text(text)
        other = _tool(tmp_path, command, "empty")
        assert (other.returncode, other.stdout, other.stderr) == (
            2,
            "",
            "torchrun-sweep: empty/sweep_summary.json cannot be read as a sweep's record: "
            f"ValueError: {why}\n",
        )
    # a file given for the sweep dir
    file = _tool(tmp_path, command, "empty/sweep_summary.json")
    assert (file.returncode, file.stdout, file.stderr) == (
        2,
        "",
        "torchrun-sweep: empty/sweep_summary.json: not a directory (a sweep dir holds the sweep's record, "
        "sweep_summary.json)\n",
    )


HOLD_APP = """
import time

import hydra


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg):
    time.sleep(cfg.hold_s)
    return cfg.hold_s


if __name__ == "__main__":
    main()
"""


def test_status_while_a_local_sweep_runs_and_after_its_launcher_was_killed(tmp_path: Path) -> None:
    (tmp_path / "hold.py").write_text(HOLD_APP)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "hold.py",
            "--multirun",
            "hydra/launcher=torchrun",
            "hydra.launcher.parallel_jobs=2",
            "hydra.sweep.dir=sweep",
            "+hold_s=600,601,602",
        ],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def two_running() -> Optional[dict]:
            result = _tool(tmp_path, "status", "sweep", "--json")
            if result.returncode != 0:
                return None  # no record yet
            shown = json.loads(result.stdout)
            return shown if shown["counts"].get("RUNNING") == 2 else None

        shown = _wait_for(two_running, "two running jobs")
        assert shown["stage"] == "running" and shown["launcher"].startswith(f"pid {launcher.pid} on "), shown
        assert [job["state"] for job in shown["jobs"]] == ["RUNNING", "RUNNING", "NOT_STARTED"], shown
        assert shown["varying"] == ["hold_s"]
        text = _tool(tmp_path, "status", "sweep")
        assert text.stdout.splitlines()[:2] == [
            f"sweep: a local sweep, running (its launcher: {shown['launcher']})",
            "3 jobs: 2 running, 1 not started",
        ], text.stdout
        # the running jobs' time counts from when they started
        time.sleep(1.5)
        later = json.loads(_tool(tmp_path, "status", "sweep", "--json").stdout)
        assert all(job["elapsed_s"] is not None and job["elapsed_s"] >= 1.0 for job in later["jobs"][:2]), (
            later
        )
    finally:
        kill_tree(launcher)  # the launcher dies with its jobs (kill -9, a lost login node)
    after = _tool(tmp_path, "status", "sweep")
    assert after.returncode == 0, after.stderr
    lines = after.stdout.splitlines()
    assert lines[:2] == [
        "sweep: a local sweep, unfinished: no launcher runs it (the sweep's command, run again, resumes it)",
        "3 jobs: 2 unfinished, 1 not started",
    ], after.stdout
    assert [row[1] for row in _rows(after.stdout)[1:]] == ["UNFINISHED", "UNFINISHED", "NOT_STARTED"]
    assert "its launcher ended while it ran" in after.stdout


def _wait_for(predicate, what: str, timeout_s: float = SWEEP_TIMEOUT_S):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        found = predicate()
        if found:
            return found
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.3)


# -- SLURM --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    skip_or_fail(unavailable())
    with SlurmCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


COUNTED = """#!/bin/sh
echo "$0" >> {log}
exec {real} "$@"
"""


def _counting_slurm(tmp_path: Path, cluster: SlurmCluster) -> "tuple[Dict[str, str], Path]":
    """The cluster's environment with `squeue` and `scancel` counted (each call logged)."""
    wrappers, log = tmp_path / "counted", tmp_path / "slurm_calls.log"
    wrappers.mkdir()
    for name in ("squeue", "scancel"):
        real = shutil.which(name, path=cluster.env["PATH"])
        assert real is not None, name
        (wrappers / name).write_text(COUNTED.format(log=log, real=real))
        (wrappers / name).chmod(0o755)
    env = _env(cluster.env)
    env["PATH"] = f"{BIN}{os.pathsep}{wrappers}{os.pathsep}{cluster.env['PATH']}"
    return env, log


def _calls(log: Path) -> List[str]:
    calls = [Path(line).name for line in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def _queue(cluster: SlurmCluster) -> Dict[str, str]:
    shown = cluster.run(["squeue", "--noheader", "--array", "--format=%i %T"])
    assert shown.returncode == 0, shown.stderr
    return dict(line.split() for line in shown.stdout.splitlines() if line.strip())


def test_status_and_cancel_of_slurm_jobs_running_and_pending(cluster: SlurmCluster, tmp_path: Path) -> None:
    app_dir = tmp_path / "app"
    shutil.copytree(SUBMIT_APP, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(__file__).parent / "multinode_apps" / "held_gather.py", app_dir)
    env, log = _counting_slurm(tmp_path, cluster)
    # three one-node jobs of 2000 steps on two nodes: two run, the third waits for a node
    launcher = subprocess.Popen(
        [
            sys.executable,
            "app.py",
            "--multirun",
            "hydra/launcher=torchrun_slurm",
            "hydra.sweep.dir=sweep",
            "steps=10000",
            "x=1,2,3",
        ],
        cwd=app_dir,
        env=_env(cluster.env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    submitted = app_dir / "sweep" / ".slurm" / "submitted.json"
    try:

        def recorded_ids() -> List[str]:
            try:
                jobs = json.loads(submitted.read_text())
            except (OSError, ValueError):
                return []
            return [jobs[str(n)]["slurm_id"] for n in range(3)] if len(jobs) == 3 else []

        ids = _wait_for(recorded_ids, f"three jobs in {submitted}")
        _wait_for(
            lambda: [_queue(cluster).get(i) for i in ids] == ["RUNNING", "RUNNING", "PENDING"],
            "two running jobs and a pending one",
        )
        _calls(log)
        running = _tool(app_dir, "status", "sweep", env=env)
        assert _calls(log) == ["squeue"], "one squeue call for the whole sweep"
        assert running.returncode == 0, running.stdout + running.stderr
        lines = running.stdout.splitlines()
        assert lines[0] == f"sweep: a SLURM sweep, running (its launcher: {_holder(app_dir)})", running.stdout
        assert lines[1] == "3 jobs: 2 running, 1 pending", running.stdout
        rows = _rows(running.stdout)
        assert rows[0] == ["#", "state", "SLURM id", "elapsed", "overrides", "result"], rows
        assert [row[:3] for row in rows[1:]] == [
            ["0", "RUNNING", ids[0]],
            ["1", "RUNNING", ids[1]],
            ["2", "PENDING", ids[2]],
        ], running.stdout
        # a running job: its time, overrides, nodes; the pending one: no time yet, SLURM's reason
        assert {rows[1][5], rows[2][5]} == {f"on {node}" for node in cluster.nodes}, rows
        assert [rows[1][4], rows[2][4]] == ["x=1", "x=2"], rows
        assert rows[3][3] == "x=3" and re.fullmatch(r"pending \((Resources|Priority)\)", rows[3][4]), rows

        # no launcher waits any more (as after `detach`, or a login node lost): the jobs run on
        kill_tree(launcher)
        shown = json.loads(_tool(app_dir, "status", "sweep", "--json", env=env).stdout)
        assert _calls(log) == ["squeue"]
        assert (shown["runner"], shown["stage"], shown["launcher"]) == ("slurm", "detached", None), shown
        assert shown["counts"] == {"RUNNING": 2, "PENDING": 1} and shown["varying"] == ["x"], shown
        assert [(j["state"], j["recorded"], j["slurm_id"]) for j in shown["jobs"]] == [
            ("RUNNING", "RUNNING", ids[0]),
            ("RUNNING", "RUNNING", ids[1]),
            ("PENDING", "RUNNING", ids[2]),
        ], shown
        assert {shown["jobs"][0]["nodes"], shown["jobs"][1]["nodes"]} == set(cluster.nodes), shown
        assert (
            all(j["elapsed_s"] is not None for j in shown["jobs"][:2])
            and shown["jobs"][2]["elapsed_s"] is None
        )
        text = _tool(app_dir, "status", "sweep", env=env).stdout
        assert text.splitlines()[0] == (
            "sweep: a SLURM sweep, detached: no launcher waits for its SLURM jobs "
            "(the sweep's command, run again, collects them)"
        ), text
        _calls(log)

        cancelled = _tool(app_dir, "cancel", "sweep", env=env)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        array = ids[0].split("_")[0]
        assert cancelled.stdout == f"cancelled #0-#2 of sweep (SLURM jobs {array}_[0-2])\n", cancelled.stdout
        assert _calls(log) == ["squeue", "scancel"], "one squeue call, one scancel call"
        _wait_for(lambda: not set(ids) & set(_queue(cluster)), "the cancelled jobs gone from squeue", 120)
        ended = json.loads(_tool(app_dir, "status", "sweep", "--json", env=env).stdout)
        assert ended["stage"] == "unfinished", ended
        assert not {"RUNNING", "PENDING"} & {job["state"] for job in ended["jobs"]}, ended
        again = _tool(app_dir, "cancel", "sweep", env=env)
        assert again.returncode == 0, again.stderr
        assert again.stdout == "nothing to cancel: no SLURM job of sweep is queued or running\n", again.stdout
        # a controller that does not answer: the record still shows, with one line saying so
        failing = tmp_path / "failing"
        failing.mkdir()
        (failing / "squeue").write_text(
            "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact' >&2\nexit 1\n"
        )
        (failing / "squeue").chmod(0o755)
        down = _tool(app_dir, "status", "sweep", env=dict(env, PATH=f"{failing}{os.pathsep}{env['PATH']}"))
        assert down.returncode == 0, down.stderr
        assert down.stdout.splitlines()[2] == "squeue failed: where its SLURM jobs stand is not known", (
            down.stdout
        )
        assert [row[1:3] for row in _rows(down.stdout)[1:]] == [["SUBMITTED", i] for i in ids], down.stdout
    finally:
        kill_tree(launcher)
        leftover = [i for i in recorded_ids() if i in _queue(cluster)] if submitted.exists() else []
        if leftover:
            cluster.run(["scancel", *leftover])


def _holder(app_dir: Path) -> str:
    """Who holds the sweep's lock, as the launcher wrote it."""
    return (app_dir / "sweep" / ".torchrun_launcher.lock").read_text().strip()
