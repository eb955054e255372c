"""Every failure told whole: the failed ranks, how, their logs and the first cause, whatever
the exception, on the console, in the table and in `sweep_summary.json`.

Each case runs the fault app (`tests/apps/fault_app.py`) as a user runs it (Hydra's short
errors, as by default), reads what the user reads, and runs plain `torchrun` on the same app
and overrides to compare: every rank torchrun names as failed (with its exit code) is named
here too. Every case ends by proving no process and no private directory is left behind.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Set

import psutil
import pytest

from hydra_plugins.hydra_torchrun_launcher._shared import private
from tests.conftest import as_from_a_terminal, assert_gone, wait_for

APPS = Path(__file__).parent / "apps"
LAUNCHER = ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"]
SWEEP_TIMEOUT_S = 180
# a line the launcher logs (Hydra's logging): "[2026-11-25 15:56:48,631][HYDRA] ..."
HYDRA_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[HYDRA\] ")

pytestmark = pytest.mark.timeout(300)


class Run(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    sweep_dir: Path
    tmp: Path  # the run's TMPDIR

    @property
    def console(self) -> str:
        return f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"

    def summary(self) -> List[dict]:
        return json.loads((self.sweep_dir / "sweep_summary.json").read_text())["jobs"]

    def job_line(self, num: int) -> List[str]:
        """The launcher's line as job `num` ended, with its indented continuation lines."""
        lines = self.stdout.splitlines()
        for i, line in enumerate(lines):
            if HYDRA_LINE.match(line) and " ended: #" in line and f" ended: #{num} " in line:
                rest = []
                for more in lines[i + 1 :]:
                    if not more.startswith("\t"):
                        break
                    rest.append(more[1:])
                return [line.split(": ", 1)[1], *rest]
        raise AssertionError(f"no line for job {num}\n{self.console}")

    def account(self, num: int) -> List[str]:
        """Job `num`'s failure as its line says it (after "FAILED in 1.23s: ")."""
        first, *rest = self.job_line(num)
        found = re.search(r": (?:FAILED|STOPPED) in [\d.]+s: (.*)$", first)
        assert found, self.console
        return [found[1], *rest]

    def table_row(self, num: int) -> str:
        for line in self.stdout.splitlines():
            if re.match(rf"^{num}  +[A-Z_]+  ", line):
                return line
        raise AssertionError(f"no table row for job {num}\n{self.console}")

    def last_word(self) -> str:
        """What Hydra prints last, on stderr: the first failed job's error."""
        return self.stderr[self.stderr.index("Error executing job") :]


