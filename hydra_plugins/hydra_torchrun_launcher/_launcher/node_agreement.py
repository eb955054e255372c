"""The nodes of a multi-node sweep agree on what to resume, through torch's rendezvous.

Each node keeps its own record of the sweep (its own sweep dir, often its own disk), and a
node can miss the end of a job another node recorded: SLURM's requeue may end it a moment
too early. A job skipped as completed on one node but run on another would leave the
other waiting in a rendezvous nobody joins. So before a resumed launch every node
publishes what its record says, through a rendezvous of torch's own (the sweep's backend
and endpoint, an id of its own), and all take the same answer: a job is completed only
where every node's record says so; it continues as preempted where any node's says so.
The node that hosts the rendezvous store lets it go last (as `_job.node_exit` does for jobs),
and before the first job's agent needs the endpoint's port.
"""

import json
import time
from typing import Any, Dict, List, Set

from .._job.node_exit import DEFAULT_PORT, listens_on
from .._shared.config_error import LauncherConfigError

AGREE_TIMEOUT_S = 300.0
_POLL_S = 0.02


def waiting_for_nodes(plan: Any) -> str:
    """What a multi-node sweep waits for, said at once: a node that never comes is seen."""
    settings, rendezvous = plan.settings, plan.rendezvous
    nodes = str(settings.max_nodes) if settings.min_nodes == settings.max_nodes else settings.conf.nnodes
    return (
        f"Multi-node sweep: every job waits for {nodes} nodes at {rendezvous.endpoint} "
        f"({rendezvous.backend} rendezvous, id {rendezvous.run_id.rsplit('_', 1)[0]}_<job>); "
        "run the same command on every node"
    )


def agree_on_resumption(plan: Any, completed: Set[int], preempted: Set[int]) -> "tuple[Set[int], Set[int]]":
    """(completed on every node, preempted on any node), from each node's `completed` and
    `preempted`; `plan` is the launch's first job plan (its settings and rendezvous)."""
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        views = _exchange(plan, {"completed": sorted(completed), "preempted": sorted(preempted)})
    except RendezvousError as e:
        rendezvous, settings = plan.rendezvous, plan.settings
        raise LauncherConfigError(
            f"the nodes did not meet to agree on what to resume ({type(e).__name__}): waited for "
            f"{settings.max_nodes} nodes at {rendezvous.endpoint} (id {rendezvous.run_id}_resume); run "
            "the same command on every node, or wait longer: hydra.launcher.rdzv_conf={join_timeout:SECONDS}"
        ) from None
    agreed_completed = set.intersection(*(set(view["completed"]) for view in views))
    agreed_preempted = set.union(*(set(view["preempted"]) for view in views)) - agreed_completed
    return agreed_completed, agreed_preempted


def _exchange(plan: Any, view: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every node's `view`, in node order, through one rendezvous of the sweep's backend."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    rendezvous, settings = plan.rendezvous, plan.settings
    params = RendezvousParameters(
        backend=rendezvous.backend,
        endpoint=rendezvous.endpoint,
        # never a job's id ("<base>_<num>"); a new one per launch of a batching sweeper
        run_id=f"{rendezvous.run_id}_resume",
        min_nodes=settings.min_nodes,
        max_nodes=settings.max_nodes,
        local_addr=settings.conf.local_addr,
        **rendezvous.configs,
    )
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    # torch >= 2.4 returns a RendezvousInfo; before, a (store, rank, world_size) tuple
    store, rank, world_size = (info.store, info.rank, info.world_size) if hasattr(info, "store") else info
    store.set(f"view/{rank}", json.dumps(view))
    keys = [f"view/{node}" for node in range(world_size)]
    store.wait(keys)
    views = [json.loads(store.get(key)) for key in keys]
    _, port = parse_rendezvous_endpoint(rendezvous.endpoint, default_port=DEFAULT_PORT)
    if listens_on(port):
        # the host: every other node has shut its handler down before it lets the store go
        deadline = time.monotonic() + AGREE_TIMEOUT_S
        while store.add("left", 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        handler.shutdown()
    else:
        handler.shutdown()
        store.add("left", 1)
    return views
