"""`cluster: auto | slurm | none` over simulated SLURM environments (no SLURM needed).

SLURM's hostlists are expanded by SLURM's own `scontrol show hostnames`; here a fake
`scontrol` on PATH (a script in tmp_path) answers as SLURM 22.05 does for the lists the
tests use, and records how it was called.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from hydra_plugins.hydra_torchrun_launcher._launcher.cluster import (
    PORT_BASE,
    PORT_SPAN,
    apply_layout,
    derived_port,
    detect,
    inspect_environment,
    resolve_cluster,
)
from hydra_plugins.hydra_torchrun_launcher._launcher.settings import JobSettings, LauncherConfigError
from hydra_plugins.hydra_torchrun_launcher.config import TorchrunLauncherConf

JOB = "4242"


def allocation(nodelist: str = "node[01-02]", nnodes: int = 2) -> Dict[str, str]:
    """What an salloc shell has: the job's variables, no step."""
    return {
        "SLURM_JOB_ID": JOB,
        "SLURM_JOBID": JOB,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_NNODES": str(nnodes),
        "SLURM_JOB_NUM_NODES": str(nnodes),
        "SLURM_TASKS_PER_NODE": f"1(x{nnodes})",
    }


def batch_script(nodelist: str = "node[01-02]", nnodes: int = 2) -> Dict[str, str]:
    """What the batch script has: the job's variables, task ids of its own, no SLURM_STEP_ID."""
    env = allocation(nodelist, nnodes)
    env.update(
        ENVIRONMENT="BATCH",
        SLURM_NODEID="0",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURMD_NODENAME="node01",
        SLURM_NTASKS=str(nnodes),
    )
    return env


def step_task(
    node_id: int,
    nodes=("node01", "node02"),
    step_nodelist: str = "node[01-02]",
    job_nodelist: str = "node[01-02]",
    step_id: int = 0,
    tasks_per_node: int = 1,
    local_id: int = 0,
) -> Dict[str, str]:
    """What a task of `srun --ntasks-per-node=N` has on node `node_id` of the step."""
    nnodes = len(nodes)
    env = allocation(job_nodelist, nnodes)
    ntasks = nnodes * tasks_per_node
    env.update(
        SLURM_STEP_ID=str(step_id),
        SLURM_STEPID=str(step_id),
        SLURM_STEP_NODELIST=step_nodelist,
        SLURM_STEP_NUM_NODES=str(nnodes),
        SLURM_STEP_NUM_TASKS=str(ntasks),
        SLURM_STEP_TASKS_PER_NODE=f"{tasks_per_node}(x{nnodes})",
        SLURM_NTASKS=str(ntasks),
        SLURM_NODEID=str(node_id),
        SLURM_PROCID=str(node_id * tasks_per_node + local_id),
        SLURM_LOCALID=str(local_id),
        SLURMD_NODENAME=nodes[node_id],
    )
    return env


# what SLURM 22.05's `scontrol show hostnames LIST` prints for the lists the tests use
_HOSTNAMES = {
    "node[01-02]": ["node01", "node02"],
    "node[01-04]": ["node01", "node02", "node03", "node04"],
    "node[03-04]": ["node03", "node04"],
    "cn[5-6]": ["cn5", "cn6"],
    "node[01-03,07],gpu-a[1-2]": ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"],
}
_FAKE_SCONTROL = """#!{python}
import json, sys
with open({calls!r}, "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
answers = {answers!r}
if sys.argv[1:3] == ["show", "hostnames"] and len(sys.argv) == 4 and sys.argv[3] in answers:
    print("\\n".join(answers[sys.argv[3]]))
    sys.exit(0)
print("scontrol: error: Unable to create hostlist from %s" % sys.argv[-1], file=sys.stderr)
sys.exit(1)
"""


@pytest.fixture(autouse=True)
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake `scontrol` first on PATH; returns the file where it records its argv, call by call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls.jsonl"
    calls.touch()
    script = bin_dir / "scontrol"
    script.write_text(_FAKE_SCONTROL.format(python=sys.executable, calls=str(calls), answers=_HOSTNAMES))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return calls


