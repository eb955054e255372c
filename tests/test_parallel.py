"""parallel_jobs and devices: concurrent jobs on one node, each on devices of its own."""

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
from hydra.test_utils.test_utils import TSweepRunner
from omegaconf import DictConfig

from hydra_plugins.hydra_torchrun_launcher._launcher.settings import LauncherConfigError
from tests.conftest import assert_gone
from tests.test_launcher import sweep

pytestmark = [pytest.mark.usefixtures("hydra_restore_singletons"), pytest.mark.timeout(240)]

MEET_TIMEOUT_S = 120


def _record_devices(cfg: DictConfig) -> Dict[str, Any]:
    """Each rank records its devices and when it ran; the first two jobs wait to see each other."""
    marker_dir = Path(cfg.marker_dir)
    rank = os.environ["RANK"]
    start = time.time()
    (marker_dir / f"running_{cfg.x}_{rank}").touch()
    if cfg.x in (0, 1):
        # jobs 0 and 1 can only both get here if they run at the same time
        other = marker_dir / f"running_{1 - cfg.x}_{rank}"
        deadline = time.monotonic() + MEET_TIMEOUT_S
        while not other.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {cfg.x} never saw job {1 - cfg.x} running")
            time.sleep(0.05)
    record = {
        "x": cfg.x,
        "rank": int(rank),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "devices": os.environ["CUDA_VISIBLE_DEVICES"].split(","),
        "start": start,
        "end": time.time(),
        "pid": os.getpid(),
    }
    (marker_dir / f"record_{cfg.x}_{rank}.json").write_text(json.dumps(record))
    return record


def test_concurrent_jobs_get_disjoint_devices(hydra_sweep_runner: TSweepRunner, tmp_path: Path) -> None:
    returns = sweep(
        hydra_sweep_runner,
        _record_devices,
        [
            "hydra.launcher.nproc_per_node=2",
            "hydra.launcher.parallel_jobs=2",
            "hydra.launcher.devices=[0,1,2,3]",
            f"+marker_dir={tmp_path}",
            "+x=0,1,2,3",
        ],
        tmp_path / "sweep",
    )
    # results come back in job order, each rank 0's
    assert [r.return_value["x"] for r in returns] == [0, 1, 2, 3]
    records: List[Dict[str, Any]] = [json.loads(p.read_text()) for p in tmp_path.glob("record_*.json")]
    assert len(records) == 8
    by_job: Dict[int, List[Dict[str, Any]]] = {}
    for record in records:
        by_job.setdefault(record["x"], []).append(record)
    spans = {x: (min(r["start"] for r in rs), max(r["end"] for r in rs)) for x, rs in by_job.items()}
    devices = {x: set(rs[0]["devices"]) for x, rs in by_job.items()}
    for x, rs in by_job.items():
        # every rank of a job sees the job's two devices; LOCAL_RANK indexes them in order
        assert all(set(r["devices"]) == devices[x] and len(r["devices"]) == 2 for r in rs)
    overlapping = [
        (a, b)
        for a in spans
        for b in spans
        if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
    ]
    assert (0, 1) in overlapping
    for a, b in overlapping:
        assert not devices[a] & devices[b], f"jobs {a} and {b} ran at once on {devices[a] & devices[b]}"
    assert_gone(r["pid"] for r in records)


def _sleepy(cfg: DictConfig) -> int:
    (Path(cfg.marker_dir) / f"ran_{cfg.x}_{os.environ['RANK']}").touch()
    return cfg.x


def test_a_job_that_asks_for_more_devices_than_exist_is_refused(
    hydra_sweep_runner: TSweepRunner, tmp_path: Path
) -> None:
    with pytest.raises(
        LauncherConfigError, match=r"hydra.launcher.nproc_per_node=3 \(job 0\) is more than the 2"
    ):
        sweep(
            hydra_sweep_runner,
            _sleepy,
            [
                "hydra.launcher.nproc_per_node=3",
                "hydra.launcher.parallel_jobs=2",
                "hydra.launcher.devices=[0,1]",
                f"+marker_dir={tmp_path}",
                "+x=0,1",
            ],
            tmp_path / "sweep",
        )
    assert not list(tmp_path.glob("ran_*"))


def _fail_job_one(cfg: DictConfig) -> int:
    if cfg.x == 1:
        raise RuntimeError("job one fails")
    return _sleepy(cfg)


def test_a_failed_job_frees_its_devices(hydra_sweep_runner: TSweepRunner, tmp_path: Path) -> None:
    # 2 devices, 2 ranks per job: every job needs all of them, so each waits for the one before
    with pytest.raises(Exception, match="job one fails"):
        sweep(
            hydra_sweep_runner,
            _fail_job_one,
            [
                "hydra.launcher.nproc_per_node=2",
                "hydra.launcher.parallel_jobs=2",
                "hydra.launcher.devices=[0,1]",
                f"+marker_dir={tmp_path}",
                "+x=0,1,2",
            ],
            tmp_path / "sweep",
        )
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_0_0", "ran_0_1", "ran_2_0", "ran_2_1"]
