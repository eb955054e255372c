"""Faults, with real processes and real signals: what a user of the launcher sees when ranks
die, raise, hang, or the launcher itself is told to stop.

Most tests run a small Hydra app (`tests/apps/`) as a user would (`python app.py -m ...`)
and assert on its exit code, its job dirs, the error Hydra prints, and what the app's
`Recorder` callback saw in the launcher process (each job's status and error, the
launcher's fds, threads and descendant processes when the job ended). Every rank records
its pid, and every test ends by proving those pids are gone.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterable, List, NamedTuple, Tuple

import psutil
import pytest
from omegaconf import DictConfig

from tests.conftest import as_from_a_terminal, assert_gone, run_app, wait_for

APPS = Path(__file__).parent / "apps"
LAUNCHER = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"]
# from a rank's failure to its job reported FAILED
FAILED_WITHIN_S = 5.0
# from the launcher getting SIGINT / SIGTERM to every process of the sweep gone
STOPPED_WITHIN_S = 10.0
SWEEP_TIMEOUT_S = 150
# ranks deaf to SIGINT/SIGTERM get this long to shut down, unless a second Ctrl-C kills them
DEAF_SHUTDOWN_TIMEOUT_S = 120


# --- helpers -------------------------------------------------------------------------------


def _install_apps(tmp_path: Path) -> Path:
    """The test apps, copied where a user would have them (once per test)."""
    app_dir = tmp_path / "app"
    if not app_dir.is_dir():
        shutil.copytree(APPS, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return app_dir


def _sweep_command(
    tmp_path: Path, *overrides: str, app: str = "fault_app.py", name: str = "multirun"
) -> List[str]:
    app_path = _install_apps(tmp_path) / app
    return [sys.executable, str(app_path), "-m", *LAUNCHER, f"hydra.sweep.dir={tmp_path / name}", *overrides]


def _env(**extra: str) -> Dict[str, str]:
    return dict(os.environ, HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1", **extra)


def _sweep(
    tmp_path: Path, *overrides: str, app: str = "fault_app.py", name: str = "multirun", **env: str
) -> subprocess.CompletedProcess:
    """`python app.py -m ...` as a user runs it; returns once the launcher has exited.

    Its output goes to files, not pipes (as in conftest.run_app): a process left behind
    holding the pipes would otherwise hang the test instead of failing it.
    """
    command = _sweep_command(tmp_path, *overrides, app=app, name=name)
    out, err = tmp_path / f"{name}.stdout", tmp_path / f"{name}.stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(command, cwd=tmp_path, env=_env(**env), stdout=stdout, stderr=stderr)
    try:
        returncode = proc.wait(timeout=SWEEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            _kill(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(command, returncode, out.read_text(), err.read_text())


def _records(sweep_dir: Path, event: str) -> Dict[int, Dict[str, Any]]:
    """The Recorder's records of one kind ("start" / "end"), by job number."""
    path = sweep_dir / "jobs.jsonl"
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    return {r["num"]: r for r in lines if r["event"] == event}


def _rank_pids(job_dir: Path) -> List[int]:
    return [int(p.read_text()) for p in sorted(job_dir.glob("pids/*.pid"))]


def _all_rank_pids(sweep_dir: Path) -> List[int]:
    return [pid for job_dir in sorted(sweep_dir.iterdir()) if job_dir.is_dir() for pid in _rank_pids(job_dir)]


def _output(result: subprocess.CompletedProcess) -> str:
    return f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def _assert_no_trace(pids: Iterable[int], ours: Iterable[int], deadline: float) -> None:
    """By `deadline` (monotonic) every pid has exited, and none is a zombie of one of `ours`."""
    pids, ours = set(pids), set(ours)

    def left() -> List[str]:
        found = []
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{pid} running: {' '.join(proc.cmdline())}")
                elif proc.ppid() in ours:
                    found.append(f"{pid} zombie of {proc.ppid()}")
            except psutil.NoSuchProcess:
                pass
        return found

    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    found = left()
    if found:
        _kill(pids)
    assert not found, f"left behind: {found}"


def _kill(pids: Iterable[int]) -> None:
    """Kill what of `pids` still runs and is ours (a failed test must leave no orphan behind)."""
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if "multiprocessing" in " ".join(proc.cmdline()) or "fault_app" in " ".join(proc.cmdline()):
                proc.kill()
        except psutil.Error:
            pass


def _assert_sweep_left_nothing(sweep_dir: Path) -> None:
    """Every rank of the sweep, and every process the launcher had while it ran, is gone."""
    recorded = [
        pid
        for kind in ("start", "end")
        for r in _records(sweep_dir, kind).values()
        for pid in r["descendants"]
    ]
    pids = set(_all_rank_pids(sweep_dir)) | set(recorded)
    try:
        assert_gone(pids)
    except AssertionError:
        _kill(pids)
        raise


