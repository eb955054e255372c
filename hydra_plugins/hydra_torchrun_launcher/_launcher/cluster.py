"""`cluster`: nnodes, node_rank and the rendezvous from the environment a scheduler made.

`auto` looks, in this order, for SLURM (an srun step, `cluster_slurm`), torchrun's own PET_*
variables (Kubernetes: Kubeflow's PyTorchJob and TrainJob, `cluster_pet`), MPI (mpirun,
`cluster_mpi`) and LSF (jsrun, `cluster_lsf`); the first that gives this node a place in a
world is used, and one line says what was found. `slurm`, `pet`, `mpi`, `lsf` require that
one (not finding it is an error); `none` looks at nothing.

What a scheduler gives fills the keys the user left alone: a key the user set wins. Pure
functions over an environ mapping (and, for PET_*, which variables the installed torchrun
reads): unit-testable anywhere.
"""

import dataclasses
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Tuple

from .._shared.config_error import LauncherConfigError
from .._shared.plan import JobSettings
from ..config import TorchrunLauncherConf
from . import cluster_lsf, cluster_mpi, cluster_pet, cluster_slurm
from .cluster_layout import PORT_BASE, PORT_SPAN, ClusterLayout, Detection, derived_port
from .settings import CLUSTERS, parse_nnodes

__all__ = [
    "PORT_BASE",
    "PORT_SPAN",
    "ClusterLayout",
    "Detection",
    "apply_layout",
    "derived_port",
    "detect",
    "inspect_environment",
    "resolve_cluster",
]

# the environments `auto` looks for, in its order
ENVIRONMENTS = (("slurm", cluster_slurm), ("pet", cluster_pet), ("mpi", cluster_mpi), ("lsf", cluster_lsf))


def detect(cluster: str, environ: Mapping[str, str]) -> Optional[ClusterLayout]:
    """The multi-node layout a scheduler gives this process, or None (single-node, or PET_*)."""
    return inspect_environment(cluster, environ).layout


def inspect_environment(cluster: str, environ: Mapping[str, str]) -> Detection:
    """What `cluster` finds here; raise LauncherConfigError where it cannot be used safely."""
    if cluster not in CLUSTERS:
        raise LauncherConfigError(
            f"hydra.launcher.cluster={cluster!r} is invalid: use one of {', '.join(CLUSTERS)}"
        )
    if cluster == "none":
        found = [words for _, module in ENVIRONMENTS if (words := module.present(environ))]
        return Detection(None, f"{', '.join(found)} ignored (hydra.launcher.cluster=none)" if found else None)
    if cluster != "auto":
        return dict(ENVIRONMENTS)[cluster].inspect(True, environ)
    notes: List[str] = []
    for _, module in ENVIRONMENTS:
        if not module.present(environ):
            continue
        found = module.inspect(False, environ)
        if found.layout is not None or found.pet is not None:
            return found if not notes else dataclasses.replace(found, note=_joined(notes, found.note))
        if found.note:
            notes.append(found.note)
    return Detection(None, "; ".join(notes) if notes else None)


def apply_layout(
    conf: TorchrunLauncherConf, layout: ClusterLayout, user_set: AbstractSet[str] = frozenset()
) -> TorchrunLauncherConf:
    """A copy of `conf` whose keys still at the plugin's default take the detected values.

    nnodes, node_rank and rdzv_id come from the scheduler; rdzv_backend static (the
    default) becomes c10d; an empty rdzv_endpoint of c10d becomes master_addr:master_port,
    each the user's where set, else node 0's host and the port derived from the job's id.
    `standalone: true` keeps the job single-node (nothing changes). A key in `user_set`
    (the user gave it, e.g. `hydra.launcher.nnodes=1`) is the user's even when it equals
    the default.
    """
    return dataclasses.replace(conf, **_detected_values(conf, layout, user_set))


def resolve_cluster(
    settings: JobSettings, environ: Mapping[str, str], user_set: AbstractSet[str] = frozenset()
) -> Tuple[JobSettings, Optional[str]]:
    """A job's settings with what `cluster` detects applied, and the one line to log (or None)."""
    conf = settings.conf
    detection = inspect_environment(conf.cluster, environ)
    if detection.pet is not None:
        resolved, line = cluster_pet.resolve(settings, detection.pet, environ, user_set)
        return resolved, _joined([detection.note] if detection.note else [], line)
    if detection.layout is None:
        return settings, detection.note
    if conf.standalone:
        return settings, f"{detection.note}; hydra.launcher.standalone=true: running single-node"
    taken = _detected_values(conf, detection.layout, user_set)
    new = dataclasses.replace(conf, **taken)
    min_nodes, max_nodes = parse_nnodes(new.nnodes)
    used = ", ".join(
        f"{key}={getattr(new, key)}" + ("" if key in taken else " (yours)")
        for key in ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id")
    )
    line = f"{detection.note}; using {used}"
    return dataclasses.replace(settings, conf=new, min_nodes=min_nodes, max_nodes=max_nodes), line


def _detected_values(
    conf: TorchrunLauncherConf, layout: ClusterLayout, user_set: AbstractSet[str] = frozenset()
) -> Dict[str, Any]:
    """The keys of `conf` the user left alone, with the values the scheduler gives them."""
    if conf.standalone:
        return {}
    default = TorchrunLauncherConf()

    def left_alone(key: str) -> bool:
        return key not in user_set and str(getattr(conf, key)) == str(getattr(default, key))

    taken: Dict[str, Any] = {}
    if left_alone("nnodes"):
        taken["nnodes"] = layout.nnodes
    if left_alone("node_rank"):
        taken["node_rank"] = layout.node_rank
    if left_alone("rdzv_id") and layout.rdzv_id is not None:
        taken["rdzv_id"] = layout.rdzv_id
    backend = conf.rdzv_backend
    if left_alone("rdzv_backend"):
        backend = taken["rdzv_backend"] = "c10d"
    if backend == "c10d" and not conf.rdzv_endpoint:
        host = layout.master_addr if left_alone("master_addr") else conf.master_addr
        port = conf.master_port if conf.master_port is not None else layout.port
        if host is None:
            raise LauncherConfigError(
                f"{layout.description}: {layout.source}'s variables do not say which host node 0 is "
                f"(the rendezvous host); set hydra.launcher.master_addr to it "
                f"(or hydra.launcher.rdzv_endpoint=host:port)"
            )
        if port is None:
            raise LauncherConfigError(
                f"{layout.description}: {layout.source}'s variables hold no job id every node shares to "
                f"derive the rendezvous port from; set hydra.launcher.master_port "
                f"(or hydra.launcher.rdzv_endpoint=host:port)"
            )
        taken["rdzv_endpoint"] = f"{host}:{port}"
    return taken


def _joined(notes: List[str], line: Optional[str]) -> str:
    return "; ".join([*notes, *([line] if line else [])])
