"""Run by Python at its start in a rank that runs a training script, before the script.

A training script's rank is a fresh `python train.py` that no code of the launcher's runs
in, so past `job_timeout` it could not be asked where it is. The rank's `exec` stage
(`_rank.main`) puts this folder first on PYTHONPATH, where Python's `site` imports it as
`sitecustomize`; it then leaves the rank as torchrun's would be, and as a user's own
`sitecustomize` expects:
- it takes its folder off `sys.path` and PYTHONPATH again (what the script and its child
  processes see is what the job's process had);
- it registers faulthandler's dump on `DUMP_SIGNAL` to the rank's stderr, and notes this
  process as one that dumps (`_shared.stop_files`), as a task's rank does: the job's process
  asks it for its stack when it stops it past `job_timeout`;
- it runs the environment's own `sitecustomize`, if there is one, in its place.
Nothing here may fail the rank: without the launcher's package (a `PYTHON_EXEC` of another
environment) the rank runs as before, without a stack to show.
"""

import importlib.machinery
import importlib.util
import os
import sys

# (`_shared.stop_files.STACK_HOOK_ENV`: this file reads it before it may import the package)
STACK_HOOK_ENV = "HYDRA_TORCHRUN_STACK_HOOK"


def _leave_no_trace() -> None:
    """This folder off sys.path and off PYTHONPATH, where the exec stage put it first."""
    here = os.environ.pop(STACK_HOOK_ENV, None)
    if here is None:
        return
    sys.path[:] = [entry for entry in sys.path if entry != here]
    value = os.environ.get("PYTHONPATH", "")
    if value == here:
        del os.environ["PYTHONPATH"]
    elif value.startswith(here + os.pathsep):
        os.environ["PYTHONPATH"] = value[len(here) + 1 :]


def _dump_stack_on_request() -> None:
    import faulthandler

    try:
        from hydra_plugins.hydra_torchrun_launcher._shared.stop_files import DUMP_SIGNAL, note_rank_process
    except ImportError:
        return  # another environment's python: no stack to show, as before
    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, RuntimeError, ValueError):
        return  # no usable stderr: the rank is named without its stack
    note_rank_process(dumps=True)


def _run_the_environments_own() -> None:
    """The `sitecustomize` this one stands before, run as Python would have run it."""
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # (Python's import keeps it there after this one)
    spec.loader.exec_module(module)


_leave_no_trace()
_dump_stack_on_request()
_run_the_environments_own()
