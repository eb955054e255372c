"""The warm server as a fork of the launcher: the app's packages are imported already.

A fresh server pays again every import the launcher paid (Lightning: seconds), one after
the other, before the first job starts. Where the launcher can be forked safely, the
server is a fork of it instead, with nothing left to import. Safe means:
- no Python thread but the main one (a fork carries no thread, only the locks it held);
- no native thread beyond those a fresh import of the same packages starts (OpenBLAS's
  pools are fork-safe and a fresh server has them too; torch's intra-op pool, once used,
  is OpenMP's, which a forked child cannot use);
- CUDA not initialised (a forked child cannot use it);
- every preloaded package's import already watched by an earlier fresh server, with what
  it read, its files unchanged since (`_server.remembered`): an import that read RANK
  must not reach the ranks, and one that already ran in the launcher cannot be watched.
Then the child is made to look like a fresh server before it serves (`become_fresh`):
the app's own modules and its `__main__` are dropped (ranks run the script body fresh),
the launcher's signal handlers, log handlers and open files do not reach a job.
"""

import logging
import os
import signal
import site
import sys
import sysconfig
import threading
import types
from typing import Iterable, Optional, Tuple

from .._shared.private import flush_loggers, lookup

# kept in a fork: what a fresh server imports too (its own package, Hydra's plugins)
_KEPT_PREFIXES = ("hydra_plugins",)


def native_threads() -> int:
    """The threads of this process, Python's and every library's (Linux; 1 elsewhere)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def fork_hazard() -> Optional[str]:
    """Why the launcher cannot be forked now, whatever it imported (one phrase), or None."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"a Python thread {others[0]!r} is running in the launcher"
    if not sys.platform.startswith("linux"):
        return "the launcher cannot count its native threads on this platform"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA is initialised in the launcher"
    return None


def thread_hazard(baseline_threads: int) -> Optional[str]:
    """Why the launcher's native threads forbid a fork (one phrase), or None.

    `baseline_threads`: the threads a fresh server had after the same imports.
    """
    running = native_threads()
    if running > baseline_threads:
        return (
            f"{running - 1} native threads run besides the launcher's main thread, where a fresh import "
            f"of its packages starts {baseline_threads - 1} (torch's intra-op pool, OpenMP?)"
        )
    return None


def app_modules(roots: Tuple[str, ...]) -> "list[str]":
    """The modules a fresh server would not have: the app's own, found outside `roots`
    (site-packages, the standard library) and outside Hydra's plugins."""
    found = []
    for name, module in list(sys.modules.items()):
        if name == "__main__" or name.startswith(_KEPT_PREFIXES):
            continue
        origin = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(
            module, "__file__", None
        )
        if isinstance(origin, str) and os.path.isabs(origin) and not origin.startswith(roots):
            found.append(name)
    return found


def site_package_roots() -> Tuple[str, ...]:
    """The folders installed packages live in (site-packages, dist-packages), each ending
    in a separator."""
    return tuple(
        os.path.join(path, "")
        for path in {*site.getsitepackages(), site.getusersitepackages(), *sysconfig.get_paths().values()}
        if "site-packages" in path or "dist-packages" in path
    )


def library_roots(site_roots: Iterable[str]) -> Tuple[str, ...]:
    """Where installed packages and the standard library live, each ending in a separator."""
    # not sysconfig's "data" or "scripts": the prefix itself, under which an app may live
    libraries = ("stdlib", "platstdlib", "purelib", "platlib")
    paths = {*site_roots, *(sysconfig.get_paths()[name] for name in libraries)}
    return tuple(os.path.join(os.path.realpath(p), "") for p in paths) + tuple(
        os.path.join(p, "") for p in paths
    )


def flush_before_fork() -> None:
    """Nothing the launcher buffered may be written twice, once by the fork."""
    flush_loggers()
    sys.stdout.flush()
    sys.stderr.flush()


def become_fresh(keep_fd: int, roots: Tuple[str, ...]) -> None:
    """In the forked server: what a fresh server is, as far as a job can tell.

    - open files: every descriptor of the launcher's (its log file, the sweep lock, the
      app's files, pipes) now points at /dev/null, stdin too; the number stays taken, so an
      object of the launcher's that closes it later closes nothing of a job's;
    - signals: every handler the launcher or the app installed is back to the default;
    - logging: the handlers Hydra or the app installed are gone (root back to WARNING);
    - modules: the app's own and its `__main__` are dropped, so that the ranks' script
      body (run as `__mp_main__`) and spawned children import them fresh; `sys.argv` is a
      fresh server's.
    """
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in _open_fds():
        if fd not in (1, 2, keep_fd, devnull):
            os.dup2(devnull, fd, inheritable=fd == 0)
    os.close(devnull)
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.WARNING)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
                logger.removeHandler(handler)
                handler.close()
    # a resource tracker the launcher started is the launcher's: jobs get the server's own
    tracker = lookup("multiprocessing.resource_tracker", "_resource_tracker")
    if getattr(tracker, "_fd", None) is not None:
        tracker._fd = tracker._pid = None  # type: ignore[union-attr]
    for name in app_modules(roots):
        del sys.modules[name]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = sys.modules["builtins"]
    sys.modules["__main__"] = main
    sys.argv[:] = ["-c"]


def _open_fds() -> "list[int]":
    """This process's open descriptors (the one that listed them is closed again by then)."""
    listed = [int(fd) for fd in os.listdir("/proc/self/fd")]
    return [fd for fd in sorted(listed) if _is_open(fd)]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
