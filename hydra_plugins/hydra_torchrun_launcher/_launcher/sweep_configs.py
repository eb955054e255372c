"""Each job's config as Hydra's `load_sweep_config` composes it, at a tenth of its cost.

Hydra composes a sweep's job from scratch: its defaults list, every config file merged, then
the overrides. The sweeper has just done the same to validate the batch, so a 1000-job
sweep pays composition twice over before its last job starts (about 0.1 s a job on a
trivial app). But the jobs of a grid differ in values only (`lr=0.1` against `lr=0.01`):
same config groups, same keys, same kinds of override. Such a job's config is the config of
an earlier job of the same shape (its *reference*, composed by Hydra) with the overrides
that differ applied again by Hydra's own code, and its override lists made its own.

Anything else is composed by Hydra as before: a job that changes a config group, a dict or
list value, a key Hydra's composition reads or checks (`_COMPOSITION_KEYS`: the launcher's
and sweeper's keys among them), a Hydra without the private functions used here, or any
error (which Hydra's path then reports in its own words). The second job of each shape is composed both
ways and compared: on any difference (another Hydra's composition, a config the rules above
miss), every later job is composed by Hydra.
"""

import copy
import logging
import pickle
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict

from .._shared.private import lookup

log = logging.getLogger(__name__)

_LOADER = "hydra._internal.config_loader_impl"

# keys whose value Hydra's composition reads after the overrides (env_copy, override_dirname,
# the job's name, the search path, 1.4's aliases), writes itself, or checks against the
# sweep's (1.4 refuses a job that changes its launcher or sweeper)
_COMPOSITION_KEYS = (
    "hydra.job.",
    "hydra.runtime.",
    "hydra.overrides.",
    "hydra.searchpath",
    "hydra.aliases",
    "hydra.launcher.",
    "hydra.sweeper.",
)
# the references kept: one a combination of config groups the sweep chooses
_REFERENCES = 16
# the override lines kept parsed (`SweepConfigs._parsed`)
_PARSED = 4096


