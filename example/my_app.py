"""A tiny DistributedDataParallel training app, run by the torchrun launcher.

Every sweep job is a torchrun job with `world` ranks (gloo, CPU). Each rank trains a linear
regression on its shard of a synthetic data set; rank 0 logs the loss and writes
`checkpoint.pt` (model state, losses, world size) into the job's output dir. The task
returns the final loss, averaged over all ranks, which is the job's return value.

    python my_app.py --multirun lr=0.1,0.01 world=1,2   # 4 jobs: 1 and 2 ranks each
    python my_app.py --multirun world=2                 # one job, 2 ranks

Always pass --multirun: a plain run does not go through the launcher, so there is no
process group to join. `world` sets `hydra.launcher.nproc_per_node` (see config.yaml).
"""

import logging
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

FEATURES = 8
SAMPLES = 1024


def make_data(seed: int) -> tuple:
    """The same data set on every rank: y = X @ w + noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    return x, x @ w + 0.01 * torch.randn(SAMPLES, 1, generator=gen)


def mean_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean squared error over every rank's shard: the same value on all ranks."""
    with torch.no_grad():
        totals = torch.tensor([((model(x) - y) ** 2).sum().item(), float(len(x))])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


@hydra.main(version_base="1.3", config_path=".", config_name="config")
def train(cfg: DictConfig) -> float:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT come from the launcher
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        x, y = make_data(cfg.seed)
        x, y = x[rank::world_size], y[rank::world_size]  # this rank's shard
        torch.manual_seed(cfg.seed)
        model = DistributedDataParallel(torch.nn.Linear(FEATURES, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        first_loss = mean_loss(model, x, y)
        for epoch in range(cfg.epochs):
            for start in range(0, len(x), cfg.batch_size):
                xb, yb = x[start : start + cfg.batch_size], y[start : start + cfg.batch_size]
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(xb), yb).backward()  # DDP averages gradients
                optimizer.step()
            loss = mean_loss(model, x, y)
            if rank == 0:
                log.info("epoch %d loss %.6f", epoch, loss)
        if rank == 0:
            out = Path(HydraConfig.get().runtime.output_dir) / "checkpoint.pt"
            state = {"model": model.module.state_dict(), "first_loss": first_loss, "loss": loss}
            torch.save({**state, "world_size": world_size, "lr": cfg.lr}, out)
            log.info("world %d lr %g: loss %.6f -> %.6f, saved %s", world_size, cfg.lr, first_loss, loss, out)
        return loss
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    train()
