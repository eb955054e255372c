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
import time
from pathlib import Path
from typing import List

import psutil
import pytest
from omegaconf import OmegaConf

from hydra_plugins.hydra_torchrun_launcher._launcher.journal import JOURNAL_FILE, read_journal
from hydra_plugins.hydra_torchrun_launcher._launcher.report import SUMMARY_INTERVAL_S
from hydra_plugins.hydra_torchrun_launcher._shared.torchrun_cli import torchrun_options
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
    note_value = OmegaConf.load(rerun_dir / "0" / ".hydra" / "config.yaml").note
    assert note_value == f"x\ntouch {pwned} #", note_value  # the value itself reached the task, as data

    # the plain torchrun line of the header, pasted into bash as it is: Hydra's run mode in every
    # rank, the same config, the value with its newline exactly (bash's $'...' keeps it one line)
    line = next(line for line in header if "torchrun --nnodes" in line).lstrip("# ")
    command = shlex.split(line.replace("$'", "'"))  # what the line holds, roughly, to check flags
    assert "--config-name=single" in command and "hydra.mode=RUN" in command, command
    for rank in (0, 1):
        (job_dir / f"rank{rank}.txt").unlink()
    torchrun = subprocess.run(  # pasted anywhere: the line goes where the sweep started
        ["bash", "-c", line], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert torchrun.returncode == 0, torchrun.stdout + torchrun.stderr
    assert not pwned.exists()
    for rank in (0, 1):
        assert (job_dir / f"rank{rank}.txt").read_text() == "2 job0 0.5\n"
    assert OmegaConf.load(job_dir / ".hydra" / "config.yaml").note == f"x\ntouch {pwned} #"
    # no nested sweep started in the job dir
    assert not list(job_dir.glob("*/rank0.txt")), list(job_dir.iterdir())


RECORD_APP = Path(__file__).parent / "record_app"


def _error(out: str) -> str:
    """The one line Hydra shows for the launcher's error (before its HYDRA_FULL_ERROR hint)."""
    lines = [line for line in out.splitlines() if line.strip()]
    hint = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
    return lines[lines.index(hint) - 1] if hint in lines else lines[-1]


def _ranks_ran(out: str) -> List[str]:
    return re.findall(r"^\[default0\]:rank 0: (train_\w lr=[\w.]+)$", out, re.M)


def test_a_finished_sweep_runs_again_and_only_the_same_sweep_resumes(tmp_path: Path) -> None:
    app_dir = _install(tmp_path, RECORD_APP)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2"]
    # job 1 fails for an outside cause: the sweep is finished all the same
    first = _run(app_dir, *sweep, FAIL_AT="0.2")
    assert first.returncode == 1, first.stdout
    assert [j["status"] for j in _summary(app_dir / "sweep")] == ["COMPLETED", "FAILED"], first.stdout

    # auto: a finished record is a new run, every job runs again, one line says so
    again = _run(app_dir, *sweep, FAIL_AT="0.2")
    assert (
        "sweep/sweep_summary.json records a finished sweep (every job completed or failed): " in again.stdout
    )
    assert _ranks_ran(again.stdout) == ["train_a lr=0.1"], again.stdout

    # true: the same sweep resumes, finished or not: the failed job is retried, job 0 kept
    resumed = _run(app_dir, *sweep, "hydra.launcher.resume=true")
    assert resumed.returncode == 0, resumed.stdout
    assert (
        "1 completed job(s) come from its record (#0), 0 unfinished job(s) continue, "
        "1 failed or not started run again (#1)"
    ) in resumed.stdout, resumed.stdout
    assert "Launching 1 job with" in resumed.stdout, resumed.stdout
    assert _ranks_ran(resumed.stdout) == ["train_a lr=0.2"], resumed.stdout
    # rerun.sh of a job that a resume=true run ran works (a rerun has no record to resume)
    rerun = subprocess.run(
        ["bash", str(app_dir / "sweep" / "1" / "rerun.sh")], env=_env(), capture_output=True
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr

    # every job from the record: nothing is launched, and the line says so
    nothing = _run(app_dir, *sweep, "hydra.launcher.resume=true")
    assert nothing.returncode == 0 and "Nothing to launch: all 2 jobs come from the record" in nothing.stdout
    assert "Launching" not in nothing.stdout and not _ranks_ran(nothing.stdout), nothing.stdout

    # whatever shapes what a job computes makes it another sweep: resume=true refuses it, naming it
    helper = app_dir / "helper.py"
    changes = [
        ({}, ["hydra.launcher.nproc_per_node=2"], "launcher settings"),
        ({}, ["hydra.job.env_set.SEED=2"], "env_set"),
        ({"DATASET": "imagenet"}, [], "environment variables the config reads"),
        ({"TASK": "b"}, [], "task code"),
    ]
    for env, extra, part in changes:
        changed = _run(app_dir, *sweep, "hydra.launcher.resume=true", *extra, **env)
        assert changed.returncode == 1, (env, extra, changed.stdout)
        assert _error(changed.stdout).startswith(
            "hydra.launcher.resume=true: sweep/sweep_summary.json records another sweep "
            f"(job #0's {part} changed)"
        ), (env, extra, changed.stdout)
    # what only shows or starts the ranks differently is the same sweep
    shown = [
        "hydra.launcher.tee=0",
        "hydra.launcher.start_method=spawn",
        "hydra.launcher.monitor_interval=0.2",
    ]
    same = _run(app_dir, *sweep, "hydra.launcher.resume=true", *shown)
    assert same.returncode == 0 and "Nothing to launch: all 2 jobs come from the record" in same.stdout, (
        same.stdout
    )
    helper.write_text(helper.read_text().replace("lr * 10", "lr * 100"))
    changed = _run(app_dir, *sweep, "hydra.launcher.resume=true")
    assert changed.returncode == 1 and "records another sweep (job #0's task code" in changed.stdout

    # auto with the helper changed: another sweep, every job runs; the record is this run's
    fresh = _run(app_dir, *sweep)
    assert fresh.returncode == 0, fresh.stdout
    assert "sweep/sweep_summary.json records another sweep (job #0's task code" in fresh.stdout
    assert [j["return_value"] for j in _summary(app_dir / "sweep")] == [10.0, 20.0]


@pytest.mark.parametrize(
    "task, edited, old, new",
    [
        ("c", "late_helper.py", "lr + OFFSET", "lr + 2 * OFFSET"),  # imported inside the task's body
        ("c", "deeper.py", "OFFSET = 1", "OFFSET = 2"),  # imported by that module in turn
        ("d", "models.py", "lr * self.factor", "lr * self.factor * 2"),  # named by a _target_
    ],
)
def test_a_module_the_task_reaches_as_it_runs_counts_in_what_it_computes(
    tmp_path: Path, task: str, edited: str, old: str, new: str
) -> None:
    app_dir = _install(tmp_path, RECORD_APP)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1"]
    assert _run(app_dir, *sweep, TASK=task).returncode == 0
    same = _run(app_dir, *sweep, "hydra.launcher.resume=true", TASK=task)
    assert same.returncode == 0 and "1 completed job(s) come from its record (#0)" in same.stdout, same.stdout
    path = app_dir / edited
    path.write_text(path.read_text().replace(old, new))
    changed = _run(app_dir, *sweep, "hydra.launcher.resume=true", TASK=task)
    assert changed.returncode == 1, changed.stdout
    assert "records another sweep (job #0's task code changed)" in _error(changed.stdout), changed.stdout


def test_the_summary_describes_the_sweep_that_ran_in_strict_json(tmp_path: Path) -> None:
    app_dir = _install(tmp_path, RECORD_APP)
    assert _run(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2,0.3").returncode == 0
    # a changed sweep in the same dir: no stale third row
    result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,nan")
    assert result.returncode == 0, result.stdout
    text = (app_dir / "sweep" / "sweep_summary.json").read_text()

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in sweep_summary.json: not JSON")

    jobs = json.loads(text, parse_constant=refuse)["jobs"]
    assert [j["overrides"] for j in jobs] == [["lr=0.1"], ["lr=nan"]], text
    assert [j["return_value"] for j in jobs] == [1.0, "nan"], text


class _Launcher:
    """`python app.py ARGS` started in the background, its console in a file."""

    def __init__(self, app_dir: Path, *args: str, umask: int = 0o022, **env: str) -> None:
        self.out = app_dir / f"console_{len(list(app_dir.glob('console_*')))}.txt"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "app.py", *args],
                cwd=app_dir,
                env=_env(**env),
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.umask(umask),
            )

    def text(self) -> str:
        return self.out.read_text()

    def wait_for_text(self, text: str, after: str = "", timeout: float = 180) -> None:
        """Until the console shows `text` after the text `after`."""

        def shown() -> bool:
            console = self.text()
            return after in console and text in console[console.index(after) :]

        wait_for(lambda: shown() or self.proc.poll() is not None, timeout, text)
        assert shown(), self.text()

    def end(self, timeout: float = 240) -> "tuple[int, str]":
        children = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        code = self.proc.wait(timeout=timeout)
        assert_gone(children)
        return code, self.text()


def test_one_launcher_per_sweep_dir_and_a_killed_ones_sweep_resumes_under_umask_002(tmp_path: Path) -> None:
    app_dir = _install(tmp_path, PREEMPT_APP)
    # jobs long enough for a second launcher to start and be refused while job 1 runs; rank 0
    # checkpoints every 2 steps, as long trainings do
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", "steps=40", "step_s=0.3", "checkpoint_every=2"]
    first = _Launcher(app_dir, *sweep, umask=0o002)
    first.wait_for_text("\t#1 : lr=0.2")

    # a second launcher in the same sweep dir is refused in one line, and runs nothing
    second = _run(app_dir, *sweep, umask=0o002)
    assert second.returncode == 1, second.stdout
    assert re.match(
        r"hydra\.sweep\.dir=sweep is in use by another launcher \(pid \d+ on .*; its lock: "
        r"sweep/\.torchrun_launcher\.lock\): wait for it to end",
        _error(second.stdout),
    ), second.stdout
    assert "[default0]" not in second.stdout

    # the first one is killed hard (an OOM killer, a node lost) while job 1 runs, after a checkpoint
    first.wait_for_text("[default0]:rank 0: step 3", after="\t#1 : lr=0.2")
    # the journal has it at once; the summary within its few seconds
    wait_for(
        lambda: [j["status"] for j in _summary(app_dir / "sweep")] == ["COMPLETED", "RUNNING"],
        2 * SUMMARY_INTERVAL_S,
        "the summary to say that job 1 runs",
    )
    children = [p.pid for p in psutil.Process(first.proc.pid).children(recursive=True)]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=60)
    assert_gone(children)
    saved = json.loads((app_dir / "sweep" / "1" / "checkpoint.json").read_text())["step"]
    assert saved >= 2

    # its lock does not block; the unfinished sweep resumes, job 0 from the record (0600
    # pickle in a group-writable job dir under umask 002), job 1 from its checkpoint
    assert (app_dir / "sweep" / "0" / ".hydra").stat().st_mode & 0o020
    code, out = _Launcher(app_dir, *sweep, umask=0o002).end()
    assert code == 0, out
    assert "1 completed job(s) come from its record (#0), 1 unfinished job(s) continue (#1)" in out, out
    assert f"[default0]:rank 0: resumed at step {saved}" in out, out
    assert f"rank 0: done, 40 steps from {saved}" in out and "steps from 0" not in out, out
    assert "job 1 of 1 ended: #1 : lr=0.2 steps=40 step_s=0.3 checkpoint_every=2 : COMPLETED" in out, out
    assert [j["status"] for j in _summary(app_dir / "sweep")] == ["COMPLETED", "COMPLETED"]


