"""A sweep a user can read: what the console and the sweep dir say, job by job.

The app (`tests/console_app/`) is copied where a user would have it and run as a user runs
it, from its own directory, with the short errors Hydra shows by default. The tests read
what the user reads: the console text (stdout and stderr as one terminal shows them), the
summary file, the job dirs, and they run the commands the launcher hands out (the job's
`rerun.sh`, the dry run's `torchrun` line).
"""

import fcntl
import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import List

import pytest

from tests.conftest import as_from_a_terminal, wait_for

APP_DIR = Path(__file__).parent / "console_app"
# a line of the launcher's (Hydra's logging), a rank's prefixed line, a row of the table
HYDRA_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[HYDRA\] ")

pytestmark = pytest.mark.timeout(300)


def _install(tmp_path: Path) -> Path:
    app_dir = tmp_path / "app"
    shutil.copytree(APP_DIR, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return app_dir


def _run(app_dir: Path, *args: str, env: "dict[str, str] | None" = None) -> subprocess.CompletedProcess:
    """`python app.py ARGS` with stdout and stderr in one stream, as a terminal shows them."""
    environ = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    environ.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "app.py", *args],
        cwd=app_dir,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )


def _summary(sweep_dir: Path) -> List[dict]:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())["jobs"]


def test_a_failed_job_is_told_once_when_it_happens(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2,0.3", "fail_at=0.2")
    out = result.stdout
    assert result.returncode == 1, out
    lines = out.splitlines()

    # the rank's own traceback, with its prefix, as it happens; later only Hydra's last word
    # (the job's error: the rank's exception itself); nobody else's copy of it
    assert out.count("Traceback (most recent call last)") == 2, out
    assert "[default1]:Traceback (most recent call last):" in lines, out
    assert "[default1]:ValueError: lr=0.2 diverged" in lines, out
    assert 'raise ValueError(f"lr={cfg.lr} diverged")' in out
    assert "api.py" not in out and "Closing process" not in out and "SIGTERM" not in out, out

    # the job's line when it ends, before the next job starts: rank, cause, where its output is
    failed = next(i for i, line in enumerate(lines) if "#1 : lr=0.2 fail_at=0.2 : FAILED in " in line)
    assert HYDRA_LINE.match(lines[failed]) and lines[failed].split("] ", 1)[1].startswith(
        "job 2 of 3 ended"
    ), out
    assert re.search(
        r"FAILED in [\d.]+s: rank 1 \(local_rank 1, pid \d+\) exited with code 1: "
        r"ValueError: lr=0.2 diverged$",
        lines[failed],
    ), lines[failed]
    its_output = lines[failed + 1].strip()
    assert its_output.startswith("its output: "), out
    rank_log = app_dir / its_output[len("its output: ") :]  # from where the sweep was launched
    assert its_output.startswith("its output: sweep/1/torchrun_logs/"), its_output
    assert "ValueError: lr=0.2 diverged" in rank_log.read_text()
    assert failed < next(i for i, line in enumerate(lines) if line.endswith("#2 : lr=0.3 fail_at=0.2"))

    # torch's own account is kept in the job's files
    assert "failed (exitcode: 1) local_rank: 1" in (app_dir / "sweep/1/torchrun_agent.log").read_text()

    # the table (its overrides column: what varies across the sweep; then one line for what
    # every job has), and the same in a file a script can read
    table = lines[next(i for i, line in enumerate(lines) if "3 jobs: 2 completed, 1 failed" in line) + 1 :]
    assert re.match(r"#\s+status\s+time\s+overrides\s+result\s+job dir$", table[0]), out
    assert re.match(r"0\s+COMPLETED\s+[\d.]+s\s+lr=0.1\s+1.0\s+sweep/0$", table[1]), out
    assert re.match(
        r"1\s+FAILED\s+[\d.]+s\s+lr=0.2\s+"
        r"rank 1 exited with code 1: ValueError: lr=0.2 diverged\s+sweep/1$",
        table[2],
    ), out
    assert re.match(r"2\s+COMPLETED\s+[\d.]+s\s+lr=0.3\s+3.0\s+sweep/2$", table[3]), out
    assert table[4] == "overrides every job has: fail_at=0.2", out
    jobs = _summary(app_dir / "sweep")
    assert [(j["num"], j["overrides"], j["status"], j["return_value"]) for j in jobs] == [
        (0, ["lr=0.1", "fail_at=0.2"], "COMPLETED", 1.0),
        (1, ["lr=0.2", "fail_at=0.2"], "FAILED", None),
        (2, ["lr=0.3", "fail_at=0.2"], "COMPLETED", 3.0),
    ]
    assert jobs[1]["error"].startswith("rank 1 (local_rank 1, pid ")
    assert all(j["duration_s"] > 0 and Path(j["job_dir"]) == app_dir / "sweep" / str(j["num"]) for j in jobs)

    # Hydra's last word: which job, then the rank's exception as the task raised it (its frame,
    # no frame of Hydra's or torch's), then which rank it was and where its output is
    end = out[out.index("Error executing job with overrides: ['lr=0.2', 'fail_at=0.2']") :]
    assert "in main\n" in end and 'raise ValueError(f"lr={cfg.lr} diverged")' in end, end
    assert "/torch/" not in end and "/hydra/" not in end, end
    told = end.splitlines()
    said = told.index("ValueError: lr=0.2 diverged")
    rank = told[said + 1]
    assert rank.startswith("rank 1 (local_rank 1, pid ") and rank.endswith("exited with code 1"), end
    assert told[said + 2] == its_output, end


def test_a_one_job_launch_ends_with_its_table_too(tmp_path: Path) -> None:
    """A single distributed run (a one-job multirun) ends as every launch does: the tally,
    the summary file and the job's row, which names its job dir."""
    app_dir = _install(tmp_path)
    result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1")
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    tally = next(i for i, line in enumerate(lines) if HYDRA_LINE.match(line) and "1 job: 1 completed" in line)
    assert lines[tally].endswith("(summary: sweep/sweep_summary.json)"), result.stdout
    assert lines[tally + 1].split() == ["#", "status", "time", "overrides", "result", "job", "dir"], (
        result.stdout
    )
    row = lines[tally + 2].split()
    assert row[:2] == ["0", "COMPLETED"] and row[3] == "lr=0.1" and row[-1] == "sweep/0", result.stdout


def test_redirects_alone_under_the_default_tee_is_said_and_with_tee_0_keeps_the_console_quiet(
    tmp_path: Path,
) -> None:
    """torch tees what both keys name: a torchrun user's `redirects=3` alone, under the
    launcher's tee=3, changes nothing, and one line says so; with tee=0 the ranks' lines are in
    the files only."""
    app_dir = _install(tmp_path)
    alone = _run(app_dir, "-m", "hydra.sweep.dir=alone", "lr=0.1", "hydra.launcher.redirects=3")
    assert alone.returncode == 0, alone.stdout
    said = (
        "hydra.launcher.redirects=3: the ranks' stdout and stderr still show on the console, as "
        "hydra.launcher.tee=3 (the launcher's default is 3) shows them; set tee=0 to keep them in "
        "the files only"
    )
    assert sum(line.endswith(said) for line in alone.stdout.splitlines()) == 1, alone.stdout
    assert "[default0]:" in alone.stdout, alone.stdout
    quiet = _run(
        app_dir, "-m", "hydra.sweep.dir=quiet", "lr=0.1", "hydra.launcher.redirects=3", "hydra.launcher.tee=0"
    )
    assert quiet.returncode == 0, quiet.stdout
    assert "still show on the console" not in quiet.stdout and "rank 0 of 2 starts" not in quiet.stdout
    logs = list((app_dir / "quiet" / "0" / "torchrun_logs").rglob("*.log"))
    assert any("rank 0 of 2 starts" in log.read_text() for log in logs), logs


def test_jobs_at_once_label_every_line(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    result = _run(
        app_dir, "-m", "hydra.sweep.dir=sweep", "hydra.launcher.parallel_jobs=2", "lr=0.1,0.2", "fail_at=0.2"
    )
    assert result.returncode == 1, result.stdout
    lines = result.stdout.splitlines()
    table_at = next(i for i, line in enumerate(lines) if "2 jobs: 1 completed, 1 failed" in line)
    unlabeled = []
    for line in lines[:table_at]:
        if HYDRA_LINE.match(line) and re.search(r"#[01] ", line):
            continue  # the launcher's line about a job
        if re.match(r"^\[#[01] default[01]\]:", line) or line.startswith("\t"):
            continue  # a rank's line; the rest of a launcher's line
        if HYDRA_LINE.match(line) and "Launching 2 jobs" in line:
            continue
        unlabeled.append(line)
    assert not unlabeled, result.stdout
    assert "[#1 default1]:ValueError: lr=0.2 diverged" in lines, result.stdout


def _torchrun_lines(out: str) -> List[str]:
    return [line.split("torchrun:", 1)[1].strip() for line in out.splitlines() if "\ttorchrun:" in line]


def test_dry_run_prints_every_jobs_plan_and_starts_nothing(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    result = _run(
        app_dir, "-m", "hydra.sweep.dir=sweep", "hydra.launcher.dry_run=true", "lr=0.1,0.2", "world=1,2"
    )
    out = result.stdout
    assert result.returncode == 0, out
    assert "Dry run: 4 jobs, 1 at a time; nothing is started" in out
    for num, (lr, world) in enumerate([(0.1, 1), (0.1, 2), (0.2, 1), (0.2, 2)]):
        block = out.split(f"\t#{num} : lr={lr} world={world}\n", 1)[1].split("\t#", 1)[0]
        assert f"job dir:    {app_dir / 'sweep' / str(num)}" in block, out
        assert f"ranks:      {world} per node x 1 node(s), forkserver, task function" in block, out
        assert "devices:    " in block and "rendezvous: c10d at localhost:0 (a free port when" in block, out
    # Hydra's sweeper writes the sweep's multirun.yaml before it launches; nothing else is there
    assert [p.name for p in (app_dir / "sweep").iterdir()] == ["multirun.yaml"], "a dry run started something"

    # the torchrun line is the job: pasted as it is printed (anywhere), plain torchrun runs job #3
    line = _torchrun_lines(out)[3]
    command = shlex.split(line)
    assert command[:3] == ["cd", str(app_dir), "&&"], command
    assert command[3:5] == ["env", "TAG=job3"] and command[5] == "torchrun", command
    assert "--nproc-per-node=2" in command and command[-5:-3] == ["lr=0.2", "world=2"], command
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    torchrun = subprocess.run(
        ["bash", "-c", line],
        cwd=tmp_path,
        env=dict(os.environ, PATH=path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert torchrun.returncode == 0, torchrun.stdout + torchrun.stderr
    for rank in (0, 1):
        assert (app_dir / "sweep" / "3" / f"rank{rank}.txt").read_text() == "2 job3 0.2\n"


def test_dry_run_names_the_bad_job_and_key(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "hydra.launcher.dry_run=true", "world=2,0")
    assert result.returncode == 1, result.stdout
    assert result.stdout.splitlines()[0] == (
        "job #1 (world=0): hydra.launcher.nproc_per_node=0 is invalid: "
        "use a positive int, one of gpu, cpu, auto, xpu or a device backend's name"
    ), result.stdout
    assert [p.name for p in (app_dir / "sweep").iterdir()] == ["multirun.yaml"]


def test_rerun_script_runs_one_job_again_outside_its_sweep(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    result = _run(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", "hold=0.1")
    assert result.returncode == 0, result.stdout
    script = app_dir / "sweep" / "1" / "rerun.sh"
    text = script.read_text()
    assert "# Job #1 of the sweep in sweep: lr=0.2 hold=0.1" in text
    assert re.search(
        r"#     cd .* && env TAG=job1 torchrun --nnodes=1 --nproc-per-node=2 .* app.py lr=0.2 hold=0.1 ", text
    )

    # from anywhere, with one more override
    rerun = subprocess.run(
        ["bash", str(script), "hold=0"], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    (rerun_dir,) = (app_dir / "sweep" / "1").glob("rerun_*")
    # the job's overrides, the extra one last (Hydra keeps the last value of a key)
    assert (rerun_dir / "0" / ".hydra" / "overrides.yaml").read_text().split() == [
        "-",
        "lr=0.2",
        "-",
        "hold=0",
    ]
    # the same job: 2 ranks, lr 0.2; it is job 0 of its own one-job sweep
    for rank in (0, 1):
        assert (rerun_dir / "0" / f"rank{rank}.txt").read_text() == "2 job0 0.2\n"
    assert "returned 2.0" in rerun.stdout + rerun.stderr


def test_a_multirun_config_makes_a_plain_run_one_distributed_job(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    result = _run(app_dir, "--config-name", "single", "lr=0.5")
    out = result.stdout
    assert result.returncode == 0, out
    (job_dir,) = (app_dir / "multirun").glob("*/*/0")
    shown = job_dir.parent.relative_to(app_dir)
    assert f"Launching 1 job with torchrun into {shown}" in out, out
    assert re.search(r"job 1 of 1 ended: #0 : lr=0.5 : COMPLETED in [\d.]+s, returned 5.0", out), out
    for rank in (0, 1):
        assert (job_dir / f"rank{rank}.txt").read_text() == "2 job0 0.5\n"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_a_job_waits_for_its_other_node_ends_on_one_line(tmp_path: Path, sig: int) -> None:
    # a two-node job whose second node never comes: its agent waits in the rendezvous (with
    # nothing to resume, the nodes do not first agree on what to resume)
    app_dir = _install(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "app.py",
        "-m",
        "hydra.sweep.dir=sweep",
        "hydra.launcher.nnodes=2",
        "hydra.launcher.rdzv_backend=c10d",
        f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}",
        "hydra.launcher.resume=false",
        "lr=0.1,0.2",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("HYDRA_FULL_ERROR", None)
    out = tmp_path / "out.txt"
    with out.open("w") as stdout:
        proc = subprocess.Popen(
            command,
            cwd=app_dir,
            env=env,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=as_from_a_terminal,
        )
    try:
        wait_for(lambda: (app_dir / "sweep/0/.hydra/config.yaml").exists(), 120, "job 0 to start")
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C, or a scheduler's SIGTERM, to the group
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = out.read_text()
    assert code == 128 + sig, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    name = signal.Signals(sig).name
    assert output.rstrip().splitlines()[-1] == (
        f"[torchrun launcher] {name}: the sweep was stopped: stopped #0 (logs in sweep/0); "
        "not started #1; summary in sweep/sweep_summary.json"
    ), output
    (job,) = [j for j in _summary(app_dir / "sweep") if j["num"] == 0]
    assert job["status"] == "STOPPED" and "stopped by signal " + name in job["error"], job


def _on_a_terminal(app_dir: Path, *args: str, columns: int = 150) -> "tuple[int, str]":
    """`python app.py ARGS` with a pseudo-terminal for its stdin, stdout and stderr, as a user
    types it: its exit status, and every byte its terminal received."""
    env = dict(os.environ, TERM="xterm")
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("PYTHONUNBUFFERED", None)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "app.py", *args],
        cwd=app_dir,
        env=env,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        start_new_session=True,
        preexec_fn=as_from_a_terminal,
    )
    os.close(follower)
    received = b""
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            if not select.select([leader], [], [], 1)[0]:
                continue
            try:
                data = os.read(leader, 1 << 16)
            except OSError:  # EIO: every process holding the terminal has ended
                break
            if not data:
                break
            received += data
        code = proc.wait(timeout=60)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, received.decode(errors="replace")


def _screen(received: str) -> List[str]:
    """The lines a terminal shows of `received`: a carriage return goes back to the line's
    start, erase-to-end (ESC [K) cuts the line there, text writes over what is there."""
    lines: List[str] = []
    line: List[str] = []
    column = 0
    for token in re.findall(r"\x1b\[K|\r|\n|[^\x1b\r\n]", received):
        if token == "\x1b[K":
            del line[column:]
        elif token == "\r":
            column = 0
        elif token == "\n":
            lines.append("".join(line))
            line, column = [], 0
        else:
            line[column : column + 1] = [token]
            column += 1
    return lines + ["".join(line)] if line else lines


def test_on_a_terminal_one_progress_line_is_redrawn_in_place_and_a_failure_prints_in_full(
    tmp_path: Path,
) -> None:
    app_dir = _install(tmp_path)
    code, received = _on_a_terminal(
        app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2,0.3,0.4", "fail_at=0.2", "hold=1.5", "+say=ok"
    )
    assert code == 1, received
    screen = _screen(received)
    shown = "\n".join(screen)

    # one line, drawn again and again in place: jobs ended (failed), running, pending, the
    # time elapsed and the time left
    drawn = re.findall(r"\r\x1b\[K(sweep: [^\r\n]*)\r", received)
    assert drawn[0] == "sweep: 0/4 ended, 0 running, 4 pending; 0:00 elapsed, ETA --", drawn
    assert all(
        re.fullmatch(
            r"sweep: [0-4]/4 ended( \(1 failed\))?, [01] running, [0-4] pending; \d+:\d\d elapsed, ETA \S+", d
        )
        for d in drawn
    ), drawn
    assert any(d.startswith("sweep: 1/4 ended, 1 running, 2 pending; ") for d in drawn), drawn
    assert any(
        re.match(r"sweep: 2/4 ended \(1 failed\), 1 running, 1 pending; \d+:\d\d elapsed, ETA \d+:\d\d", d)
        for d in drawn
    ), drawn
    assert drawn[-1].startswith("sweep: 4/4 ended (1 failed), 0 running, 0 pending; "), drawn
    assert len(set(drawn)) >= 8, drawn  # its elapsed time moves on while a job runs
    # none of it is left on the screen: every drawing was cleared or written over, also by
    # a rank's line shorter than it
    assert not any(re.search(r"\d/4 ended.*pending", line) for line in screen), shown
    assert not any("elapsed, ETA" in line for line in screen), shown
    assert screen.count("[default0]:ok") == 3 and screen.count("[default1]:ok") == 3, shown

    # it takes the place of a line per job started or completed; not of a failure's
    assert "Launching 4 jobs with torchrun into sweep" in shown, shown
    assert not re.search(r"\t#\d : lr=", shown) and "COMPLETED in" not in shown, shown
    failed = [i for i, line in enumerate(screen) if "job 2 of 4 ended: #1 : lr=0.2 fail_at=0.2" in line]
    assert len(failed) == 1, shown
    assert HYDRA_LINE.match(screen[failed[0]]) and re.search(
        r"\] job 2 of 4 ended: #1 : lr=0.2 fail_at=0.2 hold=1.5 \+say=ok : FAILED in [\d.]+s: "
        r"rank 1 \(local_rank 1, pid \d+\) exited with code 1: ValueError: lr=0.2 diverged$",
        screen[failed[0]],
    ), shown
    assert screen[failed[0] + 1].startswith("\tits output: sweep/1/torchrun_logs/"), shown
    # the rank's own traceback as it happened
    assert any(line.startswith("[default1]:ValueError: lr=0.2 diverged") for line in screen), shown
    # every line of the launcher's is whole: the progress line never ran into one
    assert all(HYDRA_LINE.match(line) for line in screen if "[HYDRA]" in line), shown

    # the table at the end, and Hydra's last word after it, on lines of their own
    tally = next(i for i, line in enumerate(screen) if "4 jobs: 3 completed, 1 failed" in line)
    assert HYDRA_LINE.match(screen[tally]), shown
    assert re.match(r"1\s+FAILED\s+[\d.]+s\s+lr=0.2\s+rank 1 exited with code 1", screen[tally + 3]), shown
    assert screen[tally + 6] == "overrides every job has: fail_at=0.2 hold=1.5 +say=ok", shown
    assert screen[tally + 7] == (
        "Error executing job with overrides: ['lr=0.2', 'fail_at=0.2', 'hold=1.5', '+say=ok']"
    ), shown
    jobs = _summary(app_dir / "sweep")
    assert [j["status"] for j in jobs] == ["COMPLETED", "FAILED", "COMPLETED", "COMPLETED"], jobs