def _failed_jobs_ranks_stopped(sweep_dir: Path, nums: Iterable[int]) -> None:
    """When the launcher reported job N, none of job N's ranks was still its descendant."""
    ends = _records(sweep_dir, "end")
    for num in nums:
        alive = set(_rank_pids(sweep_dir / str(num))) & set(ends[num]["descendants"])
        assert not alive, f"job {num} was reported while its ranks {alive} still ran"


# --- 1. a rank dies ------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_rank_killed_by_signal_or_exiting_fails_its_job_and_the_sweep_goes_on(tmp_path: Path) -> None:
    # rank 1 dies (the other rank sleeps); the last job behaves
    result = _sweep(tmp_path, "mode=fail", "how=SIGKILL,SIGSEGV,exit3,SIGINT,interrupt,none")
    sweep_dir = tmp_path / "multirun"
    ends = _records(sweep_dir, "end")

    assert result.returncode != 0, _output(result)
    # Hydra prints the first failed job's error: the rank and the signal
    assert "rank 1 " in result.stderr and "SIGKILL" in result.stderr, _output(result)
    assert sorted(ends) == [0, 1, 2, 3, 4, 5], _output(result)
    # a SIGINT, or a KeyboardInterrupt the app raises, ends a rank as it ends a script that
    # torchrun runs: by SIGINT, which fails its job at once (the other rank would wait for ever)
    expected = {
        0: "killed by signal SIGKILL",
        1: "killed by signal SIGSEGV",
        2: "exited with code 3",
        3: "killed by signal SIGINT",
        4: "killed by signal SIGINT",
    }
    for num, cause in expected.items():
        assert ends[num]["status"] == "FAILED"
        first_line = ends[num]["error"].splitlines()[0]
        assert first_line.startswith("JobFailedError: rank 1 ") and cause in first_line, ends[num]["error"]
        # torch's hint about @record means nothing to a user of the launcher
        assert "To enable traceback" not in ends[num]["error"], ends[num]["error"]
        failed_at = float((sweep_dir / str(num) / "fail_time").read_text())
        assert ends[num]["t"] - failed_at < FAILED_WITHIN_S, (
            f"job {num} reported {ends[num]['t'] - failed_at:.1f}s late"
        )
    _failed_jobs_ranks_stopped(sweep_dir, expected)
    assert ends[5]["status"] == "COMPLETED"
    assert (sweep_dir / "5" / "done_rank0").exists() and (sweep_dir / "5" / "done_rank1").exists()
    _assert_sweep_left_nothing(sweep_dir)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tmpdir", ["short", "long"])
def test_a_job_ends_as_its_ranks_return_not_at_the_agents_next_look(tmp_path: Path, tmpdir: str) -> None:
    # torch's agent looks at its ranks every monitor_interval, and a rank whose task returned
    # waits for it to take its value; a job still ends as its ranks return, also where the
    # temp dir's path is too long to hold a socket's
    interval_s = 60
    temp = tmp_path / ("t" if tmpdir == "short" else "a-temp-dir-" + "x" * 120)
    temp.mkdir()
    result = _sweep(
        tmp_path, f"hydra.launcher.monitor_interval={interval_s}", "mode=ok,allreduce", TMPDIR=str(temp)
    )
    sweep_dir = tmp_path / "multirun"
    starts, ends = _records(sweep_dir, "start"), _records(sweep_dir, "end")

    assert result.returncode == 0, _output(result)
    for num in (0, 1):
        assert ends[num]["status"] == "COMPLETED", _output(result)
        assert ends[num]["value"] == repr({"rank": 0, "job": num}), ends[num]
        took = ends[num]["t"] - starts[num]["t"]
        assert took < interval_s / 2, f"job {num} took {took:.1f}s: it waited for the agent's next look"
    _assert_sweep_left_nothing(sweep_dir)


@pytest.mark.timeout(180)
def test_a_rank_that_exits_with_code_0_before_its_task_returns_fails_its_job(tmp_path: Path) -> None:
    # `os._exit(0)` in one rank's task: its value is gone, and torch would wait for it for ever
    # (job_timeout only keeps a regression from hanging the test)
    result = _sweep(tmp_path, "mode=fail", "how=exit0", "hydra.launcher.job_timeout=90")
    sweep_dir = tmp_path / "multirun"
    ends = _records(sweep_dir, "end")

    assert result.returncode != 0, _output(result)
    assert ends[0]["status"] == "FAILED", _output(result)
    first_line = ends[0]["error"].splitlines()[0]
    assert first_line.startswith("JobFailedError: rank 1 (local_rank 1, pid "), ends[0]["error"]
    assert first_line.endswith("exited with code 0 before its task returned (os._exit?): its value is lost")
    _failed_jobs_ranks_stopped(sweep_dir, [0])
    _assert_sweep_left_nothing(sweep_dir)


