"""Sweeps of hundreds to thousands of jobs: this launcher against Hydra's basic launcher.

For each N, the same sweep (`scale_app.py`: a task that returns `cfg.x`, its module importing
torch) runs under Hydra's basic launcher and under `hydra/launcher=torchrun`
(`nproc_per_node=1`), one after the other, from a fresh sweep dir, and prints per run:

- first task: seconds from the command's start to the first task's start (the task writes it);
- sweep: the command's wall time, and per job;
- peak RSS: the launching process's own peak (VmHWM from /proc, read until it exits: the
  basic launcher's tasks run inside it, this launcher's in processes of their own);
- written: bytes the launching process wrote (/proc/<pid>/io wchar: the record, the console);
- and, for this launcher, a job by its own line (`COMPLETED in ...`: from its start to its
  result): the median and the 10th and 90th percentiles, the first five jobs left out.

With `--optuna TRIALS`, Hydra's Optuna sweeper then runs TRIALS trials of the same task in
batches of `--optuna-batch` (its `n_jobs`: one `launch()` each) under both launchers. A
sweeper that launches small batches pays the launcher's own cost of a launch again and again:
what a launch costs beyond its jobs is this launcher's wall time, less the basic launcher's
(the sweeper's own work, paid by both), less the time its jobs ran (each job's `duration_s`
in `sweep_summary.json`), divided by the number of launches.

    python benchmarks/scale.py --jobs 100 300 1000 [--launchers basic torchrun] [--json out.json]
    python benchmarks/scale.py --jobs --optuna 40 [--optuna-batch 2]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
APP = HERE / "scale_app.py"


def _proc_value(path: str, key: str) -> "int | None":
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def run(launcher: str, jobs: int, workdir: Path) -> Dict[str, Any]:
    """One N-job grid sweep under `launcher`."""
    sweep_dir = workdir / f"{launcher}-{jobs}"
    result = timed(_argv(launcher, sweep_dir, [f"x=range(0,{jobs})"]), sweep_dir, workdir)
    first = float((sweep_dir / "first_task_started").read_text())
    return {
        "launcher": launcher,
        "jobs": jobs,
        "first_task_s": round(first - result["started"], 2),
        "sweep_s": result["wall_s"],
        "per_job_s": round(result["wall_s"] / jobs, 3),
        "peak_rss_mb": result["peak_rss_mb"],
        "written_mb": result["written_mb"],
        "job_line_s": _job_lines(sweep_dir),
    }


def _job_lines(sweep_dir: Path) -> "Dict[str, float] | None":
    """This launcher's jobs by their own line (`COMPLETED in ...`, each job's `duration_s`
    in `sweep_summary.json`), the first five left out: median, 10th and 90th percentiles."""
    summary = sweep_dir / "sweep_summary.json"
    if not summary.exists():
        return None
    times = sorted(row["duration_s"] for row in json.loads(summary.read_text())["jobs"][5:])
    if not times:
        return None
    return {
        "median": statistics.median(times),
        "p10": times[len(times) // 10],
        "p90": times[len(times) * 9 // 10],
    }


def run_optuna(launcher: str, trials: int, batch: int, workdir: Path) -> Dict[str, Any]:
    """Hydra's Optuna sweeper: `trials` trials, `batch` of them per launch()."""
    sweep_dir = workdir / f"optuna-{launcher}-{trials}"
    sweep = [
        "hydra/sweeper=optuna",
        f"hydra.sweeper.n_trials={trials}",
        f"hydra.sweeper.n_jobs={batch}",
        "x=range(0,1000)",
    ]
    result = timed(_argv(launcher, sweep_dir, sweep), sweep_dir, workdir)
    jobs_s = None
    summary = sweep_dir / "sweep_summary.json"
    if summary.exists():  # this launcher's record: how long each job ran
        jobs_s = sum(row["duration_s"] or 0.0 for row in json.loads(summary.read_text())["jobs"])
    return {
        "launcher": launcher,
        "trials": trials,
        "batch": batch,
        "sweep_s": result["wall_s"],
        "jobs_s": jobs_s,
        "peak_rss_mb": result["peak_rss_mb"],
    }


def _argv(launcher: str, sweep_dir: Path, sweep: List[str]) -> List[str]:
    argv = [
        sys.executable,
        str(APP),
        "--multirun",
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={sweep_dir}",
        *sweep,
    ]
    if launcher == "torchrun":
        argv.append("hydra.launcher.nproc_per_node=1")
    return argv