def _install(tmp_path: Path) -> Path:
    app_dir = tmp_path / "app"
    if not app_dir.is_dir():
        shutil.copytree(APPS, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return app_dir


def _env(tmp: Path) -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
    env.pop("HYDRA_FULL_ERROR", None)  # Hydra's short errors, as a user sees them by default
    return env


def _start(
    tmp_path: Path, *overrides: str, name: str = "multirun", env: Optional[Dict[str, str]] = None
) -> "tuple[subprocess.Popen, Path]":
    """`python app/fault_app.py -m ...` from its project dir, as a user runs it, its output to
    files (a process left behind holding a pipe would hang the test instead of failing it);
    `env`: more environment variables."""
    _install(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    command = [
        sys.executable,
        "app/fault_app.py",
        "-m",
        *LAUNCHER,
        f"hydra.sweep.dir={name}",
        *overrides,
    ]
    with (tmp_path / f"{name}.stdout").open("w") as out, (tmp_path / f"{name}.stderr").open("w") as err:
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            env={**_env(tmp), **(env or {})},
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=as_from_a_terminal,
        )
    return proc, tmp


def _finish(tmp_path: Path, proc: subprocess.Popen, name: str = "multirun") -> Run:
    try:
        returncode = proc.wait(timeout=SWEEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait()
    return Run(
        returncode,
        (tmp_path / f"{name}.stdout").read_text(),
        (tmp_path / f"{name}.stderr").read_text(),
        tmp_path / name,
        tmp_path / "tmp",
    )


def _sweep(
    tmp_path: Path, *overrides: str, name: str = "multirun", env: Optional[Dict[str, str]] = None
) -> Run:
    proc, _ = _start(tmp_path, *overrides, name=name, env=env)
    return _finish(tmp_path, proc, name)


def _kill_tree(pid: int) -> None:
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _rank_pids(job_dir: Path) -> List[int]:
    return [int(p.read_text()) for p in sorted(job_dir.glob("pids/*.pid"))]


def _private_dirs(tmp: Path) -> List[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith(private.PRIVATE_DIR_PREFIX))


def _left_nothing(run: Run) -> None:
    """No rank of the sweep runs, and no job left its private dir in the run's TMPDIR."""
    pids = [pid for job_dir in run.sweep_dir.iterdir() if job_dir.is_dir() for pid in _rank_pids(job_dir)]
    assert_gone(pids)
    assert not _private_dirs(run.tmp), f"left in the temp dir: {_private_dirs(run.tmp)}"


# --- plain torchrun on the same app --------------------------------------------------------


class TorchrunFailure(NamedTuple):
    rank: int
    exitcode: int


def _torchrun(tmp_path: Path, *overrides: str, stop_during_shutdown: bool = False) -> str:
    """Plain torchrun on the fault app with the same overrides (each rank in Hydra's run mode,
    as the launcher's dry run writes it); its console (stderr). With `stop_during_shutdown`,
    torchrun gets a SIGINT once its agent has asked rank 0 (deaf to it) to stop."""
    _install(tmp_path)
    run_dir = tmp_path / "torchrun_run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--monitor-interval=0.1",
        *(["--shutdown-timeout=4"] if stop_during_shutdown else []),
        "app/fault_app.py",
        *overrides,
        f"hydra.run.dir={run_dir}",
        "hydra.job.num=0",
        "~hydra.callbacks.recorder",
    ]
    err_path = tmp_path / "torchrun.stderr"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=_env(tmp_path),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            preexec_fn=as_from_a_terminal,
        )
    try:
        if stop_during_shutdown:
            wait_for(
                lambda: (run_dir / "signals_rank0").exists() or proc.poll() is not None, 120, "the failure"
            )
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=SWEEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait()
    return err_path.read_text()


def _torchrun_failures(console: str) -> List[TorchrunFailure]:
    """The failures torchrun's summary lists: root cause first."""
    found = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", console)
    failures = [TorchrunFailure(int(rank), int(code)) for rank, code in found]
    root = console.index("Root Cause") if "Root Cause" in console else -1
    if root >= 0:  # torchrun prints the other failures before the root cause: put it first
        roots = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", console[root:])
        first = TorchrunFailure(int(roots[0][0]), int(roots[0][1]))
        failures = [first, *(f for f in failures if f != first)]
    return failures


def _failed_by_itself(failures: List[TorchrunFailure]) -> Set[int]:
    """The ranks that failed on their own (a survivor torchrun stopped ends by SIGTERM)."""
    return {f.rank for f in failures if f.exitcode > 0}


# --- 1. exceptions that do not travel as plain ones do -------------------------------------


EXCEPTIONS = {
    # (like pydantic's ValidationError) its pickling drops its attributes and notes
    "drops": ("DropsAttributes", "1 validation error for DeepSpeedZeroConfig (rank 1)", ["errors"]),
    # holds a lock: it cannot be pickled at all
    "unpicklable": ("Unpicklable", "rank 1 holds a lock", []),
    # its constructor takes other arguments than its args
    "needs_args": ("NeedsArguments", "bad zero_stage: 9", ["field", "value"]),
}


