"""The messages between the head and its agents: over the ssh session's stdin and stdout.

Each message is one pickled value, its length first (8 bytes). The head sends a set-up, job
requests and signals; an agent sends its readiness, the output of its jobs and each job
node's end (its JobReturn as the job process pickled it, and its job dir's files). Nothing
is put into a shell string; the stream is the session's own, so it ends with it.

A connection can be lost without ending (a host powered off, a network cut: no FIN reaches
either side), so each side says it is alive every HEARTBEAT_S (`ping` from the head, `alive`
from an agent; any message counts) and takes a peer silent for SILENCE_S as gone: the head
fails the host's jobs, the agent ends them and itself (no orphan training on a GPU).
"""

import os
import pickle
import select
import struct
from typing import Any, List, Optional

_LENGTH = struct.Struct("=Q")
# a larger length is no message of ours (a shell's banner, a stray print): the stream is broken
MAX_MESSAGE = 1 << 34
# what an agent writes first on its stream: what the host's login printed before it (a
# `.bashrc` that echoes, a conda or `module` banner, a site's ForceCommand wrapper) is the
# host's output, not the protocol's, as `ssh host torchrun ...` would show it
AGENT_HELLO = b"\x00hydra-torchrun-launcher agent\x00"
# more than this before the agent's hello: no agent of ours is coming
MAX_BANNER = 1 << 20
# how often each side says it is alive, and how long a silent peer is taken as gone
HEARTBEAT_S = 5.0
SILENCE_S = 30.0


class BrokenStream(Exception):
    """What came down the stream is not a message of the protocol."""


class PeerSilent(BrokenPipeError):
    """The peer took nothing of a message for the time allowed: it is gone."""


def send(fd: int, message: Any, timeout_s: Optional[float] = None) -> None:
    """Write one message to `fd` (blocking until all of it is written). With `timeout_s`
    (`fd` non-blocking): PeerSilent when the peer takes none of it for that long."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            assert timeout_s is not None, "a non-blocking stream needs a timeout"
            if not select.select([], [fd], [], timeout_s)[1]:
                raise PeerSilent(f"the peer took nothing for {timeout_s:g} s") from None
            continue
        view = view[written:]


class Reader:
    """Messages from a stream read in chunks as they come (`feed`), whole ones out (`messages`).

    `after`: bytes that come before the first message (the agent's hello); what precedes
    them is kept as `banner` (the host's login output), not read as messages."""

    def __init__(self, after: Optional[bytes] = None) -> None:
        self._buffer = bytearray()
        self._awaiting = after
        self.banner = b""

    def feed(self, data: bytes) -> List[Any]:
        """The messages completed by `data`, in order."""
        self._buffer += data
        if self._awaiting is not None:
            at = self._buffer.find(self._awaiting)
            if at < 0:
                if len(self._buffer) > MAX_BANNER:
                    shown = bytes(self._buffer[:80]).decode(errors="replace").splitlines()[0]
                    raise BrokenStream(f"the stream carries something else: {shown!r}")
                return []
            self.banner = bytes(self._buffer[:at])
            del self._buffer[: at + len(self._awaiting)]
            self._awaiting = None
        found = []
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            if size > MAX_MESSAGE:
                shown = bytes(self._buffer[:80]).decode(errors="replace").splitlines()[0]
                raise BrokenStream(f"the stream carries something else: {shown!r}")
            end = _LENGTH.size + size
            if len(self._buffer) < end:
                break
            found.append(pickle.loads(bytes(self._buffer[_LENGTH.size : end])))
            del self._buffer[:end]
        return found

    @property
    def awaiting(self) -> bool:
        """Whether the bytes before the first message have not all come yet."""
        return self._awaiting is not None

    def pending(self) -> bool:
        """Whether part of a message has come and the rest not (yet)."""
        return bool(self._buffer)


def read_message(fd: int, reader: Reader) -> Any:
    """The next message from `fd`, blocking; EOFError when the stream ends first."""
    while True:
        data = os.read(fd, 1 << 20)
        if not data:
            raise EOFError("the stream ended")
        found = reader.feed(data)
        if found:
            assert len(found) == 1, "read_message is for a stream that sends one message, then waits"
            return found[0]
