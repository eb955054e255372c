"""The ssh runner of `hydra/launcher=torchrun_ssh`: the sweep's jobs on a few hosts, no scheduler.

The sweep driver (`_launcher.driver`) composes and checks the jobs and keeps the record, as
for the other runners; this runner starts one agent per host over ssh (`_ssh.head`,
`_ssh.agent`) and waits until every one is ready (torch imported there) or names in one
line each host that cannot run it, with ssh's own reason, before any rank starts. Then it
packs the jobs onto free hosts (`nodes` hosts each, up to `parallel_jobs` at once; a host
with `slots` holds jobs while their ranks fit its devices, one without holds one job at a
time), each job's nodes meeting in a c10d rendezvous on its first host. A node's end comes
back with its JobReturn and job dir files, written into the head's sweep dir. A node that
fails stops its job's other nodes (their ranks would wait for it in a collective); the
job's error is the first failure's. A host lost mid-sweep fails the jobs that ran there,
naming it, and the sweep goes on on the others.

Ctrl-C or SIGTERM on the head is passed on to every job process on every host (torch's
shutdown path stops their ranks); a second one kills them. The stop signal (a preemption
notice) reaches every job the same way, so `should_stop()` agrees on all hosts.
"""

import dataclasses
import hashlib
import logging
import os
import re
import selectors
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import cloudpickle
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig

from .._job.failure_report import JobPastDeadline, failed_return, merged_deadline, process_end
from .._job.launch_config import check_supported
from .._job.preempt import JobPreempted
from .._launcher.cluster_layout import derived_port
from .._launcher.preempt import StopNotice, StopRequest, SweepStopped, sweep_notice, sweep_stop_signal
from .._launcher.preload import preload_modules, varying_variables
from .._launcher.report import jobs_counted
from .._launcher.reproduce import plain_torchrun_line
from .._launcher.runner import JobEvents, JobFeed, Placement, hard_limit_s
from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.plan import JobPlan, JobSettings, Rendezvous
from .head import HostAgent, ssh_command
from .hosts import Host, forwarded
from .nodes import node_request
from .options import SWEEP_WIDE, SshOptions, split_launcher_config
from .wire import HEARTBEAT_S, SILENCE_S

log = logging.getLogger(__name__)


