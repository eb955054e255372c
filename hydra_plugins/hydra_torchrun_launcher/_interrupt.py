"""Stop a job's elastic agent from outside the thread it runs in.

The agent's run loop stops its ranks (graceful signal, wait `shutdown_timeout`, SIGKILL)
whenever an exception leaves it. Raising one in the agent's own thread is how a job
deadline, or a Ctrl-C that the main thread received while agents run in worker threads,
reaches it; the exception is delivered at the next bytecode the thread runs, which in the
agent's monitor loop is within `monitor_interval`.
"""

import ctypes
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Type


class JobDeadline(BaseException):
    """The job ran past `job_timeout`.

    BaseException, so no `except Exception` inside torch's agent takes it for a worker
    error; the agent's `finally` still stops the ranks.
    """


class JobInterrupted(BaseException):
    """The launcher was told to stop (Ctrl-C, SIGTERM) while this job ran in a worker thread."""


def raise_in_thread(thread_id: int, exc_type: Type[BaseException]) -> bool:
    """Schedule `exc_type` in the thread `thread_id`; False when that thread is gone."""
    hits = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type))
    if hits > 1:  # cannot happen for a valid id; undo rather than hit several threads
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
        raise SystemError(f"raising in thread {thread_id} reached {hits} threads")
    return hits == 1


# Frames in which torch holds ranks it has not handed to the agent yet, or is stopping
# them: an exception raised there would leave ranks nobody stops.
_UNSAFE_FRAMES = frozenset({"start_processes", "_start_workers", "_shutdown", "_close"})
RETRY_S = 0.05


def _in_unsafe_frame(thread_id: int) -> bool:
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name in _UNSAFE_FRAMES:
            return True
        frame = frame.f_back
    return False


def raise_when_safe(
    thread_id: int, exc_type: Type[BaseException], lock: threading.Lock, wanted: Callable[[], bool]
) -> None:
    """Raise `exc_type` in the thread once it is outside torch's start and stop of the ranks.

    `wanted()` is checked under `lock` right before raising (and the raise happens under
    it), so the owner of the lock can withdraw the request for good.
    """

    def attempt() -> None:
        with lock:
            if not wanted():
                return
            if not _in_unsafe_frame(thread_id):
                raise_in_thread(thread_id, exc_type)
                return
        retry = threading.Timer(RETRY_S, attempt)
        retry.daemon = True
        retry.start()

    attempt()


@contextmanager
def deadline(seconds: Optional[float]) -> Iterator[None]:
    """Raise `JobDeadline` in the calling thread after `seconds` (no limit when None)."""
    if seconds is None:
        yield
        return
    target = threading.get_ident()
    lock = threading.Lock()
    finished = False

    timer = threading.Timer(seconds, raise_when_safe, (target, JobDeadline, lock, lambda: not finished))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        # under the lock: once `finished` is set no late expiry can land outside this block
        with lock:
            finished = True
        timer.cancel()
