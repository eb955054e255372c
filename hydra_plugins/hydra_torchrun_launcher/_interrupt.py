"""Stop a job's elastic agent from outside the thread it runs in.

The agent's run loop stops its ranks (graceful signal, wait `shutdown_timeout`, SIGKILL)
whenever an exception leaves it. Raising one in the agent's own thread is how a job
deadline, or a Ctrl-C that the main thread received while agents run in worker threads,
reaches it; the exception is delivered at the next bytecode the thread runs, which in the
agent's monitor loop is within `monitor_interval`.
"""

import ctypes
import threading
from contextlib import contextmanager
from typing import Iterator, Optional, Type


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


@contextmanager
def deadline(seconds: Optional[float]) -> Iterator[None]:
    """Raise `JobDeadline` in the calling thread after `seconds` (no limit when None)."""
    if seconds is None:
        yield
        return
    target = threading.get_ident()
    lock = threading.Lock()
    finished = False

    def expire() -> None:
        with lock:
            if not finished:
                raise_in_thread(target, JobDeadline)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        # under the lock: once `finished` is set no late expiry can land outside this block
        with lock:
            finished = True
        timer.cancel()
