"""The task function and the app's script, as they travel to the ranks.

Under torchrun every rank is `python app.py overrides...`: the script's module body runs in
each rank and the task is the function that body defines. The ranks here do the same
(`_rank.script`); this module says, once per sweep, what they run: the script (a path, or a
module for `python -m`) and the task's name in it. Only a task the body does not define by
name (a lambda, a closure, a partial, a function made under `if __name__ == "__main__":`)
travels by value, cloudpickled.
"""

import inspect
import os
import sys
from typing import Any, Optional

import cloudpickle

from .._shared.plan import AppScript


def pickle_task(task_function: Any) -> "tuple[bytes, Optional[str]]":
    """The task function, cloudpickled once per sweep; or why it cannot travel to the ranks."""
    try:
        return cloudpickle.dumps(task_function), None
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
        task_name=_name_in_script(task_function, main),
    )


def _name_in_script(task_function: Any, main: Any) -> Optional[str]:
    """The task's qualified name in the main module, when that name leads to this very
    function (through `@hydra.main`'s wrapper, which keeps it as `__wrapped__`)."""
    if getattr(task_function, "__module__", None) != "__main__":
        return None  # a function of an importable module travels by reference already
    qualname = getattr(task_function, "__qualname__", "")
    if not qualname or "<" in qualname:  # <lambda>, <locals>
        return None
    found: Any = main
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is None or inspect.unwrap(found) is not task_function:
        return None
    return qualname
