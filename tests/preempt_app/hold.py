"""A Hydra callback that holds the sweep at the end of one job until the stop signal reached it.

`on_job_end` runs in the job's own process, after its ranks ended: while it waits, the sweep
stands at the boundary between this job and the next. It marks `held_after_<job>` in the
sweep dir, then returns only once the launcher has forwarded its stop signal to this process
(the launcher has then handled the signal), so the test knows the signal came between jobs
without racing the launcher's start of the next job.
"""

import signal
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

WAIT_S = 120


class HoldAfterJob(Callback):
    def __init__(self, job: int) -> None:
        self.job = job

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.job.num != self.job:
            return
        forwarded = []
        previous = signal.getsignal(signal.SIGUSR2)

        def note(signum: int, frame: Any) -> None:
            forwarded.append(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGUSR2, note)
        try:
            sweep_dir = Path(config.hydra.runtime.output_dir).parent
            (sweep_dir / f"held_after_{self.job}").touch()
            deadline = time.monotonic() + WAIT_S
            while not forwarded:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {self.job}: no stop signal reached its process")
                time.sleep(0.05)
        finally:
            signal.signal(signal.SIGUSR2, previous)
