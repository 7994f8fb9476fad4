"""Keywords routed onto the tree: ``LLMQTrainer(settings, **overrides)``, config files and tests name a setting by
its field name (``batch_size=2``), and the old boolean spellings by theirs (``shard_weights=True`` is
``zero_level=3``, ``persistent_quants=True`` is ``fp8_weight_copies="persistent"``). An unknown keyword is
refused in one sentence naming the closest setting, as the command line does for a misspelt flag.
"""

from __future__ import annotations

import copy

from llmq_ray.errors import ConfigError
from llmq_ray.settings.fields import check_type, closest, plain_path
from llmq_ray.settings.tree import RunSettings


def apply_overrides(settings: RunSettings | None, overrides: dict, *, who: str = "LLMQTrainer") -> RunSettings:
    """A copy of ``settings`` (default: ``RunSettings()``) with every keyword of ``overrides`` set on its field.
    Values are type-checked (``fields.check_type``); paths may be ``pathlib`` paths. Aliases are applied after
    the plain keywords, in the order given; an ``at_least`` alias only ever raises its setting."""
    from llmq_ray.settings import aliases, by_name

    if settings is not None and not isinstance(settings, RunSettings):
        raise ConfigError(f"{who}(settings=...) takes a RunSettings (llmq_ray.settings), not "
                          f"{type(settings).__name__}; pass single settings as keywords.")
    out = copy.deepcopy(settings) if settings is not None else RunSettings()
    known, old = by_name(), aliases()
    later = []
    for key, value in overrides.items():
        value = plain_path(value)
        if key in known:
            s = known[key]
            check_type(s, value)
            setattr(getattr(out, s.section), s.name, value)
        elif key in old:
            later.append((key, value))
        else:
            valid = list(known) + list(old)
            raise ConfigError(f"{who} got an unknown setting {key!r}{closest(key, valid)}; the settings are the "
                              f"fields of llmq_ray/settings/tree.py (`python examples/train.py --help` lists them).")
    for key, value in later:
        s, on, off = old[key]
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"--{key.replace('_', '-')}={value!r} must be True or False, not {type(value).__name__}.")
        new = on if value else off
        if new is None:
            continue
        section = getattr(out, s.section)
        if s.meta["at_least"]:
            new = max(getattr(section, s.name), new)
        setattr(section, s.name, new)
    return out


def flat(settings: RunSettings) -> dict:
    """{field name: value} of every setting of ``settings`` (for the log's options record, W&B and
    ``--print-config``)."""
    from llmq_ray.settings import all_settings

    return {s.name: getattr(getattr(settings, s.section), s.name) for s in all_settings()}
