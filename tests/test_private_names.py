"""The private names of torch, multiprocessing and Hydra the launcher uses are all listed, and here.

Run on the oldest and newest supported releases (CI does both), this says which listed
name a release removed; the launcher itself then degrades as the list says.
"""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from hydra_plugins.hydra_torchrun_launcher._shared import private as _private

# the package root: the public modules and every private folder
PACKAGE = Path(_private.__file__).parents[1]


@pytest.mark.parametrize("entry", _private.PRIVATE_NAMES, ids=lambda e: f"{e.module}:{e.name}")
def test_listed_name_is_present_here(entry: _private.PrivateName) -> None:
    if entry.only_in:
        from importlib.metadata import version

        package, release = entry.only_in.split()
        if not version(package).startswith(release):
            assert not _private.present(entry.module, entry.name), (
                f"{entry}: now in {package} {version(package)}"
            )
            return
    if entry.name.startswith("JobReturn."):
        from hydra.core.utils import JobReturn

        assert entry.name.split(".")[1] in JobReturn.__dataclass_fields__, entry
    else:
        assert _private.present(entry.module, entry.name), f"{entry} (checked on {_private.CHECKED_ON})"


def test_no_unlisted_private_import() -> None:
    """An underscore name imported from torch, multiprocessing or Hydra is one of the list's."""
    listed = {entry.name.split(".")[0] for entry in _private.PRIVATE_NAMES}
    for path in PACKAGE.rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.replace(",", " ").split()
            if words[:1] != ["from"] or words[1].split(".")[0] not in ("torch", "multiprocessing", "hydra"):
                continue
            imported = [w for w in words[3:] if w.startswith("_") and w not in ("as",)]
            assert set(imported) <= listed, f"{path.name}: {line.strip()}"


def test_loggers_are_flushed_without_hydras_helper(tmp_path: Path) -> None:
    log_file = tmp_path / "job.log"
    handler = logging.FileHandler(log_file)
    logger = logging.getLogger("hydra_torchrun_test_flush")
    logger.addHandler(handler)
    handler.stream.write("written\n")  # buffered until flushed
    try:
        _private._flush_every_handler()
        assert log_file.read_text() == "written\n"
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_the_entry_point_alone_registers_the_launcher() -> None:
    """Hydra 1.4 may load the launcher through its `hydra.plugins` entry point, scanning nothing."""
    code = (
        "from importlib.metadata import entry_points\n"
        "try:\n"
        "    group = entry_points(group='hydra.plugins')\n"
        "except TypeError:\n"
        "    group = entry_points().get('hydra.plugins', [])\n"
        "cls = [ep for ep in group if ep.name == 'torchrun'][0].load()\n"
        "from hydra.core.config_store import ConfigStore\n"
        "assert cls.__name__ == 'TorchrunLauncher', cls\n"
        "assert 'torchrun.yaml' in ConfigStore.instance().list('hydra/launcher')\n"
        "import sys; assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
