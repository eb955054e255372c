"""MPI: one launcher per node started by `mpirun` (Open MPI or MPICH), each one node.

`mpirun -np 2 --map-by ppr:1:node python app.py -m ...` starts one launcher per node; each
takes its node rank and the node count from MPI's variables: Open MPI's
OMPI_COMM_WORLD_RANK/SIZE (and _LOCAL_SIZE, the launchers on this host), MPICH's (Hydra's)
PMI_RANK/PMI_SIZE (and MPI_LOCALNRANKS). The ranks then meet in a c10d rendezvous.

Where the rendezvous is: MPI does not tell a process the host of rank 0, unless every
launcher runs on this very host (local size = world size); elsewhere the user names it
(master_addr, or rdzv_endpoint). The port is derived from the MPI job's id, which every
launcher of the job shares (Open MPI 4's OMPI_MCA_ess_base_jobid, a PMIx namespace).

jsrun (LSF) starts its tasks through PMIx as well and sets some of these variables next
to its own JSM_NAMESPACE_*: those tasks are LSF's (`cluster_lsf`), not MPI's.
"""

from typing import Mapping, Optional

from .._shared.config_error import LauncherConfigError
from .cluster_layout import ClusterLayout, Detection, derived_port, first_var, int_var

# (world rank, world size, launchers on this host) of each MPI family, first found wins
_FAMILIES = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
)
_JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
_START = "`mpirun -np <nodes> --map-by ppr:1:node python app.py --multirun ...`"


def present(environ: Mapping[str, str]) -> Optional[str]:
    """A few words naming the MPI job this process is a rank of, or None (jsrun's are LSF's)."""
    if environ.get("JSM_NAMESPACE_SIZE"):
        return None
    family = _family(environ)
    if family is None:
        return None
    shown = family[2] if environ.get(family[2]) else family[1]
    return f"an {family[0]} job ({shown}={environ[shown]})"


def inspect(required: bool, environ: Mapping[str, str]) -> Detection:
    """The layout of the mpirun job this launcher is a rank of; `required` (cluster: mpi):
    not being one is an error."""
    family = _family(environ)
    if family is None:
        if required:
            raise LauncherConfigError(
                "hydra.launcher.cluster=mpi needs the launcher to run under mpirun, one per node: neither "
                f"OMPI_COMM_WORLD_SIZE (Open MPI) nor PMI_SIZE (MPICH) is set; start it with {_START}"
            )
        return Detection(None, None)
    name, rank_var, size_var, local_var = family
    for given, missing in ((rank_var, size_var), (size_var, rank_var)):
        if not environ.get(missing):
            raise LauncherConfigError(
                f"{given} is set but {missing} is not: half of an {name} job's variables; "
                "set hydra.launcher.cluster=none to ignore MPI"
            )
    size = int_var(environ, size_var, "MPI")
    rank = int_var(environ, rank_var, "MPI")
    if not 0 <= rank < size:
        raise LauncherConfigError(
            f"{rank_var}={rank} is not a rank of {size_var}={size}; "
            "set hydra.launcher.cluster=none to ignore MPI"
        )
    local = int_var(environ, local_var, "MPI") if environ.get(local_var) else None
    job_var = first_var(environ, *_JOB_ID_VARS)
    job_id = environ[job_var] if job_var else ""
    where = f"{name} job{' ' + job_id if job_id else ''}: {size} launcher(s), this is launcher {rank}"
    if size == 1:
        return Detection(None, f"{where}: a single launcher, running single-node")
    one_host = local == size
    if one_host:
        where += ", all on this host"
    elif local is not None and local > 1:
        where += f", {local} of them on this host (one per node: --map-by ppr:1:node)"
    layout = ClusterLayout(
        source="MPI",
        nnodes=size,
        node_rank=rank,
        # every launcher is here: so is launcher 0, the rendezvous host
        master_addr="127.0.0.1" if one_host else None,
        port=derived_port(f"mpi-{job_id}") if job_id else None,
        rdzv_id=f"mpi-{job_id}" if job_id else None,
        description=where,
        job_id=job_id,
    )
    return Detection(layout, where)


def _family(environ: Mapping[str, str]) -> Optional[tuple]:
    """The MPI family whose world rank or size is set (one without the other is refused)."""
    return next((family for family in _FAMILIES if environ.get(family[1]) or environ.get(family[2])), None)