@pytest.mark.timeout(180)
def test_sys_exit_in_every_rank_s_task_is_a_return_of_none(tmp_path: Path) -> None:
    # as a script's `sys.exit()` ends its rank successfully under torchrun
    result = _sweep(tmp_path, "mode=fail", "how=sys_exit", "bad_rank=all", "hydra.launcher.job_timeout=90")
    ends = _records(tmp_path / "multirun", "end")
    assert result.returncode == 0, _output(result)
    assert ends[0]["status"] == "COMPLETED" and ends[0]["value"] == "None", ends[0]
    _assert_sweep_left_nothing(tmp_path / "multirun")


@pytest.mark.timeout(180)
def test_a_rank_that_left_no_traceback_ends_the_sweep_with_its_last_lines(tmp_path: Path) -> None:
    """A rank killed by a signal or exiting non-zero has no traceback for Hydra's last word:
    its last lines of stderr take its place, shown by default (not only with
    HYDRA_FULL_ERROR=1); the job's line and the table keep the one-line account."""
    app = _install_apps(tmp_path) / "fault_app.py"
    args = ["-m", *LAUNCHER, f"hydra.sweep.dir={tmp_path / 'multirun'}", "mode=fail", "how=exit3"]
    result = run_app(app, args, cwd=tmp_path, check=False, full_error=False)
    assert result.returncode != 0, _output(result)
    told = result.stderr[result.stderr.index("Error executing job") :]
    assert told.splitlines()[1].startswith("rank 1 (local_rank 1, pid "), _output(result)
    assert "exited with code 3" in told.splitlines()[1], _output(result)
    assert "its last lines:\nrank 1 fails now (exit3)\n" in told, _output(result)
    job_line = next(line for line in result.stdout.splitlines() if "job 1 of 1 ended" in line)
    assert job_line.endswith("exited with code 3"), _output(result)
    assert "its last lines" not in result.stdout, _output(result)
    summary = json.loads((tmp_path / "multirun" / "sweep_summary.json").read_text())
    assert "its last lines" not in summary["jobs"][0]["error"], summary
    _assert_sweep_left_nothing(tmp_path / "multirun")


# --- 2. a rank raises while the others wait for it in a collective -------------------------


@pytest.mark.timeout(180)
def test_raising_rank_fails_its_job_while_the_others_wait_in_a_collective(tmp_path: Path) -> None:
    # rank 1 raises (or is killed) after init_process_group; rank 0 waits in a collective
    result = _sweep(tmp_path, "mode=fail", "how=raise,SIGKILL", "survivors=all_reduce,barrier")
    sweep_dir = tmp_path / "multirun"
    ends = _records(sweep_dir, "end")

    assert result.returncode != 0, _output(result)
    assert "Error executing job" in result.stderr, _output(result)
    assert sorted(ends) == [0, 1, 2, 3], _output(result)
    for num, end in ends.items():
        assert end["status"] == "FAILED"
        assert end["summary"].startswith("rank "), end["summary"]
        failed_at = float((sweep_dir / str(num) / "fail_time").read_text())
        assert end["t"] - failed_at < FAILED_WITHIN_S, f"job {num} reported {end['t'] - failed_at:.1f}s late"
    # the survivors blocked in the collective were stopped, not left hanging
    _failed_jobs_ranks_stopped(sweep_dir, ends)
    _assert_sweep_left_nothing(sweep_dir)

    # the error is the failed rank's own: its exception, or the signal that killed it
    causes = {0: "boom from rank 1", 1: "boom from rank 1", 2: "SIGKILL", 3: "SIGKILL"}
    wrong = {
        num: ends[num]["summary"].splitlines()[0]
        for num, cause in causes.items()
        if not (ends[num]["summary"].startswith("rank 1 ") and cause in ends[num]["summary"])
    }
    assert not wrong, f"the error names another rank than the one that failed first: {wrong}"
    assert ends[0]["error"] == "ValueError: boom from rank 1", ends[0]
    assert 'raise ValueError(f"boom from rank {rank}")' in ends[0]["traceback"], ends[0]  # its frames


# --- 3. job_timeout ------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_job_timeout_stops_the_ranks_and_fails_the_job(tmp_path: Path) -> None:
    # job 1's ranks never end and ignore SIGTERM/SIGINT: stopping them needs SIGKILL
    # (job 0 warms the forkserver up, so job 1's ranks start well within the timeout)
    timeout, shutdown = 5, 1
    result = _sweep(
        tmp_path,
        "mode=sleep",
        "ignore_signals=true",
        "good_jobs=[0,2]",
        "+x=0,1,2",
        f"hydra.launcher.job_timeout={timeout}",
        f"hydra.launcher.shutdown_timeout={shutdown}",
    )
    sweep_dir = tmp_path / "multirun"
    starts, ends = _records(sweep_dir, "start"), _records(sweep_dir, "end")

    assert result.returncode != 0, _output(result)
    assert "job_timeout" in result.stderr, _output(result)
    assert ends[1]["status"] == "FAILED" and "job_timeout" in ends[1]["error"], ends[1]
    took = ends[1]["t"] - starts[1]["t"]
    assert timeout <= took < timeout + shutdown + 5, f"job 1 ended after {took:.1f}s"
    # the graceful signal came first (the ranks noted it and carried on), then the kill
    for rank in (0, 1):
        assert "SIGTERM" in (sweep_dir / "1" / f"signals_rank{rank}").read_text()
    _failed_jobs_ranks_stopped(sweep_dir, [1])
    assert [ends[0]["status"], ends[2]["status"]] == ["COMPLETED", "COMPLETED"]
    _assert_sweep_left_nothing(sweep_dir)


