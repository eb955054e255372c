"""Multi-node sweeps on one machine: two launcher processes play two nodes over loopback.

Every test starts the same multirun twice at once, as two hosts would: each "node" has its
own cwd and sweep dir (two hosts have two disks), and the ranks of every job join one world
across both nodes. The app (`multinode_apps/node_app.py`) has every rank all_reduce and
all_gather over gloo and record what it saw in `<job dir>/ranks/rank<RANK>.json`; its
callback records the JobReturn each node's launcher got in `<job dir>/job_return.json`.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest

from hydra_plugins.hydra_torchrun_launcher._launcher.cluster import derived_port
from tests.conftest import assert_gone

APP = Path(__file__).parent / "multinode_apps" / "node_app.py"
# a node still running after this long is stuck (a healthy two-node sweep takes ~25 s here)
WAIT_S = 150

pytestmark = pytest.mark.timeout(180)

# variables of the surrounding environment that would change what the launcher or torch does
_FOREIGN_ENV = re.compile(
    r"^(SLURM\w*|PET_\w+|OMPI_\w+|PMIX?_\w+|MPI_LOCAL\w+|LSB_\w+|JSM_\w+|TORCHELASTIC_\w+|"
    r"MASTER_ADDR|MASTER_PORT|RANK|LOCAL_RANK|WORLD_SIZE|"
    r"GROUP_RANK|LOCAL_WORLD_SIZE|HYDRA_FULL_ERROR)$"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


def base_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _FOREIGN_ENV.match(k)}
    env.update(PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1", **extra)
    return env


@dataclass
class Node:
    """One launcher process playing one host."""

    index: int
    home: Path
    proc: subprocess.Popen
    started: float
    elapsed_s: Optional[float] = None
    files: List[Any] = field(default_factory=list)

    @property
    def sweep_dir(self) -> Path:
        return self.home / "multirun"

    def output(self) -> str:
        return (self.home / "stdout.txt").read_text() + (self.home / "stderr.txt").read_text()

    def ranks(self, job: int) -> Dict[int, Dict[str, Any]]:
        """Global rank -> what that rank of job `job` recorded on this node."""
        ranks_dir = self.sweep_dir / str(job) / "ranks"
        if not ranks_dir.is_dir():
            return {}
        facts = [json.loads(p.read_text()) for p in sorted(ranks_dir.glob("rank*.json"))]
        return {int(f["env"]["RANK"]): f for f in facts}

    def job_return(self, job: int, suffix: str = "") -> Dict[str, Any]:
        path = self.sweep_dir / str(job) / f"job_return{suffix}.json"
        assert path.is_file(), f"node {self.index} recorded no JobReturn for job {job}"
        return json.loads(path.read_text())


def report(nodes: Sequence[Node]) -> str:
    parts = []
    for node in nodes:
        code = node.proc.returncode
        parts.append(f"===== node {node.index} (exit {code}, {node.elapsed_s} s)\n{node.output()}")
    return "\n".join(parts)


class Cluster:
    """Starts "nodes" and, whatever happens in the test, leaves none of their processes behind."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.nodes: List[Node] = []

    def start(self, args_per_node: Sequence[Sequence[str]], env_per_node: Sequence[Dict[str, str]]) -> None:
        """Start one launcher per entry, all at once, each in its own cwd and sweep dir."""
        for index, (args, env) in enumerate(zip(args_per_node, env_per_node)):
            home = self.tmp_path / f"node{index}"
            home.mkdir()
            out = open(home / "stdout.txt", "w")
            err = open(home / "stderr.txt", "w")
            command = [
                sys.executable,
                str(APP),
                "--multirun",
                "hydra/launcher=torchrun",
                f"hydra.sweep.dir={home / 'multirun'}",
                *args,
            ]
            # a session of its own: on a hang, its whole process group is killed
            proc = subprocess.Popen(
                command, cwd=home, env=env, stdout=out, stderr=err, start_new_session=True
            )
            self.nodes.append(Node(index, home, proc, time.monotonic(), files=[out, err]))

    def wait(self, timeout: float = WAIT_S) -> List[Node]:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            try:
                node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"node {node.index} still running after {timeout} s\n{report(self.nodes)}")
            node.elapsed_s = round(time.monotonic() - node.started, 1)
        return self.nodes

    def kill(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                node.proc.wait()

    def close(self) -> None:
        self.kill()
        for node in self.nodes:
            for f in node.files:
                f.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def rank_pids(nodes: Sequence[Node], jobs: Sequence[int]) -> List[int]:
    return [f["pid"] for node in nodes for job in jobs for f in node.ranks(job).values()]


def check_job_across_nodes(nodes: Sequence[Node], job: int, x: int, nproc: int) -> Dict[int, int]:
    """Job `job` ran as ONE world over both nodes, with the same x everywhere.

    Returns node index -> the node's group rank in this job.
    """
    world = 2 * nproc
    per_node = [node.ranks(job) for node in nodes]
    context = f"job {job}\n{report(nodes)}"
    assert [len(r) for r in per_node] == [nproc, nproc], context
    assert sorted(r for ranks in per_node for r in ranks) == list(range(world)), context
    # one rendezvous per job, the same on both nodes
    run_ids = {f["env"]["TORCHELASTIC_RUN_ID"] for ranks in per_node for f in ranks.values()}
    assert len(run_ids) == 1, (run_ids, context)
    group_of_node: Dict[int, int] = {}
    for node, ranks in zip(nodes, per_node):
        groups = {f["env"]["GROUP_RANK"] for f in ranks.values()}
        assert len(groups) == 1, (groups, context)
        group = int(groups.pop())
        group_of_node[node.index] = group
        # a node's ranks are one contiguous block of global ranks
        assert sorted(ranks) == list(range(group * nproc, (group + 1) * nproc)), context
        for facts in ranks.values():
            env = facts["env"]
            assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == (
                str(world),
                str(nproc),
                "2",
            ), context
            assert facts["job_num"] == job, context
            assert facts["x"] == x, context
            # every rank of the world, on either node, ran this job with the same x
            assert facts["xs"] == [x] * world, context
            assert facts["allreduce"] == world * (world + 1) / 2, context
        # this node's JobReturn: global rank 0's value, whichever node ran rank 0
        job_return = node.job_return(job)
        assert job_return["status"] == "COMPLETED", (job_return, context)
        rank0 = next(ranks[0] for ranks in per_node if 0 in ranks)
        assert job_return["return_value"] == rank0, context
    assert sorted(group_of_node.values()) == [0, 1], context
    return group_of_node


def check_two_node_sweep(nodes: Sequence[Node], xs: Sequence[int], nproc: int) -> List[Dict[int, int]]:
    for node in nodes:
        assert node.proc.returncode == 0, report(nodes)
    groups = [check_job_across_nodes(nodes, job, x, nproc) for job, x in enumerate(xs)]
    # every job had a rendezvous of its own
    run_ids = {
        f["env"]["TORCHELASTIC_RUN_ID"] for job in range(len(xs)) for f in nodes[0].ranks(job).values()
    }
    assert len(run_ids) == len(xs), report(nodes)
    return groups


# --- c10d and static rendezvous, keys given on the command line ---


def test_c10d_two_nodes_run_every_job_as_one_world(cluster: Cluster) -> None:
    port = free_port()
    args = [
        "hydra.launcher.nnodes=2",
        "hydra.launcher.nproc_per_node=2",
        "hydra.launcher.rdzv_backend=c10d",
        f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}",
        # the derived id comes from the sweep dir, which differs between hosts
        "hydra.launcher.rdzv_id=mn-c10d",
        "+x=1,2",
    ]
    cluster.start([args, args], [base_env(), base_env()])
    nodes = cluster.wait()
    check_two_node_sweep(nodes, xs=[1, 2], nproc=2)
    assert_gone(rank_pids(nodes, [0, 1]))


