"""A one-rank app whose sweeps the record tests run twice, changing one thing in between.

The task is chosen by TASK (`a` to `d`: functions of this file; `c` imports a module of the
project inside its body, `d` instantiates a class of the project the config names), calls the project's
own `helper` module, and fails on the job whose lr equals FAIL_AT (an outside cause that
goes away: the same sweep, resumed, retries it).
"""

import os
import signal
import sys
from pathlib import Path

import helper
import hydra
import hydra.errors
import hydra.utils
from omegaconf import DictConfig, OmegaConf

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}


def train_a(cfg: DictConfig) -> float:
    if str(cfg.lr) == os.environ.get("FAIL_AT"):
        raise ValueError(f"lr={cfg.lr} failed")
    print(f"rank {os.environ['RANK']}: train_a lr={cfg.lr}", flush=True)
    return helper.scale(cfg.lr)


def train_b(cfg: DictConfig) -> float:
    print(f"rank {os.environ['RANK']}: train_b lr={cfg.lr}", flush=True)
    return -helper.scale(cfg.lr)


def train_c(cfg: DictConfig) -> float:
    from late_helper import shift  # imported as the task runs, not when the app starts

    print(f"rank {os.environ['RANK']}: train_c lr={cfg.lr}", flush=True)
    return shift(cfg.lr)


def train_d(cfg: DictConfig) -> float:
    print(f"rank {os.environ['RANK']}: train_d lr={cfg.lr}", flush=True)
    return hydra.utils.instantiate(cfg.model)(cfg.lr)


_LAUNCHER_PID = os.getpid()


def _stop_at(num: str) -> str:
    """Resolved when the launcher composes a job (its env_set): sends the launcher its stop
    signal (or STOP_WITH), once, while it composes job number STOP_AT (as a preemption notice
    that comes at that moment would). `${stop_at:validate}` (in a key Hydra reads as it
    composes, such as the override_dirname separators) does it while the sweeper validates
    its first batch, before it launches any."""
    once = Path(os.environ.get("STOP_ONCE", "stopped_once"))
    at = os.environ.get("STOP_AT")
    if at == "validate" and not _validating():
        return "0"
    if os.getpid() == _LAUNCHER_PID and str(num) == at and not once.exists():
        once.touch()
        if os.environ.get("STOP_IN_FINALIZER"):
            _SignalInAFinalizer()  # dropped at once: its __del__ sends the signal
        else:
            os.kill(os.getpid(), getattr(signal, os.environ.get("STOP_WITH", "SIGUSR2")))
    return "0"


class _SignalInAFinalizer:
    """Sends the stop signal from its finalizer, whose exceptions Python prints and drops: the
    signal's handler runs there (at the call after the kill), as it may whenever a finalizer
    runs (a garbage collection) at the moment a Ctrl-C comes."""

    def __del__(self) -> None:
        os.kill(os.getpid(), getattr(signal, os.environ.get("STOP_WITH", "SIGUSR2")))
        _a_call()


def _a_call() -> None:
    """A Python call: where Python runs a pending signal's handler."""


def _validating() -> bool:
    """Whether Hydra's sweeper is validating a batch (composing its jobs) right now."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "validate_batch_is_legal":
            return True
        frame = frame.f_back
    return False


OmegaConf.register_new_resolver("stop_at", _stop_at)

TASK = {"a": train_a, "b": train_b, "c": train_c, "d": train_d}[os.environ.get("TASK", "a")]

if __name__ == "__main__":
    hydra.main(**VERSION_BASE, config_path=".", config_name="config")(TASK)()
