"""When this process was created, on the time.time() clock (Linux), for the benchmark's ranks."""

import os
import time
from typing import Optional


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
