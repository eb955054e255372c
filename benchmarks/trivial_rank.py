"""The same trivial task as `trivial_app.py`, as a plain torchrun script (no Hydra).

    python -m torch.distributed.run --standalone --nproc_per_node=2 trivial_rank.py --out DIR --x 0

Each rank writes `DIR/rank<R>.json` with the same timestamps as the Hydra app's ranks.
"""

import time

started, cpu_started = time.time(), time.process_time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from proc_clock import process_created  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--x", type=int, default=0)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    imported = time.time()
    dist.init_process_group("gloo")
    joined = time.time()
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    created = process_created()
    record = {
        "x": args.x,
        "rank": int(os.environ["RANK"]),
        "pid": os.getpid(),
        "created": created,
        "start": started,
        "imported": imported,
        "joined": joined,
        "cpu_start": cpu_started,
    }
    record["cpu_end"] = time.process_time()
    record["end"] = time.time()
    path = Path(args.out) / f"rank{record['rank']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(path.with_suffix(".tmp"), path)


if __name__ == "__main__":
    main()
