"""`hydra/launcher=torchrun_ssh` on real OpenSSH servers: hosts in network namespaces on this machine.

The sweep is started on the head (this machine's own namespace), as a user starts it on a
workstation: each host's sshd (Debian's `openssh-server`, `tests/ssh_hosts.py`) starts the
launcher's agent there, which runs the jobs' nodes. The ssh config, keys and known hosts are
the test's, passed as a user's own file (`ssh_options=[-F,<file>]`). The tests read what a
user reads: the console, the sweep's files, and what still runs on each host. They skip
where hosts cannot run (not root, no sshd) and fail there under REQUIRE_SLURM=1 (CI).
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import psutil
import pytest

import hydra_plugins.hydra_torchrun_launcher
from hydra_plugins.hydra_torchrun_launcher._ssh.hosts import Host, forwarded, parse_hostfile
from hydra_plugins.hydra_torchrun_launcher._ssh.wire import SILENCE_S
from tests.conftest import kill_tree
from tests.slurm_cluster import skip_or_fail
from tests.ssh_hosts import SshHosts, unavailable
from tests.test_slurm_submit import ranks_saw

APP_DIR = Path(__file__).parent / "submit_app"
SWEEP_TIMEOUT_S = 240
# the package's own directory: hidden on a host, the host lacks the package
PACKAGE_ROOT = Path(hydra_plugins.hydra_torchrun_launcher.__file__).parents[1]

pytestmark = pytest.mark.timeout(600)

# an app that says what its ranks see of the environment
ENV_APP = """
import os
import socket
import hydra
import torch.distributed as dist
from held_gather import all_gather_held

VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}


@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def main(cfg):
    dist.init_process_group("gloo")
    names = ("HTL_FORWARDED", "HTL_NOT_FORWARDED", "JOB_TAG", "CUDA_VISIBLE_DEVICES", "SSH_CONNECTION")
    seen = all_gather_held({"host": socket.gethostname(), **{name: os.environ.get(name) for name in names}})
    dist.destroy_process_group()
    return seen


if __name__ == "__main__":
    main()
