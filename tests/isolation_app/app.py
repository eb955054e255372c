"""A Hydra app whose ranks record what they see, for the launcher's isolation tests.

Each rank writes `rank<R>.json` into its job dir: torchrun's variables, env_set and the
callback's variable as the app's module `rank_probe` saw them at import and as the task
sees them, its cwd, whether the job's `.hydra/config.yaml` and the `on_job_start` marker
existed when it started; with `all_reduce=true`, the sum of x over the job's group.
The app's module body appends a line to `body_runs.txt` each time it runs.
"""

import json
import os
import sys
import time
from pathlib import Path

# before the script imports it: in a rank, psutil is there already only if the warm server
# preloaded it (a rank runs this body as torchrun's ranks do)
PSUTIL_PRELOADED = "psutil" in sys.modules

import hydra  # noqa: E402
import psutil  # noqa: E402, F401  (an installed package the app imports: what `preload: auto` takes)
import rank_probe  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

with open(Path(__file__).with_name("body_runs.txt"), "a") as _runs:
    _runs.write(f"{os.getpid()} RANK={os.environ.get('RANK')}\n")

MEET_TIMEOUT_S = 120


@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def main(cfg: DictConfig) -> dict:
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    rank = os.environ["RANK"]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    record = {
        "x": cfg.x,
        "at_import": rank_probe.AT_IMPORT,
        "cwd_at_import": rank_probe.CWD_AT_IMPORT,
        "now": {key: os.environ.get(key) for key in rank_probe.KEYS},
        "cwd": os.getcwd(),
        "hydra_config_written": (job_dir / ".hydra" / "config.yaml").is_file(),
        "job_started": (job_dir / "on_job_start.txt").is_file(),
        "attempt": attempt,
        "pid": os.getpid(),
        "psutil_preloaded": PSUTIL_PRELOADED,
    }
    print(f"hello from job {cfg.x} rank {rank}", flush=True)
    (job_dir / f"started_rank{rank}").touch()
    if cfg.meet:
        other_job = 1 - HydraConfig.get().job.num
        other = job_dir.parent / str(other_job) / f"started_rank{rank}"
        deadline = time.monotonic() + MEET_TIMEOUT_S
        while not other.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {cfg.x} never saw job {other_job} running")
            time.sleep(0.05)
    time.sleep(cfg.hold)
    if cfg.all_reduce:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([float(cfg.x)])
        dist.all_reduce(total)
        record["sum"] = total.item()
        record["world"] = dist.get_world_size()
        dist.destroy_process_group()
    if cfg.fail_first_attempt and attempt == 0:
        raise RuntimeError("failing the first attempt on purpose")
    (job_dir / f"rank{rank}.json").write_text(json.dumps(record))
    return {"x": cfg.x, "rank": int(rank), "attempt": attempt}


if __name__ == "__main__":
    main()
