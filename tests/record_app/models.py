"""A project module only Hydra's `instantiate` imports, named by the config's `_target_`."""


class Scaler:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, lr: float) -> float:
        return lr * self.factor