"""


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    target = tmp_path / "app"
    shutil.copytree(APP_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(__file__).parent / "multinode_apps" / "held_gather.py", target)
    (target / "env_app.py").write_text(ENV_APP)
    return target


def _hosts(tmp_path: Path, hidden: "Dict[str, List[str]] | None" = None) -> SshHosts:
    skip_or_fail(unavailable())
    return SshHosts(tmp_path, ["host1", "host2"], hidden)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[SshHosts]:
    with _hosts(tmp_path) as running:
        yield running


def _command(hosts: SshHosts, *overrides: str, app: str = "app.py") -> List[str]:
    return [
        sys.executable,
        app,
        "--multirun",
        "hydra/launcher=torchrun_ssh",
        "hydra.sweep.dir=sweep",
        f"hydra.launcher.ssh_options={hosts.ssh_options()}",
        *overrides,
    ]


def _sweep(hosts: SshHosts, app_dir: Path, *overrides: str, app: str = "app.py", env=None):  # type: ignore[no-untyped-def]
    return subprocess.run(
        _command(hosts, *overrides, app=app),
        cwd=app_dir,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
        env=env,
    )


def _summary(app_dir: Path) -> dict:
    return {
        job["num"]: job for job in json.loads((app_dir / "sweep" / "sweep_summary.json").read_text())["jobs"]
    }


def _nothing_left(hosts: SshHosts) -> None:
    left = hosts.wait_no_processes()
    assert not left, f"processes left on the hosts: {left}"


def test_two_host_jobs_run_their_ranks_on_both_hosts_with_values_in_order(
    hosts: SshHosts, app_dir: Path
) -> None:
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=2",
        "x=1,2",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    jobs = _summary(app_dir)
    for n in range(2):
        value = jobs[n]["return_value"]
        assert jobs[n]["status"] == "COMPLETED", output
        assert value["x"] == n + 1 and value["world"] == 4 and value["hosts"] == ["host1", "host2"], value
        assert value["ranks_saw"] == ranks_saw(n, world=4), value
        # Hydra's bookkeeping once per job, on its first host
        assert (app_dir / "sweep" / str(n) / "job_starts.log").read_text().split() == ["host1"]
        assert (app_dir / "sweep" / str(n) / ".hydra" / "config.yaml").exists()
    assert "#0 : x=1 on host1, host2" in output, output
    # the ranks' own lines reach the head's console
    assert "rank 3/4 on host2 x=2" in output, output
    _nothing_left(hosts)


def test_one_host_jobs_are_packed_on_both_hosts_at_once(hosts: SshHosts, app_dir: Path) -> None:
    result = _sweep(
        hosts, app_dir, "hydra.launcher.hosts=[host1,host2]", "steps=5", "step_s=0.2", "x=1,2,3,4"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    jobs = _summary(app_dir)
    assert [jobs[n]["return_value"]["x"] for n in range(4)] == [1, 2, 3, 4], output
    assert {tuple(jobs[n]["return_value"]["hosts"]) for n in range(4)} == {("host1",), ("host2",)}, output
    # the first two started together, one on each host, before either ended
    lines = output.splitlines()
    first_end = next(i for i, line in enumerate(lines) if "job 1 of 4 ended" in line)
    started = [line for line in lines[:first_end] if " x=1 on " in line or " x=2 on " in line]
    assert len(started) == 2 and {line.split(" on ")[-1] for line in started} == {"host1", "host2"}, output
    _nothing_left(hosts)


def test_a_rank_failing_on_the_second_host_fails_its_job_with_its_own_error(
    hosts: SshHosts, app_dir: Path
) -> None:
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "fail_rank=1",
        "fail_x=2",
        "x=1,2,3",
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(3)] == ["COMPLETED", "FAILED", "COMPLETED"], output
    assert "rank 1 failed on purpose (x=2)" in jobs[1]["error"], jobs[1]
    assert "ValueError: rank 1 failed on purpose (x=2)" in output, output
    _nothing_left(hosts)


def test_an_unreachable_host_is_named_with_ssh_s_reason_before_any_rank_starts(
    hosts: SshHosts, app_dir: Path
) -> None:
    result = _sweep(hosts, app_dir, "hydra.launcher.hosts=[host1,unreachable]", "x=1,2")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    lines = [line for line in output.splitlines() if "unreachable" in line]
    assert len(lines) == 1, output
    assert "cannot run on 1 of the 2 host(s): unreachable: ssh: connect to host" in lines[0], output
    assert "Connection refused (exit status 255)" in lines[0], output
    assert "rank 0" not in output and "Traceback" not in output, output
    assert not (app_dir / "sweep" / "0" / ".hydra").exists()
    _nothing_left(hosts)


def test_a_host_without_the_package_is_named_before_any_rank_starts(tmp_path: Path, app_dir: Path) -> None:
    with _hosts(tmp_path, hidden={"host2": [str(PACKAGE_ROOT)]}) as hosts:
        result = _sweep(hosts, app_dir, "hydra.launcher.hosts=[host1,host2]", "x=1")
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert "cannot run on 1 of the 2 host(s): host2: " in output, output
        assert "No module named" in output and "(exit status 1)" in output, output
        assert "rank 0" not in output, output
        _nothing_left(hosts)


def test_a_sweep_dir_the_hosts_cannot_see_gets_their_files_back(tmp_path: Path, app_dir: Path) -> None:
    sweep = app_dir / "sweep"
    sweep.mkdir()
    # each host sees an empty directory of its own there (a tmpfs in its mount namespace)
    with _hosts(tmp_path, hidden={"host1": [str(sweep)], "host2": [str(sweep)]}) as hosts:
        result = _sweep(hosts, app_dir, "hydra.launcher.hosts=[host1,host2]", "hydra.launcher.nodes=2", "x=1")
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        job = sweep / "0"
        assert _summary(app_dir)[0]["return_value"]["world"] == 2
        assert (job / ".hydra" / "config.yaml").exists() and (job / ".hydra" / "ranks_started").exists()
        # each host's rank logs
        logs = sorted(str(p.relative_to(job)) for p in job.rglob("stdout.log"))
        assert [log.split("/")[1] for log in logs] == ["node0", "node1"], logs
        assert (job / "job_starts.log").read_text().split() == ["host1"]
        _nothing_left(hosts)


def _start(hosts: SshHosts, app_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        _command(hosts, *overrides),
        cwd=app_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _end(head: subprocess.Popen) -> None:
    kill_tree(head)
    if head.stdout is not None:
        head.stdout.close()


def _read_until(process: subprocess.Popen, needles: List[str]) -> str:
    """The head's output until every needle has shown (or the head ended)."""
    seen = ""
    deadline = time.monotonic() + SWEEP_TIMEOUT_S
    assert process.stdout is not None
    while not all(needle in seen for needle in needles):
        line = process.stdout.readline()
        assert line and time.monotonic() < deadline, f"the head ended or hung before {needles}: {seen}"
        seen += line
    return seen


