"""The package's folders show the process tree a sweep runs as, and its imports keep to it.

    launcher process (_launcher; _submit)  ->  warm server (_server)  ->  job process (_job)  ->  rank (_rank)

plus `_shared`, below them all, and `torchrun-sweep` (_sweep_cli), a process of its own above
the launcher that reads its record. A module imports from its own folder or from a process
below its own, never from one above: what two processes both need belongs lower down. Read
from the code's own imports (those inside functions too), not from a list kept by hand.
"""

import ast
import pkgutil
from pathlib import Path
from typing import Dict, Iterator, List, Set

import hydra_plugins
from hydra_plugins import hydra_torchrun_launcher

PKG = "hydra_plugins.hydra_torchrun_launcher"
ROOT = Path(hydra_torchrun_launcher.__file__).parent

# the modules Hydra and users import by name: they stay at the package root
PUBLIC = {"__init__", "config", "torchrun_launcher", "preemption"}
# how high each part stands in the process tree: a module imports only from its height or below
HEIGHT = {
    # `torchrun-sweep`, a console script: a process of its own, above every launcher, that
    # reads a sweep's record (`_launcher`) and asks SLURM about its jobs (`_submit`)
    "_sweep_cli": 6,
    "torchrun_launcher": 5,  # Hydra's Launcher: starts the launcher process's work
    "_launcher": 4,
    # the launcher process when it submits each job to SLURM (beside `_launcher`, whose
    # composing, checking and record it reuses), and the task each SLURM node runs, which
    # hands over to the job process
    "_submit": 4,
    # the launcher process when it runs each job on hosts over ssh (beside `_launcher`, whose
    # composing, checking and record it reuses), and the agent each host runs for the sweep,
    # which starts that host's warm server
    "_ssh": 4,
    "_server": 3,
    "_job": 2,
    "_rank": 1,
    "preemption": 1,  # the rank-side API
    "_shared": 0,
    "config": 0,
    "__init__": 0,
}
FOLDERS = {name for name in HEIGHT if name.startswith("_") and name != "__init__"}
# what `torchrun-sweep` reads of the launcher: the sweep's record and lock, SLURM's commands and
# the sweep's `.slurm/` files; nothing that composes or runs jobs (it imports no torch)
SWEEP_CLI_READS = {
    "_launcher.report",
    "_launcher.resume",
    "_launcher.lock",
    "_shared.slurm_commands",
    "_submit.files",
}


def _modules() -> Dict[str, Path]:
    """Every module of the package by dotted name below it (`_job.agent`, `config`)."""
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for path in sorted(ROOT.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _imports(name: str, path: Path, modules: Set[str]) -> Set[str]:
    """The package's modules that `name` imports, wherever in it the import stands."""
    package = name.split(".")[:-1]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                stem = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            else:
                stem = node.module or ""
                if stem != PKG and not stem.startswith(PKG + "."):
                    continue
                stem = stem[len(PKG) + 1 :]
            targets = [stem] + [f"{stem}.{alias.name}".strip(".") for alias in node.names]
        else:
            continue
        for target in targets:
            if target.startswith(PKG + "."):
                target = target[len(PKG) + 1 :]
            if target in modules:
                found.add(target)
    return found - {name}


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _part(module: str) -> str:
    return module.split(".")[0]


def test_the_package_root_holds_only_the_public_modules_and_the_folders() -> None:
    entries = {p.name for p in ROOT.iterdir() if p.name != "__pycache__"}
    assert entries == {f"{m}.py" for m in PUBLIC} | FOLDERS | {"py.typed"}
    for folder in FOLDERS:
        assert any((ROOT / folder).glob("*.py")), folder


def test_every_module_stands_in_a_known_part_of_the_tree() -> None:
    assert {_part(m) for m in _modules()} <= set(HEIGHT)


def test_no_module_imports_from_a_process_above_its_own() -> None:
    upward = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if _part(target) != _part(module) and HEIGHT[_part(target)] > HEIGHT[_part(module)]
    ]
    assert not upward, "\n".join(upward)


def test_torchrun_sweep_reads_only_the_record_and_slurms_commands() -> None:
    read = {
        target
        for module, targets in _graph().items()
        if _part(module) == "_sweep_cli"
        for target in targets
        if _part(target) in ("_launcher", "_submit")
    }
    assert read and read <= SWEEP_CLI_READS, sorted(read - SWEEP_CLI_READS)


# the sweep driver's internals: how it composes, holds the sweep dir, resumes and runs jobs
# locally. A runner (SLURM's, ssh's) takes the driver's interface (`_launcher.runner`,
# `_launcher.preempt`'s SweepStopped, the record's types), never these; the public
# Launcher classes alone hand their launch to the driver.
DRIVER_INTERNALS = {
    "_launcher.driver",
    "_launcher.local_runner",
    "_launcher.pool",
    "_launcher.lock",
    "_launcher.shared_dir",
    "_launcher.node_agreement",
}


# the runners beside the local one, each a folder of its own
RUNNER_FOLDERS = {"_submit", "_ssh"}


def test_a_runner_uses_the_drivers_interface_not_its_internals() -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if _part(module) in RUNNER_FOLDERS
        for target in targets & DRIVER_INTERNALS
    )
    assert not wrong, wrong
    # the check sees what it looks for: the launcher's classes do hand over to the driver
    assert "_launcher.driver" in _graph()["torchrun_launcher"]


def _cycles(graph: Dict[str, Set[str]]) -> Iterator[List[str]]:
    """Each import cycle once, found by depth-first search."""
    done: Set[str] = set()

    def visit(module: str, path: List[str]) -> Iterator[List[str]]:
        if module in path:
            yield path[path.index(module) :] + [module]
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            yield from visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        yield from visit(module, [])


def test_no_import_cycle() -> None:
    cycles = [" -> ".join(cycle) for cycle in _cycles(_graph())]
    assert not cycles, "\n".join(cycles)


def test_the_cycle_check_sees_a_cycle() -> None:
    """The checks above mean something: they find what they look for."""
    assert list(_cycles({"a": {"b"}, "b": {"a"}})) == [["a", "b", "a"]]
    graph = _graph()
    assert "_shared.plan" in graph["_job.agent"] and "_rank.worker" in graph["_job.agent"]
    assert "_launcher.driver" in graph["torchrun_launcher"]  # an import inside a function counts


def test_hydras_discovery_walks_only_the_public_modules() -> None:
    """Hydra imports every module `pkgutil.walk_packages` finds under `hydra_plugins` whose own
    name has no leading underscore. The folders have no `__init__.py`, so it never enters
    them: `_job/agent.py` (torch at import) is not `agent` to Hydra."""
    assert not [folder for folder in FOLDERS if (ROOT / folder / "__init__.py").exists()]
    walked = {
        name[len(PKG) + 1 :]
        for _, name, _ in pkgutil.walk_packages(hydra_plugins.__path__, "hydra_plugins.")
        if name.startswith(PKG + ".")
    }
    assert walked == PUBLIC - {"__init__"}
