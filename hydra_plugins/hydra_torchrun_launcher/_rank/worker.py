"""What runs in every rank: the app's script, the job's Hydra world, the task, its value.

The elastic agent of the job's process starts `run_rank` in each worker process (forked
from the job's warm forkserver, spawned, or forked from the job process). The rank
inherits the job process's environment and working dir (env_set, chdir, devices), and
torch has set RANK, LOCAL_RANK, ... before `run_rank` runs. The rank then starts as
torchrun's would (`_rank.script`): a fresh random state, the app's script body run as its
`__main__` (module-level set-up, `sys.argv`), the task the body defines. Everything else
the rank needs is one `RankPayload`: a rank forked from the job process's memory (its
forkserver, `start_method: fork`) finds it there, with Hydra's state as run_job set it;
another gets it cloudpickled, Hydra's state (with the app's custom OmegaConf resolvers)
and, for the cases the script does not define by name (lambdas, closures, partials), the
task included.
"""

import copy
import faulthandler
import inspect
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Dict, Iterable, List, Optional

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import configure_log, setup_globals
from omegaconf import DictConfig, OmegaConf
from omegaconf.basecontainer import BaseContainer

from .._shared.lifetime import die_with_parent
from .._shared.plan import RankPayload
from .._shared.private import flush_loggers as _flush_loggers
from .._shared.signals import group_signals
from .._shared.stop_files import DUMP_SIGNAL, note_rank_process, note_rank_started, tell_task_returned
from .carried_exception import write_rank_exception, write_torch_error_file
from .forkserver import drop_inherited_forkserver
from .preloaded import redo_reads_at_import
from .script import fresh_random_state, run_script, script_frames, task_function

_NODES_AGREE_TIMEOUT = timedelta(seconds=300)


# the job's payload, held by the job's process for ranks forked from its memory
# (`payload_for_ranks`)
_FORKED_FROM: Optional[RankPayload] = None


def payload_for_ranks(payload: RankPayload, forked: bool) -> Optional[bytes]:
    """What the job's process passes each rank for `payload`.

    `forked`: the ranks fork from this process's memory as it is now (its own forkserver,
    forked next, or start_method fork), where run_job has set Hydra's state as the job sees
    it: they take the payload and that state from there (None), rather than unpickling what
    this process holds already. Otherwise the payload cloudpickled, with the job's
    HydraConfig as run_job has set it."""
    global _FORKED_FROM
    if forked and isinstance(getattr(BaseContainer, "_resolvers", None), dict):
        _FORKED_FROM = payload
        return None
    if not payload.pickled_hydra_config:
        payload.pickled_hydra_config = cloudpickle.dumps(HydraConfig.instance())
    return cloudpickle.dumps(payload)


def run_rank(sys_path: List[str], payload: Optional[bytes]) -> Optional[bytes]:
    """Entry point of a rank. Returns local rank 0's return value, cloudpickled.

    `sys_path` comes apart from the payload: unpickling a task function that lives in an
    importable module needs the app's import path first. `payload`: see `payload_for_ranks`.

    A KeyboardInterrupt that reaches here (a SIGINT sent to this rank, or raised by the app)
    ends the process by SIGINT, as it ends a Python script that torchrun runs: torch's agent
    then fails the job naming this rank. torch's multiprocessing wrapper around this function
    would take it for a normal exit, and the job would wait on its other ranks for ever.
    """
    try:
        return _run_rank(sys_path, payload)
    except KeyboardInterrupt:
        # no traceback: a Ctrl-C at the terminal reaches every rank, and the job then says
        # it was stopped; a SIGINT to this rank alone is named by the job's failure
        _flush_loggers()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)
        raise  # SIGINT ends the process before this line


