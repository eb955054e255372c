"""The launcher Hydra instantiates for `hydra/launcher=torchrun`.

Hydra's discovery imports this module on every run, so torch (and everything that needs
it) is imported only when a sweep is launched. Hydra 1.4 may load it alone, through the
`hydra.plugins` entry point: it imports `config`, which registers `hydra/launcher=torchrun`.
"""

import logging
from typing import Any, Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from . import config as config  # noqa: F401  (registers the launcher's config)

log = logging.getLogger(__name__)


class TorchrunLauncher(Launcher):
    # whether the launcher takes its stop signal as a preemption notice from `setup` on
    takes_stop_notice = True
    # whether the launcher's jobs are forked by its warm server (started at `setup`)
    uses_warm_server = True

    def __init__(self, **params: Any) -> None:
        # the per-job settings come from each job's composed config, not from here
        self.params = params
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None
        # the sweep's progress and outcomes (`_launcher.report.SweepReport`), made at the first launch
        self.report: Any = None
        # the sweep's stop notice (`_launcher.preempt.StopNotice`), installed at setup
        self.notice: Any = None
        # composes the sweep's job configs (`_launcher.sweep_configs.SweepConfigs`), across batches
        self.sweep_configs: Any = None
        # what the warm server imports besides torch (`preload`), chosen when it was started
        self.preload: Optional[tuple[str, ...]] = None
        # whether the one-line Ctrl-C/SIGTERM handlers of the sweep are installed (at setup)
        self._stops_handled = False

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        self._handle_stops_while_no_job_runs()
        if self.notice is None and self.takes_stop_notice:
            # the stop signal is a notice from now on, for the whole sweep: one that comes while
            # the sweeper validates its first batch ends the sweep preempted, not killed
            from ._launcher.preempt import sweep_notice, sweep_stop_signal

            self.notice = sweep_notice(None, sweep_stop_signal(config), hydra_context.callbacks)
        if self.uses_warm_server:
            self._start_warm_server()

    def _handle_stops_while_no_job_runs(self) -> None:
        """Ctrl-C or SIGTERM before, between or after the jobs: one line, not a traceback."""
        if self._stops_handled:
            return
        self._stops_handled = True
        from ._launcher.preempt import handle_stops_while_no_job_runs

        callbacks = self.hydra_context.callbacks if self.hydra_context is not None else None
        handle_stops_while_no_job_runs(self, callbacks)

    def _start_warm_server(self) -> None:
        """Start the warm server once, at set-up: its imports (torch, the app's packages) then
        overlap with what the launcher does before the first job starts (the sweeper composes
        and checks every job of its batch before `launch`, `launch` composes them again)."""
        if self.preload is not None:
            return
        from ._launcher.preload import preload_modules
        from ._server.server import warm_server

        self.preload = preload_modules(self.params.get("preload", "auto"))
        if self.params.get("dry_run") is not True:
            warm_server(self.preload)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        self._start_warm_server()  # Hydra's sweepers call `setup` first; a caller that did not
        from ._launcher import driver
        from ._launcher.local_runner import LocalRunner

        assert self.preload is not None
        return driver.launch(self, job_overrides, initial_job_idx, LocalRunner(self, self.preload))


class TorchrunSlurmLauncher(TorchrunLauncher):
    """`hydra/launcher=torchrun_slurm`: each job submitted to SLURM from a login node, one
    task per node running the job's elastic agent there (`_submit.slurm_runner`)."""

    # no stop notice here: the stop signal is SLURM's to send to the jobs' nodes, and a
    # launcher on a login node keeps its default dispositions
    takes_stop_notice = False
    # each node starts its own job process from a fresh interpreter (`_submit.node`)
    uses_warm_server = False

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ._launcher import driver
        from ._submit.slurm_runner import SlurmRunner

        return driver.launch(self, job_overrides, initial_job_idx, SlurmRunner(self))


class TorchrunSshLauncher(TorchrunLauncher):
    """`hydra/launcher=torchrun_ssh`: every sweep job on `nodes` of a few hosts, over ssh,
    each host's agent started once for the sweep (`_ssh.ssh_runner`)."""

    # each host's agent starts a warm server of its own there
    uses_warm_server = False

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ._launcher import driver
        from ._ssh.ssh_runner import SshRunner

        return driver.launch(self, job_overrides, initial_job_idx, SshRunner(self))
