"""Resuming a sweep from its record: which jobs are done, which continue, which run.

The record is the sweep dir's journal, `sweep_journal.jsonl` (`_launcher.journal`; where an
earlier version left only `sweep_summary.json`, that), plus, for every completed
job, its pickled `JobReturn` in `<job dir>/.hydra/job_return.pkl` (beside Hydra's own
account of the job). A pickle is code: it is loaded only when this user owns it and its
dir and nobody else can write it (it is written 0600 whatever the umask); a group-writable
dir (umask 002) is fine: what another user puts there is theirs, and refused.

`resume: auto` resumes an UNFINISHED sweep: the record is of the same sweep (every job of
this launch recorded with the same overrides and fingerprint) and says that the earlier run
did not reach its end (a job preempted, stopped or never started; the run stopped between
a sweeper's batches), or SLURM restarted the batch job. Then a recorded job is:
- COMPLETED: not run; its JobReturn (return value included) comes from the record;
- stopped before it ended (PREEMPTED by the stop signal; STOPPED by Ctrl-C or SIGTERM;
  RUNNING when the launcher died with it, kill -9 or a node failure): run in its same job
  dir, with `preemption.resumed()` True when its ranks ran there before (the job dir's
  `.hydra/ranks_started` says so: it outlasts a launcher killed with -9);
- FAILED or NOT_STARTED: run, afresh.
A FINISHED record (every job completed or failed) is a new run: every job runs again, with
one line. `true` resumes a record of the same sweep, finished or not (an error if there is
none); `false` runs every job. What cannot be trusted (a record that cannot be read, a
truncated or foreign pickle) runs again, with one line.
"""

import ast
import dis
import hashlib
import inspect
import json
import logging
import os
import pickle
import re
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set

import cloudpickle
from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf

from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path
from .._shared.stop_files import RANKS_STARTED_FILE
from ..config import described
from .durable import replace_whole
from .journal import JOURNAL_FILE, read_journal
from .report import (
    COMPLETED,
    PREEMPTED,
    RUNNING,
    STOPPED,
    SUMMARY_FILE,
    JobOutcome,
    Record,
    job_numbers,
    strict_json,
)

log = logging.getLogger(__name__)

