"""The agent of `hydra/launcher=torchrun_ssh` on one host: one per host for the whole sweep.

    ssh HOST 'cd <the head's working dir> && exec <python> -m <this module>'

It talks to the head over the ssh session's stdin and stdout (`_ssh.wire`): the head's
set-up first (its import path, the modules to preload, the variables that vary per job),
then the requests of the job nodes to run here. It starts the host's warm server
(`_server.server`: torch and the preloaded packages imported once), which forks each job
node's process (`_job.process`, the same path as every job of every launcher: Hydra's
bookkeeping on a job's first node, torch's elastic agent and its ranks). Each node's end
goes back with the JobReturn its process wrote and the files of its job dir, so the sweep
dir need not be shared. The job processes' stdout comes back as messages; their stderr is
the session's.

The agent ends when its stdin ends (the head exited, was killed with -9, or the connection
was closed), or when the head has been silent for SILENCE_S (the connection was lost without
closing: a network cut, the head's machine off; `_ssh.wire`): it kills what its job
processes started, their whole process groups, first. A job process that outlives its
`job_timeout` and its ranks' shutdown is killed the same way, one job alone: the process
group the job processes share with the warm server that forks them is spared.
"""

import logging
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .._server.server import WarmServer, checked_warm_server
from .._shared.signals import send_signal
from .wire import AGENT_HELLO, HEARTBEAT_S, SILENCE_S, Reader, read_message, send

log = logging.getLogger(__name__)

# the job dir's files that go back to the head, at most (a checkpoint may stay on the host)
MAX_RETURNED_BYTES = 256 << 20

Key = Tuple[int, int]  # (job number, node)


@dataclass
class _Node:
    """A job node's process on this host."""

    key: Key
    pid: int
    result_r: int
    job_dir: str
    kill_after: Optional[float]
    data: List[bytes] = field(default_factory=list)


