"""The real-app case of `lightning_sweep.py`: a Lightning DDP fit per sweep job.

Each job fits a small regression with `Trainer(strategy="ddp", accelerator="cpu",
devices=2)` on synthetic data for a few steps. Rank 0 writes `timing.json` into the job's
output dir: when the task started, when `trainer.fit` started and ended (time.time()),
so the benchmark can tell the launcher's time from the training loop's.
"""

import json
import os
import time
import warnings
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> None:
    task_start = time.time()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    fit_start = time.time()
    trainer.fit(Regression(), DataLoader(data, batch_size=16))
    fit_end = time.time()
    if trainer.global_rank == 0:
        out = Path(HydraConfig.get().runtime.output_dir) / "timing.json"
        out.write_text(
            json.dumps(
                {"task_start": task_start, "fit_start": fit_start, "fit_end": fit_end, "pid": os.getpid()}
            )
        )


if __name__ == "__main__":
    main()