# the launch prefix that makes a rank's start slow: it notes its own pid and its sleep's
SLOW_START = """#!/bin/sh
echo $$ > "$SLOW_START_DIR/prefix.$$"
sleep {sleep_s} &
echo $! > "$SLOW_START_DIR/sleep.$!"
wait $!
exec "$@"
"""
SLOW_START_S = 30


@pytest.mark.timeout(180)
def test_job_timeout_while_ranks_start_leaves_no_rank(tmp_path: Path) -> None:
    # every rank starts through a launch prefix that sleeps 30 s first: the 2 s deadline lands
    # while the agent is starting the ranks, before any rank's Python runs
    marks = tmp_path / "slow_start"
    marks.mkdir()
    prefix = tmp_path / "slow_start.sh"
    prefix.write_text(SLOW_START.format(sleep_s=SLOW_START_S))
    prefix.chmod(0o755)
    timeout = 2
    result = _sweep(
        tmp_path,
        "mode=sleep",
        "+x=0,1",
        f"hydra.launcher.launch_prefix=[{prefix}]",
        f"hydra.launcher.job_timeout={timeout}",
        "hydra.launcher.shutdown_timeout=1",
        SLOW_START_DIR=str(marks),
    )
    sweep_dir = tmp_path / "multirun"
    starts, ends = _records(sweep_dir, "start"), _records(sweep_dir, "end")
    started = [int(p.name.split(".")[1]) for p in marks.iterdir()]
    try:
        assert result.returncode != 0, _output(result)
        assert sorted(ends) == [0, 1], _output(result)
        for num in (0, 1):
            assert ends[num]["status"] == "FAILED", ends[num]
            first, *rest = ends[num]["error"].splitlines()
            assert first.endswith(
                f"the job ran past hydra.launcher.job_timeout={timeout}s; its ranks were stopped"
            ), ends[num]
            # the ranks' processes ran their launch prefix: named, without a stack of theirs
            for rank in (0, 1):
                assert any(
                    line.startswith(f"still running: rank {rank} (local_rank {rank}, pid ") for line in rest
                )
                unknown = "not known (a launch prefix or a program not Python runs there)"
                assert f"rank {rank}'s stack: {unknown}" in rest
            # the deadline, not the slow start, ended it: far sooner than the prefix's sleep
            took = ends[num]["t"] - starts[num]["t"]
            assert took < SLOW_START_S / 2, f"job {num} ended after {took:.1f}s"
            # the deadline came while the ranks were starting: both prefixes ran, no rank did
            assert not _rank_pids(sweep_dir / str(num)), _output(result)
        assert len(list(marks.glob("prefix.*"))) == len(list(marks.glob("sleep.*"))) == 4, started
        assert_gone(started)
    finally:
        _kill(started)


# --- 4. Ctrl-C / SIGTERM to the launcher ---------------------------------------------------


class Stop(NamedTuple):
    sig: signal.Signals
    to_group: bool = False  # to the launcher's process group, as a terminal's Ctrl-C does
    twice: bool = False  # again once the agent is acting on the first
    overrides: Tuple[str, ...] = ()
    running: Tuple[int, ...] = (1,)  # the jobs whose ranks run when the signal comes


