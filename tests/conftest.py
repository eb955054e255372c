"""Shared test helpers: running apps as a user would, and proving no process is left behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, List, Sequence

import psutil
import pytest

from tests import slurm_cluster

# the launcher's warm server and multiprocessing's helpers live as long as the process
# that started them (here: pytest)
_LONG_LIVED_HELPERS = (
    "multiprocessing.forkserver",
    "multiprocessing.resource_tracker",
    "hydra_torchrun_launcher._server.server",
)
EXIT_WAIT_S = 15.0


def _start_apps_as_from_a_terminal() -> None:
    """Every app the suite starts gets a terminal's signal dispositions, however the suite runs.

    A suite run as a shell's background job or under nohup has SIGINT/SIGQUIT (or SIGHUP)
    ignored, and a child inherits an ignored signal: the launcher rightly keeps it ignored and
    says so in a warning, which is not what a user typing the command sees. A handler that
    does nothing keeps this process as deaf as it was started, and is reset to the default in
    every program it starts. Tests of the ignored case set it themselves.
    """
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, _deaf)


def _deaf(signum: int, frame: Any) -> None:
    """Ignore the signal here, unlike SIG_IGN not in the programs this process starts."""


_start_apps_as_from_a_terminal()


def _is_long_lived_helper(proc: psutil.Process) -> bool:
    if proc.pid in slurm_cluster.RUNNING_DAEMONS:
        return True  # a SLURM test cluster's daemon; its jobs' processes are checked
    try:
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False
    return any(name in cmdline for name in _LONG_LIVED_HELPERS) or cmdline.startswith(
        slurm_cluster.DAEMON_HELPERS
    )


def _rank_descendants() -> List[psutil.Process]:
    """This process's descendants other than multiprocessing's forkserver and tracker."""
    return [p for p in psutil.Process().children(recursive=True) if not _is_long_lived_helper(p)]


def kill_tree(proc: subprocess.Popen) -> None:
    """A process this test started (in a group of its own) and all its descendants, killed."""
    if proc.poll() is not None:
        return
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def assert_gone(pids: Iterable[int]) -> None:
    """Every pid has exited (and been reaped) within EXIT_WAIT_S."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=EXIT_WAIT_S)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.fixture(autouse=True)
def no_leftover_ranks():
    """Every test ends with no rank of ours alive: workers, agents, scripts, wrappers."""
    yield
    leftovers = _rank_descendants()
    if leftovers:
        _, alive = psutil.wait_procs(leftovers, timeout=EXIT_WAIT_S)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for proc in alive:
            proc.kill()
        assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def run_app(
    app: Path,
    args: Sequence[str],
    cwd: Path,
    timeout: float = 240,
    check: bool = True,
    full_error: bool = True,
) -> subprocess.CompletedProcess:
    """Run `python app.py ARGS` as a user would; its output is returned as text.

    full_error=False shows errors as users see them by default (Hydra's short form).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("HYDRA_FULL_ERROR", None)
    if full_error:
        env["HYDRA_FULL_ERROR"] = "1"
    result = subprocess.run(
        [sys.executable, str(app), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{app.name} {' '.join(args)} exited {result.returncode}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
    return result


def as_from_a_terminal() -> None:
    """Signal dispositions of a command typed in a terminal, whatever this test runs under.

    A background job of a non-interactive shell (as CI may run the tests) ignores SIGINT,
    and the launcher, rightly, keeps ignoring what it was started ignoring.
    """
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """The first truthy value of `condition()`, polled; fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


# the files whose tests start real daemons (SLURM, sshd) or network namespaces: root and minutes
# each; `python -m pytest -m "not cluster"` is the contributors' fast tier (docs/contributing.md)
_CLUSTER_FILES = frozenset(
    {"test_slurm.py", "test_slurm_submit.py", "test_slurm_detach.py", "test_ssh.py", "test_pods.py"}
)


# the files that take longest (minutes each, in this order), run first: the suite runs on
# several workers a file each (pytest.ini: xdist's loadfile), and a long file that starts
# last keeps one worker busy after the others are done. The other files keep their order.
_LONGEST_FIRST = (
    "test_slurm_detach.py",
    "test_record.py",
    "test_slurm_submit.py",
    "test_ssh.py",
    "test_preemption.py",
    "test_parity.py",
    "test_readme.py",
    "test_faults.py",
    "test_failure_reports.py",
)


def _file_rank(item: pytest.Item) -> int:
    name = item.path.name
    return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    items.sort(key=_file_rank)  # stable: a file's tests, and the other files, keep their order
    for item in items:
        uses_a_cluster = "cluster" in getattr(item, "fixturenames", ())
        if item.path.name in _CLUSTER_FILES or uses_a_cluster:
            item.add_marker(pytest.mark.cluster)
