"""The error a user's setting raises, in whichever process finds it (before any rank starts)."""

from hydra.errors import CompactHydraException


class LauncherConfigError(CompactHydraException, ValueError):
    """A launcher setting a user gave that cannot work; its message names the key.

    Hydra prints a CompactHydraException as its message alone: one line, no stack.
    """
