"""The settings of a run: one tree of dataclasses (``tree``), what a field is (``fields``), the machine's "auto"
values (``defaults``), every rule between fields (``rules``) and the routing of keywords onto fields
(``overrides``). A leaf of the package: it imports neither torch nor Ray, nor anything above it.

    from llmq_ray.settings import make_settings
    s = make_settings(model="tiny", batch_size=2, zero_level=3)   # RunSettings, keywords routed by name
    s.data.batch_size, s.parallel.zero_level
"""

from __future__ import annotations

from llmq_ray.settings.fields import AUTO, Setting, check_range, check_type, closest, flatten, plain_path, setting
from llmq_ray.settings.tree import (CheckpointSettings, DataSettings, MemorySettings, ModelSettings, NumericsSettings,
                                    ObserveSettings, OptimSettings, ParallelSettings, RunSettings,
                                    SpeedSettings, sections)

__all__ = ["AUTO", "RunSettings", "Setting", "all_settings", "by_name", "sections", "setting",
           "check_types", "plain_path", "closest", "make_settings", "aliases", "ModelSettings", "DataSettings",
           "OptimSettings", "NumericsSettings", "MemorySettings", "SpeedSettings", "ParallelSettings",
           "CheckpointSettings", "ObserveSettings"]


def all_settings() -> list[Setting]:
    """Every setting of the tree, section by section."""
    return flatten(RunSettings)


def by_name() -> dict[str, Setting]:
    return {s.name: s for s in all_settings()}


def aliases() -> dict[str, tuple[Setting, object, object]]:
    """{old keyword: (the setting it maps onto, value when True, value when False)} (``--persistent-quants``)."""
    return {old: (s, on, off) for s in all_settings() for old, (on, off) in s.meta["aliases"].items()}


def check_types(values: dict) -> None:
    """ConfigError (one sentence naming the flag) for a value of the wrong type or outside its choices, for
    every key of ``values`` that is a setting (aliases take True or False); other keys are ignored."""
    from llmq_ray.errors import ConfigError

    known, old = by_name(), aliases()
    for name, value in values.items():
        if name in known:
            check_type(known[name], value)
        elif name in old and value is not None and not isinstance(value, bool):
            raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be True or False, not "
                              f"{type(value).__name__}.")


def make_settings(settings: RunSettings | None = None, **overrides) -> RunSettings:
    """``settings`` (default: the tree's defaults) with ``overrides`` routed onto their fields by name; see
    llmq_ray/settings/overrides.py."""
    from llmq_ray.settings.overrides import apply_overrides

    return apply_overrides(settings, overrides)
