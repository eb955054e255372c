"""The head's side of its agents: one ssh session per host, started once for the sweep.

    ssh -T -o BatchMode=yes <ssh_options> HOST 'cd DIR && exec PYTHON -m <the agent>'

Each part of the remote command is quoted (`shlex.quote`); the user's ssh config is
honoured (`-F` in `ssh_options` names another). An ssh runs in a session of its own, so a
terminal's Ctrl-C reaches the hosts only through the head (which stops the jobs there
through torch's own shutdown path), never by cutting the connection. The agents' output
is relayed to the head's console in whole lines; an agent that ends before it is ready is
named with ssh's own reason (its last line on stderr). A ready agent silent for SILENCE_S
(`_ssh.wire`: its host or the network to it is down, which ssh alone may never notice) is
taken as lost and its ssh killed.
"""

import os
import shlex
import subprocess
import sys
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence

from .hosts import Host
from .wire import AGENT_HELLO, SILENCE_S, BrokenStream, Reader, send

AGENT_MODULE = "hydra_plugins.hydra_torchrun_launcher._ssh.agent"
# how long a closed agent has to end before its ssh is killed
CLOSE_WAIT_S = 30.0


def ssh_command(host: Host, ssh_options: Sequence[str], python: str, cwd: str) -> List[str]:
    """The ssh command that starts `host`'s agent in `cwd` with `python`, under the head's
    umask: the files the host writes into the sweep dir (job dirs, `.hydra/`, logs) are as
    private, or as shared with the group, as those the local launcher writes (sshd's own
    umask, 022, would make them readable by all and not writable by the group)."""
    umask = _head_umask()
    remote = f"cd {shlex.quote(cwd)} && umask {umask:04o} && exec {shlex.quote(python)} -m {AGENT_MODULE}"
    return ["ssh", "-T", "-o", "BatchMode=yes", *ssh_options, host.name, remote]


def _head_umask() -> int:
    """This process's umask (read by setting it, then back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


class _Lines:
    """A stream relayed in whole lines (hosts' output does not interleave mid-line)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.pending = b""

    def write(self, data: bytes) -> None:
        data = self.pending + data
        cut = data.rfind(b"\n") + 1
        self.pending = data[cut:]
        if cut:
            self.stream.write(data[:cut])
            self.stream.flush()

    def close(self) -> None:
        if self.pending:
            self.stream.write(self.pending + b"\n")
            self.stream.flush()
            self.pending = b""


class HostAgent:
    """A host's agent, over its ssh session."""

    def __init__(self, host: Host, command: List[str], setup: Dict[str, Any]) -> None:
        self.host = host
        self.command = command
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        assert self.process.stderr is not None
        self.stdin = self.process.stdin.fileno()
        self.stdout = self.process.stdout.fileno()
        self.stderr = self.process.stderr.fileno()
        self.reader = Reader(after=AGENT_HELLO)
        # what the agent said when ready: its hostname, its environment, its clock
        self.ready: Optional[Dict[str, Any]] = None
        self.clock_offset = 0.0
        # why the host is gone (ssh's reason), once it is
        self.lost: Optional[str] = None
        self.out = _Lines(sys.stdout.buffer)
        self.err = _Lines(sys.stderr.buffer)
        # stderr until the agent is ready: the reason when it fails, else shown then
        self.early_err: List[bytes] = []
        self.tail: Deque[bytes] = deque(maxlen=20)
        self.stdout_open = True
        self.stderr_open = True
        # when the agent was last heard (anything on its streams), and last sent anything
        self.heard = self.said = time.monotonic()
        try:
            send(self.stdin, ("setup", setup))
        except BrokenPipeError:
            pass  # ended already: its reason comes with its stderr

    @property
    def hostname(self) -> str:
        assert self.ready is not None
        return str(self.ready["hostname"])

    def read_stdout(self) -> List[Any]:
        """The messages that came (output is relayed); [] and `stdout_open` False at its end."""
        data = os.read(self.stdout, 1 << 20)
        if not data:
            self.stdout_open = False
            return []
        self.heard = time.monotonic()
        awaiting_hello = self.reader.awaiting
        try:
            messages = self.reader.feed(data)
        except BrokenStream as e:
            self.stdout_open = False
            self.lost = f"its agent broke the protocol: {e}"
            return []
        if awaiting_hello and not self.reader.awaiting and self.reader.banner:
            self.out.write(self.reader.banner)  # the host's login output, shown as ssh shows it
        found = []
        for message in messages:
            if message[0] == "out":
                self.out.write(message[1])
            elif message[0] == "alive":
                continue
            elif message[0] == "ready":
                self.ready = message[1]
                # how far the host's clock is ahead of the head's (its message's transit aside)
                self.clock_offset = float(self.ready.get("time", time.time())) - time.time()
                for chunk in self.early_err:
                    self.err.write(chunk)
                self.early_err.clear()
            else:
                found.append(message)
        return found

    def read_stderr(self) -> None:
        data = os.read(self.stderr, 1 << 16)
        if not data:
            self.stderr_open = False
            return
        self.heard = time.monotonic()
        self.tail.extend(data.splitlines())
        if self.ready is None:
            self.early_err.append(data)
        else:
            self.err.write(data)

    def reason(self) -> str:
        """Why the agent ended: ssh's (or the remote shell's) last words, and its exit status."""
        status = self.process.wait()
        said = [line.decode(errors="replace").strip() for line in self.tail]
        said = [line for line in said if line]
        words = said[-1] if said else "no message"
        how = f"exit status {status}" if status >= 0 else f"killed by signal {-status}"
        return f"{words} ({how})"

    def send(self, message: Any) -> bool:
        """Send `message`; False when the session has ended."""
        if self.lost is not None:
            return False
        try:
            send(self.stdin, message)
        except (BrokenPipeError, ConnectionResetError):
            return False
        self.said = time.monotonic()
        return True

    def silent(self, now: float) -> bool:
        """A ready agent not heard for SILENCE_S is lost: its ssh is killed (its streams end,
        and its jobs fail with this reason)."""
        if self.ready is None or self.lost is not None or now - self.heard <= SILENCE_S:
            return False
        self.lost = f"no word from its agent for {SILENCE_S:g} s (the host, or the network to it, is down)"
        self.process.kill()
        return True

    def close(self) -> None:
        """End the session (the agent ends with its stdin) and wait for ssh to exit."""
        try:
            self.process.stdin.close()  # type: ignore[union-attr]
        except BrokenPipeError:
            pass
        try:
            self.process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # what is left of its output
        for fd, open_, sink in (
            (self.stdout, self.stdout_open, None),
            (self.stderr, self.stderr_open, self.err),
        ):
            while open_:
                data = os.read(fd, 1 << 20)
                if not data:
                    break
                if sink is not None:
                    sink.write(data)
                else:
                    try:
                        for message in self.reader.feed(data):
                            if message[0] == "out":
                                self.out.write(message[1])
                    except BrokenStream:
                        break
        self.out.close()
        self.err.close()
        self.process.stdout.close()  # type: ignore[union-attr]
        self.process.stderr.close()  # type: ignore[union-attr]