STOPS = {
    "sigint": Stop(signal.SIGINT),
    "sigterm": Stop(signal.SIGTERM),
    "ctrl_c_to_the_group": Stop(signal.SIGINT, to_group=True),
    # the second Ctrl-C lands while the agent waits for ranks deaf to the first; their
    # shutdown_timeout is far away, so only the second press's SIGKILL ends them in time
    "sigint_twice": Stop(
        signal.SIGINT,
        twice=True,
        overrides=("ignore_signals=true", f"hydra.launcher.shutdown_timeout={DEAF_SHUTDOWN_TIMEOUT_S}"),
    ),
    # two jobs running at once: every rank of both goes
    "sigint_parallel_jobs": Stop(
        signal.SIGINT, overrides=("hydra.launcher.parallel_jobs=2",), running=(1, 2)
    ),
    # killed outright (OOM killer, scheduler): only the ranks' parent-death signal is left
    "sigkill": Stop(signal.SIGKILL),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "name",
    [name for name in STOPS],
)
def test_stopping_the_launcher_stops_every_rank(tmp_path: Path, name: str) -> None:
    stop = STOPS[name]
    sweep_dir = tmp_path / "multirun"
    # job 0 finishes; the jobs in `stop.running` sleep; the later ones must never start
    command = _sweep_command(tmp_path, "mode=sleep", "good_jobs=[0]", "+x=0,1,2,3", *stop.overrides)
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        launcher = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=_env(),
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=as_from_a_terminal,
        )
    ours = {launcher.pid}
    try:
        wait_for(
            lambda: (
                all(len(_rank_pids(sweep_dir / str(n))) == 2 for n in stop.running)
                or launcher.poll() is not None
            ),
            120,
            f"the ranks of jobs {stop.running}",
        )
        assert launcher.poll() is None, err.read_text()
        ranks = _all_rank_pids(sweep_dir)
        ours |= {p.pid for p in psutil.Process(launcher.pid).children(recursive=True)}

        sent = time.monotonic()
        if stop.to_group:
            os.killpg(launcher.pid, stop.sig)
        else:
            os.kill(launcher.pid, stop.sig)
        if stop.twice:
            wait_for(lambda: "death signal" in err.read_text(), 30, "the agent to act on the first signal")
            os.kill(launcher.pid, stop.sig)
            sent = time.monotonic()  # from here on, nothing waits for the deaf ranks
        try:
            returncode = launcher.wait(timeout=STOPPED_WITHIN_S if stop.twice else 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the launcher still ran {STOPPED_WITHIN_S:g}s after the last {stop.sig.name}"
                f"\n{err.read_text()}"
            ) from None
    finally:
        if launcher.poll() is None:
            _kill(ours)
            launcher.kill()
            launcher.wait()

    if stop.sig == signal.SIGKILL:
        assert returncode == -signal.SIGKILL
    else:
        assert returncode == 128 + stop.sig, err.read_text()
        # one line says what happened; no traceback of the launcher's, the agents' or the ranks'
        assert (
            f"[torchrun launcher] {signal.Signals(stop.sig).name}: the sweep was stopped" in err.read_text()
        )
        assert "Traceback" not in err.read_text() + out.read_text(), err.read_text()
    _assert_no_trace(set(ranks) | ours, ours, sent + STOPPED_WITHIN_S)
    # the finished job keeps its outputs; the stopped sweep started nothing more
    assert (sweep_dir / "0" / "done_rank0").exists() and (sweep_dir / "0" / ".hydra" / "config.yaml").exists()
    later = [n for n in range(max(stop.running) + 1, 4) if (sweep_dir / str(n) / "pids").exists()]
    assert not later, f"the sweep went on after being stopped: jobs {later} started"


def _sentinel_handler(signum: int, frame: Any) -> None:
    raise AssertionError(f"signal {signum} reached the test's own handler")


def _in_process_task(cfg: DictConfig) -> Any:
    if cfg.mode == "raise":
        raise ValueError("boom")
    if cfg.mode == "sleep":
        while True:
            time.sleep(1)
    return int(os.environ["RANK"])


def _in_process_sweep(hydra_sweep_runner: Any, tmp_path: Path, *overrides: str) -> Any:
    """A sweep of `_in_process_task` in this process, with the launcher and `overrides`."""
    return hydra_sweep_runner(
        calling_file=__file__,
        calling_module=None,
        task_function=_in_process_task,
        config_path=None,
        config_name=None,
        overrides=[*LAUNCHER, *overrides],
        temp_dir=tmp_path / "multirun",
    )


@pytest.mark.timeout(180)
def test_launcher_signal_handlers_are_the_same_after_its_jobs(
    hydra_sweep_runner: Any, tmp_path: Path
) -> None:
    watched = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    originals = {sig: signal.getsignal(sig) for sig in watched}
    # pytest-timeout's SIGALRM handler and timer must survive too (a SIGALRM-based deadline
    # would replace the one and cancel the other)
    alarm_handler = signal.getsignal(signal.SIGALRM)
    alarm_before = signal.getitimer(signal.ITIMER_REAL)[0]
    # torch's agent names the signals it handles in the launcher's environment
    agent_signals_var = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    for sig in watched:
        signal.signal(sig, _sentinel_handler)
    try:
        sweep = _in_process_sweep(
            hydra_sweep_runner,
            tmp_path,
            "hydra.launcher.job_timeout=4",
            "hydra.launcher.shutdown_timeout=1",
            "+mode=ok,raise,sleep",
        )
        with pytest.raises(Exception, match="boom"):  # the sweeper re-raises the first failed job
            with sweep:
                pass
        after = {sig: signal.getsignal(sig) for sig in watched}
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
    assert all(handler is _sentinel_handler for handler in after.values()), after
    assert signal.getsignal(signal.SIGALRM) is alarm_handler
    assert os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE") == agent_signals_var
    if alarm_before > 0:
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0, (
            "the launcher cancelled the process's SIGALRM timer"
        )


