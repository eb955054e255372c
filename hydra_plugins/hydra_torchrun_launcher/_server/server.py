"""The warm server: one process per launcher that has torch imported and forks every job.

Each sweep job runs in a process of its own (its "job process": Hydra's `run_job` and
torch's elastic agent, see `_job.process`), so jobs running at once share no
process-global state. Starting that process with a fresh `import torch` would cost
seconds per job; forking it from the launcher would copy the launcher's threads and
half-finished state. So the launcher starts this server once (a fresh interpreter,
single-threaded, which imports torch and Hydra's plugins and never initialises CUDA) and
asks it to fork a job process per job.

Protocol, over a Unix socket pair: the launcher sends one message per job whose
ancillary data are two pipe ends, the job's payload (read end) and its result (write
end); the server forks, answers with the child's pid, and later with the child's exit
status. Nothing is ever put into a shell string; the payload never touches the disk.

The server ignores the signals a terminal or a scheduler sends to a whole process group:
the launcher decides what they mean, and each job process is given the launcher's own
dispositions back. It ends with the launcher: the launcher closes its socket as it exits
and reaps it (or the parent-death signal ends it, after a launcher killed outright).

It outlives its job processes: one killed outright (a second Ctrl-C, the launcher's
backstop past `job_timeout`, the OOM killer) cannot remove its private directory, so the
server removes what such dead processes left as it reaps them, and, as it starts, what an
earlier run's left (`_shared.private.remove_dead_private_dirs`).
"""

import atexit
import gc
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .._rank.preloaded import REDONE_IN_RANK
from .._shared.lifetime import die_with_parent
from .._shared.private import remove_dead_private_dirs
from .._shared.signals import group_signals
from .watch import watched_import

# what every job process imports anyway: done once here, inherited by every fork
BASE_PRELOAD = ("torch", "torch.distributed.elastic.multiprocessing", "torch.distributed.launcher.api")
# and what each job process imported for itself (a few ms a job, counted in a trace): the
# launcher's callback its request carries, torch's c10d rendezvous store and forkserver ranks,
# Hydra's callback base and logging set-up, the codec of socket's host names
JOB_PROCESS_IMPORTS = (
    "hydra_plugins.hydra_torchrun_launcher._job.process",
    "hydra_plugins.hydra_torchrun_launcher._launcher.preempt",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "multiprocessing.popen_forkserver",
    "multiprocessing.queues",
    "hydra.experimental.callback",
    "logging.config",
    "encodings.idna",
)

# set in the server (and so in every process it forks): Hydra's plugin scan, and where it looked
PLUGINS: Optional[object] = None
SCANNED_FOLDERS: List[str] = []

_PID_MESSAGE = struct.Struct("=cqq")  # kind (b"P" started / b"X" exited), pid, wait status
_REQUEST = b"J"
# a job process's payload pipe: the request's size, the request, then _GO when the job starts
_REQUEST_SIZE = struct.Struct("=q")
_GO = b"G"

_BOOTSTRAP = (
    "import sys; from hydra_plugins.hydra_torchrun_launcher._server.server import serve; "
    "serve(int(sys.argv[1]))"
)

# the tracker's warning at shutdown about resources of processes that died without unlinking them
_TRACKER_QUIET = "ignore:resource_tracker:UserWarning:multiprocessing.resource_tracker"


# ------------------------------------------------------------------ server side


def serve(fd: int) -> None:
    """Main loop of the server process (started by `WarmServer.start`)."""
    die_with_parent()
    for sig in group_signals():
        signal.signal(sig, signal.SIG_IGN)
    _remove_what_dead_jobs_left()  # an earlier run's, killed outright
    sock = socket.socket(fileno=fd)
    sys_path, preload = _recv_frame(sock)
    sys.path[:] = [p for p in sys_path if p] + [p for p in sys.path if p not in sys_path]
    try:
        report = _preload(preload, lambda name: _send_frame(sock, ("importing", name)))
        _send_frame(sock, ("done", report))
    except BrokenPipeError:
        os._exit(0)  # the launcher went away (or replaced this server) while it preloaded
    if report["unsafe"] is not None:
        os._exit(3)  # no rank may be forked from here: the launcher starts a server without it
    # multiprocessing's resource tracker, started once here: every job process inherits it.
    # It still unlinks what a job process killed on a second Ctrl-C could not, but without
    # its "leaked semaphore objects" warning on the user's console after the sweep's last line.
    from multiprocessing import resource_tracker

    sys.warnoptions.append(_TRACKER_QUIET)  # read by the tracker's command line, then dropped
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(_TRACKER_QUIET)
    # one full collection now, before the first fork. What the imports above made is counted
    # by the collector as long-lived objects not yet walked; left so, a full collection may be
    # due in every process forked from here, which each then pays (a walk of the whole
    # preloaded heap, every page it touches copied: 0.2 s a job with Optuna's packages
    # preloaded). Collected here, it is paid once; a job or rank collects what is its own.
    gc.collect()
    children: Set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _reap(sock, children)
                continue
            try:
                message, fds, _, _ = socket.recv_fds(sock, 16, 5)
            except OSError:
                message, fds = b"", []
            if not message:  # the launcher is gone
                os._exit(0)
            payload_r, result_w, *stdio = fds
            # the child starts with the group signals blocked, not ignored: a stop sent before
            # it has taken the launcher's handlers is held for it (`_job.process`)
            signal.pthread_sigmask(signal.SIG_BLOCK, group_signals())
            pid = os.fork()
            if pid != 0:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, group_signals())
            if pid == 0:
                selector.close()
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                # the launcher's stdin, stdout and stderr as they are now, not at server start
                for target, fd in enumerate(stdio):
                    os.dup2(fd, target)
                    os.close(fd)
                _run_job_process(payload_r, result_w)
            for fd in (payload_r, result_w, *stdio):
                os.close(fd)
            children.add(pid)
            sock.sendall(_PID_MESSAGE.pack(b"P", pid, 0))
        _reap(sock, children)


