"""Script mode and launch prefixes: the launch layers users already have keep working."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import assert_gone, run_app

pytestmark = pytest.mark.timeout(240)

MULTIRUN_2_RANKS = ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"]

HYDRA_APP = """
import os
import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def main(cfg):
    with open(os.path.join(cfg.marker_dir, f"task_{cfg.lr}_{os.environ['RANK']}.json"), "w") as f:
        import json
        json.dump({"mark": os.environ.get("MARK"), "pid": os.getpid(), "cwd": os.getcwd()}, f)
    return f"lr={cfg.lr} rank={os.environ['RANK']}"

if __name__ == "__main__":
    main()
"""

TRAIN_SCRIPT = """
import argparse, json, os, sys
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
parser.add_argument("--fail", action="store_true")
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(f"script_rank{rank}.json", "w") as f:
    json.dump({"lr": args.lr, "world": dist.get_world_size(), "pid": os.getpid(), "argv": sys.argv[1:]}, f)
print(f"script rank {rank} lr {args.lr}", flush=True)
dist.destroy_process_group()
if args.fail and rank == 1:
    print("the loss went NaN on rank 1", file=sys.stderr, flush=True)
    sys.exit(7)
"""

WRAPPER = """
import json, os, stat, sys
# a stand-in for numactl / nsys: records how it was called, then runs the rest
tag, rest = sys.argv[1], sys.argv[2:]
# the files its command names, as they are while the job runs (mode, owner, and their dir's)
def facts(path):
    st, dir_st = os.stat(path), os.stat(os.path.dirname(path))
    return {"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
            "dir_mode": stat.S_IMODE(dir_st.st_mode), "dir_uid": dir_st.st_uid}
files = {arg: facts(arg) for arg in rest if os.path.isfile(arg)}
with open(os.path.join(os.environ["WRAPPER_LOG_DIR"], f"wrapper_{tag}.json"), "w") as f:
    json.dump({"argv": rest, "pid": os.getpid(), "files": files}, f)