@pytest.mark.timeout(180)
def test_python_s_own_ctrl_c_and_sigterm_are_back_after_a_sweep(
    hydra_sweep_runner: Any, tmp_path: Path
) -> None:
    """The launcher's one-line Ctrl-C and SIGTERM while no job runs end with the sweep: an app
    (or a notebook) that goes on after `--multirun` has Python's defaults again."""
    originals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        sweep = _in_process_sweep(hydra_sweep_runner, tmp_path, "+mode=ok")
        with sweep:
            pass
        after = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
    assert after == (signal.default_int_handler, signal.SIG_DFL), after


# --- 5. ports ------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_default_sweep_runs_with_port_29500_taken(tmp_path: Path) -> None:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            holder.bind(("0.0.0.0", 29500))
            holder.listen()
        except OSError:  # taken already: by someone else, which is the point
            pass
        with socket.create_connection(("127.0.0.1", 29500), timeout=5):
            pass  # something listens there
        result = _sweep(tmp_path, "mode=allreduce", "+x=0,1")
    finally:
        holder.close()
    assert result.returncode == 0, _output(result)
    sweep_dir = tmp_path / "multirun"
    for num in (0, 1):
        ports = {(sweep_dir / str(num) / f"done_rank{rank}").read_text() for rank in (0, 1)}
        assert len(ports) == 1 and ports != {"29500"}, ports
    _assert_sweep_left_nothing(sweep_dir)


@pytest.mark.timeout(180)
def test_two_sweeps_started_together_both_succeed(tmp_path: Path) -> None:
    _install_apps(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda name: _sweep(tmp_path, "mode=allreduce", "+x=0,1", name=name), "ab"))
    for result in results:
        assert result.returncode == 0, _output(result)
    for name in ("a", "b"):
        ends = _records(tmp_path / name, "end")
        assert [ends[n]["status"] for n in (0, 1)] == ["COMPLETED", "COMPLETED"]
        _assert_sweep_left_nothing(tmp_path / name)


# --- 6. restarts ---------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_restarted_job_completes_and_keeps_each_attempts_logs(tmp_path: Path) -> None:
    # rank 1 raises on attempt 0 and succeeds on attempt 1
    result = _sweep(tmp_path, "mode=flaky", "hydra.launcher.max_restarts=1")
    sweep_dir = tmp_path / "multirun"
    assert result.returncode == 0, _output(result)
    end = _records(sweep_dir, "end")[0]
    assert end["status"] == "COMPLETED"
    # TORCHELASTIC_RESTART_COUNT as the task saw it, in rank 0's return value
    assert end["value"] == repr({"attempt": 1, "max_restarts": 1}), end

    (run_dir,) = (sweep_dir / "0" / "torchrun_logs").iterdir()
    assert "rank 1 fails on attempt 0" in (run_dir / "attempt_0" / "1" / "error.json").read_text()
    assert "rank 1 attempt 0" in (run_dir / "attempt_0" / "1" / "stdout.log").read_text()
    for rank in (0, 1):
        assert f"rank {rank} attempt 1" in (run_dir / "attempt_1" / str(rank) / "stdout.log").read_text()
    assert len(_rank_pids(sweep_dir / "0")) == 4  # two ranks, two attempts
    _assert_sweep_left_nothing(sweep_dir)


# --- 7. the next job's process, forked ahead --------------------------------------------


@pytest.mark.timeout(180)
def test_jobs_run_one_after_another_though_the_next_one_is_forked_ahead(tmp_path: Path) -> None:
    # the next job's process is forked and reads its request while a job runs: Hydra's
    # bookkeeping of the next job (its on_job_start) still comes after the job before it ended
    result = _sweep(tmp_path, "mode=ok", "+x=range(6)")
    sweep_dir = tmp_path / "multirun"
    starts, ends = _records(sweep_dir, "start"), _records(sweep_dir, "end")
    assert result.returncode == 0, _output(result)
    assert sorted(ends) == list(range(6)), _output(result)
    for num in range(1, 6):
        assert ends[num - 1]["t"] <= starts[num]["t"], f"job {num} started before job {num - 1} ended"
    _assert_sweep_left_nothing(sweep_dir)


@pytest.mark.timeout(180)
def test_a_next_job_whose_process_was_killed_before_it_started_fails_alone(tmp_path: Path) -> None:
    # job 0 kills the process forked ahead for job 1 (as the OOM killer may, while it waits):
    # job 1 fails saying so, and the sweep goes on with job 2 in a process of its own
    result = _sweep(tmp_path, "mode=kill_next", "good_jobs=[1,2]", "+x=0,1,2")
    sweep_dir = tmp_path / "multirun"
    killed = int((sweep_dir / "0" / "killed_next").read_text())
    rows = {row["num"]: row for row in json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]}
    assert result.returncode != 0, _output(result)
    assert [rows[n]["status"] for n in (0, 1, 2)] == ["COMPLETED", "FAILED", "COMPLETED"], rows
    assert rows[1]["error"].startswith(
        f"the job's process (pid {killed}) was killed by signal SIGKILL before reporting a result"
    ), rows[1]["error"]
    assert "#1 : mode=kill_next good_jobs=[1,2] +x=1 : FAILED in" in result.stdout, _output(result)
    assert not (sweep_dir / "1" / "pids").exists()  # its ranks never started
    assert (sweep_dir / "2" / "done_rank0").exists() and (sweep_dir / "2" / "done_rank1").exists()
    _assert_sweep_left_nothing(sweep_dir)


