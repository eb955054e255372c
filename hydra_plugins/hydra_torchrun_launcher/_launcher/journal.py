"""The sweep's journal: one line per job event, appended and on disk as it happens.

`<sweep dir>/sweep_journal.jsonl` is what a resumed run reads (`_launcher.resume.read_record`);
`sweep_summary.json` is a view of it for scripts, rewritten every few seconds
(`_launcher.report`). Each line is a JSON object: the first says the journal's format
(`{"journal": 1}`); then `{"job": {...}}` holds a job's row as it is now (the summary's row, as
the job is launched, starts and ends: the last one of a job number counts) and
`{"interrupted": true}` says that the run did not reach its end. A line costs one `write` and
one `fsync` of the file, whatever the number of jobs.

A run's first event starts a fresh journal, written whole beside it and renamed over the
earlier run's (a reader sees one or the other); later events, a sweeper's later batches
included, are appended to it. A launcher killed with -9 (or a node that loses power) may
leave its last line cut short: it is ignored when the journal is read. Any other line that
is not JSON makes the journal unreadable.
"""

import itertools
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Tuple

from .durable import sync_dir

JOURNAL_FILE = "sweep_journal.jsonl"
FORMAT = 1
_PARTIALS = itertools.count()


def _encoded(lines: Iterable[Dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line, default=repr, allow_nan=False) + "\n" for line in lines).encode()


class Journal:
    """The journal of one run, open for appending."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def fresh(cls, path: Path, lines: Iterable[Dict[str, Any]]) -> "Journal":
        """A new journal holding `lines` replaces the one at `path`, whole, on disk."""
        partial = path.with_name(f".{path.name}.{os.getpid()}.{next(_PARTIALS)}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
        try:
            _write_all(fd, _encoded([{"journal": FORMAT}, *lines]))
            os.fsync(fd)
            os.replace(partial, path)
        except BaseException:
            os.close(fd)
            raise
        sync_dir(path.parent)
        return cls(path, fd)

    def append(self, lines: Iterable[Dict[str, Any]]) -> None:
        """`lines` at the journal's end, on disk before this returns."""
        data = _encoded(lines)
        if data:
            _write_all(self._fd, data)
            os.fsync(self._fd)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_journal(path: Path) -> Tuple[Dict[int, Dict[str, Any]], bool]:
    """The journal's jobs (each one's last row, by number) and whether the run was
    interrupted. A last line cut short is left out; `ValueError` for anything else that is
    not a journal's."""
    data = path.read_bytes()
    *lines, last = data.split(b"\n")
    parsed: List[Any] = []
    for number, line in enumerate(lines, 1):
        try:
            parsed.append(_strict(line))
        except ValueError as e:
            raise ValueError(f"line {number}: {e}") from None
    if last.strip(b"\0 \t\r"):
        # written in one `write` with its newline: a complete object without the newline is
        # whole (no proper prefix of an object is JSON), anything else is a cut line
        try:
            parsed.append(_strict(last))
        except ValueError:
            pass
    if not parsed or not isinstance(parsed[0], dict) or parsed[0].get("journal") != FORMAT:
        raise ValueError(f"its first line is not a journal's of format {FORMAT}")
    jobs: Dict[int, Dict[str, Any]] = {}
    interrupted = False
    for number, entry in enumerate(parsed[1:], 2):
        if not isinstance(entry, dict):
            raise ValueError(f"line {number}: not an object")
        if "job" in entry:
            row = entry["job"]
            if not isinstance(row, dict):
                raise ValueError(f"line {number}: the job is not an object")
            jobs[int(row["num"])] = row
        if "interrupted" in entry:
            interrupted = bool(entry["interrupted"])
    return jobs, interrupted


def _strict(line: bytes) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line.decode(), parse_constant=refuse)
