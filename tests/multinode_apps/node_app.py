"""A Hydra app for the multi-node tests: every rank joins its job's gloo world and records it.

Each rank writes `<job output dir>/ranks/rank<RANK>.json` (its env, the `x` it was given,
the `x` of every rank of the job, an all_reduce, its pid) and returns the same facts; the
`record_returns` callback writes the JobReturn this node's launcher got.
"""

import json
import os
import socket
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@hydra.main(**VERSION_BASE, config_path=".", config_name="node_config")
def main(cfg: DictConfig) -> dict:
    import rank_probe
    import torch
    import torch.distributed as dist
    from held_gather import all_gather_held

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    xs = all_gather_held(cfg.x)  # all_gather_object, safe to destroy after on every torch
    dist.destroy_process_group()
    host = socket.gethostname()
    print(f"rank {os.environ.get('RANK')}/{os.environ.get('WORLD_SIZE')} on {host}", flush=True)
    facts = {
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "at_import": rank_probe.AT_IMPORT,
        "host": host,
        "x": cfg.x,
        "xs": xs,
        "allreduce": total.item(),
        "pid": os.getpid(),
        "job_num": HydraConfig.get().job.num,
    }
    ranks = Path(HydraConfig.get().runtime.output_dir) / "ranks"
    ranks.mkdir(exist_ok=True)
    tmp = ranks / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(facts))
    tmp.rename(ranks / f"rank{rank}.json")
    return facts


if __name__ == "__main__":
    main()
