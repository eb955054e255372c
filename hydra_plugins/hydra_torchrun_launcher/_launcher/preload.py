"""What the warm server imports once per sweep (`preload`), chosen in the launcher process.

`auto` looks at what the app has imported by the time the sweep launches, which only the
launcher process can see; the server (`_server.server`) is then started with the list.
"""

import os
import site
import sys
import sysconfig
from typing import Any

from .settings import check_preload

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
