"""The same trivial task as `trivial_app.py`, as a plain torchrun script (no Hydra).

    python -m torch.distributed.run --standalone --nproc_per_node=2 trivial_rank.py --out DIR --x 0

Each rank writes `DIR/rank<R>.json` with the same timestamps as the Hydra app's ranks.
"""

import time

started, cpu_started = time.time(), time.process_time()

import argparse  # noqa: E402

import trivial_task  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--x", type=int, default=0)
    args = parser.parse_args()

    trivial_task.run(args.x, started, cpu_started, args.out)


if __name__ == "__main__":
    main()
