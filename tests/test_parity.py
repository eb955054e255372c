"""A rank under the launcher sees what a rank under plain `torchrun` sees, field by field.

The same app (`tests/parity_app/`) runs under `torchrun --standalone` in Hydra's run mode
(the reference) and under the launcher in each start method and with jobs running at
once. Every rank writes what it observes; a difference is a failure that names the field.
Where the launcher goes beyond torchrun on purpose, `DELIBERATE` says so, and the test
checks the launcher's own behaviour there. The next "torchrun does X" report becomes a
field of the app and a line here.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from tests.conftest import as_from_a_terminal

APP_DIR = Path(__file__).parent / "parity_app"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# variables that name one run, not what a rank sees: its port, its run id, its error file
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
# the launcher's own variables (a rank's channel to its job's process)
LAUNCHERS_OWN_PREFIX = "HYDRA_TORCHRUN_"

# where the launcher differs from plain torchrun on purpose (field: why)
DELIBERATE = {
    "main.name": "the script's body runs as __mp_main__ (as multiprocessing's spawn runs it), so its "
    "`if __name__ == '__main__':` block does not start Hydra again",
    "task_globals": "the same: the task runs in the module __mp_main__",
    "installed_package.job_var": "the job's env_set is in place from the rank's first line; under torchrun "
    "Hydra applies it only after the script's imports",
    "logging.handlers": "rank N logs to <job>_rank<N>.log, not all ranks to one file",
    "hydra.output_dir": "a sweep job's dir, not the run dir",
}


@pytest.fixture(scope="module")
def installed_probe() -> Iterator[None]:
    """`parity_probe`, installed in this environment as a user's package would be."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    source = APP_DIR / "parity_pkg"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-build-isolation", str(source)], check=True, timeout=300
    )
    try:
        yield
    finally:
        subprocess.run([*pip, "uninstall", "-y", "parity-probe"], check=True, timeout=300)
        for leftover in ("build", "parity_probe.egg-info"):
            shutil.rmtree(source / leftover, ignore_errors=True)


