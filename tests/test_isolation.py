"""Every job alone, as torchrun would run it: what each rank sees when jobs run at once.

The app (`tests/isolation_app/`) is copied where a user would have it and run as a user
runs it (`python app.py -m ...` from its own directory). Its ranks record what they saw
from their first line (through `rank_probe`, a module of the app that reads torchrun's
variables when it is imported, as Lightning does), and a callback marks each job's start.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import psutil
import pytest

from tests.conftest import as_from_a_terminal, assert_gone, run_app, wait_for

APP_DIR = Path(__file__).parent / "isolation_app"
FAULT_APPS = Path(__file__).parent / "apps"

pytestmark = pytest.mark.timeout(300)


def _install(tmp_path: Path, source: Path = APP_DIR) -> Path:
    app_dir = tmp_path / "app"
    shutil.copytree(source, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return app_dir


def _records(sweep_dir: Path, job: int) -> Dict[int, Dict[str, Any]]:
    return {
        int(p.stem[len("rank") :]): json.loads(p.read_text())
        for p in (sweep_dir / str(job)).glob("rank*.json")
    }


def _sweep(app_dir: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_app(app_dir / "app.py", ["-m", "hydra.sweep.dir=sweep", *overrides], cwd=app_dir, check=check)


@pytest.mark.parametrize(
    "how",
    [
        ["hydra.launcher.start_method=forkserver"],
        ["hydra.launcher.start_method=spawn"],
        ["hydra.launcher.start_method=fork"],
        # every rank a real process under a wrapper, as numactl or nsys would run it
        ["hydra.launcher.launch_prefix=[env,'MARK=1']"],
    ],
    ids=["forkserver", "spawn", "fork", "launch_prefix"],
)
def test_concurrent_jobs_each_see_only_their_own_world(tmp_path: Path, how: List[str]) -> None:
    app_dir = _install(tmp_path)
    result = _sweep(
        app_dir,
        "hydra.launcher.parallel_jobs=2",
        *how,
        "meet=true",
        "all_reduce=true",
        "x=1,10",
    )
    sweep_dir = app_dir / "sweep"
    for job, x in enumerate((1, 10)):
        records = _records(sweep_dir, job)
        assert sorted(records) == [0, 1]
        for rank, record in records.items():
            expected = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                # this job's env_set and callback, never the other job's
                "JOB_TAG": f"tag{job}",
                "FROM_CALLBACK": f"job{job}",
            }
            # from the first line of the app's modules, as torchrun's ranks see them
            assert {k: record["at_import"][k] for k in expected} == expected
            assert {k: record["now"][k] for k in expected} == expected
            # the job's bookkeeping was done before its ranks started
            assert record["hydra_config_written"] and record["job_started"]
            assert record["cwd"] == record["cwd_at_import"] == str(app_dir)
            # each job's ranks form a group of their own: x summed over the job's two ranks
            assert record["sum"] == 2 * x and record["world"] == 2
        outcome = json.loads((sweep_dir / str(job) / "on_job_end.json").read_text())
        assert outcome["status"] == "COMPLETED"
        assert outcome["value"] == repr({"x": x, "rank": 0, "attempt": 0})
    # the app's module body ran in the launcher (Hydra's run of the script) and, as under
    # torchrun, once in every rank, with the rank's own RANK from its first line; never in
    # a job's process or the warm server
    runs = (app_dir / "body_runs.txt").read_text().splitlines()
    rank_pids = {str(r["pid"]): str(rank) for job in (0, 1) for rank, r in _records(sweep_dir, job).items()}
    assert [line for line in runs if line.endswith("RANK=None")] == [runs[0]], runs
    assert sorted(line.split()[0] for line in runs[1:]) == sorted(rank_pids), runs
    assert all(line.split()[1] == f"RANK={rank_pids[line.split()[0]]}" for line in runs[1:]), runs
    # console lines of jobs running at once say which job they come from
    assert "[#0 default0]:hello from job 1 rank 0" in result.stdout
    assert "[#1 default1]:hello from job 10 rank 1" in result.stdout


def test_a_variable_only_one_job_sets_reaches_no_other_job_and_not_the_launcher(tmp_path: Path) -> None:
    """Every job sets JOB_TAG, so a leak of it would be overwritten: ONLY_ONE_JOB is job 0's
    alone (`+env=only_this_job`), and jobs 0 and 1 run at once."""
    app_dir = _install(tmp_path)
    _sweep(app_dir, "hydra.launcher.parallel_jobs=2", "meet=true", "+env=only_this_job,nothing")
    sweep_dir = app_dir / "sweep"
    for job, expected in ((0, "set by one job alone"), (1, None)):
        records = _records(sweep_dir, job)
        assert sorted(records) == [0, 1], records
        for record in records.values():
            assert record["at_import"]["ONLY_ONE_JOB"] == record["now"]["ONLY_ONE_JOB"] == expected, job
            assert record["now"]["JOB_TAG"] == f"tag{job}"
    # the launcher's own environment, after its jobs: neither job's env_set
    launcher_env = json.loads((sweep_dir / "launcher_env.json").read_text())
    assert launcher_env == {"JOB_TAG": None, "ONLY_ONE_JOB": None}, launcher_env


def test_fixed_port_with_parallel_jobs_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    result = run_app(
        app_dir / "app.py",
        [
            "-m",
            "hydra.sweep.dir=sweep",
            "hydra.launcher.parallel_jobs=2",
            "hydra.launcher.master_port=29511",
            "x=1,10",
        ],
        cwd=app_dir,
        check=False,
        full_error=False,
    )
    assert result.returncode != 0
    assert (
        "hydra.launcher.master_port=29511 cannot serve parallel_jobs=2: jobs running at once would join "
        "one rendezvous" in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not list((app_dir / "sweep").glob("*/rank*.json"))


def test_launch_prefix_retry_returns_the_last_attempts_value(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    _sweep(
        app_dir,
        "hydra.launcher.launch_prefix=[env,'MARK=1']",
        "hydra.launcher.max_restarts=1",
        "fail_first_attempt=true",
        "x=3",
    )
    outcome = json.loads((app_dir / "sweep" / "0" / "on_job_end.json").read_text())
    assert outcome == {"status": "COMPLETED", "value": repr({"x": 3, "rank": 0, "attempt": 1})}


@pytest.mark.parametrize(
    "script_keys",
    [
        ["hydra.launcher.training_script=train.py"],
        ["hydra.launcher.training_script=train", "hydra.launcher.module=true"],
    ],
)
def test_script_paths_are_taken_from_where_the_sweep_was_launched(
    tmp_path: Path, script_keys: List[str]
) -> None:
    app_dir = _install(tmp_path)
    _sweep(app_dir, *script_keys, "hydra.launcher.training_script_args=[--x,'${x}']", "x=4,5")
    for job, x in enumerate((4, 5)):
        for rank in (0, 1):
            # the script runs in its job dir, found where the user launched the sweep
            assert (app_dir / "sweep" / str(job) / f"script_rank{rank}.txt").read_text() == f"--x {x}"


def _torch_lacks(field_name: str) -> bool:
    """Whether the installed torch's LaunchConfig lacks the field (each older release lacks some)."""
    from hydra_plugins.hydra_torchrun_launcher._job.launch_config import launch_config_fields

    return field_name not in launch_config_fields()