def test_a_sweep_stopped_with_sigterm_continues_its_job_from_the_checkpoint(tmp_path: Path) -> None:
    """Ctrl-C or SIGTERM (a scheduler's kill) mid-job: the same command continues the job in its
    job dir with `resumed()` True; a job that failed, or that is rerun afresh, is not resumed."""
    app_dir = _install(tmp_path, PREEMPT_APP)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", "steps=30", "step_s=0.2", "checkpoint_every=2"]
    first = _Launcher(app_dir, *sweep)
    first.wait_for_text("[default0]:rank 0: step 3", after="\t#1 : lr=0.2")
    first.proc.send_signal(signal.SIGTERM)
    code, out = first.end()
    assert code != 0, out
    assert [j["status"] for j in _summary(app_dir / "sweep")] == ["COMPLETED", "STOPPED"], out
    saved = json.loads((app_dir / "sweep" / "1" / "checkpoint.json").read_text())["step"]

    code, out = _Launcher(app_dir, *sweep).end()
    assert code == 0, out
    assert "1 completed job(s) come from its record (#0), 1 unfinished job(s) continue (#1)" in out, out
    assert f"[default0]:rank 0: resumed at step {saved}" in out, out
    assert "without a checkpoint" not in out, out

    # the finished sweep, run again, is a new run: its jobs start afresh, not resumed
    code, out = _Launcher(app_dir, *sweep).end()
    assert code == 0, out
    assert "rank 0: resumed" not in out and out.count("rank 0: done, 30 steps from 0") == 2, out


