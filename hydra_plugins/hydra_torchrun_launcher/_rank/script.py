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

import inspect
import random
import sys
from multiprocessing import spawn
from typing import Any, Callable, List, Optional

import cloudpickle

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
    """Run the app's script body as this rank's `__main__`, with torchrun's `sys.argv`."""
    if script is None:
        return
    data: dict[str, Any] = {"sys_argv": [script.argv0, *overrides]}
    if script.module is not None:
        data["init_main_from_name"] = script.module
    else:
        data["init_main_from_path"] = script.path
    spawn.prepare(data)


def task_function(script: Optional[AppScript], pickled_task: bytes) -> Callable[..., Any]:
    """The task the script's body defined, by name; by value where it has no name there."""
    if script is not None and script.task_name is not None:
        found: Any = sys.modules["__main__"]
        for part in script.task_name.split("."):
            found = getattr(found, part, None)
        if found is not None:
            return inspect.unwrap(found)
        if not pickled_task:
            raise RuntimeError(
                f"the task function {script.task_name} is not defined when the script's body runs "
                "in a rank (is it made under `if __name__ == '__main__':`?), and it cannot be pickled"
            )
    return cloudpickle.loads(pickled_task)
