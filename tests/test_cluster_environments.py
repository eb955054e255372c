"""`cluster` beyond SLURM: torchrun's PET_* variables (Kubernetes), MPI and LSF, as unit tests.

The variables are those Kubeflow's PyTorchJob (v1) and TrainJob (v2) set in each pod, that
Open MPI's mpirun and MPICH's set in each rank, and that LSF and jsrun set (with rank files
generated here). What they give and what they refuse is checked without starting anything;
tests/test_pods.py and tests/test_mpi.py run real processes.
"""

import dataclasses
from pathlib import Path
from typing import Dict, Optional

import pytest

from hydra_plugins.hydra_torchrun_launcher._launcher.cluster import (
    derived_port,
    detect,
    inspect_environment,
    resolve_cluster,
)
from hydra_plugins.hydra_torchrun_launcher._launcher.cluster_pet import PET_KEYS, read_here
from hydra_plugins.hydra_torchrun_launcher._launcher.settings import JobSettings, LauncherConfigError
from hydra_plugins.hydra_torchrun_launcher.config import TORCHRUN_FLAGS, TorchrunLauncherConf


def settings(conf: Optional[TorchrunLauncherConf] = None) -> JobSettings:
    conf = conf or TorchrunLauncherConf()
    return JobSettings(conf=conf, min_nodes=1, max_nodes=1, rdzv_conf={}, local_ranks_filter=None)


def kubeflow_v1(pod: int, pods: int = 2, nproc: int = 2) -> Dict[str, str]:
    """A PyTorchJob (training-operator v1) pod: pod 0 the master, the others workers."""
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456",
        "WORLD_SIZE": str(pods * nproc),
        "RANK": str(pod),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(pod),
        "PET_NNODES": str(pods),
    }


def kubeflow_v2(pod: int, pods: int = 2, nproc: str = "2") -> Dict[str, str]:
    """A TrainJob (Kubeflow Trainer v2) pod: the Torch plugin's PET_* only."""
    return {
        "PET_NNODES": str(pods),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(pod),
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }


def kubeflow_v1_elastic(pod: int) -> Dict[str, str]:
    """A PyTorchJob with an elasticPolicy: a c10d rendezvous, nnodes MIN:MAX."""
    return {
        "PET_RDZV_ENDPOINT": "job-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:3",
        "PET_MAX_RESTARTS": "3",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_ID": "job-42",
        "PET_RDZV_CONF": "join_timeout=60,last_call_timeout=5",
    }


# --- PET_*: the variables torchrun reads ---


def test_pet_keys_are_the_launcher_keys_torchrun_reads_from_pet_variables():
    from torch.distributed.argparse_util import check_env, env
    from torch.distributed.run import get_args_parser

    read_from_pet = {
        action.dest
        for action in get_args_parser()._actions
        if isinstance(action, (env, check_env)) and action.dest in TORCHRUN_FLAGS
    }
    # exactly what the installed torchrun reads; PET_KEYS also has what a newer one reads
    assert set(read_here()) == read_from_pet <= set(PET_KEYS), set(read_here()) ^ read_from_pet
    assert set(TORCHRUN_FLAGS) <= {f.name for f in dataclasses.fields(TorchrunLauncherConf)}


@pytest.mark.parametrize("pod", [0, 1])
@pytest.mark.parametrize("environ", [kubeflow_v1, kubeflow_v2], ids=["pytorchjob-v1", "trainjob-v2"])
def test_kubeflow_pods_take_nnodes_node_rank_and_the_master(environ, pod):
    job, line = resolve_cluster(settings(), environ(pod))
    conf = job.conf
    assert (job.min_nodes, job.max_nodes, conf.nproc_per_node, conf.node_rank) == (2, 2, 2, pod)
    assert (conf.rdzv_backend, conf.rdzv_endpoint) == ("static", "")  # torchrun's default, as torchrun
    assert conf.master_addr == environ(pod)["PET_MASTER_ADDR"]
    assert conf.master_port == int(environ(pod)["PET_MASTER_PORT"])
    assert line.startswith("torchrun's PET_* variables PET_NNODES=2, PET_NPROC_PER_NODE=2, ")
    assert f"node_rank={pod}" in line and "(yours)" not in line and "\n" not in line


