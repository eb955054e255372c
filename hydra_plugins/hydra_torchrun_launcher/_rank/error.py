"""A rank's own exception, carried whole to the sweep: its type, message, frames and chain.

Hydra's own launchers hand back the task's exception itself (Hydra 1.4 checks it: its
message, a frame of the task function, its `__cause__`), so code that catches a failed
job's error by type, and Hydra's report of it, see what the task raised. A rank's
exception lives in another process: pickling keeps its type and args but drops its
traceback, `__cause__` and `__context__`. So the rank writes it here as plain data (each
exception of the chain pickled on its own, with its frames as (file, function, line)), and
the job's process rebuilds it with a traceback of stand-in frames that point at the same
source lines; the trip from the job's process to the launcher keeps them the same way.

The job's error is still said first as "rank 1 (local_rank 1, pid N) exited with code 1":
in the launcher's line and table (`failure_summary`) and as the exception's first note.
A failure with no Python exception (a signal, an exit code, a script) stays a
`_job.failures.JobFailedError`.
"""

import os
import pickle
from pathlib import Path
from types import CodeType, FrameType, TracebackType
from typing import Any, List, Optional, Tuple

import cloudpickle

# beside torch's error file of the rank (TORCHELASTIC_ERROR_FILE)
EXCEPTION_FILE = "hydra_torchrun_exception.pkl"
# the launcher's one-paragraph account of the failure (rank first), kept on the exception
SUMMARY_ATTR = "hydra_torchrun_summary"
_MAX_CHAIN = 32

_Frames = List[Tuple[str, str, int]]


class _StandIn(Exception):
    """Raised once per stand-in frame, to get a real frame object with a chosen code location."""


_STUB = compile("raise _StandIn", "<rank traceback>", "exec")


# the launcher's own modules (this package, all its folders): their frames are plumbing
# between Hydra's run_job and the task
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _frames(tb: Optional[TracebackType]) -> _Frames:
    """The frames of `tb`, less the launcher's own (the rank's entry point, the job process's
    agent): the traceback a user reads goes from Hydra's run_job straight to the task, as
    with Hydra's own launchers."""
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        if not os.path.abspath(code.co_filename).startswith(_OWN_DIR):
            frames.append((code.co_filename, code.co_name, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _pickled(error: BaseException) -> Optional[bytes]:
    """The exception alone (args, attributes, notes), if it survives the trip unchanged."""
    try:
        data = cloudpickle.dumps(error)
        back = pickle.loads(data)
        same = type(back) is type(error) and str(back) == str(error)
    except Exception:
        return None
    return data if same else None


def _node(error: BaseException, tb: Optional[TracebackType]) -> Tuple[Any, ...]:
    kind = type(error)
    return (_pickled(error), f"{kind.__module__}.{kind.__qualname__}", str(error), _frames(tb))


def freeze(error: BaseException, tb: Optional[TracebackType]) -> Optional[bytes]:
    """The exception (with `tb` as its traceback) and its chain as bytes; None if it cannot travel."""
    try:
        head = _node(error, tb)
        if head[0] is None:
            return None
        chain = []
        seen = {id(error)}
        current = error
        while len(chain) < _MAX_CHAIN:
            if current.__cause__ is not None:
                relation, current = "cause", current.__cause__
            elif current.__context__ is not None and not current.__suppress_context__:
                relation, current = "context", current.__context__
            else:
                break
            if id(current) in seen:
                break
            seen.add(id(current))
            chain.append((relation, _node(current, current.__traceback__)))
        return pickle.dumps((head, chain))
    except Exception:
        return None


def write_rank_exception(error: BaseException, tb: Optional[TracebackType]) -> None:
    """In a failing rank: leave the exception beside torch's error file, for the job's process."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    data = freeze(error, tb)
    if not error_file or data is None:
        return
    try:
        path = Path(error_file).with_name(EXCEPTION_FILE)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except OSError:
        pass  # the job's error then carries the rank's traceback as text


def read_rank_exception(error_file: str) -> Optional[BaseException]:
    """In the job's process: the exception a failed rank left beside its error file, rebuilt."""
    try:
        return thaw((Path(error_file).parent / EXCEPTION_FILE).read_bytes())
    except Exception:
        return None


def _stand_in_frame(filename: str, name: str, lineno: int) -> FrameType:
    code: CodeType = _STUB.replace(co_filename=filename, co_name=name, co_firstlineno=lineno)
    if hasattr(code, "co_qualname"):  # Python >= 3.11 shows co_qualname
        code = code.replace(co_qualname=name)
    try:
        exec(code, {"_StandIn": _StandIn})
    except _StandIn as e:
        assert e.__traceback__ is not None and e.__traceback__.tb_next is not None
        return e.__traceback__.tb_next.tb_frame
    raise AssertionError("the stand-in frame did not raise")


def _traceback(frames: _Frames) -> Optional[TracebackType]:
    tb: Optional[TracebackType] = None
    for filename, name, lineno in reversed(frames):
        tb = TracebackType(tb, _stand_in_frame(filename, name, lineno), -1, lineno)
    return tb


def _rebuilt(node: Tuple[Any, ...]) -> BaseException:
    data, type_name, message, frames = node
    error: Optional[BaseException] = None
    if data is not None:
        try:
            error = pickle.loads(data)
        except Exception:
            error = None
    if error is None:
        # a type the launcher cannot import: its name and message, as the rank printed them
        error = RuntimeError(f"{type_name}: {message}")
    return error.with_traceback(_traceback(frames))


def thaw(data: bytes) -> BaseException:
    head, chain = pickle.loads(data)
    error = _rebuilt(head)
    current = error
    for relation, node in chain:
        chained = _rebuilt(node)
        if relation == "cause":
            current.__cause__ = chained
        else:
            current.__context__ = chained
        current = chained
    return error


def with_summary(error: BaseException, summary: str, note: str) -> BaseException:
    """The rank's exception, told as the launcher tells a failure: `summary` kept, `note` added first."""
    try:
        setattr(error, SUMMARY_ATTR, summary)
        notes = getattr(error, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
        error.__notes__ = [note, *notes]  # type: ignore[attr-defined]  (shown by Python >= 3.11)
    except Exception:
        pass
    return error


def failure_summary(error: Any) -> str:
    """A failed job's account, rank first: the launcher's summary when it has one, else the error."""
    summary = getattr(error, SUMMARY_ATTR, None)
    return summary if isinstance(summary, str) else str(error)


class _JobReturnPickler(cloudpickle.Pickler):
    """Pickles a JobReturn; its error (when Hydra leaves it in place) goes with its frames and chain.

    Hydra 1.4's JobReturn carries its error's traceback and chain itself (it swaps the
    error out in `__getstate__`); Hydra 1.3's does not, and this pickler adds them.
    """

    def __init__(self, file: Any, error: Any) -> None:
        super().__init__(file)
        self._error = error

    def reducer_override(self, obj: Any) -> Any:
        if obj is self._error and isinstance(obj, BaseException):
            data = freeze(obj, obj.__traceback__)
            if data is not None:
                return thaw, (data,)
        return super().reducer_override(obj)


def dumps_job_return(job_return: Any) -> bytes:
    """cloudpickle.dumps(job_return), its error's traceback and chain kept on every Hydra."""
    import io

    buffer = io.BytesIO()
    _JobReturnPickler(buffer, getattr(job_return, "_return_value", None)).dump(job_return)
    return buffer.getvalue()
