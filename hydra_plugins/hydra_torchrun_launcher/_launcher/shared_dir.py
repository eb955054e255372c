"""Nodes that share one sweep dir: node 0 decides what to resume, the others take its word.

Every node of a multi-node sweep may use one sweep dir on a shared filesystem. Node 0 (the
launcher holding the dir's first lock, `_launcher.lock`) keeps the record; a node that reads
the record itself could read the one node 0 is writing for this very run (its jobs not
started yet) instead of the earlier run's, and decide otherwise. So node 0 publishes its
decision (which jobs come from the record, which continue preempted, whether the nodes must
agree) in a file of the sweep dir, marked with its lock's holder, before any job starts; the
other nodes wait for the decision of the node 0 that holds the lock now, and take it.
"""

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from .._shared.config_error import LauncherConfigError
from .._shared.paths import shown_path
from .durable import replace_whole
from .report import JobOutcome
from .resume import Resumption, job_dir_of, load_return

DECISION_FILE = ".torchrun_launcher.resume.json"
_POLL_S = 0.05


def publish_decision(sweep_dir: Path, holder: str, jobs: List[int], found: Resumption, asks: bool) -> None:
    """Node 0's decision for the launch of `jobs`; `asks`: it will ask the nodes to agree."""
    decision = {
        "holder": holder,
        "jobs": jobs,
        "completed": sorted(found.completed),
        "preempted": sorted(found.preempted),
        "recorded": {str(num): asdict(outcome) for num, outcome in found.recorded.items()},
        "asks": asks,
    }
    replace_whole(sweep_dir / DECISION_FILE, json.dumps(decision).encode())


def take_decision(
    sweep_dir: Path, holder: str, jobs: List[int], timeout_s: float
) -> "tuple[Resumption, bool]":
    """The decision of node 0 (`holder`) for the launch of `jobs`, once it is published (at
    most `timeout_s`; the caller's stop handling may end the wait): what is resumed, with
    the JobReturns of the completed jobs from the record; and whether the nodes agree."""
    path = sweep_dir / DECISION_FILE
    deadline = time.monotonic() + timeout_s
    decision = _read(path, holder, jobs)
    while decision is None:
        if time.monotonic() > deadline:
            raise LauncherConfigError(
                f"node 0 of the sweep in {shown_path(str(sweep_dir))} ({holder}) did not say what to "
                f"resume within {timeout_s:g}s ({shown_path(str(path))})"
            )
        time.sleep(_POLL_S)
        decision = _read(path, holder, jobs)
    found = Resumption()
    found.recorded = {int(num): JobOutcome(**row) for num, row in decision["recorded"].items()}
    found.preempted = set(decision["preempted"])
    for num in decision["completed"]:
        returned = load_return(job_dir_of(sweep_dir, found.recorded[num]), num)
        if returned is None:
            raise LauncherConfigError(
                f"job #{num} comes from the record on node 0 but not here: this node cannot read its "
                f"JobReturn in {shown_path(str(sweep_dir))}; the nodes must share the sweep dir's files"
            )
        found.completed[num] = returned
    return found, bool(decision["asks"])


def _read(path: Path, holder: str, jobs: List[int]) -> Optional[dict]:
    """The decision in `path` when it is that of `holder` for `jobs`; None while it is not."""
    try:
        decision = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # not written yet (it is replaced whole)
        return None
    if decision.get("holder") != holder or decision.get("jobs") != jobs:
        return None
    return decision