def test_the_pods_rank_and_world_size_are_said_to_be_no_ranks_own():
    _, line = resolve_cluster(settings(), kubeflow_v1(1))
    assert "RANK=1, WORLD_SIZE=4 are no rank's own" in line
    _, line = resolve_cluster(settings(), kubeflow_v2(1))
    assert "RANK" not in line.replace("NODE_RANK", "")


def test_an_elastic_pytorchjob_meets_over_c10d_with_its_values():
    job, line = resolve_cluster(settings(), kubeflow_v1_elastic(0))
    conf = job.conf
    assert (job.min_nodes, job.max_nodes) == (1, 3)
    assert (conf.rdzv_backend, conf.rdzv_endpoint, conf.rdzv_id) == ("c10d", "job-worker-0:23456", "job-42")
    assert conf.max_restarts == 3
    assert job.rdzv_conf == {"join_timeout": "60", "last_call_timeout": "5"}


def test_keys_the_user_set_win_over_the_variables_and_the_line_says_so():
    mine = dataclasses.replace(TorchrunLauncherConf(), nproc_per_node=4)
    job, line = resolve_cluster(settings(mine), kubeflow_v1(1), {"node_rank"})
    # nproc_per_node differs from the default, node_rank was given on the command line
    assert (job.conf.nproc_per_node, job.conf.node_rank, job.conf.nnodes) == (4, 0, 2)
    assert "nproc_per_node=4 (yours)" in line and "node_rank=0 (yours)" in line and "nnodes=2," in line


def test_variables_win_over_the_plugins_defaults_of_every_kind():
    environ = {
        "PET_NNODES": "1",
        "PET_MONITOR_INTERVAL": "2.5",
        "PET_START_METHOD": "spawn",
        "PET_STANDALONE": "1",
        "PET_TEE": "0",
        "PET_LOCAL_RANKS_FILTER": "0",
    }
    conf = resolve_cluster(settings(), environ)[0].conf
    assert (conf.monitor_interval, conf.start_method, conf.standalone) == (2.5, "spawn", True)
    assert (conf.tee, conf.local_ranks_filter) == ("0", "0")


# what torchrun reads from PET_ from one release on (2.8, 2.10, 2.12, 2.15), as each key's value
NEWER = {
    "event_log_handler": ("PET_EVENT_LOG_HANDLER", "console", "console"),
    "virtual_local_rank": ("PET_VIRTUAL_LOCAL_RANK", "0", False),
    "duplicate_stdout_filters": ("PET_DUPLICATE_STDOUT_FILTERS", "loss,step", ["loss", "step"]),
    "shutdown_timeout": ("PET_SHUTDOWN_TIMEOUT", "9", 9),
    "log_line_prefix_template": ("PET_LOG_LINE_PREFIX_TEMPLATE", "[${rank}] ", "[${rank}] "),
}


def test_a_variable_the_installed_torchrun_does_not_read_is_ignored_as_it_ignores_it():
    environ = {"PET_NPROC_PER_NODE": "2", **{name: text for name, text, _ in NEWER.values()}}
    conf, line = resolve_cluster(settings(), environ)
    unread = [NEWER[key][0] for key in PET_KEYS if key in NEWER and key not in read_here()]
    for key, (name, _, value) in NEWER.items():
        assert getattr(conf.conf, key) == (
            getattr(TorchrunLauncherConf(), key) if name in unread else value
        ), key
    assert conf.conf.nproc_per_node == 2
    if unread:
        assert line is not None and line.startswith(
            f"{', '.join(unread)} ignored: the installed torchrun does not read "
            f"{'it' if len(unread) == 1 else 'them'} (a newer one does); torchrun's PET_* variables "
        ), line
    else:
        assert line is not None and "ignored" not in line, line


def test_an_empty_variable_is_set_as_torchrun_reads_it():
    """torchrun takes an empty PET_ variable as given: an empty role, an int that is not one."""
    conf = resolve_cluster(settings(), {"PET_ROLE": ""})[0].conf
    assert conf.role == ""
    with pytest.raises(LauncherConfigError, match=r"^PET_MAX_RESTARTS='' is not an int"):
        resolve_cluster(settings(), {"PET_MAX_RESTARTS": ""})


