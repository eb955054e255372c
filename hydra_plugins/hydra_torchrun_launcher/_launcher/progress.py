"""A launch's live progress line on a terminal, redrawn in place as pip's and tqdm's are.

When stderr is a terminal, and every handler that the launcher's log lines go to writes to
a terminal (so that no file or pipe that keeps them misses a line), one line on stderr says
how the launch stands: jobs ended (and failed), running and pending, the time since it
began and an estimate of the time left. It is redrawn in place (a carriage return, the line,
erase to the line's end, and a carriage return again) at every job event and every second.
It takes the place of the lines that say a job starts and that it completed; a failure still
prints at once, in full. A log line of the launcher's clears it, is printed, and the line is
drawn again below it: the log handlers' streams are wrapped while it is shown. What the
ranks print goes to the terminal straight from their processes: the cursor waits at the
line's start, so that their line is written over it rather than after it, and the line is
drawn again below within a second. Off a terminal there is no such line.
"""

import logging
import os
import sys
import threading
import time
from typing import Any, List, Optional, Set, TextIO

# how often the line is redrawn while nothing happens (its elapsed time moves on)
TICK_S = 1.0
_CLEAR = "\r\x1b[K"


def on_a_terminal(logger: logging.Logger, stream: Optional[TextIO] = None) -> bool:
    """Whether a progress line may replace the per-job lines: `stream` (stderr) is a terminal
    and so is every stream that `logger`'s INFO lines are written to."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("TERM") == "dumb" or not _isatty(stream):
        return False
    if not logger.isEnabledFor(logging.INFO):
        return True
    handlers = _info_handlers(logger)
    return bool(handlers) and all(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and _isatty(h.stream)
        for h in handlers
    )


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _info_handlers(logger: logging.Logger) -> List[logging.Handler]:
    """The handlers an INFO record of `logger` reaches."""
    found: List[logging.Handler] = []
    current: Optional[logging.Logger] = logger
    while current is not None:
        found.extend(h for h in current.handlers if h.level <= logging.INFO)
        current = current.parent if current.propagate else None
    return found


def _clock(seconds: float) -> str:
    """1:05, 12:00, 1:02:03."""
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressLine:
    """The line of one launch of `total` jobs, shown from `start` to `close`."""

    def __init__(self, total: int, logger: logging.Logger, stream: Optional[TextIO] = None) -> None:
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self._logger = logger
        self._lock = threading.RLock()
        self._started: Set[int] = set()
        self._ended: Set[int] = set()
        self._failed = 0
        self._began = time.monotonic()
        self._shown = False
        # a log line is half written: nothing is drawn until it ends
        self._mid_line = False
        self._wrapped: List[tuple[logging.StreamHandler, Any, _ClearingStream]] = []
        self._stop = threading.Event()
        self._ticker: Optional[threading.Thread] = None
        self.closed = False

    def start(self) -> None:
        for handler in _info_handlers(self._logger):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler.stream, _ClearingStream):
                wrapper = _ClearingStream(handler.stream, self)
                original = handler.setStream(wrapper)  # type: ignore[arg-type]
                self._wrapped.append((handler, original, wrapper))
        self._ticker = threading.Thread(target=self._tick, name="torchrun-launcher-progress", daemon=True)
        self._ticker.start()
        self.draw()

    def job_started(self, num: int) -> None:
        with self._lock:
            self._started.add(num)
            self.draw()

    def job_ended(self, num: int, failed: bool) -> None:
        with self._lock:
            if num not in self._ended:
                self._ended.add(num)
                self._failed += failed
            self.draw()

    def text(self, now: Optional[float] = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self._began
        ended = len(self._ended)
        running = len(self._started - self._ended)
        pending = max(self.total - len(self._started | self._ended), 0)
        if ended and ended < self.total:
            eta = _clock(elapsed / ended * (self.total - ended))
        else:
            eta = "--" if ended < self.total else "0:00"
        failed = f" ({self._failed} failed)" if self._failed else ""
        return (
            f"sweep: {ended}/{self.total} ended{failed}, {running} running, {pending} pending; "
            f"{_clock(elapsed)} elapsed, ETA {eta}"
        )

    def draw(self) -> None:
        with self._lock:
            if self.closed or self._mid_line:
                return
            width = _width(self.stream)
            text = self.text()
            if len(text) > width - 1:  # a line that wraps cannot be redrawn in place
                text = text[: max(width - 2, 0)] + "~"
            self._write(_CLEAR + text + "\r")
            self._shown = True

    def clear(self) -> None:
        with self._lock:
            if self._shown:
                self._write(_CLEAR)
                self._shown = False

    def close(self) -> None:
        """The line gone for good, the handlers' streams as they were."""
        with self._lock:
            if self.closed:
                return
            self.clear()
            self.closed = True
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=2 * TICK_S)
        for handler, original, wrapper in self._wrapped:
            if handler.stream is wrapper:
                handler.setStream(original)
        self._wrapped = []

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a terminal gone (closed, hung up): nothing to draw on
            self.closed = True

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self.draw()


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return 80


class _ClearingStream:
    """A log handler's stream while the progress line is shown: the line is cleared before
    a log line is written, and drawn again once it has ended."""

    def __init__(self, stream: Any, line: ProgressLine) -> None:
        self._stream = stream
        self._line = line

    def write(self, text: str) -> int:
        with self._line._lock:
            self._line.clear()
            written = self._stream.write(text)
            if text:
                self._line._mid_line = not text.endswith("\n")
            return written

    def flush(self) -> None:
        with self._line._lock:
            self._stream.flush()
            self._line.draw()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
