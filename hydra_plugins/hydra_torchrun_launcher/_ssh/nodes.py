"""A multi-host job's request for each of its nodes, made on the head from its first node's.

The head makes the job's request once (`JobEvents.request`: its first node's, which writes
the job's `.hydra/` files and fires Hydra's callbacks) and derives each other node's from
it, as `_submit.node` does on a SLURM node: its node rank, its environment and devices, and
no bookkeeping (no `.hydra/` files, no callbacks: they run once per job, on its first node).
Imported by the job processes on the hosts too (the callbacks' class is unpickled there), so
it imports nothing of the launcher process.
"""

import dataclasses
from typing import Any, Dict, List, Optional

from .._job.process import decode_request, encode_request


class NoCallbacks:
    """Hydra's callbacks as a node other than a job's first sees them: none. Duck-typed:
    run_job calls `on_job_start` and `on_job_end`."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def node_request(
    first: bytes,
    node: int,
    environ: Dict[str, str],
    devices: Optional[List[str]],
    host: str,
    deadline: Optional[float],
    console_label: str,
) -> bytes:
    """Node `node`'s request, on `host`, from the job's first node's (`first`, encoded); the
    job's deadline in the host's clock; what its ranks' lines start with on the head's console."""
    request = decode_request(first)
    plan = request.plan
    plan.deadline = deadline
    plan.console_label = console_label
    conf = dataclasses.replace(plan.settings.conf, node_rank=node)
    plan.settings = dataclasses.replace(plan.settings, conf=conf)
    plan.node_slot = node
    plan.host = host
    request.environ = environ
    request.devices = devices
    request.bookkeeping = False
    request.hydra_context = dataclasses.replace(request.hydra_context, callbacks=NoCallbacks())
    return encode_request(request)