@pytest.mark.timeout(180)
def test_a_warm_server_killed_outright_ends_the_sweep_saying_so_once(tmp_path: Path) -> None:
    # the OOM killer picks the launcher's warm server while a job runs and the next job's
    # process waits: the launcher ends with the server's death, said once, and nothing is left
    sweep_dir = tmp_path / "multirun"
    command = _sweep_command(tmp_path, "mode=sleep", "+x=0,1,2")
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        launcher = subprocess.Popen(
            command, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        wait_for(lambda: len(_rank_pids(sweep_dir / "0")) == 2, 120, "job 0's ranks")
        (server,) = [
            p for p in psutil.Process(launcher.pid).children() if "_server.server" in " ".join(p.cmdline())
        ]
        ours = {launcher.pid} | {p.pid for p in server.children(recursive=True)}
        server.kill()
        returncode = launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert returncode != 0
    said = f"the torchrun launcher's warm server (pid {server.pid}) exited unexpectedly with status -9"
    assert err.read_text().count(said) == 1, err.read_text()
    assert "During handling of the above exception" not in err.read_text(), err.read_text()
    _assert_no_trace(set(_all_rank_pids(sweep_dir)) | ours, ours, time.monotonic() + STOPPED_WITHIN_S)


# --- 8. soak -------------------------------------------------------------------------------


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_soak_launcher_resources_stay_flat(tmp_path: Path) -> None:
    jobs = 40
    result = _sweep(tmp_path, "mode=ok", f"+x=range({jobs})")
    assert result.returncode == 0, _output(result)
    sweep_dir = tmp_path / "multirun"
    starts, ends = _records(sweep_dir, "start"), _records(sweep_dir, "end")
    assert sorted(ends) == list(range(jobs))

    # the forkserver and the resource tracker are there from the first job on; nothing else
    helpers = starts[0]["descendants"]
    for num, end in ends.items():
        assert end["descendants"] == helpers, f"after job {num}: {end['descendants']} (helpers {helpers})"
    # warm-up (imports, loggers) may open a few fds and start a thread during the first jobs,
    # and a thread of the last job may still be on its way out
    fds = [ends[n]["fds"] for n in range(jobs)]
    threads = [ends[n]["threads"] for n in range(jobs)]
    assert fds[-1] <= starts[0]["fds"] + 4 and fds[-1] <= fds[9] + 1, fds
    assert threads[-1] <= starts[0]["threads"] + 2 and threads[-1] <= threads[9] + 1, threads
    rss = [ends[n]["rss"] for n in range(jobs)]
    growth = rss[-1] - rss[9]
    assert growth < 12 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB from job 10 to job 40"
    _assert_sweep_left_nothing(sweep_dir)


@pytest.mark.timeout(180)
def test_failed_jobs_do_not_leak_launcher_resources(tmp_path: Path) -> None:
    jobs = 6
    result = _sweep(tmp_path, "mode=fail", "how=raise", f"+x=range({jobs})")
    sweep_dir = tmp_path / "multirun"
    ends = _records(sweep_dir, "end")
    assert result.returncode != 0, _output(result)
    assert [ends[n]["status"] for n in range(jobs)] == ["FAILED"] * jobs
    fds = [ends[n]["fds"] for n in range(jobs)]
    threads = [ends[n]["threads"] for n in range(jobs)]
    # (a thread of the last job may still be on its way out: one more is fine, one per job not)
    assert fds[-1] <= fds[0] + 2 and threads[-1] <= threads[0] + 1, f"fds {fds}, threads {threads}"
    _assert_sweep_left_nothing(sweep_dir)


# --- 8. bad input --------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_unpicklable_return_value_fails_only_its_job(tmp_path: Path) -> None:
    result = _sweep(tmp_path, "mode=lock_return", "good_jobs=[1]", "+x=0,1")
    sweep_dir = tmp_path / "multirun"
    ends = _records(sweep_dir, "end")
    assert result.returncode != 0, _output(result)
    assert ends[0]["status"] == "FAILED", ends[0]
    error = ends[0]["error"]
    assert error.startswith("JobFailedError: rank 0 "), error
    assert "cannot be pickled" in error and "lock" in error, error
    assert "cannot be pickled" in result.stderr, _output(result)
    assert ends[1]["status"] == "COMPLETED"
    _assert_sweep_left_nothing(sweep_dir)


@pytest.mark.timeout(180)
def test_unpicklable_task_function_is_reported_with_its_cause(tmp_path: Path) -> None:
    result = _sweep(tmp_path, "+x=0,1", app="closure_app.py")
    sweep_dir = tmp_path / "multirun"
    ends = _records(sweep_dir, "end")
    assert result.returncode != 0, _output(result)
    # the last line Hydra prints names the cause, not some later crash
    last_line = result.stderr.strip().splitlines()[-1]
    assert "pickle" in last_line and "lock" in last_line, _output(result)
    # each job went through Hydra's bookkeeping and came back FAILED, naming the cause
    assert sorted(ends) == [0, 1], _output(result)
    for end in ends.values():
        assert end["status"] == "FAILED"
        assert "pickle" in end["error"] and "lock" in end["error"], end["error"]
    _assert_sweep_left_nothing(sweep_dir)


# --- 9. the payload --------------------------------------------------------------------------


def _is_log(relative: Path) -> bool:
    # the ranks' stdout/stderr and torch's error file (a failed rank's traceback) are logs
    return relative.suffix == ".log" or relative.name == "error.json"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "prefixed",
    [
        False,
        True,
    ],
    ids=["in_process", "launch_prefix"],
)
def test_payload_never_reaches_a_file_others_can_read(tmp_path: Path, prefixed: bool) -> None:
    marker = f"secret-{uuid.uuid4().hex}"  # travels in the job's config, so in the payload
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    sweep_dir = tmp_path / "multirun"
    # a launch prefix makes every rank a real process: its payload then travels by a file
    prefix = ["hydra.launcher.launch_prefix=[env]"] if prefixed else []
    result = _sweep(tmp_path, "mode=scan", *prefix, TMPDIR=str(tmp), FAULT_APP_MARKER=marker)
    assert result.returncode == 0, _output(result)
    job_dir = sweep_dir / "0"
    # while the ranks ran: where the payload's content was (Hydra's own .hydra/*.yaml hold
    # the job's config by design)
    for rank in (0, 1):
        lines = (job_dir / f"scan_rank{rank}.txt").read_text().splitlines()
        found = [line for line in lines if "/.hydra/" not in line]
        if not prefixed:
            assert not found, f"rank {rank} found the payload's content in: {found}"
        for line in found:
            path, file_mode, dir_mode = line.rsplit(" ", 2)
            assert Path(path).is_relative_to(tmp), f"payload outside the temp dir: {line}"
            assert (file_mode, dir_mode) == ("600", "700"), f"payload readable by others: {line}"
    # afterwards: nothing left in the temp dir; in the job dir only Hydra's files, the app's,
    # and logs
    assert not [p for p in tmp.rglob("*") if p.is_file()], list(tmp.rglob("*"))
    # rerun.sh: the job's command line, by design (as .hydra/overrides.yaml)
    app_files = {"pids", "scan_rank0.txt", "scan_rank1.txt", ".hydra", "rerun.sh"}
    for path in job_dir.rglob("*"):
        relative = path.relative_to(job_dir)
        if path.is_dir() or relative.parts[0] in app_files or _is_log(relative):
            continue
        mode = path.stat().st_mode & 0o777
        raise AssertionError(f"the launcher left {relative} (mode {mode:o}) in the job dir")
    _assert_sweep_left_nothing(sweep_dir)


