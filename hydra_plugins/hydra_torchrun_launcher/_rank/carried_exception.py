"""A rank's own exception, carried whole to the sweep: its type, message, frames and chain.

Hydra's own launchers hand back the task's exception itself (Hydra 1.4 checks it: its
message, a frame of the task function, its `__cause__`), so code that catches a failed
job's error by type, and Hydra's report of it, see what the task raised. A rank's
exception lives in another process: pickling keeps its type and args but drops its
traceback, `__cause__` and `__context__`. So the rank writes it here as plain data (each
exception of the chain pickled on its own, with its frames as (file, function, line)), and
the job's process rebuilds it with a traceback of stand-in frames that point at the same
source lines; the trip from the job's process to the launcher keeps them the same way.

Any exception travels, whatever its pickling does: one whose `__reduce__` drops its
attributes and notes (pydantic's `ValidationError`) gets them back from copies carried beside
it; one that cannot be pickled whole, or whose constructor takes other arguments than its
`args` (required keyword-like parameters), is rebuilt as its own type from its class and
`args` without calling `__init__`; one whose class cannot be had at all becomes a
`RuntimeError` naming it. Its frames and chain come along every time.

The job's error is still said first as "rank 1 (local_rank 1, pid N) exited with code 1":
in the launcher's line and table (`failure_summary`) and as the exception's first note.
That account (`FailureAccount`) travels beside the exception, on the JobReturn, never on the
exception alone, whose pickling it would otherwise depend on. A failure with no Python
exception (a signal, an exit code, a script) stays a `_job.failure_report.JobFailedError`.
"""

import io
import json
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType, TracebackType
from typing import Any, Dict, List, Optional, Tuple

import cloudpickle

# beside torch's error file of the rank (TORCHELASTIC_ERROR_FILE)
EXCEPTION_FILE = "hydra_torchrun_exception.pkl"
# the launcher's one-paragraph account of the failure (rank first): set on the job's error
# where it is made and where it arrives, for code that reads it there; it travels as
# ACCOUNT_ATTR, an attribute of the JobReturn
SUMMARY_ATTR = "hydra_torchrun_summary"
ACCOUNT_ATTR = "hydra_torchrun_failure"
_MAX_CHAIN = 32

_Frames = List[Tuple[str, str, int]]


class _StandIn(Exception):
    """Raised once per stand-in frame, to get a real frame object with a chosen code location."""


_STUB = compile("raise _StandIn", "<rank traceback>", "exec")
# a stand-in frame's globals. Hydra 1.4 reads a frame whose globals name `_SyntheticTraceback`
# (and no `__name__`) as one its own JobReturn restored from another process, and places it
# by its code's file and name: so it finds run_job among ours, and prints the task's frames
# from there on, as for a job of its own launchers (a key of our own: nothing of Hydra's)
_STAND_IN_GLOBALS = {"_StandIn": _StandIn, "_SyntheticTraceback": _StandIn}


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


def _script_class(qualname: str, by_value: bytes) -> type:
    """A class the app's script defined, where it arrives: the script's own class when this
    process runs the script as `__main__` (the launcher: `python app.py`), so that
    `isinstance(error, AppError)` holds there and it prints as `AppError`, as with Hydra's own
    launchers; elsewhere (the job's process, where the `on_job_*` callbacks run) the copy of
    that name it already has (`_arrived`), else this one."""
    found: Any = sys.modules.get("__main__")
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if isinstance(found, type) and found.__module__ == "__main__" and found.__qualname__ == qualname:
        return found
    known = _arrived(qualname)
    if known is not None:
        return known
    kind = pickle.loads(by_value)
    assert isinstance(kind, type)
    return kind