def timed(
    argv: List[str], sweep_dir: Path, workdir: Path, env: "Dict[str, str] | None" = None
) -> Dict[str, Any]:
    """Run the command to its end: its wall time, peak RSS and bytes written (its console in
    `<workdir>/<sweep dir's name>.log`)."""
    log = workdir / f"{sweep_dir.name}.log"
    peak = {"rss_kb": 0, "wchar": 0}
    started = time.time()
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)

        def watch() -> None:
            while process.poll() is None:
                rss = _proc_value(f"/proc/{process.pid}/status", "VmHWM:")
                wchar = _proc_value(f"/proc/{process.pid}/io", "wchar:")
                if rss:
                    peak["rss_kb"] = max(peak["rss_kb"], rss)
                if wchar:
                    peak["wchar"] = max(peak["wchar"], wchar)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        code = process.wait()
        watcher.join()
    ended = time.time()
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} exited {code}; see {log}:\n{log.read_text()[-3000:]}")
    return {
        "started": started,
        "wall_s": round(ended - started, 2),
        "peak_rss_mb": round(peak["rss_kb"] / 1024),
        "written_mb": round(peak["wchar"] / 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, nargs="*", default=[100, 300, 1000])
    parser.add_argument("--launchers", nargs="+", default=["basic", "torchrun"])
    parser.add_argument("--optuna", type=int, metavar="TRIALS", help="also an Optuna sweep")
    parser.add_argument("--optuna-batch", type=int, default=2, metavar="N_JOBS")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: List[Dict[str, Any]] = []
    optuna: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        for jobs in args.jobs:
            for launcher in args.launchers:
                result = run(launcher, jobs, Path(tmp))
                results.append(result)
                print(json.dumps(result), flush=True)
        if args.optuna:
            for launcher in args.launchers:
                result = run_optuna(launcher, args.optuna, args.optuna_batch, Path(tmp))
                optuna.append(result)
                print(json.dumps(result), flush=True)
    header = ("N", "launcher", "first task", "sweep", "per job", "RSS", "written")
    if results:
        print("\n{:>5} {:<9} {:>10} {:>8} {:>8} {:>7} {:>8}".format(*header))
    for r in results:
        print(
            f"{r['jobs']:>5} {r['launcher']:<9} {r['first_task_s']:>9.1f}s {r['sweep_s']:>7.1f}s "
            f"{r['per_job_s']:>7.3f}s {r['peak_rss_mb']:>5}MB {r['written_mb']:>6.1f}MB"
        )
    for r in results:
        if r["job_line_s"]:
            line = r["job_line_s"]
            print(
                f"N={r['jobs']}: a {r['launcher']} job by its own line: median {line['median']:.3f}s "
                f"(10th to 90th percentile {line['p10']:.3f}s to {line['p90']:.3f}s)"
            )
    by = {(r["launcher"], r["jobs"]): r for r in results}
    for jobs in args.jobs:
        if ("basic", jobs) in by and ("torchrun", jobs) in by:
            b, t = by[("basic", jobs)], by[("torchrun", jobs)]
            print(
                f"N={jobs}: torchrun/basic  first task {t['first_task_s'] / b['first_task_s']:.2f}x, "
                f"sweep {t['sweep_s'] / b['sweep_s']:.2f}x, RSS +{t['peak_rss_mb'] - b['peak_rss_mb']} MB"
            )
    _print_optuna(optuna)
    if args.json:
        args.json.write_text(json.dumps({"grid": results, "optuna": optuna}, indent=1))


def _print_optuna(optuna: List[Dict[str, Any]]) -> None:
    by = {r["launcher"]: r for r in optuna}
    for r in optuna:
        print(
            f"optuna {r['trials']} trials, {r['batch']} a launch, {r['launcher']:<9} "
            f"{r['sweep_s']:>7.1f}s  RSS {r['peak_rss_mb']}MB"
        )
    if "basic" in by and "torchrun" in by and by["torchrun"]["jobs_s"] is not None:
        b, t = by["basic"], by["torchrun"]
        launches = -(-t["trials"] // t["batch"])
        beyond = (t["sweep_s"] - b["sweep_s"] - t["jobs_s"]) / launches
        print(
            f"optuna: torchrun/basic {t['sweep_s'] / b['sweep_s']:.2f}x; its jobs ran {t['jobs_s']:.1f}s; "
            f"a launch() costs {beyond:.3f}s beyond its jobs ({launches} launches)"
        )


if __name__ == "__main__":
    main()