os.execvp(rest[0], rest)
"""


@pytest.fixture
def app(tmp_path: Path) -> Path:
    path = tmp_path / "app.py"
    path.write_text(HYDRA_APP)
    # launcher keys interpolate `lr`: Hydra builds the launcher from the base config, so lr has a default
    (tmp_path / "config.yaml").write_text(f"lr: 0.0\nmarker_dir: {tmp_path}\n")
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    return path


def test_script_mode_runs_the_script_per_rank_in_each_job_dir(app: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_app(
        app,
        [
            *MULTIRUN_2_RANKS,
            # as the README shows it: a path relative to where the sweep is launched
            "hydra.launcher.training_script=train.py",
            "hydra.launcher.training_script_args=[--lr,'${lr}']",
            "hydra.sweep.dir=sweep",
            "lr=0.1,0.01",
        ],
        cwd=tmp_path,
    )
    pids = []
    for job, lr in (("0", 0.1), ("1", 0.01)):
        job_dir = sweep_dir / job
        assert (job_dir / ".hydra" / "overrides.yaml").is_file()
        for rank in (0, 1):
            record = json.loads((job_dir / f"script_rank{rank}.json").read_text())
            assert record["lr"] == lr and record["world"] == 2
            pids.append(record["pid"])
        logs = sorted((job_dir / "torchrun_logs").glob("*/attempt_0/*/stdout.log"))
        # torch's own lines aside (gloo says who it connected to from torch 2.8 on, as under torchrun)
        printed = [[ln for ln in p.read_text().splitlines() if not ln.startswith("[Gloo]")] for p in logs]
        assert printed == [[f"script rank 0 lr {lr}"], [f"script rank 1 lr {lr}"]]
    assert "[default1]:script rank 1 lr 0.01" in result.stdout
    # the app's task function is not what runs in script mode
    assert not list(tmp_path.glob("task_*.json"))
    assert_gone(pids)


def test_script_that_exits_non_zero_fails_its_job_with_its_stderr(app: Path, tmp_path: Path) -> None:
    result = run_app(
        app,
        [
            *MULTIRUN_2_RANKS,
            "hydra.launcher.training_script=train.py",
            "hydra.launcher.training_script_args=[--lr,'${lr}',--fail]",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "lr=0.5",
        ],
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode != 0
    assert "rank 1 (local_rank 1" in result.stderr
    assert "exited with code 7" in result.stderr
    assert "the loss went NaN on rank 1" in result.stderr


def test_launch_prefix_wraps_every_rank_of_a_task(app: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    run_app(
        app,
        [
            *MULTIRUN_2_RANKS,
            f"hydra.launcher.launch_prefix=[env,'MARK=1','WRAPPER_LOG_DIR={tmp_path}',"
            f"'{sys.executable}','{tmp_path / 'wrapper.py'}','r{{rank}}-l{{local_rank}}']",
            "hydra.job.chdir=True",
            f"hydra.sweep.dir={sweep_dir}",
            "lr=0.1,0.2",
        ],
        cwd=tmp_path,
    )
    pids = []
    for lr, job in ((0.1, "0"), (0.2, "1")):
        for rank in (0, 1):
            record = json.loads((tmp_path / f"task_{lr}_{rank}.json").read_text())
            assert record["mark"] == "1"
            assert Path(record["cwd"]) == (sweep_dir / job).resolve()
            pids.append(record["pid"])
    # the wrapper ran once per rank, with the rank put into its arguments, around python
    wrappers = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("wrapper_*.json")}
    assert set(wrappers) == {"wrapper_r0-l0.json", "wrapper_r1-l1.json"}
    assert wrappers["wrapper_r1-l1.json"]["argv"][0] == sys.executable
    pids += [w["pid"] for w in wrappers.values()]
    assert_gone(pids)
    # each rank's task travels in a payload file that only the user can read, in a private
    # dir of its own (not the sweep dir), which lives only while the job runs
    payloads = {
        path: facts for w in wrappers.values() for path, facts in w["files"].items() if path.endswith(".pkl")
    }
    # the last job's (its wrappers' records replaced the first's): both ranks read one file
    assert len(payloads) == 1, wrappers
    for path, facts in payloads.items():
        assert Path(path).name == "payload.pkl", path
        assert not Path(path).is_relative_to(sweep_dir) and not Path(path).is_relative_to(tmp_path), path
        assert facts == {"mode": 0o600, "uid": os.getuid(), "dir_mode": 0o700, "dir_uid": os.getuid()}, facts
        assert not Path(path).exists() and not Path(path).parent.exists(), path
    # in the sweep dir: only the completed jobs' records (a resume reads them)
    assert {p.name for p in Path(sweep_dir).rglob("*.pkl")} <= {"job_return.pkl"}


def test_a_launch_prefix_that_never_runs_the_task_fails_its_job(app: Path, tmp_path: Path) -> None:
    """A prefix program that ends without running the command it was given (`true`, a
    wrapper script without `exec "$@"`) ends every rank with code 0: the task never ran, and
    the job says so instead of completing with no value."""
    result = run_app(
        app,
        [
            *MULTIRUN_2_RANKS,
            "hydra.launcher.launch_prefix=[/bin/true]",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "lr=0.1,0.2",
        ],
        cwd=tmp_path,
        check=False,
        full_error=False,
    )
    output = result.stdout + result.stderr
    summary = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())["jobs"]
    assert [job["status"] for job in summary] == ["FAILED", "FAILED"], output
    said = (
        "the job's ranks ended with code 0 but never ran the task: "
        "hydra.launcher.launch_prefix=['/bin/true'] must run the command that follows it"
    )
    assert all(said in job["error"] for job in summary), summary
    assert said in output and "Traceback" not in output, output
    assert not list(tmp_path.glob("task_*.json"))


def test_launch_prefix_keeps_rank_zeros_return_value(tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text(
        """
import os
import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
from hydra.experimental.callback import Callback

class Record(Callback):
    def on_job_end(self, config, job_return, **kwargs):
        with open(os.path.join(config.hydra.sweep.dir, "returns.txt"), "a") as f:
            f.write(f"{job_return.return_value}\\n")

@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    return f"x={cfg.x} rank={os.environ['RANK']}"

if __name__ == "__main__":
    main()