WAITING_APP = """
import os, time
from pathlib import Path
import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    marker_dir = Path(cfg.marker_dir)
    (marker_dir / f"running_{os.environ['RANK']}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (marker_dir / "release").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never released this rank")
        time.sleep(0.05)
    return int(os.environ["RANK"])

if __name__ == "__main__":
    main()
"""


def _ignoring_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(180)
def test_a_signal_the_launcher_ignores_stays_ignored(tmp_path: Path) -> None:
    # a sweep started as a background job (or under nohup, for SIGHUP) ignores the signal;
    # torch's agent would otherwise catch it and stop the job's ranks
    app = tmp_path / "waiting_app.py"
    app.write_text(WAITING_APP)
    command = [
        sys.executable,
        str(app),
        "-m",
        *LAUNCHER,
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
        f"+marker_dir={tmp_path}",
    ]
    with (tmp_path / "stdout.txt").open("w") as stdout, (tmp_path / "stderr.txt").open("w") as stderr:
        launcher = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=_env(),
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=_ignoring_sigint,
        )
    try:
        wait_for(
            lambda: len(list(tmp_path.glob("running_*"))) == 2 or launcher.poll() is not None,
            120,
            "both ranks to run",
        )
        os.kill(launcher.pid, signal.SIGINT)  # dropped by the kernel: the launcher ignores it
        (tmp_path / "release").touch()
        returncode = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert returncode == 0, (tmp_path / "stderr.txt").read_text()
    assert "death signal" not in (tmp_path / "stderr.txt").read_text()
    assert_gone(int(p.read_text()) for p in tmp_path.glob("running_*"))
