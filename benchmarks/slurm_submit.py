"""What `hydra/launcher=torchrun_slurm` costs SLURM, on a real cluster on this machine.

Starts the test suite's SLURM cluster (root and SLURM needed, as tests/test_slurm_submit.py)
and a sweep of `--jobs` one-node jobs of a trivial app (one rank each), submitted as one
array from the host, as from a login node. Prints:
- submission: the seconds the launcher takes to compose and check the jobs, then to write
  their requests and submit them (one sbatch call for the array), and per job;
- waiting: the launcher's squeue/sacct calls, per minute of waiting (the sweep's log counts
  none, so the launcher runs here under a wrapper PATH that counts each call);
- start: from a job's start (SLURM's StartTime) to its first rank line (the rank prints the
  time, `benchmarks/slurm_submit_app.py`).

With `--detach`, the sweep is submitted with `hydra.launcher.detach=true` and not waited for:
it prints Hydra's own time before the launcher's first line (its start-up and the basic
sweeper's validation, which composes every job), the launcher's time from there to its
last line (composing, checking and submitting in chunks), `torchrun-sweep status`'s time on
the sweep, then cancels it with `torchrun-sweep cancel`. With `--hold` the jobs are
submitted held (`sbatch --hold`), so that on a small machine the cluster's jobs do not take
the CPU the launcher is measured on.

    flock <lock> python benchmarks/slurm_submit.py --jobs 100
    flock <lock> python benchmarks/slurm_submit.py --jobs 1000 --detach --hold
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale import timed  # noqa: E402  (this folder is sys.path's first entry)

from tests.slurm_cluster import SlurmCluster, unavailable  # noqa: E402

APP = Path(__file__).resolve().parent / "slurm_submit_app.py"
COUNTED = ("squeue", "sacct", "sbatch")


def _counting_path(bin_dir: Path, log: Path) -> str:
    """A PATH whose squeue/sacct/sbatch append their name to `log`, then run SLURM's own."""
    for name in COUNTED:
        real = shutil.which(name)
        assert real, name
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho {name} $(date +%s.%N) >> "{log}"\nexec "{real}" "$@"\n')
        script.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def _stamp(line: str) -> float:
    """The time of a `[YYYY-mm-dd HH:MM:SS,mmm][HYDRA] ...` line."""
    stamp = line[1:24]
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--detach", action="store_true")
    parser.add_argument(
        "--hold",
        action="store_true",
        help="submit the jobs held (sbatch --hold): none runs and takes CPU from the launcher",
    )
    args = parser.parse_args()
    if unavailable():
        sys.exit(f"no SLURM cluster here: {unavailable()}")
    with tempfile.TemporaryDirectory() as tmp, SlurmCluster(Path(tmp), nodes=args.nodes) as cluster:
        app = Path(tmp) / "app"
        app.mkdir()
        shutil.copy(APP, app / "app.py")
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        calls = Path(tmp) / "calls.log"
        env = dict(cluster.env, PATH=_counting_path(bin_dir, calls))
        xs = ",".join(str(i) for i in range(args.jobs))
        command = [
            sys.executable,
            "app.py",
            "-m",
            "hydra/launcher=torchrun_slurm",
            "hydra.sweep.dir=sweep",
            f"+x={xs}",
        ]
        if args.hold:
            command.append("+hydra.launcher.additional_parameters.hold=true")
        if args.detach:
            _detached(command, app, env, args.jobs)
            return
        started = time.time()
        launcher = subprocess.run(command, cwd=app, env=env, capture_output=True, text=True)
        ended = time.time()
        output = launcher.stdout + launcher.stderr
        assert launcher.returncode == 0, output[-3000:]
        lines = output.splitlines()
        submitting = _stamp(next(line for line in lines if "Submitting" in line))
        submitted = _stamp([line for line in lines if ": SLURM job " in line][-1])
        log = [line.split() for line in calls.read_text().splitlines()]
        polls = [float(t) for name, t in log if name in ("squeue", "sacct")]
        sbatch = [name for name, _ in log if name == "sbatch"]
        print(f"{args.jobs} one-node jobs on {args.nodes} nodes, {ended - started:.1f}s in all")
        print(
            f"composing and checking the jobs: {submitting - started:.2f}s from the launcher's start "
            f"({(submitting - started) / args.jobs * 1000:.0f} ms per job)"
        )
        print(
            f"submission (requests written, {len(sbatch)} sbatch call): {submitted - submitting:.2f}s "
            f"({(submitted - submitting) / args.jobs * 1000:.1f} ms per job)"
        )
        waited_min = (ended - submitted) / 60
        print(
            f"waiting: {len(polls)} squeue/sacct calls in {waited_min * 60:.1f}s = "
            f"{len(polls) / waited_min:.1f} per minute"
        )
        delays = []
        for out in (app / "sweep" / ".slurm").glob("job*.out"):
            job = out.name.split(".")[1] + "_" + out.name.split(".")[0][3:]
            shown = cluster.run(["scontrol", "show", "job", "-o", job]).stdout
            start = re.search(r"StartTime=(\S+)", shown)
            first = re.search(r"first rank line at (\d+\.\d+)", out.read_text())
            if start and first:
                t0 = time.mktime(time.strptime(start.group(1), "%Y-%m-%dT%H:%M:%S"))
                delays.append(float(first.group(1)) - t0)
        if delays:
            delays.sort()
            print(
                f"job start (SLURM's StartTime, whole seconds) to its first rank line: median "
                f"{delays[len(delays) // 2]:.2f}s, min {delays[0]:.2f}s, max {delays[-1]:.2f}s "
                f"over {len(delays)} jobs"
            )


