"""The task function and the app's script, as they travel to the ranks.

Under torchrun every rank is `python app.py overrides...`: the script's module body runs in
each rank and the task is the function that body defines. The ranks here do the same
(`_rank.script`); this module says, once per sweep, what they run: the script (a path, or a
module for `python -m`) and the task's name in it. Only a task the body does not define by
name (a lambda, a closure, a partial, a function made under `if __name__ == "__main__":`)
travels by value, cloudpickled.
"""

import io
import marshal
import os
import sys
import types
from collections import ChainMap
from typing import Any, Optional

import cloudpickle

from .._shared.plan import AppScript


def _marshalled(code: types.CodeType) -> "tuple[Any, tuple[bytes]]":
    return marshal.loads, (marshal.dumps(code),)


class _TaskPickler(cloudpickle.Pickler):
    """cloudpickle, with code objects marshalled whole. cloudpickle >= 3.1.3 renames the file
    of a by-value function's code "<dynamic-code>", which leaves its frames in a traceback
    without a file or source lines (Hydra 1.4 checks that a failed task's frames are its
    own). The ranks run this very interpreter, for which marshal is exact."""

    dispatch_table = ChainMap({types.CodeType: _marshalled}, cloudpickle.Pickler.dispatch_table)


def pickle_task(task_function: Any) -> "tuple[bytes, Optional[str]]":
    """The task function, cloudpickled once per sweep; or why it cannot travel to the ranks."""
    try:
        buffer = io.BytesIO()
        _TaskPickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(task_function)
        return buffer.getvalue(), None
    except Exception as e:
        return b"", (
            f"the task function cannot be pickled for the ranks ({type(e).__name__}: {e}); "
            "a task holding a lock, an open file or a socket cannot travel to another process"
        )


def app_script(task_function: Any) -> Optional[AppScript]:
    """The launcher's main script, as multiprocessing's spawn would run it in a child.

    None where there is no script to run (`python -c`, an interactive session): the
    ranks then run the task alone, by value.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    module = getattr(spec, "name", None)
    path = getattr(main, "__file__", None)
    if module is None and not path:
        return None
    return AppScript(
        path=None if module is not None else os.path.abspath(str(path)),
        module=module,
        argv0=sys.argv[0] if sys.argv else str(path or module),
        **_name_in_script(task_function, main),
    )


def _name_in_script(task_function: Any, main: Any) -> "dict[str, Any]":
    """The task's qualified name in the main module, when that name leads to this very
    function, and how many `__wrapped__` levels inside it is: `@hydra.main`'s wrapper keeps
    it there, around any decorator of the app's own (`functools.wraps`: torch's `@record`)."""
    none = {"task_name": None, "task_unwraps": 0}
    if getattr(task_function, "__module__", None) != "__main__":
        return none  # a function of an importable module travels by reference already
    qualname = getattr(task_function, "__qualname__", "")
    if not qualname or "<" in qualname:  # <lambda>, <locals>
        return none
    found: Any = main
    for part in qualname.split("."):
        found = getattr(found, part, None)
    for unwraps in range(_MAX_WRAPPERS):
        if found is None:
            break
        if found is task_function:
            return {"task_name": qualname, "task_unwraps": unwraps}
        found = getattr(found, "__wrapped__", None)
    return none


# decorators between the name and the task (inspect.unwrap's own guard against a loop)
_MAX_WRAPPERS = 32
