"""A PyTorch Lightning DDP fit inside a torchrun launcher job.

    python lightning_app.py --multirun hydra/launcher=torchrun hydra.launcher.nproc_per_node=2

Lightning must join the world the launcher made (TorchElasticEnvironment: RANK, WORLD_SIZE,
MASTER_ADDR/PORT from the launcher) and start no process of its own. Every rank writes
`<job dir>/rank<R>.json`: Lightning's view of its rank and world, its losses and final
weights, and the process tree under the launching process while training, as psutil sees it.
"""

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List

import hydra
import lightning as L
import psutil
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}

ConfigStore.instance().store(name="config", node={"epochs": 2, "lr": 0.1, "samples": 64, "batch_size": 8})

APP = os.path.basename(__file__)


def _describe(proc: psutil.Process) -> Dict[str, Any]:
    try:
        return {"pid": proc.pid, "ppid": proc.ppid(), "cmdline": proc.cmdline()}
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return {"pid": proc.pid, "ppid": None, "cmdline": []}


def _launching_process() -> psutil.Process:
    """The outermost ancestor running this app: the process the user started."""
    found = None
    proc = psutil.Process().parent()
    while proc is not None:
        try:
            if any(arg.endswith(APP) for arg in proc.cmdline()):
                found = proc
        except psutil.AccessDenied:
            pass
        proc = proc.parent()
    assert found is not None, "no ancestor runs " + APP
    return found


def process_tree() -> Dict[str, Any]:
    me = psutil.Process()
    launcher = _launching_process()
    return {
        "pid": me.pid,
        "ppid": me.ppid(),
        "children": [_describe(p) for p in me.children(recursive=True)],
        "launcher": _describe(launcher),
        "under_launcher": [_describe(p) for p in launcher.children(recursive=True)],
    }


class Regression(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.lr = lr
        self.losses: List[float] = []
        self.tree_while_training: Dict[str, Any] = {}

    def on_train_start(self) -> None:
        # DDP has wrapped the model (a collective): every rank of the job is running now
        self.tree_while_training = process_tree()
        self.trainer.strategy.barrier()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_data(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 1.0
    return TensorDataset(x, y)


@hydra.main(**VERSION_BASE, config_path=None, config_name="config")
def fit(cfg: DictConfig) -> float:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    # Lightning's idea of this process's rank before any Trainer exists (it reads RANK at import)
    rank_before_trainer = rank_zero_only.rank
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(int(os.environ["RANK"]))  # different initial weights per rank: DDP syncs them
    model = Regression(cfg.lr)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=cfg.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(make_data(cfg.samples), batch_size=cfg.batch_size))
    strategy = trainer.strategy
    steps_per_epoch = len(model.losses) // cfg.epochs
    record = {
        "env_rank": int(os.environ["RANK"]),
        "env_local_rank": int(os.environ["LOCAL_RANK"]),
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "strategy": type(strategy).__name__,
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "creates_processes_externally": strategy.cluster_environment.creates_processes_externally,
        # Lightning's own launcher: the scripts it started (none when the environment starts them)
        "strategy_launcher": type(strategy.launcher).__name__,
        "strategy_launcher_procs": len(getattr(strategy.launcher, "procs", [])),
        "process_group_world": torch.distributed.get_world_size(),
        "losses": model.losses,
        "first_epoch_loss": sum(model.losses[:steps_per_epoch]) / steps_per_epoch,
        "last_epoch_loss": sum(model.losses[-steps_per_epoch:]) / steps_per_epoch,
        "train_loss_metric": trainer.callback_metrics["train_loss"].item(),
        "weights": model.layer.weight.detach().flatten().tolist() + model.layer.bias.detach().tolist(),
        "tree_while_training": model.tree_while_training,
        "children_after_fit": [_describe(p) for p in psutil.Process().children(recursive=True)],
        "argv": sys.argv,
        "rank_zero_only_before_trainer": rank_before_trainer,
    }
    torch.distributed.destroy_process_group()
    out = Path(HydraConfig.get().runtime.output_dir) / f"rank{trainer.global_rank}.json"
    out.write_text(json.dumps(record, indent=1))
    return record["train_loss_metric"]


if __name__ == "__main__":
    fit()