"""
    )
    sweep_dir = tmp_path / "sweep"
    run_app(
        app,
        [
            *MULTIRUN_2_RANKS,
            "hydra.launcher.launch_prefix=[env,'MARK=1']",
            f"hydra.sweep.dir={sweep_dir}",
            "+hydra.callbacks.record._target_=__main__.Record",
            "+x=1,2",
        ],
        cwd=tmp_path,
    )
    assert (sweep_dir / "returns.txt").read_text().split("\n")[:-1] == ["x=1 rank=0", "x=2 rank=0"]


PROGRESS_APP = """
import os, sys
import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    rank = os.environ["RANK"]
    for pct in range(0, 101, 25):
        # a progress bar: each update rewrites the line, written in two pieces
        sys.stdout.write(f"\\rrank {rank} progress {pct:3d}%")
        sys.stdout.flush()
        sys.stdout.write(" (eta 0s)")
        sys.stdout.flush()
    sys.stdout.write(f"\\nrank {rank} done\\n")

if __name__ == "__main__":
    main()
"""


def _console_lines(stdout: str, prefix_marker: str) -> list:
    return [line for line in stdout.splitlines() if prefix_marker in line]


@pytest.mark.parametrize(
    "extra, prefixes",
    [
        ([], {"0": "[default0]:", "1": "[default1]:"}),
        (["hydra.launcher.local_ranks_filter=0"], {"0": "[default0]:"}),
        (["hydra.launcher.log_line_prefix_template='<r{rank}>'"], {"0": "<r0>", "1": "<r1>"}),
    ],
    ids=["default", "local_ranks_filter", "prefix_template"],
)
def test_console_shows_whole_prefixed_lines_and_files_keep_everything(
    tmp_path: Path, extra: list, prefixes: dict
) -> None:
    app = tmp_path / "progress.py"
    app.write_text(PROGRESS_APP)
    sweep_dir = tmp_path / "sweep"
    result = run_app(
        app,
        [
            *MULTIRUN_2_RANKS,
            f"hydra.sweep.dir={sweep_dir}",
            *extra,
        ],
        cwd=tmp_path,
    )
    shown = {rank for rank in ("0", "1") if f"rank {rank} done" in result.stdout}
    assert shown == set(prefixes)
    for rank, prefix in prefixes.items():
        lines = [line for line in result.stdout.splitlines() if f"rank {rank} " in line]
        # every update is a whole line of its own, starting with the rank's prefix
        assert lines == [f"{prefix}rank {rank} progress {pct:3d}% (eta 0s)" for pct in range(0, 101, 25)] + [
            f"{prefix}rank {rank} done"
        ]
    # the files keep every rank's bytes exactly as written, whatever the console showed
    for rank in ("0", "1"):
        (stdout_log,) = (sweep_dir / "0" / "torchrun_logs").glob(f"*/attempt_0/{rank}/stdout.log")
        raw = stdout_log.read_bytes()
        assert raw.startswith(f"\rrank {rank} progress   0% (eta 0s)\rrank {rank} progress  25%".encode())
        assert raw.endswith(f"\nrank {rank} done\n".encode())


@pytest.mark.parametrize(
    "flags, script",
    [
        (["hydra.launcher.module=true"], "train"),
        (["hydra.launcher.run_path=true"], "train.py"),
        (["hydra.launcher.no_python=true"], "./train.sh"),
    ],
    ids=["module", "run_path", "no_python"],
)
def test_script_mode_flags_run_the_script_as_torchrun_would(
    app: Path, tmp_path: Path, flags: list, script: str
) -> None:
    # ranks run in the job's dir; the script (or module) is found where the sweep was launched,
    # as the user wrote it, with no PYTHONPATH or absolute path of the user's
    (tmp_path / "train.sh").write_text(f'#!/bin/sh\nexec {sys.executable} "$(dirname "$0")/train.py" "$@"\n')
    (tmp_path / "train.sh").chmod(0o755)
    sweep_dir = tmp_path / "sweep"
    run_app(
        app,
        [
            *MULTIRUN_2_RANKS,
            f"hydra.launcher.training_script={script}",
            "hydra.launcher.training_script_args=[--lr,'${lr}']",
            *flags,
            "hydra.sweep.dir=sweep",
            "lr=0.3",
        ],
        cwd=tmp_path,
    )
    records = [json.loads((sweep_dir / "0" / f"script_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["lr"], r["world"]) for r in records] == [(0.3, 2), (0.3, 2)]
    assert_gone(r["pid"] for r in records)
