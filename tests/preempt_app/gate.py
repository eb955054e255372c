"""A job callback that holds `on_job_start` until the test says go (GATE_DIR/go), so that a
stop signal can be sent while a job's callback runs, before any of its ranks starts."""

import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

_WAIT_S = 120.0


class HoldOnJobStart(Callback):
    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        gate = Path(os.environ["GATE_DIR"])
        (gate / "in_callback").touch()
        deadline = time.monotonic() + _WAIT_S
        while not (gate / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