def test_static_two_nodes_run_every_job_as_one_world(cluster: Cluster) -> None:
    port = free_port()
    common = [
        "hydra.launcher.nnodes=2",
        "hydra.launcher.nproc_per_node=1",
        "hydra.launcher.rdzv_backend=static",
        "hydra.launcher.master_addr=127.0.0.1",
        f"hydra.launcher.master_port={port}",
        "hydra.launcher.rdzv_id=mn-static",
        "+x=1,2",
    ]
    cluster.start(
        [[*common, f"hydra.launcher.node_rank={n}"] for n in (0, 1)],
        [base_env(), base_env()],
    )
    nodes = cluster.wait()
    groups = check_two_node_sweep(nodes, xs=[1, 2], nproc=1)
    # static: the group rank is the node_rank each node was given, in every job
    assert groups == [{0: 0, 1: 1}, {0: 0, 1: 1}], report(nodes)
    assert nodes[0].job_return(0)["return_value"]["env"]["RANK"] == "0"
    assert_gone(rank_pids(nodes, [0, 1]))


def test_c10d_nodes_meet_without_an_explicit_rdzv_id(cluster: Cluster) -> None:
    port = free_port()
    args = [
        "hydra.launcher.nnodes=2",
        "hydra.launcher.rdzv_backend=c10d",
        f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}",
        # fail in seconds, not 10 minutes, while the bug is there
        "hydra.launcher.rdzv_conf={join_timeout:10}",
        "+x=1",
    ]
    cluster.start([args, args], [base_env(), base_env()])
    nodes = cluster.wait()
    for node in nodes:
        assert node.proc.returncode == 0, report(nodes)
    check_job_across_nodes(nodes, 0, x=1, nproc=1)
    assert_gone(rank_pids(nodes, [0]))


