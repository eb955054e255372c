"""The nodes of a multi-node job leave its rendezvous store in order: its host last.

torch's c10d rendezvous keeps its store (a TCPStore server) in the agent of one node, the
host. When the job ends, every agent meets the others at an exit barrier on that store,
then writes the rendezvous's closed state to it; the host's agent returns as soon as it
is through, and its store goes with it. An agent on another node that is a moment behind
(still waiting at the barrier, or closing the rendezvous) then loses its connection, and
torch prints a C++ stack trace and an "Error waiting on exit barrier" traceback on that
node, after every job, although every rank did its work.

Here the job process keeps the rendezvous handler (and with it the host's store) alive
after the agent returns (`keep_rendezvous_handlers`, installed through torch's public
registry), and every node, once its agent has returned, counts itself out in the store;
the node whose process hosts the store waits until every node has (at most
`LEAVE_TIMEOUT_S`) and only then lets its store go, when the job process exits.

A job past its `job_timeout` leaves in the same order (`leave_after_deadline`): its nodes
share one deadline, and each stops its ranks there; a node whose ranks had ended before it
(waiting at the exit barrier for the others) would otherwise be done first, and if it hosts
the store, the others' agents lose it as they close the rendezvous. Its host waits for the
others for as long as their ranks' shutdown may take, not `LEAVE_TIMEOUT_S`.

On the way out the nodes also share global rank 0's return value: the node that ran rank 0
puts it into the store, every other node takes it before it counts itself out, so every
node's launcher hands its sweeper the same JobReturn, whichever node held rank 0 (with
c10d, that changes from job to job). The static backend's store (node 0's, at
`master_addr:master_port`) serves the same way.
"""

import logging
import os
import time
from datetime import timedelta
from typing import Any, List, Optional

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 30.0
_POLL_S = 0.02
# torch's c10d rendezvous port when the endpoint has none
DEFAULT_PORT = 29400

KEPT_HANDLERS: List[Any] = []


def keep_rendezvous_handlers() -> None:
    """Hold every rendezvous handler the agent creates, so the store it hosts outlives it."""
    from torch.distributed.elastic.rendezvous import registry

    create = getattr(registry, "get_rendezvous_handler", None)
    if create is None:
        return  # a torch that builds handlers some other way: the nodes leave as torch has them

    def get_rendezvous_handler(params: Any) -> Any:
        handler = create(params)
        KEPT_HANDLERS.append(handler)
        return handler

    registry.get_rendezvous_handler = get_rendezvous_handler


def leave_together(
    backend: str, endpoint: str, run_id: str, nodes: int, rank0_value: Optional[bytes]
) -> Optional[bytes]:
    """Share global rank 0's value (pickled; given by the node that ran rank 0, None on the
    others) and count this node out of the job's store; the node hosting it waits for all
    `nodes`. Returns rank 0's value, pickled, on every node; None where it could not be had
    (then the node keeps its own, and says so)."""
    return _leave(backend, endpoint, run_id, nodes, LEAVE_TIMEOUT_S, share=True, rank0_value=rank0_value)


def leave_after_deadline(backend: str, endpoint: str, run_id: str, nodes: int, wait_s: float) -> None:
    """Count this node out of the job's store after it stopped its ranks at the job's deadline;
    the node hosting it waits for all `nodes`, at most `wait_s`. No value is shared."""
    _leave(backend, endpoint, run_id, nodes, wait_s, share=False, rank0_value=None)


def _leave(
    backend: str,
    endpoint: str,
    run_id: str,
    nodes: int,
    wait_s: float,
    share: bool,
    rank0_value: Optional[bytes],
) -> Optional[bytes]:
    if backend not in ("c10d", "static") or nodes <= 1 or not KEPT_HANDLERS:
        return rank0_value
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    hosting = listens_on(port)
    key = f"hydra_torchrun/left/{run_id}"
    value_key = f"hydra_torchrun/rank0_value/{run_id}"
    shared = rank0_value
    try:
        # (a store already gone is retried for as long, then given up)
        timeout = timedelta(seconds=wait_s)
        store = TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        if share and rank0_value is not None:
            store.set(value_key, rank0_value)
        elif share:
            shared = store.get(value_key)  # waits for it, at most wait_s
        left = store.add(key, 1)
        deadline = time.monotonic() + wait_s
        while hosting and left < nodes and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            left = store.add(key, 0)
    except RuntimeError as e:  # torch's DistError family: the store is gone already
        if hosting or shared is None:
            log.warning(f"the rendezvous store of job {run_id} failed before every node had left it: {e}")
        return shared
    if hosting and left < nodes:
        log.warning(
            f"{nodes - left} node(s) of job {run_id} had not left its rendezvous after "
            f"{wait_s:g}s; its store closes now"
        )
    return shared


def listens_on(port: int) -> Optional[bool]:
    """Whether this process has a listening TCP socket on `port` (Linux's /proc)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    inodes = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd of the listing itself, closed by now
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:
                return True
    return False
