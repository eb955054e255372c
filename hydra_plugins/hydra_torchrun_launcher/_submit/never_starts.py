"""Which pending reasons SLURM never lifts for a job: the launcher cancels such a job and
fails it with SLURM's reason at once, instead of waiting for ever.

Conservative: only the reasons squeue's JOB REASON CODES (and SLURM's resource limits page)
describe as the job's own request being outside a limit that applies to each job, never a
reason that lifts when other jobs end or nodes come back (Resources, Priority, NodeDown,
ReqNodeNotAvail, the aggregate `*Grp*` limits, job-count limits). PartitionNodeLimit (and
PartitionConfig, which SLURM shows first) also mean "the partition's nodes are down now":
they are final only when the job asks for more nodes than the partition has or allows.
"""

from typing import Callable, Optional

# the job's own request is outside its partition's time limit, its constraints match no
# node, its dependency can never be satisfied
_FINAL = {
    "PartitionTimeLimit": "its time limit exceeds its partition's (lower hydra.launcher.timeout_min)",
    "BadConstraints": "no node of its partition has its constraints (hydra.launcher.constraint)",
    "DependencyNeverSatisfied": "the job it depends on can never satisfy its dependency",
}
_NODE_COUNT = ("PartitionNodeLimit", "PartitionConfig")


def never_starts(reason: str, nodes: int, partition_nodes: Callable[[], Optional[int]]) -> Optional[str]:
    """Why a job pending for `reason` will never start (asking for `nodes` nodes), or None.
    `partition_nodes`: how many nodes its partition has at most (asked only when needed)."""
    if reason in _FINAL:
        return _FINAL[reason]
    # AssocMaxNodesPerJobLimit, QOSMaxWallDurationPerJobLimit, ...: a per-job limit of its
    # account or QOS (not AssocMaxJobsLimit & co.: those count running jobs and lift)
    if reason.startswith(("AssocMax", "QOSMax")) and "PerJob" in reason:
        return "it asks for more than its account's or QOS's limit for one job allows"
    if reason in _NODE_COUNT:
        most = partition_nodes()
        if most is not None and nodes > most:
            return f"it asks for {nodes} nodes (hydra.launcher.nodes) and its partition has at most {most}"
    return None
