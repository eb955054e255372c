"""What a rank asks the launcher about preemption: should it stop now, is it resuming.

    from hydra_plugins.hydra_torchrun_launcher import preemption

    for step in range(start, steps):
        train_step()
        if preemption.should_stop():
            if rank == 0:
                save_checkpoint()
            return

When the launcher gets its `stop_signal` (SIGUSR2 unless configured otherwise: SLURM's
`--signal=USR2@120`, or `kill -USR2 <launcher pid>`), each job process it runs marks the
job's stop file; the ranks read it at their next `should_stop()` and agree, through one
small collective, so that the k-th call returns the same answer on every rank of the job
(on every node). The job then counts as preempted: it runs again, in the same job dir, when
the sweep resumes, and there `resumed()` is True (when its ranks had run).

This module imports no torch (Hydra imports it while discovering plugins); `should_stop()`
imports `torch.distributed` the first time a multi-rank job asks. Outside the launcher
both functions return False.
"""

import os
from typing import Any

from ._shared.stop_files import RESUMED_ENV, SEEN, stop_file, touch


class _Agreement:
    """The answer once it was True (it stays True), the gloo group the ranks agree over, and
    the all-reduce of the previous call, still in flight."""

    stopped = False
    group: Any = None
    pending: Any = None  # (work, tensor)


def should_stop() -> bool:
    """Whether the job has been asked to stop; the same answer on every rank at the same call.

    In a job of several ranks each call is a collective over a gloo group of the job's
    process group: every rank must call it at the same points, as any collective, and
    `torch.distributed` must be initialised. The ranks' flags travel in an all-reduce that
    each call starts and the next one reads, so the call does not wait for the network
    (the all-reduce runs while the rank trains) and a stop is seen one call later than it
    could be. Once True it stays True, with no further collective.
    """
    if _Agreement.stopped:
        return True
    path = stop_file()
    if path is None:
        return False
    asked = os.path.exists(path)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        asked = _agreed(asked)
    if asked:
        _Agreement.stopped = True
        # the job's process learns that its ranks stopped at a step boundary
        touch(path + SEEN)
    return asked


def resumed() -> bool:
    """Whether this job's ranks ran in an earlier run of the sweep, were stopped before they
    completed, and now continue in the same (recorded) job dir.

    Whatever they saved there (a checkpoint) is there, if they saved it: rank 0 may have been
    stopped first, so check that the file exists. A job stopped before any rank started (in
    its rendezvous, in an `on_job_start` callback), or that now runs in another job dir
    (`hydra.sweep.subdir` changed), is not resumed: it simply runs.
    """
    return os.environ.get(RESUMED_ENV) == "1"


def _agreed(asked: bool) -> bool:
    """Whether any rank was asked at the previous call (every rank reads the same all-reduce
    MAX); this call's flag goes out for the next one."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "preemption.should_stop() in a job of several ranks needs torch.distributed initialised "
            "(torch.distributed.init_process_group()): every rank must get the same answer"
        )
    group = _group(dist)
    agreed = False
    if _Agreement.pending is not None:
        work, flag = _Agreement.pending
        work.wait()
        agreed = bool(flag.item())
        _Agreement.pending = None
    if not agreed:
        flag = torch.tensor([1 if asked else 0], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        _Agreement.pending = (work, flag)
    return agreed


def _group(dist: Any) -> Any:
    """The job's default group when its backend is gloo (it takes CPU tensors), else a gloo
    group made once: a collective too, which every rank makes at its first call."""
    if _Agreement.group is None:
        if str(dist.get_backend()).lower() == "gloo":
            _Agreement.group = dist.group.WORLD
        else:
            _Agreement.group = dist.new_group(backend="gloo")
    return _Agreement.group