def _hydra_internals() -> Optional[Tuple[Any, Any, Any]]:
    """Hydra's override parser, its function that applies value overrides and the one that
    makes `override_dirname` (None in Hydra 1.4, whose `${hydra_override_dirname:}` resolver
    makes it as the job runs), or None where this Hydra lacks one (then Hydra composes every
    job)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
    except ImportError:
        return None
    apply = lookup(_LOADER, "ConfigLoaderImpl._apply_overrides_to_config")
    if apply is None:
        return None
    return OverridesParser.create(), apply, lookup(_LOADER, "get_overrides_dirname")


class SweepConfigs:
    """The configs of one sweep's jobs (`master`: the sweep's config, as Hydra's launchers get it)."""

    def __init__(self, loader: Any, master: DictConfig) -> None:
        self.loader = loader
        self.master = master
        self.hydra_overrides = [str(o) for o in OmegaConf.to_container(master.hydra.overrides.hydra)]
        internals = _hydra_internals()
        repository = getattr(loader, "repository", None)
        self.usable = internals is not None and callable(getattr(repository, "group_exists", None))
        if internals is not None:
            self.parser, self.apply, self.override_dirname = internals
            self.repository = repository
            if self.override_dirname is None and not _resolved_later(master):
                self.usable = False  # made at composition, by a function this Hydra no longer has
        self.references: OrderedDict[tuple, Tuple[List[Any], Callable[[], DictConfig], bool]] = OrderedDict()
        self.groups: Dict[str, bool] = {}
        # each override line parsed once a sweep: a sweep's own lines recur in every job
        self.parsed: Dict[str, Any] = {}

    def compose(self, overrides: List[str]) -> DictConfig:
        """The job's config, equal to `load_sweep_config(master, overrides)`."""
        if not self.usable:
            return self._by_hydra(overrides)
        try:
            parsed = [self._parsed(line) for line in self.hydra_overrides + list(overrides)]
            shape = tuple(self._shape(o) for o in parsed)
        except Exception:  # Hydra's path says what is wrong with it, in its own words
            return self._by_hydra(overrides)
        reference = self.references.get(shape)
        if reference is None:
            config = self._by_hydra(overrides)
            # its own copy: the caller makes the job's config its own (its number, its dir)
            self.references[shape] = (parsed, _copies_of(config), False)
            if len(self.references) > _REFERENCES:
                self.references.popitem(last=False)
            return config
        self.references.move_to_end(shape)
        ref_parsed, ref_copy, checked = reference
        try:
            config = self._from_reference(parsed, ref_parsed, ref_copy())
        except Exception:
            return self._by_hydra(overrides)
        if not checked:
            composed = self._by_hydra(overrides)
            same = OmegaConf.to_yaml(config, resolve=False) == OmegaConf.to_yaml(composed, resolve=False)
            if not same:
                log.debug("a job's config differs from Hydra's composition of it: Hydra composes every job")
                self.usable = False
                return composed
            self.references[shape] = (ref_parsed, ref_copy, True)
        return config

    def _parsed(self, line: str) -> Any:
        """The override `line` as Hydra's parser makes it (Hydra parses each line alone)."""
        parsed = self.parsed.get(line)
        if parsed is None:
            if len(self.parsed) >= _PARSED:
                self.parsed.clear()
            parsed = self.parsed[line] = self.parser.parse_overrides([line])[0]
        return parsed

    def _by_hydra(self, overrides: List[str]) -> DictConfig:
        return self.loader.load_sweep_config(self.master, list(overrides))

    def _shape(self, override: Any) -> tuple:
        """What a job of the same shape has alike: all of an override but a value that may
        be set again on the reference's config."""
        key = override.key_or_group
        line = override.input_line
        if override.package is not None or override.is_delete() or self._is_group(key):
            return (line,)
        if key.startswith("hydra") and any(
            key.startswith(prefix) or key == prefix.rstrip(".") for prefix in _COMPOSITION_KEYS
        ):
            return (line,)
        if not _plain(override.value()):
            return (line,)
        return (override.type, key)

    def _is_group(self, key: str) -> bool:
        if key not in self.groups:
            self.groups[key] = bool(self.repository.group_exists(key))
        return self.groups[key]

    def _from_reference(self, parsed: List[Any], ref_parsed: List[Any], config: DictConfig) -> DictConfig:
        """The job's config from a copy of its reference's (`config`, the job's own now)."""
        changed = []
        for override, ref_override in zip(parsed, ref_parsed):
            if override.input_line == ref_override.input_line:
                continue
            if override.is_add():  # the reference holds the key its `+key=` added: set it again
                override = self._parsed("+" + override.input_line)
            changed.append(override)
        self.apply(changed, config)
        task = [o for o in parsed if not o.is_hydra_override()]
        with open_dict(config.hydra):
            config.hydra.overrides.hydra = [o.input_line for o in parsed if o.is_hydra_override()]
            config.hydra.overrides.task = [o.input_line for o in task]
            if self.override_dirname is not None:
                dirname = config.hydra.job.config.override_dirname
                config.hydra.job.override_dirname = self.override_dirname(
                    overrides=task,
                    kv_sep=dirname.kv_sep,
                    item_sep=dirname.item_sep,
                    exclude_keys=dirname.exclude_keys,
                )
        OmegaConf.copy_cache(from_config=self.master, to_config=config)
        return config


def _copies_of(config: DictConfig) -> Callable[[], DictConfig]:
    """A maker of copies of `config`: unpickled from its bytes, kept once (three times
    faster than `copy.deepcopy`, and the same: OmegaConf's nodes pickle whole, as Hydra's
    launchers send them), or deep copies where it does not pickle."""
    try:
        data = pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # a value only a deep copy takes: copied so
        kept = copy.deepcopy(config)
        return lambda: copy.deepcopy(kept)
    return lambda: pickle.loads(data)


def _plain(value: Any) -> bool:
    """A value that replaces what the key held, whatever it held (a dict or list merges)."""
    return value is None or isinstance(value, (str, int, float, bool))


def _resolved_later(config: DictConfig) -> bool:
    """Whether `hydra.job.override_dirname` is an interpolation (Hydra 1.4's resolver): the
    job's own overrides make it as it runs, nothing to make here."""
    return OmegaConf.is_interpolation(config.hydra.job, "override_dirname")
