"""The project's own module, imported by the app."""


def scale(lr: float) -> float:
    return lr * 10
