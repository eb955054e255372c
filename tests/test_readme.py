"""The README and the docs/ pages, run as a user pastes them.

Every fenced block of README.md and docs/*.md carries a marker, an HTML comment on the line
just before its opening fence (GitHub does not show it), so no recipe can be added without
saying how it is checked:

    <!-- readme-test: file train.py -->   the block is that file: written into the project
    <!-- readme-test: run -->             a bash block: run with `bash -e` in the project, exit 0
    <!-- readme-test: output -->          a console excerpt of a real run: its first line is
                                          `$ <command>`; the command is run in the project and
                                          every other line of the excerpt must be in its output
    <!-- readme-test: skip <why> -->      a recipe this suite cannot run (two nodes, a GPU, a
                                          cluster); the why is the skip reason
    <!-- readme-test: text -->            not a recipe: a diagram, a file layout, part of a file

`run` and `output` take options: `exit=N` (the exit status the recipe ends with, 0 by
default) and `needs=prog,prog` (programs it needs: without one of them the recipe is
skipped, naming it). A comment of its own, `<!-- readme-test: project NAME [from=OTHER] -->`,
starts project NAME, a fresh directory (holding a copy of project OTHER's files), for the
blocks that follow; each page starts in project `main`. A project's blocks run in the
page's order, as a user follows them, in one test per project.

Commands run through `bash` in the project directory, with the environment this suite runs
in (the package installed as the README's set-up installs it; its interpreter's `bin`
first on PATH, as an activated virtual environment has it), without HYDRA_FULL_ERROR.

An `output` excerpt is compared with the run line by line after both are normalised: log
times, sweep dir dates, durations, pids and torch's run ids are placeholders; the project
dir reads `/home/you/project`, the interpreter's `bin` `/home/you/venv/bin`; runs of blanks
are one blank. Each excerpt line must appear in the run's output, in order among the lines of
its own stream (a rank's prefixed lines, or the launcher's and Hydra's), since ranks print
concurrently; a line `...` stands for lines left out.
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from hydra_plugins.hydra_torchrun_launcher._shared.torchrun_cli import torchrun_options

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- readme-test: (?P<kind>\w+)(?P<rest>.*?) -->$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<info>.*)$")
RECIPE_TIMEOUT_S = 240
SHOWN_PROJECT = "/home/you/project"
SHOWN_BIN = "/home/you/venv/bin"


@dataclass
class Block:
    page: str
    line: int  # of the opening fence
    kind: str  # file | run | output | skip | text
    arg: str  # the file's path, the skip's reason
    options: Dict[str, str]
    body: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Project:
    page: str
    name: str
    source: Optional[str]  # the project whose files it starts with
    blocks: List[Block] = field(default_factory=list)


def _options(words: List[str]) -> Tuple[List[str], Dict[str, str]]:
    plain = [w for w in words if "=" not in w]
    return plain, dict(w.split("=", 1) for w in words if "=" in w)


def parse(page: Path) -> List[Project]:
    """The page's projects, each with its marked blocks in order; an unmarked block fails."""
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
    lines = page.read_text().splitlines()
    projects = [Project(name, "main", None)]
    marker: Optional[re.Match] = None
    i = 0
    while i < len(lines):
        line = lines[i]
        found = MARKER.match(line.strip())
        if found and found["kind"] == "project":
            words, options = _options(found["rest"].split())
            assert len(words) == 1, f"{name}:{i + 1}: use <!-- readme-test: project NAME [from=OTHER] -->"
            projects.append(Project(name, words[0], options.get("from")))
            i += 1
            continue
        if found:
            marker = found
            i += 1
            continue
        fence = FENCE.match(line)
        if fence is None:
            if line.strip():
                marker = None  # a marker belongs to the block right after it
            i += 1
            continue
        indent, ticks = fence["indent"], fence["fence"]
        closing = (j for j in range(i + 1, len(lines)) if lines[j].startswith(indent + ticks))
        end = next((j for j in closing if lines[j].strip() == ticks), None)
        assert end is not None, f"{name}:{i + 1}: a fenced block that never closes"
        assert marker is not None, (
            f"{name}:{i + 1}: a fenced block without a marker; put <!-- readme-test: KIND ... --> on the "
            "line before it (file, run, output, skip or text: see tests/test_readme.py)"
        )
        kind, rest = marker["kind"], marker["rest"].strip()
        assert kind in ("file", "run", "output", "skip", "text"), f"{name}:{i + 1}: unknown marker {kind!r}"
        words, options = _options(rest.split()) if kind in ("file", "run", "output") else ([rest], {})
        body = "\n".join(text[len(indent) :] for text in lines[i + 1 : end]) + "\n"
        projects[-1].blocks.append(Block(name, i + 1, kind, " ".join(words), options, body))
        marker = None
        i = end + 1
    return [p for p in projects if p.blocks]