class SshRunner:
    """`hydra/launcher=torchrun_ssh`'s runner (`_launcher.runner.Runner`)."""

    names_hosts = True

    def __init__(self, launcher: Any) -> None:
        self.sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
        self.notice: Optional[StopNotice] = sweep_notice(
            launcher.notice, sweep_stop_signal(launcher.config), launcher.hydra_context.callbacks
        )
        launcher.notice = self.notice
        # what each host's warm server imports besides torch (`preload`, the first job's)
        self.preload: Tuple[str, ...] = ()
        self.options: Dict[int, SshOptions] = {}
        self.stopped = ""

    def job_settings(self, config: DictConfig) -> "tuple[JobSettings, Optional[str]]":
        settings, options = split_launcher_config(config.hydra.launcher, os.getcwd())
        check_supported(settings)
        self.options[int(config.hydra.job.num)] = options
        return settings, None

    def check_sweep(self, first: JobPlan) -> None:
        self.first = self.options[first.idx]
        self.first_plan = first
        # auto: what the app has imported here by now
        self.preload = preload_modules(self.first.preload)
        self.check_job(first)

    def check_job(self, plan: JobPlan) -> None:
        """The sweep-wide keys as the first job's; hosts with slots enough for its ranks."""
        first, options = self.first, self.options[plan.idx]
        for key, mine, theirs in zip(SWEEP_WIDE, options.sweep_wide, first.sweep_wide):
            if mine != theirs:
                raise LauncherConfigError(
                    f"hydra.launcher.{key} differs from the first job's (job {plan.idx}): "
                    "it applies to the whole sweep and must be the same for every job"
                )
        fitting = [h for h in first.hosts if h.slots is None or h.slots >= plan.nproc]
        if len(fitting) < options.nodes:
            slots = ", ".join(f"{h.name} slots={h.slots}" for h in first.hosts if h.slots is not None)
            raise LauncherConfigError(
                f"hydra.launcher.nproc_per_node={plan.nproc} (job {plan.idx}) needs {options.nodes} host(s) "
                f"with that many slots; the hostfile gives {slots}"
            )
        if _at_once(first) > 1 or options.nodes > 1:
            plan.console_label = f"#{plan.idx} "

    def launchers_sharing_dir(self, first: JobPlan) -> int:
        return 1  # the head alone keeps the sweep dir; the hosts send their files back

    def dry_run(self, plans: Sequence[JobPlan], configs: Dict[int, DictConfig], recorded: Any) -> str:
        first = self.options[plans[0].idx]
        from_record = recorded.in_header("not started")
        hosts = ", ".join(h.name if h.slots is None else f"{h.name} (slots={h.slots})" for h in first.hosts)
        agent = ssh_command(Host("HOST"), first.ssh_options, first.python, os.getcwd())
        lines = [
            f"Dry run: {jobs_counted(len(plans))} on the hosts {hosts}, up to {_at_once(first)} at once"
            f"{from_record}; nothing is started",
            # as pasted into a shell: ssh and its words, the remote command one of them
            f"\teach host's agent: {shlex.join(agent)}",
        ]
        for plan in plans:
            options = self.options[plan.idx]
            conf = plan.settings.conf
            rdzv = plan.rendezvous
            if options.nodes > 1:
                # as `_start` places it: c10d on the job's first host, a port derived when it starts
                endpoint = "FIRST_HOST:PORT"
                plan = dataclasses.replace(
                    plan,
                    settings=dataclasses.replace(
                        plan.settings, conf=dataclasses.replace(conf, rdzv_endpoint=endpoint)
                    ),
                    rendezvous=Rendezvous("c10d", endpoint, rdzv.run_id, rdzv.configs),
                )
                where = "c10d on the job's first host (FIRST_HOST), on a port derived when it starts (PORT)"
            else:
                where = f"{rdzv.backend} at {rdzv.endpoint} on its host (a free port when the job starts)"
            # a line per host: as `node_request` makes each node's plan, whose torch logs go
            # to a dir of its own (`job_log_dir`)
            torchrun = []
            for node, name in enumerate(_node_hosts(options)):
                on_node = plan
                if options.nodes > 1:
                    conf_k = dataclasses.replace(plan.settings.conf, node_rank=node)
                    on_node = dataclasses.replace(
                        plan, node_slot=node, settings=dataclasses.replace(plan.settings, conf=conf_k)
                    )
                line, missing = plain_torchrun_line(on_node, configs[plan.idx], None, first.python)
                torchrun.append(f"on {name}: {line}")
            lines += [
                f"\t#{plan.idx} : {' '.join(plan.overrides)}",
                *([f"\t\trecord:     {recorded.said[plan.idx]}"] if plan.idx in recorded.said else []),
                f"\t\tjob dir:    {plan.output_dir}",
                f"\t\tranks:      {plan.nproc or f'{conf.nproc_per_node} (counted on each host)'} per host "
                f"x {options.nodes} host(s), {conf.start_method}",
                f"\t\thosts:      {_which_hosts(options)}",
                f"\t\trendezvous: {where}, id {plan.rendezvous.run_id}",
                f"\t\ttorchrun:   {torchrun[0]}",
                *(f"\t\t            {line}" for line in torchrun[1:]),
                *([f"\t\t            (it cannot express: {'; '.join(missing)})"] if missing else []),
            ]
        return "\n".join(lines)

    def run(self, jobs: JobFeed, events: JobEvents) -> Dict[int, JobReturn]:
        assert self.notice is not None
        if self.notice.received:
            return {}
        count = jobs.left()
        sweep = _Sweep(self, jobs, events)
        try:
            with sweep.stop.handling():
                sweep.start_agents()
                log.info(
                    f"Launching {jobs_counted(count)} on {len(sweep.hosts)} host(s) "
                    f"({', '.join(state.host.name for state in sweep.hosts)}) "
                    f"into {shown_path(str(self.sweep_dir))}"
                )
                return sweep.run()
        except SweepStopped:
            self.stopped = sweep.stopped_words()
            raise
        finally:
            self.notice.forward = lambda signum: None
            sweep.close()

    def held_over(self, plans: Sequence[JobPlan]) -> Set[int]:
        return set()  # the hosts' agents end with the launcher's ssh sessions, and their jobs

    def stopped_words(self) -> str:
        return self.stopped