def _run_rank(sys_path: List[str], payload: Optional[bytes]) -> Optional[bytes]:
    die_with_parent()
    tempfile.tempdir = None  # the job process's own (its private dir): TMPDIR, as in a fresh interpreter
    drop_inherited_forkserver()
    note_rank_started()
    _dump_stack_on_request()
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    _match_torch_threads()
    redo_reads_at_import()
    job: Optional[RankPayload] = _FORKED_FROM if payload is None else cloudpickle.loads(payload)
    assert job is not None, "a rank started without its payload, and not forked from its job's process"
    # a rank forked from the job's process keeps its OmegaConf resolvers (the body starts without)
    resolvers = BaseContainer._resolvers if payload is None else None  # type: ignore[attr-defined]
    if job.stop_signal is not None:
        signal.signal(job.stop_signal, signal.SIG_IGN)
    fresh_random_state()
    try:
        run_script(job.script, job.overrides)
    except Exception as e:
        _tell_failure(e, script_frames(e.__traceback__, job.script))
        raise
    check_nodes_agree(job.job_num, job.overrides)
    setup_globals()
    _take_hydra_state(job, resolvers)
    rank = int(os.environ.get("RANK", "0"))
    configure_log(rank_log_config(job.job_logging, rank), HydraConfig.get().verbose, **_whitelisted(job))
    _enter_execution_whitelist(job.execution_whitelist)
    task = task_function(job.script, job.pickled_task)
    try:
        value = _returned_by(task, job.task_cfg)
    except BaseException as e:
        if isinstance(e, Exception):
            _tell_failure(e, e.__traceback__.tb_next if e.__traceback__ else None)
        _linger_before_failing(job.failure_grace_s)
        raise
    finally:
        _flush_loggers()
    returned = None
    if os.environ.get("LOCAL_RANK", "0") == "0":
        try:
            returned = cloudpickle.dumps(value)
        except Exception as e:
            raise TypeError(
                f"the task function's return value ({type(value).__name__}) cannot be pickled "
                f"to send it back to the launcher: {e}"
            ) from e
    tell_task_returned()
    return returned


def _returned_by(task: Any, task_cfg: Any) -> Any:
    """The task's value; `sys.exit()` or `sys.exit(0)` in it is a return of None, as a script's
    successful end under torchrun (torch's own wrapper takes `sys.exit(0)` so, not `sys.exit()`,
    whose process would end before the agent has its value)."""
    try:
        return task(task_cfg)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
        return None


def _dump_stack_on_request() -> None:
    """On `DUMP_SIGNAL` this rank writes where each of its threads is to its stderr (the rank's
    log), even when it is stuck in C code: the job's process asks it of the ranks still running
    when it stops them past `job_timeout`, before they are killed."""
    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, RuntimeError, ValueError):
        return  # no usable stderr: the rank is named without its stack
    note_rank_process(dumps=True)


def _tell_failure(error: BaseException, tb: Optional[TracebackType]) -> None:
    """On the rank's stderr, as Python prints it for a script under torchrun (from the
    script's or the task's frame on): the console shows it once, with the rank's prefix;
    and the exception itself, for the job's error (`_rank.carried_exception`); and torch's error file
    where torch cannot write it (an exception whose `__str__` raises)."""
    traceback.print_exception(type(error), error, tb)
    write_rank_exception(error, tb)
    write_torch_error_file(error, tb)


def _whitelisted(job: RankPayload) -> Dict[str, Any]:
    """configure_log's execution whitelist, on a Hydra that takes one (1.4), as run_job passes it."""
    if "execution_whitelist" not in inspect.signature(configure_log).parameters:
        return {}
    return {"execution_whitelist": job.execution_whitelist}


def _enter_execution_whitelist(whitelist: Any) -> None:
    """The task's instantiate() calls checked as in Hydra's run_job (1.4), for the rank's life."""
    try:
        from hydra.utils import execution_whitelist  # type: ignore[attr-defined]
    except ImportError:
        return  # Hydra 1.3: no whitelist
    execution_whitelist(whitelist, reset=True).__enter__()