# --- SLURM: what an srun step sets, no rendezvous keys ---

SLURM_NODES = ("localhost", "127.0.0.1")  # two names of this host; node 0 is the rendezvous host


def slurm_job_id_with_a_free_port() -> str:
    """A job id whose derived rendezvous port is free here (the port is not ours to choose)."""
    for offset in range(1000):
        job = str(100000 + os.getpid() % 1000 * 1000 + offset)
        if port_is_free(derived_port(f"{job}.0")):
            return job
    raise AssertionError("no job id with a free rendezvous port")


def srun_task_env(job_id: str, node_id: int) -> Dict[str, str]:
    """The variables of the task `srun --nodes=2 --ntasks-per-node=1` starts on node `node_id`."""
    nodelist = ",".join(SLURM_NODES)
    return dict(
        SLURM_JOB_ID=job_id,
        SLURM_JOBID=job_id,
        SLURM_JOB_NODELIST=nodelist,
        SLURM_NODELIST=nodelist,
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_TASKS_PER_NODE="1(x2)",
        SLURM_NTASKS="2",
        SLURM_NPROCS="2",
        SLURM_STEP_ID="0",
        SLURM_STEPID="0",
        SLURM_STEP_NODELIST=nodelist,
        SLURM_STEP_NUM_NODES="2",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        SLURM_NODEID=str(node_id),
        SLURM_PROCID=str(node_id),
        SLURM_LOCALID="0",
        SLURMD_NODENAME=SLURM_NODES[node_id],
        SLURM_CPUS_ON_NODE="1",
    )


def test_slurm_step_makes_a_two_node_world(cluster: Cluster) -> None:
    job_id = slurm_job_id_with_a_free_port()
    port = derived_port(f"{job_id}.0")
    args = ["hydra.launcher.nproc_per_node=1", "+x=1,2"]
    cluster.start([args, args], [base_env(**srun_task_env(job_id, n)) for n in (0, 1)])
    nodes = cluster.wait()
    groups = check_two_node_sweep(nodes, xs=[1, 2], nproc=1)
    for node in nodes:
        # one line says what was detected and what it is used for
        lines = [line for line in node.output().splitlines() if "SLURM" in line]
        assert len(lines) == 1, report(nodes)
        assert f"SLURM job {job_id} step 0: 2 node(s)" in lines[0], lines
        assert f"this is node {node.index} ({SLURM_NODES[node.index]})" in lines[0], lines
        for used in ("nnodes=2", f"node_rank={node.index}", f"rdzv_endpoint=localhost:{port}"):
            assert used in lines[0], lines
        ranks = node.ranks(0)
        assert {f["env"]["TORCHELASTIC_RUN_ID"] for f in ranks.values()} == {f"slurm-{job_id}.0_0"}
    # c10d: the group ranks are the rendezvous' to assign; every job has both
    assert all(sorted(g.values()) == [0, 1] for g in groups)
    assert_gone(rank_pids(nodes, [0, 1]))


def test_slurm_without_a_step_runs_single_node(cluster: Cluster) -> None:
    """An salloc shell or a batch script: the job's variables, no SLURM_STEP_ID."""
    job_id = slurm_job_id_with_a_free_port()
    env = srun_task_env(job_id, 0)
    del env["SLURM_STEP_ID"], env["SLURM_STEPID"]
    cluster.start([["hydra.launcher.nproc_per_node=2", "+x=1,2"]], [base_env(**env)])
    # waiting for a second node would outlast this by far
    (node,) = cluster.wait(timeout=90)
    assert node.proc.returncode == 0, report([node])
    lines = [line for line in node.output().splitlines() if "SLURM" in line]
    assert len(lines) == 1 and "running single-node" in lines[0], report([node])
    for job, x in enumerate([1, 2]):
        ranks = node.ranks(job)
        assert sorted(ranks) == [0, 1], report([node])
        for facts in ranks.values():
            assert facts["env"]["WORLD_SIZE"] == "2" and facts["env"]["GROUP_WORLD_SIZE"] == "1"
            assert facts["xs"] == [x, x]
        assert node.job_return(job)["return_value"] == ranks[0]
    assert_gone(rank_pids([node], [0, 1]))


# --- nodes that disagree on a job ---