def _all_projects() -> List[Project]:
    return [project for page in PAGES for project in parse(page)]


def _environment() -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"  # a terminal's line buffering: stdout and stderr in order
    return env


_VARIABLE = [
    (re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"), "<time>"),  # log records
    (re.compile(r"\d{4}-\d\d-\d\d[/_]\d\d-\d\d-\d\d"), "<date>/<time>"),  # sweep dirs, reruns
    (re.compile(r"\b\d+\.\d+s\b"), "<seconds>"),  # durations
    (re.compile(r"\bpid \d+"), "pid <pid>"),
    (re.compile(r"\b[0-9a-f]{12}_(\d+)"), r"<id>_\1"),  # rendezvous ids from the sweep dir
    (re.compile(r"torchrun_logs/[^/\s]+/attempt"), "torchrun_logs/<run>/attempt"),
    (re.compile(r"\s+"), " "),  # table columns, tabs
]
# a rank's prefix: its job's number when jobs overlap, its host in a torchrun_ssh job on several
_RANK_PREFIX = re.compile(r"^\[(#\d+ )?([A-Za-z0-9_.-]+ )?[A-Za-z_]+\d+\]:")


def normalised(line: str, project: Path) -> str:
    line = line.replace(str(project), SHOWN_PROJECT).replace(str(Path(sys.executable).parent), SHOWN_BIN)
    for pattern, placeholder in _VARIABLE:
        line = pattern.sub(placeholder, line)
    return line.strip()


def _stream(line: str) -> str:
    prefix = _RANK_PREFIX.match(line)
    return prefix.group(0) if prefix else ""


def _for_this_torchrun(line: str) -> str:
    """An excerpt's dry-run `torchrun:` line as the installed torch prints it: the README's
    comes from the newest torch; an older torchrun's line leaves out the options it lacks (its
    `(it cannot express: ...)` line names those that matter)."""
    flags = torchrun_options()
    if not line.startswith("torchrun: ") or flags is None:
        return line
    return " ".join(t for t in line.split(" ") if not t.startswith("--") or t.split("=")[0] in flags)


# a number with a fraction (a loss, a returned value): its last digits differ between CPUs
# (torch's kernels sum in the order the CPU's vector width gives)
_FRACTION = re.compile(r"(?<![\w.])-?\d+\.\d+(?:[eE][-+]?\d+)?(?![\w.])")


def _same_line(shown: str, want: str) -> bool:
    """`shown` is the excerpt's `want`: the same text, and each number with a fraction the
    same to a relative 1e-4 or to its last printed digit (as the README's run printed it, on
    another CPU)."""
    if shown == want:
        return True
    if _FRACTION.split(shown) != _FRACTION.split(want):
        return False

    def close(a: str, b: str) -> bool:
        last_digit = 10.0 ** -len(b.split(".")[1].split("e")[0].split("E")[0])
        difference = abs(float(a) - float(b))
        return difference <= max(1e-4 * max(abs(float(a)), abs(float(b))), last_digit * 1.01)

    return all(close(a, b) for a, b in zip(_FRACTION.findall(shown), _FRACTION.findall(want)))


def check_excerpt(excerpt: List[str], output: str, project: Path) -> List[str]:
    """The excerpt's lines missing from `output`, each sought in order within its stream."""
    streams: Dict[str, List[str]] = {}
    for line in output.splitlines():
        shown = normalised(line, project)
        streams.setdefault(_stream(shown), []).append(shown)
    position: Dict[str, int] = {}
    missing = []
    for line in excerpt:
        want = _for_this_torchrun(normalised(line, project))
        if want in ("", "..."):
            continue
        stream = _stream(want)
        lines, start = streams.get(stream, []), position.get(stream, 0)
        found = next((k for k in range(start, len(lines)) if _same_line(lines[k], want)), None)
        if found is None:
            missing.append(line)
        else:
            position[stream] = found + 1
    return missing


def _run(block: Block, command: str, project: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", command],
        cwd=project,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=float(block.options.get("timeout", RECIPE_TIMEOUT_S)),
    )


def _missing_programs(block: Block) -> List[str]:
    needs = [p for p in block.options.get("needs", "").split(",") if p]
    return [p for p in needs if shutil.which(p) is None]


def run_block(block: Block, project: Path) -> Optional[str]:
    """Write or run one block in `project`; a reason when it was skipped, else None."""
    if block.kind == "file":
        path = project / block.arg
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.body)
        return None
    if block.kind == "skip":
        return block.arg
    if block.kind == "text":
        return None
    missing = _missing_programs(block)
    if missing:
        return f"needs {', '.join(missing)}, not found on PATH"
    expected_exit = int(block.options.get("exit", "0"))
    if block.kind == "run":
        result = _run(block, block.body, project)
        assert result.returncode == expected_exit, (
            f"{block.where}: exited {result.returncode}, not {expected_exit}:\n{block.body}\n--- output\n"
            f"{result.stdout}"
        )
        return None
    first, *excerpt = block.body.splitlines()
    assert first.startswith("$ "), f"{block.where}: an output block starts with `$ <command>`"
    result = _run(block, first[2:], project)
    assert result.returncode == expected_exit, (
        f"{block.where}: `{first[2:]}` exited {result.returncode}, not {expected_exit}\n--- output\n"
        f"{result.stdout}"
    )
    missing = check_excerpt(excerpt, result.stdout, project)
    assert not missing, (
        f"{block.where}: lines of the excerpt that the run of `{first[2:]}` did not print:\n"
        + "\n".join(missing)
        + f"\n--- the run's output\n{result.stdout}"
    )
    return None


