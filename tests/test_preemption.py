"""Preemption and resume on one machine, as a user meets them.

The app (`tests/preempt_app/`) trains in steps, asks `preemption.should_stop()` after each,
checkpoints on rank 0 when told to stop and continues from its checkpoint when
`preemption.resumed()`. The tests send the launcher its stop signal (`kill -USR2`, as
SLURM's `--signal=USR2@T` would) at a chosen step, read the console and the sweep dir, and
run the same command again.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import psutil
import pytest

from tests.conftest import assert_gone, wait_for
from tests.test_multinode import Cluster, Node, base_env, free_port

APP_DIR = Path(__file__).parent / "preempt_app"
LIGHTNING_APP = Path(__file__).parent / "integration_apps" / "lightning_preempt_app.py"
SWEEP = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2,0.3"]

pytestmark = pytest.mark.timeout(300)


class Sweep:
    """`python app.py ARGS` run from the app's dir, its console kept in a file."""

    def __init__(self, app_dir: Path, *args: str, tmpdir: Optional[Path] = None) -> None:
        self.out = app_dir / f"console_{len(list(app_dir.glob('console_*')))}.txt"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if tmpdir is not None:  # where the jobs' private dirs go (their stop files)
            tmpdir.mkdir(exist_ok=True)
            env["TMPDIR"] = str(tmpdir)
        env.pop("HYDRA_FULL_ERROR", None)
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "app.py", *args], cwd=app_dir, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def text(self) -> str:
        return self.out.read_text()

    def lines_after(self, marker: str) -> List[str]:
        text = self.text()
        return text[text.index(marker) :].splitlines() if marker in text else []

    def wait_for_line(self, line: str, after: str = "", timeout: float = 120) -> None:
        """Until the console shows `line`, after the text `after`."""
        wait_for(lambda: line in self.lines_after(after) or self.proc.poll() is not None, timeout, line)
        assert line in self.lines_after(after), self.text()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def end(self, timeout: float = 120) -> "tuple[int, str]":
        children = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        code = self.proc.wait(timeout=timeout)
        assert_gone(children)
        return code, self.text()