def test_ctrl_c_stops_every_rank_on_every_host_and_ends_in_one_line(hosts: SshHosts, app_dir: Path) -> None:
    head = _start(hosts, app_dir, "hydra.launcher.hosts=[host1,host2]", "steps=1000", "step_s=0.1", "x=1,2")
    try:
        seen = _read_until(head, ["rank 0 running x=1", "rank 0 running x=2"])
        os.killpg(head.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        rest, _ = head.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        _end(head)
    output = seen + rest
    assert head.returncode == 130, output
    stop_lines = [line for line in output.splitlines() if line.startswith("[torchrun launcher] SIGINT")]
    assert len(stop_lines) == 1 and "every host (host1, host2)" in stop_lines[0], output
    assert "Traceback" not in output, output
    _nothing_left(hosts)


def test_a_host_lost_mid_sweep_fails_its_job_naming_it_and_the_sweep_goes_on_on_the_other(
    hosts: SshHosts, app_dir: Path
) -> None:
    # each job runs x steps: the second (on host2) runs until its host is lost
    head = _start(
        hosts, app_dir, "hydra.launcher.hosts=[host1,host2]", "step_s=0.1", "steps=${x}", "x=3,100000,4,5"
    )
    try:
        seen = _read_until(head, ["x=100000 on host2", "rank 0 running x=100000"])
        assert hosts.crash("host2")
        rest, _ = head.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        _end(head)
    output = seen + rest
    assert head.returncode == 1, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(4)] == ["COMPLETED", "FAILED", "COMPLETED", "COMPLETED"], output
    assert jobs[1]["error"].startswith("host host2 was lost: "), jobs[1]
    assert [jobs[n]["return_value"]["hosts"] for n in (2, 3)] == [["host1"], ["host1"]], output
    lost = [line for line in output.splitlines() if "host2 was lost" in line]
    assert "the sweep goes on on the other hosts" in lost[0], output
    assert "Traceback" not in output, output
    _nothing_left(hosts)


def test_a_host_cut_off_mid_sweep_fails_its_job_and_its_agent_ends_the_ranks_there(
    hosts: SshHosts, app_dir: Path
) -> None:
    """No connection closes (the host, or the network to it, is down): each side takes the
    other's silence as its end."""
    head = _start(
        hosts, app_dir, "hydra.launcher.hosts=[host1,host2]", "step_s=0.1", "steps=${x}", "x=3,100000,4,5"
    )
    try:
        seen = _read_until(head, ["x=100000 on host2", "rank 0 running x=100000"])
        hosts.cut("host2")
        rest, _ = head.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        _end(head)
    output = seen + rest
    assert head.returncode == 1, output
    jobs = _summary(app_dir)
    assert [jobs[n]["status"] for n in range(4)] == ["COMPLETED", "FAILED", "COMPLETED", "COMPLETED"], output
    assert jobs[1]["error"].startswith(f"host host2 was lost: no word from its agent for {SILENCE_S:g} s"), (
        jobs[1]
    )
    assert [jobs[n]["return_value"]["hosts"] for n in (2, 3)] == [["host1"], ["host1"]], output
    # on host2, cut off still, its agent ended the job's ranks and itself
    deadline = time.monotonic() + SILENCE_S + 60
    while any("python" in line for line in hosts.command_lines("host2")):
        assert time.monotonic() < deadline, hosts.command_lines("host2")
        time.sleep(0.2)
    hosts.cut("host2", up=True)  # its sshd's session learns that the head's connection is gone
    _nothing_left(hosts)


def test_the_head_killed_with_sigkill_leaves_no_process_on_any_host(hosts: SshHosts, app_dir: Path) -> None:
    head = _start(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=2",
        "steps=1000",
        "step_s=0.1",
        "x=1",
    )
    try:
        _read_until(head, ["rank 0 running x=1"])
        ssh_clients = psutil.Process(head.pid).children()
        assert ssh_clients, "the head runs its ssh sessions"
        os.kill(head.pid, signal.SIGKILL)
        head.wait()
        _, alive = psutil.wait_procs(ssh_clients, timeout=30)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    finally:
        _end(head)
    _nothing_left(hosts)


def test_the_stop_signal_reaches_every_rank_on_every_host_and_they_stop_at_one_step(
    hosts: SshHosts, app_dir: Path
) -> None:
    head = _start(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=2",
        "steps=1000",
        "step_s=0.1",
        "x=1",
    )
    try:
        seen = _read_until(head, ["rank 0 running x=1"])
        os.kill(head.pid, signal.SIGUSR2)  # the head's notice, as a scheduler or a user sends it
        rest, _ = head.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        _end(head)
    output = seen + rest
    stopped = {}
    for line in output.splitlines():
        if ": stopping after step " in line:
            rank, step = line.split("rank ", 1)[1].split(": stopping after step ")
            stopped[int(rank)] = int(step)
    # every rank of the job, on both hosts, stopped at the same step (should_stop agreed)
    assert sorted(stopped) == [0, 1, 2, 3] and len(set(stopped.values())) == 1, output
    assert _summary(app_dir)[0]["status"] == "PREEMPTED", output
    preempted = [line for line in output.splitlines() if line.startswith("[torchrun launcher] SIGUSR2")]
    assert len(preempted) == 1 and "the sweep was preempted: preempted #0" in preempted[0], output
    assert head.returncode != 0 and "Traceback" not in output, output
    _nothing_left(hosts)


def test_env_forward_passes_the_named_variables_and_no_other(hosts: SshHosts, app_dir: Path) -> None:
    env = dict(os.environ, HTL_FORWARDED="from the head", HTL_NOT_FORWARDED="kept on the head")
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "hydra.launcher.env_forward=[HTL_FORW*]",
        app="env_app.py",
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    seen = _summary(app_dir)[0]["return_value"]
    assert len(seen) == 2, seen
    for rank in seen:
        assert rank["HTL_FORWARDED"] == "from the head" and rank["HTL_NOT_FORWARDED"] is None, seen
        assert rank["JOB_TAG"] == "job_0", seen  # env_set, as Hydra sets it
        assert rank["SSH_CONNECTION"], seen  # the host's own environment, as its sshd gives it
    _nothing_left(hosts)


