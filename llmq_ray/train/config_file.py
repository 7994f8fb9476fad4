"""Run settings from a TOML file, with the command line on top: ``--config run.toml --steps 5``.

A config file holds the settings of the tree (llmq_ray/settings/tree.py): ``LLMQTrainer`` keyword arguments (the CLI
flags' names with underscores) at the top level or in any table, and in a section's own table also the short
names of the dotted flags (``[optim] lr`` is ``--optim.lr``, ``[checkpoints] interval`` is ``--ckpt-interval``)::

    model = "Qwen2.5-0.5B"
    [optim]
    lr = 6e-4
    warmup = 100
    [checkpoints]
    ckpt_interval = 500

A flag given on the command line wins over the file. ``--print-config`` prints every resolved setting in this
same format (``resolved_toml``), so its output is a config file that reproduces the run. A key that is not a
setting is refused in one sentence naming the closest valid one.

Why our own writer: Python reads TOML (``tomllib``) but does not write it, and the flat ``key = value`` lines
we print need no library (JSON's escaping of strings, numbers and booleans is valid TOML).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from llmq_ray.errors import ConfigError
from llmq_ray.settings import closest  # one definition, shared with the CLI and LLMQTrainer




def read_config(path: str, valid: set[str], short: dict[tuple[str, str], str] | None = None) -> dict[str, Any]:
    """The settings of a TOML file as {keyword argument: value}; ConfigError (one sentence naming the file
    and the key) for a file that cannot be read or parsed, a key that is not a setting, or a key twice.
    ``short``: {(section, short name): keyword argument}, the names a section's table may use."""
    short = short or {}
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        raise ConfigError(f"--config {path}: reading TOML needs Python 3.11 or newer (tomllib).")
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file.") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror}).") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path} is not valid TOML ({exc}).") from None
    out: dict[str, Any] = {}

    def take(key: str, value: Any, where: str, table: str | None = None) -> None:
        key = short.get((table, key), key)
        if key not in valid:
            names = set(valid) | {s for (sec, s) in short if sec == table}
            raise ConfigError(f"--config {path}: {where}{key!r} is not a setting{closest(key, names)}.")
        if key in out:
            raise ConfigError(f"--config {path}: {key!r} is given twice.")
        out[key] = value

    for key, value in doc.items():
        if isinstance(value, dict):  # a table: its keys are settings
            for k, v in value.items():
                if isinstance(v, dict):
                    raise ConfigError(f"--config {path}: [{key}.{k}] nests tables two deep; settings sit at the top "
                                      f"level or in one table.")
                take(k, v, f"[{key}] ", key)
        else:
            take(key, value, "")
    return out


def resolved_toml(settings: dict[str, Any], source: str = "") -> str:
    """``settings`` as TOML, one table per section of the settings tree (``key = value``; a setting that is None
    is a comment, TOML has no null)."""
    from llmq_ray.settings import all_settings

    section_of = {s.name: s.section for s in all_settings()}
    lines = [f"# resolved by llmq-ray{f' from {source}' if source else ''}; use it with --config"]
    top = sorted(k for k in settings if k not in section_of)
    for key in top:
        lines.append(_line(key, settings[key]))
    sections = list(dict.fromkeys(section_of[k] for k in section_of if k in settings))
    for section in sections:
        lines.append(f"\n[{section}]")
        lines += [_line(k, settings[k]) for k in section_of if section_of[k] == section and k in settings]
    return "\n".join(lines) + "\n"


_AT_START = {  # settings still "auto" after the pre-flight: what decides them when the run starts
    "device": "cuda when the Ray cluster has GPUs, else cpu",
    "backend": "triton on cuda, torch on cpu",
    "kept_quants_gib": "the device memory set-up leaves free",
    "opt_resident_gib": "the device memory set-up leaves free",
}


def _line(key: str, value: Any) -> str:
    if value == "auto" and key in _AT_START:
        return f"{key} = \"auto\"  # resolved when the run starts: {_AT_START[key]}"
    if key == "run_id" and value is None:
        return "# run_id = (a new one per run: <UTC time>-<random>)"
    if value is None:
        return f"# {key} = (none)"
    if isinstance(value, (bool, int, float, str)):
        return f"{key} = {json.dumps(value)}"
    return f"# {key} = {value!r} (not a TOML scalar)"