def test_virtual_local_rank_gives_each_rank_its_own_device(tmp_path: Path) -> None:
    if _torch_lacks("virtual_local_rank"):
        pytest.skip("this torch has no virtual_local_rank: refused by name (test_launcher's cannot_honour)")
    app_dir = _install(tmp_path)
    _sweep(
        app_dir,
        "hydra.launcher.parallel_jobs=2",
        "hydra.launcher.devices=[0,1,2,3]",
        "hydra.launcher.virtual_local_rank=true",
        # relative: from where the sweep was launched, whatever the jobs' dirs
        "hydra.launcher.log_dir=rank_logs",
        "meet=true",
        "x=0,1",
    )
    # each job's ranks log under rank_logs/ in a dir of the job's own (its rendezvous id)
    runs = sorted(p.name.rsplit("_", 1)[0] for p in (app_dir / "rank_logs").iterdir())
    assert len(runs) == 2 and runs[0] != runs[1]
    assert len(list((app_dir / "rank_logs").glob("*/attempt_0/*/stdout.log"))) == 4
    assert not list((app_dir / "sweep").glob("*/torchrun_logs"))
    seen = []
    for job in (0, 1):
        for record in _records(app_dir / "sweep", job).values():
            assert record["now"]["LOCAL_RANK"] == "0"
            seen.append(record["at_import"]["CUDA_VISIBLE_DEVICES"])
    # four ranks at once, each on one device of its own
    assert sorted(seen) == ["0", "1", "2", "3"]