def test_a_hostfile_with_slots_and_comments_shares_out_each_host_s_devices(
    hosts: SshHosts, app_dir: Path
) -> None:
    (app_dir / "hostfile").write_text("# the lab's machines\nhost1 slots=2\n\nhost2 slots=2  # the new one\n")
    result = _sweep(hosts, app_dir, "hydra.launcher.hostfile=hostfile", "x=1,2,3,4", app="env_app.py")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    jobs = _summary(app_dir)
    placed = sorted(
        (line.split(" on ")[-1]) for line in output.splitlines() if " : x=" in line and " on host" in line
    )
    assert placed == ["host1 (devices 0)", "host1 (devices 1)", "host2 (devices 0)", "host2 (devices 1)"], (
        output
    )
    assert sorted(jobs[n]["return_value"][0]["CUDA_VISIBLE_DEVICES"] for n in range(4)) == [
        "0",
        "0",
        "1",
        "1",
    ]
    _nothing_left(hosts)


def test_rerun_sh_of_a_job_reruns_it_on_the_host_and_devices_it_had(
    hosts: SshHosts, app_dir: Path, tmp_path: Path
) -> None:
    (app_dir / "hostfile").write_text("host1 slots=2\nhost2 slots=2\n")
    result = _sweep(hosts, app_dir, "hydra.launcher.hostfile=hostfile", "x=1,2,3,4", app="env_app.py")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    jobs = _summary(app_dir)
    (num,) = [
        n
        for n in range(4)
        if jobs[n]["return_value"][0]["host"] == "host2"
        and jobs[n]["return_value"][0]["CUDA_VISIBLE_DEVICES"] == "1"
    ]
    job_dir = app_dir / "sweep" / str(num)
    # run by hand from elsewhere, as a user reruns one job of a sweep
    rerun = subprocess.run(
        ["bash", str(job_dir / "rerun.sh")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
    )
    said = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, said
    assert f"#0 : x={num + 1} on host2\n" in said and "host1" not in said, said
    (rerun_dir,) = job_dir.glob("rerun_*")
    (again,) = json.loads((rerun_dir / "sweep_summary.json").read_text())["jobs"]
    assert again["status"] == "COMPLETED", said
    assert again["return_value"][0]["host"] == "host2", again
    assert again["return_value"][0]["CUDA_VISIBLE_DEVICES"] == "1", again
    assert again["return_value"][0]["JOB_TAG"] == "job_0", again  # a sweep of its own
    _nothing_left(hosts)


def test_the_readme_s_console_is_what_a_run_on_two_hosts_prints(tmp_path: Path) -> None:
    """README.md's "Without a scheduler" console, run as shown (its hosts `gpu1`, `gpu2`; the
    user's ssh config is this test's file) and compared as tests/test_readme.py compares."""
    from tests.test_readme import PROJECTS, check_excerpt

    (block,) = [
        b
        for p in PROJECTS
        for b in p.blocks
        if p.page == "README.md"
        and b.body.startswith("$ python my_app.py --multirun hydra/launcher=torchrun_ssh")
    ]
    command, *excerpt = block.body.splitlines()
    project = tmp_path / "project"
    shutil.copytree(Path(__file__).parents[1] / "example", project)
    (project / "hosts").write_text("gpu1\ngpu2\n")
    skip_or_fail(unavailable())
    with SshHosts(tmp_path, ["gpu1", "gpu2"]) as hosts:
        run = subprocess.run(
            [sys.executable, *command.split()[2:], f"hydra.launcher.ssh_options={hosts.ssh_options()}"],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=SWEEP_TIMEOUT_S,
        )
        output = run.stdout + run.stderr
        assert run.returncode == 0, output
        assert not check_excerpt(excerpt, output, project), output
        _nothing_left(hosts)


def test_a_two_host_job_past_job_timeout_names_the_ranks_still_running_on_both_hosts(
    hosts: SshHosts, app_dir: Path
) -> None:
    """docs/failures.md: past `job_timeout` "the ranks still running are named with where each
    one was". Every rank of this 2-host job loops until stopped; the job's error named the
    ranks of one host only (2 and 3 in one run, 0 and 1 in the next), the other host's
    stacks showed on the console only. The local launcher names every rank of its node: the
    job's nodes share one deadline, and its error names every node's ranks, each with its host."""
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=2",
        "hydra.launcher.job_timeout=5",
        "steps=100000",
        "step_s=0.1",
        "x=1",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    error = _summary(app_dir)[0]["error"]
    assert error.startswith("the job ran past hydra.launcher.job_timeout=5s"), error
    named = sorted(
        int(line.split("still running: rank ")[1].split()[0])
        for line in error.splitlines()
        if "still running: rank " in line
    )
    assert named == [0, 1, 2, 3], error
    running = [line for line in error.splitlines() if "still running: rank " in line]
    assert sorted(line.split(" on ")[1].split(")")[0] for line in running) == ["host1"] * 2 + ["host2"] * 2, (
        error
    )
    # each in the app's loop: in main, or in what main called at that moment (`should_stop()`'s
    # collective), the app's own frame named, never the launcher's
    assert all(" in main (app.py:" in line or ", called from main (app.py:" in line for line in running), (
        error
    )
    # Hydra's last word: every rank's stack, whichever host it ran on
    for rank in range(4):
        assert f"rank {rank}'s stack when it was stopped:" in output, output
    _nothing_left(hosts)


# a callback whose on_job_end (in the job's process, after its ranks) never returns for x=1
HANG_AT_JOB_END = """
import time
from hydra.experimental.callback import Callback


class HangAtJobEnd(Callback):
    def on_job_end(self, config, job_return, **kwargs):
        if config.x == 1:
            time.sleep(300)
"""


def test_a_job_process_killed_past_its_job_timeout_leaves_its_host_s_warm_server_to_the_next_job(
    hosts: SshHosts, app_dir: Path
) -> None:
    """The agent's backstop kills a job process that outlives its job_timeout and its ranks'
    shutdown: it killed the process group of every process of the job, the warm server's
    (which forks them all) with it, so the host was lost and the next job had none."""
    (app_dir / "hang_at_job_end.py").write_text(HANG_AT_JOB_END)
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1]",
        "hydra.launcher.job_timeout=1",
        "hydra.launcher.shutdown_timeout=1",
        "+hydra.callbacks.hang._target_=hang_at_job_end.HangAtJobEnd",
        "x=1,2",
    )
    output = result.stdout + result.stderr
    jobs = _summary(app_dir)
    assert jobs[0]["status"] == "FAILED", output
    assert "was killed by signal SIGKILL" in jobs[0]["error"], jobs[0]
    assert "its process did not end after its job_timeout; killing it" in output, output
    assert jobs[1]["status"] == "COMPLETED", output
    assert jobs[1]["return_value"]["hosts"] == ["host1"], jobs[1]
    assert "was lost" not in output and "Traceback" not in output, output
    _nothing_left(hosts)