def _which_hosts(options: SshOptions) -> str:
    """The hosts a job runs on, as far as a dry run can tell: jobs take the first free ones."""
    names = [h.name for h in options.hosts]
    if options.nodes == len(names):
        return ", ".join(names)
    return f"{options.nodes} of {', '.join(names)}: the first free when the job starts"


def _node_hosts(options: SshOptions) -> List[str]:
    """Each node's host as a dry run names it: the host itself where the job takes every host."""
    if options.nodes == 1:
        return ["its host"]
    if options.nodes == len(options.hosts):
        return [h.name for h in options.hosts]
    return ["its host 1 (FIRST_HOST)", *(f"its host {node + 1}" for node in range(1, options.nodes))]


def _at_once(options: SshOptions) -> int:
    """How many jobs may run at once: parallel_jobs, else as many as the hosts hold."""
    hold = sum(h.slots if h.slots is not None else 1 for h in options.hosts)
    return min(options.parallel_jobs or hold, hold)


@dataclass
class _HostState:
    host: Host
    agent: HostAgent
    # the host's free devices (slots), or None: one job at a time
    free: Optional[List[str]]
    jobs: Set[int] = field(default_factory=set)

    def fits(self, nproc: int) -> bool:
        if self.agent.lost is not None:
            return False
        return len(self.free) >= self._needs(nproc) if self.free is not None else not self.jobs

    def take(self, idx: int, nproc: int) -> Optional[List[str]]:
        self.jobs.add(idx)
        if self.free is None:
            return None
        need = self._needs(nproc)
        taken, self.free = self.free[:need], self.free[need:]
        return taken

    def _needs(self, nproc: int) -> int:
        """The slots a job takes: its ranks', or every slot of the host where the host counts
        its ranks itself (nproc 0: nproc_per_node=gpu counts the devices it is given)."""
        return nproc or (self.host.slots or 0)

    def give_back(self, idx: int, devices: Optional[List[str]]) -> None:
        self.jobs.discard(idx)
        if self.free is not None and devices:
            self.free = sorted(self.free + devices, key=int)


@dataclass
class _Running:
    plan: JobPlan
    hosts: List[_HostState]
    devices: List[Optional[List[str]]]
    open_nodes: Set[int]
    returns: Dict[int, JobReturn] = field(default_factory=dict)
    # the first node that failed, and its JobReturn
    failed: Optional[Tuple[int, JobReturn]] = None