def _run_job_process(payload_r: int, result_w: int) -> None:
    """The forked child: run the job, then leave without running the server's cleanup."""
    code = 0
    try:
        from .._job.process import job_process_main

        with os.fdopen(payload_r, "rb") as payload:
            job_process_main(RequestPipe(payload), result_w)
    except BaseException:
        # the launcher reports the exit status; the cause goes to the launcher's stderr
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class RequestPipe:
    """A job process's end of its payload pipe (the launcher's `PreparedJob` writes the other)."""

    def __init__(self, payload: Any) -> None:
        self._payload = payload

    def request(self) -> bytes:
        (size,) = _REQUEST_SIZE.unpack(self._payload.read(_REQUEST_SIZE.size))
        return self._payload.read(size)

    def go(self) -> bool:
        """Wait for the launcher's go: True, or False where it cancelled the job."""
        return self._payload.read(len(_GO)) == _GO


def _reap(sock: socket.socket, children: Set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in children:
            children.discard(pid)
            if status != 0:  # it may have died without removing its private dir
                _remove_what_dead_jobs_left()
            sock.sendall(_PID_MESSAGE.pack(b"X", pid, status))


def _remove_what_dead_jobs_left() -> None:
    try:
        remove_dead_private_dirs()
    except Exception:
        pass  # never a reason to fail a sweep


def _preload(modules: Sequence[str], importing: Callable[[str], None]) -> Dict[str, Any]:
    """Import torch, our rank-side modules and `modules`, each watched (`_server.watch`).

    The report says which modules failed to import (skipped: the launcher warns, naming
    them), which variables each import read (the launcher decides which differ per rank or
    job), and the first import after which no rank may be forked from here (a Python thread
    started, CUDA initialised, the process asked to exit): the server stops there.
    `importing(name)` is told before each import, so that an import that kills the process
    is named all the same.
    """
    import importlib

    for name in (*BASE_PRELOAD, *JOB_PROCESS_IMPORTS):
        importlib.import_module(name)
    import torch

    if "numpy" in sys.modules:  # torch's; its global generator too, so that seeding it is seen
        importlib.import_module("numpy.random")

    skipped: List[Tuple[str, str]] = []
    reads: Dict[str, Dict[str, List[str]]] = {}
    for name in modules:
        importing(name)
        why = None
        try:
            reads[name], threads, touched = watched_import(name)
            if touched:
                why = f"it seeds a global random generator at import ({', '.join(touched)}), a seed a rank's "
                why += "fresh random state would lose"
            if threads:
                why = f"it starts a Python thread at import ({', '.join(threads)}), which a fork cannot carry"
        except Exception as e:  # reported to the launcher, which names the module
            skipped.append((name, f"{type(e).__name__}: {e}".splitlines()[0]))
        except SystemExit as e:
            why = f"it exits at import (SystemExit: {e.code})"
        if why is None and torch.cuda.is_initialized():
            why = "importing it initialises CUDA, which forked ranks could not use"
        if why is not None:
            return {"skipped": skipped, "reads": reads, "unsafe": (name, why)}
    # first-use costs every job process would pay again (it is a fresh fork each time):
    # OmegaConf's interpolation grammar (antlr builds its tables) and the YAML dumper
    from omegaconf import OmegaConf

    warm = OmegaConf.create({"a": 1, "b": "${a}"})
    OmegaConf.to_yaml(OmegaConf.create({"b": warm.b}))
    # Hydra's plugin scan (an import of every module under hydra_plugins), once for all jobs
    from hydra.core.plugins import Plugins

    from .._rank.worker import scanned_folders

    global PLUGINS, SCANNED_FOLDERS
    PLUGINS = Plugins.instance()
    SCANNED_FOLDERS = scanned_folders(getattr(importlib.import_module("hydra_plugins"), "__path__", []))
    return {"skipped": skipped, "reads": reads, "unsafe": None}


def _send_frame(sock: socket.socket, value: Any) -> None:
    """One pickled value, length first (the server's start-up exchange)."""
    frame = pickle.dumps(value)
    sock.sendall(struct.pack("=q", len(frame)) + frame)


def _recv_frame(sock: socket.socket) -> Any:
    header = _recv_exact(sock, 8)
    return pickle.loads(_recv_exact(sock, struct.unpack("=q", header)[0]))


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError("the launcher closed the warm server's socket")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------ launcher side


class PreparedJob:
    """A job process that has its request and waits for its go: `go` runs the job, `cancel`
    ends the process without it (it writes no result; the launcher still reaps it)."""

    def __init__(self, pid: int, result_r: int, payload_w: int) -> None:
        self.pid = pid
        self.result_r = result_r
        self.payload_w = payload_w

    def go(self) -> None:
        try:
            os.write(self.payload_w, _GO)
        except BrokenPipeError:  # the process died before its go: its missing result says so
            pass
        finally:
            os.close(self.payload_w)

    def cancel(self) -> None:
        os.close(self.payload_w)


class WarmServer:
    """The launcher's handle on its server: start job processes, learn when they exit."""

    def __init__(self, sys_path: List[str], preload: Tuple[str, ...]) -> None:
        self.key = (tuple(sys_path), preload)
        self._owner = os.getpid()  # a process forked from the launcher has no server of its own
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                # a group of its own: a terminal's Ctrl-C reaches the jobs once, through the launcher
                preexec_fn=os.setpgrp,
            )
        finally:
            theirs.close()
        _send_frame(self._sock, (list(sys_path), list(preload)))
        self._buffer = b""
        self.exited: Dict[int, int] = {}  # pid -> wait status, for job processes that ended
        self._started: List[int] = []
        self._report: Optional[Dict[str, Any]] = None

    def report(self) -> Dict[str, Any]:
        """What the server's preload did (waits until it is done): see `_preload`."""
        importing = None
        while self._report is None:
            try:
                kind, value = _recv_frame(self._sock)
            except EOFError:
                status = self._process.wait()
                if importing is None:
                    raise RuntimeError(
                        f"the torchrun launcher's warm server (pid {self._process.pid}) exited with "
                        f"status {status} before it imported the preloaded modules"
                    ) from None
                why = f"the process ended (exit status {status}) while importing it"
                self._report = {"skipped": [], "reads": {}, "unsafe": (importing, why)}
                break
            if kind == "importing":
                importing = value
            else:
                self._report = value
        return self._report

    def reported(self) -> bool:
        """Whether `report` has been read already (its warnings logged)."""
        return self._report is not None

    def alive(self) -> bool:
        return self._process.poll() is None

    @property
    def pid(self) -> int:
        """The server's pid, which is also its process group's (and its job processes' group)."""
        return self._process.pid

    def start_job(self, request: bytes) -> "tuple[int, int]":
        """Fork a job process that runs `request` now; its pid, and the pipe's end its result
        comes back on."""
        job = self.prepare_job(request)
        job.go()
        return job.pid, job.result_r

    def prepare_job(self, request: bytes) -> "PreparedJob":
        """Fork a job process that reads `request` and takes the launcher's state, then waits
        for its go (`PreparedJob`): what a job's process does before its job can be done
        while an earlier job runs."""
        payload_r, payload_w = os.pipe()
        result_r, result_w = os.pipe()
        try:
            self.report()
            socket.send_fds(self._sock, [_REQUEST], [payload_r, result_w, 0, 1, 2])
            while not self._started:
                self._receive()
            pid = self._started.pop(0)
        finally:
            os.close(payload_r)
            os.close(result_w)
        data = memoryview(_REQUEST_SIZE.pack(len(request)) + request)
        try:
            while data:
                data = data[os.write(payload_w, data) :]
        except BrokenPipeError:  # the process died reading it: its missing result says so
            pass
        return PreparedJob(pid, result_r, payload_w)

    def wait_exit(self, pid: int) -> int:
        """The wait status of a job process, waiting for the server to report it."""
        while pid not in self.exited:
            self._receive()
        return self.exited.pop(pid)

    def forget_exited(self, pids: Set[int]) -> None:
        """Drop from `pids` (job processes whose exit nobody waits for) those the server has
        reported exited so far, and their statuses."""
        for pid in [pid for pid in pids if pid in self.exited]:
            del self.exited[pid]
            pids.discard(pid)

    def _receive(self) -> None:
        data = self._sock.recv(4096)
        if not data:
            raise RuntimeError(
                f"the torchrun launcher's warm server (pid {self._process.pid}) exited unexpectedly "
                f"with status {self._process.wait()}"
            )
        self._buffer += data
        size = _PID_MESSAGE.size
        while len(self._buffer) >= size:
            kind, pid, status = _PID_MESSAGE.unpack(self._buffer[:size])
            self._buffer = self._buffer[size:]
            if kind == b"P":
                self._started.append(pid)
            else:
                self.exited[pid] = status

    def close(self, timeout: Optional[float] = None) -> None:
        """End the server: it exits as its socket closes, at once when idle (between jobs).
        With `timeout`, one still importing its preload is killed at once (it holds nothing
        but imports), and one that has not ended after `timeout` s too."""
        self._sock.close()
        if os.getpid() != self._owner:
            return
        try:
            if timeout is not None and self._report is None:
                self._process.kill()
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """End the server at once (SIGKILL) and reap it."""
        self._sock.close()
        if os.getpid() == self._owner:
            self._process.kill()
            self._process.wait()


