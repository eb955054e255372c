"""Imported once by the forkserver that forks every rank: the work ranks would all repeat.

torch's import (seconds) and Hydra's plugin scan (tenths of a second: it imports every
module under `hydra_plugins`) happen here once per sweep; each rank inherits the result.
The scan is only reused by a rank whose plugin search path is the one scanned here.
"""

import torch  # noqa: F401
import torch.distributed.elastic.multiprocessing  # noqa: F401
from hydra.core.plugins import Plugins

from . import _worker  # noqa: F401

PLUGINS = Plugins.instance()
SCANNED_PATH = list(getattr(__import__("hydra_plugins"), "__path__", []))
