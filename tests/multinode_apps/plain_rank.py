"""The reference under plain `torchrun`: every rank joins the world and records where it ran.

    torchrun plain_rank.py OUT_DIR

Each rank writes OUT_DIR/rank<RANK>.json: its RANK/WORLD_SIZE/GROUP_RANK, its host, and the
(rank, host) of every rank of the world.
"""

import json
import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist
from held_gather import all_gather_held


def main() -> None:
    dist.init_process_group("gloo")
    host = socket.gethostname()
    world = all_gather_held((dist.get_rank(), host))  # all_gather_object, safe to destroy after
    dist.destroy_process_group()
    print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} on {host}", flush=True)
    facts = {
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")},
        "host": host,
        "world": world,
    }
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