def test_a_sigterm_after_the_last_job_ended_leaves_a_sweep_whose_jobs_all_completed_ended(
    hosts: SshHosts, app_dir: Path
) -> None:
    """A SIGTERM (a scheduler's, a `kill`) after the last job ended, while the head closes its
    agents: the head said "the sweep was stopped while no job of it was running", printed no
    table, and recorded the sweep as interrupted, so `torchrun-sweep status` called a sweep
    whose every job completed "unfinished" (a user's break-it pass: 3 runs in 4). The sweep
    ended: its table, its record ended, and the status of a process a SIGTERM ended (143), as
    the local launcher's when the signal comes as it ends. The signal comes at that moment
    every time: the hosts' interpreter is a wrapper whose agent, once the head has closed its
    session, sends it before the session ends (the head waits for that end)."""
    wrapper = app_dir / "python_then_sigterm"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'{shlex.quote(sys.executable)} "$@"\n'
        "status=$?\n"
        # the first agent to end only: a second SIGTERM would be the user's insisting one
        'if mkdir sigterm_sent 2>/dev/null; then kill -TERM "$(cat head.pid)"; fi\n'
        'exit "$status"\n'
    )
    wrapper.chmod(0o755)
    head = _start(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        f"hydra.launcher.python={wrapper}",
        "x=1,2",
    )
    (app_dir / "head.pid").write_text(str(head.pid))
    try:
        output, _ = head.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        _end(head)
    assert (app_dir / "sigterm_sent").is_dir(), output
    assert [job["status"] for job in _summary(app_dir).values()] == ["COMPLETED", "COMPLETED"], output
    assert "while no job of it was running" not in output, output
    assert "SIGTERM: every job of the sweep had ended; the launcher ends after its table" in output, output
    assert "2 jobs: 2 completed (summary: sweep/sweep_summary.json)" in output, output
    assert head.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output, output
    tool = Path(sys.executable).parent / "torchrun-sweep"
    shown = subprocess.run(
        [str(tool), "status", "sweep"], cwd=app_dir, capture_output=True, text=True, timeout=60
    )
    assert shown.stdout.splitlines()[0].endswith(", ended"), shown.stdout
    _nothing_left(hosts)