class _Sweep:
    """One launch's jobs on the hosts: agents started, jobs placed, ends collected."""

    def __init__(self, runner: SshRunner, jobs: JobFeed, events: JobEvents) -> None:
        self.runner = runner
        self.events = events
        self.jobs = jobs
        self.options = runner.options
        self.first = runner.first
        self.hosts: List[_HostState] = []
        self.selector = selectors.DefaultSelector()
        self.running: Dict[int, _Running] = {}
        self.returns: Dict[int, JobReturn] = {}
        assert runner.notice is not None
        # Ctrl-C or SIGTERM: passed on to every host's jobs, a second one kills them
        self.stop = StopRequest(self._signal_all, runner.notice.signum)
        self.run_tag = hashlib.sha1(f"{runner.sweep_dir.resolve()}:{time.time()}".encode()).hexdigest()[:12]

    # -- signals --------------------------------------------------------------------------

    def _signal_all(self, signum: int) -> None:
        for state in self.hosts:
            if state.jobs:
                state.agent.send(("signal", signum, None))

    def stopped_words(self) -> str:
        hosts = ", ".join(state.host.name for state in self.hosts)
        return f"the sweep was stopped on every host ({hosts}): " if hosts else "the sweep was stopped: "

    # -- agents ---------------------------------------------------------------------------

    def start_agents(self) -> None:
        """Every host's agent started and ready, or one line naming those that are not."""
        setup = {
            "sys_path": list(sys.path),
            "preload": list(self.runner.preload),
            "varying": sorted(varying_variables([self.runner.first_plan])),
            "heartbeat_s": HEARTBEAT_S,
            "silence_s": SILENCE_S,
        }
        cwd = os.getcwd()
        for host in self.first.hosts:
            command = ssh_command(host, self.first.ssh_options, self.first.python, cwd)
            agent = HostAgent(host, command, setup)
            free = [str(i) for i in range(host.slots)] if host.slots is not None else None
            state = _HostState(host, agent, free)
            self.hosts.append(state)
            self.selector.register(agent.stdout, selectors.EVENT_READ, (state, "out"))
            self.selector.register(agent.stderr, selectors.EVENT_READ, (state, "err"))
        waiting = list(self.hosts)
        while any(s.agent.ready is None and s.agent.lost is None for s in waiting):
            self.stop.raise_if_stopped()
            self._pump(timeout=None)
        failed = [s for s in self.hosts if s.agent.ready is None]
        if failed:
            named = "; ".join(f"{s.host.name}: {s.agent.lost}" for s in failed)
            raise LauncherConfigError(
                f"hydra/launcher=torchrun_ssh: no job started: the launcher's agent cannot run on "
                f"{len(failed)} of the {len(self.hosts)} host(s): {named}"
            )
        assert self.runner.notice is not None
        self.runner.notice.forward = self._signal_all

    def _pump(self, timeout: Optional[float]) -> None:
        """Read what the agents sent; act on it."""
        for key, _ in self.selector.select(timeout=timeout):
            state, stream = key.data
            agent = state.agent
            if stream == "err":
                agent.read_stderr()
                if not agent.stderr_open:
                    self.selector.unregister(agent.stderr)
                    self._maybe_lost(state)
                continue
            for message in agent.read_stdout():
                self._handle(state, message)
            if not agent.stdout_open:
                self.selector.unregister(agent.stdout)
                self._maybe_lost(state)

    def _maybe_lost(self, state: _HostState) -> None:
        """Once both of its streams have ended, the host is gone: its jobs fail, naming it."""
        agent = state.agent
        if agent.stdout_open or agent.stderr_open:
            return
        if agent.lost is None:
            agent.lost = agent.reason()
        if agent.ready is None:
            return  # named in the start-up's one line
        for idx in sorted(state.jobs):
            running = self.running[idx]
            node = running.hosts.index(state)
            why = f"host {state.host.name} was lost: {agent.lost}"
            if self.stop.signum is None:
                log.warning(f"job #{idx}: {why}; the sweep goes on on the other hosts")
            self._node_ended(running, node, failed_return(why))
        state.jobs.clear()

    def _heartbeat(self) -> None:
        """Tell each live agent the head is alive; an agent silent too long is lost (its ssh
        killed: its streams' end fails its jobs, naming the host)."""
        now = time.monotonic()
        for state in self.hosts:
            agent = state.agent
            if agent.silent(now):
                log.warning(f"host {state.host.name}: {agent.lost}")
            elif agent.ready is not None and now - agent.said >= HEARTBEAT_S:
                agent.send(("ping",))

    # -- jobs -----------------------------------------------------------------------------

    def run(self) -> Dict[int, JobReturn]:
        notice = self.runner.notice
        assert notice is not None
        limit = _at_once(self.first)
        upcoming = self.jobs.next()  # composed ahead of its hosts
        while upcoming is not None or self.running:
            starting = self.stop.signum is None and not notice.received
            while upcoming is not None and starting and len(self.running) < limit:
                nodes = self.options[upcoming.idx].nodes
                free = [s for s in self.hosts if s.fits(upcoming.nproc)]
                if len(free) < nodes and not self.running:  # the hosts lost: no host left can take it
                    alive = [s.host.name for s in self.hosts if s.agent.lost is None]
                    lost = ", ".join(s.host.name for s in self.hosts if s.agent.lost is not None)
                    self.events.started(upcoming, None)
                    left = ", ".join(alive) or "none"
                    why = f"it needs {nodes} host(s); the hosts left ({left}) cannot take it (lost: {lost})"
                    self._end(upcoming, failed_return(why))
                    upcoming = self.jobs.next()
                    continue
                if len(free) < nodes:
                    break
                self._start(upcoming, free[:nodes])
                upcoming = self.jobs.next()
            if not self.running:
                break
            self._pump(timeout=HEARTBEAT_S)
            self._heartbeat()
        self.stop.raise_if_stopped()
        return self.returns

    def _start(self, plan: JobPlan, hosts: List[_HostState]) -> None:
        options = self.options[plan.idx]
        devices = [state.take(plan.idx, plan.nproc) for state in hosts]
        environs = [
            {**state.agent.ready["environ"], **forwarded(options.env_forward, plan.env_set, os.environ)}  # type: ignore[index]
            for state in hosts
        ]
        first = dataclasses.replace(
            plan, host=hosts[0].host.name, console_label=_label(plan, hosts[0].host.name)
        )
        # one deadline for the job's nodes, in each host's clock: they stop their ranks together,
        # each naming its own still running (a node that stopped its ranks first would have
        # the others' fail in a collective before their own job_timeout came)
        timeout = plan.settings.conf.job_timeout
        ends = time.time() + timeout if timeout is not None and len(hosts) > 1 else None
        deadlines = [None if ends is None else ends + state.agent.clock_offset for state in hosts]
        if len(hosts) > 1:
            run = f"ssh-{self.run_tag}-{plan.idx}"
            endpoint = f"{hosts[0].agent.hostname}:{derived_port(run)}"
            conf = dataclasses.replace(plan.settings.conf, node_rank=0, rdzv_endpoint=endpoint)
            first = dataclasses.replace(
                first,
                deadline=deadlines[0],
                settings=dataclasses.replace(plan.settings, conf=conf),
                rendezvous=Rendezvous("c10d", endpoint, f"{run}_{plan.idx}", plan.rendezvous.configs),
            )
        request = self.events.request(
            first, devices[0], environs[0], [], _placement(hosts, devices, self.first.python)
        )
        where = ", ".join(
            state.host.name + (f" (devices {','.join(d)})" if d else "") for state, d in zip(hosts, devices)
        )
        self.events.started(plan, f" on {where}", [state.host.name for state in hosts])
        running = _Running(plan, hosts, devices, set(range(len(hosts))))
        self.running[plan.idx] = running
        limit = hard_limit_s(plan)
        for node, state in enumerate(hosts):
            node_bytes = (
                request
                if node == 0
                else node_request(
                    request,
                    node,
                    environs[node],
                    devices[node],
                    state.host.name,
                    deadlines[node],
                    _label(plan, state.host.name),
                )
            )
            # a host lost as the job started: its loss fails the job when seen
            state.agent.send(("job", (plan.idx, node), node_bytes, str(plan.output_dir), limit))
        # a stop that came as it started reaches it too
        if self.stop.signum is not None:
            self._signal_job(running, self.stop.signum)

    def _signal_job(self, running: _Running, signum: int, nodes: Optional[Set[int]] = None) -> None:
        for node in sorted(running.open_nodes if nodes is None else nodes):
            running.hosts[node].agent.send(("signal", signum, [(running.plan.idx, node)]))

    def _handle(self, state: _HostState, message: Any) -> None:
        kind = message[0]
        if kind != "ended":
            raise ValueError(f"unknown message from {state.host.name}'s agent: {kind!r}")
        _, (idx, node), result, status, pid, files, left = message
        running = self.running.get(idx)
        if running is None or node not in running.open_nodes:
            return
        plan = running.plan
        _write_back(plan.output_dir, files, first=node == 0)
        if left:
            shown = ", ".join(f"{path} ({size >> 20} MiB)" for path, size in left)
            log.info(
                f"job #{idx}: files of its job dir left on {state.host.name} (too large to send back): "
                f"{shown}"
            )
        if result is not None:
            try:
                job_return = cloudpickle.loads(result)
            except Exception as e:  # a result that cannot be read is the job's failure, said so
                job_return = failed_return(f"its result from {state.host.name} could not be read: {e}")
        else:
            how = f"(pid {pid} on {state.host.name}) {process_end(status)}"
            job_return = failed_return(f"the job's process {how} before reporting a result")
        self._node_ended(running, node, job_return)

    def _node_ended(self, running: _Running, node: int, job_return: JobReturn) -> None:
        running.open_nodes.discard(node)
        running.returns[node] = job_return
        state = running.hosts[node]
        state.give_back(running.plan.idx, running.devices[node])
        value = job_return._return_value
        if job_return.status == JobStatus.FAILED and not isinstance(value, JobPreempted):
            if running.failed is None:
                running.failed = (node, job_return)
                # the job's other nodes would wait for the failed rank in a collective; past
                # the deadline they share, they are stopping their ranks themselves
                if not isinstance(value, JobPastDeadline):
                    self._signal_job(running, signal.SIGTERM)
        if running.open_nodes:
            return
        del self.running[running.plan.idx]
        self._end(running.plan, _job_return(running))

    def _end(self, plan: JobPlan, job_return: JobReturn) -> None:
        if job_return.overrides is None:
            job_return.overrides = list(plan.overrides)
        self.returns[plan.idx] = job_return
        self.events.ended(plan, job_return, self.stop.signum is not None)

    def close(self) -> None:
        """End every agent's session (its agent ends with it) and wait for them."""
        for state in self.hosts:
            state.agent.close()
        self.selector.close()