_server: Optional[WarmServer] = None
_server_lock = threading.Lock()
# modules found unfit to preload (see `_server.watch`): never preloaded again by this launcher
_left_out: Set[str] = set()
# how long the app's exit waits for an idle server to end by itself before it is killed
_EXIT_WAIT_S = 1.0


def _close_at_exit() -> None:
    """The app ends: its server ends with it, reaped here (not left running to the
    parent-death signal, its socket and process unclosed as the interpreter goes). An idle
    server ends at once when its socket closes; one still importing its preload is killed."""
    global _server
    server, _server = _server, None
    if server is None:
        return
    try:
        server.close(timeout=_EXIT_WAIT_S)
    except (SystemExit, KeyboardInterrupt):
        # a stop signal came as the app exits (SLURM's SIGTERM right after a requeue): its
        # handler's exit is the one under way already; the server goes at once
        server.kill()


atexit.register(_close_at_exit)


def warm_server(preload: Tuple[str, ...] = ()) -> WarmServer:
    """The launcher's server for the current import path and preload list, started on first use.

    It lives as long as the launcher process (an Optuna sweep calls `launch` once per
    batch; each call reuses it) and is replaced when the import path or the list changed.
    A module that fails to preload is skipped with one warning; one whose import a fork
    would carry wrongly into the ranks is left out (the server is started again without
    it), also with a warning.
    """
    global _server
    preload = tuple(name for name in preload if name not in _left_out)
    with _server_lock:
        key = (tuple(sys.path), preload)
        if _server is not None and (_server.key != key or not _server.alive()):
            _server.close()
            _server = None
        if _server is None:
            _server = WarmServer(list(sys.path), preload)
        return _server