PROJECTS = _all_projects()
# a recipe that needs a program, or that this suite cannot run, is a test of its own: its
# skip (and why) shows in the report instead of vanishing inside its project's test
APART = [(p, b) for p in PROJECTS for b in p.blocks if b.kind == "skip" or "needs" in b.options]


def _start(project: Project, directory: Path) -> None:
    directory.mkdir()
    if project.source is not None:
        source = next(p for p in PROJECTS if p.page == project.page and p.name == project.source)
        for block in source.blocks:
            if block.kind == "file":
                run_block(block, directory)


RUN = [
    p
    for p in PROJECTS
    if any(b.kind in ("run", "output") and all(b is not a for _, a in APART) for b in p.blocks)
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("project", RUN, ids=[f"{p.page}:{p.name}" for p in RUN])
def test_every_recipe_runs_as_pasted(project: Project, tmp_path: Path) -> None:
    """The project's blocks, in the page's order, in a directory of its own."""
    directory = tmp_path / "project"
    _start(project, directory)
    for block in project.blocks:
        if all(block is not apart for _, apart in APART):
            run_block(block, directory)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("project, block", APART, ids=[b.where for _, b in APART])
def test_recipes_that_need_what_this_machine_may_lack(project: Project, block: Block, tmp_path: Path) -> None:
    """A `skip` recipe, or one with `needs=`: run after its project's files, where it can run."""
    directory = tmp_path / "project"
    _start(project, directory)
    for earlier in project.blocks[: project.blocks.index(block)]:
        if earlier.kind == "file":
            run_block(earlier, directory)
    why = run_block(block, directory)
    if why is not None:
        pytest.skip(f"{block.where}: {why}")


def test_a_block_without_a_marker_is_refused(tmp_path: Path) -> None:
    """Every page is parsed when this file is collected; a block added without a marker
    fails there, naming its page and line."""
    page = tmp_path / "page.md"
    page.write_text("<!-- readme-test: run -->\n```bash\ntrue\n```\n\ntext\n\n```bash\nfalse\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:8: a fenced block without a marker"):
        parse(page)
    page.write_text("<!-- readme-test: run -->\n\nA paragraph between.\n\n```bash\ntrue\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:5: a fenced block without a marker"):
        parse(page)


def test_an_excerpt_that_the_run_did_not_print_is_caught(tmp_path: Path) -> None:
    """The comparison can fail: a changed word, a line out of its stream's order."""
    ended = "[2026-01-02 03:04:05,678][HYDRA] job 1 of 1 ended: #0 : COMPLETED in 1.23s"
    run = f"{ended}\n[default0]:a\n[default0]:b"
    good = ["[2026-11-23 10:00:00,000][HYDRA] job 1 of 1 ended: #0 : COMPLETED in 0.50s", "[default0]:a"]
    assert check_excerpt(good, run, tmp_path) == []
    assert check_excerpt(["[default0]:b", "[default0]:a"], run, tmp_path) == ["[default0]:a"]
    assert check_excerpt(["job 1 of 1 ended: #0 : FAILED"], run, tmp_path) != []