def test_ranks_inherit_the_launchers_environment_as_it_is_when_their_job_starts(tmp_path: Path) -> None:
    """The launcher's environment changes between sweeps of one process (as a sweeper may)."""
    app_dir = _install(tmp_path)
    code = (
        "import os, sys, runpy\n"
        "for value in ('first', 'second'):\n"
        "    os.environ['FROM_LAUNCHER'] = value\n"
        "    sys.argv = ['app.py', '-m', f'hydra.sweep.dir=sweep_{value}', 'x=0']\n"
        "    try:\n"
        "        runpy.run_path('app.py', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, e.code\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=app_dir, check=True, timeout=240)
    for value in ("first", "second"):
        records = _records(app_dir / f"sweep_{value}", 0)
        assert [r["at_import"]["FROM_LAUNCHER"] for r in records.values()] == [value, value]


def _start_as_from_a_terminal(command: List[str], cwd: Path, out: Path, **popen: Any) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("HYDRA_FULL_ERROR", None)
    with out.open("w") as stdout:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT, **popen)


def _ignore_hangup() -> None:
    """What `nohup` does before it runs the command."""
    as_from_a_terminal()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_signal_ignored_by_the_launcher_stays_ignored_with_parallel_jobs(tmp_path: Path) -> None:
    if _torch_lacks("signals_to_handle"):
        pytest.skip("this torch's agent handles SIGHUP whatever the launcher ignores: the next test")
    app_dir = _install(tmp_path)
    sweep_dir = app_dir / "sweep"
    command = [
        sys.executable,
        "app.py",
        "-m",
        "hydra.launcher.parallel_jobs=2",
        "hydra.sweep.dir=sweep",
        "hold=5",
        "x=0,1",
    ]
    proc = _start_as_from_a_terminal(command, app_dir, tmp_path / "out.txt", preexec_fn=_ignore_hangup)
    try:
        wait_for(lambda: len(list(sweep_dir.glob("*/started_rank*"))) == 4, 120, "both jobs' ranks")
        # a hangup reaches the launcher and, as `kill -HUP` may, every process of the sweep
        for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            process.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=120) == 0, (tmp_path / "out.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (tmp_path / "out.txt").read_text()
    assert "Traceback" not in output
    for job in (0, 1):
        assert sorted(_records(sweep_dir, job)) == [0, 1]
        assert json.loads((sweep_dir / str(job) / "on_job_end.json").read_text())["status"] == "COMPLETED"


def test_without_signals_to_handle_an_ignored_signal_torch_handles_is_said_at_launch(tmp_path: Path) -> None:
    """torch before 2.10 stops a job's ranks on SIGHUP even under nohup: the launch says so."""
    import torch

    if not _torch_lacks("signals_to_handle"):
        pytest.skip("this torch's agent leaves an ignored signal ignored: the test above")
    app_dir = _install(tmp_path)
    command = [sys.executable, "app.py", "-m", "hydra.sweep.dir=sweep", "x=0,1"]
    proc = _start_as_from_a_terminal(command, app_dir, tmp_path / "out.txt", preexec_fn=_ignore_hangup)
    try:
        assert proc.wait(timeout=240) == 0, (tmp_path / "out.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = (
        f"torch {torch.__version__} has no LaunchConfig.signals_to_handle: SIGHUP, which this process "
        "ignores, stops a job's ranks if it is sent to the job's own process (the terminal's does not "
        "reach it: jobs run in a process group of their own)"
    )
    output = (tmp_path / "out.txt").read_text()
    assert sum(said in line for line in output.splitlines()) == 1, output  # once, for the whole sweep


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_with_parallel_jobs_ends_with_one_line_and_no_process_left(
    tmp_path: Path, presses: int
) -> None:
    app_dir = _install(tmp_path, FAULT_APPS)
    sweep_dir = app_dir / "sweep"
    command = [
        sys.executable,
        "fault_app.py",
        "-m",
        "hydra/launcher=torchrun",
        "hydra.launcher.nproc_per_node=2",
        "hydra.launcher.parallel_jobs=2",
        f"hydra.sweep.dir={sweep_dir}",
        "mode=sleep",
        "+x=0,1,2",
    ]
    # a terminal's Ctrl-C reaches the foreground process group: the launcher's own group
    out = tmp_path / "out.txt"
    proc = _start_as_from_a_terminal(
        command, app_dir, out, start_new_session=True, preexec_fn=as_from_a_terminal
    )
    try:
        wait_for(lambda: len(list(sweep_dir.glob("*/pids/*.pid"))) == 4, 120, "both jobs' ranks")
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        if presses == 2:
            # the second press while the jobs' agents are stopping their ranks
            wait_for(lambda: "death signal" in out.read_text(), 30, "the agents to act on the first press")
            os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        stopped_in = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (tmp_path / "out.txt").read_text()
    assert code == 128 + signal.SIGINT, output
    assert "Traceback" not in output
    # one line: what finished, what was stopped and where its logs are, what never started
    assert output.rstrip().splitlines()[-1] == (
        "[torchrun launcher] SIGINT: the sweep was stopped: stopped #0, #1 (logs in sweep/0, sweep/1); "
        "not started #2; summary in sweep/sweep_summary.json"
    ), output
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert [job["status"] for job in summary] == ["STOPPED", "STOPPED", "NOT_STARTED"]
    assert stopped_in < 30
    assert_gone(descendants)
    # the third job never started
    assert not (sweep_dir / "2").exists()


def test_launch_from_a_thread_that_is_not_the_main_thread(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    code = (
        "import sys, runpy, threading\n"
        "errors = []\n"
        "def run():\n"
        "    sys.argv = ['app.py', '-m', 'hydra.sweep.dir=sweep', 'x=0,1']\n"
        "    try:\n"
        "        runpy.run_path('app.py', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        if e.code: errors.append(e.code)\n"
        "    except BaseException as e:\n"
        "        errors.append(repr(e))\n"
        "t = threading.Thread(target=run)\n"
        "t.start(); t.join()\n"
        "assert not errors, errors\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=app_dir, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    assert sorted(_records(app_dir / "sweep", 1)) == [0, 1]


def test_a_survivor_that_handles_sigterm_is_stopped_within_shutdown_timeout(tmp_path: Path) -> None:
    """torch's own join waits a hard-coded 30 s after a rank fails; the job's shutdown_timeout holds."""
    app_dir = _install(tmp_path, FAULT_APPS)
    sweep_dir = app_dir / "sweep"
    started = time.monotonic()
    result = run_app(
        app_dir / "fault_app.py",
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.launcher.shutdown_timeout=2",
            f"hydra.sweep.dir={sweep_dir}",
            "mode=fail",
            "how=raise",
            "survivors=sleep",
            "ignore_signals=true",
        ],
        cwd=app_dir,
        check=False,
    )
    took = time.monotonic() - started
    assert result.returncode != 0
    ends = [json.loads(line) for line in (sweep_dir / "jobs.jsonl").read_text().splitlines()]
    end = next(r for r in ends if r["event"] == "end")
    assert end["status"] == "FAILED" and end["summary"].startswith("rank 1 "), end
    # two grace periods of 2 s at most (peers first, then SIGTERM to SIGKILL), plus start-up
    assert took < 25, took


@pytest.mark.parametrize(
    "preload, preloaded, warning",
    [
        ([], True, None),  # auto: the installed packages the app imported
        (["hydra.launcher.preload=[]"], False, None),
        (
            ["hydra.launcher.preload=[psutil,no_such_module_xyz]"],
            True,
            "hydra.launcher.preload: no_such_module_xyz was not preloaded (ModuleNotFoundError: "
            "No module named 'no_such_module_xyz'); ranks import it themselves",
        ),
    ],
    ids=["auto", "torch_only", "a_module_that_fails"],
)
def test_preload_imports_what_the_app_uses_once_in_the_warm_server(
    tmp_path: Path, preload: List[str], preloaded: bool, warning: Any
) -> None:
    app_dir = _install(tmp_path)
    result = _sweep(app_dir, *preload, "x=0")
    records = _records(app_dir / "sweep", 0)
    assert [records[rank]["psutil_preloaded"] for rank in (0, 1)] == [preloaded, preloaded]
    # preloading changes nothing of what the ranks see from their first line
    assert [records[rank]["at_import"]["RANK"] for rank in (0, 1)] == ["0", "1"]
    if warning:
        assert (result.stdout + result.stderr).count(warning) == 1, result.stdout
