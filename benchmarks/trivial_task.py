"""The benchmark's trivial rank task, shared by the Hydra app and the plain torchrun script.

Import torch, join a gloo group from torchrun's environment, one all_reduce, leave; the
rank's timestamps (time.time()) and CPU times go to `<out_dir>/rank<R>.json`.
"""

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional


def process_created() -> Optional[float]:
    """time.time() at which this process was created (10 ms ticks), else None.

    From /proc: the process's start in clock ticks since boot against the uptime now, both
    on the same clock, so the result is good to about one tick.
    """
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def write_json(directory: str, name: str, record: Dict[str, Any]) -> None:
    path = Path(directory) / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def run(x: Any, started: float, cpu_started: float, out_dir: str) -> float:
    """The task; `started`/`cpu_started` are when the caller's task (or script) began."""
    import torch
    import torch.distributed as dist

    imported = time.time()
    dist.init_process_group("gloo")
    joined = time.time()
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    record = {
        "x": x,
        "rank": int(os.environ["RANK"]),
        "pid": os.getpid(),
        "created": process_created(),
        "start": started,
        "imported": imported,
        "joined": joined,
        "cpu_start": cpu_started,
    }
    record["cpu_end"] = time.process_time()
    record["end"] = time.time()
    write_json(out_dir, f"rank{record['rank']}.json", record)
    return float(value.item())
