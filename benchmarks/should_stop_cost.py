"""What `preemption.should_stop()` costs per call: 2 ranks on loopback (gloo, CPU).

    python benchmarks/should_stop_cost.py --calls 1000 --rounds 5 --step-ms 5

Runs one job of `should_stop_app.py` under the launcher (the stop file and the agreement
as in any sweep) and prints rank 0's median time per call of `should_stop()` and of one
blocking all-reduce of an integer (what a check that waits for the other ranks costs):
back to back, and between steps of `--step-ms` that leave the CPU free (as a rank that
waits for its GPU does).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

APP = Path(__file__).with_name("should_stop_app.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        subprocess.run(
            [
                sys.executable,
                str(APP),
                "--multirun",
                "hydra/launcher=torchrun",
                f"hydra.launcher.nproc_per_node={args.nproc}",
                "hydra.sweep.dir=sweep",
                f"+calls={args.calls}",
                f"+rounds={args.rounds}",
                f"+step_ms={args.step_ms}",
            ],
            cwd=work,
            check=True,
            capture_output=True,
        )
        summary = json.loads((Path(work) / "sweep" / "sweep_summary.json").read_text())
    result = summary["jobs"][0]["return_value"]
    rounds = f"median of {args.rounds} rounds of {args.calls} calls"
    print(f"{args.nproc} ranks, loopback gloo, {rounds}, microseconds per call:")
    print(f"{'':28}{'back to back':>14}{f'{args.step_ms:g} ms steps apart':>22}")
    for name, label in (("should_stop", "should_stop()"), ("all_reduce", "blocking all_reduce")):
        print(f"  {label:26}{result[name]:14.1f}{result[name + '_in_steps']:22.1f}")


if __name__ == "__main__":
    main()
