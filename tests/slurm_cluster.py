"""A real SLURM cluster (two compute nodes, or `nodes`) on this one machine, for the tests.

Debian's `slurmctld`, `slurmd` and `munge`: munged and slurmctld run on the host, each
slurmd in a network namespace of its own (a veth into a private bridge), with its own
hostname (UTS namespace) and its own /etc/hosts (mount namespace), so that the node names
resolve to each node's own address, as torch's c10d rendezvous needs. Everything lives in
one directory (config, state, spool, logs, munge key and socket); `stop()` ends every
daemon by PID and removes the namespaces and the bridge.

    with SlurmCluster(tmp_path) as cluster:
        cluster.run(["sbatch", "--wait", f"--output={tmp_path}/slurm-%j.out", ...], cwd=tmp_path)

(without `--output`, sbatch writes `slurm-<job id>.out` where it is called from: under pytest,
the checkout's root.)

`unavailable()` says why a cluster cannot start here (not root, no SLURM, no namespaces);
`skip_or_fail()` turns that into a skip, or a failure where `REQUIRE_SLURM=1` (CI).
"""

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Set

import pytest

NODES = ("node1", "node2")
_DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "sinfo")
START_TIMEOUT_S = 30.0
# torch's agents stop their ranks within 30 s of SIGTERM; SLURM then ends the job
CANCEL_WAIT_S = 60.0
# partition `preemptible`'s jobs are preempted (PreemptMode=REQUEUE) by partition `urgent`'s,
# with this long to end after SLURM's SIGTERM before SLURM kills and requeues them
PREEMPT_GRACE_S = 30
# the daemons of clusters that run now: they outlive a test, their jobs' processes do not
RUNNING_DAEMONS: Set[int] = set()
# what a daemon starts for itself (not for a job): slurmctld's script helper
DAEMON_HELPERS = ("slurmctld: slurmscriptd",)


def unavailable() -> Optional[str]:
    """Why a cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "a SLURM cluster needs root (network namespaces, daemons)"
    missing = [d for d in _DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return (
            f"SLURM is not installed (missing {', '.join(missing)}): "
            "apt-get install slurmctld slurmd slurm-client munge"
        )
    if shutil.which("ip") is None or shutil.which("nsenter") is None or shutil.which("unshare") is None:
        return "ip, nsenter and unshare are needed for the nodes' namespaces"
    return None


REQUIRE_ENV = "REQUIRE_SLURM"


def skip_or_fail(reason: Optional[str], environ: Optional[Mapping[str, str]] = None) -> None:
    """Skip a test that needs the cluster, saying why (`reason` from `unavailable()`); fail it
    instead where `REQUIRE_SLURM=1` (CI, which installs SLURM: a silent skip there would hide
    that the SLURM tests never ran). None: the cluster can run, nothing happens."""
    if reason is None:
        return
    if (os.environ if environ is None else environ).get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1, but no SLURM cluster can run here: {reason}", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """SLURM compute nodes (node1, node2, ...; two unless `nodes` says) and a controller; see the
    module docstring."""

    def __init__(self, root: Path, nodes: int = len(NODES)) -> None:
        self.nodes = tuple(f"node{i}" for i in range(1, nodes + 1))
        self.root = root / "slurm"
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"sbr{tag}"
        self.namespaces = {node: f"s{tag}{i}" for i, node in enumerate(self.nodes, 1)}
        # a private /24 per cluster, picked from the tag
        self.subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
        self.addresses = {node: f"{self.subnet}.{i}" for i, node in enumerate(self.nodes, 1)}
        self.controller_address = f"{self.subnet}.254"
        self.processes: List[subprocess.Popen] = []
        self.env: Dict[str, str] = {}

    # -- set-up -------------------------------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o711)
        self._network()
        self._munge()
        self._config()
        self.env = dict(os.environ, SLURM_CONF=str(self.root / "slurm.conf"))
        self._start([_sbin("slurmctld"), "-D", "-f", str(self.root / "slurm.conf")], "slurmctld")
        for node in self.nodes:
            hosts = self.root / f"hosts.{node}"
            inner = (
                f"hostname {node} && mount --bind {hosts} /etc/hosts && "
                f"exec {_sbin('slurmd')} -D -N {node} -f {self.root / 'slurm.conf'}"
            )
            command = [
                "nsenter",
                f"--net=/run/netns/{self.namespaces[node]}",
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                inner,
            ]
            self._start(command, f"slurmd.{node}")
        self._wait_idle()

    def _run(self, command: Sequence[str]) -> None:
        subprocess.run(command, check=True, capture_output=True, text=True)

    def _network(self) -> None:
        self._run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._run(["ip", "addr", "add", f"{self.controller_address}/24", "dev", self.bridge])
        self._run(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            ns = self.namespaces[node]
            host_end, node_end = f"{ns}h", f"{ns}n"
            self._run(["ip", "netns", "add", ns])
            self._run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end])
            self._run(["ip", "link", "set", host_end, "master", self.bridge, "up"])
            self._run(["ip", "link", "set", node_end, "netns", ns])
            self._run(["ip", "-n", ns, "addr", "add", f"{self.addresses[node]}/24", "dev", node_end])
            self._run(["ip", "-n", ns, "link", "set", node_end, "up"])
            self._run(["ip", "-n", ns, "link", "set", "lo", "up"])
            lines = ["127.0.0.1 localhost", f"{self.controller_address} {socket.gethostname()}"]
            lines += [f"{self.addresses[n]} {n}" for n in self.nodes]
            (self.root / f"hosts.{node}").write_text("\n".join(lines) + "\n")

    def _munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._start(
            [
                _sbin("munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
            "munged",
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._log('munged')}")
            time.sleep(0.05)

    def _config(self) -> None:
        root = self.root
        (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        nodes = "\n".join(
            f"NodeName={node} NodeAddr={self.addresses[node]} CPUs=2 State=UNKNOWN" for node in self.nodes
        )
        nodelist = ",".join(self.nodes)
        preemptible = (
            f"PartitionName=preemptible Nodes={nodelist} MaxTime=INFINITE State=UP PriorityTier=1 "
            f"PreemptMode=REQUEUE GraceTime={PREEMPT_GRACE_S}"
        )
        (root / "slurm.conf").write_text(
            f"""ClusterName=hydratorchrun
