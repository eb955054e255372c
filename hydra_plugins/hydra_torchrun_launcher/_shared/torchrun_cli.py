"""What the installed `torchrun` command line has: its options, and those it reads from
`PET_<OPTION>` variables.

Both change between torch releases (2.8 added `--event-log-handler`, 2.12
`--shutdown-timeout`, 2.15 reads `PET_LOG_LINE_PREFIX_TEMPLATE`), and the launcher must do
what the installed torchrun does: its dry-run line uses only flags that torchrun has, and a
`PET_` variable is taken only where that torchrun would take it. Both are read off
torchrun's own argparse parser; `ArgumentParser._actions` is argparse's private list, so
where it (or torch's `env` actions) is missing the callers fall back as they say.
"""

import functools
import os
from typing import Optional


@functools.cache
def torchrun_options() -> "Optional[frozenset[str]]":
    """The installed torchrun's option strings (`--nproc-per-node`, `--nproc_per_node`, ...);
    None where its parser cannot be read."""
    actions = _actions()
    if actions is None:
        return None
    return frozenset(option for action in actions for option in action.option_strings)


@functools.cache
def read_from_pet_variables() -> "Optional[frozenset[str]]":
    """The destinations (`nproc_per_node`, ...) of the options the installed torchrun reads
    from `PET_<DEST>` when its command line does not give them (torch's `env` and
    `check_env` actions); None where that cannot be read."""
    actions = _actions()
    try:
        from torch.distributed.argparse_util import check_env, env
    except ImportError:
        return None
    if actions is None:
        return None
    return frozenset(action.dest for action in actions if isinstance(action, (env, check_env)))


def _actions() -> "Optional[list]":
    """The parser's actions, built without this environment's PET_* variables: torch's `env`
    actions read them as the parser is built, and one that is not a number where a number is
    meant (PET_STANDALONE=true) raises there; the launcher reads and checks them itself
    (`_launcher.cluster_pet`), naming the variable."""
    from torch.distributed.run import get_args_parser

    hidden = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("PET_")}
    try:
        return getattr(get_args_parser(), "_actions", None)
    finally:
        os.environ.update(hidden)
