"""The only places where a job's process changes what torch does, each guarded and measured.

They apply in the job's own process (`_job.process`), which runs one job's elastic agent
and nothing else, so they never touch the launcher or another job. Each checks that the
torch it finds has the shape it was written against (checked on torch 2.6 to 2.15) and
otherwise leaves torch alone, with one warning where a documented promise then does not hold.

- `PContext.close` (torch.distributed.elastic.multiprocessing.api, public): the agent stops
  its ranks through it. Before it does, the ranks already ended with a failure (the
  `returncode` of a `SubprocessContext`'s public `subprocess_handlers`) are told to
  `_job.preempt` as the job's first cause, which a stop signal coming during the shutdown
  then does not override. And only where `LaunchConfig` has no `shutdown_timeout` field
  (torch before 2.12, which has neither the field nor TORCH_ELASTIC_SHUTDOWN_TIMEOUT), the
  agent calls it without a timeout, so the ranks get its default 30 s between the graceful
  signal and SIGKILL: here its documented `timeout` argument defaults to the job's
  `shutdown_timeout` instead, as the field does where torch has it.

- `PContext.start` (public): the agent starts (or restarts) its ranks through it; a failure
  seen before a restart is not the job's first cause any more (`_job.preempt`).
- `ProcessContext.join` (torch.multiprocessing.spawn, public): on a rank's failure torch's
  agent calls it without a grace period, and it then waits a hard-coded 30 s between
  SIGTERM and SIGKILL, so a survivor that handles SIGTERM (Lightning, any
  checkpoint-on-SIGTERM code) keeps the job alive that long. Here the grace period, a
  documented argument, defaults to the job's `shutdown_timeout`, and the survivors get
  SIGTERM as soon as the failure is seen: a survivor that ignores SIGTERM is killed at
  most 2 x shutdown_timeout after the failure. torch then names the first dead rank it
  finds among the ones it still watches (`sentinels`, a public attribute): here only the
  failed ones, so a survivor ended by that SIGTERM is never taken for the cause. The
  failed ranks (`processes`, public) are told to `_job.preempt` first, as with `close`:
  torch reports one failed rank of a multiprocessing context, the job's error names them all.
- `store.barrier` (torch.distributed.elastic.utils.store, public), multi-node jobs only:
  once a node's ranks have ended, torch's agent waits there for the job's other nodes (its
  exit barrier, up to `exit_barrier_timeout`, 300 s) in one `Store.wait`, a C++ call in
  which no Python signal handler of the job's process runs: neither the SIGALRM of
  `job_timeout` (`_job.agent`) nor a stop signal (the launcher's SIGTERM after another node
  failed) was acted on before the other nodes came or the barrier timed out. Here, in the
  job's process, the barrier's wait polls the store (`Store.check`, a few times a second):
  between polls the handlers run, and the node ends at its deadline or on a stop as one
  whose ranks still run does. A rank forked from this process waits as torch does.
- `dynamic_rendezvous.get_method_name` (public in its module): names the calling method for
  rendezvous event records, through two `inspect.stack()` calls that read the source of
  every frame and scan `sys.modules` (about 0.1 s per job on a 2-core machine, more with
  a large app loaded). Here the same name comes from walking the frames.
- the `time` module as torch's agent module (`agent.server.api`) names it: the agent sleeps
  `monitor_interval` between its checks of its ranks, and a rank whose task returned waits
  (in torch's wrapper) for the agent to take its value, so every job ended up to that long
  (0.1 s) after its task, and a short one a whole interval later: a third of a trivial
  job's time. Here that sleep (the module's only one) also ends as soon as a rank says its
  task returned (`_shared.stop_files.tell_task_returned`); torch's wrapper queues the value
  just after, so the next sleeps are short (1 ms, doubling up to `monitor_interval`) until
  the agent has it. A failure is seen at the agent's next check, as torch sees it (a
  failing rank lingers for it: `_rank.worker`).
- `dynamic_rendezvous._delay` (private), single-node jobs only: before its first round the
  c10d rendezvous sleeps a random 0-0.3 s "to skew the rendezvous attempts across the
  nodes". A single-node job has no other node to skew against; its process skips that
  sleep (every other delay, such as the 1 s between polls, is kept).
"""

import inspect
import logging
import os
import select
import socket
import time
from datetime import timedelta
from types import FrameType
from typing import Any, Dict, Optional, Tuple

from .._rank.forkserver import drop_inherited_forkserver
from . import preempt

log = logging.getLogger(__name__)