def scontrol_calls(calls: Path) -> List[List[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()]


def settings(conf: TorchrunLauncherConf) -> JobSettings:
    return JobSettings(conf=conf, min_nodes=1, max_nodes=1, rdzv_conf={}, local_ranks_filter=None)


# --- detection ---


@pytest.mark.parametrize("node_id", [0, 1])
def test_srun_step_on_two_nodes(node_id):
    layout = detect("auto", step_task(node_id))
    assert layout is not None
    port = derived_port(f"{JOB}.0")
    assert (layout.nnodes, layout.node_rank) == (2, node_id)
    assert layout.master_addr == "node01"
    assert layout.rdzv_endpoint == f"node01:{port}"
    assert layout.rdzv_id == f"slurm-{JOB}.0"
    assert layout.nodes == ("node01", "node02")
    assert f"SLURM job {JOB} step 0" in layout.description


def test_every_node_of_a_step_agrees_and_other_steps_differ():
    layouts = [detect("auto", step_task(i)) for i in (0, 1)]
    assert len({(lo.rdzv_endpoint, lo.rdzv_id) for lo in layouts}) == 1
    other_step = detect("auto", step_task(0, step_id=1))
    assert other_step.rdzv_id != layouts[0].rdzv_id
    assert other_step.port != layouts[0].port
    assert all(
        PORT_BASE <= derived_port(f"{j}.{s}") < PORT_BASE + PORT_SPAN for j in range(50) for s in (0, 3)
    )


def test_a_requeued_job_meets_a_new_rendezvous_on_every_node():
    first = detect("auto", step_task(0))
    requeued = [detect("auto", {**step_task(i), "SLURM_RESTART_COUNT": "1"}) for i in (0, 1)]
    assert len({(lo.rdzv_endpoint, lo.rdzv_id) for lo in requeued}) == 1
    assert requeued[0].rdzv_id == f"slurm-{JOB}.0.restart1" != first.rdzv_id
    assert requeued[0].port != first.port


def test_nodelist_with_brackets_is_expanded_by_scontrol(fake_scontrol):
    nodes = ("node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2")
    nodelist = "node[01-03,07],gpu-a[1-2]"
    layout = detect("auto", step_task(4, nodes=nodes, step_nodelist=nodelist, job_nodelist=nodelist))
    assert layout.nodes == nodes
    assert (layout.nnodes, layout.node_rank, layout.master_addr) == (6, 4, "node01")
    # SLURM's own command, one argv (no shell); a list is expanded once per process
    assert scontrol_calls(fake_scontrol) == [["show", "hostnames", nodelist]]
    detect("auto", step_task(4, nodes=nodes, step_nodelist=nodelist, job_nodelist=nodelist))
    assert len(scontrol_calls(fake_scontrol)) == 1


def test_plain_nodelists_need_no_scontrol(fake_scontrol, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    env = step_task(1, nodes=("a1", "b2"), step_nodelist="a1,b2", job_nodelist="a1,b2")
    assert detect("auto", env).nodes == ("a1", "b2")
    assert scontrol_calls(fake_scontrol) == []


def test_a_hostlist_without_scontrol_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LauncherConfigError, match=r"^SLURM_STEP_NODELIST='node\[01-02\]' .*`scontrol`") as e:
        detect("auto", step_task(0))
    assert "not on PATH" in str(e.value) and "cluster=none" in str(e.value) and "\n" not in str(e.value)


def test_a_hostlist_scontrol_refuses_names_the_variable_and_scontrols_reason():
    env = step_task(0, job_nodelist="node[01-09]")
    culprit = r"^SLURM_JOB_NODELIST='node\[01-09\]': `scontrol show"
    with pytest.raises(LauncherConfigError, match=culprit) as e:
        detect("auto", env)
    assert "Unable to create hostlist from node[01-09]" in str(e.value) and "\n" not in str(e.value)


def test_step_nodelist_wins_over_the_job_nodelist():
    # a 2-node step inside a 4-node job: the step's nodes, the step's count
    env = step_task(1, nodes=("node03", "node04"), step_nodelist="node[03-04]", job_nodelist="node[01-04]")
    env["SLURM_NNODES"] = "4"  # what `srun --preserve-env` leaves
    layout = detect("auto", env)
    assert (layout.nnodes, layout.node_rank, layout.master_addr) == (2, 1, "node03")


@pytest.mark.parametrize("cluster", ["auto", "none"])
def test_no_slurm_at_all_is_single_node_and_silent(cluster):
    found = inspect_environment(cluster, {"PATH": "/usr/bin"})
    assert found.layout is None and found.note is None


@pytest.mark.parametrize("env", [allocation(), batch_script()], ids=["salloc-shell", "batch-script"])
def test_salloc_shell_and_batch_script_run_single_node(env):
    found = inspect_environment("auto", env)
    assert found.layout is None
    assert "single-node" in found.note and "srun --ntasks-per-node=1" in found.note


@pytest.mark.parametrize(
    "step_id", [0xFFFFFFFA, 0xFFFFFFFB, 0xFFFFFFFC], ids=["interactive", "batch", "extern"]
)
def test_special_steps_are_not_srun_steps(step_id):
    env = step_task(0, step_id=step_id)
    found = inspect_environment("auto", env)
    assert found.layout is None and "special step" in found.note
    with pytest.raises(LauncherConfigError, match="SLURM_STEP_ID=4294967"):
        detect("slurm", env)


def test_one_node_step_runs_single_node():
    # `srun --pty bash` and the like: a step, but of one node
    env = step_task(0, nodes=("node01",), step_nodelist="node01", job_nodelist="node[01-02]")
    found = inspect_environment("slurm", env)
    assert found.layout is None and "single-node" in found.note


def test_variables_of_another_step_are_not_taken():
    # a batch script whose job was submitted from inside a step of another job
    env = batch_script(nodelist="cn[5-6]")
    env.update(
        SLURMD_NODENAME="cn5", SLURM_STEP_ID="3", SLURM_STEP_NODELIST="node[01-02]", SLURM_STEP_NUM_NODES="2"
    )
    found = inspect_environment("auto", env)
    assert found.layout is None and "SLURMD_NODENAME=cn5" in found.note
    del env["SLURMD_NODENAME"]
    found = inspect_environment("auto", env)
    assert found.layout is None and "not in SLURM_JOB_NODELIST" in found.note


def test_cluster_none_ignores_even_a_step():
    found = inspect_environment("none", step_task(1))
    assert found.layout is None and "cluster=none" in found.note


@pytest.mark.parametrize("env", [{}, allocation(), batch_script()], ids=["no-slurm", "salloc-shell", "batch"])
def test_cluster_slurm_outside_a_step_is_an_error(env):
    with pytest.raises(
        LauncherConfigError, match=r"^hydra\.launcher\.cluster=slurm .*SLURM_STEP_ID is not set"
    ):
        detect("slurm", env)


def test_cluster_slurm_in_a_step_detects():
    assert detect("slurm", step_task(1)).node_rank == 1


@pytest.mark.parametrize("cluster", ["auto", "slurm"])
@pytest.mark.parametrize("local_id", [0, 1])
def test_two_tasks_per_node_is_refused(cluster, local_id):
    env = step_task(0, tasks_per_node=2, local_id=local_id)
    with pytest.raises(
        LauncherConfigError, match=r"^SLURM_STEP_TASKS_PER_NODE=2\(x2\).*--ntasks-per-node=1"
    ) as e:
        detect(cluster, env)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, culprit",
    [
        ({"SLURM_STEP_NODELIST": "node[01-"}, "SLURM_STEP_NODELIST"),
        ({"SLURM_STEP_NODELIST": "node01,,"}, "SLURM_STEP_NODELIST"),
        ({"SLURM_STEP_NUM_NODES": "3"}, "SLURM_STEP_NODELIST"),
        ({"SLURM_STEP_NUM_NODES": "two"}, "SLURM_STEP_NUM_NODES"),
        ({"SLURM_NODEID": "2", "SLURMD_NODENAME": ""}, "SLURM_NODEID"),
        ({"SLURM_STEP_ID": "x"}, "SLURM_STEP_ID"),
    ],
)
def test_malformed_step_variables_name_the_variable(change, culprit):
    env = {**step_task(0), **change}
    with pytest.raises(LauncherConfigError, match=f"^{culprit}=") as e:
        detect("auto", env)
    assert "\n" not in str(e.value)


