"""What a sweep costs under the torchrun launcher, against a torchrun loop and the floor.

One invocation runs the same trivial sweep (N jobs x NPROC ranks; each rank imports torch,
joins a gloo group, does one all_reduce, leaves, returns) three ways, one after the other:

  (a) plugin: `python trivial_app.py --multirun hydra/launcher=torchrun
      hydra.launcher.nproc_per_node=NPROC x=0,..,N-1` (the launcher's defaults otherwise);
  (b) loop:   N x `python -m torch.distributed.run --standalone --nproc_per_node=NPROC
      trivial_rank.py`, as a shell loop around torchrun would;
  (c) floor:  N x `python -c "import torch"`.

Per-job figures come from timestamps the processes write themselves (time.time(), one
clock): every rank records its creation, task start and task end (taken just before it
returns); under (a) a Hydra Callback records `on_job_start` and `on_job_end` (the moment the
launcher holds the job's JobReturn) in the launching process; under (b) the benchmark
records when each torchrun process was started and when it had exited.

    python benchmarks/sweep_overhead.py --jobs 6 [--nproc 2] [--json results.json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
APP = HERE / "trivial_app.py"
RANK_SCRIPT = HERE / "trivial_rank.py"


def _env() -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    # this benchmark measures the launcher, not a user's PYTHONSTARTUP or an odd OMP setting
    env.pop("PYTHONSTARTUP", None)
    return env


def _run(argv: Sequence[str], cwd: Path, log: Path) -> float:
    """Run argv to completion, output to `log`; returns time.time() at exit. Fails loudly."""
    with open(log, "ab") as out:
        result = subprocess.run(list(argv), cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    ended = time.time()
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"{' '.join(map(str, argv))} exited {result.returncode}; log {log}:\n{tail}")
    return ended


def _read(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise SystemExit(f"missing timing record {path}: the job did not run as expected")
    return json.loads(path.read_text())


def _ranks(job_dir: Path, nproc: int) -> List[Dict[str, Any]]:
    return [_read(job_dir / f"rank{r}.json") for r in range(nproc)]


def _rank_summary(ranks: List[Dict[str, Any]], started: float) -> Dict[str, Optional[float]]:
    created = [r["created"] for r in ranks if r.get("created") is not None]
    return {
        # launcher start of the job -> the last rank process exists
        "to_ranks_created": (max(created) - started) if created else None,
        # rank process exists -> its task function (or script) starts, slowest rank
        "rank_boot": max(r["start"] - r["created"] for r in ranks) if created else None,
        # CPU seconds a rank spends from its creation to its task's start, slowest rank
        "rank_boot_cpu": max(r["cpu_start"] for r in ranks),
        "to_task_start": max(r["start"] for r in ranks) - started,
        "import_torch": max(r["imported"] - r["start"] for r in ranks),
        "init_process_group": max(r["joined"] for r in ranks) - max(r["imported"] for r in ranks),
        "task_span": max(r["end"] for r in ranks) - min(r["start"] for r in ranks),
        "last_rank_end": max(r["end"] for r in ranks),
    }


def run_plugin(jobs: int, nproc: int, work: Path) -> Dict[str, Any]:
    sweep_dir = work / "plugin"
    argv = [
        sys.executable,
        str(APP),
        "--multirun",
        "hydra/launcher=torchrun",
        f"hydra.launcher.nproc_per_node={nproc}",
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweep.subdir=${hydra.job.num}",
        "x=" + ",".join(str(i) for i in range(jobs)),
    ]
    started = time.time()
    ended = _run(argv, work, work / "plugin.log")
    per_job = []
    previous_end = started
    previous_cpu: Optional[float] = None
    for i in range(jobs):
        job_dir = sweep_dir / str(i)
        job_start = _read(job_dir / "job_start.json")["t"]
        job_end_record = _read(job_dir / "job_end.json")
        if job_end_record["status"] != "COMPLETED":
            raise SystemExit(f"plugin job {i} is {job_end_record['status']}")
        job_end = job_end_record["t"]
        ranks = _rank_summary(_ranks(job_dir, nproc), job_start)
        per_job.append(
            {
                "job": i,
                # from the previous job's JobReturn (or the command's start) to this one's
                "cycle": job_end - previous_end,
                "start_to_end": job_end - job_start,
                # previous JobReturn -> this job's on_job_start: compose, run_job bookkeeping
                "between_jobs": job_start - previous_end,
                **{k: v for k, v in ranks.items() if k != "last_rank_end"},
                "end_latency": job_end - ranks["last_rank_end"],
                # CPU seconds of the launching process (all its threads) in this cycle
                "launcher_cpu": None if previous_cpu is None else job_end_record["cpu"] - previous_cpu,
                "job_start": job_start,
                "job_end": job_end,
            }
        )
        previous_end = job_end
        previous_cpu = job_end_record["cpu"]
    return {"total": ended - started, "per_job": per_job, "after_last_job": ended - previous_end}


def run_loop(jobs: int, nproc: int, work: Path) -> Dict[str, Any]:
    started = time.time()
    per_job = []
    for i in range(jobs):
        out = work / "loop" / str(i)
        out.mkdir(parents=True)
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(RANK_SCRIPT),
            "--out",
            str(out),
            "--x",
            str(i),
        ]
        job_start = time.time()
        job_end = _run(argv, work, work / "loop.log")
        ranks = _rank_summary(_ranks(out, nproc), job_start)
        per_job.append(
            {
                "job": i,
                "cycle": job_end - job_start,
                "start_to_end": job_end - job_start,
                **{k: v for k, v in ranks.items() if k != "last_rank_end"},
                "end_latency": job_end - ranks["last_rank_end"],
                "job_start": job_start,
                "job_end": job_end,
            }
        )
    return {"total": time.time() - started, "per_job": per_job}


def run_floor(jobs: int, work: Path) -> Dict[str, Any]:
    started = time.time()
    per_job = []
    for _ in range(jobs):
        t0 = time.time()
        t1 = _run([sys.executable, "-c", "import torch"], work, work / "floor.log")
        per_job.append({"cycle": t1 - t0})
    return {"total": time.time() - started, "per_job": per_job}


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _fmt(value: Optional[float], width: int = 8) -> str:
    return f"{value:{width}.3f}" if value is not None else f"{'-':>{width}}"


def summarize(
    plugin: Dict[str, Any], loop: Dict[str, Any], floor: Dict[str, Any], jobs: int
) -> Dict[str, Any]:
    a = plugin["total"] / jobs
    b = loop["total"] / jobs
    c = floor["total"] / jobs
    steady = plugin["per_job"][1:]
    summary: Dict[str, Any] = {
        "per_job_wall": {"plugin": a, "torchrun_loop": b, "import_torch_floor": c},
        "ratio_plugin_over_loop": a / b,
        "ratio_plugin_over_floor": a / c,
        "plugin_first_job": plugin["per_job"][0]["cycle"],
    }
    if steady:
        cycle = _mean([j["cycle"] for j in steady])
        assert cycle is not None
        summary.update(
            plugin_steady_per_job=cycle,
            plugin_steady_per_job_stdev=statistics.pstdev([j["cycle"] for j in steady]),
            ratio_plugin_steady_over_loop=cycle / _mean([j["cycle"] for j in loop["per_job"]]),  # type: ignore[operator]
            ratio_plugin_steady_over_floor=cycle / _mean([j["cycle"] for j in floor["per_job"]]),  # type: ignore[operator]
        )
    summary["end_latency"] = {
        "plugin_mean": _mean([j["end_latency"] for j in plugin["per_job"]]),
        "plugin_max": max(j["end_latency"] for j in plugin["per_job"]),
        "torchrun_loop_mean": _mean([j["end_latency"] for j in loop["per_job"]]),
        "torchrun_loop_max": max(j["end_latency"] for j in loop["per_job"]),
    }
    return summary


def print_report(
    plugin: Dict[str, Any], loop: Dict[str, Any], floor: Dict[str, Any], summary: Dict[str, Any], args: Any
) -> None:
    jobs, nproc = args.jobs, args.nproc
    print(f"\nsweep of {jobs} jobs x {nproc} ranks (gloo, one all_reduce); {os.cpu_count()} CPUs; seconds\n")
    print(f"{'way':<44}{'total':>9}{'per job':>9}")
    rows = [
        ("(a) plugin, --multirun hydra/launcher=torchrun", plugin["total"]),
        ("(b) loop of torchrun --standalone", loop["total"]),
        ('(c) floor: python -c "import torch"', floor["total"]),
    ]
    for name, total in rows:
        print(f"{name:<44}{total:9.2f}{total / jobs:9.3f}")
    print(
        f"\nratio a/b {summary['ratio_plugin_over_loop']:.3f}   "
        f"ratio a/c {summary['ratio_plugin_over_floor']:.3f}   (per-job wall, whole command)"
    )
    if "plugin_steady_per_job" in summary:
        print(
            f"plugin per job, jobs 2..{jobs}: {summary['plugin_steady_per_job']:.3f} "
            f"(stdev {summary['plugin_steady_per_job_stdev']:.3f}); first job (incl. Hydra start) "
            f"{summary['plugin_first_job']:.3f}; steady/b {summary['ratio_plugin_steady_over_loop']:.3f}, "
            f"steady/c {summary['ratio_plugin_steady_over_floor']:.3f}"
        )
    el = summary["end_latency"]
    print(
        f"end-of-job latency (last rank's return -> JobReturn / torchrun exit): "
        f"plugin mean {el['plugin_mean']:.3f} max {el['plugin_max']:.3f}; "
        f"loop mean {el['torchrun_loop_mean']:.3f} max {el['torchrun_loop_max']:.3f}"
    )

    cols = [
        ("cycle", "cycle"),
        ("between_jobs", "between"),
        ("to_ranks_created", "spawned"),
        ("rank_boot", "rankboot"),
        ("rank_boot_cpu", "bootcpu"),
        ("to_task_start", "to_task"),
        ("import_torch", "import"),
        ("init_process_group", "init_pg"),
        ("task_span", "task"),
        ("end_latency", "end_lat"),
        ("launcher_cpu", "l_cpu"),
    ]
    legend = [
        "cycle    previous job's JobReturn (a) / torchrun exit (b) -> this job's",
        "between  previous job's JobReturn -> this job's on_job_start (compose, run_job bookkeeping)",
        "spawned  job start -> the last rank process exists",
        "rankboot rank process exists -> its task function starts (slowest rank)",
        "bootcpu  CPU seconds the slowest rank spent on that (process_time at task start)",
        "to_task  job start -> the last rank's task start",
        "import   `import torch` in the rank (0: the forkserver had it)",
        "init_pg  init_process_group, after the last rank imported torch",
        "task     first rank's task start -> last rank's task end",
        "end_lat  last rank's return -> JobReturn (a) / torchrun exit (b)",
        "l_cpu    CPU seconds of the launching process (all threads) in the cycle",
    ]
    for title, result in (("(a) plugin", plugin), ("(b) torchrun loop", loop)):
        print(f"\n{title}, per job")
        print(f"{'job':>4}" + "".join(f"{label:>9}" for _, label in cols))
        for j in result["per_job"]:
            print(f"{j['job']:>4}" + "".join(" " + _fmt(j.get(key)) for key, _ in cols))
    print()
    for line in legend:
        print(line)
    floor_cycles = " ".join(f"{j['cycle']:.3f}" for j in floor["per_job"])
    print(f"(c) floor per job: {floor_cycles}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=6, help="sweep jobs per way (default 6)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per job (default 2)")
    parser.add_argument("--json", type=Path, help="also write every figure and timestamp here")
    parser.add_argument("--workdir", type=Path, help="keep the runs' output here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.nproc < 1:
        parser.error("--jobs and --nproc must be at least 1")

    work = args.workdir or Path(tempfile.mkdtemp(prefix="sweep_overhead_"))
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("plugin", "loop"):
        shutil.rmtree(work / stale, ignore_errors=True)
    try:
        # warm the page cache so that no way pays for the first read of torch from disk
        _run([sys.executable, "-c", "import torch"], work, work / "floor.log")
        plugin = run_plugin(args.jobs, args.nproc, work)
        loop = run_loop(args.jobs, args.nproc, work)
        floor = run_floor(args.jobs, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    summary = summarize(plugin, loop, floor, args.jobs)
    print_report(plugin, loop, floor, summary, args)
    if args.json:
        record = {
            "jobs": args.jobs,
            "nproc": args.nproc,
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "summary": summary,
            "plugin": plugin,
            "torchrun_loop": loop,
            "floor": floor,
        }
        args.json.write_text(json.dumps(record, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
