"""The requeue round trip on a real two-node SLURM cluster (this machine; root and SLURM needed).

    sudo python benchmarks/slurm_requeue.py --rounds 3

Runs the test suite's preemption app (`tests/preempt_app/`) as a batch job on two nodes
(`tests/slurm_cluster.py`), sends it SLURM's stop notice (`scancel --signal=USR2`) while
job 1 trains, and reads node 0's output: the time from the preempted job's end to the
requeued run resuming the sweep (SLURM's requeue and restart, the launcher's start and
the nodes' agreement), and from the notice to the whole sweep's completion. Prints the
median of `--rounds` batch jobs.
"""

import argparse
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.slurm_cluster import SlurmCluster, unavailable  # noqa: E402

APP_DIR = ROOT / "tests" / "preempt_app"
WAIT_S = 300
# node 0's lines that bound the round trip: its preempted job ended / the requeued run resumes
_STAMP = r"^\[([\d-]+ [\d:]+),(\d+)\]\[HYDRA\][^\n]*"
_ENDS = (r": PREEMPTED in ", r" Resuming the sweep in multirun/\d+/node0")


def round_trip_s(output: str) -> Optional[float]:
    """Seconds from the first PREEMPTED line to node 0's first `Resuming the sweep` line of a
    batch job's output (both stamped by Hydra's logging); None without both."""
    stamps = []
    for pattern in _ENDS:
        found = re.findall(_STAMP + pattern, output, re.M)
        if not found:
            return None
        stamp, ms = found[0]
        stamps.append(time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000)
    return stamps[1] - stamps[0]


def _one_round(cluster: SlurmCluster, work: Path) -> Tuple[float, float]:
    app_dir = work / f"app{len(list(work.iterdir()))}"
    shutil.copytree(APP_DIR, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    sweep = shlex.join(
        [
            sys.executable,
            "app.py",
            "--multirun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.sweep.dir=multirun/${oc.env:SLURM_JOB_ID}/node${oc.env:SLURM_NODEID}",
            "lr=0.1,0.2,0.3",
            "steps=8",
            "step_s=0.3",
            "checkpoint=${hydra:runtime.cwd}/checkpoint_${hydra:job.num}.json",
        ]
    )
    (app_dir / "job.sh").write_text(f"#!/bin/bash\nsrun {sweep}\n")
    options = ["--parsable", f"--chdir={app_dir}", f"--output={app_dir}/slurm-%j.out"]
    options += ["--nodes=2", "--ntasks-per-node=1", "--open-mode=append"]
    submitted = cluster.run(["sbatch", *options, "job.sh"], cwd=app_dir)
    if submitted.returncode != 0:
        sys.exit(f"sbatch failed: {submitted.stderr}")
    job_id = submitted.stdout.strip().split(";")[0]
    output = app_dir / f"slurm-{job_id}.out"
    deadline = time.monotonic() + WAIT_S
    while True:  # job 1 trains: its rank 0 printed step 2
        text = output.read_text() if output.exists() else ""
        if "#1 : lr=0.2" in text and "rank 0: step 2" in text[text.find("#1 : lr=0.2") :]:
            break
        if time.monotonic() > deadline:
            sys.exit(f"job 1 never reached step 2:\n{text}")
        time.sleep(0.1)
    signalled = time.monotonic()
    cluster.run(["scancel", "--signal=USR2", job_id])
    while True:
        state = re.search(r"JobState=(\S+)", cluster.run(["scontrol", "show", "job", "-o", job_id]).stdout)
        if state and state.group(1) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        if time.monotonic() > deadline:
            sys.exit(f"SLURM job {job_id} did not end within {WAIT_S}s")
        time.sleep(0.2)
    whole = time.monotonic() - signalled
    trip = round_trip_s(output.read_text())
    if state.group(1) != "COMPLETED" or trip is None:
        sys.exit(f"SLURM job {job_id} ended {state.group(1)} without a resumed run:\n{output.read_text()}")
    return trip, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        sys.exit(f"no SLURM cluster here: {reason}")
    trips: List[float] = []
    wholes: List[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with SlurmCluster(work / "cluster") as cluster:
            (work / "runs").mkdir()
            for _ in range(args.rounds):
                trip, whole = _one_round(cluster, work / "runs")
                trips.append(trip)
                wholes.append(whole)
    print(f"2 nodes x 2 ranks, 3-job sweep preempted in job 1, median of {args.rounds} batch jobs:")
    print(f"  requeue round trip (preempted job ended -> sweep resuming)  {statistics.median(trips):6.1f} s")
    print(f"  USR2 -> the whole sweep completed                           {statistics.median(wholes):6.1f} s")


if __name__ == "__main__":
    main()
