"""Hydra launcher plugin that runs every sweep job as a torchrun (torch elastic) job."""

__version__ = "0.1.0"
