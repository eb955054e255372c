"""A Lightning DDP fit that stops when the launcher is asked to, and resumes: the README's recipe.

    python lightning_preempt_app.py --multirun hydra/launcher=torchrun hydra.launcher.nproc_per_node=2

`StopOnPreemption` is the callback of the README: when `preemption.should_stop()` says so
(the same step on every rank), it saves a checkpoint through the Trainer and stops it; a
resumed job fits from that checkpoint. Every rank writes `<job dir>/rank<R>.json`.
"""

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import hydra.errors
import lightning as L
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset

from hydra_plugins.hydra_torchrun_launcher import preemption

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

ConfigStore.instance().store(
    name="config",
    node={
        "epochs": 3,
        "lr": 0.1,
        "samples": 64,
        "batch_size": 8,
        "step_s": 0.2,
        "hydra": {"job": {"chdir": True}},
    },
)


class StopOnPreemption(L.Callback):
    """Stop the Trainer at the step where the launcher asks every rank to stop, checkpointed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if preemption.should_stop():
            trainer.save_checkpoint(self.path)  # every rank calls it; rank 0 writes the file
            trainer.should_stop = True


class Regression(L.LightningModule):
    def __init__(self, lr: float, step_s: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.lr = lr
        self.step_s = step_s
        self.start_step = -1

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_s)
        x, y = batch
        print(f"rank {self.global_rank}: step {self.trainer.global_step + 1}", flush=True)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@hydra.main(**VERSION_BASE, config_path=None, config_name="config")
def fit(cfg: DictConfig) -> int:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.samples, 4, generator=gen)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=cfg.batch_size)
    checkpoint = "preempted.ckpt"  # in the job dir, where a resumed job runs again
    model = Regression(cfg.lr, cfg.step_s)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        max_epochs=cfg.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StopOnPreemption(checkpoint)],
    )
    resuming = preemption.resumed() and os.path.exists(checkpoint)
    trainer.fit(model, data, ckpt_path=checkpoint if resuming else None)
    record = {"start_step": model.start_step, "final_step": trainer.global_step}
    Path(f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    torch.distributed.destroy_process_group()
    return trainer.global_step


if __name__ == "__main__":
    fit()