def test_unknown_cluster_value_is_refused():
    with pytest.raises(LauncherConfigError, match=r"^hydra\.launcher\.cluster='pbs'"):
        detect("pbs", {})


# --- applying what was detected ---


def test_defaults_take_the_detected_values():
    layout = detect("auto", step_task(1))
    conf = apply_layout(TorchrunLauncherConf(), layout)
    assert (conf.nnodes, conf.node_rank) == (2, 1)
    assert (conf.rdzv_backend, conf.rdzv_endpoint) == ("c10d", layout.rdzv_endpoint)
    assert conf.rdzv_id == f"slurm-{JOB}.0"


def test_explicit_settings_win():
    layout = detect("auto", step_task(1))
    mine = TorchrunLauncherConf(nnodes="2:4", node_rank=5, rdzv_endpoint="head:29400", rdzv_id="exp7")
    conf = apply_layout(mine, layout)
    assert (conf.nnodes, conf.node_rank, conf.rdzv_endpoint, conf.rdzv_id) == ("2:4", 5, "head:29400", "exp7")
    assert conf.rdzv_backend == "c10d"


def test_master_addr_and_port_set_by_the_user_make_the_endpoint():
    layout = detect("auto", step_task(0))
    assert apply_layout(TorchrunLauncherConf(master_port=29555), layout).rdzv_endpoint == "node01:29555"
    conf = apply_layout(TorchrunLauncherConf(master_addr="10.0.0.9"), layout)
    assert conf.rdzv_endpoint == f"10.0.0.9:{layout.port}"


