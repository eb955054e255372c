"""A project module that the task imports only as it runs (inside its body)."""

from deeper import OFFSET


def shift(lr: float) -> float:
    return lr + OFFSET
