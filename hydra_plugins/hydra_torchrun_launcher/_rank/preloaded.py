"""What a rank redoes of a preloaded module's import: the variables it read, read again.

A package the warm server preloaded was imported before any rank existed. One whose import
reads a variable that differs per rank (RANK, LOCAL_RANK, ...) would keep the server's
value in every rank, so the launcher leaves it out of the preload (`_server.watch`) and the
ranks import it themselves. For a few widely used modules the launcher knows exactly what
the import derived from those variables, and redoes that in each rank, the way the module
does it, before the app's script runs: they stay warm. The server's watch checks that such
a module reads nothing more than listed here; if a release reads more, it is left out.
"""

import os
import sys
from typing import Callable, Dict, FrozenSet, Tuple


def _lightning_rank_zero(module: object) -> None:
    # lightning/fabric/utilities/rank_zero.py: rank_zero_only.rank = _get_rank() or 0
    # (its rank_zero_only is lightning_utilities' own object: one attribute for both)
    get_rank = getattr(module, "_get_rank", None)
    rank = get_rank() if callable(get_rank) else None
    module.rank_zero_only.rank = rank or 0  # type: ignore[attr-defined]


def _torchmetrics_prints(module: object) -> None:
    # torchmetrics/utilities/prints.py: rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))
    module.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))  # type: ignore[attr-defined]


# module -> (the variables its import reads, how a rank redoes what it derived from them)
REDONE_IN_RANK: Dict[str, Tuple[FrozenSet[str], Callable[[object], None]]] = {
    "lightning.fabric.utilities.rank_zero": (
        frozenset({"RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"}),
        _lightning_rank_zero,
    ),
    "torchmetrics.utilities.prints": (frozenset({"LOCAL_RANK"}), _torchmetrics_prints),
}


def redo_reads_at_import() -> None:
    """In a rank, before the app's script: redo what preloaded modules read at import."""
    for name, (_, redo) in REDONE_IN_RANK.items():
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "rank_zero_only"):
            redo(module)
