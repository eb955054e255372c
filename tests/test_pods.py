"""Kubernetes for real, on one machine: two pods (network namespaces, tests/pods.py), each
with the PET_* variables Kubeflow sets, form ONE world, as plain torchrun does with them.

In each pod the same multirun starts, as a PyTorchJob's (v1) or a TrainJob's (v2) container
command would: `python node_app.py --multirun ... +x=1,2`, with no launcher key about nodes.
Every job of the sweep runs as one world of 4 ranks (2 per pod) over both pods' hostnames.
Plain `torchrun` in the same pods, with the same variables, is the reference: the launcher's
world is the world torchrun makes (the same rank on the same pod). Kubeflow v1's own RANK and
WORLD_SIZE (the pod's index, pods x processes) never reach a rank as its own, not even in a
module the rank imports (`multinode_apps/rank_probe.py`).
"""

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import pytest

from tests import pods as pods_module
from tests.conftest import assert_gone, kill_tree
from tests.pods import Pods
from tests.test_cluster_environments import kubeflow_v1, kubeflow_v2
from tests.test_multinode import APP, Node, base_env, check_job_across_nodes, rank_pids, report

REFERENCE = Path(__file__).parent / "multinode_apps" / "plain_rank.py"
# one pod still running after this long is stuck (a 2-job sweep takes ~40 s here)
WAIT_S = 240

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(pods_module.unavailable() is not None, reason=str(pods_module.unavailable())),
]

# (the pods' hostnames, their DNS aliases, the variables of pod i) of each Kubeflow version
KUBEFLOW: Dict[str, tuple] = {
    "pytorchjob-v1": (["job-master-0", "job-worker-0"], {}, kubeflow_v1),
    "trainjob-v2": (["job-node-0-0", "job-node-0-1"], {"job-node-0-0": ["job-node-0-0.job"]}, kubeflow_v2),
}


def run_in_pods(
    pods: Pods, homes: Sequence[Path], argv: List[str], env_of: Callable[[int], Dict]
) -> List[Node]:
    """`argv` in every pod at once (pod i in homes[i]); waits for all; kills all on a hang."""
    nodes = []
    for index, (pod, home) in enumerate(zip(pods.hostnames, homes)):
        home.mkdir(parents=True)
        with open(home / "stdout.txt", "w") as out, open(home / "stderr.txt", "w") as err:
            proc = subprocess.Popen(
                pods.command(pod, argv),
                cwd=home,
                env={**base_env(), **env_of(index)},
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        nodes.append(Node(index, home, proc, time.monotonic()))
    deadline = time.monotonic() + WAIT_S
    try:
        for node in nodes:
            node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            node.elapsed_s = round(time.monotonic() - node.started, 1)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a pod still runs after {WAIT_S} s\n{report(nodes)}")
    finally:
        for node in nodes:
            kill_tree(node.proc)
    return nodes


def reference_world(pods: Pods, tmp_path: Path, env_of: Callable[[int], Dict]) -> Dict[int, str]:
    """Plain torchrun in both pods: global rank -> the host it ran on."""
    out = tmp_path / "torchrun_ranks"
    argv = [sys.executable, "-m", "torch.distributed.run", str(REFERENCE), str(out)]
    homes = [tmp_path / f"torchrun{i}" for i in range(2)]
    nodes = run_in_pods(pods, homes, argv, env_of)
    assert all(node.proc.returncode == 0 for node in nodes), report(nodes)
    facts = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(facts) == [0, 1, 2, 3], report(nodes)
    world = {rank: f["host"] for rank, f in facts.items()}
    for rank, f in facts.items():
        assert (f["env"]["RANK"], f["env"]["WORLD_SIZE"]) == (str(rank), "4")
        assert {r: h for r, h in f["world"]} == world  # every rank saw the same world
    assert set(world.values()) == set(pods.hostnames)
    return world


@pytest.mark.parametrize("kubeflow", list(KUBEFLOW))
def test_two_pods_make_one_world_as_torchrun_does(tmp_path: Path, kubeflow: str) -> None:
    hostnames, aliases, environ = KUBEFLOW[kubeflow]
    with Pods(hostnames, aliases) as pods:
        reference = reference_world(pods, tmp_path, environ)
        homes = [tmp_path / f"pod{i}" for i in range(2)]
        argv = [sys.executable, str(APP), "--multirun", "hydra/launcher=torchrun", "+x=1,2"]
        argv.insert(3, "hydra.sweep.dir=multirun")
        nodes = run_in_pods(pods, homes, argv, environ)
    for node in nodes:
        assert node.proc.returncode == 0, report(nodes)
        # one line says what was found and what it is used for
        lines = [line for line in node.output().splitlines() if "PET_* variables" in line]
        assert len(lines) == 1, report(nodes)
        assert f"PET_NODE_RANK={node.index}" in lines[0] and f"node_rank={node.index}" in lines[0], lines
    for job, x in enumerate([1, 2]):
        groups = check_job_across_nodes(nodes, job, x=x, nproc=2)
        # static rendezvous, as torchrun with these variables: the group rank is the pod's index
        assert groups == {0: 0, 1: 1}, report(nodes)
        ranks = {rank: f for node in nodes for rank, f in node.ranks(job).items()}
        # the world torchrun makes: the same ranks on the same pods
        assert {rank: f["host"] for rank, f in ranks.items()} == reference, report(nodes)
        for rank, f in ranks.items():
            # a module the rank imports sees the rank's own RANK/WORLD_SIZE, never the pod's
            assert f["at_import"] == {"RANK": str(rank), "WORLD_SIZE": "4"}, (rank, f)
    for node in nodes:
        # every rank printed its RANK/WORLD_SIZE and host (console lines of rank r: "[default<r>]:...")
        for rank in (2 * node.index, 2 * node.index + 1):
            assert f"rank {rank}/4 on {hostnames[node.index]}" in node.output(), report(nodes)
    assert_gone(rank_pids(nodes, [0, 1]))


def test_a_pod_without_the_master_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    """A half-set environment: PET_NNODES=2 but no PET_MASTER_ADDR."""

    def environ(i: int) -> Dict[str, str]:
        return {k: v for k, v in kubeflow_v2(i).items() if k != "PET_MASTER_ADDR"}

    home = tmp_path / "pod"
    home.mkdir()
    argv = [
        sys.executable,
        str(APP),
        "--multirun",
        "hydra/launcher=torchrun",
        "hydra.sweep.dir=multirun",
        "+x=1",
    ]
    result = subprocess.run(
        argv, cwd=home, env={**base_env(), **environ(1)}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "PET_NNODES=2 but PET_MASTER_ADDR not set" in result.stderr, result.stderr
    assert not (home / "multirun" / "0" / "ranks").exists()
