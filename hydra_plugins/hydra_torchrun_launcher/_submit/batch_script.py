"""The batch script of one array of sweep jobs: what `dry_run` prints and sbatch gets.

One task per node (`srun --ntasks-per-node=1`), each running `_submit.node`, which runs
the job's own process there (`_job.process`: Hydra's run_job on node 0, torch's elastic
agent on every node). The script holds no config value in a shell line: the directives
are `#SBATCH` comments SLURM parses, their values shell-quoted as submitit writes them
(sbatch reads them with the shell's quoting: a space, a quote or a `#` stays in the value),
the paths are absolute (a `setup` line or `--chdir` that changes the working dir changes
nothing) and quoted, and only `setup` (shell lines the user wrote for this purpose, as
with submitit) is shell.
"""

import shlex
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from .files import output_pattern
from .options import SlurmOptions

NODE_MAIN = "hydra_plugins.hydra_torchrun_launcher._submit.node"


def array_spec(jobs: List[int], parallelism: int) -> str:
    """`--array` of these job numbers, at most `parallelism` at once."""
    spec = ",".join(str(idx) for idx in jobs)
    return f"{spec}%{parallelism}" if parallelism < len(jobs) else spec


def batch_script(options: SlurmOptions, jobs: List[int], directory: Path, sweep_dir: str) -> str:
    """The script: directives, the user's `setup`, then srun of the node entry."""
    directory = directory.absolute()
    sweep_dir = str(Path(sweep_dir).absolute())
    listed = ", ".join(f"#{idx}" for idx in jobs)
    directives: List[Tuple[str, Optional[str]]] = [
        *options.directives,
        ("array", array_spec(jobs, options.array_parallelism)),
        ("output", output_pattern(directory)),
        ("open-mode", "append"),
        ("requeue", None),
    ]
    if options.signal_delay_s > 0:
        directives.append(("signal", f"USR2@{options.signal_delay_s}"))
    srun = [
        "srun",
        "--ntasks-per-node=1",
        f"--nodes={options.nodes}",
        # a node whose rank failed ends non-zero: the other nodes' ranks are stopped with it
        "--kill-on-bad-exit=1",
        *options.srun_args,
        sys.executable,
        "-u",
        "-m",
        NODE_MAIN,
        str(directory),
        str(options.signal_delay_s),
        str(options.max_num_timeout),
    ]
    lines = [
        "#!/bin/bash",
        f"# hydra-torchrun-launcher: job(s) {listed} of the sweep in {sweep_dir}".replace("\n", " "),
        *(_directive(key, value) for key, value in directives),
        *options.setup,
        f"exec {shlex.join(srun)}",
        "",
    ]
    return "\n".join(lines)


def _directive(key: str, value: Optional[str]) -> str:
    """`#SBATCH --key=value`, the value quoted as submitit quotes it; None: a bare flag."""
    return f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={shlex.quote(value)}"
