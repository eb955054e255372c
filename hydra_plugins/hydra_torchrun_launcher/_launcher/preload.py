"""What the warm server imports once per sweep (`preload`), chosen in the launcher process.

`auto` looks at what the app has imported by the time the sweep launches, which only the
launcher process can see; the server (`_server.server`) is then started with the list.
"""

import os
import site
import sys
import sysconfig
from typing import Any, FrozenSet, Iterable

from .._shared.plan import JobPlan
from .._shared.stop_files import RESUMED_ENV, STOP_FILE_ENV
from .settings import check_preload

# what torch's elastic agent sets in every rank, and the launcher in every job: a preloaded
# import that read one would hand every rank the warm server's value (`_server.watch`)
PER_RANK_OR_JOB: FrozenSet[str] = frozenset(
    {
        *("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
        *("ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
        *("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"),
        *("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        *("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", STOP_FILE_ENV, RESUMED_ENV),
    }
)


def varying_variables(plans: Iterable[JobPlan]) -> FrozenSet[str]:
    """The variables that differ per rank or per job in this sweep: torch's, ours, env_set's."""
    return PER_RANK_OR_JOB | {key for plan in plans for key in plan.env_set}


# imported by the warm server in any case, or never worth preloading
_NOT_PRELOADED = frozenset(
    {"torch", "hydra", "omegaconf", "hydra_plugins", "cloudpickle", "pytest", "pip", "setuptools"}
)


def preload_modules(value: Any) -> "tuple[str, ...]":
    """The modules the warm server imports besides torch (see the `preload` key).

    `auto`: the top-level packages, installed in site-packages, that the app has imported
    by now (Lightning, transformers, ...). The app's own modules are not taken: they are
    cheap to import, and may read torchrun's variables at import, which ranks must see.
    """
    check_preload(value)
    if value != "auto":
        return tuple(value)
    roots = tuple(
        os.path.join(path, "")
        for path in {*site.getsitepackages(), site.getusersitepackages(), *sysconfig.get_paths().values()}
        if "site-packages" in path or "dist-packages" in path
    )
    names = set()
    for name, module in list(sys.modules.items()):
        if "." in name or name.startswith("_") or name in _NOT_PRELOADED:
            continue
        origin = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(
            module, "__file__", None
        )
        if isinstance(origin, str) and origin.startswith(roots):
            names.add(name)
    return tuple(sorted(names))
