"""The sweep's record at any number of jobs: a journal line per job event, a summary that lags
it by a few seconds at most and is always whole, a table that shows what varies.

The report is driven here as the launcher drives it (`launching`, `started`, `ended`,
`log_table`), without ranks: what it writes, and what a resumed run reads back
(`read_record`), are compared line by line. Real sweeps (a reader polling the summary, a
launcher killed with -9) are in `test_record.py`, the terminal in `test_console.py`.
"""

import json
import logging
import re
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence

import pytest
from hydra.core.utils import JobReturn, JobStatus

from hydra_plugins.hydra_torchrun_launcher._launcher import report as report_module
from hydra_plugins.hydra_torchrun_launcher._launcher.journal import JOURNAL_FILE, read_journal
from hydra_plugins.hydra_torchrun_launcher._launcher.report import (
    COMPLETED,
    FAILED,
    SUMMARY_FILE,
    SweepReport,
)
from hydra_plugins.hydra_torchrun_launcher._launcher.resume import read_record


def _plans(sweep_dir: Path, nums: range, *fixed: str) -> List[Any]:
    return [
        SimpleNamespace(
            idx=num,
            overrides=[*fixed, f"lr={num / 10}"],
            output_dir=sweep_dir / str(num),
            fingerprint=f"fp{num}",
        )
        for num in nums
    ]


def _returned(value: Any) -> JobReturn:
    job_return = JobReturn(status=JobStatus.COMPLETED)
    job_return.return_value = value
    return job_return


def _failed(error: BaseException) -> JobReturn:
    job_return = JobReturn(status=JobStatus.FAILED)
    job_return.return_value = error
    return job_return


def _run(report: SweepReport, plans: List[Any], fail: Sequence[int] = ()) -> None:
    report.launching(plans)
    for plan in plans:
        report.started(plan.idx, line=f"\t#{plan.idx}")
        if plan.idx in fail:
            report.ended(plan.idx, _failed(ValueError(f"lr={plan.idx / 10} diverged")), FAILED)
        else:
            report.ended(plan.idx, _returned(plan.idx * 2), COMPLETED)


def _summary(sweep_dir: Path) -> Dict[str, Any]:
    return json.loads((sweep_dir / SUMMARY_FILE).read_text())


def _as_summary(sweep_dir: Path) -> Dict[str, Any]:
    """The record a resumed run reads, as the summary file writes it."""
    record = read_record(sweep_dir)
    written: Dict[str, Any] = {"jobs": [asdict(record.jobs[num]) for num in sorted(record.jobs)]}
    if record.interrupted:
        written["interrupted"] = True
    return written


def test_every_event_is_one_journal_line_and_the_record_read_back_is_the_summary(tmp_path: Path) -> None:
    report = SweepReport(tmp_path)
    _run(report, _plans(tmp_path, range(5)), fail=[3])
    report.log_table()
    lines = (tmp_path / JOURNAL_FILE).read_text().splitlines()
    # the format, the launch (5 rows), then a start and an end per job
    assert json.loads(lines[0]) == {"journal": 1}
    assert len(lines) == 1 + 5 + 2 * 5, lines
    assert _as_summary(tmp_path) == _summary(tmp_path)
    assert [job["status"] for job in _summary(tmp_path)["jobs"]] == [COMPLETED] * 3 + [FAILED, COMPLETED]

    # stopped between a sweeper's batches: one more line, and the summary says it too
    report.interrupted = True
    report.write()
    assert len((tmp_path / JOURNAL_FILE).read_text().splitlines()) == len(lines) + 1
    assert _summary(tmp_path)["interrupted"] is True
    assert read_record(tmp_path).interrupted and _as_summary(tmp_path) == _summary(tmp_path)


