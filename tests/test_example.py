"""The example app, run as a user runs it: a sweep over learning rate and world size."""

from pathlib import Path

import torch
import yaml

from tests.conftest import run_app

APP = Path(__file__).resolve().parent.parent / "example" / "my_app.py"


def test_example_sweeps_lr_and_world_size(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_app(
        APP, ["--multirun", "lr=0.1,0.01", "world=1,2", f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path
    )
    assert result.returncode == 0

    job_dirs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [p.name for p in job_dirs] == ["0", "1", "2", "3"]
    seen = set()
    for job_dir in job_dirs:
        cfg = yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())
        ckpt = torch.load(job_dir / "checkpoint.pt")
        assert ckpt["world_size"] == cfg["world"], job_dir
        assert ckpt["lr"] == cfg["lr"], job_dir
        assert ckpt["loss"] < ckpt["first_loss"] / 10, (job_dir, ckpt["first_loss"], ckpt["loss"])
        assert set(ckpt["model"]) == {"weight", "bias"}
        # rank 0 logs the summary to the job's log; rank 1 has a log file of its own
        assert "saved" in (job_dir / "my_app.log").read_text()
        assert (job_dir / "my_app_rank1.log").exists() == (cfg["world"] == 2)
        seen.add((cfg["lr"], cfg["world"]))
    assert seen == {(0.1, 1), (0.1, 2), (0.01, 1), (0.01, 2)}