def test_the_ranks_of_a_two_host_job_are_told_apart_on_the_console_by_their_host(
    hosts: SshHosts, app_dir: Path
) -> None:
    """Plain torchrun prefixes each rank's line with its role and local rank (`[default0]:`,
    its log_line_prefix_template default), the same on every node: each node's torchrun
    prints on a terminal of its own. On the head's one console, rank 0 on host1 and rank 2 on
    host2 both said `[#0 default0]:`; each line now says its host before torchrun's prefix."""
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=2",
        "x=1",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    said = [line for line in output.splitlines() if "/4 on host" in line and line.endswith(" x=1")]
    assert len(said) == 4, output
    prefixes = {}
    for line in said:
        prefix, text = line.split("]:", 1)
        rank, host = text.split()[1].split("/")[0], text.split()[3]
        prefixes[int(rank)] = prefix + "]:"
        assert prefix.startswith(f"[#0 {host} default"), output
    assert len(set(prefixes.values())) == 4, prefixes
    # torchrun's own words after the host: its role and the rank's local rank, 0 and 1 on each host
    assert sorted(p.split()[-1] for p in prefixes.values()) == [
        "default0]:",
        "default0]:",
        "default1]:",
        "default1]:",
    ]
    _nothing_left(hosts)


def ssh_dry_run(app_dir: Path, *overrides: str) -> str:
    """`app.py`'s dry run under torchrun_ssh on host1 and host2 (no host is asked), with
    `overrides`; its console, once it ended with status 0."""
    result = subprocess.run(
        [
            sys.executable,
            "app.py",
            "--multirun",
            "hydra/launcher=torchrun_ssh",
            "hydra.sweep.dir=sweep",
            "hydra.launcher.hosts=[host1,host2]",
            "hydra.launcher.dry_run=true",
            *overrides,
        ],
        cwd=app_dir,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_the_dry_run_shows_each_job_s_hosts_rendezvous_and_torchrun_line(app_dir: Path) -> None:
    """The local launcher's dry run shows each job's rendezvous and its torchrun line; under
    torchrun_ssh it showed only the job's ranks. Each job now says on which hosts it runs, its
    rendezvous (c10d on the first host of a multi-host job) and the line plain torchrun would
    run on each host, which the installed torchrun takes: a line per host, each naming its
    node's own log dir (every host's named node 0's). Nothing starts: no host is asked."""
    output = ssh_dry_run(app_dir, "hydra.launcher.nodes=${x}", "hydra.launcher.nproc_per_node=2", "x=2,1")
    assert not (app_dir / "sweep" / "0").exists(), output
    hosts = [line.strip() for line in output.splitlines() if line.strip().startswith("hosts:")]
    assert hosts == [
        "hosts:      host1, host2",
        "hosts:      1 of host1, host2: the first free when the job starts",
    ]
    rendezvous = [line.strip() for line in output.splitlines() if line.strip().startswith("rendezvous:")]
    assert rendezvous[0].startswith("rendezvous: c10d on the job's first host (FIRST_HOST)"), output
    assert rendezvous[1].startswith("rendezvous: c10d at localhost:0 on its host"), output
    # a line per host of the job, each with its own node's log dir
    shown = [line.strip() for line in output.splitlines()]
    at = [n for n, line in enumerate(shown) if line.startswith("torchrun:")]
    lines = [shown[at[0]], shown[at[0] + 1], shown[at[1]]]
    assert lines[0].startswith("torchrun:   on host1: cd "), output
    assert lines[1].startswith("on host2: cd "), output
    assert lines[2].startswith("torchrun:   on its host: cd "), output
    from torch.distributed.run import parse_args

    for line, nnodes, endpoint, logs in zip(
        lines,
        ("2", "2", "1"),
        ("FIRST_HOST:PORT", "FIRST_HOST:PORT", "localhost:0"),
        ("0/torchrun_logs/node0", "0/torchrun_logs/node1", "1/torchrun_logs"),
    ):
        words = shlex.split(line.split(": cd ", 1)[1].split(" && ", 1)[1])
        args = parse_args(words[words.index("torchrun") + 1 :])
        assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == (nnodes, "2", "c10d"), line
        assert args.rdzv_endpoint == endpoint and args.training_script == "app.py", line
        assert args.log_dir == str(app_dir / "sweep" / logs), line


def test_hostfile_lines_parse_as_deepspeed_writes_them() -> None:
    text = "# comment\nworker-1 slots=4\nworker-2\n  worker-3 slots=8 # trailing\n"
    assert parse_hostfile(text, "hostfile") == [Host("worker-1", 4), Host("worker-2"), Host("worker-3", 8)]


def test_env_forward_takes_names_patterns_and_env_set() -> None:
    environ = {"NCCL_DEBUG": "INFO", "HOME": "/h", "SECRET": "s", "MINE": "1"}
    assert forwarded(["NCCL_*"], {"MINE": "2"}, environ) == {"NCCL_DEBUG": "INFO", "MINE": "1"}


def test_job_dirs_that_the_hosts_write_follow_the_head_s_umask_002(hosts: SshHosts, app_dir: Path) -> None:
    """Under `umask 002` (a group's shared project dir) the local launcher's job dirs are
    group-writable (tests/test_record.py relies on it for a teammate's resume), as SLURM jobs
    get the submitting shell's umask. The hosts' files (`.hydra/`, logs, the job dir's
    contents) come with the hosts' sshd umask (022), so the group cannot write them; under
    `umask 077` they are readable by every user (config.yaml, rank logs)."""
    result = subprocess.run(
        _command(hosts, "hydra.launcher.hosts=[host1,host2]", "hydra.launcher.nodes=2", "x=1"),
        cwd=app_dir,
        capture_output=True,
        text=True,
        timeout=SWEEP_TIMEOUT_S,
        preexec_fn=lambda: os.umask(0o002),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    job = app_dir / "sweep" / "0"
    not_group_writable = sorted(
        str(path.relative_to(job))
        for path in [job, *job.rglob("*")]
        if not path.stat().st_mode & 0o020
        and path.name not in ("job_return.pkl", "ranks_started")
        and not path.name.startswith("ssh-")  # torch's own mkdtemp dirs are 0700 locally too
    )
    assert not not_group_writable, not_group_writable
    _nothing_left(hosts)


class _ChattyHosts(SshHosts):
    """Hosts whose every ssh session prints a line on stdout before running the command, as a
    `~/.bashrc` that echoes, a conda or `module` banner or a site's ForceCommand wrapper does."""

    def _start_sshd(self, name: str) -> None:
        config = self.root / f"sshd_config.{name}"
        wrapper = 'ForceCommand echo "Welcome to the lab cluster"; eval "$SSH_ORIGINAL_COMMAND"\n'
        config.write_text(config.read_text() + wrapper)
        super()._start_sshd(name)


def test_hosts_whose_login_prints_a_line_on_stdout_still_run_the_sweep(tmp_path: Path, app_dir: Path) -> None:
    """`ssh host torchrun ...` (and pdsh, DeepSpeed's multi-node runner) works on such a host:
    the line is only shown. The launcher refuses every such host before any job starts: "its
    agent broke the protocol: the stream carries something else: 'Welcome to the lab
    cluster'", with no hint that the host's shell start-up is what printed it."""
    skip_or_fail(unavailable())
    with _ChattyHosts(tmp_path, ["host1", "host2"]) as hosts:
        result = _sweep(hosts, app_dir, "hydra.launcher.hosts=[host1,host2]", "hydra.launcher.nodes=2", "x=1")
        output = result.stdout + result.stderr
        assert "broke the protocol" not in output, output
        assert result.returncode == 0, output
        assert _summary(app_dir)[0]["return_value"]["hosts"] == ["host1", "host2"], output
        _nothing_left(hosts)


def test_a_host_without_the_app_s_files_fails_its_job_saying_what_is_missing(
    tmp_path: Path, app_dir: Path
) -> None:
    """The head's working dir is empty on host2 (the project not synced there): the job there
    fails with a launcher-internal traceback (cloudpickle's decode_request: No module named
    'callbacks', unprefixed on the console) and the job's error says only that "the job's
    process (pid N on host2) exited with code 1 before reporting a result". On a job's second
    node the same host says `FileNotFoundError: ... app.py`, which is what the user needs."""
    with _hosts(tmp_path, hidden={"host2": [str(app_dir)]}) as hosts:
        result = _sweep(hosts, app_dir, "hydra.launcher.hosts=[host2]", "x=1")
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        (job,) = _summary(app_dir).values()
        assert job["status"] == "FAILED", output
        assert "host2" in job["error"] and "No module named 'callbacks'" in job["error"], job["error"]
        assert "decode_request" not in output, output
        _nothing_left(hosts)


def test_a_launch_prefix_program_on_the_hosts_path_only_is_not_refused_by_the_head(
    hosts: SshHosts, app_dir: Path
) -> None:
    """The ranks run on the hosts, with the host's own PATH (README: "The ranks get the host's
    own environment"); a `launch_prefix` program that is on the hosts' PATH (here /usr/sbin's
    chroot, in sshd's PATH) but not on the head's is refused by the head before any host is
    asked: `chroot is not a program found on PATH`. Plain torchrun on the hosts finds it. The
    same goes for nproc_per_node=gpu, judged by the head's CUDA (a head without a GPU, the
    hosts with GPUs, refused: `Cuda is not available`)."""
    assert Path("/usr/sbin/chroot").exists()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1]",
        "hydra.launcher.launch_prefix=[chroot,--skip-chdir,/]",
        "x=1",
        env=env,
    )
    output = result.stdout + result.stderr
    assert "is not a program found on PATH" not in output, output
    assert result.returncode == 0, output
    assert _summary(app_dir)[0]["return_value"]["hosts"] == ["host1"], output
    _nothing_left(hosts)


