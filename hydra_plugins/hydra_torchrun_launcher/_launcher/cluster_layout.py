"""What a cluster environment says about this node's place in a multi-node world.

Shared by the detections of SLURM (`cluster_slurm`), MPI (`cluster_mpi`) and LSF
(`cluster_lsf`): each reads its scheduler's variables into one `ClusterLayout`, and
`cluster` applies it. Pure values, no torch.
"""

import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from .._shared.config_error import LauncherConfigError

# the rendezvous port when none is given: the same on every node of a job, different for
# other jobs; 20000-31999 stays below Linux's default ephemeral range (32768-60999)
PORT_BASE = 20000
PORT_SPAN = 12000


@dataclass(frozen=True)
class ClusterLayout:
    """This node's place in the job its scheduler started, as far as the variables tell."""

    # "SLURM", "MPI", "LSF": names the source in lines and errors
    source: str
    nnodes: int
    node_rank: int
    # host of node 0 (the rendezvous host); None where the variables cannot tell it
    master_addr: Optional[str]
    # the port derived from the job's id; None where there is no id every node shares
    port: Optional[int]
    # None: derived from the endpoint (`_job.launch_config.rendezvous_for`)
    rdzv_id: Optional[str]
    # what was detected, for the log
    description: str
    job_id: str = ""
    step_id: Optional[int] = None
    nodes: Tuple[str, ...] = field(default_factory=tuple)

    @property
    def rdzv_endpoint(self) -> Optional[str]:
        """master_addr:port, where both are known."""
        if self.master_addr is None or self.port is None:
            return None
        return f"{self.master_addr}:{self.port}"


@dataclass(frozen=True)
class Detection:
    """What `cluster` found: a layout to apply, torchrun's PET_* values to apply, or neither
    (run single-node); and a line saying so, for the log."""

    layout: Optional[ClusterLayout]
    # None when there is nothing to say (no cluster around, or cluster: none with none present)
    note: Optional[str]
    # PET_* values by launcher key: key -> (variable, its text, the value for the key)
    pet: Optional[Dict[str, Tuple[str, str, Any]]] = None


def derived_port(run: str) -> int:
    """A port every node of one job computes alike, and other jobs (likely) not; `run` names
    the job, e.g. "<job id>.<step id>[.restart<n>]" under SLURM, "mpi-<job id>"."""
    digest = hashlib.sha1(run.encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "big") % PORT_SPAN


def int_var(environ: Mapping[str, str], name: str, source: str) -> int:
    """A count or index from a scheduler's variable; an error naming it when it is not one."""
    value = environ.get(name, "")
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise LauncherConfigError(
            f"{name}={value!r} is not a count or index; set hydra.launcher.cluster=none to ignore {source}"
        )
    return number


def first_var(environ: Mapping[str, str], *names: str) -> Optional[str]:
    """The first of `names` that is set (and not empty), or None."""
    return next((name for name in names if environ.get(name)), None)
