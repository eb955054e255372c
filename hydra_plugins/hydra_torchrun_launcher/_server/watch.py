"""What a preloaded import does that a fork would carry into every rank.

The warm server imports the app's packages once and forks every job (and so every rank)
from itself: whatever an import did is then in every rank, as it was in the server. That
is only right when the rank would have got the same from importing the package itself.
It would not when the import:
- reads a variable that differs per rank or per job (RANK, CUDA_VISIBLE_DEVICES, an
  env_set key, ...): the server has none of their values, the rank its own;
- starts a Python thread: a fork carries no thread, only the state it left (locks held);
- initialises CUDA: a forked child cannot use it;
- ends the process (`sys.exit()` at import);
- seeds a global random generator (Python's, NumPy's, torch's): a rank starts with a
  fresh random state, as a new interpreter does, so the seed would be lost. (A draw at
  import is not seen: it is the same in every rank, where torchrun's ranks each draw their
  own, as `rich` does for its style ids; harmless there.)
The server watches each import for these (`watched_import`); the launcher, which knows
which variables differ in this sweep, decides what to leave out (`_server.server`).

Reads are seen through `os.environ` (also `os.getenv`, `in`, `.get`): a C library's
`getenv` is not.
"""

import importlib
import inspect
import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Set

# frames that stand between a reading module and the environ mapping
_PLUMBING = {"os", "collections.abc", "_collections_abc", __name__}


class _WatchedEnviron(type(os.environ)):  # type: ignore[misc]
    """`os.environ` while a preload import runs: notes which module reads which key."""

    reads: Dict[str, Set[str]] = {}

    def __getitem__(self, key: str) -> str:
        _note(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        _note(key)
        return super().__contains__(key)


def _note(key: object) -> None:
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__") in _PLUMBING:
        frame = frame.f_back
    reader = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    _WatchedEnviron.reads.setdefault(str(reader), set()).add(str(key))


@contextmanager
def _watched_environ() -> Iterator[Dict[str, Set[str]]]:
    """`os.environ` watched for the block; yields {reading module: keys it read}."""
    plain = type(os.environ)
    _WatchedEnviron.reads = {}
    os.environ.__class__ = _WatchedEnviron
    try:
        yield _WatchedEnviron.reads
    finally:
        os.environ.__class__ = plain


def watched_import(name: str) -> "tuple[Dict[str, List[str]], List[str], List[str]]":
    """Import `name`; return the variables each module read while it ran ({module: keys}),
    the names of the Python threads it left running, and the global random generators it
    seeded."""
    before = set(threading.enumerate())
    with _watched_environ() as reads, _watched_seeding() as seeded:
        importlib.import_module(name)
    started = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    return {module: sorted(keys) for module, keys in reads.items()}, started, sorted(seeded)


# the calls that seed (or set) a global generator: module, attribute, generator
_SEEDING = (
    ("random", "seed", "random"),
    ("random", "setstate", "random"),
    ("numpy.random", "seed", "numpy"),
    ("numpy.random", "set_state", "numpy"),
    ("torch", "manual_seed", "torch"),
    ("torch", "set_rng_state", "torch"),
    ("torch.random", "manual_seed", "torch"),
    ("torch.random", "set_rng_state", "torch"),
)


@contextmanager
def _watched_seeding() -> Iterator[Set[str]]:
    """The global generators' seeding calls noted for the block (the names as modules
    expose them; a module imported by then)."""
    seeded: Set[str] = set()
    replaced = []
    for module_name, attr, generator in _SEEDING:
        module = sys.modules.get(module_name)
        original = getattr(module, attr, None)
        if original is None:
            continue

        def noted(*args: Any, _call: Any = original, _gen: str = generator, **kwargs: Any) -> Any:
            seeded.add(_gen)
            return _call(*args, **kwargs)

        setattr(module, attr, noted)
        replaced.append((module, attr, original))
    try:
        yield seeded
    finally:
        for module, attr, original in replaced:
            setattr(module, attr, original)