@pytest.mark.parametrize(
    "change, line",
    [
        ({"PET_NODE_RANK": "one"}, r"^PET_NODE_RANK='one' is not an int \(torchrun reads it as --node-rank"),
        ({"PET_NODE_RANK": "-1"}, r"^PET_NODE_RANK='-1': hydra\.launcher\.node_rank=-1 is invalid"),
        ({"PET_NNODES": "2:1"}, r"^PET_NNODES='2:1': hydra\.launcher\.nnodes='2:1' is invalid"),
        ({"PET_START_METHOD": "thread"}, r"^PET_START_METHOD='thread': hydra\.launcher\.start_method="),
        ({"PET_STANDALONE": "yes"}, r"^PET_STANDALONE='yes' is not 0 or 1"),
        ({"PET_MASTER_PORT": "70000"}, r"^PET_MASTER_PORT='70000': hydra\.launcher\.master_port=70000"),
    ],
)
def test_a_bad_variable_is_refused_in_one_line_naming_it(change, line):
    with pytest.raises(LauncherConfigError, match=line) as e:
        resolve_cluster(settings(), {**kubeflow_v2(1), **change})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "drop, missing",
    [
        (("PET_MASTER_ADDR",), "PET_MASTER_ADDR not set"),
        (("PET_MASTER_PORT",), "PET_MASTER_PORT not set"),
        (("PET_MASTER_ADDR", "PET_MASTER_PORT"), "PET_MASTER_ADDR and PET_MASTER_PORT not set"),
    ],
)
def test_a_half_set_pod_is_refused_before_any_rank_starts(drop, missing):
    environ = {k: v for k, v in kubeflow_v2(1).items() if k not in drop}
    with pytest.raises(LauncherConfigError, match=f"^PET_NNODES=2 but {missing}") as e:
        resolve_cluster(settings(), environ)
    assert "hydra.launcher.master_addr" in str(e.value) and "\n" not in str(e.value)


def test_a_half_set_c10d_pod_is_refused_naming_the_endpoint():
    environ = {k: v for k, v in kubeflow_v1_elastic(0).items() if k != "PET_RDZV_ENDPOINT"}
    with pytest.raises(LauncherConfigError, match=r"^PET_NNODES=1:3 with rdzv_backend=c10d but no PET_RDZV"):
        resolve_cluster(settings(), environ)


def test_the_users_endpoint_completes_a_half_set_pod():
    environ = {k: v for k, v in kubeflow_v2(1).items() if not k.startswith("PET_MASTER")}
    mine = dataclasses.replace(TorchrunLauncherConf(), master_addr="head", master_port=29500)
    job, _ = resolve_cluster(settings(mine), environ)
    assert (job.conf.master_addr, job.conf.master_port, job.max_nodes) == ("head", 29500, 2)


def test_cluster_pet_requires_the_variables_and_none_ignores_them():
    with pytest.raises(LauncherConfigError, match=r"^hydra\.launcher\.cluster=pet needs torchrun's PET_\*"):
        resolve_cluster(settings(dataclasses.replace(TorchrunLauncherConf(), cluster="pet")), {})
    off = settings(dataclasses.replace(TorchrunLauncherConf(), cluster="none"))
    job, line = resolve_cluster(off, kubeflow_v1(1))
    assert job is off and "PET_NNODES" in line and "ignored (hydra.launcher.cluster=none)" in line


# --- MPI ---


