"""The trivial app of `benchmarks/slurm_submit.py`: each rank prints the time of its first line."""

import time

import hydra

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}


@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg: object) -> int:
    print(f"first rank line at {time.time():.3f}", flush=True)
    return 0


if __name__ == "__main__":
    main()
