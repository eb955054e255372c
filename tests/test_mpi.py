"""MPI for real: Debian's Open MPI `mpirun` starts two launchers on this host, one world.

`mpirun -np 2 python node_app.py --multirun ...` with no launcher key about nodes: each
launcher takes its node rank and the node count from Open MPI's variables, the rendezvous
(127.0.0.1, every launcher being on this host) and its port from the MPI job's id, and
every job of the sweep runs as one world of 2 x 2 ranks. Each launcher keeps its own sweep
dir (`node${oc.env:OMPI_COMM_WORLD_RANK}`), as two hosts' disks would.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import assert_gone, kill_tree
from tests.test_multinode import APP, Node, base_env, check_job_across_nodes, rank_pids, report

WAIT_S = 240

pytestmark = [
    pytest.mark.timeout(360),
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun: apt-get install openmpi-bin"),
]


def test_mpirun_starts_two_launchers_that_make_one_world(tmp_path: Path) -> None:
    for index in (0, 1):
        (tmp_path / f"node{index}").mkdir()
    sweep = [
        str(APP),
        "--multirun",
        "hydra/launcher=torchrun",
        f"hydra.sweep.dir={tmp_path}/node${{oc.env:OMPI_COMM_WORLD_RANK}}/multirun",
        "hydra.launcher.nproc_per_node=2",
        "+x=1,2",
    ]
    # each launcher's output in its node dir, as a host's own log would be
    per_rank_output = 'cd node$OMPI_COMM_WORLD_RANK && exec "$@" >stdout.txt 2>stderr.txt'
    command = [
        "mpirun",
        "--oversubscribe",
        "--allow-run-as-root",
        "--bind-to",
        "none",
        "-np",
        "2",
        "sh",
        "-c",
        per_rank_output,
        "sh",
        sys.executable,
        *sweep,
    ]
    started = time.monotonic()
    mpirun = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        mpirun_output, _ = mpirun.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        kill_tree(mpirun)
        pytest.fail(f"mpirun still runs after {WAIT_S} s")
    elapsed = round(time.monotonic() - started, 1)
    nodes = [Node(i, tmp_path / f"node{i}", mpirun, started, elapsed_s=elapsed) for i in (0, 1)]
    assert mpirun.returncode == 0, f"{mpirun_output}\n{report(nodes)}"
    for node in nodes:
        lines = [line for line in node.output().splitlines() if "Open MPI job" in line]
        assert len(lines) == 1, report(nodes)
        assert f"2 launcher(s), this is launcher {node.index}, all on this host" in lines[0], lines
        assert "nnodes=2" in lines[0] and "rdzv_endpoint=127.0.0.1:" in lines[0], lines
    for job, x in enumerate([1, 2]):
        groups = check_job_across_nodes(nodes, job, x=x, nproc=2)
        assert sorted(groups.values()) == [0, 1], report(nodes)
    assert_gone(rank_pids(nodes, [0, 1]))