def test_another_backend_keeps_its_endpoint_unset():
    layout = detect("auto", step_task(0))
    conf = apply_layout(TorchrunLauncherConf(rdzv_backend="etcd-v2"), layout)
    assert (conf.rdzv_backend, conf.rdzv_endpoint, conf.nnodes) == ("etcd-v2", "", 2)


def test_standalone_stays_single_node():
    layout = detect("auto", step_task(1))
    mine = TorchrunLauncherConf(standalone=True)
    assert apply_layout(mine, layout) == mine
    job, line = resolve_cluster(settings(mine), step_task(1))
    assert job.conf == mine and "standalone=true" in line


def test_apply_layout_returns_a_copy():
    original = TorchrunLauncherConf()
    apply_layout(original, detect("auto", step_task(1)))
    assert original == TorchrunLauncherConf()


# --- the one call the launcher makes, and its one log line ---


def test_resolve_cluster_updates_settings_and_says_what_it_used():
    job, line = resolve_cluster(settings(TorchrunLauncherConf(nnodes="1")), step_task(1))
    assert (job.min_nodes, job.max_nodes, job.conf.node_rank) == (2, 2, 1)
    port = derived_port(f"{JOB}.0")
    assert line.startswith(f"SLURM job {JOB} step 0: 2 node(s) node[01-02], this is node 1 (node02)")
    assert f"rdzv_endpoint=node01:{port}" in line and "(yours)" not in line
    assert "\n" not in line


def test_resolve_cluster_marks_the_users_own_keys():
    mine = dataclasses.replace(TorchrunLauncherConf(), nnodes=3)
    job, line = resolve_cluster(settings(mine), step_task(0))
    assert (job.min_nodes, job.max_nodes) == (3, 3)
    assert "nnodes=3 (yours)" in line and "node_rank=0," in line


@pytest.mark.parametrize("env", [{}, allocation()], ids=["no-slurm", "salloc-shell"])
def test_resolve_cluster_single_node_leaves_settings_alone(env):
    job = settings(TorchrunLauncherConf())
    resolved, line = resolve_cluster(job, env)
    assert resolved is job
    assert (line is None) == (not env)


def test_keys_the_user_gave_stay_the_users_even_at_their_default():
    # `hydra.launcher.nnodes=1 hydra.launcher.node_rank=0` inside a 2-node step: one node, as asked
    job, line = resolve_cluster(settings(TorchrunLauncherConf()), step_task(1), {"nnodes", "node_rank"})
    assert (job.min_nodes, job.max_nodes, job.conf.node_rank) == (1, 1, 0)
    assert "nnodes=1 (yours)" in line and "node_rank=0 (yours)" in line