@pytest.fixture
def temp_dir() -> Iterator[Path]:
    """The TMPDIR of both runs: a short path, as a user's is. multiprocessing puts its
    sockets there (a spawn DataLoader's workers, in `pymp-*/listener-*`), and a socket path
    of more than 107 bytes cannot be bound, under torchrun as under the launcher."""
    path = Path(tempfile.mkdtemp(prefix="parity-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _install_app(tmp_path: Path) -> Path:
    app_dir = tmp_path / "app"
    shutil.copytree(APP_DIR, app_dir, ignore=shutil.ignore_patterns("__pycache__", "parity_pkg"))
    return app_dir


def _records(out: Path) -> Dict[Tuple[int, int], Dict[str, Any]]:
    records = {}
    for path in sorted(out.glob("rank*_x*.json")):
        rank, x = path.stem[len("rank") :].split("_x")
        records[(int(rank), int(x))] = json.loads(path.read_text())
    return records


def _under_torchrun(app_dir: Path, out: Path, tmp: Path) -> Dict[Tuple[int, int], Dict[str, Any]]:
    """torchrun in the launcher's TMPDIR (`_under_the_launcher`, run first: torchrun leaves
    its own log dirs there)."""
    result = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node=2", "app.py", f"out={out}", "x=1", "hydra.run.dir=run"],
        cwd=app_dir,
        env=dict(_env(), TMPDIR=str(tmp)),
        preexec_fn=as_from_a_terminal,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return _records(out)


def _under_the_launcher(
    app_dir: Path, out: Path, tmp: Path, *args: str
) -> Dict[Tuple[int, int], Dict[str, Any]]:
    launch = ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "hydra.sweep.dir=sweep"]
    assert not list(tmp.iterdir())
    result = subprocess.run(
        [sys.executable, "app.py", *launch, f"out={out}", "x=1,2", *args],
        cwd=app_dir,
        env=dict(_env(), TMPDIR=str(tmp)),
        preexec_fn=as_from_a_terminal,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # no temp dir or file is left per job (multiprocessing's pymp-* dirs, sockets, payloads)
    assert not list(tmp.iterdir()), list(tmp.iterdir())
    return _records(out)


def _env() -> Dict[str, str]:
    """The same environment for torchrun and the launcher, as a user's shell has it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    for key in [k for k in env if k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", LAUNCHERS_OWN_PREFIX))]:
        del env[key]
    return env


def _flat(record: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested fields as `a.b` names; the environment is compared key by key."""
    flat: Dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "env_set":
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _comparable(record: Dict[str, Any]) -> Dict[str, Any]:
    flat = _flat(record)
    for name in list(flat):
        field = name[len("env.") :] if name.startswith("env.") else None
        if field is not None and (field in PER_RUN or field.startswith(LAUNCHERS_OWN_PREFIX)):
            del flat[name]
        elif (
            name.startswith(("unseeded_at_import.", "unseeded_in_task."))
            or name in DELIBERATE
            or name == "argv"
        ):
            del flat[name]  # checked on their own below
    return flat


def _differences(theirs: Dict[str, Any], ours: Dict[str, Any]) -> List[str]:
    a, b = _comparable(theirs), _comparable(ours)
    return [
        f"{name}: torchrun {a.get(name)!r}, launcher {b.get(name)!r}"
        for name in sorted(set(a) | set(b))
        if a.get(name) != b.get(name)
    ]


def _repeated_draws(records: Dict[Tuple[int, int], Dict[str, Any]]) -> List[str]:
    """Each generator's unseeded draws that two ranks (of one job or two) share."""
    repeated = []
    for phase in ("unseeded_at_import", "unseeded_in_task"):
        for generator in next(iter(records.values()))[phase]:
            draws = [r[phase][generator] for r in records.values()]
            if len(set(draws)) < len(draws):
                repeated.append(f"{phase}.{generator}: {draws}")
    return repeated


@pytest.mark.parametrize(
    "how",
    [
        ["hydra.launcher.start_method=forkserver"],
        ["hydra.launcher.start_method=spawn"],
        ["hydra.launcher.start_method=fork"],
        ["hydra.launcher.parallel_jobs=2"],
        # every rank a real process under a wrapper, as numactl or nsys would run it
        ["hydra.launcher.launch_prefix=[env,'PARITY_WRAPPED=1']"],
    ],
    ids=["forkserver", "spawn", "fork", "parallel_jobs", "launch_prefix"],
)
def test_a_rank_sees_what_a_torchrun_rank_sees(
    tmp_path: Path, temp_dir: Path, installed_probe: None, how: List[str]
) -> None:
    app_dir = _install_app(tmp_path)
    ours = _under_the_launcher(app_dir, tmp_path / "launcher", temp_dir, *how)
    theirs = _under_torchrun(app_dir, tmp_path / "torchrun", temp_dir)
    assert sorted(theirs) == [(0, 1), (1, 1)], theirs.keys()
    assert sorted(ours) == [(0, 1), (0, 2), (1, 1), (1, 2)], ours.keys()

    wrapped = {"env.PARITY_WRAPPED": "1"} if any("launch_prefix" in a for a in how) else {}
    for rank in (0, 1):
        found = [
            d for d in _differences(theirs[(rank, 1)], ours[(rank, 1)]) if d.split(":")[0] not in wrapped
        ]
        assert not found, f"rank {rank}:\n" + "\n".join(found)

    # the fields where the launcher goes beyond torchrun on purpose, as it means to
    for (rank, x), record in ours.items():
        assert record["main"]["name"] == record["task_globals"] == "__mp_main__"
        assert theirs[(rank, 1)]["main"]["name"] == theirs[(rank, 1)]["task_globals"] == "__main__"
        # as torchrun gives it: the script as typed, the job's overrides (torchrun's line adds the run dir)
        assert record["argv"] == ["app.py", f"out={tmp_path / 'launcher'}", f"x={x}"]
        assert record["installed_package"]["job_var"] == "job_app"
        assert record["hydra"]["output_dir"] == str(app_dir / "sweep" / str(x - 1))
        log_file = f"app_rank{rank}.log" if rank else "app.log"
        assert [h[2] for h in record["logging"]["handlers"]] == [log_file, ""]  # file, console
    for rank in (0, 1):
        assert theirs[(rank, 1)]["argv"] == [
            "app.py",
            f"out={tmp_path / 'torchrun'}",
            "x=1",
            "hydra.run.dir=run",
        ]
        assert theirs[(rank, 1)]["installed_package"]["job_var"] is None
        assert [h[2] for h in theirs[(rank, 1)]["logging"]["handlers"]] == ["app.log", ""]

    # a fresh interpreter's random state in every rank of every job, as torchrun's ranks have
    for records in (theirs, ours):
        assert not _repeated_draws(records), _repeated_draws(records)


# in script mode a rank is `python script.py args` run in its job dir, by the launcher's rule
# that a script runs in its job dir: the fields that follow from that
SCRIPT_MODE_DELIBERATE = {"cwd", "hydra.output_dir", "hydra.cwd_is_output_dir"}


def test_a_script_mode_rank_sees_what_a_torchrun_rank_sees(
    tmp_path: Path, temp_dir: Path, installed_probe: None
) -> None:
    """`training_script`: every rank runs the script itself, as a process of its own."""
    app_dir = _install_app(tmp_path)
    out = tmp_path / "script"
    ours = _under_the_launcher(
        app_dir,
        tmp_path / "launcher",
        temp_dir,
        "hydra.launcher.training_script=app.py",
        f"hydra.launcher.training_script_args=['out={out}','x=${{x}}','hydra.run.dir=.']",
    )
    assert ours == {}  # the launching app's task runs in no rank: the script does
    ours = _records(out)
    theirs = _under_torchrun(app_dir, tmp_path / "torchrun", temp_dir)
    assert sorted(ours) == [(0, 1), (0, 2), (1, 1), (1, 2)], ours.keys()
    for rank in (0, 1):
        found = [
            d
            for d in _differences(theirs[(rank, 1)], ours[(rank, 1)])
            if d.split(":")[0] not in SCRIPT_MODE_DELIBERATE
        ]
        assert not found, f"rank {rank}:\n" + "\n".join(found)
    for (_, x), record in ours.items():
        # a script of its own: __main__, all ranks logging into one file, as under torchrun
        assert record["main"]["name"] == record["task_globals"] == "__main__"
        assert [h[2] for h in record["logging"]["handlers"]] == ["app.log", ""]
        assert record["argv"] == [str(app_dir / "app.py"), f"out={out}", f"x={x}", "hydra.run.dir=."]
        assert record["cwd"] == record["hydra"]["output_dir"] == str(app_dir / "sweep" / str(x - 1))
        assert record["installed_package"]["job_var"] == "job_app"
    assert not _repeated_draws(ours), _repeated_draws(ours)


def test_every_deliberate_difference_is_a_field_the_app_records(
    tmp_path: Path, temp_dir: Path, installed_probe: None
) -> None:
    """The list of deliberate differences names real fields (a renamed field would hide one)."""
    app_dir = _install_app(tmp_path)
    ours = _under_the_launcher(app_dir, tmp_path / "launcher", temp_dir, "x=1")
    fields = set(_flat(next(iter(ours.values()))))
    assert set(DELIBERATE) <= fields, set(DELIBERATE) - fields