def test_a_sweepers_later_batch_adds_to_the_journal_and_a_new_run_starts_it_afresh(tmp_path: Path) -> None:
    report = SweepReport(tmp_path)
    _run(report, _plans(tmp_path, range(0, 2)))
    _run(report, _plans(tmp_path, range(2, 4)))
    assert sorted(read_record(tmp_path).jobs) == [0, 1, 2, 3]
    assert _as_summary(tmp_path) == _summary(tmp_path)

    # another run in the same sweep dir (another sweep, or a finished one run again): its
    # first event replaces the journal whole, no row of the earlier run is left in it
    again = SweepReport(tmp_path)
    again.launching(_plans(tmp_path, range(0, 1), "x=1"))
    assert sorted(read_record(tmp_path).jobs) == [0]
    assert read_record(tmp_path).jobs[0].overrides == ["x=1", "lr=0.0"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial file left


def test_a_cut_last_line_is_left_out_and_a_bad_line_before_it_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    report = SweepReport(tmp_path)
    _run(report, _plans(tmp_path, range(3)))
    journal = tmp_path / JOURNAL_FILE
    whole = journal.read_bytes()
    before = _as_summary(tmp_path)

    # a launcher killed with -9 as it wrote a line (or a node that lost power: zeros)
    for torn in (b'{"job": {"num": 1, "overrides": ["lr=0', b"\0\0\0\0", b"   "):
        journal.write_bytes(whole + torn)
        assert _as_summary(tmp_path) == before, torn
    # a whole last line that lost only its newline counts
    *rest, last = whole.rstrip(b"\n").split(b"\n")
    journal.write_bytes(whole.rstrip(b"\n"))
    assert _as_summary(tmp_path) == before

    # anything else: nothing is resumed from it, in one line naming the journal
    journal.write_bytes(b"\n".join([*rest[:2], b"{garbled", *rest[2:], last, b""]))
    caplog.clear()  # what the cases above logged is theirs
    with caplog.at_level(logging.WARNING):
        assert read_record(tmp_path).jobs == {}
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said.startswith(f"{journal} cannot be read as this launcher's record (ValueError: line 3: "), said
    assert said.endswith("nothing is resumed from it, every job runs and the record starts afresh"), said
    with pytest.raises(ValueError, match="first line"):
        journal.write_bytes(b'{"not": "a journal"}\n')
        read_journal(journal)


def test_without_a_journal_the_summary_an_earlier_version_wrote_is_the_record(tmp_path: Path) -> None:
    report = SweepReport(tmp_path)
    _run(report, _plans(tmp_path, range(3)), fail=[1])
    report.interrupted = True
    report.write()
    written = _summary(tmp_path)
    (tmp_path / JOURNAL_FILE).unlink()
    assert _as_summary(tmp_path) == written


def test_the_summary_is_rewritten_every_few_seconds_and_whole_at_the_launchs_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report_module, "SUMMARY_INTERVAL_S", 0.5)
    rewrites = []
    original = report_module.replace_whole

    def counted(path: Path, data: bytes, mode: int = 0o666) -> None:
        if path.name == SUMMARY_FILE:
            rewrites.append(json.loads(data))
        original(path, data, mode)

    monkeypatch.setattr(report_module, "replace_whole", counted)
    report = SweepReport(tmp_path)
    plans = _plans(tmp_path, range(50))
    report.launching(plans)
    for plan in plans[:49]:
        report.started(plan.idx)
        report.ended(plan.idx, _returned(plan.idx), COMPLETED)
    # a hundred events in a moment: the summary was written at the launch, not since
    assert len(rewrites) == 1
    # nothing happens for a while: the timer writes what the summary lacked
    deadline = time.monotonic() + 5
    while len(rewrites) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(rewrites) == 2 and rewrites[1] == _as_summary(tmp_path)
    # from here on an event waits for the timer however slow this machine is, but the last
    monkeypatch.setattr(report_module, "SUMMARY_INTERVAL_S", 3600.0)
    report.started(49)
    assert len(rewrites) == 2
    report.ended(49, _returned(49), COMPLETED)  # the launch's last job: at once
    assert len(rewrites) == 3 and rewrites[2] == _as_summary(tmp_path) == _summary(tmp_path)
    # and the timer that waited for the started job's event is gone with it
    assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer)]
    assert [job["status"] for job in rewrites[2]["jobs"]] == [COMPLETED] * 50


def test_a_node_that_does_not_keep_the_record_writes_nothing(tmp_path: Path) -> None:
    report = SweepReport(tmp_path)
    report.writes = False
    _run(report, _plans(tmp_path, range(2)))
    report.log_table()
    assert not list(tmp_path.iterdir())


def _table(caplog: pytest.LogCaptureFixture) -> List[str]:
    (message,) = [r.getMessage() for r in caplog.records if re.match(r"\d+ jobs?: ", r.getMessage())]
    return message.splitlines()


def test_the_tables_overrides_column_shows_what_varies_and_one_line_what_every_job_has(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fixed = ("model=gpt2-with-a-long-name", "trainer.max_epochs=100", "data.root=/datasets/shakespeare")
    report = SweepReport(tmp_path)
    with caplog.at_level(logging.INFO):
        _run(report, _plans(tmp_path, range(3), *fixed))
        report.log_table()
    table = _table(caplog)
    assert table[1].split() == ["#", "status", "time", "overrides", "result", "job", "dir"]
    # the swept key, not cut off behind 60 characters of fixed overrides
    assert [row.split()[3] for row in table[2:5]] == ["lr=0.0", "lr=0.1", "lr=0.2"], table
    assert table[5] == f"overrides every job has: {' '.join(fixed)}", table
    assert not (tmp_path / report_module.TABLE_FILE).exists()


def test_a_large_launchs_table_lists_the_jobs_that_did_not_complete_and_the_file_has_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    report = SweepReport(tmp_path)
    with caplog.at_level(logging.INFO):
        _run(report, _plans(tmp_path, range(30), "seed=1"), fail=[4, 17])
        report.log_table()
    table = _table(caplog)
    assert table[0].startswith("30 jobs: 28 completed, 2 failed (summary: "), table
    listed = "below, the 2 that did not complete"
    assert table[1] == f"every job's row is in {tmp_path / 'sweep_table.txt'}; {listed}", table
    assert [row.split()[:2] for row in table[3:5]] == [["4", "FAILED"], ["17", "FAILED"]], table
    assert "lr=0.4" in table[3] and "lr=0.4 diverged" in table[3], table
    assert table[5:] == ["overrides every job has: seed=1"], table
    full = (tmp_path / "sweep_table.txt").read_text().splitlines()
    assert len(full) == 1 + 30 + 1 and full[-1] == "overrides every job has: seed=1", full
    assert [row.split()[0] for row in full[1:31]] == [str(num) for num in range(30)]


def test_a_one_job_launch_shows_its_overrides(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    report = SweepReport(tmp_path)
    with caplog.at_level(logging.INFO):
        _run(report, _plans(tmp_path, range(1), "seed=1"))
        report.log_table()
    table = _table(caplog)
    assert table[2].split()[3:5] == ["seed=1", "lr=0.0"] and len(table) == 3, table


def test_off_a_terminal_each_job_starts_and_ends_on_a_line_of_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    report = SweepReport(tmp_path)
    with caplog.at_level(logging.INFO):
        _run(report, _plans(tmp_path, range(2)))
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "\t#0" and said[1].startswith("job 1 of 2 ended: #0 : lr=0.0 : COMPLETED in "), said
    assert said[2] == "\t#1" and said[3].startswith("job 2 of 2 ended: #1 : lr=0.1 : COMPLETED in "), said
    assert not report_module.on_a_terminal(report_module.log)