def test_nodes_that_disagree_on_a_job_fail_it_promptly(cluster: Cluster) -> None:
    port = free_port()
    common = [
        "hydra.launcher.nnodes=2",
        "hydra.launcher.nproc_per_node=1",
        "hydra.launcher.rdzv_backend=c10d",
        f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}",
        "hydra.launcher.rdzv_id=mn-disagree",
    ]
    cluster.start([[*common, "+x=1,2"], [*common, "+x=1,3"]], [base_env(), base_env()])
    nodes = cluster.wait()
    # job 0 is the same on both nodes: it runs as one world
    check_job_across_nodes(nodes, 0, x=1, nproc=1)
    for node in nodes:
        # job 1 fails on both nodes, so the multirun fails, and says why
        assert node.proc.returncode != 0, report(nodes)
        job_return = node.job_return(1)
        assert job_return["status"] == "FAILED", report(nodes)
        error = job_return["error"]
        assert re.search(r"disagree|mismatch|differ", error, re.I) and "overrides" in error, error
        assert "job 1" in error, error
        assert re.search(r"disagree|mismatch|differ", node.output(), re.I), report(nodes)
        # the task never ran with a config the other node does not share
        assert node.ranks(1) == {}, report(nodes)
        # promptly: well before any rendezvous or store timeout (minutes)
        assert node.elapsed_s is not None and node.elapsed_s < 60, report(nodes)
    assert_gone(rank_pids(nodes, [0]))


def test_a_node_whose_peer_never_comes_says_what_it_waits_for_and_ends_on_one_line(cluster: Cluster) -> None:
    port = free_port()
    args = [
        "hydra.launcher.nnodes=2",
        "hydra.launcher.rdzv_backend=c10d",
        f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}",
        "hydra.launcher.rdzv_conf={join_timeout:5}",
        "+x=0",
    ]
    env = base_env()
    del env["HYDRA_FULL_ERROR"]  # errors as a user sees them
    cluster.start([args], [env])
    (node,) = cluster.wait(timeout=90)
    out = node.output()
    assert node.proc.returncode == 1, out
    lines = out.splitlines()
    # at once, before the job waits: for how many nodes, where
    waits = next(i for i, line in enumerate(lines) if f"waits for 2 nodes at 127.0.0.1:{port}" in line)
    assert waits < next(i for i, line in enumerate(lines) if "\t#0 : +x=0" in line), out
    assert "Traceback" not in out and "RendezvousTimeoutError\n" not in out, out
    said = f"the job's nodes did not meet (RendezvousTimeoutError): it waited for 2 nodes at 127.0.0.1:{port}"
    assert [line for line in lines if line.startswith(said)], out
    assert node.elapsed_s is not None and node.elapsed_s < 60, out


def test_nodes_sharing_a_sweep_dir_keep_one_record_and_get_rank_0s_value(cluster: Cluster) -> None:
    """The README's recipe: one sweep dir on a shared filesystem for every node."""
    import pickle

    port = free_port()
    shared = cluster.tmp_path / "shared"
    args = [
        "hydra.launcher.nnodes=2",
        "hydra.launcher.nproc_per_node=2",
        "hydra.launcher.rdzv_backend=c10d",
        f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}",
        "hydra.launcher.rdzv_id=mn-shared",
        f"hydra.sweep.dir={shared}",
        "+x=1,2",
    ]
    cluster.start([args, args], [base_env(RECORD_SUFFIX=f"_node{n}") for n in (0, 1)])
    nodes = cluster.wait()
    for node in nodes:
        assert node.proc.returncode == 0, report(nodes)
    for job in (0, 1):
        job_dir = shared / str(job)
        facts = {int(p.stem[4:]): json.loads(p.read_text()) for p in (job_dir / "ranks").glob("rank*.json")}
        assert sorted(facts) == [0, 1, 2, 3], report(nodes)
        # every node's launcher got global rank 0's JobReturn
        for n in (0, 1):
            returned = json.loads((job_dir / f"job_return_node{n}.json").read_text())
            assert returned["return_value"] == facts[0], report(nodes)
        # one record, written by one node: rank 0's value; each node's torch logs apart
        with open(job_dir / ".hydra" / "job_return.pkl", "rb") as f:
            assert pickle.load(f).return_value == facts[0]
        assert sorted(p.name for p in (job_dir / "torchrun_logs").iterdir()) == ["node0", "node1"]
    jobs = json.loads((shared / "sweep_summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["COMPLETED", "COMPLETED"], jobs
    assert [j["return_value"]["env"]["RANK"] for j in jobs] == ["0", "0"], jobs
    assert sorted(p.name for p in shared.glob(".torchrun_launcher*.lock")) == [
        ".torchrun_launcher.lock",
        ".torchrun_launcher.node1.lock",
    ]
    assert_gone(rank_pids(nodes, [0, 1]))