def _arrived(qualname: str) -> Optional[type]:
    """The first copy by value of the script's class `qualname` in this process: in the job's
    process, the launcher's (its callbacks' globals came with the job's request). cloudpickle
    keeps, weakly, every class it made by value, in the order made; a cloudpickle without
    that registry finds none (the arriving copy is then used). A class made in a function
    (`<locals>`) has no name to share."""
    if "<locals>" in qualname:
        return None
    made = getattr(cloudpickle.cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_ID", {})
    for kind in list(made.values()):
        if isinstance(kind, type) and kind.__module__ == "__main__" and kind.__qualname__ == qualname:
            return kind
    return None


class _ScriptClassPickler(cloudpickle.Pickler):
    """cloudpickle, but a class of the app's script (`__main__`: a rank names the classes of
    its script body so, `_rank.script`) goes by its name too, beside its copy by value."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and obj.__module__ == "__main__":
            return _script_class, (obj.__qualname__, cloudpickle.dumps(obj))
        return super().reducer_override(obj)


def _script_pickled(value: Any) -> bytes:
    """`cloudpickle.dumps(value)`, with the app's script's classes by name too."""
    buffer = io.BytesIO()
    _ScriptClassPickler(buffer).dump(value)
    return buffer.getvalue()


def _dumps(value: Any) -> Optional[bytes]:
    try:
        return _script_pickled(value)
    except Exception:
        return None


def _pickled(error: BaseException) -> "Tuple[Optional[bytes], List[str]]":
    """The exception pickled alone, if it comes back as its own type with its message; and
    the names of its attributes that the trip loses (a `__reduce__` that keeps only `args`)."""
    try:
        data = _script_pickled(error)
        back = pickle.loads(data)
        same = type(back) is type(error) and message_of(back) == message_of(error)
    except Exception:
        return None, list(_attributes(error))
    if not same:
        return None, list(_attributes(error))
    kept = getattr(back, "__dict__", {})
    return data, [name for name in _attributes(error) if name not in kept]


def _attributes(error: BaseException) -> Dict[str, Any]:
    """The exception's own attributes, less its notes and the launcher's summary (carried apart)."""
    return {
        name: value
        for name, value in getattr(error, "__dict__", {}).items()
        if name not in ("__notes__", SUMMARY_ATTR)
    }


def _notes(error: BaseException) -> Optional[List[str]]:
    notes = getattr(error, "__notes__", None)
    return [note for note in notes if isinstance(note, str)] if isinstance(notes, list) else None


def _unrenderable(error: BaseException) -> Optional[str]:
    """Why `str(error)` fails ("its __str__ raised TypeError: ..."); None when it renders."""
    try:
        str(error)
    except Exception as e:
        try:
            why = f"{type(e).__name__}: {e}"
        except Exception:  # its own message fails too: its type says enough
            why = type(e).__name__
        return f"its __str__ raised {why}"
    return None


def message_of(error: BaseException) -> str:
    """`str(error)`, or, when its `__str__` raises, a line that says so and why (where Python's
    traceback prints `<exception str() failed>`): the failure is still told, by its type."""
    why = _unrenderable(error)
    return str(error) if why is None else f"<its message could not be rendered: {why}>"


def write_torch_error_file(error: BaseException, tb: Optional[TracebackType]) -> None:
    """In a failing rank whose exception's `__str__` raises: torch's error file, which torch's
    `record` cannot write then (it formats `f"{type(e).__name__}: {e}"` and fails on it), so
    the job's error still names the exception's type, the rank and its exit (torch's format)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or _unrenderable(error) is None:
        return  # torch's `record` writes it
    data = {
        "message": {
            "message": f"{type(error).__name__}: {message_of(error)}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(error), error, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        Path(error_file).parent.mkdir(parents=True, exist_ok=True)
        Path(error_file).write_text(json.dumps(data))
    except OSError:
        pass  # the job's error then names the rank and its exit, with its last lines


def _node(error: BaseException, tb: Optional[TracebackType]) -> Tuple[Any, ...]:
    """(the exception pickled whole or None, its type's name, its message, its frames, and
    beside it what rebuilds it when it does not come back whole: its notes, its class, its
    args and the attributes its pickling loses, each pickled on its own)."""
    kind = type(error)
    data, lost = _pickled(error)
    attributes = _attributes(error)
    beside: Dict[str, Any] = {
        "notes": _notes(error),
        "class": None if data is not None else _dumps(kind),
        "args": None if data is not None else _dumps(error.args),
        "attributes": {name: _dumps(attributes[name]) for name in lost},
    }
    return (data, f"{kind.__module__}.{kind.__qualname__}", message_of(error), _frames(tb), beside)


def freeze(error: BaseException, tb: Optional[TracebackType]) -> Optional[bytes]:
    """The exception (with `tb` as its traceback) and its chain as bytes; None if it cannot travel."""
    try:
        head = _node(error, tb)
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
        exec(code, _STAND_IN_GLOBALS)
    except _StandIn as e:
        assert e.__traceback__ is not None and e.__traceback__.tb_next is not None
        return e.__traceback__.tb_next.tb_frame
    raise AssertionError("the stand-in frame did not raise")


def _traceback(frames: _Frames) -> Optional[TracebackType]:
    tb: Optional[TracebackType] = None
    for filename, name, lineno in reversed(frames):
        tb = TracebackType(tb, _stand_in_frame(filename, name, lineno), -1, lineno)
    return tb


def _loads(data: Optional[bytes]) -> Any:
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:
        return None


def _from_parts(beside: Dict[str, Any], message: str) -> Optional[BaseException]:
    """The exception rebuilt as its own class from its `args`, without its `__init__` (which
    may take other arguments): as pickle rebuilds an object, when its own pickling fails."""
    kind = _loads(beside.get("class"))
    args = _loads(beside.get("args"))
    if not isinstance(kind, type) or not issubclass(kind, BaseException) or not isinstance(args, tuple):
        return None
    try:
        error = kind.__new__(kind, *args)
        error.args = args
        _restore(error, beside)
        if message_of(error) != message:
            return None
    except Exception:
        return None
    return error


def _restore(error: BaseException, beside: Dict[str, Any]) -> None:
    """The attributes and notes the exception's pickling lost, put back."""
    for name, data in beside.get("attributes", {}).items():
        value = _loads(data)
        if data is None or (value is None and data != _NONE):
            continue
        try:
            if name not in getattr(error, "__dict__", {}):
                setattr(error, name, value)
        except Exception:
            pass
    notes = beside.get("notes")
    if notes is not None and _notes(error) != notes:
        try:
            error.__notes__ = list(notes)  # type: ignore[attr-defined]
        except Exception:
            pass


_NONE = cloudpickle.dumps(None)


def _rebuilt(node: Tuple[Any, ...]) -> BaseException:
    data, type_name, message, frames, beside = node
    error = _loads(data)
    if isinstance(error, BaseException):
        _restore(error, beside)
    else:
        error = _from_parts(beside, message)
    if error is None:
        # a type the launcher cannot import: its name and message, as the rank printed them
        error = RuntimeError(f"{type_name}: {message}")
        _restore(error, {"notes": beside.get("notes")})
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
    """The rank's exception, told as the launcher tells a failure: `note` added first (what
    Python prints under it), `summary` set on it for code of this process that reads it.
    Neither is needed for the trip to the launcher: the account travels as a
    `FailureAccount`, and the notes beside the exception (`freeze`)."""
    try:
        setattr(error, SUMMARY_ATTR, summary)
    except Exception:
        pass
    try:
        notes = getattr(error, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
        error.__notes__ = [note, *notes]  # type: ignore[attr-defined]  (shown by Python >= 3.11)
    except Exception:
        pass
    return error


@dataclass(frozen=True)
class FailureAccount:
    """The launcher's account of a failed job, carried beside its error on the JobReturn.

    `summary`: what the job's line, the table and `sweep_summary.json` say, the first cause
    first (the failed rank, how, its exception, every other failed rank, where their output
    is). `stopped`: the job ended because the sweep was stopped (Ctrl-C, SIGTERM), not by a
    failure of its own; a stop that came after a failure leaves it False (the failure came
    first: the job is FAILED, and its summary says the stop after it).
    """

    summary: str
    stopped: bool = False


def account_of(failed: Any) -> Optional[FailureAccount]:
    """The account a failed JobReturn carries, if its job's process gave it one."""
    account = getattr(failed, ACCOUNT_ATTR, None)
    return account if isinstance(account, FailureAccount) else None


def ended_by_stop(job_return: Any) -> Optional[bool]:
    """For the launcher's record of a failed job: True when the job says a stop ended it
    (STOPPED), False when it says it failed on its own first (FAILED, a stop after that
    included), None when it says nothing (the job's process died before it could)."""
    account = account_of(job_return)
    return None if account is None else account.stopped


def failure_summary(failed: Any) -> str:
    """A failed job's account, rank first: of a JobReturn (the account it carries, else its
    error's) or of an error (the summary set on it, else its message)."""
    account = account_of(failed)
    if account is not None:
        return account.summary
    error = failed._return_value if hasattr(failed, "_return_value") and hasattr(failed, "status") else failed
    summary = getattr(error, SUMMARY_ATTR, None)
    return summary if isinstance(summary, str) else message_of(error)


def _rebuild_job_return(kind: type, state: Dict[str, Any], frozen: bytes) -> Any:
    """The JobReturn as the job's process sent it: its error thawed (its frames, chain, notes
    and lost attributes back), and the account, where it has one, set on the error too."""
    job_return = kind.__new__(kind)
    job_return.__dict__.update(state)
    error = thaw(frozen)
    account = account_of(job_return)
    if account is not None:
        try:
            setattr(error, SUMMARY_ATTR, account.summary)
        except Exception:
            pass
    job_return._return_value = error
    return job_return


class _JobReturnPickler(cloudpickle.Pickler):
    """Pickles a JobReturn whose error goes frozen (`freeze`): its type, frames, chain and
    notes kept on every Hydra, whatever the exception's own pickling does.

    Hydra 1.4's JobReturn pickles its error itself (`__getstate__`), and falls back to a
    `RuntimeError` when the exception does not come back equal (a `__reduce__` that drops
    its notes); Hydra 1.3's keeps neither traceback nor chain. Here the JobReturn's fields
    travel as they are, its error frozen beside them.
    """

    def __init__(self, file: Any, job_return: Any) -> None:
        super().__init__(file)
        self._job_return = job_return

    def reducer_override(self, obj: Any) -> Any:
        if obj is self._job_return:
            error = getattr(obj, "_return_value", None)
            if isinstance(error, BaseException):
                frozen = freeze(error, error.__traceback__)
                if frozen is not None:
                    state = dict(vars(obj))
                    state["_return_value"] = None
                    return _rebuild_job_return, (type(obj), state, frozen)
        return super().reducer_override(obj)


def dumps_job_return(job_return: Any) -> bytes:
    """cloudpickle.dumps(job_return), its error's traceback, chain and notes kept on every Hydra."""
    import io

    buffer = io.BytesIO()
    _JobReturnPickler(buffer, job_return).dump(job_return)
    return buffer.getvalue()
