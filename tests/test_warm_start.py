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


# modules a user's app might have, each doing at import what a fork must not carry to ranks
UNFIT_MODULES = {
    "reads_rank.py": 'import os\nRANK = os.environ.get("RANK")\n',
    "reads_job_var.py": 'import os\nTAG = os.getenv("JOB_TAG")\n',
    "starts_thread.py": (
        "import threading\nimport time\n\n"
        "threading.Thread(target=time.sleep, args=(3600,), name='poller', daemon=True).start()\n"
    ),
    "exits_at_import.py": "import sys\nsys.exit(3)\n",
    "seeds.py": "import random\n\nrandom.seed(0)\n",
    "fine.py": "VALUE = 1\n",
}

WATCH_APP = """
import json
import os
import sys

import hydra
# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
# what the warm server preloaded, before this body (run in every rank) imports anything
PRELOADED = sorted(m for m in ("reads_rank", "reads_job_var", "starts_thread", "fine") if m in sys.modules)

import reads_job_var  # noqa: E402
import reads_rank  # noqa: E402


@hydra.main(**VERSION_BASE, config_path=None)
def main(cfg):
    record = {"preloaded": PRELOADED, "rank": reads_rank.RANK, "tag": reads_job_var.TAG}
    with open(f"rank{os.environ['RANK']}.json", "w") as f:
        json.dump(record, f)
    return cfg.x


if __name__ == "__main__":
    main()
"""


def test_preload_leaves_out_what_a_fork_would_carry_wrongly_with_one_line_each(tmp_path: Path) -> None:
    """A module whose import reads a per-rank or per-job variable, starts a thread or exits is
    not preloaded (each said once, by name and why); the others are; ranks see their own values."""
    for name, text in UNFIT_MODULES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "app.py").write_text(WATCH_APP)
    result = run_app(
        tmp_path / "app.py",
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.launcher.preload=[reads_rank,reads_job_var,starts_thread,exits_at_import,seeds,fine]",
            "+hydra.job.env_set.JOB_TAG=tag${hydra:job.num}",
            "hydra.job.chdir=true",
            "hydra.sweep.dir=sweep",
            "+x=0,1",
        ],
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    prefix = "hydra.launcher.preload: "
    suffix = "; ranks import it themselves"
    expected = [
        f"{prefix}reads_rank is not preloaded: reads_rank reads RANK at import, which differs per rank "
        "or job",
        f"{prefix}reads_job_var is not preloaded: reads_job_var reads JOB_TAG at import, which differs per "
        "rank or job",
        f"{prefix}starts_thread is not preloaded: it starts a Python thread at import (poller), which a fork "
        "cannot carry",
        f"{prefix}exits_at_import is not preloaded: it exits at import (SystemExit: 3)",
        f"{prefix}seeds is not preloaded: it seeds a global random generator at import (random), a seed a "
        "rank's fresh random state would lose",
    ]
    expected = [line + suffix for line in expected]
    for line in expected:
        assert output.count(line) == 1, (line, output)
    assert output.count(prefix) == len(expected), output
    for job in (0, 1):
        for rank in (0, 1):
            record = json.loads((tmp_path / "sweep" / str(job) / f"rank{rank}.json").read_text())
            assert record == {"preloaded": ["fine"], "rank": str(rank), "tag": f"tag{job}"}, (job, rank)


def test_a_preloaded_module_that_kills_the_process_is_named_and_left_out(tmp_path: Path) -> None:
    """An import that ends the warm server outright (os._exit, a crash) names the module."""
    (tmp_path / "kills.py").write_text("import os\nos._exit(7)\n")
    (tmp_path / "app.py").write_text(
        WATCH_APP.replace(
            "import reads_job_var  # noqa: E402\nimport reads_rank  # noqa: E402\n", ""
        ).replace(
            '"rank": reads_rank.RANK, "tag": reads_job_var.TAG', '"rank": os.environ["RANK"], "tag": None'
        )
    )
    result = run_app(
        tmp_path / "app.py",
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.preload=[kills]",
            "hydra.job.chdir=true",
            "hydra.sweep.dir=sweep",
            "+x=0",
        ],
        cwd=tmp_path,
    )
    line = (
        "hydra.launcher.preload: kills is not preloaded: the process ended (exit status 7) while importing "
        "it; ranks import it themselves"
    )
    assert (result.stdout + result.stderr).count(line) == 1, result.stdout + result.stderr
    assert json.loads((tmp_path / "sweep" / "0" / "rank0.json").read_text())["rank"] == "0"


