"""Edges users met: a 2-host job past job_timeout whose first host had ended, torchrun_ssh's
dry run pasted in a shell, a Ctrl-C as a local sweep ends (real processes, real apps, real
sshd hosts)."""

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ssh_hosts import SshHosts
from tests.test_ssh import SWEEP_TIMEOUT_S, _nothing_left, _summary, _sweep, app_dir, hosts, ssh_dry_run  # noqa: F401

pytestmark = pytest.mark.timeout(600)

# ranks on host1 return at once; ranks on host2 keep running until stopped
ASYMMETRIC_APP = """
import socket
import time
import hydra

VERSION_BASE = {} if hasattr(hydra.errors, "Hydra15MigrationWarning") else {"version_base": "1.3"}


@hydra.main(**VERSION_BASE, config_path=".", config_name="config")
def main(cfg):
    if socket.gethostname() == "host1":
        print("host1 rank done", flush=True)
        return 1
    print("host2 rank sleeping", flush=True)
    time.sleep(100)


if __name__ == "__main__":
    main()
"""


def test_a_two_host_job_past_job_timeout_whose_first_host_had_ended_keeps_that_host(
    hosts: SshHosts,  # noqa: F811
    app_dir: Path,  # noqa: F811
) -> None:
    """job_timeout=5 on a 2-host job whose host1 ranks returned while host2's still run: the
    job ended only after 45 s, host1's warm server was SIGKILLed (the agent's traceback on
    the console), host1 was declared lost and the next job failed "it needs 2 host(s)".
    Expected: the job FAILED shortly after 5 s naming host2's ranks, host1 stays usable, the
    next job runs on both hosts."""
    (app_dir / "asym.py").write_text(ASYMMETRIC_APP)
    started = time.monotonic()
    result = _sweep(
        hosts,
        app_dir,
        "hydra.launcher.hosts=[host1,host2]",
        "hydra.launcher.nodes=2",
        "hydra.launcher.nproc_per_node=1",
        "hydra.launcher.job_timeout=5",
        "x=1,2",
        app="asym.py",
    )
    took = time.monotonic() - started
    output = result.stdout + result.stderr
    jobs = _summary(app_dir)
    assert jobs[0]["status"] == "FAILED", output
    assert jobs[0]["error"].startswith("the job ran past hydra.launcher.job_timeout=5s"), jobs[0]
    assert "was lost" not in output, output
    assert "Traceback" not in output.split("Error executing job")[0], output
    # the second job gets both hosts (and times out the same way)
    assert "needs 2 host(s)" not in jobs[1]["error"], jobs[1]
    assert jobs[1]["error"].startswith("the job ran past hydra.launcher.job_timeout=5s"), jobs[1]
    assert took < 90, (took, output)
    _nothing_left(hosts)


def test_the_dry_run_s_agent_line_is_a_pasteable_ssh_command(app_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """The dry run prints `each host's agent: ssh -T -o BatchMode=yes -F /tmp/x y/cfg file
    HOST cd '<dir>' && umask 0022 && exec <python> -m ...`: pasted in a shell, `&&` runs
    `umask` and `exec python -m ...agent` on the local machine (replacing the user's shell),
    ssh gets `cd <dir>` split at its spaces, and the ssh_options `-F` path and
    `-o ProxyCommand=ssh -W %h:%p jump` are split at their spaces. Expected: the remote
    command as one quoted word, each ssh option as one word, as torchrun's line is quoted."""
    config = tmp_path / "cfg dir" / "ssh config"
    output = ssh_dry_run(
        app_dir, f"hydra.launcher.ssh_options=[-F,'{config}',-o,'ProxyCommand=ssh -W %h:%p jump']", "x=1"
    )
    line = next(line for line in output.splitlines() if "each host's agent:" in line)
    words = shlex.split(line.split("each host's agent: ", 1)[1])
    assert words[:3] == ["ssh", "-T", "-o"], words
    assert str(config) in words, words
    assert "ProxyCommand=ssh -W %h:%p jump" in words, words
    # the remote command is one word after HOST: the local shell runs ssh and nothing else
    assert "&&" not in words, words
    assert words[-2] == "HOST" and words[-1].startswith("cd "), words


def _ctrl_c_as_the_sweep_ends(app_dir: Path, sweep: str, delay_s: float) -> "tuple[int, str]":  # noqa: F811
    with subprocess.Popen(
        [
            sys.executable,
            "app.py",
            "--multirun",
            "hydra/launcher=torchrun",
            f"hydra.sweep.dir={sweep}",
            "x=1,2",
        ],
        cwd=app_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        lines = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "job 2 of 2 ended" in line:
                time.sleep(delay_s)
                state = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    process.send_signal(signal.SIGINT)
                    lines.append(f"<<< SIGINT sent, the launcher was in state {state} >>>\n")
        process.wait(timeout=SWEEP_TIMEOUT_S)
    return process.returncode, "".join(lines)


def test_a_ctrl_c_as_a_local_sweep_ends_is_not_swallowed(app_dir: Path) -> None:  # noqa: F811
    """A SIGINT 20-40 ms after `job 2 of 2 ended` (the launcher alive, its table printed or
    being printed) ended the launcher with status 0, saying nothing; a SIGTERM at the same
    moment ends it with -15 (143), and under torchrun_ssh a SIGINT there says "SIGINT: every
    job of the sweep had ended; the launcher ends after its table" and exits 130. Expected:
    130 (or death by SIGINT) whenever the signal reached a live launcher."""
    for n, delay_s in enumerate((0.02, 0.03, 0.04)):
        status, output = _ctrl_c_as_the_sweep_ends(app_dir, f"sweep{n}", delay_s)
        if "SIGINT sent" not in output:
            continue
        assert status in (130, -signal.SIGINT), (delay_s, status, output[-3000:])