class Agent:
    def __init__(self, proto_in: int, proto_out: int, output_r: int) -> None:
        self.proto_in = proto_in
        self.proto_out = proto_out
        self.output_r = output_r
        self.reader = Reader()
        self.nodes: Dict[Key, _Node] = {}
        self.selector = selectors.DefaultSelector()
        self.server: Optional[WarmServer] = None
        self.heartbeat_s = HEARTBEAT_S
        self.silence_s = SILENCE_S
        # when the head was last heard, and this agent last sent anything
        self.heard = self.said = time.monotonic()

    def _send(self, message: Any) -> None:
        """Send `message` to the head; PeerSilent when the head takes none of it for silence_s."""
        send(self.proto_out, message, self.silence_s)
        self.said = time.monotonic()

    def serve(self) -> int:
        _, setup = read_message(self.proto_in, self.reader)
        sys.path[:] = list(setup["sys_path"])
        self.heartbeat_s = float(setup.get("heartbeat_s", HEARTBEAT_S))
        self.silence_s = float(setup.get("silence_s", SILENCE_S))
        self.server = checked_warm_server(tuple(setup["preload"]), setup["varying"])
        # a head that stops reading (its connection lost) must not block this agent for good
        os.set_blocking(self.proto_out, False)
        # its clock too: the head gives a multi-host job's nodes one deadline, in each host's clock
        self._send(
            ("ready", {"hostname": socket.gethostname(), "environ": dict(os.environ), "time": time.time()})
        )
        self.heard = time.monotonic()
        self.selector.register(self.proto_in, selectors.EVENT_READ, "head")
        self.selector.register(self.output_r, selectors.EVENT_READ, "output")
        try:
            while True:
                for key, _ in self.selector.select(timeout=self._next_timeout()):
                    if key.data == "head":
                        data = os.read(self.proto_in, 1 << 20)
                        if not data:
                            return 0  # the head is gone: so is every job of it here
                        self.heard = time.monotonic()
                        for message in self.reader.feed(data):
                            self._handle(message)
                    elif key.data == "output":
                        self._forward_output()
                    else:
                        self._read_result(key.data)
                self._kill_overdue()
                now = time.monotonic()
                if now - self.heard > self.silence_s:
                    print(
                        f"[torchrun launcher] no word from the head for {self.silence_s:g} s: "
                        "its connection is lost; ending this host's jobs",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 0
                if now - self.said >= self.heartbeat_s:
                    self._send(("alive",))
        finally:
            self._end_all()

    # -- what the head asks -------------------------------------------------------------

    def _handle(self, message: Any) -> None:
        kind = message[0]
        if kind == "ping":
            return  # the head is alive (noted as it was read)
        if kind == "job":
            _, key, request, job_dir, limit_s = message
            self._start(key, request, job_dir, limit_s)
        elif kind == "signal":
            _, signum, keys = message
            for node in list(self.nodes.values()):
                if keys is None or node.key in keys:
                    send_signal(node.pid, signum)
        else:
            raise ValueError(f"unknown message from the head: {kind!r}")

    def _start(self, key: Key, request: bytes, job_dir: str, limit_s: Optional[float]) -> None:
        assert self.server is not None
        pid, result_r = self.server.start_job(request)
        kill_after = None if limit_s is None else time.monotonic() + limit_s
        self.nodes[key] = _Node(key, pid, result_r, job_dir, kill_after)
        self.selector.register(result_r, selectors.EVENT_READ, key)

    # -- what goes back -----------------------------------------------------------------

    def _forward_output(self) -> None:
        data = os.read(self.output_r, 1 << 16)
        if data:
            self._send(("out", data))

    def _read_result(self, key: Key) -> None:
        node = self.nodes[key]
        chunk = os.read(node.result_r, 1 << 20)
        if chunk:
            node.data.append(chunk)
            return
        self.selector.unregister(node.result_r)
        os.close(node.result_r)
        del self.nodes[key]
        assert self.server is not None
        status = self.server.wait_exit(node.pid)
        while self._output_waiting():  # what the job printed comes before its end
            self._forward_output()
        files, left = job_files(Path(node.job_dir))
        result = b"".join(node.data) if node.data else None
        self._send(("ended", key, result, status, node.pid, files, left))

    def _output_waiting(self) -> bool:
        ready = selectors.DefaultSelector()
        try:
            ready.register(self.output_r, selectors.EVENT_READ)
            return bool(ready.select(timeout=0))
        finally:
            ready.close()

    def _next_timeout(self) -> float:
        """Until the next job to kill, the next heartbeat, or the head's silence limit."""
        limits = [node.kill_after for node in self.nodes.values() if node.kill_after is not None]
        limits += [self.said + self.heartbeat_s, self.heard + self.silence_s]
        return max(0.0, min(limits) - time.monotonic())

    def _kill_overdue(self) -> None:
        now = time.monotonic()
        for node in self.nodes.values():
            if node.kill_after is not None and now >= node.kill_after:
                print(
                    f"[torchrun launcher] job #{node.key[0]}: its process did not end after its "
                    "job_timeout; killing it",
                    file=sys.stderr,
                    flush=True,
                )
                _kill_tree(node.pid, self._spared_groups())
                node.kill_after = None

    def _end_all(self) -> None:
        """Every job process of this agent, and everything it started, killed."""
        for node in self.nodes.values():
            _kill_tree(node.pid, self._spared_groups())
        self.selector.close()

    def _spared_groups(self) -> "set[int]":
        """The process groups a job's kill must spare: this agent's, and its warm server's,
        which every job process is in (forked from it): killing that group would take the
        server, and every other job on this host, with the one job."""
        spared = {os.getpgrp()}
        if self.server is not None:
            spared.add(self.server.pid)
        return spared


def job_files(job_dir: Path) -> "tuple[List[Tuple[str, bytes, int]], List[Tuple[str, int]]]":
    """The job dir's files (path in it, bytes, mode), up to MAX_RETURNED_BYTES in all; and
    those left out (path, size)."""
    files: List[Tuple[str, bytes, int]] = []
    left: List[Tuple[str, int]] = []
    total = 0
    if not job_dir.is_dir():
        return files, left
    for path in sorted(job_dir.rglob("*")):
        try:
            if path.is_symlink() or not path.is_file():
                continue
            size = path.stat().st_size
            relative = str(path.relative_to(job_dir))
            if total + size > MAX_RETURNED_BYTES:
                left.append((relative, size))
                continue
            files.append((relative, path.read_bytes(), path.stat().st_mode & 0o777))
            total += size
        except FileNotFoundError:  # a rank's temporary file, gone as it was listed
            continue
    return files, left


def _descendants(pid: int) -> List[int]:
    """Every live descendant of `pid` (from /proc), deepest last."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found: List[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid: int, spared: "set[int]") -> None:
    """SIGKILL a job process, every process below it, and the process groups they are in (a
    rank in a session of its own too), but the `spared` ones."""
    below = _descendants(pid)
    groups = set()
    for each in [pid, *below]:
        try:
            groups.add(os.getpgid(each))
        except ProcessLookupError:
            continue
    for each in [pid, *below]:
        send_signal(each, signal.SIGKILL)
    for group in groups - spared:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            continue


def main() -> int:
    # the protocol is the session's stdin and stdout: nothing else may read or write them
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.write(proto_out, AGENT_HELLO)  # the protocol starts here: what the login printed came before
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # what the job processes (and this one) print goes back to the head as messages
    output_r, output_w = os.pipe()
    os.dup2(output_w, 1)
    os.close(output_w)
    logging.basicConfig(level=logging.WARNING, format=f"[{socket.gethostname()}] %(message)s")
    try:
        return Agent(proto_in, proto_out, output_r).serve()
    except BrokenPipeError:  # the head is gone
        return 0


if __name__ == "__main__":
    sys.exit(main())
