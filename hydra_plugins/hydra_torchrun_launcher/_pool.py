"""Several sweep jobs at once on one node (`parallel_jobs` > 1), each on devices of its own.

Each running job's elastic agent runs in a thread of its own; the main thread keeps doing
Hydra's per-job bookkeeping in job order and collects results in job order. A job takes
`nproc_per_node` devices from the pool before its ranks start and gives them back when it
ends, failed or not, so concurrent jobs never share a device. A stop (Ctrl-C, SIGTERM) in
the main thread reaches every running agent, which stops its ranks.
"""

import functools
import logging
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import FrameType, TracebackType
from typing import Any, Callable, Dict, List, Optional, Type

from . import _signals
from ._interrupt import JobInterrupted, raise_when_safe

log = logging.getLogger(__name__)


class DevicePool:
    """Device ids shared out to running jobs, each id to one job at a time."""

    def __init__(self, devices: List[str]) -> None:
        self._free = list(devices)
        self._changed = threading.Condition()

    def take(self, count: int) -> List[str]:
        """Block until `count` devices are free; the lowest free ids, in order."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._free) >= count)
            taken, self._free = self._free[:count], self._free[count:]
            return taken

    def give_back(self, devices: List[str]) -> None:
        with self._changed:
            self._free = sorted(self._free + devices, key=_device_order)
            self._changed.notify_all()


def _device_order(device: str) -> Any:
    return (0, int(device)) if device.isdigit() else (1, device)


class LauncherStopped(BaseException):
    """A signal told the launcher to stop while jobs ran in worker threads."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class ConcurrentJobs:
    """Run up to `parallel_jobs` jobs at a time; `submit` returns a Future of the job's value.

    `run(devices)` is called in a worker thread with the devices taken for the job (None
    when jobs do not share devices out).
    """

    def __init__(self, parallel_jobs: int, devices: Optional[List[str]], signal_names: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=parallel_jobs, thread_name_prefix="torchrun-job")
        self._devices = DevicePool(devices) if devices is not None else None
        self._running: Dict[int, int] = {}  # job idx -> thread ident
        self._lock = threading.Lock()
        self._stopping = False
        self._signal_names = signal_names
        self._handlers = _signals.preserved_handlers(signal_names)

    def __enter__(self) -> "ConcurrentJobs":
        self._handlers.__enter__()
        for sig in _signals.signals_named(self._signal_names):
            signal.signal(sig, _raise_stopped)
        return self

    def submit(self, idx: int, nproc: int, run: Callable[[Optional[List[str]]], Any]) -> "Future[Any]":
        return self._executor.submit(self._run, idx, nproc, run)

    def _run(self, idx: int, nproc: int, run: Callable[[Optional[List[str]]], Any]) -> Any:
        devices = self._devices.take(nproc) if self._devices is not None else None
        try:
            with self._lock:
                if self._stopping:
                    raise JobInterrupted()
                self._running[idx] = threading.get_ident()
            try:
                if devices is not None:
                    log.info(f"job #{idx} runs on devices {','.join(devices)}")
                return run(devices)
            finally:
                with self._lock:
                    del self._running[idx]
        finally:
            if devices is not None:
                self._devices.give_back(devices)  # type: ignore[union-attr]

    def stop(self) -> None:
        """Stop every running job's ranks and start no new job."""
        with self._lock:
            self._stopping = True
            running = dict(self._running)
        for idx, ident in running.items():
            raise_when_safe(ident, JobInterrupted, self._lock, functools.partial(self._runs, idx, ident))

    def _runs(self, idx: int, ident: int) -> bool:
        return self._running.get(idx) == ident

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if exc is not None:
            self.stop()
        self._executor.shutdown(wait=True, cancel_futures=exc is not None)
        self._handlers.__exit__(None, None, None)
        if isinstance(exc, LauncherStopped):
            # every rank is stopped: the launcher's own handlers decide what the signal does
            _signals.redeliver(exc.signum)


def _raise_stopped(signum: int, frame: Optional[FrameType]) -> None:
    raise LauncherStopped(signum)
