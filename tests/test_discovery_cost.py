"""What the installed plugin costs apps that do not use it.

Hydra's plugin discovery imports `config.py` and `torchrun_launcher.py` on every run of
every app, so neither may import torch (seconds) nor do much work of its own.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest

from tests.conftest import run_app

PLUGIN = "hydra_plugins.hydra_torchrun_launcher"
DISCOVERED = (f"{PLUGIN}.config", f"{PLUGIN}.torchrun_launcher")
SELF_TIME_BUDGET_US = 10_000
# timing runs at most; the fastest counts (other work on the machine only ever adds time)
IMPORTTIME_RUNS = 15

APP = textwrap.dedent(
    """
    import sys

    import hydra
    # Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
    VERSION_BASE = {{}} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {{"version_base": "1.3"}}
    from omegaconf import DictConfig


    @hydra.main(**VERSION_BASE, config_path=None, config_name=None)
    def main(cfg: DictConfig) -> None:
        discovered = all(name in sys.modules for name in {discovered!r})
        print(f"REPORT discovered={{discovered}} torch={{'torch' in sys.modules}}")


    if __name__ == "__main__":
        main()
    """
).format(discovered=DISCOVERED)

_REPORT = re.compile(r"^REPORT discovered=(\w+) torch=(\w+)$", re.M)


@pytest.fixture
def app(tmp_path: Path) -> Path:
    path = tmp_path / "plain_app.py"
    path.write_text(APP)
    return path


def _reports(output: str) -> List[Dict[str, bool]]:
    return [
        {"discovered": discovered == "True", "torch": torch == "True"}
        for discovered, torch in _REPORT.findall(output)
    ]


def test_plain_run_never_imports_torch(app: Path, tmp_path: Path) -> None:
    result = run_app(app, ["+x=1"], cwd=tmp_path)
    # the plugin was discovered (so the check means something), and torch never came in
    assert _reports(result.stdout) == [{"discovered": True, "torch": False}], result.stdout


def test_multirun_with_basic_launcher_never_imports_torch(app: Path, tmp_path: Path) -> None:
    result = run_app(app, ["--multirun", "hydra/launcher=basic", "+x=1,2"], cwd=tmp_path)
    assert _reports(result.stdout) == [{"discovered": True, "torch": False}] * 2, result.stdout


def _import_self_times(env: Dict[str, str], cwd: Path) -> Dict[str, int]:
    """`-X importtime` self times (us) of the modules a fresh interpreter imports for the
    discovered plugin modules, with hydra and omegaconf already imported."""
    code = f"import hydra, omegaconf\nimport {DISCOVERED[0]}, {DISCOVERED[1]}\n"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    times = {}
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)$", line)
        if match:
            times[match.group(2)] = int(match.group(1))
    assert DISCOVERED[0] in times and DISCOVERED[1] in times, result.stderr
    return times


def test_discovered_modules_are_cheap_and_torch_free(tmp_path: Path) -> None:
    env = dict(os.environ)
    # measure what users pay with bytecode cached (a compile is not the plugin's cost)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "pycache")
    _import_self_times(env, tmp_path)  # writes the bytecode

    best: Dict[str, int] = {}
    for _ in range(IMPORTTIME_RUNS):
        times = _import_self_times(env, tmp_path)
        heavy = sorted(name for name in times if name.split(".")[0] in ("torch", "numpy"))
        assert not heavy, f"plugin discovery imports {heavy}"
        ours = {name: t for name, t in times.items() if name == PLUGIN or name.startswith(PLUGIN + ".")}
        if not best or sum(ours.values()) < sum(best.values()):
            best = ours
        if sum(best.values()) < SELF_TIME_BUDGET_US:
            break
    total = sum(best.values())
    assert total < SELF_TIME_BUDGET_US, (
        f"the plugin's modules take {total} us of their own to import "
        f"(best of {IMPORTTIME_RUNS} runs): {best}"
    )


def test_composing_a_sweeps_jobs_builds_the_launcher_config_once() -> None:
    """Hydra composes every job of a sweep again (the basic sweeper's validation of each
    batch, then each job) and deep-copies its whole ConfigStore each time: the launcher's
    config is made into a DictConfig once, not once a job, and no job's copy leaks into
    the next."""
    import hydra
    from hydra import compose, initialize
    from hydra.core.config_store import ConfigStore

    version_base = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
    with initialize(**version_base, config_path=None):
        # after initialize: Hydra's plugin scan may import config.py again, storing new entries
        entry = ConfigStore.instance().repo["hydra"]["launcher"]["torchrun.yaml"]
        build, builds = entry._build, []

        def counted_build() -> Dict[str, object]:
            builds.append(1)
            return build()

        entry._build = counted_build
        first = compose(
            overrides=["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=4"], return_hydra_config=True
        )
        again = [compose(overrides=["hydra/launcher=torchrun"], return_hydra_config=True) for _ in range(3)]
    assert len(builds) <= 1, f"the launcher's config was built {len(builds)} times for 4 compositions"
    assert first.hydra.launcher.nproc_per_node == 4
    assert [cfg.hydra.launcher.nproc_per_node for cfg in again] == [1, 1, 1]
    assert again[0].hydra.launcher.max_restarts == 0 and again[0].hydra.launcher.tee == "3"
