"""torchrun's own `PET_<OPTION>` variables, as Kubernetes sets them for every pod.

torchrun reads each of its options from `PET_<OPTION>` when its command line does not give
it (torch/distributed/argparse_util.py, `env` and `check_env`): the command line wins over
the variable, the variable over torchrun's default. Kubeflow's PyTorchJob (v1) and
TrainJob (v2) configure torchrun that way in each pod (PET_NNODES, PET_NPROC_PER_NODE,
PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT; PET_RDZV_* with an elastic policy). The
launcher keeps that precedence: a key the user sets wins over the variable, the variable
over the plugin's default.

Kubeflow v1 also sets RANK (the pod's index) and WORLD_SIZE (pods x processes): they are
not read here, and never reach a rank as its own, since torch's agent sets every rank's.
"""

import dataclasses
import typing
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Tuple

from .._shared.config_error import LauncherConfigError
from .._shared.plan import JobSettings
from .._shared.torchrun_cli import read_from_pet_variables
from ..config import TorchrunLauncherConf, described
from .cluster_layout import Detection
from .settings import checked_settings

# launcher keys that some torchrun (the newest) reads from PET_<KEY>
PET_KEYS: Tuple[str, ...] = tuple(key for key, read in described("pet").items() if read)


def read_here() -> Tuple[str, ...]:
    """The keys of PET_KEYS whose variable the installed torchrun reads: an older torchrun
    ignores a newer one's (PET_SHUTDOWN_TIMEOUT before 2.12, PET_LOG_LINE_PREFIX_TEMPLATE
    before 2.15), and so does the launcher, as a pod image made for a newer torch may set
    them. All of PET_KEYS where torchrun's parser cannot be read."""
    read = read_from_pet_variables()
    return PET_KEYS if read is None else tuple(key for key in PET_KEYS if key in read)


_HINTS = typing.get_type_hints(TorchrunLauncherConf)

# ValuesFound: key -> (variable, its text, the value for the key)
ValuesFound = Dict[str, Tuple[str, str, Any]]


def variable(key: str) -> str:
    return f"PET_{key.upper()}"


def present(environ: Mapping[str, str]) -> Optional[str]:
    """The PET_* variables set here, as a few words, or None."""
    names = [variable(key) for key in PET_KEYS if variable(key) in environ]
    return f"torchrun's {', '.join(names)}" if names else None


def inspect(required: bool, environ: Mapping[str, str]) -> Detection:
    """The PET_* values by launcher key, each converted as torchrun converts it; the ones the
    installed torchrun does not read are ignored, with a note naming them.

    An empty variable is set, as torchrun reads it (an empty role, an int that is not one).
    `required` (cluster: pet): none set is an error.
    """
    values: ValuesFound = {}
    read = read_here()
    for key in read:
        name = variable(key)
        text = environ.get(name)
        if text is not None:
            values[key] = (name, text, _converted(key, name, text))
    unread = [variable(key) for key in PET_KEYS if key not in read and variable(key) in environ]
    note = (
        f"{', '.join(unread)} ignored: the installed torchrun does not read "
        f"{'it' if len(unread) == 1 else 'them'} (a newer one does)"
        if unread
        else None
    )
    if not values:
        if required:
            raise LauncherConfigError(
                "hydra.launcher.cluster=pet needs torchrun's PET_* variables (PET_NNODES, PET_NODE_RANK, "
                "PET_MASTER_ADDR, ... as Kubeflow sets them in each pod): none that the installed torchrun "
                "reads is set"
            )
        return Detection(None, note)
    return Detection(None, note, pet=values)


def resolve(
    settings: JobSettings, values: ValuesFound, environ: Mapping[str, str], user_set: AbstractSet[str]
) -> Tuple[JobSettings, str]:
    """`settings` with the PET_* values for the keys the user left alone, checked; and the line."""
    conf = settings.conf
    default = TorchrunLauncherConf()

    def left_alone(key: str) -> bool:
        return key not in user_set and str(getattr(conf, key)) == str(getattr(default, key))

    taken = {key: value for key, (_, _, value) in values.items() if left_alone(key)}
    for key in taken:  # each value alone against the user's (valid) settings: the error names it
        name, text, _ = values[key]
        try:
            checked_settings(dataclasses.replace(conf, **{key: taken[key]}))
        except LauncherConfigError as e:
            raise LauncherConfigError(f"{name}={text!r}: {e}") from e
    new = dataclasses.replace(conf, **taken)
    try:
        resolved = checked_settings(new)
    except LauncherConfigError as e:
        raise LauncherConfigError(f"with torchrun's PET_* variables: {e}") from e
    _check_meeting_point(resolved, values, taken)
    return resolved, _line(resolved.conf, values, taken, environ)


def _converted(key: str, name: str, text: str) -> Any:
    """The variable's text as the key's value: torchrun's conversion of each option."""
    hint = _HINTS[key]
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    try:
        if base is bool:  # torchrun's check_env: bool(int(value))
            return int(text) != 0
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if typing.get_origin(base) in (list, List):  # torchrun's comma-separated list
            return [item for item in text.split(",") if item]
    except ValueError:
        kind = {bool: "0 or 1", int: "an int", float: "a number"}[base]
        raise LauncherConfigError(
            f"{name}={text!r} is not {kind} (torchrun reads it as --{key.replace('_', '-')})"
        ) from None
    if key in ("nnodes", "nproc_per_node") and text.isdigit():
        return int(text)
    return text


def _check_meeting_point(settings: JobSettings, values: ValuesFound, taken: Dict[str, Any]) -> None:
    """A multi-node world from PET_* must say where the nodes meet; each pod would otherwise
    wait for the others at its own 127.0.0.1 until the rendezvous times out."""
    conf = settings.conf
    if "nnodes" not in taken or settings.max_nodes == 1 or conf.standalone or conf.rdzv_endpoint:
        return
    nodes = f"{values['nnodes'][0]}={values['nnodes'][1]}"
    if conf.rdzv_backend != "static":
        raise LauncherConfigError(
            f"{nodes} with rdzv_backend={conf.rdzv_backend} but no PET_RDZV_ENDPOINT: set it (host:port of "
            f"the rendezvous), or hydra.launcher.rdzv_endpoint"
        )
    missing = [
        variable(key)
        for key in ("master_addr", "master_port")
        if key not in taken and str(getattr(conf, key)) == str(getattr(TorchrunLauncherConf(), key))
    ]
    if missing:
        raise LauncherConfigError(
            f"{nodes} but {' and '.join(missing)} not set: the pods cannot know where to meet; set "
            f"{', '.join(missing)} (or PET_RDZV_ENDPOINT), or hydra.launcher.master_addr/master_port"
        )


def _line(
    conf: TorchrunLauncherConf, values: ValuesFound, taken: Dict[str, Any], environ: Mapping[str, str]
) -> str:
    """One line: the variables found, and for each the setting used (the user's where set)."""
    found = ", ".join(f"{name}={text}" for name, text, _ in values.values())
    used = ", ".join(f"{key}={getattr(conf, key)}" + ("" if key in taken else " (yours)") for key in values)
    line = f"torchrun's PET_* variables {found}: using {used}"
    pod = [f"{name}={environ[name]}" for name in ("RANK", "WORLD_SIZE") if environ.get(name)]
    if pod:
        line += f"; the pod's {', '.join(pod)} are no rank's own (torch's agent sets each rank's)"
    return line