def _label(plan: JobPlan, host: str) -> str:
    """What a node's rank lines start with on the head's console: torchrun's own prefix
    (`[default0]:`, its role and local rank) says the same on every host, as each node's
    torchrun prints it on its own terminal; in the one console of a multi-host job, the host
    comes before it (`[#0 host2 default0]:`), as pdsh puts each line's host first."""
    if plan.settings.max_nodes <= 1:
        return plan.console_label
    return f"{plan.console_label or f'#{plan.idx} '}{host} "


def _placement(hosts: List[_HostState], devices: List[Optional[List[str]]], python: str) -> Placement:
    """The job's hosts, in order (its rendezvous on the first), for its rerun.sh: a one-job
    sweep on them, whatever hosts the sweep had; the devices it had on hosts with slots,
    where every host gave it the same ones (else each host's are all visible to it); the
    hosts' interpreter (`python`), for its plain torchrun line."""
    names = [state.host.name for state in hosts]
    quoted = [name if re.fullmatch(r"[A-Za-z0-9_.@:-]+", name) else f"'{name}'" for name in names]
    overrides = [f"hydra.launcher.hosts=[{','.join(quoted)}]", "hydra.launcher.hostfile=null"]
    where = f"on the hosts it ran on ({', '.join(names)})"
    shares = {",".join(d) for d in devices if d is not None}
    if len(shares) == 1 and all(d is not None for d in devices):
        (share,) = shares
        overrides.append(f"++hydra.job.env_set.CUDA_VISIBLE_DEVICES='{share}'")
        where += f", devices {share}"
    elif shares:
        where += " (all of each host's devices: they had different ones)"
    return Placement(tuple(overrides), where, python)


