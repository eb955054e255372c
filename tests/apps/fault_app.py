"""A Hydra app whose ranks misbehave on demand (`mode=...`), for the launcher's fault tests.

Every rank first records its pid in `<job dir>/pids/rank<R>_attempt<N>.pid`, so a test can
wait for the ranks to be up and then prove they are gone. `recorder.Recorder` (a callback)
records each job's outcome in `<sweep dir>/jobs.jsonl`.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

ConfigStore.instance().store(
    name="config",
    node={
        # ok | allreduce | fail | sleep | hang | flaky | lock_return | scan | kill_next
        "mode": "ok",
        # fail: the rank that fails (or "all": every rank), and how: SIGKILL | SIGSEGV | SIGINT |
        # exit3 | exit0 (os._exit) | sys_exit | raise | interrupt (raises KeyboardInterrupt) |
        # drops (an exception whose pickling drops its attributes, as pydantic's) | unpicklable |
        # needs_args (its constructor takes other arguments) | by_rank (rank 0 raises a ValueError, rank 1 a
        # KeyError, ...) | bad_str (its __str__ raises) | huge (a 2 MB message) | app_error
        # (AppError, a class of this script) | none
        "bad_rank": 1,
        "how": "SIGKILL",
        # fail: what the other ranks do meanwhile: sleep | barrier | all_reduce
        "survivors": "sleep",
        # jobs whose number is listed here do mode=ok instead
        "good_jobs": [],
        # sleep, and fail's sleeping survivors: ranks ignore SIGTERM and SIGINT (only SIGKILL
        # stops them)
        "ignore_signals": False,
        # scan: a string to look for in files while the ranks run (not on the command
        # line, where the user's own process would show it)
        "marker": os.environ.get("FAULT_APP_MARKER", ""),
        "hydra": {"callbacks": {"recorder": {"_target_": "recorder.Recorder"}}},
    },
)


class AppError(ValueError):
    """An exception class of the script itself (`__main__` under `python fault_app.py`)."""


class AppErrorSeen(Callback):
    """A callback of the script itself (`+hydra.callbacks.seen._target_=__main__.AppErrorSeen`):
    in the job's process, whether a failed job's error is this script's AppError, in
    `<sweep dir>/app_error_seen`."""

    def on_job_end(self, config: Any, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.FAILED:
            seen = isinstance(job_return._return_value, AppError)
            (Path(str(config.hydra.sweep.dir)) / "app_error_seen").write_text(str(seen))


def _job_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def _record_pid(rank: int) -> None:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    pids = _job_dir() / "pids"
    pids.mkdir(exist_ok=True)
    tmp = pids / f".rank{rank}_attempt{attempt}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(pids / f"rank{rank}_attempt{attempt}.pid")  # appears complete or not at all


def _forever() -> None:
    while True:
        time.sleep(1)


def _deaf_to_stops(rank: int) -> None:
    """SIGTERM and SIGINT are noted in the job dir, and the rank carries on."""

    def note(signum, frame):
        with (_job_dir() / f"signals_rank{rank}").open("a") as f:
            f.write(signal.Signals(signum).name + "\n")

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    (_job_dir() / f"deaf_rank{rank}").touch()


def _raise(how: str, rank: int) -> None:
    import fault_errors

    if how == "raise":
        raise ValueError(f"boom from rank {rank}")
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "drops":
        raise fault_errors.DropsAttributes(f"1 validation error for DeepSpeedZeroConfig (rank {rank})")
    if how == "unpicklable":
        raise fault_errors.Unpicklable(f"rank {rank} holds a lock")
    if how == "needs_args":
        raise fault_errors.NeedsArguments("zero_stage", 9)
    if how == "bad_str":
        raise fault_errors.BadStr(f"rank {rank}")
    if how == "huge":  # 2 MB on one line
        raise ValueError("head " + "x" * 2_000_000 + " tail")
    if how == "app_error":
        raise AppError(f"rank {rank}'s own AppError")
    if how == "by_rank":
        kinds = [ValueError, KeyError, RuntimeError, TypeError]
        raise kinds[rank % len(kinds)](f"rank {rank}'s own error")


def _fail(cfg, rank: int) -> None:
    collective = cfg.survivors != "sleep"
    if collective:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
    failing = (cfg.bad_rank == "all" or rank == cfg.bad_rank) and cfg.how != "none"
    if cfg.ignore_signals and not failing:
        _deaf_to_stops(rank)
    elif cfg.ignore_signals:  # fails once the others are deaf to the stop that follows
        others = [r for r in range(int(os.environ["WORLD_SIZE"])) if r != rank]
        deadline = time.monotonic() + 120
        deaf = [_job_dir() / f"deaf_rank{r}" for r in others]
        while not all(p.exists() for p in deaf) and time.monotonic() < deadline:
            time.sleep(0.05)
    if failing:
        (_job_dir() / f"fail_time{'' if cfg.bad_rank != 'all' else rank}").write_text(repr(time.time()))
        print(f"rank {rank} fails now ({cfg.how})", file=sys.stderr, flush=True)
        if cfg.how == "exit3":
            os._exit(3)
        if cfg.how == "exit0":  # as scripts do to skip their teardown
            os._exit(0)
        if cfg.how == "sys_exit":  # a script's successful end
            sys.exit()
        if not cfg.how.startswith("SIG"):
            _raise(cfg.how, rank)
        os.kill(os.getpid(), getattr(signal, cfg.how))
        _forever()
    if cfg.survivors == "barrier":
        dist.barrier()  # never returns: the failed rank does not come
    elif cfg.survivors == "all_reduce":
        dist.all_reduce(torch.ones(1))
    if cfg.how != "none":
        _forever()


def _kill_next_job_process() -> int:
    """SIGKILL, as the OOM killer would, the process the launcher's warm server forked ahead
    for the next job (the server's child other than this job's own process); its pid."""
    import psutil

    # the rank, its forkserver and its job process are forks of the server: same command line
    ancestors = psutil.Process().parents()  # nearest first
    forks = [p for p in ancestors if "_server.server" in " ".join(p.cmdline())]
    job_process = forks[-2]  # the server's own child
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        others = [  # not the server's other child, multiprocessing's resource tracker
            p
            for p in forks[-1].children()
            if p.pid != job_process.pid and "_server.server" in " ".join(p.cmdline())
        ]
        if others:
            others[0].kill()
            return others[0].pid
        time.sleep(0.05)
    raise AssertionError("no process was forked ahead for the next job")


def _hang(rank: int) -> None:
    """Rank 0 sleeps in Python; every other rank waits for it in a gloo barrier (in C)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"rank {rank} is up", flush=True)
    print(f"rank {rank} waits", file=sys.stderr, flush=True)
    if rank == 0:
        _forever()
    dist.barrier()