def test_the_readme_s_preload_workaround_is_taken_by_torchrun_ssh(hosts: SshHosts, app_dir: Path) -> None:
    """README, Troubleshooting: ranks that hang in their first multi-threaded torch op (an
    installed package of the app ran a matmul at import, and the warm process imported it)
    are fixed with `hydra.launcher.preload=[...]` without it, or `[]`. Each host's agent
    "imports torch and the app's packages once" and its ranks hang the same way (seen with a
    site-packages module doing a 1500x1500 matmul at import: stuck at the task's matmul
    until job_timeout), but torchrun_ssh has no `preload` key: `Key 'preload' is not in
    struct`. (start_method=spawn avoids it, undocumented.)"""
    result = _sweep(hosts, app_dir, "hydra.launcher.hosts=[host1]", "hydra.launcher.preload=[]", "x=1")
    output = result.stdout + result.stderr
    assert "not in struct" not in output, output
    assert result.returncode == 0, output
    _nothing_left(hosts)


def test_torchrun_sweep_status_of_a_running_ssh_sweep_names_each_running_job_s_host(
    hosts: SshHosts, app_dir: Path
) -> None:
    """DESIGN: `torchrun-sweep status` speaks of "a local, SLURM or ssh sweep", a line per job
    with its "SLURM id or host"; for a SLURM sweep a running job says `on node1` (and `nodes`
    in --json). An ssh sweep is called "a local sweep" and its running jobs name no host."""
    head = _start(hosts, app_dir, "hydra.launcher.hosts=[host1,host2]", "steps=1000", "step_s=0.1", "x=1,2")
    try:
        _read_until(head, ["rank 0 running x=1", "rank 0 running x=2"])
        tool = Path(sys.executable).parent / "torchrun-sweep"
        shown = subprocess.run(
            [str(tool), "status", "sweep"], cwd=app_dir, capture_output=True, text=True, timeout=60
        )
        as_json = subprocess.run(
            [str(tool), "status", "sweep", "--json"], cwd=app_dir, capture_output=True, text=True, timeout=60
        )
        os.killpg(head.pid, signal.SIGINT)
        head.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        _end(head)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    header, *_ = shown.stdout.splitlines()
    assert "a local sweep" not in header and ": an ssh sweep, running" in header, shown.stdout
    assert json.loads(as_json.stdout)["runner"] == "ssh", as_json.stdout
    running = [line for line in shown.stdout.splitlines() if "RUNNING" in line]
    assert len(running) == 2, shown.stdout
    assert {line.split()[-1] for line in running} == {"host1", "host2"}, shown.stdout
    jobs = json.loads(as_json.stdout)["jobs"]
    assert sorted(str(job["nodes"]) for job in jobs) in (["host1", "host2"], ["['host1']", "['host2']"]), jobs
    # ended (stopped): still an ssh sweep, each job with the host it ran on
    after = subprocess.run(
        [str(tool), "status", "sweep", "--json"], cwd=app_dir, capture_output=True, text=True, timeout=60
    )
    ended = json.loads(after.stdout)
    assert ended["runner"] == "ssh" and sorted(job["nodes"] for job in ended["jobs"]) == ["host1", "host2"], (
        ended
    )
    _nothing_left(hosts)


