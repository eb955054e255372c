"""The app's script as every rank runs it: what a user's real scripts do, each as under torchrun.

Each case was a report of a user trying the launcher on a script that works under plain
`torchrun`: a resolver registered at import, a `@record`-decorated task reading a module
global, a dataclass returned, an exception class of the script's own, an error in the
script's body, a script without the `__main__` guard.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List

import pytest

pytestmark = pytest.mark.timeout(300)

HEADER = """
import dataclasses
import json
import os

import hydra
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

# Hydra 1.4 warns when version_base is given, Hydra 1.3 when it is not
VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}
"""

APP = (
    HEADER
    + """
RANK_AT_IMPORT = os.environ.get("RANK")
OmegaConf.register_new_resolver("double", lambda x: 2 * int(x))  # at import, as apps do


@dataclasses.dataclass
class Result:
    rank_at_import: str
    value: int


class Diverged(Exception):
    pass


@hydra.main(**VERSION_BASE, config_path=None, config_name=None)
@record
def main(cfg) -> Result:
    if cfg.get("fail") and os.environ["RANK"] == "1":
        raise Diverged("lr too high")
    value = OmegaConf.create({"v": "${double:21}"}).v
    return Result(RANK_AT_IMPORT, value)


if __name__ == "__main__":
    main()
"""
)


def _run(tmp_path: Path, app: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    (tmp_path / "app.py").write_text(textwrap.dedent(app))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
    env.pop("HYDRA_FULL_ERROR", None)
    result = subprocess.run(
        [
            sys.executable,
            "app.py",
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "hydra.sweep.dir=sweep",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    if check:
        assert result.returncode == 0, result.stdout
    # nothing left in TMPDIR, a failed job included (torch's error files of its ranks)
    assert not list(tmp.iterdir()), list(tmp.iterdir())
    return result


def _summary(tmp_path: Path) -> List[dict]:
    return json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())["jobs"]


def test_a_decorated_task_returns_a_class_of_the_script_with_the_ranks_own_globals(tmp_path: Path) -> None:
    """`@hydra.main` over torch's `@record`, a resolver registered at import, a dataclass of
    the script returned: rank 0's value, built in the rank's own module."""
    result = _run(tmp_path, APP, "+x=1")
    assert "returned Result(rank_at_import='0', value=42)" in result.stdout, result.stdout


def test_an_exception_class_of_the_script_keeps_its_name(tmp_path: Path) -> None:
    result = _run(tmp_path, APP, "+x=1", "+fail=true", check=False)
    assert result.returncode == 1, result.stdout
    [job] = _summary(tmp_path)
    assert job["status"] == "FAILED"
    assert "Diverged: lr too high" in job["error"], job
    assert "RuntimeError" not in job["error"], job


def test_an_error_in_the_scripts_body_is_shown_as_python_shows_it(tmp_path: Path) -> None:
    """Under torchrun a rank whose module body raises prints the traceback from the
    script's line; so does a rank here, on the console and in its output file."""
    broken = 'if RANK_AT_IMPORT == "1":\n    raise RuntimeError("body broke on rank 1")'
    app = APP.replace(
        'RANK_AT_IMPORT = os.environ.get("RANK")', f'RANK_AT_IMPORT = os.environ.get("RANK")\n{broken}'
    )
    result = _run(tmp_path, app, "+x=1", check=False)
    assert result.returncode == 1, result.stdout
    lines = result.stdout.splitlines()
    assert "[default1]:RuntimeError: body broke on rank 1" in lines, result.stdout
    assert any(line.startswith('[default1]:  File "') and 'app.py", line' in line for line in lines), (
        result.stdout
    )
    assert not any("runpy" in line or "multiprocessing/spawn" in line for line in lines), result.stdout
    [job] = _summary(tmp_path)
    assert "rank 1" in job["error"] and "RuntimeError: body broke on rank 1" in job["error"], job


def test_a_script_without_the_main_guard_is_told_what_to_do(tmp_path: Path) -> None:
    app = APP.replace('if __name__ == "__main__":\n    main()\n', "main()\n")
    result = _run(tmp_path, app, "+x=1", check=False)
    assert result.returncode == 1, result.stdout
    [job] = _summary(tmp_path)
    assert job["status"] == "FAILED"
    assert "the script's module body started Hydra again in the rank" in job["error"], job
    assert 'call main() under `if __name__ == "__main__":`' in job["error"], job