RETURN_FILE = Path(".hydra") / "job_return.pkl"
# jobs stopped before they ended: they continue in their job dir
_CONTINUING = (PREEMPTED, STOPPED, RUNNING)
# launcher keys that say how and where the sweep runs or what it shows, not what a job computes
_NOT_FINGERPRINTED = frozenset(key for key, computes in described("fingerprinted").items() if not computes)
# what a fingerprint is made of, in its order: a record names the parts that changed
_FINGERPRINT_PARTS = (
    "task code",
    "config",
    "launcher settings",
    "env_set",
    "environment variables the config reads",
)
# `${oc.env:NAME}` (and Hydra's older `${env:NAME}`) in a config: the values it reads count
_ENV_READ = re.compile(r"\$\{(?:oc\.env|env):\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class Resumption:
    """What the record says of this launch's jobs."""

    # jobs the record holds with the same overrides, by number
    recorded: Dict[int, JobOutcome] = field(default_factory=dict)
    # completed jobs and their JobReturns, from the record
    completed: Dict[int, JobReturn] = field(default_factory=dict)
    # jobs stopped before they ended (preempted, stopped, running when the launcher died):
    # they continue in their job dir
    preempted: Set[int] = field(default_factory=set)


def read_record(sweep_dir: Path) -> Record:
    """The sweep dir's record: its journal (`_launcher.journal`), or where it has none, the
    `sweep_summary.json` an earlier version of the launcher left; empty when there is
    neither, or (with one line) when it cannot be read: then every job runs."""
    path = sweep_dir / JOURNAL_FILE
    if not path.is_file():
        path = sweep_dir / SUMMARY_FILE
    if not path.is_file():
        return Record()
    try:
        if path.name == JOURNAL_FILE:
            rows, interrupted = read_journal(path)
            return Record({num: JobOutcome(**row) for num, row in rows.items()}, interrupted)
        data = strict_json(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("jobs"), list):
            raise ValueError("not a JSON object with a list of jobs")
        if not all(isinstance(row, dict) for row in data["jobs"]):
            raise ValueError("a job in it is not a JSON object")
        jobs = {int(row["num"]): JobOutcome(**row) for row in data["jobs"]}
        return Record(jobs, bool(data.get("interrupted", False)))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        log.warning(
            f"{shown_path(str(path))} cannot be read as this launcher's record ({type(e).__name__}: {e}): "
            "nothing is resumed from it, every job runs and the record starts afresh"
        )
        return Record()


def same_sweep(jobs: Sequence[Any], record: Record) -> Optional[str]:
    """None when `record` holds every one of `jobs` (plans) with the same overrides and
    fingerprint; else what differs, for the user's line."""
    for job in jobs:
        outcome = record.jobs.get(job.idx)
        if outcome is None:
            return f"it has no job #{job.idx}"
        if list(outcome.overrides) != list(job.overrides):
            return f"its job #{job.idx} had other overrides ({' '.join(outcome.overrides) or 'none'})"
        # no fingerprint: the earlier run ended before it composed the job (it never started)
        if outcome.fingerprint and outcome.fingerprint != job.fingerprint:
            changed = " and ".join(changed_parts(outcome.fingerprint, job.fingerprint))
            return f"job #{job.idx}'s {changed} changed"
    return None


def changed_parts(recorded: str, now: str) -> List[str]:
    """The parts of a job's fingerprint (`_FINGERPRINT_PARTS`) that differ; all of them for a
    record whose fingerprint has no parts to compare."""
    old, new = recorded.split("-"), now.split("-")
    if len(old) != len(new) or len(new) != len(_FINGERPRINT_PARTS):
        return [", ".join(_FINGERPRINT_PARTS[:-1]) + " or " + _FINGERPRINT_PARTS[-1]]
    return [part for part, a, b in zip(_FINGERPRINT_PARTS, old, new) if a != b]


def resumption(mode: Any, sweep_dir: Path, jobs: Sequence[Any], record: Record, first: bool) -> Resumption:
    """What of `jobs` (plans with `.idx`, `.overrides`, `.fingerprint`) the record has done
    or stopped, for `mode` (`hydra.launcher.resume`). `first`: the run's first launch, which
    decides whether the record is resumed at all; a later batch of a sweeper takes what
    the record holds of its jobs."""
    found = Resumption()
    if mode is False or not record.jobs:
        if mode is True and first:
            raise LauncherConfigError(
                f"hydra.launcher.resume=true: {shown_path(str(sweep_dir))} holds no record of this sweep "
                f"(no readable {SUMMARY_FILE}); set hydra.launcher.resume=auto to run it afresh"
            )
        return found
    path = shown_path(str(sweep_dir / SUMMARY_FILE))
    differs = same_sweep(jobs, record)
    if first:
        if differs is not None:
            if mode is True:
                raise LauncherConfigError(
                    f"hydra.launcher.resume=true: {path} records another sweep ({differs}); "
                    "set hydra.launcher.resume=auto to run every job afresh, or use another hydra.sweep.dir"
                )
            log.info(f"{path} records another sweep ({differs}): every job runs, the record starts afresh")
            record.jobs.clear()
            return found
        if mode == "auto" and record.finished() and not _slurm_restarted(os.environ):
            log.info(
                f"{path} records a finished sweep (every job completed or failed): this is a new run, "
                "every job runs again (hydra.launcher.resume=true resumes it instead)"
            )
            record.jobs.clear()
            return found
    for job in jobs:
        outcome = record.jobs.get(job.idx)
        if (
            outcome is not None
            and list(outcome.overrides) == list(job.overrides)
            and outcome.fingerprint == job.fingerprint
        ):
            found.recorded[job.idx] = outcome
    for num, outcome in found.recorded.items():
        if outcome.status == COMPLETED:
            returned = load_return(job_dir_of(sweep_dir, outcome), num)
            if returned is not None:
                found.completed[num] = returned
        elif outcome.status in _CONTINUING:
            found.preempted.add(num)
    return found


def job_dir_of(sweep_dir: Path, outcome: JobOutcome) -> Path:
    """Where a recorded job's dir is now: below the sweep dir, wherever that was moved."""
    return sweep_dir / outcome.subdir if outcome.subdir else Path(outcome.job_dir)


def continues_in_place(sweep_dir: Path, outcome: JobOutcome, output_dir: Path) -> bool:
    """Whether a stopped job resumes: its ranks ran before, in the dir it runs in now (the
    record says so, or, for a job whose launcher died with it, the mark its ranks left)."""
    if os.path.relpath(output_dir, sweep_dir) != outcome.subdir:
        return False
    return outcome.ranks_ran or (output_dir / RANKS_STARTED_FILE).is_file()


def continuing_in_place(sweep_dir: Path, jobs: Sequence[Any], found: Resumption) -> Set[int]:
    """The unfinished jobs of `jobs` (plans) that continue where their ranks ran before."""
    return {
        job.idx
        for job in jobs
        if job.idx in found.preempted
        and continues_in_place(sweep_dir, found.recorded[job.idx], job.output_dir)
    }


@dataclass
class PlannedResumption:
    """For the dry run: what a run would do with the jobs the sweep dir's record holds."""

    # by job number, in words
    said: Dict[int, str] = field(default_factory=dict)
    # the completed jobs a run would take from the record, not run
    completed: Set[int] = field(default_factory=set)

    def in_header(self, instead: str) -> str:
        """The dry run's first line's word on the record ("" when it gives no job)."""
        if not self.completed:
            return ""
        return f" ({len(self.completed)} of them from the sweep dir's record, {instead})"


def planned_resumption(mode: Any, sweep_dir: Path, jobs: Sequence[Any]) -> PlannedResumption:
    """What a run would do with each of `jobs` (plans) that the sweep dir's record holds (a
    job it does not hold runs, as every job of a new sweep). Reads the record and takes
    nothing: a real run decides the same way (`resumption`)."""
    record = read_record(sweep_dir) if mode is not False else Record()
    found = resumption(mode, sweep_dir, jobs, record, first=True)
    in_place = continuing_in_place(sweep_dir, jobs, found)
    planned = PlannedResumption(completed=set(found.completed))
    for num, outcome in found.recorded.items():
        if num in found.completed:
            planned.said[num] = f"{outcome.status} in the record: not run, its result comes from the record"
        elif num in in_place:
            planned.said[num] = (
                f"{outcome.status} in the record: runs on in its job dir (preemption.resumed() True)"
            )
        else:
            planned.said[num] = f"{outcome.status} in the record: runs afresh"
    return planned


def _slurm_restarted(environ: Mapping[str, str]) -> bool:
    """SLURM runs this batch job again (a requeue): what it had done is kept, finished or not."""
    return int(environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0


def log_resumption(sweep_dir: Path, found: Resumption, in_place: Set[int], held_over: Set[int]) -> None:
    """One line when the launch resumes a recorded sweep: what comes from the record, the jobs
    an earlier command submitted that are waited for (`held_over`: SLURM still has them), which
    unfinished jobs continue in their job dir (`in_place`: their ranks ran there), and which
    run afresh (their ranks never ran, or their job dir is another now)."""
    if not found.recorded:
        return
    done = sorted(found.completed)
    waited = sorted(held_over - set(found.completed))
    continuing = sorted(in_place - held_over)
    afresh = sorted(found.preempted - in_place - held_over)
    said = f", {len(waited)} submitted earlier are waited for{_listed(waited)}" if waited else ""
    if continuing or not waited:
        said += f", {len(continuing)} unfinished job(s) continue{_listed(continuing)}"
    if afresh:
        said += f", {len(afresh)} run afresh{_listed(afresh)}"
    # failed, never started, or completed with a return that cannot be trusted
    others = sorted(set(found.recorded) - set(found.completed) - found.preempted - held_over)
    if others:
        said += f", {len(others)} failed or not started run again{_listed(others)}"
    log.info(
        f"Resuming the sweep in {shown_path(str(sweep_dir))}: "
        f"{len(done)} completed job(s) come from its record{_listed(done)}{said} "
        "(hydra.launcher.resume=false runs every job again)"
    )


def task_digest(task_function: Any) -> str:
    """What the task computes, digested: the function itself (its code, what it closes over,
    its defaults; a `functools.partial`'s arguments), the source file that defines it (its
    module body runs in every rank) and the project's own modules it has imported (those
    below the task's directory, not installed packages). Another function of the same file,
    an edited helper module, another closed-over value: another task."""
    digest = hashlib.sha1()
    target = task_function
    while hasattr(target, "func") and hasattr(target, "args"):  # functools.partial
        _digest_value(digest, (target.args, sorted((target.keywords or {}).items())))
        target = target.func
    target = inspect.unwrap(target)
    digest.update(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}".encode())
    code = getattr(target, "__code__", None)
    if code is not None:
        _digest_code(digest, code)
    for cell in getattr(target, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell: nothing it closes over yet
            continue
        _digest_value(digest, value)
    _digest_value(digest, (getattr(target, "__defaults__", None), getattr(target, "__kwdefaults__", None)))
    task_file = _source_file(target)
    for name, path in _project_modules(task_file, _imported_by(code) if code is not None else set()):
        digest.update(f"\n{name}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _source_file(target: Any) -> Optional[str]:
    try:
        source = inspect.getsourcefile(target)
    except TypeError:  # a builtin or a callable object without a source file
        return None
    return os.path.abspath(source) if source and os.path.isfile(source) else None


def _digest_code(digest: Any, code: Any) -> None:
    """A code object's bytecode, names and constants, nested functions' code included."""
    digest.update(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        if inspect.iscode(const):
            _digest_code(digest, const)
        else:
            digest.update(repr(const).encode())


def _digest_value(digest: Any, value: Any) -> None:
    """A value the task closes over: its pickle (its repr when it cannot be pickled)."""
    try:
        data = cloudpickle.dumps(value)
    except Exception as e:  # a lock, a socket: what it shows of itself is what can count
        data = f"{type(e).__name__}: {value!r}".encode()
    digest.update(data)


def _imported_by(code: Any) -> Set[str]:
    """The modules the task's own code imports as it runs (`import x.y`, `from x import y`:
    `x`, `x.y`), its nested functions' included; read from the bytecode, nothing imported.
    Relative imports are left out: a script's task has no package to be relative to."""
    names: Set[str] = set()
    module = None
    for instruction in dis.get_instructions(code):
        if instruction.opname == "IMPORT_NAME":
            module = str(instruction.argval)
            names.add(module)
        elif instruction.opname == "IMPORT_FROM" and module:
            names.add(f"{module}.{instruction.argval}")
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _imported_by(const)
    return names


def _imports_in_file(path: str) -> Set[str]:
    """The modules a source file imports (absolute imports: `x`, `x.y`), read, not run."""
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=path)
    except (SyntaxError, ValueError):  # not Python that parses here: its bytes count all the same
        return set()
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def task_container(config: DictConfig) -> Dict[str, Any]:
    """The task's config (the job's without `hydra`), unresolved, as plain containers: what
    the job's fingerprint and `_target_`s are read from, without the copy of the whole
    config that run_job makes (the job's process makes it)."""
    container = OmegaConf.to_container(config, resolve=False, enum_to_str=True)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    return container  # type: ignore[return-value]


def config_targets(task: Dict[str, Any]) -> FrozenSet[str]:
    """The modules that the config's `_target_`s name (`models.Net` -> `models`,
    `models.Net`): what Hydra's `instantiate` imports when the task runs."""
    names: Set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            target = node.get("_target_")
            if isinstance(target, str):
                parts = target.split(".")
                names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(task)
    return frozenset(names)


def targets_digest(task_function: Any, targets: FrozenSet[str]) -> str:
    """The project's modules (below the task's dir) that `targets` (`config_targets`) name
    and the task has not imported yet, digested; "" when there are none."""
    target = task_function
    while hasattr(target, "func") and hasattr(target, "args"):  # functools.partial
        target = target.func
    task_file = _source_file(inspect.unwrap(target))
    modules = [m for m in _project_modules(task_file, targets) if m[0] not in sys.modules]
    if not modules:
        return ""
    digest = hashlib.sha1()
    for name, path in modules:
        digest.update(f"\n{name}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _module_file(name: str, roots: Sequence[str]) -> Optional[str]:
    """Where module `name` would be found below one of `roots` (the import path's entries
    below the task's directory), without importing it; None when it is not there."""
    relative = os.path.join(*name.split("."))
    for root in roots:
        for candidate in (relative + ".py", os.path.join(relative, "__init__.py")):
            path = os.path.join(root, candidate)
            if os.path.isfile(path):
                return path
    return None


def _project_modules(
    task_file: Optional[str], imported_later: Iterable[str] = ()
) -> List["tuple[str, Path]"]:
    """The modules whose source lies below the task's directory (the app and the project's
    own modules), not those of installed packages or of Python itself: those imported now,
    and those of `imported_later` (imported by the task's body as it runs) found there."""
    if task_file is None:
        return []
    root = os.path.dirname(task_file) + os.sep
    installed = tuple({os.path.join(p, "") for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    found = []
    roots = [
        entry
        for entry in (os.path.abspath(e or os.curdir) for e in sys.path)
        if os.path.join(entry, "").startswith(root) and not os.path.join(entry, "").startswith(installed)
    ]
    # not imported yet: found below the task's dir, with what they import in turn
    todo, seen = sorted(set(imported_later) - set(sys.modules)), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name, roots)
        if path is None or "site-packages" in path.split(os.sep):
            continue
        found.append((name, Path(path)))
        todo.extend(sorted(_imports_in_file(path) - set(sys.modules) - seen))
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py"):
            continue
        path = os.path.abspath(path)
        parts = path.split(os.sep)
        if not path.startswith(root) or path.startswith(installed) or "site-packages" in parts:
            continue
        if name.startswith("hydra_plugins.hydra_torchrun_launcher") or not os.path.isfile(path):
            continue
        found.append((name, Path(path)))
    return sorted(found)


def fingerprint(task: str, task_cfg: Any, settings: Any, env_set: Mapping[str, str]) -> str:
    """What a job computes, a short digest per part (`_FINGERPRINT_PARTS`, joined by `-`, so
    that a record can say which part changed): the task's digest (`task_digest`), its config
    as composed, unresolved (so that `${now:}` and the like do not make a requeued run another
    job), the launcher's settings (`settings`: the job's TorchrunLauncherConf, but for how and
    where the sweep runs and what it shows), env_set (resolved), and the values of the
    environment variables that config reads (`oc.env`). `task_cfg`: the task's config, or
    its `task_container`."""
    text = OmegaConf.to_yaml(task_cfg, resolve=False)
    read = {name: os.environ.get(name) for name in sorted(set(_ENV_READ.findall(text)))}
    launcher = {k: v for k, v in asdict(settings).items() if k not in _NOT_FINGERPRINTED}
    parts = [
        task,
        text,
        json.dumps(launcher, sort_keys=True, default=repr),
        json.dumps(dict(sorted(env_set.items())), sort_keys=True),
        json.dumps(read, sort_keys=True),
    ]
    return "-".join(hashlib.sha1(part.encode()).hexdigest()[:8] for part in parts)


def _listed(nums: Iterable[int]) -> str:
    nums = list(nums)
    return f" ({job_numbers(nums)})" if nums else ""


def save_return(job_dir: Path, job_return: JobReturn) -> None:
    """Keep a completed job's JobReturn for a later resume: owner-only whatever the umask,
    replaced whole, on disk before the launcher goes on."""
    path = job_dir / RETURN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_whole(path, cloudpickle.dumps(job_return), mode=0o600)


def load_return(job_dir: Path, num: int) -> "JobReturn | None":
    """A completed job's JobReturn from the record; None, with one line (the job runs
    again), when it is missing, cannot be trusted or cannot be read.

    Trusted: the file and its dir are this user's, and nobody else can write the file. A
    dir others may write (umask 002) lets them replace the file only with one of their
    own, which is refused here."""
    path = job_dir / RETURN_FILE
    shown = shown_path(str(path))
    if not path.is_file():
        log.warning(f"job #{num} is completed in the record but {shown} is missing: it runs again")
        return None
    for checked, others_may_write in ((path.parent, True), (path, False)):
        info = checked.stat()
        foreign = info.st_uid != os.geteuid()
        if foreign or (not others_may_write and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            log.warning(
                f"job #{num} is completed in the record but {shown_path(str(checked))} is not this user's "
                f"alone (owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): its result is not "
                "trusted, the job runs again"
            )
            return None
    try:
        with open(path, "rb") as f:
            returned = pickle.load(f)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, ValueError) as e:
        log.warning(
            f"job #{num} is completed in the record but {shown} cannot be read ({type(e).__name__}: {e}): "
            "it runs again"
        )
        return None
    if not isinstance(returned, JobReturn):
        log.warning(f"job #{num} is completed in the record but {shown} holds no JobReturn: it runs again")
        return None
    return returned