def _detached(command: "list[str]", app: Path, env: "dict[str, str]", jobs: int) -> None:
    """The detached submission, then the same sweep under Hydra's basic launcher (its tasks
    run in its process, here): the login node's memory under each."""
    submitted = timed([*command, "hydra.launcher.detach=true"], app / "sweep", app, env)
    output = (app / "sweep.log").read_text()
    stamped = [line for line in output.splitlines() if line.startswith("[") and "][HYDRA]" in line[:40]]
    first, last = _stamp(stamped[0]), _stamp(stamped[-1])
    print(f"{jobs} one-node jobs submitted detached, {submitted['wall_s']:.1f}s in all")
    hydra_s = first - submitted["started"]
    print(f"Hydra's own time before the launcher's first line (start-up, validation): {hydra_s:.1f}s")
    print(f"the launcher's, from its first line to its last (compose, check, submit): {last - first:.1f}s")
    tool = str(Path(sys.executable).parent / "torchrun-sweep")
    began = time.time()
    status = subprocess.run([tool, "status", "sweep"], cwd=app, env=env, capture_output=True, text=True)
    print(f"torchrun-sweep status: {time.time() - began:.2f}s; {status.stdout.splitlines()[:2]}")
    began = time.time()
    cancel = subprocess.run([tool, "cancel", "sweep"], cwd=app, env=env, capture_output=True, text=True)
    print(f"torchrun-sweep cancel: {time.time() - began:.2f}s; {cancel.stdout.strip()[:200]}")
    plain = [
        part
        for part in command
        if not part.startswith(("hydra/launcher=", "hydra.launcher.", "+hydra.launcher.", "hydra.sweep.dir="))
    ]
    basic = timed([*plain, "hydra/launcher=basic", "hydra.sweep.dir=basic"], app / "basic", app, env)
    print(
        f"the launching process's peak RSS: {submitted['peak_rss_mb']} MB submitting detached, "
        f"{basic['peak_rss_mb']} MB under Hydra's basic launcher running the same {jobs} tasks "
        f"({basic['wall_s']:.1f}s)"
    )


if __name__ == "__main__":
    main()
