"""Wall time of the same sleep-bound sweep with parallel_jobs=1 and parallel_jobs=2.

    python benchmarks/parallel_jobs.py --jobs 4 --seconds 3

Each job has `--nproc` ranks that sleep `--seconds`; `devices` lists 2 x nproc ids so two
jobs can run at once, each on devices of its own. Prints both wall times and their ratio
(about 0.5 when jobs overlap fully), also after taking off the start-up (Hydra, the
launcher's torch import, the forkserver) that both pay once.
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

APP = Path(__file__).with_name("sleep_app.py")


def run_sweep(parallel_jobs: int, jobs: int, nproc: int, seconds: float, work: Path) -> float:
    devices = ",".join(str(i) for i in range(2 * nproc))
    argv = [
        sys.executable,
        str(APP),
        "--multirun",
        "hydra/launcher=torchrun",
        f"hydra.launcher.nproc_per_node={nproc}",
        f"hydra.launcher.parallel_jobs={parallel_jobs}",
        f"hydra.launcher.devices=[{devices}]",
        f"hydra.sweep.dir={work / f'k{parallel_jobs}'}",
        f"+seconds={seconds}",
        "+x=" + ",".join(str(i) for i in range(jobs)),
    ]
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    subprocess.run(argv, cwd=work, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fixed = run_sweep(1, 1, args.nproc, 0.0, work / "fixed")
        k1 = run_sweep(1, args.jobs, args.nproc, args.seconds, work)
        k2 = run_sweep(2, args.jobs, args.nproc, args.seconds, work)
    print(f"{args.jobs} jobs x {args.nproc} ranks, each sleeping {args.seconds:g} s")
    print(f"parallel_jobs=1: {k1:6.2f} s")
    print(f"parallel_jobs=2: {k2:6.2f} s")
    print(f"ratio K=2/K=1:   {k2 / k1:6.3f}")
    print(f"start-up (one job that does not sleep): {fixed:.2f} s")
    print(f"ratio K=2/K=1 after start-up: {(k2 - fixed) / (k1 - fixed):6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