@pytest.mark.parametrize("how", list(EXCEPTIONS))
def test_any_exception_keeps_the_rank_its_exit_and_its_log(tmp_path: Path, how: str) -> None:
    kind, message, attributes = EXCEPTIONS[how]
    run = _sweep(tmp_path, "mode=fail", f"how={how}")
    assert run.returncode == 1, run.console

    # the job's line: the rank, its exit, its exception, then where its output is
    first, output = run.job_line(0)[:2]
    said = re.escape(f"exited with code 1: {kind}: {message}")
    assert re.fullmatch(
        rf"#0 : mode=fail how={how} : FAILED in [\d.]+s: rank 1 \(local_rank 1, pid \d+\) {said}", first
    ), run.console
    log = re.fullmatch(r"its output: (multirun/0/torchrun_logs/.+/attempt_0/1/stderr\.log)", output)
    assert log and (tmp_path / log[1]).is_file(), run.console
    assert f"{kind}: {message}" in (tmp_path / log[1]).read_text()
    # the table: the same, less the pid
    assert "FAILED  " in run.table_row(0) and "rank 1 exited with code 1: " in run.table_row(0), run.console
    # sweep_summary.json: the whole account
    (job,) = run.summary()
    assert job["status"] == "FAILED"
    assert job["error"].splitlines() == run.account(0), job
    # Hydra's last word: the task's own exception (its type, its frames), then the account
    told = run.last_word()
    assert f"fault_errors.{kind}: {message}" in told, run.console
    assert "in _raise" in told and "raise fault_errors." in told, run.console  # the rank's frames
    if sys.version_info >= (3, 11):  # notes are printed from 3.11
        assert re.search(r"^rank 1 \(local_rank 1, pid \d+\) exited with code 1$", told, re.M), run.console
        assert f"\n{output}\n" in told, run.console
    # the job's process had the exception back as its own type, with its attributes
    (end,) = [
        json.loads(line)
        for line in (run.sweep_dir / "jobs.jsonl").read_text().splitlines()
        if '"end"' in line
    ]
    assert end["error"].startswith(f"{kind}: "), end
    assert set(attributes) <= set(end["attributes"]), end
    _left_nothing(run)

    # plain torchrun names the same rank, with the same exit code, as the first cause
    assert _torchrun_failures(_torchrun(tmp_path, "mode=fail", f"how={how}"))[0] == TorchrunFailure(1, 1)


def _end_record(run: Run) -> dict:
    """What the Recorder callback saw of job 0's end, in the job's process."""
    (end,) = [
        json.loads(line)
        for line in (run.sweep_dir / "jobs.jsonl").read_text().splitlines()
        if '"end"' in line
    ]
    return end


def test_an_error_of_hydra_s_run_job_outside_the_task_is_the_job_s_error(tmp_path: Path) -> None:
    """A job log file that Hydra's run_job cannot open (its directory does not exist) fails
    the job before its task: the job's error is Hydra's, naming the handler, as the basic
    launcher raises it, not 'exited before reporting a result'."""
    run = _sweep(tmp_path, "mode=ok", "hydra.job_logging.handlers.file.filename=/nonexistent/job.log")
    assert run.returncode == 1, run.console
    (job,) = run.summary()
    assert job["status"] == "FAILED", job
    error = "Hydra's run_job failed outside the task: ValueError: Unable to configure handler 'file'"
    assert job["error"].startswith(error), job["error"]
    assert run.account(0)[0].startswith(error), run.console
    _left_nothing(run)


def test_an_env_set_value_run_job_cannot_resolve_stops_the_sweep_before_any_rank(tmp_path: Path) -> None:
    """Hydra's run_job resolves `hydra.job.env_set` in the `hydra` node alone, where `${mode}`
    (a key of the task's config) is not found: the basic launcher's sweep stops there. Here
    too, before any rank starts, in one line naming the key."""
    run = _sweep(tmp_path, "mode=ok,allreduce", "+hydra.job.env_set.FOO=${mode}")
    assert run.returncode == 1, run.console
    refusal = "job #0 (mode=ok): hydra.job.env_set.FOO: Interpolation key 'mode' not found"
    assert run.stderr.startswith(refusal + "\n"), run.console
    assert "Launching" not in run.stdout and "Traceback" not in run.stderr, run.console
    assert not (run.sweep_dir / "0").exists(), run.console
    _left_nothing(run)


