"""What a whole command costs, start to exit: this launcher against plain torchrun.

The edit-run loop of a user: one job (`hydra.mode: MULTIRUN`, or `-m` with no sweep), and a
short sweep. Three cases, each timed as whole commands (wall clock, start to exit):

  lightning: `python lightning_app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2`
             against `torchrun --standalone --nproc-per-node 2 lightning_app.py` (a Lightning
             DDP fit, 2 CPU ranks, 10 steps; the app imports Lightning at module level);
  trivial:   the same with `trivial_app.py` (each rank imports torch, one all_reduce);
  sweep:     a 5-job sweep of `lightning_app.py` (`+x=range(5)`) against a loop of 5 torchrun
             commands.

Runs are paired and interleaved: each round runs every variant of a case once, one after
the other, so that a machine shared with other work loads them alike; the figures are the
medians over the rounds, and the ratios are of those medians. Variants:

  torchrun   plain torchrun (a loop of it for the sweep);
  launcher   this checkout, after a first run of the app (not counted);
  other      with `--compare-with DIR`: the checkout in DIR (another revision), through
             PYTHONPATH, for a before/after in one run.

Every plugin run goes into a fresh sweep dir with `hydra.launcher.resume=false` (rerunning
into a sweep dir would resume instead of running).

    python benchmarks/single_run.py [--rounds 5] [--cases lightning,trivial,sweep] [--compare-with DIR]

Measured on a 2-core machine with other work running (1-min load 1.4 to 3.2 at round
starts), CPU torch 2.13, Lightning 2.6.6, 3 rounds, medians in seconds (ratio to torchrun);
`other` was a checkout whose warm server was a fork of the launcher, not shipped (see
docs/benchmarks.md: a rank saw the launcher's copy of the app's classes):

    case        torchrun        launcher        other (fork, not shipped)
    lightning     6.78 (1.00)    8.18 (1.21)     5.88 (0.87)
    sweep        42.38 (1.00)   12.27 (0.29)    10.11 (0.24)
    trivial       4.26 (1.00)    2.40 (0.56)     2.57 (0.60)

The trivial app imports no package at module level (its ranks import torch): there is no
second import to save, and its rows differ by noise only.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
LIGHTNING = HERE / "lightning_app.py"
TRIVIAL = HERE / "trivial_app.py"
SWEEP_JOBS = 5


def _env(cache: Path, pythonpath: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1", XDG_CACHE_HOME=str(cache))
    env.pop("PYTHONSTARTUP", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return env


def _timed(commands: List[List[str]], cwd: Path, env: Dict[str, str], log: Path) -> float:
    started = time.perf_counter()
    for command in commands:
        with open(log, "ab") as out:
            result = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(command)} exited {result.returncode}; see {log}")
    return time.perf_counter() - started


def _plugin(app: Path, sweep_dir: Path, jobs: int) -> List[List[str]]:
    sweep = [f"+x=range({jobs})"] if jobs > 1 else []
    return [
        [
            sys.executable,
            str(app),
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.launcher.resume=false",
            f"hydra.sweep.dir={sweep_dir}",
            *sweep,
        ]
    ]


def _torchrun(app: Path, run_dir: Path, jobs: int) -> List[List[str]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if jobs == 1:
        return [[*torchrun, str(app), f"hydra.run.dir={run_dir}"]]
    return [[*torchrun, str(app), f"+x={i}", f"hydra.run.dir={run_dir / str(i)}"] for i in range(jobs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="lightning,trivial,sweep")
    parser.add_argument("--compare-with", type=Path, default=None, help="a checkout of another revision")
    args = parser.parse_args()
    cases = {"lightning": (LIGHTNING, 1), "trivial": (TRIVIAL, 1), "sweep": (LIGHTNING, SWEEP_JOBS)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        log = work / "runs.log"
        warm_cache = work / "cache"
        counter = iter(range(1_000_000))

        def fresh(name: str) -> Path:
            return work / f"{name}{next(counter)}"

        variants: Dict[str, Callable[[Path, int], float]] = {
            "torchrun": lambda app, jobs: _timed(
                _torchrun(app, fresh("run"), jobs), work, _env(warm_cache, None), log
            ),
            "launcher": lambda app, jobs: _timed(
                _plugin(app, fresh("sweep"), jobs), work, _env(warm_cache, None), log
            ),
        }
        if args.compare_with is not None:
            other = str(args.compare_with.resolve())
            variants["other"] = lambda app, jobs: _timed(
                _plugin(app, fresh("sweep"), jobs), work, _env(fresh("cache"), other), log
            )
        results: Dict[str, Dict[str, List[float]]] = {}
        loads: List[float] = []
        for case in args.cases.split(","):
            app, jobs = cases[case]
            variants["launcher"](app, 1)  # a first run, not counted: files in the OS cache
            results[case] = {name: [] for name in variants}
            for _ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                for name, run in variants.items():
                    results[case][name].append(run(app, jobs))
    seen = f"{min(loads):.1f} to {max(loads):.1f}"
    print(f"{args.rounds} rounds, medians in s (ratio to torchrun); 1-min load {seen} at round starts")
    print(f"{'case':10} " + " ".join(f"{name:>16}" for name in variants))
    for case, by_variant in results.items():
        base = statistics.median(by_variant["torchrun"])
        cells = []
        for times in by_variant.values():
            median = statistics.median(times)
            cells.append(f"{median:7.2f} ({median / base:4.2f})")
        print(f"{case:10} " + " ".join(f"{cell:>16}" for cell in cells))
    print("all runs (s):")
    for case, by_variant in results.items():
        for name, times in by_variant.items():
            print(f"  {case:10} {name:9} " + " ".join(f"{t:6.2f}" for t in times))


if __name__ == "__main__":
    main()