def checked_warm_server(preload: Tuple[str, ...], varying: Iterable[str]) -> WarmServer:
    """`warm_server`, once its preload is done and fit for this sweep, with its warnings logged.

    `varying`: the variables whose values differ per rank or per job in this sweep; a
    preloaded import that read one is left out, unless its reads are redone in every rank
    (`_rank.preloaded`).
    """
    import logging

    log = logging.getLogger(__name__)
    varying = frozenset(varying)
    while True:
        server = warm_server(preload)
        first_look = not server.reported()
        report = server.report()
        if first_look:  # once per server, not once per launch of a sweeper's batches
            for name, error in report["skipped"]:
                log.warning(
                    f"hydra.launcher.preload: {name} was not preloaded ({error}); ranks import it themselves"
                )
        unfit = [report["unsafe"]] if report["unsafe"] is not None else []
        unfit += [
            (name, why) for name, why in _reads_that_vary(report["reads"], varying) if name not in _left_out
        ]
        if not unfit:
            return server
        for name, why in unfit:
            log.warning(f"hydra.launcher.preload: {name} is not preloaded: {why}; ranks import it themselves")
            _left_out.add(name)


def _reads_that_vary(
    reads: Dict[str, Dict[str, List[str]]], varying: "frozenset[str]"
) -> List[Tuple[str, str]]:
    """(preloaded module, why) for each import that read a variable differing per rank or job."""
    found = []
    for name, by_module in reads.items():
        for module, keys in sorted(by_module.items()):
            redone = REDONE_IN_RANK.get(module, (frozenset(), None))[0]
            culprits = sorted(k for k in keys if k in varying and k not in redone)
            if culprits:
                found.append(
                    (name, f"{module} reads {', '.join(culprits)} at import, which differs per rank or job")
                )
                break
    return found