def _scan(marker: str) -> str:
    """Files (job dir, temp dir) holding `marker`, with their and their dir's modes, and
    the processes (this rank, its parent) whose command line holds it: one per line."""
    import tempfile

    import psutil

    needle = marker.encode()
    found = []
    for root in (_job_dir(), Path(tempfile.gettempdir())):
        for path in root.rglob("*"):
            try:
                if path.is_file() and needle in path.read_bytes():
                    modes = f"{path.stat().st_mode & 0o777:o} {path.parent.stat().st_mode & 0o777:o}"
                    found.append(f"{path} {modes}")
            except OSError:
                pass
    me = psutil.Process()
    for proc in [me, me.parent()]:
        try:
            if marker in " ".join(proc.cmdline()):
                found.append(f"cmdline of pid {proc.pid}")
        except psutil.Error:
            pass
    return "\n".join(found)


@hydra.main(**VERSION_BASE, config_name="config")
def main(cfg):
    rank = int(os.environ["RANK"])
    _record_pid(rank)
    mode = "ok" if HydraConfig.get().job.num in cfg.good_jobs else cfg.mode

    if mode == "allreduce":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.ones(1)
        dist.all_reduce(total)
        assert int(total.item()) == dist.get_world_size()
        dist.destroy_process_group()
        mode = "ok"
    if mode == "fail":
        _fail(cfg, rank)
        mode = "ok"
    if mode == "kill_next":
        if rank == 0:
            (_job_dir() / "killed_next").write_text(str(_kill_next_job_process()))
        mode = "ok"
    if mode == "ok":
        (_job_dir() / f"done_rank{rank}").write_text(os.environ["MASTER_PORT"])
        return {"rank": rank, "job": HydraConfig.get().job.num}
    if mode == "sleep":
        if cfg.ignore_signals:  # and carry on: only SIGKILL ends this rank
            _deaf_to_stops(rank)
        _forever()
    if mode == "hang":
        _hang(rank)
    if mode == "flaky":
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print(f"rank {rank} attempt {attempt}", flush=True)
        if rank == cfg.bad_rank and attempt == 0:
            raise RuntimeError(f"rank {rank} fails on attempt {attempt}")
        return {"attempt": attempt, "max_restarts": int(os.environ["TORCHELASTIC_MAX_RESTARTS"])}
    if mode == "lock_return":
        return threading.Lock()
    if mode == "scan":
        (_job_dir() / f"scan_rank{rank}.txt").write_text(_scan(cfg.marker))
        return rank
    raise AssertionError(f"unknown mode {mode}")


if __name__ == "__main__":
    try:
        main()
    except AppError as e:  # with HYDRA_FULL_ERROR=1 Hydra raises the failed job's error here
        print(f"the launcher caught {type(e).__qualname__} of the script: {e}", file=sys.stderr, flush=True)
        raise