def _preempt_job_1(app_dir: Path, *extra: str, **env: str) -> str:
    sweep = _Launcher(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", *extra, **env)
    sweep.wait_for_text("[default0]:rank 0: step 2", after="\t#1 : lr=0.2")
    sweep.proc.send_signal(signal.SIGUSR2)
    code, out = sweep.end()
    assert code == 128 + signal.SIGUSR2, out
    return out


def test_a_moved_sweep_dir_resumes_and_another_job_dir_starts_afresh(tmp_path: Path) -> None:
    app_dir = _install(tmp_path, PREEMPT_APP)
    _preempt_job_1(app_dir)
    stopped_at = json.loads((app_dir / "sweep" / "1" / "checkpoint.json").read_text())["step"]
    (app_dir / "sweep").rename(app_dir / "moved")
    # the dry run says what the run will do with the recorded jobs, and changes nothing
    summary = (app_dir / "moved" / "sweep_summary.json").read_text()
    dry = _run(app_dir, "-m", "hydra.sweep.dir=moved", "lr=0.1,0.2", "hydra.launcher.dry_run=true")
    assert dry.returncode == 0, dry.stdout
    assert (
        "Dry run: 2 jobs, 1 at a time (1 of them from the sweep dir's record, not run); nothing is started"
        in dry.stdout
    ), dry.stdout
    job_0, job_1 = dry.stdout.split("\t#1 : lr=0.2")
    assert "record:     COMPLETED in the record: not run, its result comes from the record" in job_0
    assert "record:     PREEMPTED in the record: runs on in its job dir (preemption.resumed() True)" in job_1
    assert "rank 0:" not in dry.stdout and (app_dir / "moved" / "sweep_summary.json").read_text() == summary
    code, out = _Launcher(app_dir, "-m", "hydra.sweep.dir=moved", "lr=0.1,0.2").end()
    assert code == 0, out
    assert "1 completed job(s) come from its record (#0), 1 unfinished job(s) continue (#1)" in out, out
    assert f"[default0]:rank 0: resumed at step {stopped_at}" in out, out

    # preempted again, then resumed with another hydra.sweep.subdir: no checkpoint there
    shutil.rmtree(app_dir / "moved")
    _preempt_job_1(app_dir)
    elsewhere = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", "hydra.sweep.subdir=job_${hydra.job.num}"]
    dry = _run(app_dir, *elsewhere, "hydra.launcher.dry_run=true")
    assert "\t\trecord:     PREEMPTED in the record: runs afresh\n" in dry.stdout, dry.stdout
    never = _run(app_dir, *elsewhere, "hydra.launcher.dry_run=true", "hydra.launcher.resume=false")
    assert never.returncode == 0 and "record:" not in never.stdout, never.stdout
    code, out = _Launcher(app_dir, *elsewhere).end()
    assert code == 0, out
    assert "0 unfinished job(s) continue, 1 run afresh (#1)" in out, out
    assert "resumed" not in out.split("\t#1 : lr=0.2")[1], out
    assert "[default0]:rank 0: done, 6 steps from 0" in out, out


def test_a_job_stopped_in_its_callback_is_not_resumed(tmp_path: Path) -> None:
    app_dir = _install(tmp_path, PREEMPT_APP)
    gate = tmp_path / "gate"
    gate.mkdir()
    callback = ["+hydra.callbacks.hold._target_=gate.HoldOnJobStart"]
    sweep = _Launcher(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1", *callback, GATE_DIR=str(gate))
    wait_for(lambda: (gate / "in_callback").exists() or sweep.proc.poll() is not None, 180, "on_job_start")
    sweep.proc.send_signal(signal.SIGUSR2)
    wait_for(
        lambda: "the sweep was preempted" in sweep.text() or (gate / "go").touch() or False, 5, "x"
    ) if False else None
    (gate / "go").touch()
    code, out = sweep.end()
    assert code == 128 + signal.SIGUSR2, out
    assert [j["status"] for j in _summary(app_dir / "sweep")] == ["PREEMPTED"], out
    (gate / "in_callback").unlink()
    code, out = _Launcher(
        app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1", *callback, GATE_DIR=str(gate)
    ).end()
    assert code == 0, out
    assert "resumed" not in out and "[default0]:rank 0: done, 6 steps from 0" in out, out


def test_a_completed_jobs_value_comes_from_its_kept_return_not_from_the_summary(tmp_path: Path) -> None:
    app_dir = _install(tmp_path, RECORD_APP)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1"]
    assert _run(app_dir, *sweep).returncode == 0
    path = app_dir / "sweep" / "sweep_summary.json"
    record = json.loads(path.read_text())
    record["jobs"][0]["return_value"] = 999
    path.write_text(json.dumps(record))
    resumed = _run(app_dir, *sweep, "hydra.launcher.resume=true")
    assert resumed.returncode == 0, resumed.stdout
    assert "#0 : lr=0.1 : COMPLETED in an earlier run, returned 1.0" in resumed.stdout, resumed.stdout
    assert [job["return_value"] for job in _summary(app_dir / "sweep")] == [1.0]


def test_a_truncated_job_return_runs_the_job_again(tmp_path: Path) -> None:
    app_dir = _install(tmp_path, RECORD_APP)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2"]
    assert _run(app_dir, *sweep).returncode == 0
    pickled = app_dir / "sweep" / "0" / ".hydra" / "job_return.pkl"
    assert pickled.stat().st_mode & 0o777 == 0o600
    pickled.write_bytes(pickled.read_bytes()[:20])
    result = _run(app_dir, *sweep, "hydra.launcher.resume=true")
    assert result.returncode == 0, result.stdout
    assert re.search(
        r"job #0 is completed in the record but sweep/0/\.hydra/job_return\.pkl cannot be read "
        r"\(\w+: .*\): it runs again",
        result.stdout,
    ), result.stdout
    assert _ranks_ran(result.stdout) == ["train_a lr=0.1"], result.stdout

    # the summary an earlier version of the launcher left (no journal), cut short (a full
    # disk): nothing is resumed from it, every job runs
    (app_dir / "sweep" / JOURNAL_FILE).unlink()
    summary = app_dir / "sweep" / "sweep_summary.json"
    summary.write_text(summary.read_text()[:40])
    result = _run(app_dir, *sweep)
    assert result.returncode == 0, result.stdout
    assert re.search(
        r"sweep/sweep_summary\.json cannot be read as this launcher's record \(\w+: .*\): nothing is resumed",
        result.stdout,
    ), result.stdout
    assert _ranks_ran(result.stdout) == ["train_a lr=0.1", "train_a lr=0.2"], result.stdout


def test_a_failed_job_runs_again_though_its_job_dir_holds_an_earlier_runs_return(tmp_path: Path) -> None:
    """A job that completed, then failed when the sweep ran again in the same sweep dir (the
    code had changed), still has the first run's `.hydra/job_return.pkl` in its job dir. The
    record says FAILED: resuming runs it again, and its value is this run's, not the stale one."""
    app_dir = _install(tmp_path, RECORD_APP)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2"]
    first = _run(app_dir, *sweep)
    assert first.returncode == 0, first.stdout
    assert [j["return_value"] for j in _summary(app_dir / "sweep")] == [1.0, 2.0], first.stdout

    # the code changes (another sweep: every job runs) and job 1 fails for an outside cause
    helper = app_dir / "helper.py"
    helper.write_text(helper.read_text().replace("lr * 10", "lr * 100"))
    failed = _run(app_dir, *sweep, FAIL_AT="0.2")
    assert failed.returncode == 1, failed.stdout
    assert "records another sweep (job #0's task code changed)" in failed.stdout, failed.stdout
    assert [j["status"] for j in _summary(app_dir / "sweep")] == ["COMPLETED", "FAILED"], failed.stdout
    # the case this test is about: job 1's dir still holds the first run's return (2.0)
    assert (app_dir / "sweep" / "1" / ".hydra" / "job_return.pkl").is_file()

    resumed = _run(app_dir, *sweep, "hydra.launcher.resume=true")
    assert resumed.returncode == 0, resumed.stdout
    assert (
        "1 completed job(s) come from its record (#0), 0 unfinished job(s) continue, "
        "1 failed or not started run again (#1)"
    ) in resumed.stdout, resumed.stdout
    assert "#0 : lr=0.1 : COMPLETED in an earlier run, returned 10.0" in resumed.stdout, resumed.stdout
    assert "#1 : lr=0.2 : COMPLETED in an earlier run" not in resumed.stdout, resumed.stdout
    assert _ranks_ran(resumed.stdout) == ["train_a lr=0.2"], resumed.stdout
    jobs = _summary(app_dir / "sweep")
    assert [j["status"] for j in jobs] == ["COMPLETED", "COMPLETED"], resumed.stdout
    assert [j["return_value"] for j in jobs] == [10.0, 20.0], resumed.stdout


@pytest.mark.parametrize(
    "stop_at, batch",
    [
        # while the sweeper validates its batch, before the launcher's first launch
        ("validate", ["hydra.job.config.override_dirname.kv_sep=${stop_at:validate}"]),
        ("0", []),
        ("1", ["hydra.sweeper.max_batch_size=1"]),
    ],
)
def test_a_stop_while_jobs_are_composed_ends_the_sweep_preempted(
    tmp_path: Path, stop_at: str, batch: List[str]
) -> None:
    """The stop signal while the launcher composes the first jobs, or a later batch of a
    sweeper: one line, the record of an unfinished sweep, and the same command resumes."""
    app_dir = _install(tmp_path, RECORD_APP)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", *batch]
    once = str(tmp_path / "once")
    stopped = _run(app_dir, *sweep, STOP_AT=stop_at, STOP_ONCE=once)
    assert stopped.returncode == 128 + signal.SIGUSR2, stopped.stdout
    last = stopped.stdout.strip().splitlines()[-1]
    assert last.startswith("[torchrun launcher] SIGUSR2: the sweep was preempted: "), stopped.stdout
    assert "To resume it, run the same command with hydra.sweep.dir=sweep" in last, stopped.stdout
    done = ["train_a lr=0.1"] if stop_at == "1" else []
    assert _ranks_ran(stopped.stdout) == done, stopped.stdout

    resumed = _run(app_dir, *sweep, STOP_AT=stop_at, STOP_ONCE=once)
    assert resumed.returncode == 0, resumed.stdout
    todo = ["train_a lr=0.2"] if stop_at == "1" else ["train_a lr=0.1", "train_a lr=0.2"]
    assert _ranks_ran(resumed.stdout) == todo, resumed.stdout
    assert [j["status"] for j in _summary(app_dir / "sweep")] == ["COMPLETED", "COMPLETED"]


@pytest.mark.parametrize(
    "launcher, sig, stop_at, batch, in_finalizer",
    [
        ("torchrun", "SIGINT", "0", [], False),
        ("torchrun", "SIGTERM", "0", [], False),
        # while Hydra's sweeper validates its batch, before the launcher's first launch
        (
            "torchrun",
            "SIGINT",
            "validate",
            ["hydra.job.config.override_dirname.kv_sep=${stop_at:validate}"],
            False,
        ),
        ("torchrun_slurm", "SIGINT", "0", [], False),
        # the handler runs inside a finalizer, which drops what it raises: no job starts either
        ("torchrun", "SIGINT", "0", [], True),
    ],
)
def test_ctrl_c_or_sigterm_while_no_job_runs_ends_with_one_line_and_its_status(
    tmp_path: Path, launcher: str, sig: str, stop_at: str, batch: List[str], in_finalizer: bool
) -> None:
    """Python's own Ctrl-C (or SIGTERM's default) before any job runs: one line, as during
    the jobs, not a traceback through Hydra and the launcher (or a silent end)."""
    app_dir = _install(tmp_path, RECORD_APP)
    finalizer = {"STOP_IN_FINALIZER": "1"} if in_finalizer else {}
    stopped = _run(
        app_dir,
        "-m",
        "hydra.sweep.dir=sweep",
        f"hydra/launcher={launcher}",
        "lr=0.1,0.2",
        *batch,
        STOP_AT=stop_at,
        STOP_WITH=sig,
        STOP_ONCE=str(tmp_path / "once"),
        **finalizer,
    )
    assert stopped.returncode == 128 + getattr(signal, sig), stopped.stdout
    assert not _ranks_ran(stopped.stdout), stopped.stdout
    line = f"[torchrun launcher] {sig}: the sweep was stopped while no job of it was running"
    if in_finalizer:  # the line, then Python's own words for what the finalizer raised; no job ran
        said = stopped.stdout.split(line, 1)[1]
        assert said.lstrip().startswith("Exception ignored in: <function _SignalInAFinalizer.__del__"), said
        assert said.rstrip().endswith(f"SystemExit: {stopped.returncode}") and "HYDRA" not in said, said
    else:
        assert "Traceback" not in stopped.stdout, stopped.stdout
        assert stopped.stdout.rstrip().splitlines()[-1] == line, stopped.stdout


def test_sigusr1_as_the_stop_signal_is_taken_with_one_warning(tmp_path: Path) -> None:
    app_dir = _install(tmp_path, RECORD_APP)
    result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", "hydra.launcher.stop_signal=SIGUSR1")
    assert result.returncode == 0, result.stdout
    warning = "hydra.launcher.stop_signal=SIGUSR1: NCCL may take SIGUSR1"
    assert result.stdout.count(warning) == 1, result.stdout
    assert _ranks_ran(result.stdout) == ["train_a lr=0.1", "train_a lr=0.2"], result.stdout


@pytest.mark.parametrize("key", ["job_timeout", "stop_timeout"])
def test_an_infinite_timeout_is_refused_in_one_line(tmp_path: Path, key: str) -> None:
    app_dir = _install(tmp_path, RECORD_APP)
    result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1", f"hydra.launcher.{key}=inf")
    assert result.returncode == 1, result.stdout
    assert _error(result.stdout).startswith(f"job #0 (lr=0.1): hydra.launcher.{key}=inf is invalid: "), (
        result.stdout
    )
    assert "Traceback" not in result.stdout and not _ranks_ran(result.stdout)


def test_a_failed_job_names_this_runs_stderr_log_in_a_reused_sweep_dir(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", "fail_at=0.2"]
    named = []
    for _ in range(2):
        result = _run(app_dir, *sweep)
        assert result.returncode == 1, result.stdout
        (path,) = set(re.findall(r"its output: (\S+stderr\.log)", result.stdout))
        named.append(app_dir / path)
        assert named[-1].is_file(), result.stdout
    # the second run's own log, not the first run's (same rendezvous id, same job dir)
    assert named[0] != named[1] and named[0].parent.parent.parent != named[1].parent.parent.parent, named


def test_jobs_at_once_with_a_prefix_template_and_a_job_without_overrides_are_labelled(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    template = "hydra.launcher.log_line_prefix_template='<{rank}>'"
    result = _run(
        app_dir, "-m", "hydra.sweep.dir=sweep", "hydra.launcher.parallel_jobs=2", template, "lr=0.1,0.2"
    )
    assert result.returncode == 0, result.stdout
    ranks = [line for line in result.stdout.splitlines() if re.match(r"^(#\d )?<\d>", line)]
    assert ranks and all(re.match(r"^#[01] <[01]>", line) for line in ranks), result.stdout

    # a job without overrides: its number alone, no empty overrides between colons
    result = _run(app_dir, "-m", "hydra.sweep.dir=single")
    assert result.returncode == 0, result.stdout
    assert re.search(r"job 1 of 1 ended: #0 : COMPLETED in [\d.]+s, returned 1\.0", result.stdout), (
        result.stdout
    )
    assert " :  : " not in result.stdout, result.stdout


def _torchrun_line(out: str) -> "tuple[str, List[str]]":
    """The dry run's torchrun line of its only job, and its `(it cannot express: ...)` line."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "\ttorchrun:" in line)
    cannot = [line.strip() for line in lines[at + 1 : at + 2] if "it cannot express" in line]
    return lines[at].split("torchrun:", 1)[1].strip(), cannot


def test_the_torchrun_line_runs_a_script_in_its_job_dir_with_the_jobs_settings(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    (app_dir / "write.py").write_text(
        "import os, sys\n"
        "open(f\"out_{os.environ['RANK']}.txt\", 'w').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "print('role', os.environ['ROLE_NAME'], flush=True)\n"
    )
    # flags of a newer torchrun are shown where the installed one has them, else said
    shutdown = "--shutdown-timeout" in torchrun_options()
    virtual = "--virtual-local-rank" in torchrun_options()
    job = [
        "-m",
        "hydra.sweep.dir=sweep",
        "world=1",
        "hydra.launcher.training_script=write.py",
        "hydra.launcher.shutdown_timeout=7",
        *(["hydra.launcher.virtual_local_rank=true"] if virtual else []),
        "hydra.launcher.dry_run=true",
    ]
    # a PET_ variable of this shell that the line's torchrun would read: the job has the
    # user's role (torchrun's default), and so must the line pasted in this shell
    prefix = "hydra.launcher.log_line_prefix_template='<{rank}>'"
    pet = {"PET_ROLE": "pet"}
    result = _run(
        app_dir,
        *job,
        "hydra.launcher.training_script_args=[--tag,x]",
        "hydra.launcher.role=default",
        prefix,
        **pet,
    )
    assert result.returncode == 0, result.stdout
    assert "PET_ROLE=pet: using role=default (yours)" in result.stdout, result.stdout
    line, cannot = _torchrun_line(result.stdout)
    job_dir = app_dir / "sweep" / "0"
    quoted = shlex.quote(str(job_dir))
    assert line.startswith(f"mkdir -p {quoted} && cd {quoted} && "), line
    assert ("--shutdown-timeout=7" in line) == shutdown and ("--virtual-local-rank" in line) == virtual, line
    no_such = ["(it cannot express: --shutdown-timeout (this torch's torchrun has no such option))"]
    assert cannot == ([] if shutdown else no_such), cannot
    run = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=_env(**pet), capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (job_dir / "out_0.txt").read_text() == "--tag x\n"
    assert "<0>role default" in run.stdout.splitlines(), (line, run.stdout)

    # what a torchrun line cannot do is said, not left out
    result = _run(app_dir, *job, "hydra.launcher.training_script_args=[--tag,'{rank}']")
    _, cannot = _torchrun_line(result.stdout)
    per_rank = "{rank}/{local_rank} in {rank} (replaced per rank by the launcher)"
    older = "" if shutdown else "--shutdown-timeout (this torch's torchrun has no such option); "
    assert cannot == [f"(it cannot express: {older}{per_rank})"], cannot


def test_the_torchrun_line_runs_the_task_under_its_launch_prefix(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    prefix = "hydra.launcher.launch_prefix=[env,'TAG=prefixed']"
    result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "world=1", prefix, "hydra.launcher.dry_run=true")
    assert result.returncode == 0, result.stdout
    line, cannot = _torchrun_line(result.stdout)
    assert " --no-python env TAG=prefixed " in line, line
    # the launcher's shutdown_timeout (5 s) is not torchrun's default: a torchrun without
    # the option cannot say it
    no_such = "(it cannot express: --shutdown-timeout (this torch's torchrun has no such option))"
    assert cannot == ([] if "--shutdown-timeout" in torchrun_options() else [no_such]), cannot
    run = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # the job ran through its prefix, in its job dir (Hydra's run mode applies env_set itself)
    assert (app_dir / "sweep" / "0" / "rank0.txt").read_text() == "1 job0 0.1\n"


def test_a_pet_variable_torch_itself_cannot_parse_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    """torch's own parser reads PET_STANDALONE as an int as it is built (plain torchrun ends
    with a traceback there); the launcher names the variable in one line, before any rank."""
    app_dir = _install(tmp_path)
    for args in ([], ["hydra.launcher.dry_run=true"]):
        result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "world=1", *args, PET_STANDALONE="true")
        assert result.returncode == 1, result.stdout
        assert _error(result.stdout) == (
            "job #0 (world=1): PET_STANDALONE='true' is not 0 or 1 (torchrun reads it as --standalone)"
        ), result.stdout


def test_a_reader_of_the_summary_always_parses_it_while_200_jobs_run(tmp_path: Path) -> None:
    """The summary is replaced whole (a reader polling it never sees half of it), a few
    times a minute rather than twice a job; the journal has every event; the console ends
    with the tally, where the full table is, and no row of the 200 completed jobs."""
    app_dir = _install(tmp_path, RECORD_APP)
    summary = app_dir / "sweep" / "sweep_summary.json"
    sweep = _Launcher(
        app_dir, "-m", "hydra.sweep.dir=sweep", "lr=range(200)", "hydra.launcher.parallel_jobs=2"
    )
    texts = set()
    seen_completed = set()
    first_seen = None
    launcher = psutil.Process(sweep.proc.pid)
    while "200 jobs: " not in sweep.text() and launcher.status() != psutil.STATUS_ZOMBIE:
        try:
            text = summary.read_text()
        except FileNotFoundError:  # not written yet
            time.sleep(0.01)
            continue
        first_seen = first_seen or time.monotonic()
        jobs = json.loads(text)["jobs"]  # whole, whenever it is read
        assert len(jobs) == 200, text
        texts.add(text)
        seen_completed.add(sum(job["status"] == "COMPLETED" for job in jobs))
        time.sleep(0.01)
    running_s = time.monotonic() - (first_seen or time.monotonic())
    code, out = sweep.end()
    assert code == 0, out[-5000:]
    # read as the sweep went on (0 completed, some, ...), rewritten every few seconds at most
    assert len([n for n in seen_completed if 0 < n < 200]) >= 2, (seen_completed, out[-5000:])
    assert len(texts) <= running_s / SUMMARY_INTERVAL_S + 3, (len(texts), running_s)

    jobs = _summary(app_dir / "sweep")
    assert [(j["num"], j["status"], j["return_value"]) for j in jobs] == [
        (num, "COMPLETED", num * 10) for num in range(200)
    ]
    # a line per event: the launch of each job, its start, its end
    assert len((app_dir / "sweep" / JOURNAL_FILE).read_text().splitlines()) == 1 + 3 * 200
    lines = out.splitlines()
    tally = next(i for i, line in enumerate(lines) if "200 jobs: 200 completed" in line)
    assert lines[tally].endswith("(summary: sweep/sweep_summary.json)"), out[-5000:]
    assert lines[tally + 1] == "every job's row is in sweep/sweep_table.txt", out[-5000:]
    assert tally + 2 == len(lines) or not re.match(r"\d+\s+COMPLETED", lines[tally + 2]), out[-5000:]
    table = (app_dir / "sweep" / "sweep_table.txt").read_text().splitlines()
    assert len(table) == 201 and re.match(
        r"199\s+COMPLETED\s+[\d.]+s\s+lr=199\s+1990\s+sweep/199$", table[-1]
    )


def test_a_sweep_killed_with_kill_9_resumes_from_its_journal_with_nothing_lost(tmp_path: Path) -> None:
    """The launcher killed hard mid-sweep (an OOM killer): every job it had said completed
    is in the journal (the summary may lag it by a few seconds); the same command runs the
    rest, and none of those again."""
    app_dir = _install(tmp_path, RECORD_APP)
    sweep = ["-m", "hydra.sweep.dir=sweep", "lr=range(40)"]
    first = _Launcher(app_dir, *sweep)
    first.wait_for_text("job 12 of 40 ended")
    children = [p.pid for p in psutil.Process(first.proc.pid).children(recursive=True)]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=60)
    assert_gone(children)
    told = {int(n) for n in re.findall(r"job \d+ of 40 ended: #(\d+) : lr=\d+ : COMPLETED", first.text())}
    assert len(told) >= 12, first.text()
    rows, _ = read_journal(app_dir / "sweep" / JOURNAL_FILE)
    completed = {num for num, row in rows.items() if row["status"] == "COMPLETED"}
    assert told <= completed and sorted(rows) == list(range(40)), (told, completed)
    summarized = {job["num"] for job in _summary(app_dir / "sweep") if job["status"] == "COMPLETED"}
    assert summarized <= completed

    code, out = _Launcher(app_dir, *sweep).end()
    assert code == 0, out
    assert f"{len(completed)} completed job(s) come from its record" in out, out
    assert sorted(_ranks_ran(out)) == sorted(f"train_a lr={n}" for n in range(40) if n not in completed), out
    jobs = _summary(app_dir / "sweep")
    assert [(j["num"], j["status"], j["return_value"]) for j in jobs] == [
        (num, "COMPLETED", num * 10) for num in range(40)
    ]
