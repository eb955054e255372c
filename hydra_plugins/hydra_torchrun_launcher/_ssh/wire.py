"""The messages between the head and its agents: over the ssh session's stdin and stdout.

Each message is one pickled value, its length first (8 bytes). The head sends a set-up, job
requests and signals; an agent sends its readiness, the output of its jobs and each job
node's end (its JobReturn as the job process pickled it, and its job dir's files). Nothing
is put into a shell string; the stream is the session's own, so it ends with it.
"""

import os
import pickle
import struct
from typing import Any, List

_LENGTH = struct.Struct("=Q")
# a larger length is no message of ours (a shell's banner, a stray print): the stream is broken
MAX_MESSAGE = 1 << 34


class BrokenStream(Exception):
    """What came down the stream is not a message of the protocol."""


def send(fd: int, message: Any) -> None:
    """Write one message to `fd` (blocking until all of it is written)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class Reader:
    """Messages from a stream read in chunks as they come (`feed`), whole ones out (`messages`)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> List[Any]:
        """The messages completed by `data`, in order."""
        self._buffer += data
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