def test_an_exception_class_of_the_app_s_script_is_the_script_s_own(tmp_path: Path) -> None:
    """`class AppError` of `python fault_app.py` (its `__main__`) reaches the launcher as that
    class, as with Hydra's basic launcher: `except AppError` around the app's `main()` takes it
    (Hydra raises the job's error there with HYDRA_FULL_ERROR=1), and every line names it
    `AppError`, as Python does a class of `__main__`, never `__mp_main__.AppError`."""
    seen = "+hydra.callbacks.seen._target_=__main__.AppErrorSeen"  # a callback of the script
    run = _sweep(tmp_path, "mode=fail", "how=app_error", seen)
    assert run.returncode == 1, run.console
    message = "AppError: rank 1's own AppError"
    assert re.search(rf"rank 1 \(local_rank 1, pid \d+\) exited with code 1: {message}$", run.job_line(0)[0])
    assert f"[default1]:{message}\n" in run.stderr, run.console  # the rank's own traceback
    assert f"\n{message}\n" in run.last_word(), run.console  # Hydra's last word
    assert "__mp_main__" not in run.stdout + run.stderr, run.console
    assert _end_record(run)["error"] == message, _end_record(run)
    # in the job's process too, where on_job_end runs: the error is the script's AppError
    assert (run.sweep_dir / "app_error_seen").read_text() == "True"
    _left_nothing(run)

    full = _sweep(tmp_path, "mode=fail", "how=app_error", name="full_error", env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 1, full.console
    assert "the launcher caught AppError of the script: rank 1's own AppError" in full.stderr, full.console


def test_an_exception_whose_str_raises_is_still_named(tmp_path: Path) -> None:
    run = _sweep(tmp_path, "mode=fail", "how=bad_str")
    assert run.returncode == 1, run.console
    said = "BadStr: <its message could not be rendered: its __str__ raised TypeError: no str for this one>"
    first, output = run.job_line(0)[:2]
    assert re.search(rf"rank 1 \(local_rank 1, pid \d+\) exited with code 1: {re.escape(said)}$", first), (
        run.console
    )
    assert re.fullmatch(r"its output: multirun/0/torchrun_logs/.+/attempt_0/1/stderr\.log", output)
    (job,) = run.summary()
    assert job["error"].splitlines() == run.account(0), job
    # Hydra's last word: the exception itself, as Python prints one whose __str__ raises
    assert "fault_errors.BadStr: <exception str() failed>" in run.last_word(), run.console
    assert "in _raise" in run.last_word(), run.console  # with the rank's frames
    assert _end_record(run)["error"] == "BadStr: <exception str() failed>", _end_record(run)
    _left_nothing(run)


def test_a_huge_message_is_cut_in_the_account_and_whole_in_the_log(tmp_path: Path) -> None:
    run = _sweep(tmp_path, "mode=fail", "how=huge")
    assert run.returncode == 1, run.console
    first, output = run.job_line(0)[:2]
    cut = re.search(
        r"exited with code 1: ValueError: head x+ \.\.\. \[(\d+) characters cut: the whole is in its "
        r"output\] \.\.\. x+ tail$",
        first,
    )
    assert cut and len(first) < 2000, first[:3000]
    assert int(cut[1]) + (len(first) - first.index("ValueError")) > 2_000_000
    (job,) = run.summary()
    assert job["error"].splitlines() == run.account(0) and len(job["error"]) < 2000, job["error"][:3000]
    log = re.fullmatch(r"its output: (multirun/0/torchrun_logs/.+/attempt_0/1/stderr\.log)", output)
    assert log, output
    assert "ValueError: head " + "x" * 2_000_000 + " tail" in (tmp_path / log[1]).read_text()
    _left_nothing(run)


# --- 2. several ranks fail -----------------------------------------------------------------


def test_every_failed_rank_is_named_first_cause_first(tmp_path: Path) -> None:
    # rank 0 raises a ValueError, rank 1 a KeyError, at the same moment
    run = _sweep(tmp_path, "mode=fail", "how=by_rank", "bad_rank=all")
    assert run.returncode == 1, run.console
    errors = {0: "ValueError: rank 0's own error", 1: 'KeyError: "rank 1\'s own error"'}

    lines = run.job_line(0)
    first = re.search(
        r"FAILED in [\d.]+s: rank (\d) \(local_rank \1, pid \d+\) exited with code 1: (.*)$", lines[0]
    )
    assert first, run.console
    root, other = int(first[1]), 1 - int(first[1])
    assert first[2] == errors[root]
    assert re.fullmatch(rf"its output: multirun/0/torchrun_logs/.+/attempt_0/{root}/stderr\.log", lines[1])
    also = rf"also failed: rank {other} \(local_rank {other}, pid \d+\) exited with code 1: "
    also += re.escape(errors[other])
    assert re.fullmatch(also, lines[2]), run.console
    assert re.fullmatch(rf"its output: multirun/0/torchrun_logs/.+/attempt_0/{other}/stderr\.log", lines[3])
    assert len(lines) == 4, run.console
    assert f"rank {root} exited with code 1: {errors[root][:20]}" in run.table_row(0)
    (job,) = run.summary()
    assert job["error"].splitlines()[1:] == lines[1:], job
    # Hydra's last word: the first cause's own exception, then every failed rank
    told = run.last_word()
    assert errors[root] in told and re.search(also, told), run.console
    _left_nothing(run)

    # every rank plain torchrun names as failed by itself (exit code 1) is named here: torchrun
    # may miss one that was on its way out when it stopped the others (SIGTERM)
    torchrun = _failed_by_itself(
        _torchrun_failures(_torchrun(tmp_path, "mode=fail", "how=by_rank", "bad_rank=all"))
    )
    assert torchrun and torchrun <= {0, 1}, torchrun


def test_a_peer_that_failed_because_of_the_first_cause_comes_after_it(tmp_path: Path) -> None:
    # rank 1 raises after init_process_group; rank 0's all_reduce then breaks on the closed connection
    run = _sweep(tmp_path, "mode=fail", "how=raise", "survivors=all_reduce")
    assert run.returncode == 1, run.console
    lines = run.job_line(0)
    assert re.search(
        r"rank 1 \(local_rank 1, pid \d+\) exited with code 1: ValueError: boom from rank 1$", lines[0]
    )
    # rank 0, if its collective broke before the agent stopped it, is named after the first cause
    assert not any(line.startswith("also failed: rank 1") for line in lines), run.console
    (job,) = run.summary()
    assert job["error"].startswith("rank 1 (local_rank 1, pid "), job
    _left_nothing(run)
    failures = _torchrun_failures(_torchrun(tmp_path, "mode=fail", "how=raise", "survivors=all_reduce"))
    assert failures[0] == TorchrunFailure(1, 1), failures


# --- 3. a stop during a failed job's shutdown ---------------------------------------------


def test_ctrl_c_while_a_failed_job_shuts_down_keeps_the_failure_first(tmp_path: Path) -> None:
    # rank 1 raises; rank 0 ignores SIGTERM, so the job's shutdown takes 2 x shutdown_timeout;
    # Ctrl-C comes during it
    proc, _ = _start(
        tmp_path,
        "mode=fail",
        "how=raise",
        "ignore_signals=true",
        "hydra.launcher.shutdown_timeout=4",
        "+x=0,1",
    )
    sweep_dir = tmp_path / "multirun"
    try:
        # the agent has seen rank 1's failure when it asks rank 0 to stop; it then waits for it
        wait_for(
            lambda: (sweep_dir / "0" / "signals_rank0").exists() or proc.poll() is not None,
            120,
            "the agent to stop rank 0 after rank 1's failure",
        )
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
    finally:
        run = _finish(tmp_path, proc)
    assert run.returncode == 128 + signal.SIGINT, run.console

    # the first cause: rank 1's exception; the stop after it
    lines = run.job_line(0)
    assert re.search(
        r": FAILED in [\d.]+s: rank 1 \(local_rank 1, pid \d+\) exited with code 1: ValueError: boom",
        lines[0],
    )
    assert lines[-1] == "then SIGINT stopped the sweep while the job's ranks were shutting down", run.console
    assert "FAILED" in run.table_row(0) and "ValueError: boom from rank 1" in run.table_row(0), run.console
    assert "NOT_STARTED" in run.table_row(1), run.console
    jobs = run.summary()
    assert [job["status"] for job in jobs] == ["FAILED", "NOT_STARTED"], jobs
    assert jobs[0]["error"].splitlines()[0].endswith("ValueError: boom from rank 1"), jobs
    assert jobs[0]["error"].splitlines()[-1].startswith("then SIGINT"), jobs
    # the launcher's last line says the stop, with the failed job among what it stopped
    assert "[torchrun launcher] SIGINT: the sweep was stopped: failed #0; not started #1" in run.stderr, (
        run.console
    )
    # rank 0 got the failure's SIGTERM before the stop's (the stop did not replace it)
    assert (sweep_dir / "0" / "signals_rank0").read_text().splitlines()[0] == "SIGTERM"
    _left_nothing(run)

    # plain torchrun prints the rank's traceback too, then ends on the SIGINT: its summary of
    # the failure is lost (torch's agent takes the stop over the failure it was handling)
    console = _torchrun(tmp_path, "mode=fail", "how=raise", "ignore_signals=true", stop_during_shutdown=True)
    assert "ValueError: boom from rank 1" in console


# --- 4. a rank that hangs past job_timeout -----------------------------------------------------


def _assert_named_past_job_timeout(run: Run, timeout: int, app: str, caller: str) -> None:
    """The job's account of a two-rank job past job_timeout, in its line and in the summary:
    rank 0 sleeps in `_forever` of `app`, rank 1 waits in a gloo barrier called from `caller`;
    each rank named with where it was, then where its output is."""
    assert run.returncode == 1, run.console
    lines = run.account(0)
    assert lines[0] == f"the job ran past hydra.launcher.job_timeout={timeout}s; its ranks were stopped", (
        run.console
    )
    rank0 = rf"still running: rank 0 \(local_rank 0, pid \d+\) in _forever \({app}\.py:\d+\)"
    rank1 = (
        r"still running: rank 1 \(local_rank 1, pid \d+\) in barrier \(distributed_c10d\.py:\d+\), "
        rf"called from {re.escape(caller)} \({app}\.py:\d+\)"
    )
    assert re.fullmatch(rank0, lines[1]) and re.fullmatch(rank1, lines[3]), run.console
    assert re.fullmatch(r"its output: multirun/0/torchrun_logs/.+/attempt_0/0/stderr\.log", lines[2])
    assert re.fullmatch(r"its output: multirun/0/torchrun_logs/.+/attempt_0/1/stderr\.log", lines[4])
    assert len(lines) == 5, run.console
    (job,) = run.summary()
    assert job["status"] == "FAILED" and job["error"].splitlines() == lines, job


def test_a_rank_hanging_past_job_timeout_is_named_with_where_it_was(tmp_path: Path) -> None:
    # rank 0 sleeps in Python; rank 1 waits for it in a gloo barrier (in C)
    timeout = 12
    run = _sweep(
        tmp_path, "mode=hang", f"hydra.launcher.job_timeout={timeout}", "hydra.launcher.shutdown_timeout=1"
    )
    _assert_named_past_job_timeout(run, timeout, "fault_app", "_hang")
    assert f"the job ran past hydra.launcher.job_timeout={timeout}s" in run.table_row(0), run.console
    # Hydra's last word: each rank's last lines, and its stack, from the task's frames on
    told = run.last_word()
    for rank, frame in ((0, "in _forever"), (1, "in _hang")):
        assert f"rank {rank}'s last lines of stdout:\nrank {rank} is up" in told, run.console
        assert f"rank {rank}'s last lines of stderr:\nrank {rank} waits" in told, run.console
        stack = told.split(f"rank {rank}'s stack when it was stopped:\n", 1)[1]
        assert re.search(rf'File ".*fault_app\.py", line \d+ {frame}', stack.split("\nrank ", 1)[0]), (
            run.console
        )
    assert "run_rank" not in told  # the launcher's frames below the task are left out
    # the stacks were on the console as they were written, with the ranks' prefixes
    assert re.search(
        r"^\[default1\]:\s+File \".*distributed_c10d\.py\", line \d+ in barrier", run.stderr, re.M
    )
    _left_nothing(run)


def test_a_training_script_hanging_past_job_timeout_is_named_with_where_it_was(tmp_path: Path) -> None:
    """As a task's rank: a rank that runs a training script (`python train.py`) is asked for
    its stack too (the launcher's `sitecustomize` registered it, and left no other trace)."""
    timeout = 15
    run = _sweep(
        tmp_path,
        "hydra.launcher.training_script=app/hang_script.py",
        f"hydra.launcher.job_timeout={timeout}",
        "hydra.launcher.shutdown_timeout=1",
    )
    _assert_named_past_job_timeout(run, timeout, "hang_script", "<module>")
    told = run.last_word()
    for rank, frame in ((0, "in _forever"), (1, "in <module>")):
        assert (
            f"rank {rank}'s last lines of stderr:\nrank {rank} waits (stack hook in sight: False)" in told
        ), run.console
        stack = told.split(f"rank {rank}'s stack when it was stopped:\n", 1)[1]
        assert re.search(rf'File ".*hang_script\.py", line \d+ {frame}', stack.split("\nrank ", 1)[0]), (
            run.console
        )
    assert "stack: not known" not in told, run.console
    _left_nothing(run)


# --- 5. nothing left behind after a process killed outright -----------------------------------


def test_a_job_process_killed_outright_points_to_its_ranks_logs_and_leaves_no_private_dir(
    tmp_path: Path,
) -> None:
    proc, tmp = _start(tmp_path, "mode=sleep", "good_jobs=[1]", "+x=0,1")
    job_dir = tmp_path / "multirun" / "0"
    try:
        wait_for(lambda: len(_rank_pids(job_dir)) == 2 or proc.poll() is not None, 120, "job 0's ranks")
        assert len(_private_dirs(tmp)) == 1, _private_dirs(tmp)
        # a forkserver rank's parent is the job's forkserver, whose parent is the job's process
        job_process = psutil.Process(_rank_pids(job_dir)[0]).parent().parent()
        job_process.kill()
    finally:
        run = _finish(tmp_path, proc)
    assert run.returncode == 1, run.console
    first, *rest = run.job_line(0)
    assert re.search(
        rf"FAILED in [\d.]+s: the job's process \(pid {job_process.pid}\) was killed by signal SIGKILL "
        r"before reporting a result$",
        first,
    ), run.console
    # the ranks died with it, unheard: where they wrote is said, as for a rank that failed
    assert len(rest) == 1, run.console
    logs = re.fullmatch(
        r"its ranks' output: (multirun/0/torchrun_logs/[^/ ]+/attempt_0) "
        r"\(stdout\.log, stderr\.log of each\)",
        rest[0],
    )
    assert logs, run.console
    assert all((tmp_path / logs[1] / str(rank) / "stderr.log").is_file() for rank in (0, 1)), run.console
    assert [job["status"] for job in run.summary()] == ["FAILED", "COMPLETED"]
    assert run.summary()[0]["error"].splitlines() == run.account(0), run.summary()
    assert rest[0] in run.last_word(), run.console
    _left_nothing(run)  # the warm server removed what the job's process could not


def test_after_a_launcher_killed_outright_the_next_run_removes_what_it_left(tmp_path: Path) -> None:
    proc, tmp = _start(tmp_path, "mode=sleep", name="first")
    job_dir = tmp_path / "first" / "0"
    try:
        wait_for(lambda: len(_rank_pids(job_dir)) == 2 or proc.poll() is not None, 120, "the ranks")
        os.kill(proc.pid, signal.SIGKILL)  # its server, job process and ranks die with it
        proc.wait(timeout=30)
        assert_gone(_rank_pids(job_dir))
    finally:
        _finish(tmp_path, proc, "first")
    left = _private_dirs(tmp)
    assert len(left) == 1, left  # the job process could not remove it
    # what the next run must not touch: a live process's dir, and dirs that name no owner
    alive = private.private_dir(parent=str(tmp))
    unnamed = tmp / "hydra_torchrun_abcd1234"
    unnamed.mkdir()
    try:
        run = _sweep(tmp_path, "mode=ok", name="second")
        assert run.returncode == 0, run.console
        assert _private_dirs(tmp) == sorted([os.path.basename(alive), unnamed.name])
    finally:
        os.rmdir(alive)
        unnamed.rmdir()


def test_a_dead_owner_s_dir_is_removed_and_no_other(tmp_path: Path) -> None:
    """By name: whose dir it is (pid, start time, boot); a pid now used by a later process is
    dead; a dir of another host or boot (a temp dir several hosts share) is never judged."""
    me, start, boot = os.getpid(), private._start_time(os.getpid()), private._boot()
    assert boot is not None
    other_boot = "0" * 8 if boot != "0" * 8 else "1" * 8
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone_pid = int(dead.stdout)
    names = {
        f"hydra_torchrun_{gone_pid}-123-{boot}_abcdefgh": False,  # its owner has exited
        f"hydra_torchrun_{me}-{int(start) + 1}-{boot}_abcdefgh": False,  # this pid, but a later process
        f"htl-{gone_pid}-123-{boot}_abcdefgh": False,  # a forkserver socket's dir
        f"hydra_torchrun_{me}-{start}-{boot}_abcdefgh": True,  # this live process's
        f"hydra_torchrun_{gone_pid}-123-{other_boot}_abcdefgh": True,  # another host's (or boot's)
        f"hydra_torchrun_{gone_pid}-123_abcdefgh": True,  # says no host
        "hydra_torchrun_abcdefgh": True,  # names no owner (an older launcher's)
        f"other_{gone_pid}-123-{boot}_abcdefgh": True,  # not the launcher's
    }
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / f"hydra_torchrun_{gone_pid}-123-{boot}_file").write_text("not a dir")
    removed = private.remove_dead_private_dirs([str(tmp_path)])
    assert sorted(os.path.basename(p) for p in removed) == sorted(n for n, kept in names.items() if not kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(n for n, kept in names.items() if kept), f"hydra_torchrun_{gone_pid}-123-{boot}_file"]
    )


# --- 6. the launcher's own resources at its exit -------------------------------------------


def test_the_warm_server_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    """No `unclosed socket` or `subprocess ... is still running` as the launcher's process
    exits (what pytest printed at the suite's end): its server is closed and reaped then."""
    code = (
        "from hydra_plugins.hydra_torchrun_launcher._server.server import warm_server\n"
        "server = warm_server()\n"
        "server.report()\n"
        "print(server._process.pid)\n"
    )
    result = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "ResourceWarning" not in result.stderr, result.stderr
    assert_gone([int(result.stdout)])
