"""Run the test suite against other torch releases, each in a virtual environment of its own.

The launcher supports a range of torch releases with one codebase (it reads what the
installed torch has: `LaunchConfig`'s fields, private names guarded in `_shared/private.py`).
A range is only as good as the releases it was run on, and releases before 2.13 exist on
the package index only as CUDA builds (about 3 GB with their `nvidia-*` wheels; they run
on a machine without a GPU). This builds, for every `--torch VERSION`, a venv with that
torch and this project installed editable with its test extras, runs pytest there, and
prints a result line per version:

    torch 2.6.0: 412 passed, 0 failed, 9 skipped in 38.4 min on 2026-11-24 (install 6.1 min, 5.2 GB)

    python compat/run.py --torch 2.6.0 --torch 2.8.0            # the whole suite on each
    python compat/run.py --torch 2.10.0 -- tests/test_launcher.py -k refused
    python compat/run.py --torch 2.6.0 --results compat-results.txt --remove

The venvs live outside the repo (`--venvs`, default `~/.cache/hydra-torchrun-compat`) and are
kept for the next run unless `--remove` is given; pip's cache (`--pip-cache`) is shared by
all of them. A test file that starts the SLURM test cluster must not run beside another
cluster: run those files under the same lock the rest of the suite's runs take.
The table of tested versions is kept in docs/torch-versions.md.
"""

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENVS = Path.home() / ".cache" / "hydra-torchrun-compat"


class Result(NamedTuple):
    torch: str
    passed: int
    failed: int
    skipped: int
    minutes: float
    date: str
    install_minutes: float
    venv_bytes: int
    tests: str

    def line(self) -> str:
        return (
            f"torch {self.torch}: {self.passed} passed, {self.failed} failed, {self.skipped} skipped "
            f"in {self.minutes:.1f} min on {self.date} (install {self.install_minutes:.1f} min, "
            f"{self.venv_bytes / 1e9:.1f} GB) [{self.tests}]"
        )


def _run(command: Sequence[str], env: Dict[str, str], cwd: Path = REPO) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(list(command), cwd=cwd, env=env, check=True)


def _size(path: Path) -> int:
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def build_venv(version: str, venvs: Path, pip_cache: Optional[Path]) -> "tuple[Path, float]":
    """The venv of `version` (made or brought up to date) and the minutes its install took."""
    venv = venvs / f"torch-{version}"
    env = dict(os.environ)
    if pip_cache is not None:
        env["PIP_CACHE_DIR"] = str(pip_cache)
    started = time.monotonic()
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)], env)
    python = str(venv / "bin" / "python")
    # setuptools: tests/test_parity.py builds a package without build isolation, which needs a
    # setuptools that builds wheels itself (torch 2.13 and later pull one in; older ones do not)
    _run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip", "setuptools>=70.1"], env)
    # compat mode: Hydra 1.3 finds the plugin by scanning the hydra_plugins namespace package
    _run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            f"torch=={version}",
            "-e",
            ".[test]",
            "--config-settings",
            "editable_mode=compat",
        ],
        env,
    )
    installed = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if installed.split("+")[0] != version:
        raise SystemExit(f"the venv of torch {version} has torch {installed}")
    return venv, (time.monotonic() - started) / 60


def run_tests(version: str, venv: Path, pytest_args: List[str], install_minutes: float) -> Result:
    """pytest in the venv of `version`; counts come from pytest's own junit report."""
    report = venv / "pytest-report.xml"
    report.unlink(missing_ok=True)
    started = time.monotonic()
    command = [str(venv / "bin" / "python"), "-m", "pytest", f"--junitxml={report}", *pytest_args]
    print("+", " ".join(command), flush=True)
    # as in an activated venv: the README's recipes run `python` and `torchrun` by name
    path = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env = dict(os.environ, VIRTUAL_ENV=str(venv), PATH=path)
    subprocess.run(command, cwd=REPO, env=env, check=False)
    minutes = (time.monotonic() - started) / 60
    passed = failed = skipped = 0
    if report.exists():
        for suite in ElementTree.parse(report).getroot().iter("testsuite"):
            tests, skips = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
            bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            passed += tests - skips - bad
            failed += bad
            skipped += skips
    else:
        failed = 1  # pytest did not get as far as its report: count the run as a failure
    return Result(
        torch=version,
        passed=passed,
        failed=failed,
        skipped=skipped,
        minutes=minutes,
        date=datetime.date.today().isoformat(),
        install_minutes=install_minutes,
        venv_bytes=_size(venv),
        tests=" ".join(pytest_args) or "full suite",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--torch", action="append", required=True, metavar="VERSION", help="repeatable")
    parser.add_argument("--venvs", type=Path, default=DEFAULT_VENVS, help="where the venvs are kept")
    parser.add_argument("--pip-cache", type=Path, default=None, help="pip's cache, shared by every venv")
    parser.add_argument("--results", type=Path, default=None, help="append each result line to this file")
    parser.add_argument("--remove", action="store_true", help="remove each venv once its tests ran")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: the suite)")
    args = parser.parse_args(argv)
    args.venvs.mkdir(parents=True, exist_ok=True)
    results = []
    for version in args.torch:
        venv, install_minutes = build_venv(version, args.venvs, args.pip_cache)
        result = run_tests(version, venv, args.pytest_args, install_minutes)
        results.append(result)
        print(result.line(), flush=True)
        if args.results is not None:
            with args.results.open("a") as out:
                out.write(result.line() + "\n")
        if args.remove:
            shutil.rmtree(venv)
    print("\n".join(r.line() for r in results))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
