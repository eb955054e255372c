"""A project module that the task imports only as it runs (inside its body)."""


def shift(lr: float) -> float:
    return lr + 1
