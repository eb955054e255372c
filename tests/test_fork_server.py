"""The warm server is a fork of the launcher where that is safe, and a job cannot tell.

A fresh warm server imports the app's packages again after the launcher did. Where the
launcher may be forked (no Python thread but the main one, no native thread a fresh import
would not start, CUDA not initialised, every import already watched by a fresh server of
an earlier run), the server is a fork of it; otherwise a fresh interpreter, with one line
saying why. Either way a rank sees what torchrun's rank sees: none of the launcher's open
files, signal handlers or log handlers, and the app's own modules imported afresh.

Each test keeps its own cache of watched imports (XDG_CACHE_HOME in its tmp dir): its first
run starts the server fresh and watches, the next run may fork.
"""

import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.conftest import run_app

pytestmark = pytest.mark.timeout(600)

FRESH = "the warm server starts as a fresh interpreter: "

HELPER = """
import os

# what this module saw when it was imported, in the process that imported it
RANK_AT_IMPORT = os.environ.get("RANK")
"""

# the launcher's own state (under `__main__`), which no job may see; each rank records, at its
# script's first line, what it sees of it
APP = """
import json
import logging
import os
import signal
import sys
import threading
import time

# the rank's view before anything of this body runs (it runs in every rank as __mp_main__)
def _fds():
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return found


def _ancestors():
    found, pid = [], os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            found.append(f.read().replace(b"\\0", b" ").decode())
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return found


FIRST_LINE = {
    "fds": _fds(),
    "sigalrm_default": signal.getsignal(signal.SIGALRM) == signal.SIG_DFL,
    "handlers": [getattr(h, "baseFilename", type(h).__name__) for h in logging.getLogger().handlers],
    "app_logger_handlers": len(logging.getLogger("app").handlers),
    "main_already": sys.modules["__main__"].__dict__.get("LAUNCHER_ONLY"),
    "helper_loaded": "helper" in sys.modules,
    "ancestors": _ancestors(),
}

import helper  # noqa: E402
import hydra  # noqa: E402
import torch  # noqa: E402

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

MODE = os.environ.get("FORK_TEST_MODE", "")
if MODE == "thread":  # a poller the app starts at import, as some libraries do
    threading.Thread(target=time.sleep, args=(600,), name="poller", daemon=True).start()
elif MODE == "cuda":  # what torch.cuda.init() leaves behind (this is CPU-only torch)
    torch.cuda._initialized = True
elif MODE == "intra_op":  # torch's intra-op pool (OpenMP) started by work at import
    torch.set_num_threads(2)
    torch.ones(512, 512) @ torch.ones(512, 512)


@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    record = dict(FIRST_LINE, rank=os.environ["RANK"], helper_rank=helper.RANK_AT_IMPORT)
    with open(f"rank{os.environ['RANK']}.json", "w") as f:
        json.dump(record, f)
    return cfg.x


if __name__ == "__main__":
    LAUNCHER_ONLY = "the launcher's __main__"
    # the launcher's own state: an open file, a signal handler, a log file of its own
    kept_open = open("launcher_file.txt", "w")
    signal.signal(signal.SIGALRM, lambda *_: None)
    app_log = logging.FileHandler(os.path.abspath("launcher.log"))
    logging.getLogger("app").addHandler(app_log)
    logging.getLogger().addHandler(logging.FileHandler(os.path.abspath("launcher_root.log")))
    main()
"""


def _write_app(tmp_path: Path) -> Path:
    (tmp_path / "helper.py").write_text(HELPER)
    (tmp_path / "app.py").write_text(APP)
    return tmp_path / "app.py"


def _run(
    tmp_path: Path, sweep: str, mode: str, monkeypatch: pytest.MonkeyPatch, start_method: str = "forkserver"
) -> str:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("FORK_TEST_MODE", mode)
    result = run_app(
        tmp_path / "app.py",
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            f"hydra.launcher.start_method={start_method}",
            "hydra.job.chdir=true",
            f"hydra.sweep.dir={sweep}",
            "+x=0",
        ],
        cwd=tmp_path,
    )
    return result.stdout + result.stderr


def _records(tmp_path: Path, sweep: str) -> List[Dict[str, Any]]:
    return [json.loads((tmp_path / sweep / "0" / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _launcher_lines(output: str) -> List[str]:
    return [line for line in output.splitlines() if FRESH in line]


def _forked(record: Dict[str, Any]) -> bool:
    """Whether the rank's job came from a fork of the launcher: its server, job process and
    forkserver then run the app's command line, as the launcher does."""
    return sum("app.py" in cmdline for cmdline in record["ancestors"]) > 1


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_forked_server_hands_a_job_nothing_of_the_launchers_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_method: str
) -> None:
    """forkserver: a rank runs the script body unless its `__main__` is that script already;
    spawn: a spawned rank runs the main module its job process has. A forked server's job
    process has a fresh interpreter's `__main__`, not the launcher's app."""
    _write_app(tmp_path)
    first = _run(tmp_path, "first", "", monkeypatch, start_method)
    assert [line.split(FRESH)[1] for line in _launcher_lines(first)] == [
        "the imports of the app's packages have not been watched yet (this run does)"
    ], first
    assert not any(_forked(record) for record in _records(tmp_path, "first"))

    second = _run(tmp_path, "second", "", monkeypatch, start_method)
    assert _launcher_lines(second) == [], second
    for record in _records(tmp_path, "second"):
        assert _forked(record), record["ancestors"]
        rank = record["rank"]
        # the launcher's open file, its logs: not open in the rank
        opened = " ".join(record["fds"].values())
        for name in ("launcher_file.txt", "launcher.log", "launcher_root.log", ".lock"):
            assert name not in opened, (name, record["fds"])
        # its signal handler: the default, as in a fresh interpreter
        assert record["sigalrm_default"] is True, record
        # its log handlers: the rank's logging is the job's alone
        assert not any("launcher" in str(h) for h in record["handlers"]), record["handlers"]
        assert record["app_logger_handlers"] == 0, record
        # its __main__ and the app's own modules: run afresh in the rank, under torchrun's RANK
        assert record["main_already"] is None, record
        assert record["helper_loaded"] is False, record
        assert record["helper_rank"] == rank, record


@pytest.mark.parametrize(
    "mode, why",
    [
        ("thread", "a Python thread 'poller' is running in the launcher"),
        ("cuda", "CUDA is initialised in the launcher"),
        ("intra_op", "native threads run besides the launcher's main thread"),
    ],
)
def test_a_launcher_unsafe_to_fork_starts_a_fresh_server_with_one_line_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, why: str
) -> None:
    """CUDA cannot be initialised by a CPU-only torch: the app leaves torch.cuda in the state
    an initialisation leaves, which is what the launcher checks."""
    _write_app(tmp_path)
    _run(tmp_path, "watch", "", monkeypatch)  # the imports watched once: a fork is possible
    output = _run(tmp_path, "sweep", mode, monkeypatch)
    lines = _launcher_lines(output)
    assert len(lines) == 1 and why in lines[0], output
    for record in _records(tmp_path, "sweep"):
        assert not _forked(record), record["ancestors"]
        assert record["helper_rank"] == record["rank"]
    assert sys.modules.get("helper") is None
