"""The local runner: every sweep job in a process of its own on this node, forked from the
launcher's warm server (`_server.server`), where Hydra's `run_job` does the job's bookkeeping
and torch's elastic agent runs its ranks (`_job.process`). Up to `parallel_jobs` such
processes run at once (`_launcher.pool`); the same code path runs one at a time. On a
multi-node sweep, a launcher runs on every node, each running its node's part of each job.
"""

import logging
import os
import signal
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf

from .._job.launch_config import check_supported
from .._server.server import checked_warm_server
from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.plan import JobPlan, JobSettings
from .._shared.signals import ignored_group_signals
from .cluster import resolve_cluster
from .pool import run_jobs
from .preempt import StopNotice, sweep_notice, sweep_stop_signal
from .preload import varying_variables
from .report import jobs_counted
from .reproduce import dry_run_plan
from .runner import JobEvents, JobFeed
from .settings import check_node_rank, resolve_settings

log = logging.getLogger(__name__)

# keys that shape the whole sweep rather than one job: every job must agree on them
_SWEEP_WIDE_KEYS = ("parallel_jobs", "devices", "preload", "dry_run", "stop_signal", "requeue", "resume")


class LocalRunner:
    """`hydra/launcher=torchrun`'s runner (`_launcher.runner.Runner`)."""

    names_hosts = False

    def __init__(self, launcher: Any, preload: "tuple[str, ...]") -> None:
        self.preload = preload
        self.sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
        # installed at the launcher's setup, for the whole sweep: a notice while jobs are composed
        # or between a sweeper's batches ends the sweep preempted, as one while jobs run does
        self.notice: Optional[StopNotice] = sweep_notice(
            launcher.notice, sweep_stop_signal(launcher.config), launcher.hydra_context.callbacks
        )
        launcher.notice = self.notice
        self.parallel_jobs = 1
        self.devices: Optional[List[str]] = None

    def job_settings(self, config: DictConfig) -> "tuple[JobSettings, Optional[str]]":
        """The job's launcher settings (with what SLURM gives), checked; and the cluster log line."""
        settings = resolve_settings(config.hydra.launcher)
        settings, note = resolve_cluster(settings, os.environ, _keys_set(config))
        check_node_rank(settings)
        check_supported(settings)
        return settings, note

    def check_sweep(self, first: JobPlan) -> None:
        if first.payload.stop_signal == signal.SIGUSR1:
            log.warning(
                "hydra.launcher.stop_signal=SIGUSR1: NCCL may take SIGUSR1 in the ranks' processes for "
                "its own debugging dumps (NCCL_PROXY_DUMP_SIGNAL, torch's NCCL flight recorder); "
                "SIGUSR2 is the stop signal nothing else uses"
            )
        self.first = first
        conf = first.settings.conf
        self.parallel_jobs = conf.parallel_jobs
        self.devices = [str(d) for d in conf.devices] if conf.devices is not None else None
        if self.devices is None and self.parallel_jobs > 1:
            self.devices = _visible_devices()
        self.check_job(first)

    def check_job(self, plan: JobPlan) -> None:
        """The sweep-wide keys as the first job's; what running jobs at once needs."""
        first, parallel_jobs = self.first, self.parallel_jobs
        for key in _SWEEP_WIDE_KEYS:
            if getattr(plan.settings.conf, key) != getattr(first.settings.conf, key):
                raise LauncherConfigError(
                    f"hydra.launcher.{key} differs between jobs {first.idx} and {plan.idx}: "
                    "it applies to the whole sweep and must be the same for every job"
                )
        if parallel_jobs > 1 and not plan.rendezvous.endpoint.endswith(":0"):
            key = "rdzv_endpoint" if plan.settings.conf.rdzv_endpoint else "master_port"
            raise LauncherConfigError(
                f"hydra.launcher.{key}={getattr(plan.settings.conf, key)} cannot serve "
                f"parallel_jobs={parallel_jobs}: jobs running at once would join one rendezvous; "
                f"leave {key} unset (each job then gets a free port of its own)"
            )
        if parallel_jobs > 1 and plan.settings.max_nodes > 1:
            raise LauncherConfigError(
                f"hydra.launcher.parallel_jobs={parallel_jobs} is invalid for a multi-node sweep: "
                "the nodes run the jobs one by one in lockstep"
            )
        if self.devices is not None and plan.nproc > len(self.devices):
            raise LauncherConfigError(
                f"hydra.launcher.nproc_per_node={plan.nproc} (job {plan.idx}) is more than the "
                f"{len(self.devices)} devices to share out ({','.join(self.devices) or 'none'}); "
                "set hydra.launcher.devices or lower nproc_per_node"
            )
        if parallel_jobs > 1:
            plan.console_label = f"#{plan.idx} "

    def launchers_sharing_dir(self, first: JobPlan) -> int:
        return first.settings.max_nodes

    def dry_run(self, plans: Sequence[JobPlan], configs: Dict[int, DictConfig], recorded: Any) -> str:
        return dry_run_plan(list(plans), configs, self.parallel_jobs, self.devices, recorded)

    def run(self, jobs: JobFeed, events: JobEvents) -> Dict[int, JobReturn]:
        # the variables env_set gives, by the first job's (each job's may differ in value)
        server = checked_warm_server(self.preload, varying_variables([self.first]))
        assert self.notice is not None
        if self.notice.received:
            return {}

        def request_for(plan: JobPlan, devices: Optional[List[str]]) -> "tuple[bytes, Callable[[], None]]":
            return events.request_ahead(plan, devices, dict(os.environ), ignored_group_signals())

        def on_start(plan: JobPlan, devices: Optional[List[str]]) -> None:
            events.started(plan, f" on devices {','.join(devices)}" if devices is not None else "")

        log.info(
            f"Launching {jobs_counted(jobs.left())} with torchrun into {shown_path(str(self.sweep_dir))}"
        )
        return run_jobs(
            server,
            jobs,
            self.parallel_jobs,
            self.devices,
            request_for,
            on_start,
            events.ended,
            self.notice,
        )

    def held_over(self, plans: Sequence[JobPlan]) -> Set[int]:
        return set()  # a job process never outlives the launcher that started it

    def stopped_words(self) -> str:
        return "the sweep was stopped: "


def _keys_set(config: DictConfig) -> Set[str]:
    """Launcher keys the user gave on the command line (`hydra.launcher.nnodes=1`, `++...`)."""
    keys = set()
    for override in OmegaConf.to_container(config.hydra.overrides.hydra, resolve=False):  # as typed
        name = str(override).lstrip("+~").split("=", 1)[0]
        if name.startswith("hydra.launcher."):
            keys.add(name[len("hydra.launcher.") :])
    return keys


def _visible_devices() -> Optional[List[str]]:
    """All visible GPUs (CUDA_VISIBLE_DEVICES, else the CUDA device count); None without GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()] or None
    import torch

    count = torch.cuda.device_count()
    return [str(i) for i in range(count)] if count else None
