"""The ranks' output on the launcher's console: whole lines, each with its rank's prefix.

torch's own tee prints whatever part of a line a rank has written so far, so a progress
bar (`\\r` updates) or any write without a newline comes out cut in pieces, interleaved with
other ranks' pieces. Here each rank's files are followed as bytes and only complete lines
(ended by `\\n` or `\\r`) are printed; a `\\r` update becomes a line of its own. The files
themselves, written by the ranks, keep everything as it was written.

On a terminal, each line ends by erasing the rest of the screen's line: the launcher's
progress line waits there with the cursor at its start, and a rank's line shorter than it
would leave its end showing.
"""

import dataclasses
import os
import re
import sys
import threading
from string import Template
from typing import Dict, List, Optional, TextIO

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest

POLL_INTERVAL_S = 0.05
_LINE_END = re.compile(rb"\r\n|\r|\n")
# erase from the cursor to the end of the screen's line
_ERASE_TO_END = "\x1b[K"


def _line_end(stream: TextIO) -> str:
    """How a line ends on `stream`: erasing what a progress line left, on a terminal."""
    try:
        terminal = stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError, OSError):
        terminal = False
    return _ERASE_TO_END + "\n" if terminal else "\n"


class _Follower:
    """One rank's file: the bytes read so far that do not end a line yet."""

    def __init__(self, path: str, prefix: str, stream: TextIO) -> None:
        self.path = path
        self.prefix = prefix
        self.stream = stream
        self.offset = 0
        self.pending = b""
        self.line_end = _line_end(stream)

    def pump(self, final: bool) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        buffer = self.pending + data
        held = b""
        if buffer.endswith(b"\r") and not final:
            # maybe the first half of \r\n: decide when the next byte is there
            buffer, held = buffer[:-1], b"\r"
        *lines, rest = _LINE_END.split(buffer)
        self.pending = rest + held
        if final and rest:
            lines.append(rest)
            self.pending = b""
        if lines:
            text = "".join(f"{self.prefix}{line.decode(errors='replace')}{self.line_end}" for line in lines)
            self.stream.write(text)
            self.stream.flush()


class RankConsole:
    """Follows the files of one job's ranks until `close`, which prints what is left."""

    def __init__(self) -> None:
        self._followers: List[_Follower] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchrun-console", daemon=True)
        self._thread.start()

    def follow(self, files: Dict[int, str], prefixes: Dict[int, str], stream: TextIO) -> None:
        with self._lock:
            for local_rank, path in sorted(files.items()):
                self._followers.append(_Follower(path, prefixes[local_rank], stream))

    def _run(self) -> None:
        while not self._closed.wait(POLL_INTERVAL_S):
            with self._lock:
                for follower in self._followers:
                    follower.pump(final=False)

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        with self._lock:
            for follower in self._followers:
                follower.pump(final=True)


class ConsoleLogsSpecs(DefaultLogsSpecs):
    """torch's default log layout, with the console side done by a `RankConsole`.

    The streams torch would tee are still written to files; instead of torch's line
    tailer, the job's console follows those files.
    """

    def __init__(
        self,
        *args: object,
        console: RankConsole,
        prefix_template: Optional[str],
        label: str,
        **kwargs: object,
    ):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._console = console
        self._prefix_template = prefix_template
        self._label = label

    def reify(self, envs: Dict[int, Dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        prefixes = {local_rank: self._prefix(env, local_rank) for local_rank, env in envs.items()}
        self._console.follow(dest.tee_stdouts, prefixes, sys.stdout)
        self._console.follow(dest.tee_stderrs, prefixes, sys.stderr)
        return dataclasses.replace(dest, tee_stdouts={}, tee_stderrs={})

    def _prefix(self, env: Dict[str, str], local_rank: int) -> str:
        role = env.get("ROLE_NAME", "")
        if self._prefix_template:
            # the job's label first: with jobs at once, every line still says its job
            return self._label + Template(self._prefix_template).safe_substitute(
                role_name=role, rank=env.get("RANK", ""), local_rank=local_rank
            )
        return f"[{self._label}{role}{local_rank}]:"