def _install(tmp_path: Path) -> Path:
    app_dir = tmp_path / "app"
    shutil.copytree(APP_DIR, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    return app_dir


def _summary(app_dir: Path) -> List[dict]:
    return json.loads((app_dir / "sweep" / "sweep_summary.json").read_text())["jobs"]


def _preempt_job_1_at_step(app_dir: Path, step: int, *extra: str) -> "tuple[int, str]":
    sweep = Sweep(app_dir, *SWEEP, *extra)
    sweep.wait_for_line(f"[default0]:rank 0: step {step}", after="\t#1 : lr=0.2")
    sweep.signal(signal.SIGUSR2)
    return sweep.end()


def test_a_stop_signal_stops_every_rank_at_one_step_and_the_same_command_resumes(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    code, out = _preempt_job_1_at_step(app_dir, 2)

    # both ranks stopped after the same step; job 0 completed before; job 2 never started
    assert code == 128 + signal.SIGUSR2, out
    stops = re.findall(r"^\[default(\d)\]:rank \d: stopping after step (\d+)$", out, re.M)
    assert len(stops) == 2 and len({step for _, step in stops}) == 1, out
    stopped_at = int(stops[0][1])
    assert json.loads((app_dir / "sweep" / "1" / "checkpoint.json").read_text()) == {"step": stopped_at}
    assert "#2 : lr=0.3" not in out, out
    jobs = _summary(app_dir)
    assert [job["status"] for job in jobs] == ["COMPLETED", "PREEMPTED", "NOT_STARTED"], jobs
    # one line on how the sweep resumes
    last = out.strip().splitlines()[-1]
    assert last.startswith(
        "[torchrun launcher] SIGUSR2: the sweep was preempted: completed #0; preempted #1"
    ), out
    assert last.endswith(
        "To resume it, run the same command with hydra.sweep.dir=sweep: completed jobs are not run again, "
        "preempted ones continue in their job dir"
    ), out

    # the same command again: job 0 from the record, job 1 from its checkpoint, job 2 runs
    again = Sweep(app_dir, *SWEEP)
    code, out = again.end()
    assert code == 0, out
    assert re.search(r"#0 : lr=0.1 : COMPLETED in an earlier run, returned \{", out), out
    assert "[default0]:rank 0: step 1" in out  # job 2 from step 1
    assert f"[default0]:rank 0: resumed at step {stopped_at}" in out, out
    assert f"[default1]:rank 1: resumed at step {stopped_at}" in out, out
    assert f"[default0]:rank 0: done, 6 steps from {stopped_at}" in out, out
    jobs = _summary(app_dir)
    assert [job["status"] for job in jobs] == ["COMPLETED"] * 3, jobs
    assert [job["return_value"]["from"] for job in jobs] == [0, stopped_at, 0], jobs
    # job 0 did not run again
    assert out.count("#0 : lr=0.1") == 1, out
    assert "after the sweep: SIGUSR2 -> <Handlers.SIG_DFL: 0>" in out, out


def test_a_stop_between_jobs_starts_no_further_job(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    # job 0's on_job_end holds the sweep at the boundary until the stop signal reached it
    hold = ["+hydra.callbacks.hold._target_=hold.HoldAfterJob", "+hydra.callbacks.hold.job=0"]
    sweep = Sweep(app_dir, *SWEEP, *hold)
    wait_for(
        lambda: (app_dir / "sweep" / "held_after_0").exists() or sweep.proc.poll() is not None,
        120,
        "job 0 to end",
    )
    sweep.signal(signal.SIGUSR2)
    code, out = sweep.end()
    assert code == 128 + signal.SIGUSR2, out
    statuses = [job["status"] for job in _summary(app_dir)]
    assert statuses == ["COMPLETED", "NOT_STARTED", "NOT_STARTED"], out
    # job 1 (the next one) never started: none of its ranks ran, it has no job dir
    assert "#1 : lr=0.2" not in out.split("3 jobs:")[0], out
    assert out.count("[default0]:rank 0: done, 6 steps from 0") == 1, out
    assert not (app_dir / "sweep" / "1").exists(), sorted(p.name for p in (app_dir / "sweep").iterdir())
    # the way on: job 0 from the record, jobs 1 and 2 run
    assert "not started #1, #2" in out.strip().splitlines()[-1], out


def test_a_second_stop_signal_changes_nothing(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    # long steps: from the stop file's appearance the ranks take one to two steps to stop
    tmpdir = tmp_path / "tmp"
    sweep = Sweep(app_dir, *SWEEP, "step_s=1", tmpdir=tmpdir)
    sweep.wait_for_line("[default0]:rank 0: step 1")
    sweep.signal(signal.SIGUSR2)
    # two signals sent back to back may reach the launcher as one: the second goes once the
    # first has been handled (the job's process made its stop file) and the job still runs
    wait_for(lambda: list(tmpdir.glob("hydra_torchrun_*/stop")), 60, "the first SIGUSR2 to reach the job")
    assert "stopping after step" not in sweep.text(), sweep.text()
    sweep.signal(signal.SIGUSR2)
    code, out = sweep.end()
    assert code == 128 + signal.SIGUSR2, out
    assert [job["status"] for job in _summary(app_dir)] == ["PREEMPTED", "NOT_STARTED", "NOT_STARTED"], out
    assert out.count("the sweep was preempted") == 1, out


def test_ranks_that_do_not_stop_are_stopped_after_stop_timeout(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    # never asks: ignore_stop makes the loop skip should_stop()
    sweep = Sweep(app_dir, *SWEEP, "steps=1000", "+ignore_stop=true", "hydra.launcher.stop_timeout=2")
    sweep.wait_for_line("[default0]:rank 0: step 2")
    sweep.signal(signal.SIGUSR2)
    code, out = sweep.end()
    assert code == 128 + signal.SIGUSR2, out
    job = _summary(app_dir)[0]
    assert job["status"] == "PREEMPTED", job
    assert "did not return within hydra.launcher.stop_timeout=2s" in job["error"], job


def test_stop_keys_are_checked_before_any_rank_starts(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    cases = {
        "hydra.launcher.stop_signal=SIGTERM": "hydra.launcher.stop_signal='SIGTERM' is invalid",
        "hydra.launcher.stop_signal=SIGNOPE": "hydra.launcher.stop_signal='SIGNOPE' is invalid",
        "hydra.launcher.stop_timeout=0": "hydra.launcher.stop_timeout=0.0 is invalid",
        "hydra.launcher.requeue=yes": "hydra.launcher.requeue='yes' is invalid",
        "hydra.launcher.resume=true": "hydra.launcher.resume=true: sweep holds no record of this sweep",
        "hydra.launcher.signals_to_handle='SIGTERM,SIGUSR2'": "also in hydra.launcher.signals_to_handle",
    }
    for override, message in cases.items():
        result = Sweep(app_dir, *SWEEP, override)
        code, out = result.end()
        assert code == 1 and message in out, out
        assert "[default0]" not in out, out


# --- a stop while a multi-node launcher waits for the other node ---


@pytest.fixture
def one_of_two_nodes(tmp_path: Path) -> Iterator[Cluster]:
    """A launcher of a two-node sweep whose other node never comes."""
    nodes = Cluster(tmp_path)
    try:
        yield nodes
    finally:
        nodes.close()


def _start_first_node(nodes: Cluster, *extra: str, port: int = 0) -> "tuple[Node, int]":
    port = port or free_port()
    args = [
        "hydra.launcher.nnodes=2",
        "hydra.launcher.rdzv_backend=c10d",
        f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}",
        "+x=0,1",
        *extra,
    ]
    nodes.start([args], [base_env()])
    return nodes.nodes[0], port


def _listening(pid: int, port: int) -> bool:
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):  # a child that ended as it was listed
            continue
        if any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == port for conn in connections):
            return True
    return False


def test_a_stop_during_a_jobs_rendezvous_ends_it_without_waiting_for_stop_timeout(
    one_of_two_nodes: Cluster,
) -> None:
    node, port = _start_first_node(one_of_two_nodes, "hydra.launcher.resume=false")
    # job 0's agent hosts its rendezvous and waits for node 1
    wait_for(lambda: _listening(node.proc.pid, port), 120, "job 0's rendezvous")
    node.proc.send_signal(signal.SIGUSR2)
    (node,) = one_of_two_nodes.wait(timeout=60)
    out = node.output()
    assert node.proc.returncode == 128 + signal.SIGUSR2, out
    jobs = json.loads((node.sweep_dir / "sweep_summary.json").read_text())["jobs"]
    assert [job["status"] for job in jobs] == ["PREEMPTED", "NOT_STARTED"], jobs
    assert jobs[0]["error"] == "the job was preempted before its ranks started", jobs
    assert "hydra.launcher.resume=false: running the same command again runs every job again" in out, out
    assert node.elapsed_s is not None and node.elapsed_s < 60, out


# --- the Lightning recipe of docs/preemption.md ---


def test_the_lightning_recipe_stops_with_a_checkpoint_and_resumes_from_it(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    shutil.copy(LIGHTNING_APP, app_dir / "app.py")
    args = ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "hydra.sweep.dir=sweep"]
    sweep = Sweep(app_dir, *args, "lr=0.1,0.2")
    sweep.wait_for_line("[default0]:rank 0: step 3", after="\t#0 : lr=0.1")
    sweep.signal(signal.SIGUSR2)
    code, out = sweep.end()
    assert code == 128 + signal.SIGUSR2, out
    job_dir = app_dir / "sweep" / "0"
    stopped = [json.loads((job_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert stopped[0]["final_step"] == stopped[1]["final_step"] < 12, stopped  # 3 epochs x 4 steps
    assert (job_dir / "preempted.ckpt").is_file()
    assert [job["status"] for job in _summary(app_dir)] == ["PREEMPTED", "NOT_STARTED"], out

    again = Sweep(app_dir, *args, "lr=0.1,0.2")
    code, out = again.end()
    assert code == 0, out
    resumed = [json.loads((job_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert resumed == [{"start_step": stopped[0]["final_step"], "final_step": 12}] * 2, out
    second = [json.loads((app_dir / "sweep" / "1" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert second == [{"start_step": 0, "final_step": 12}] * 2, out
    assert [job["return_value"] for job in _summary(app_dir)] == [12, 12], out
    # the docs show this callback as it is here
    recipe = (Path(__file__).parent.parent / "docs" / "preemption.md").read_text()
    source = LIGHTNING_APP.read_text()
    callback = source[source.index("class StopOnPreemption") : source.index("class Regression")].strip()
    assert callback in recipe, "docs/preemption.md's Lightning recipe differs from the tested callback"


def test_a_changed_app_or_config_in_the_same_sweep_dir_runs_again(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    args = ["-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2"]
    code, out = Sweep(app_dir, *args).end()
    assert code == 0, out
    # the same command on a finished sweep: a new run, every job runs again
    code, out = Sweep(app_dir, *args).end()
    assert code == 0 and "sweep/sweep_summary.json records a finished sweep" in out, out
    assert out.count("[default0]:rank 0: done, 6 steps from 0") == 2, out
    # resume=true: the same sweep comes from its record
    code, out = Sweep(app_dir, *args, "hydra.launcher.resume=true").end()
    assert code == 0 and "2 completed job(s) come from its record (#0, #1)" in out, out
    assert "[default0]" not in out, out
    # the config changed (not an override): another sweep, every job runs
    config = app_dir / "config.yaml"
    config.write_text(config.read_text().replace("steps: 6", "steps: 4"))
    code, out = Sweep(app_dir, *args).end()
    assert code == 0, out
    assert "sweep/sweep_summary.json records another sweep" in out, out
    assert out.count("[default0]:rank 0: done, 4 steps from 0") == 2, out
    # the code changed: not the same sweep, which resume=true refuses in one line
    source = app_dir / "app.py"
    source.write_text(source.read_text().replace("done,", "finished,"))
    code, out = Sweep(app_dir, *args, "hydra.launcher.resume=true").end()
    assert code == 1, out
    assert "records another sweep (job #0's task code changed)" in out, out
    assert "[default0]" not in out, out


def test_edited_code_under_the_default_resume_starts_the_sweep_afresh(tmp_path: Path) -> None:
    """README: a job is the same only with the same task source; a record of another (here:
    edited) app starts afresh with one line, so the preempted job does not continue from its
    checkpoint and the completed one runs again (`resume: auto`, the default)."""
    app_dir = _install(tmp_path)
    code, out = _preempt_job_1_at_step(app_dir, 2)
    assert code == 128 + signal.SIGUSR2, out
    assert [job["status"] for job in _summary(app_dir)] == ["COMPLETED", "PREEMPTED", "NOT_STARTED"], out
    source = app_dir / "app.py"
    source.write_text(source.read_text().replace("done,", "finished,"))
    code, out = Sweep(app_dir, *SWEEP).end()
    assert code == 0, out
    assert (
        "sweep/sweep_summary.json records another sweep (job #0's task code changed): every job runs, "
        "the record starts afresh" in out
    ), out
    assert "Resuming the sweep" not in out and "resumed at step" not in out, out
    assert out.count("[default0]:rank 0: finished, 6 steps from 0") == 3, out
    jobs = _summary(app_dir)
    assert [job["status"] for job in jobs] == ["COMPLETED"] * 3, jobs
    assert [job["return_value"]["from"] for job in jobs] == [0, 0, 0], jobs


def test_changed_overrides_under_resume_true_are_refused_in_one_line(tmp_path: Path) -> None:
    """README: `resume=true` resumes the record of the same sweep (the same jobs with the same
    overrides), finished or not; a sweep whose jobs' overrides changed is another sweep, and
    resuming it is refused in one line, naming the job, before any rank runs."""
    app_dir = _install(tmp_path)
    code, out = Sweep(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2").end()
    assert code == 0, out
    resume = "hydra.launcher.resume=true"
    # the same sweep, finished: its completed jobs come from the record
    code, out = Sweep(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2", resume).end()
    assert code == 0, out
    assert "[default0]" not in out, out
    # job 1's override changed: another sweep
    code, out = Sweep(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.3", resume).end()
    assert code == 1, out
    assert (
        "hydra.launcher.resume=true: sweep/sweep_summary.json records another sweep (its job #1 had other "
        "overrides (lr=0.2)); set hydra.launcher.resume=auto to run every job afresh, or use another "
        "hydra.sweep.dir" in out
    ), out
    assert "[default0]" not in out, out
    jobs = _summary(app_dir)
    assert [(job["status"], job["return_value"]["lr"]) for job in jobs] == [
        ("COMPLETED", 0.1),
        ("COMPLETED", 0.2),
    ], jobs


def test_a_training_script_asks_the_same_way(tmp_path: Path) -> None:
    app_dir = _install(tmp_path)
    script = "hydra.launcher.training_script=script.py"
    sweep = Sweep(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1", script)
    sweep.wait_for_line("[default0]:rank 0: step 2")
    sweep.signal(signal.SIGUSR2)
    code, out = sweep.end()
    assert code == 128 + signal.SIGUSR2, out
    stops = re.findall(r"^\[default(\d)\]:rank \d: stopping after step (\d+)$", out, re.M)
    assert len(stops) == 2 and len({step for _, step in stops}) == 1, out
    assert [job["status"] for job in _summary(app_dir)] == ["PREEMPTED"], out


def test_ranks_out_of_phase_stop_at_the_same_call_one_call_after_the_first_saw_the_stop(
    tmp_path: Path,
) -> None:
    """should_stop() itself makes the ranks agree: these ranks share no collective of their own
    and run at different speeds, so a rank that read the stop file alone would stop at a
    call of its own. The README documents one call of lag: the answer turns True at the call
    after the first at which a rank saw the stop file."""
    app_dir = _install(tmp_path)
    script = "hydra.launcher.training_script=out_of_phase.py"
    sweep = Sweep(app_dir, "-m", "hydra.sweep.dir=sweep", "lr=0.1", script)
    sweep.wait_for_line("[default1]:rank 1: call 3")
    sweep.signal(signal.SIGUSR2)
    code, out = sweep.end()
    assert code == 128 + signal.SIGUSR2, out
    stops = re.findall(
        r"^\[default(\d)\]:rank \d: stopped at call (\d+), "
        r"file seen before call (\d+|None), after call (\d+)$",
        out,
        re.M,
    )
    assert sorted(rank for rank, *_ in stops) == ["0", "1"], out
    calls = {int(call) for _, call, _, _ in stops}
    assert len(calls) == 1, f"the ranks stopped at different calls: {stops}\n{out}"
    (call,) = calls
    # each rank's own read of the file lies between its two checks around the call; the
    # agreed answer comes one call after the earliest rank's read
    first_after = min(int(after) for *_, after in stops)
    first_before = min(int(before) for _, _, before, _ in stops if before != "None")  # None: never
    assert first_after + 1 <= call <= first_before + 1, stops
    assert [job["status"] for job in _summary(app_dir)] == ["PREEMPTED"], out


@pytest.mark.parametrize("sig, how", [(signal.SIGUSR2, "preempted"), (signal.SIGTERM, "stopped")])
def test_a_stop_while_the_nodes_agree_on_what_to_resume_ends_the_launcher_on_one_line(
    one_of_two_nodes: Cluster, tmp_path: Path, sig: int, how: str
) -> None:
    # a first run stopped in job 0's rendezvous leaves an unfinished record: something to resume
    first, port = _start_first_node(one_of_two_nodes)
    wait_for(lambda: _listening(first.proc.pid, port), 120, "job 0's rendezvous")
    first.proc.send_signal(signal.SIGUSR2)
    one_of_two_nodes.wait(timeout=60)
    (tmp_path / "again").mkdir()
    again = Cluster(tmp_path / "again")
    try:
        node, _ = _start_first_node(again, f"hydra.sweep.dir={first.sweep_dir}", port=port)
        # before any job, the launcher waits in the rendezvous where the nodes agree
        wait_for(lambda: _listening(node.proc.pid, port), 120, "the nodes' agreement")
        node.proc.send_signal(sig)
        (node,) = again.wait(timeout=60)
    finally:
        again.close()
    out = node.output()
    assert node.proc.returncode == 128 + sig, out
    assert (
        out.rstrip()
        .splitlines()[-1]
        .startswith(
            f"[torchrun launcher] {signal.Signals(sig).name}: the sweep was {how}: "
            "no job had started (the nodes were agreeing on what to resume)"
        )
    ), out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
