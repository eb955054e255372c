"""The warm server never hands the ranks a process in which CUDA was initialised.

A rank forked from a process that initialised CUDA cannot use CUDA. An app may import a
library that initialises CUDA when imported; the launcher must then leave it out of the
warm server's preload (one warning, once per sweep), and the ranks still import it
themselves. On a machine with a GPU the library below really initialises CUDA; on a
CPU-only torch it leaves `torch.cuda` in the state an initialisation leaves, which is
what the warm server checks.
"""

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_app

pytestmark = pytest.mark.timeout(300)

GPU_LIB = '''
"""A library that initialises CUDA when it is imported, as some do."""
import torch

if torch.cuda.is_available():
    torch.cuda.init()
else:  # a CPU-only torch: what torch.cuda.init() leaves behind
    torch.cuda._initialized = True
'''

APP = """
import json
import os
import sys

import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
import torch


@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    record = {
        # the process the rank was forked from had initialised CUDA
        "cuda_initialized_at_start": torch.cuda.is_initialized(),
        "gpu_lib_at_start": "gpu_lib" in sys.modules,
    }
    import gpu_lib  # noqa: F401  (the rank imports it itself)

    with open(f"rank{os.environ['RANK']}.json", "w") as f:
        json.dump(record, f)
    return cfg.x


if __name__ == "__main__":
    main()
"""


def test_a_module_that_initialises_cuda_is_never_preloaded(tmp_path: Path) -> None:
    (tmp_path / "gpu_lib.py").write_text(GPU_LIB)
    (tmp_path / "app.py").write_text(APP)
    result = run_app(
        tmp_path / "app.py",
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.launcher.preload=[gpu_lib]",
            "hydra.job.chdir=true",
            # one launch per job, as sweepers that work in batches call the launcher
            "hydra.sweeper.max_batch_size=1",
            "hydra.sweep.dir=sweep",
            "+x=0,1",
        ],
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    warning = (
        "hydra.launcher.preload: gpu_lib is not preloaded: importing it initialises CUDA, which forked ranks "
        "could not use; ranks import it themselves"
    )
    assert output.count(warning) == 1, output
    for job in (0, 1):
        for rank in (0, 1):
            record = json.loads((tmp_path / "sweep" / str(job) / f"rank{rank}.json").read_text())
            assert record == {"cuda_initialized_at_start": False, "gpu_lib_at_start": False}, (job, rank)
    assert sys.modules.get("gpu_lib") is None