def open_mpi(rank: int, size: int = 2, local_size: int = 2, jobid: str = "1328676865") -> Dict[str, str]:
    """What Open MPI 4.1's mpirun sets in each process (the part read here)."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_MCA_ess_base_jobid": jobid,
        "PMIX_NAMESPACE": jobid,
        "PMIX_RANK": str(rank),
    }


def mpich(rank: int, size: int = 2, local_size: int = 1) -> Dict[str, str]:
    """What MPICH's Hydra mpiexec sets (PMI-1): no job id."""
    return {
        "PMI_RANK": str(rank),
        "PMI_SIZE": str(size),
        "PMI_FD": "5",
        "MPI_LOCALRANKID": "0",
        "MPI_LOCALNRANKS": str(local_size),
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_mpirun_on_one_host_makes_a_world_without_any_key(rank):
    job, line = resolve_cluster(settings(), open_mpi(rank))
    port = derived_port("mpi-1328676865")
    assert (job.max_nodes, job.conf.node_rank, job.conf.rdzv_backend) == (2, rank, "c10d")
    assert (job.conf.rdzv_endpoint, job.conf.rdzv_id) == (f"127.0.0.1:{port}", "mpi-1328676865")
    assert line.startswith(f"Open MPI job 1328676865: 2 launcher(s), this is launcher {rank}, all on this")


def test_mpirun_across_hosts_needs_the_rendezvous_host():
    environ = open_mpi(1, size=4, local_size=1)
    with pytest.raises(LauncherConfigError, match=r"set hydra\.launcher\.master_addr .*rdzv_endpoint") as e:
        resolve_cluster(settings(), environ)
    assert "which host node 0 is" in str(e.value) and "\n" not in str(e.value)
    mine = dataclasses.replace(TorchrunLauncherConf(), master_addr="n0")
    job, line = resolve_cluster(settings(mine), environ)
    assert job.conf.rdzv_endpoint == f"n0:{derived_port('mpi-1328676865')}" and job.conf.node_rank == 1


def test_mpich_without_a_job_id_needs_a_port_too():
    mine = dataclasses.replace(TorchrunLauncherConf(), master_addr="n0")
    with pytest.raises(LauncherConfigError, match=r"no job id .* set hydra\.launcher\.master_port"):
        resolve_cluster(settings(mine), mpich(1))
    mine = dataclasses.replace(TorchrunLauncherConf(), rdzv_endpoint="n0:29400")
    job, line = resolve_cluster(settings(mine), mpich(1))
    assert (job.conf.rdzv_endpoint, job.conf.node_rank, job.max_nodes) == ("n0:29400", 1, 2)
    assert line.startswith("MPICH job: 2 launcher(s), this is launcher 1")


def test_one_mpi_process_is_single_node_and_cluster_mpi_outside_mpirun_is_an_error():
    found = inspect_environment("auto", open_mpi(0, size=1, local_size=1))
    assert found.layout is None and "single-node" in found.note
    with pytest.raises(LauncherConfigError, match=r"^hydra\.launcher\.cluster=mpi needs .*mpirun -np"):
        detect("mpi", {})


@pytest.mark.parametrize("drop", ["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"])
def test_half_of_an_mpi_jobs_variables_is_refused_not_run_single_node(drop):
    environ = {k: v for k, v in open_mpi(1).items() if k != drop}
    with pytest.raises(LauncherConfigError, match=rf"^OMPI_COMM_WORLD_\w+ is set but {drop} is not") as e:
        resolve_cluster(settings(), environ)
    assert "cluster=none to ignore MPI" in str(e.value) and "\n" not in str(e.value)
    note = inspect_environment("none", environ).note
    assert note.startswith("an Open MPI job (OMPI_COMM_WORLD_") and note.endswith(
        "ignored (hydra.launcher.cluster=none)"
    )


def test_a_bad_mpi_variable_names_it():
    with pytest.raises(LauncherConfigError, match=r"^OMPI_COMM_WORLD_RANK=2 is not a rank of"):
        detect("auto", open_mpi(2))


# --- LSF ---


def rank_file(tmp_path: Path, lines) -> str:
    path = tmp_path / "rankfile"
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def jsrun_task(tmp_path: Path, rank: int, size: int = 2, lines=None) -> Dict[str, str]:
    """A task of `jsrun -n2 -r1 -a1` in LSF job 777 on Summit-like hosts: the rank file lists
    the launch node once, then one line per slot of each compute host."""
    lines = lines or ["batch1", *["h01"] * 4, *["h02"] * 4]
    return {
        "LSB_JOBID": "777",
        "LSB_DJOB_RANKFILE": rank_file(tmp_path, lines),
        "JSM_NAMESPACE_RANK": str(rank),
        "JSM_NAMESPACE_SIZE": str(size),
        "JSM_NAMESPACE_LOCAL_RANK": "0",
        "JSM_NAMESPACE_LOCAL_SIZE": "1",
        # jsrun starts its tasks through PMIx and sets MPI's variables as well
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_jsrun_tasks_meet_at_the_first_compute_host(tmp_path, rank):
    layout = detect("auto", jsrun_task(tmp_path, rank))
    assert layout.source == "LSF" and layout.nodes == ("h01", "h02")
    assert (layout.nnodes, layout.node_rank, layout.master_addr) == (2, rank, "h01")
    assert layout.rdzv_endpoint == f"h01:{derived_port('lsf-777')}" and layout.rdzv_id == "lsf-777"
    job, line = resolve_cluster(settings(), jsrun_task(tmp_path, rank))
    assert line.startswith(f"LSF job 777: 2 jsrun task(s) on 2 compute host(s), this is task {rank}")


def test_an_array_element_has_a_rendezvous_of_its_own(tmp_path):
    element = detect("auto", {**jsrun_task(tmp_path, 0), "LSB_JOBINDEX": "3"})
    assert element.rdzv_id == "lsf-777[3]" and element.port == derived_port("lsf-777[3]")


def test_the_batch_script_of_an_lsf_job_runs_single_node(tmp_path):
    environ = {"LSB_JOBID": "777", "LSB_DJOB_RANKFILE": rank_file(tmp_path, ["batch1", "h01"])}
    found = inspect_environment("auto", environ)
    assert found.layout is None and "single-node" in found.note and "jsrun -n" in found.note
    with pytest.raises(LauncherConfigError, match=r"^hydra\.launcher\.cluster=lsf needs .*JSM_NAMESPACE_"):
        detect("lsf", environ)


@pytest.mark.parametrize(
    "change, line",
    [
        ({"LSB_DJOB_RANKFILE": ""}, r"^LSB_DJOB_RANKFILE is not set"),
        ({"LSB_DJOB_RANKFILE": "/nonexistent/rankfile"}, r"^LSB_DJOB_RANKFILE='/nonexistent/rankfile' "),
        ({"JSM_NAMESPACE_RANK": "x"}, r"^JSM_NAMESPACE_RANK='x' is not a count or index"),
        ({"JSM_NAMESPACE_RANK": "2"}, r"^JSM_NAMESPACE_RANK=2 is not a rank of JSM_NAMESPACE_SIZE=2"),
    ],
)
def test_bad_lsf_variables_name_the_variable(tmp_path, change, line):
    with pytest.raises(LauncherConfigError, match=line) as e:
        detect("auto", {**jsrun_task(tmp_path, 0), **change})
    assert "cluster=none" in str(e.value) and "\n" not in str(e.value)


def test_a_jsrun_task_without_its_lsf_job_is_refused_not_run_single_node(tmp_path):
    environ = {k: v for k, v in jsrun_task(tmp_path, 1).items() if k != "LSB_JOBID"}
    with pytest.raises(
        LauncherConfigError, match=r"^JSM_NAMESPACE_SIZE is set \(a jsrun task\) but LSB_JOBID is not"
    ):
        resolve_cluster(settings(), environ)
    assert inspect_environment("none", environ).note.startswith("a jsrun task (JSM_NAMESPACE_SIZE=2)")


def test_a_rank_file_with_only_the_launch_node_is_refused(tmp_path):
    with pytest.raises(LauncherConfigError, match=r"names no compute host"):
        detect("auto", jsrun_task(tmp_path, 0, lines=["batch1"]))


# --- the order of `auto`, and naming one ---


def test_auto_takes_slurm_first_then_pet_then_mpi(tmp_path):
    slurm_batch = {"SLURM_JOB_ID": "9", "SLURM_NNODES": "2"}  # a batch script: SLURM, but no step
    found = inspect_environment("auto", {**slurm_batch, **kubeflow_v2(1), **open_mpi(1)})
    # SLURM gives no place in a world here: PET_* does, and the line says both
    assert found.pet is not None and found.note.startswith("SLURM job 9 but no job step")
    found = inspect_environment("auto", {**open_mpi(1), **{"LSB_JOBID": "1"}})
    assert found.layout.source == "MPI"
    # jsrun's tasks carry MPI's variables too: they are LSF's
    assert inspect_environment("auto", jsrun_task(tmp_path, 1)).layout.source == "LSF"
    assert inspect_environment("mpi", jsrun_task(tmp_path, 1)).layout.source == "MPI"


def test_cluster_none_names_every_environment_it_ignores(tmp_path):
    environ = {"SLURM_JOB_ID": "9", **kubeflow_v2(0), **open_mpi(0), **jsrun_task(tmp_path, 0)}
    note = inspect_environment("none", environ).note
    assert note.startswith("SLURM job 9, torchrun's PET_NNODES") and "LSF job 777 ignored" in note
    assert inspect_environment("none", {}).note is None
