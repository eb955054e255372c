"""A forkserver for one job's ranks, forked from its (warm) job process.

With `start_method: forkserver`, torch asks Python's multiprocessing for ranks; left to
itself, multiprocessing would start its forkserver as a fresh interpreter and re-import
torch in every job. Here the job process forks the server itself, once its environment
is final (env_set, callbacks, devices applied) and while it is still single-threaded, and
runs multiprocessing's own server loop (`multiprocessing.forkserver.main`) in it. The
ranks are then forked from a clean, warm process that holds exactly the job's
environment; the app's main module is never re-imported (the job process has none).

This touches three private attributes of `multiprocessing.forkserver._forkserver`
(address, alive fd, pid; present in CPython 3.9 to 3.13, checked below). Where they or
`main`'s signature differ, ranks use multiprocessing's own forkserver: correct, but cold.
"""

import inspect
import logging
import os
import socket
from multiprocessing import forkserver
from typing import Callable, Optional

from .._shared.private import socket_address
from .._shared.signals import ignored_group_signals, take_dispositions

log = logging.getLogger(__name__)

_CLIENT_ATTRS = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")


def supported() -> bool:
    client = getattr(forkserver, "_forkserver", None)
    if client is None or not all(hasattr(client, name) for name in _CLIENT_ATTRS):
        return False
    params = list(inspect.signature(forkserver.main).parameters)
    # CPython 3.14 adds an authentication key the client must hold
    return params[:3] == ["listener_fd", "alive_r", "preload"] and "authkey_r" not in params


def drop_inherited_forkserver() -> None:
    """Forget the forkserver this process knows, closing its end of the server's alive pipe.

    Every process a forkserver forks (every forkserver rank) inherits the write end of the
    pipe by which the forkserver learns that its job process is gone. While a rank holds it,
    the forkserver outlives a killed job process, and so does the rank, whose parent-death
    signal waits for the forkserver. A rank that starts processes with the forkserver method
    itself then gets a forkserver of its own. The job process drops it to stop its server.
    """
    client = getattr(forkserver, "_forkserver", None)
    alive_fd = getattr(client, "_forkserver_alive_fd", None)
    if alive_fd is None:
        return
    client._forkserver_address = client._forkserver_alive_fd = client._forkserver_pid = None  # type: ignore
    os.close(alive_fd)


def start_rank_forkserver(socket_dir: str, ranks_ignore: Optional[int] = None) -> Callable[[], None]:
    """Fork the job's forkserver and point multiprocessing at it; returns how to stop it.

    `socket_dir`: a private directory for the server's socket, removed with the job (the
    address multiprocessing would choose lies in a `pymp-*` dir that only an orderly
    interpreter exit removes, and a job process leaves with `os._exit`).

    `ranks_ignore`: a signal the server and its ranks ignore (the stop signal, which SLURM
    sends to every process of a step: it is the job process's to act on).
    """
    if not supported():
        log.warning(
            "this Python's multiprocessing.forkserver differs from what the torchrun launcher knows: "
            "ranks start from a fresh forkserver (slower)"
        )
        return lambda: None
    client = forkserver._forkserver  # type: ignore[attr-defined]
    listener = socket.socket(socket.AF_UNIX)
    address, own_dir = socket_address(socket_dir, "forkserver")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(alive_w)
            # its ranks start with the signals as the launcher's processes have them, not
            # with the job process's stop handler
            ignored = ignored_group_signals()
            take_dispositions(ignored if ranks_ignore is None else [*ignored, ranks_ignore])
            forkserver.main(listener.fileno(), alive_r, [])
            code = 0
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    client._forkserver_address = address
    client._forkserver_alive_fd = alive_w
    client._forkserver_pid = pid

    def stop() -> None:
        drop_inherited_forkserver()  # closing the alive pipe ends the server's loop
        os.waitpid(pid, 0)
        if os.path.exists(address):
            os.unlink(address)
        if own_dir is not None:
            os.rmdir(own_dir)

    return stop