# a Hydra plugin of the app's own project, as users add a SearchPathPlugin: each import of
# it (each scan of Hydra's plugins) leaves a line
PROJECT_PLUGIN = """
import os

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scans.txt"), "a") as f:
    f.write(f"{os.getpid()}\\n")


class ProjectSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        pass
"""


def test_hydras_plugins_are_scanned_once_a_sweep_not_again_in_each_job_and_rank(tmp_path: Path) -> None:
    """Hydra's plugin scan imports every module under `hydra_plugins`: the launcher and the
    warm server scan once each; the jobs and ranks forked from the server reuse its scan,
    also when the project that launches the sweep has plugins of its own."""
    (tmp_path / "hydra_plugins").mkdir()
    (tmp_path / "hydra_plugins" / "project_searchpath.py").write_text(PROJECT_PLUGIN)
    (tmp_path / "app.py").write_text(
        WATCH_APP.replace(
            "import reads_job_var  # noqa: E402\nimport reads_rank  # noqa: E402\n", ""
        ).replace(
            '{"preloaded": PRELOADED, "rank": reads_rank.RANK, "tag": reads_job_var.TAG}',
            '{"rank": os.environ["RANK"]}',
        )
    )
    run_app(
        tmp_path / "app.py",
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.job.chdir=true",
            "hydra.sweep.dir=sweep",
            "+x=0,1,2",
        ],
        cwd=tmp_path,
    )
    for job in (0, 1, 2):
        for rank in (0, 1):
            assert json.loads((tmp_path / "sweep" / str(job) / f"rank{rank}.json").read_text()) == {
                "rank": str(rank)
            }
    scans = (tmp_path / "scans.txt").read_text().split()
    assert len(scans) == len(set(scans)) == 2, scans


# a package the warm server preloads (the app does not import it) that leaves the collector
# as a large import can: more long-lived objects not yet walked than a quarter of all, the
# oldest generation's count past its threshold, so that the next automatic collection of the
# young generations is a full one. The rest of the server's start-up allocates too: the
# server itself makes no full collection of its own accord, each process forked from it gets
# the usual thresholds back. Every full collection notes the process it ran in.
BULKY = """
import gc
import os

SERVER = os.getpid()
LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "full_collections.txt")

gc.disable()
KEPT = [[i] for i in range(300_000)]
gc.enable()
for _ in range(gc.get_threshold()[2] + 1):
    gc.collect(1)
THRESHOLDS = gc.get_threshold()
gc.set_threshold(THRESHOLDS[0], THRESHOLDS[1], 10**9)
os.register_at_fork(after_in_child=lambda: gc.set_threshold(*THRESHOLDS))


def _note(phase, info):
    if phase == "stop" and info["generation"] == 2:
        with open(LOG, "a") as f:
            f.write(f"{os.getpid()} {os.getpid() == SERVER}\\n")


gc.callbacks.append(_note)
"""


def test_no_job_or_rank_pays_a_full_collection_of_what_the_warm_server_imported(tmp_path: Path) -> None:
    """What the warm server's preload made is collected once, in the server: a job process
    or a rank forked from it never walks that whole heap again (under Optuna's sweeper, whose
    packages the server preloads, such a collection cost every job 0.2 s)."""
    (tmp_path / "bulky.py").write_text(BULKY)
    (tmp_path / "app.py").write_text(
        WATCH_APP.replace(
            "import reads_job_var  # noqa: E402\nimport reads_rank  # noqa: E402\n", ""
        ).replace(
            '{"preloaded": PRELOADED, "rank": reads_rank.RANK, "tag": reads_job_var.TAG}',
            '{"rank": os.environ["RANK"], "bulky": "bulky" in sys.modules}',
        )
    )
    run_app(
        tmp_path / "app.py",
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.launcher.preload=[bulky]",
            "hydra.job.chdir=true",
            "hydra.sweep.dir=sweep",
            "+x=0,1",
        ],
        cwd=tmp_path,
    )
    for job in (0, 1):
        for rank in (0, 1):
            record = json.loads((tmp_path / "sweep" / str(job) / f"rank{rank}.json").read_text())
            assert record == {"rank": str(rank), "bulky": True}, (job, rank)
    log = tmp_path / "full_collections.txt"
    collections = log.read_text().splitlines() if log.exists() else []
    assert [line for line in collections if not line.endswith(" True")] == [], collections