SlurmctldHost={socket.gethostname().split(".")[0]}({self.controller_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}/%n
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.%n.pid"}
SlurmctldLogFile={root / "log" / "slurmctld.log"}
SlurmdLogFile={root / "log" / "slurmd.%n.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/linear
{nodes}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes={nodelist} Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF
{preemptible}
PartitionName=urgent Nodes={nodelist} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""
        )

    def _start(self, command: List[str], name: str) -> None:
        with (self.root / "log" / f"{name}.out").open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env or None)
        self.processes.append(process)
        RUNNING_DAEMONS.add(process.pid)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            result = subprocess.run(
                ["sinfo", "-h", "-o", "%n %t"], env=self.env, capture_output=True, text=True
            )
            states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
            if all(states.get(node) == "idle" for node in self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the SLURM nodes did not become idle ({states or result.stderr.strip()}); "
                    f"slurmctld: {self._log('slurmctld')}"
                )
            time.sleep(0.2)

    def _log(self, name: str) -> str:
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            if path.exists():
                return path.read_text()[-2000:]
        return "(no log)"

    # -- use ----------------------------------------------------------------------------

    def run(self, command: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, srun, scontrol, ...) against this cluster."""
        return subprocess.run(list(command), env=self.env, capture_output=True, text=True, **kwargs)

    # -- tear-down ----------------------------------------------------------------------

    def _cancel_jobs(self) -> None:
        """scancel every job of this cluster and wait (up to CANCEL_WAIT_S: torch's agents
        take up to 30 s to stop their ranks) for the queue to empty."""
        if not self.env or not self.processes or self.processes[0].poll() is not None:
            return  # no controller to ask
        jobs = self.run(["squeue", "-h", "-o", "%A"]).stdout.split()
        if not jobs:
            return
        self.run(["scancel", *jobs])
        deadline = time.monotonic() + CANCEL_WAIT_S
        while self.run(["squeue", "-h", "-o", "%A"]).stdout.split() and time.monotonic() < deadline:
            time.sleep(0.5)

    def _kill_node_processes(self) -> None:
        """SIGKILL what is still alive in the nodes' network namespaces (only this cluster's
        jobs run there), and wait for it to be gone."""
        pids = []
        for ns in self.namespaces.values():
            listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids += [int(pid) for pid in listed.stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + START_TIMEOUT_S
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        """End the jobs still queued or running, every daemon by PID and what the jobs left in
        the nodes' namespaces, then remove the namespaces and the bridge.

        A job's `slurmstepd` detaches from `slurmd` and outlives it by design (a restarted
        slurmd finds its jobs again), so stopping the daemons alone would leave a job that a
        failed test did not wait for running, out of the test's process tree.
        """
        self._cancel_jobs()
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for process in self.processes:
            RUNNING_DAEMONS.discard(process.pid)
        self.processes.clear()
        self._kill_node_processes()
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _running(pid: int) -> bool:
    """Alive and not a zombie (one reparented away from us is reaped by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
