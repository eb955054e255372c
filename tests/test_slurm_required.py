"""Whether the real-SLURM tests run, skip or fail: decided without starting a cluster.

`tests/test_slurm.py` needs root and SLURM; where they are missing its tests skip, saying
why (`-rs`), except in CI's default job (`REQUIRE_SLURM=1`), where that is a failure: a
skip there would hide that the SLURM tests never ran.
"""

import configparser
import sys
from pathlib import Path

import pytest

from tests.slurm_cluster import REQUIRE_ENV, skip_or_fail

ROOT = Path(__file__).parent.parent
REASON = "a SLURM cluster needs root (network namespaces, daemons)"


def test_a_cluster_that_cannot_run_skips_saying_why() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"^a SLURM cluster needs root"):
        skip_or_fail(REASON, environ={})
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail(REASON, environ={REQUIRE_ENV: "0"})


def test_a_cluster_that_cannot_run_fails_where_slurm_is_required() -> None:
    # BaseException: a skip escaping here would report this test skipped, not failed
    with pytest.raises(BaseException) as stopped:
        skip_or_fail(REASON, environ={REQUIRE_ENV: "1"})
    assert stopped.type is pytest.fail.Exception, stopped
    assert str(stopped.value) == f"REQUIRE_SLURM=1, but no SLURM cluster can run here: {REASON}"


def test_a_cluster_that_can_run_neither_skips_nor_fails() -> None:
    skip_or_fail(None, environ={REQUIRE_ENV: "1"})
    skip_or_fail(None, environ={})


def test_only_cis_default_job_requires_slurm_and_skips_are_reported() -> None:
    commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    # the default job's pytest (the one right after the README's install), and no other
    requiring = [line for line in commands if REQUIRE_ENV in line]
    assert requiring == [f"{REQUIRE_ENV}=1 python -m pytest"], requiring
    pytest_runs = [line for line in commands if "-m pytest" in line]
    assert pytest_runs[0] == requiring[0], pytest_runs
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    assert "-rs" in ini["pytest"]["addopts"].split()


def test_the_requeue_benchmark_reads_the_round_trip_from_node_0s_output() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import slurm_requeue
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    output = (
        "[2026-11-23 12:57:17,932][HYDRA] job 2 of 3 ended: #1 : lr=0.2 : PREEMPTED in 1.23s: ...\n"
        "[torchrun launcher] SIGUSR2: the sweep was preempted: ... SLURM job 7 is requeued\n"
        "[2026-11-23 12:57:21,432][HYDRA] Resuming the sweep in multirun/7/node1: ...\n"
        "[2026-11-23 12:57:22,182][HYDRA] Resuming the sweep in multirun/7/node0: ...\n"
    )
    assert slurm_requeue.round_trip_s(output) == pytest.approx(4.25)
    assert slurm_requeue.round_trip_s(output.split("[torchrun")[0]) is None