def _job_return(running: _Running) -> JobReturn:
    """The job's JobReturn: its first node's, with the error of the node that failed first;
    past its job_timeout, with every node's ranks still running then (each node names its own)."""
    first = running.returns.get(0)
    if running.failed is None:
        assert first is not None
        return first
    node, failed = running.failed
    past = [
        r._return_value
        for _, r in sorted(running.returns.items())
        if isinstance(r._return_value, JobPastDeadline)
    ]
    if isinstance(failed._return_value, JobPastDeadline) and len(past) > 1:
        failed = dataclasses.replace(failed)  # without the one node's account
        failed.return_value = merged_deadline(past)
    if node == 0 or first is None:
        return failed
    job_return = dataclasses.replace(first, status=JobStatus.FAILED)
    job_return.return_value = failed._return_value
    return job_return


def _write_back(job_dir: Path, files: List[Tuple[str, bytes, int]], first: bool) -> None:
    """A node's job dir files into the head's: the first node's win; another node's are
    added where the first's has none. A file already there with the same bytes (a shared
    sweep dir) is left alone."""
    for relative, data, mode in files:
        if os.path.isabs(relative) or ".." in Path(relative).parts:
            continue
        target = job_dir / relative
        if target.exists():
            if not first or (target.stat().st_size == len(data) and target.read_bytes() == data):
                continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.chmod(target, mode)