def _match_torch_threads() -> None:
    """torch was imported (by the warm server) before OMP_NUM_THREADS had its job's value."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def check_nodes_agree(job_num: int, overrides: List[str]) -> None:
    """Refuse to train when the nodes of a multi-node job composed different configs.

    Each node runs the sweep on its own; a sweeper that is not deterministic would let
    node 0 and node 1 run job N with different overrides under one rendezvous. Every rank
    publishes its node's overrides in the job's rendezvous store and compares.
    """
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    from torch.distributed import PrefixStore, TCPStore

    store = PrefixStore(
        f"hydra_torchrun/overrides/{os.environ['TORCHELASTIC_RUN_ID']}/"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
        TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=_NODES_AGREE_TIMEOUT,
        ),
    )
    mine = " ".join(overrides)
    store.set(os.environ["GROUP_RANK"], mine)
    keys = [str(node) for node in range(nodes)]
    store.wait(keys)
    seen = {node: store.get(key).decode() for node, key in enumerate(keys)}
    if len(set(seen.values())) > 1:
        listing = "; ".join(f"node {node}: [{text}]" for node, text in seen.items())
        raise RuntimeError(f"nodes disagree on the overrides of job {job_num}: {listing}")


def rank_log_config(job_logging: Optional[Dict[str, Any]], rank: int) -> Optional[DictConfig]:
    """Rank 0 logs to the job's `<job_name>.log`; rank N to `<job_name>_rank<N>.log` beside it.

    Ranks sharing one file would interleave and, with rotation, clobber each other.
    `job_logging` comes resolved from the launcher, so no rank parses interpolations.
    """
    if job_logging is None:
        return None
    config = copy.deepcopy(job_logging)
    if rank != 0:
        for handler in (config.get("handlers") or {}).values():
            if isinstance(handler, dict) and handler.get("filename"):
                path = Path(handler["filename"])
                handler["filename"] = str(path.with_name(f"{path.stem}_rank{rank}{path.suffix}"))
    return OmegaConf.create(config)


def _take_hydra_state(job: RankPayload, resolvers: Optional[Dict[str, Any]]) -> None:
    """Hydra's Singleton state as the job's world has it. A rank forked from the job's
    process has it in memory, but for the resolvers its script's body started without
    (`resolvers`: put back). Others take it from the payload."""
    if resolvers is None:
        Singleton.set_state(hydra_state(job))
        return
    BaseContainer._resolvers = resolvers  # type: ignore[attr-defined]
    if job.pickled_hydra_config:  # a node that writes no `.hydra/`: its ranks see the first node's
        HydraConfig.instance().cfg = cloudpickle.loads(job.pickled_hydra_config).cfg


def hydra_state(payload: RankPayload) -> Dict[str, Any]:
    """Hydra's Singleton state as the job's world has it: the launch's, with the job's
    HydraConfig in its place (`RankPayload.pickled_hydra_config`), and the plugin scan."""
    state = cloudpickle.loads(payload.pickled_state)
    if payload.pickled_hydra_config and isinstance(state, dict) and isinstance(state.get("instances"), dict):
        state = {
            **state,
            "instances": {**state["instances"], HydraConfig: cloudpickle.loads(payload.pickled_hydra_config)},
        }
    return with_scanned_plugins(state)


def with_scanned_plugins(state: Dict[str, Any]) -> Dict[str, Any]:
    """Hydra's state, plus the warm server's plugin scan when this process would scan the same.

    `Singleton.set_state` rescans every plugin module unless the state holds a Plugins
    instance; Hydra leaves it out of the pickled state on purpose. The scan is the same when
    it walks the same folders: `hydra_plugins.__path__` follows `sys.path`, which may name a
    folder twice (an editable install's entry and the app's own) or by another path.
    """
    server = sys.modules.get("hydra_plugins.hydra_torchrun_launcher._server.server")
    hydra_plugins = sys.modules.get("hydra_plugins")
    if server is None or server.PLUGINS is None or hydra_plugins is None or "instances" not in state:
        return state
    if scanned_folders(getattr(hydra_plugins, "__path__", [])) != server.SCANNED_FOLDERS:
        return state
    from hydra.core.plugins import Plugins

    return {**state, "instances": {**state["instances"], Plugins: server.PLUGINS}}


def scanned_folders(path: Iterable[str]) -> List[str]:
    """The folders a plugin scan of a namespace package's `__path__` walks, each once, in order."""
    return list(dict.fromkeys(os.path.realpath(entry) for entry in path))


class _StoppedLingering(BaseException):
    pass


def _stop_lingering(signum: int, frame: Any) -> None:
    raise _StoppedLingering()


def _linger_before_failing(grace_s: float) -> None:
    """Keep a failing rank's process alive for `grace_s` (two of the agent's polls).

    Peers see a rank fail only when its process exits (their collectives break on the
    closed connection) and then fail too, within milliseconds; the agent, polling every
    `monitor_interval`, names the lowest rank among those it finds dead. Each failing rank
    lingering alike keeps the one that failed first dead alone at the agent's next poll,
    so the job's error is the root cause, not a peer's "connection reset".

    The agent's signal (another rank was found dead first, or the job is stopped) ends the
    wait: the rank then exits as it would have, with its own failure (its error file
    written), so the job's error names it too ("also failed"), not as a survivor stopped.
    """
    if grace_s <= 0 or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    stops = [sig for sig in group_signals() if signal.getsignal(sig) != signal.SIG_IGN]
    try:
        previous = {sig: signal.signal(sig, _stop_lingering) for sig in stops}
    except (ValueError, OSError):  # not the main thread: the plain wait
        time.sleep(grace_s)
        return

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    try:
        try:
            time.sleep(grace_s)
        finally:
            restore()
    except _StoppedLingering:  # (also when it came as the wait ended)
        restore()