def adjust_torch_for_this_job(shutdown_timeout: int, single_node: bool, close_timeout: bool) -> None:
    """`close_timeout`: torch's LaunchConfig cannot carry shutdown_timeout, `PContext.close` does."""
    _join_within_shutdown_timeout(shutdown_timeout)
    _close_after_noting_failures(shutdown_timeout if close_timeout else None)
    _note_attempts()
    _cheap_method_names()
    if single_node:
        _no_skew_delay()
    else:
        _exit_barrier_heeds_signals()


def _join_within_shutdown_timeout(seconds: float) -> None:
    from torch.multiprocessing.spawn import ProcessContext

    original = ProcessContext.join
    if "grace_period" not in inspect.signature(original).parameters:
        log.warning(
            "this torch's ProcessContext.join takes no grace_period: after a rank fails, "
            "its peers get 30 s (not hydra.launcher.shutdown_timeout) before SIGKILL"
        )
        return

    def join(self: Any, timeout: Optional[float] = None, grace_period: Optional[float] = None) -> Any:
        preempt.rank_exits_from(lambda: {i: (p.pid, p.exitcode) for i, p in enumerate(self.processes)})
        if timeout is not None and timeout < 0:  # the agent's check of its ranks
            _no_rank_ended_without_its_value(self.processes)
        if grace_period is None:
            failed = {s: i for s, i in self.sentinels.items() if self.processes[i].exitcode not in (None, 0)}
            if failed:
                dead = {i: self.processes[i] for i in failed.values()}
                preempt.ranks_failed({i: (p.pid, p.exitcode) for i, p in dead.items()})
                # a rank failed: the survivors get the graceful signal now, not after a grace period
                for process in self.processes:
                    if process.is_alive():
                        process.terminate()
                # and the rank torch names is the one that failed, never a survivor that this
                # SIGTERM ended before torch looked (torch names the first dead one it finds)
                self.sentinels = failed
            grace_period = seconds
        finished = original(self, timeout, grace_period)
        if finished and all(process.exitcode == 0 for process in self.processes):
            # every rank returned: none will be forked again, so the job's forkserver starts
            # its exit now, while the agent ends the job, not when the job process stops it
            drop_inherited_forkserver()
        return finished

    ProcessContext.join = join  # type: ignore[method-assign]


def _no_rank_ended_without_its_value(processes: Any) -> None:
    """A rank's process ends only once the agent has taken every rank's value (torch's wrapper
    waits for it), so one that ended with code 0 before (`os._exit(0)` in the task, as scripts
    do to skip their teardown) took its value with it, and torch would wait for that value
    for ever: it fails the job instead, naming the rank."""
    from torch.multiprocessing.spawn import ProcessExitedException

    for index, process in enumerate(processes):
        if process.exitcode == 0:
            preempt.ranks_failed({index: (process.pid, 0)})
            raise ProcessExitedException(
                f"process {index} exited with code 0 before its task returned",
                error_index=index,
                error_pid=process.pid,
                exit_code=0,
            )