def test_what_only_a_host_can_tell_is_refused_by_its_job_naming_the_host_and_the_key(
    hosts: SshHosts, app_dir: Path
) -> None:
    """A `launch_prefix` program missing on the host, `nproc_per_node=gpu` on a host without
    CUDA: the head starts the job (it cannot tell), the host refuses it in one line naming
    the key and the host, as the head refuses what it can tell, and the sweep goes on."""
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1]",
        "hydra.launcher.launch_prefix=[no-such-program-here]",
        "x=1",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    (job,) = _summary(app_dir).values()
    assert job["status"] == "FAILED", output
    assert job["error"].splitlines()[0] == (
        "hydra.launcher.launch_prefix=['no-such-program-here'] is invalid on host host1: "
        "no-such-program-here is not a program found on its PATH"
    ), job["error"]
    _nothing_left(hosts)

    import torch

    if torch.cuda.is_available():
        return  # this machine's hosts have CUDA: gpu counts their devices
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=gpu",
        "x=1",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    (job,) = _summary(app_dir).values()
    assert job["status"] == "FAILED", output
    first = job["error"].splitlines()[0]
    assert first.startswith("hydra.launcher.nproc_per_node='gpu' is invalid on host host"), job["error"]
    assert "Cuda is not available" in first, job["error"]
    _nothing_left(hosts)


def test_numa_binding_is_decided_on_each_host_naming_the_host(hosts: SshHosts, app_dir: Path) -> None:
    """`numa_binding` binds each rank to its GPU's NUMA node: the GPUs and numactl it needs
    are the host's, as launch_prefix's program is. The head refused it by its own torch and
    PATH before asking any host (`is invalid here: ... not built with CUDA`); the host now
    decides, and refuses its job in one line naming the key and the host, before any rank."""
    import torch

    if torch.backends.cuda.is_built() and torch.cuda.device_count() and shutil.which("numactl"):
        pytest.skip("these hosts can bind ranks to NUMA nodes: nothing to refuse")
    result = _sweep(hosts, app_dir, "hydra.launcher.hosts=[host1]", "hydra.launcher.numa_binding=node", "x=1")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "is invalid here" not in output, output
    (job,) = _summary(app_dir).values()
    assert job["status"] == "FAILED", output
    first = job["error"].splitlines()[0]
    key = "hydra.launcher.numa_binding='node'"
    assert first.startswith(f"{key} is invalid on host host1: it binds each rank to its GPU's NUMA node"), (
        first
    )
    assert "rank 0" not in output, output
    _nothing_left(hosts)
