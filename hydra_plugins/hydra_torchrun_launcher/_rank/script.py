"""A rank starts as torchrun's ranks start: a fresh random state, then the app's script.

Under torchrun every rank is a fresh `python app.py overrides...`. A rank here is forked
from a warm process instead, so two things a fresh interpreter gives for free are given
here, before anything of the app runs:
- its own random state: Python's `random`, NumPy's global generator (when imported) and
  torch's CPU generator are seeded from the OS, as at interpreter start; a fork would
  otherwise copy one state into every rank of every job (DDP on duplicated data). CUDA's
  generators start from torch's default seed in a fresh interpreter, and CUDA is never
  initialised before a rank starts, so they already do.
- the app's script, run as multiprocessing's spawn runs it in a child
  (`multiprocessing.spawn.prepare`): as `__mp_main__`, installed as `__main__` too, so the
  `if __name__ == "__main__":` block does not start Hydra again, with `sys.argv` as torchrun
  gives it (`[app.py, overrides...]`). Module-level set-up (seeds, default dtype,
  `torch.set_float32_matmul_precision`, registries) then holds in the rank, classes the
  script defines pickle by name (spawn DataLoader workers run the script the same way),
  and the task is the function the body defined, with the rank's own module globals.
"""

import os
import random
import sys
from multiprocessing import spawn
from types import ModuleType, TracebackType
from typing import Any, Callable, List, Optional

import cloudpickle
from omegaconf import OmegaConf

from .._shared.plan import AppScript


def fresh_random_state() -> None:
    """Seed the generators a fresh interpreter seeds from the OS, as it would."""
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()


def run_script(script: Optional[AppScript], overrides: List[str]) -> None:
    """Run the app's script body as this rank's `__main__`, with torchrun's `sys.argv`.

    It starts with OmegaConf's own resolvers only, as in a fresh interpreter (this process
    holds the launcher's, the app's among them: a body that registers one would find it
    taken); Hydra's state, the app's resolvers included, is set after the body. What the
    body defines pickles by value when it leaves the rank (a return value, an exception),
    as `__main__`'s objects do: the processes it goes to have no `__mp_main__`.
    """
    if script is None:
        return
    data: dict[str, Any] = {"sys_argv": [script.argv0, *overrides]}
    if script.module is not None:
        data["init_main_from_name"] = script.module
    else:
        data["init_main_from_path"] = script.path
    OmegaConf.clear_resolvers()
    try:
        spawn.prepare(data)
    except (Exception, SystemExit) as e:  # Hydra's main ends on sys.exit(1) when it fails
        if _ran_hydras_main(e.__traceback__):
            raise RuntimeError(
                f"the script's module body started Hydra again in the rank ({type(e).__name__}: {e}): "
                'call main() under `if __name__ == "__main__":`, as multiprocessing and spawned '
                "DataLoader workers also require"
            ) from e
        raise
    main = sys.modules.get("__mp_main__")
    if main is not None:
        cloudpickle.register_pickle_by_value(main)
        _named_as_main(main)


def _named_as_main(module: ModuleType) -> None:
    """The classes the script's body defined are named `__main__.X`, as under `python app.py`
    (and torchrun), not `__mp_main__.X`: a rank's traceback then says `AppError: ...` as
    Python's does, and the class travels to the launcher by that name (`_rank.carried_exception`), where
    it is the script's own. Pickling by that name still works here and in spawned workers,
    whose `__main__` is this module too."""
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            value.__module__ = "__main__"


def _ran_hydras_main(tb: Optional[TracebackType]) -> bool:
    """Whether the body called a `@hydra.main` function (a script without the guard)."""
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "decorated_main" and code.co_filename.endswith(os.path.join("hydra", "main.py")):
            return True
        tb = tb.tb_next
    return False


def script_frames(tb: Optional[TracebackType], script: Optional[AppScript]) -> Optional[TracebackType]:
    """The traceback from the script's own first frame on (as Python shows a script's error),
    without the frames of multiprocessing and runpy that ran it."""
    if script is None:
        return tb
    own = script.path or script.module.replace(".", os.sep) + ".py"  # type: ignore[union-attr]
    first = tb
    while first is not None:
        filename = first.tb_frame.f_code.co_filename
        if filename == own or filename.endswith(os.sep + own):
            return first
        first = first.tb_next
    return tb


def task_function(script: Optional[AppScript], pickled_task: bytes) -> Callable[..., Any]:
    """The task the script's body defined, by name; by value where it has no name there.

    The name leads to what the body bound (`@hydra.main`'s wrapper, around any decorator of
    the app's own, such as torch's `@record`); the task is `task_unwraps` levels inside it.
    """
    if script is not None and script.task_name is not None:
        found: Any = sys.modules["__main__"]
        for part in script.task_name.split("."):
            found = getattr(found, part, None)
        for _ in range(script.task_unwraps):
            found = getattr(found, "__wrapped__", None)
        if found is not None:
            return found
        if not pickled_task:
            raise RuntimeError(
                f"the task function {script.task_name} is not defined when the script's body runs "
                "in a rank (is it made under `if __name__ == '__main__':`?), and it cannot be pickled"
            )
    return cloudpickle.loads(pickled_task)