def close_takes_a_timeout() -> bool:
    """Whether this torch's `PContext.close` takes the seconds before SIGKILL (every torch
    setup.py allows does; checked so that a later one that does not is never patched)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    return list(inspect.signature(PContext.close).parameters) == ["self", "death_sig", "timeout"]


def _close_after_noting_failures(seconds: Optional[int]) -> None:
    """`PContext.close`, after telling `_job.preempt` which ranks had failed (subprocess ranks:
    a launch prefix, a script); with `seconds` as its default timeout where torch's agent
    passes none (see the module's docstring)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    if not close_takes_a_timeout():
        return  # check_supported refused a shutdown_timeout this torch cannot honour
    original = PContext.close

    def exits(context: Any) -> Dict[int, Tuple[int, Optional[int]]]:
        handlers = getattr(context, "subprocess_handlers", None)
        if not isinstance(handlers, dict):
            return {}
        return {rank: (handler.proc.pid, handler.proc.returncode) for rank, handler in handlers.items()}

    def close(self: Any, death_sig: Any = None, timeout: Optional[int] = None) -> None:
        now = exits(self)
        if now:
            preempt.rank_exits_from(lambda: exits(self))
            preempt.ranks_failed(
                {rank: (pid, code) for rank, (pid, code) in now.items() if code not in (None, 0)}  # type: ignore[misc]
            )
        if timeout is None:
            timeout = seconds
        if timeout is None:
            original(self, death_sig)
        else:
            original(self, death_sig, timeout)

    PContext.close = close  # type: ignore[method-assign]


def _note_attempts() -> None:
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.start
    if list(inspect.signature(original).parameters) != ["self"]:
        return  # a torch that starts its ranks some other way: a restart keeps an earlier failure noted

    def start(self: Any) -> None:
        preempt.attempt_starting()
        original(self)

    PContext.start = start  # type: ignore[method-assign]


def _cheap_method_names() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    current = getattr(dynamic_rendezvous, "get_method_name", None)
    if current is None or list(inspect.signature(current).parameters) != ["depth"]:
        return  # a torch that names methods some other way: leave it be

    def get_method_name(depth: int = 2) -> str:
        # inspect.stack()[depth] counted from this function's own frame, without reading sources
        frame: Optional[FrameType] = inspect.currentframe()
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
        return frame.f_code.co_name if frame is not None else "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


# after a rank said its task returned, the agent's next sleeps: this long, each next one
# twice the one before, until the interval's own (torch's wrapper queues the value just after)
_AFTER_RETURN_FIRST_S = 0.001


class _AgentSleep:
    """The `time` module as torch's agent module sees it, but for `sleep` (see the module's
    docstring): it also ends when a rank says on `returned` that its task returned."""

    def __init__(self, returned: socket.socket) -> None:
        self._returned = returned
        self._short: Optional[float] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if self._short is not None:
            seconds, self._short = self._short, (2 * self._short if 2 * self._short < seconds else None)
        if not select.select([self._returned], [], [], seconds)[0]:
            return
        while True:  # every rank that said so since
            try:
                self._returned.recv(16)
            except BlockingIOError:
                break
        self._short = _AFTER_RETURN_FIRST_S


def agent_wakes_on(returned: socket.socket) -> None:
    """Torch's agent, in this process, looks at its ranks as soon as one says on `returned`
    (a bound, non-blocking datagram socket) that its task returned (see the module's docstring)."""
    from torch.distributed.elastic.agent.server import api

    current = getattr(api, "time", None)
    if current is time or isinstance(current, _AgentSleep):
        api.time = _AgentSleep(returned)  # type: ignore[assignment]
    # else a torch whose agent waits some other way: leave it be


def _no_skew_delay() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if delay is None or list(inspect.signature(delay).parameters) != ["seconds"]:
        return  # a torch that delays some other way: leave it be

    def delay_without_skew(seconds: Any) -> None:
        if isinstance(seconds, tuple):
            return  # the random skew between nodes: there is one node
        delay(seconds)

    dynamic_rendezvous._delay = delay_without_skew


# the exit barrier's polls of the store: the first after this long, each next one twice as
# long after the one before, at most _BARRIER_POLL_MAX_S (a stop or the deadline waits no more)
_BARRIER_POLL_FIRST_S = 0.005
_BARRIER_POLL_MAX_S = 0.2


class _PolledStore:
    """A store whose `wait` polls `check` (sleeping between polls, which a signal handler
    interrupts) instead of blocking in C++ until the keys come or its timeout; everything
    else is the store's own."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def wait(self, keys: Any, timeout: Optional[timedelta] = None) -> None:
        limit = self._store.timeout if timeout is None else timeout
        # a zero timeout is c10d's "no timeout" (`Store.kNoTimeout`)
        ends = time.monotonic() + limit.total_seconds() if limit > timedelta(0) else None
        pause = _BARRIER_POLL_FIRST_S
        while not self._store.check(keys):
            if ends is not None and time.monotonic() >= ends:
                from torch.distributed import DistStoreError

                waited = limit // timedelta(milliseconds=1)
                raise DistStoreError(f"wait timeout after {waited}ms, keys: {keys}")
            time.sleep(pause)
            pause = min(2 * pause, _BARRIER_POLL_MAX_S)


def _exit_barrier_heeds_signals() -> None:
    """torch's `store.barrier`, in this process, with a `wait` that signal handlers interrupt
    (see the module's docstring)."""
    from torch.distributed.elastic.utils import store as store_util

    original = getattr(store_util, "barrier", None)
    if original is None or list(inspect.signature(original).parameters)[:1] != ["store"]:
        return  # a torch whose barrier takes its store some other way: leave it be
    job_process = os.getpid()

    def barrier(store: Any, *args: Any, **kwargs: Any) -> Any:
        if os.getpid() != job_process:
            return original(store, *args, **kwargs)  # a rank forked from the job's process
        return original(_PolledStore(store), *args, **kwargs)

    store_util.barrier = barrier
