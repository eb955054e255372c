"""What a sweep of a real Lightning app costs per job: this launcher against the usual ways.

One invocation runs the same N-job sweep of `lightning_app.py` (a Lightning DDP fit,
2 CPU ranks, a few steps) three ways, one after the other:

  (a) plugin: `python lightning_app.py --multirun hydra/launcher=torchrun
      hydra.launcher.nproc_per_node=2 +x=0..N-1`;
  (b) loop:   N x `python -m torch.distributed.run --standalone --nproc_per_node=2
      lightning_app.py +x=i hydra.run.dir=...`, a shell loop around torchrun;
  (c) basic:  `python lightning_app.py --multirun +x=0..N-1` with Hydra's basic launcher,
      Lightning starting its second rank itself (it re-runs the script).

Per job (k >= 1), from timestamps rank 0 writes (time.time(), one clock):
  overhead = this job's fit start - the previous job's fit end (all the launcher's time:
             end of the previous job, start of this one, imports, rendezvous, Trainer set-up)
  to_task  = the previous job's fit end -> this job's task function start (rank 0)
  setup    = task start -> fit start (Lightning's Trainer, DDP set-up, in the task)
  fit      = the training loop itself (not overhead)

    python benchmarks/lightning_sweep.py --jobs 6
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
APP = HERE / "lightning_app.py"


def _run(argv: List[str], cwd: Path, log: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    env.pop("PYTHONSTARTUP", None)
    with open(log, "ab") as out:
        result = subprocess.run(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} exited {result.returncode}; see {log}:\n{log.read_text()[-3000:]}"
        )


def _timings(job_dirs: List[Path]) -> List[Dict[str, float]]:
    records = []
    for job_dir in job_dirs:
        path = job_dir / "timing.json"
        if not path.is_file():
            raise SystemExit(f"missing {path}: the job did not run as expected")
        records.append(json.loads(path.read_text()))
    return records


def _per_job(records: List[Dict[str, float]]) -> List[Dict[str, float]]:
    rows = []
    for previous, this in zip(records, records[1:]):
        rows.append(
            {
                "overhead": this["fit_start"] - previous["fit_end"],
                "to_task": this["task_start"] - previous["fit_end"],
                "setup": this["fit_start"] - this["task_start"],
                "fit": this["fit_end"] - this["fit_start"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=6)
    args = parser.parse_args()
    jobs = args.jobs
    sweep = f"+x=range({jobs})"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        ways = {
            # way: its commands, run one after the other; its job dirs are under work/<a, b or c>
            "(a) this launcher": [
                [sys.executable, str(APP), "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2",
                 f"hydra.sweep.dir={work / 'a'}", sweep],
            ],
            "(b) torchrun loop": [
                [*torchrun, str(APP), f"+x={i}", f"hydra.run.dir={work / 'b' / str(i)}"] for i in range(jobs)
            ],
            "(c) basic launcher": [[sys.executable, str(APP), "-m", f"hydra.sweep.dir={work / 'c'}", sweep]],
        }  # fmt: skip
        for way, commands in ways.items():
            name = way[1]  # a, b, c
            started = time.time()
            for command in commands:
                _run(command, work, work / f"{name}.log")
            results[way] = (time.time() - started, _timings([work / name / str(i) for i in range(jobs)]))

    print(f"Lightning DDP sweep, {jobs} jobs x 2 CPU ranks, 10 steps each (jobs 2..{jobs}: medians)")
    print(f"{'way':22} {'wall':>7} {'per job':>8} {'overhead':>9} {'to_task':>8} {'setup':>7} {'fit':>6}")
    medians = {}
    for way, (wall, records) in results.items():
        rows = _per_job(records)
        med = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        medians[way] = med
        print(
            f"{way:22} {wall:7.2f} {wall / jobs:8.2f} {med['overhead']:9.3f} {med['to_task']:8.3f} "
            f"{med['setup']:7.3f} {med['fit']:6.3f}"
        )
    a, b, c = (medians[w]["overhead"] for w in results)
    print(f"overhead ratio launcher/torchrun-loop {a / b:.3f}   launcher/basic {a / c:.3f}")
    print("overhead: previous job's fit end -> this job's fit start; to_task: -> this job's task start;")
    print("setup: task start -> fit start (Trainer, DDP); fit: the training loop (not overhead)")


if __name__ == "__main__":
    main()
