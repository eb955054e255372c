"""A rank that runs as a real process: a training script, or a task under a launch prefix.

    python -m hydra_plugins.hydra_torchrun_launcher._rank.main exec SPEC.json
        put the rank into `{rank}` / `{local_rank}` of the
        command, then exec it (same pid, so the agent's signals reach the real program); a
        training script's Python starts with `stack_hook/sitecustomize.py` first
    python -m hydra_plugins.hydra_torchrun_launcher._rank.main task PAYLOAD RETURN_DIR
        run the task function from a payload file, as `_rank.worker.run_rank` does in-process

The files live in a private directory (0700, files 0600) of the launcher's and are removed
after the job. The `exec` stage imports nothing heavy: it runs once per rank before the
real program starts.
"""

import json
import os
import signal
import sys
from typing import Dict, List

from hydra_plugins.hydra_torchrun_launcher._shared.lifetime import die_with_parent
from hydra_plugins.hydra_torchrun_launcher._shared.stop_files import (
    STACK_HOOK_ENV,
    note_rank_process,
    note_rank_started,
)


def substitute_rank(args: List[str], environ: Dict[str, str]) -> List[str]:
    """`{rank}` and `{local_rank}` in each argument, from torch elastic's RANK / LOCAL_RANK."""
    values = {"{rank}": environ.get("RANK", "0"), "{local_rank}": environ.get("LOCAL_RANK", "0")}
    out = []
    for arg in args:
        for token, value in values.items():
            arg = arg.replace(token, value)
        out.append(arg)
    return out


def _exec(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    die_with_parent()
    if spec.get("ignore_signal"):
        # the stop signal is the job process's to act on (SLURM sends it to every process)
        signal.signal(spec["ignore_signal"], signal.SIG_IGN)
    note_rank_started()
    note_rank_process(dumps=False)  # this pid runs the rank's program: a script, or a prefix
    if spec.get("stack_hook"):
        _hook_stack_dump()
    command = substitute_rank(spec["command"], dict(os.environ))
    os.execvp(command[0], command)


def _hook_stack_dump() -> None:
    """The Python that runs the training script starts with `stack_hook/sitecustomize.py`,
    which registers its stack dump (as a task's rank does) and notes its own pid as the one
    that dumps (a launch prefix's program may start it as a child of this pid)."""
    hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stack_hook")
    path = os.environ.get("PYTHONPATH")
    os.environ[STACK_HOOK_ENV] = hook
    os.environ["PYTHONPATH"] = hook if path is None else hook + os.pathsep + path


def _task(payload_path: str, return_dir: str) -> None:
    import cloudpickle
    from torch.distributed.elastic.multiprocessing.errors import record

    from hydra_plugins.hydra_torchrun_launcher._rank.worker import run_rank

    with open(payload_path, "rb") as f:
        sys_path, payload = cloudpickle.load(f)
    pickled = record(run_rank)(sys_path, payload)
    if pickled is not None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        path = os.path.join(return_dir, f"return_{attempt}_{os.environ.get('RANK', '0')}.pkl")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pickled)


if __name__ == "__main__":
    stage, *rest = sys.argv[1:]
    if stage == "exec":
        _exec(*rest)
    elif stage == "task":
        _task(*rest)
    else:
        sys.exit(f"unknown stage {stage!r}")
