"""Sweeps of hundreds to thousands of jobs: this launcher against Hydra's basic launcher.

For each N, the same sweep (`scale_app.py`: a task that returns `cfg.x`, its module importing
torch) runs under Hydra's basic launcher and under `hydra/launcher=torchrun`
(`nproc_per_node=1`), one after the other, from a fresh sweep dir, and prints per run:

- first task: seconds from the command's start to the first task's start (the task writes it);
- sweep: the command's wall time, and per job;
- peak RSS: the launching process's own peak (VmHWM from /proc, read until it exits: the
  basic launcher's tasks run inside it, this launcher's in processes of their own);
- written: bytes the launching process wrote (/proc/<pid>/io wchar: the record, the console).

    python benchmarks/scale.py --jobs 100 300 1000 [--launchers basic torchrun] [--json out.json]
"""

import argparse
import json
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
    sweep_dir = workdir / f"{launcher}-{jobs}"
    argv = [
        sys.executable,
        str(APP),
        "--multirun",
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={sweep_dir}",
        f"x=range(0,{jobs})",
    ]
    if launcher == "torchrun":
        argv.append("hydra.launcher.nproc_per_node=1")
    log = workdir / f"{launcher}-{jobs}.log"
    peak = {"rss_kb": 0, "wchar": 0}
    started = time.time()
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)

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
    first = float((sweep_dir / "first_task_started").read_text())
    return {
        "launcher": launcher,
        "jobs": jobs,
        "first_task_s": round(first - started, 2),
        "sweep_s": round(ended - started, 2),
        "per_job_s": round((ended - started) / jobs, 3),
        "peak_rss_mb": round(peak["rss_kb"] / 1024),
        "written_mb": round(peak["wchar"] / 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--launchers", nargs="+", default=["basic", "torchrun"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        for jobs in args.jobs:
            for launcher in args.launchers:
                result = run(launcher, jobs, Path(tmp))
                results.append(result)
                print(json.dumps(result), flush=True)
    header = ("N", "launcher", "first task", "sweep", "per job", "RSS", "written")
    print("\n{:>5} {:<9} {:>10} {:>8} {:>8} {:>7} {:>8}".format(*header))
    for r in results:
        print(
            f"{r['jobs']:>5} {r['launcher']:<9} {r['first_task_s']:>9.1f}s {r['sweep_s']:>7.1f}s "
            f"{r['per_job_s']:>7.3f}s {r['peak_rss_mb']:>5}MB {r['written_mb']:>6.1f}MB"
        )
    by = {(r["launcher"], r["jobs"]): r for r in results}
    for jobs in args.jobs:
        if ("basic", jobs) in by and ("torchrun", jobs) in by:
            b, t = by[("basic", jobs)], by[("torchrun", jobs)]
            print(
                f"N={jobs}: torchrun/basic  first task {t['first_task_s'] / b['first_task_s']:.2f}x, "
                f"sweep {t['sweep_s'] / b['sweep_s']:.2f}x, RSS +{t['peak_rss_mb'] - b['peak_rss_mb']} MB"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
