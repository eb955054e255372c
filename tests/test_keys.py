"""Each launcher key is described once, by its field in config.py (`_key`): what the rest of the
package reads of it (the torchrun flag, the fingerprint, the LaunchConfig field, the SLURM
launcher's keys) is derived from that description, and the description agrees with torch."""

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf
from torch.distributed.run import get_args_parser

from hydra_plugins.hydra_torchrun_launcher._launcher.resume import fingerprint
from hydra_plugins.hydra_torchrun_launcher.config import (
    SLURM_KEYS,
    SSH_KEYS,
    TORCHRUN_FLAGS,
    PerJobConf,
    TorchrunLauncherConf,
    TorchrunSlurmLauncherConf,
    TorchrunSshLauncherConf,
    described,
)

KEYS = [f.name for f in dataclasses.fields(TorchrunLauncherConf) if f.name != "_target_"]


def test_every_key_says_whether_it_changes_what_a_job_computes_and_whether_a_job_has_it_alone() -> None:
    assert set(described("fingerprinted")) == set(KEYS)
    assert set(described("per_job")) == set(KEYS)
    assert set(described("pet")) == set(TORCHRUN_FLAGS)


def test_each_keys_torchrun_flag_is_the_installed_torchruns_own() -> None:
    """The flag the dry run's torchrun line gives a key is the one torchrun has for it (a
    torchrun newer than the installed one may have keys this one lacks)."""
    for action in get_args_parser()._actions:
        if action.dest not in TORCHRUN_FLAGS:
            continue
        flag = TORCHRUN_FLAGS[action.dest]
        assert flag in action.option_strings or (not action.option_strings and flag == action.dest), (
            action.dest,
            flag,
            action.option_strings,
        )


def _launcher_part(conf: TorchrunLauncherConf) -> str:
    """The fingerprint's part that the launcher's settings make."""
    return fingerprint("task", OmegaConf.create({"lr": 0.1}), conf, {}).split("-")[2]


@pytest.mark.parametrize("key", KEYS)
def test_a_key_counts_in_the_fingerprint_exactly_when_it_changes_what_a_job_computes(key: str) -> None:
    changed = dataclasses.replace(TorchrunLauncherConf(), **{key: "another value"})
    assert (_launcher_part(changed) != _launcher_part(TorchrunLauncherConf())) == described("fingerprinted")[
        key
    ]


def test_the_default_settings_fingerprint_as_in_earlier_releases() -> None:
    """A sweep recorded by an earlier release resumes: the same settings, the same fingerprint.
    A new key that changes what a job computes changes it (every earlier record then reads as
    another sweep): say so in the release notes, then update the value here."""
    assert _launcher_part(TorchrunLauncherConf()) == "b22492ce"


@pytest.mark.parametrize("conf", PerJobConf.__subclasses__(), ids=lambda conf: conf.__name__)
def test_every_other_launcher_has_every_per_job_key_as_the_torchrun_launcher(conf: type) -> None:
    """hydra/launcher=torchrun_slurm (and any launcher built on PerJobConf): the torchrun
    launcher's per-job keys, in its order, with its defaults, types and descriptions."""
    per_job = [key for key, alone in described("per_job").items() if alone]
    fields = {f.name: f for f in dataclasses.fields(conf)}
    assert [key for key in fields if key in per_job] == per_job
    local, other = dataclasses.asdict(TorchrunLauncherConf()), dataclasses.asdict(conf())
    assert {key: other[key] for key in per_job} == {key: local[key] for key in per_job}
    hints, other_hints = typing.get_type_hints(TorchrunLauncherConf), typing.get_type_hints(conf)
    assert {key: other_hints[key] for key in per_job} == {key: hints[key] for key in per_job}
    described_here = {f.name: f.metadata for f in dataclasses.fields(TorchrunLauncherConf)}
    assert {key: dict(fields[key].metadata) for key in per_job} == {
        key: dict(described_here[key]) for key in per_job
    }
    assert conf().launch_prefix is not conf().launch_prefix  # each instance its own lists


def test_the_slurm_launcher_has_submitits_keys_first_then_the_per_job_keys() -> None:
    names = [f.name for f in dataclasses.fields(TorchrunSlurmLauncherConf)]
    per_job = [key for key, alone in described("per_job").items() if alone]
    assert names[: 1 + len(SLURM_KEYS) + len(per_job)] == ["_target_", *SLURM_KEYS, *per_job]
    assert TorchrunSlurmLauncherConf._target_.endswith(".TorchrunSlurmLauncher")


def test_the_ssh_launcher_has_its_hosts_keys_first_then_the_per_job_keys() -> None:
    names = [f.name for f in dataclasses.fields(TorchrunSshLauncherConf)]
    per_job = [key for key, alone in described("per_job").items() if alone]
    # then the keys each host's agent has too (what its warm server imports), as described
    assert names == ["_target_", *SSH_KEYS, *per_job, *described("hosts")]
    assert described("hosts") == {"preload": True}
    hosts_keys = {f.name: f for f in dataclasses.fields(TorchrunSshLauncherConf)}
    local_keys = {f.name: f for f in dataclasses.fields(TorchrunLauncherConf)}
    for key in described("hosts"):
        assert getattr(TorchrunSshLauncherConf(), key) == getattr(TorchrunLauncherConf(), key)
        assert dict(hosts_keys[key].metadata) == dict(local_keys[key].metadata)
    assert TorchrunSshLauncherConf._target_.endswith(".TorchrunSshLauncher")


@pytest.mark.parametrize(
    "name, conf",
    [
        ("torchrun", TorchrunLauncherConf),
        ("torchrun_slurm", TorchrunSlurmLauncherConf),
        ("torchrun_ssh", TorchrunSshLauncherConf),
    ],
)
def test_a_launchers_config_is_made_when_hydra_loads_it_from_its_dataclass(name: str, conf: type) -> None:
    """Plugin discovery stores every launcher's config on every run of every app: with the
    installed Hydra it is stored unmade, and what Hydra loads is the dataclass's defaults."""
    from hydra.core.config_store import ConfigStore

    from hydra_plugins.hydra_torchrun_launcher.config import _BuiltWhenLoaded

    store = ConfigStore.instance()
    assert isinstance(store.repo["hydra"]["launcher"][f"{name}.yaml"], _BuiltWhenLoaded)
    loaded = store.load(f"hydra/launcher/{name}.yaml")
    assert loaded.group == "hydra/launcher" and loaded.package is None
    assert OmegaConf.to_container(loaded.node) == dataclasses.asdict(conf())
    # each load is a copy of its own: a change to one never reaches the next
    loaded.node.nproc_per_node = 99
    assert store.load(f"hydra/launcher/{name}.yaml").node.nproc_per_node != 99
