"""Exceptions that do not travel as plain ones do, for the fault app's ranks (`how=...`)."""

import threading


class DropsAttributes(ValueError):
    """Like pydantic's ValidationError: its pickling keeps its args alone, not its attributes
    (nor the notes Python keeps among them)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.errors = [{"loc": "zero_stage", "msg": "Input should be 0, 1, 2 or 3"}]

    def __reduce__(self):
        return (type(self), self.args)


class Unpicklable(RuntimeError):
    """Holds what cannot be pickled at all (a lock)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class NeedsArguments(Exception):
    """Its constructor takes other arguments than its args: unpickling it calls it wrongly."""

    def __init__(self, field: str, value: object) -> None:
        super().__init__(f"bad {field}: {value!r}")
        self.field = field
        self.value = value


class BadStr(RuntimeError):
    """Its `__str__` raises: its message cannot be rendered at all."""

    def __str__(self) -> str:
        raise TypeError("no str for this one")
