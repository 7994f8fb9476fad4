"""What a setting is: a dataclass field whose metadata carries its help, its command-line spellings, its range and
its aliases; and the flattened view (``Setting``) the command line, config files and the rules read.

A field is declared with ``setting(default, help, ...)`` in llmq_ray/settings/tree.py. Its metadata:

* ``flags``: extra spellings beside ``--name-with-dashes`` (llm.q's: ``--lr``);
* ``short``: its name inside its section (``--optim.lr``, ``[optim] lr``; default the field name);
* ``negative``: the flag that turns off a boolean defaulting to True (default ``--no-name-with-dashes``);
* ``choices`` / ``metavar`` / ``nargs`` / ``const``: as argparse's;
* ``ge`` / ``gt`` / ``le`` / ``lt``: the range of a number, checked by ``check_ranges`` with one sentence; ``note``:
  a few words the sentence adds (``0: off``);
* ``aliases``: {old keyword: (value when True, value when False or None)}: boolean spellings that map onto this
  choice (``persistent_quants=True`` / ``--persistent-quants`` is ``fp8_weight_copies="persistent"``);
  ``at_least=True`` makes an alias raise the value to its own, never lower it (``--shard-weights`` is ZeRO 3);
* ``command_only``: a setting of the train command, not of the trainer (the sample it prints);
* ``parse``: the value parser when the annotation does not say (``gib_or_auto``).

Why our own small layer instead of a config library: the flags must keep llm.q's spellings, negations and
aliases, the defaults must stay "auto" until the machine is known, and this package must import without torch or
Ray (it is the leaf every layer reads); tyro / simple-parsing / jsonargparse each fix one of those differently.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Iterable

AUTO = "auto"


def setting(default: Any, help: str, *, flags: tuple = (), short: str | None = None, negative: str | None = None,
            choices: tuple | None = None, metavar: str | None = None, nargs: str | None = None, const: Any = None,
            ge=None, gt=None, le=None, lt=None, note: str | None = None, aliases: dict | None = None,
            at_least: bool = False, command_only: bool = False, parse: str | None = None):
    """One setting (a dataclass field); the module docstring says what each piece of metadata means."""
    meta = dict(help=help, flags=tuple(flags), short=short, negative=negative, choices=choices, metavar=metavar,
                nargs=nargs, const=const, ge=ge, gt=gt, le=le, lt=lt, note=note, aliases=dict(aliases or {}),
                at_least=at_least, command_only=command_only, parse=parse)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One leaf of the tree, flattened: its section, name, type (as written), default and metadata."""

    section: str
    name: str
    type: str
    default: Any
    meta: dict

    @property
    def short(self) -> str:
        return self.meta["short"] or self.name

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.short}"

    @property
    def dashed(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.type in ("bool", "bool | None")


def flatten(tree_cls: type) -> list[Setting]:
    """Every setting of the tree ``tree_cls`` (a dataclass of section dataclasses), section by section."""
    out = []
    for sec in dataclasses.fields(tree_cls):
        for f in dataclasses.fields(sec.default_factory):
            out.append(Setting(sec.name, f.name, f.type if isinstance(f.type, str) else f.type.__name__, f.default,
                               dict(f.metadata)))
    return out


def closest(name: str, valid: Iterable[str]) -> str:
    """' (did you mean X?)' for the valid name closest to ``name``, or '' when none is close."""
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


_KINDS = {  # the annotation's words: a test of a value, and how a sentence names them
    "int": (lambda v: isinstance(v, numbers.Integral) and not is_bool(v), "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not is_bool(v), "a number"),
    "bool": (lambda v: is_bool(v), "True or False"),
    "str": (lambda v: isinstance(v, str), "a string"),
}
FILE_LISTS = ("train_file", "eval_file")  # a list of paths works there too (the data pipeline takes sequences)


def is_bool(value) -> bool:
    """True / False, and numpy's booleans (a mask's element), which are no ``bool`` subclass."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def plain_path(value):
    """``value`` with an ``os.PathLike`` (a ``pathlib.Path``), alone or in a list, turned into its string: the
    code below takes paths as strings (and URIs: ``s3://...`` is no Path); any other value as it is."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return type(value)(plain_path(v) for v in value)
    return value


def check_type(s: Setting, value) -> None:
    """ConfigError (one sentence naming the flag) for a value of the wrong type or outside the setting's choices.
    A value equal to the default passes (several default to None or "auto" whatever their type), and so does
    "auto" and None where the default is "auto" or None (resolved later)."""
    from llmq_ray.errors import ConfigError

    if (type(value) is type(s.default) and value == s.default) or (value is None and s.default is None):
        return
    if value == AUTO and s.default == AUTO:
        return
    if s.name in ("warmup", "from_scratch") and value == AUTO:  # None-defaulted, derived from others
        return
    kinds = [k.strip() for k in s.type.split("|")]
    ok = any(_KINDS[k][0](value) for k in kinds if k in _KINDS) or (value is None and "None" in kinds)
    wanted = " or ".join(_KINDS[k][1] for k in kinds if k in _KINDS)
    if s.name in FILE_LISTS:
        wanted = "a path (a string) or a non-empty list of paths"
        if isinstance(value, (list, tuple)):
            ok = bool(value) and all(isinstance(v, str) for v in value)
    if not ok:
        raise ConfigError(f"{s.dashed}={value!r} must be {wanted}, not {type(value).__name__}.")
    choices = s.meta["choices"]
    if choices and value is not None and value not in choices and not (value == AUTO and s.default == AUTO):
        raise ConfigError(f"{s.dashed}={value!r} must be one of {', '.join(map(str, choices))}.")


def check_range(s: Setting, value) -> None:
    """ConfigError for a number outside the setting's ``ge`` / ``gt`` / ``le`` / ``lt`` (and for an infinite or
    NaN one where a range is given); "auto", None and non-numbers pass (the type check is ``check_type``'s)."""
    from llmq_ray.errors import ConfigError

    m = s.meta
    bounds = [(k, m[k]) for k in ("ge", "gt", "le", "lt") if m[k] is not None]
    if not bounds or value is None or value == AUTO or is_bool(value) or not isinstance(value, numbers.Real):
        return
    ok = math.isfinite(value) and all({"ge": value >= b, "gt": value > b, "le": value <= b, "lt": value < b}[k]
                                      for k, b in bounds)
    if ok:
        return
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    kind = "an integer" if s.type.split(" |")[0] == "int" else "a number"
    rng = " and ".join(f"{words[k]} {b}" for k, b in bounds)
    note = f" ({m['note']})" if m["note"] else ""
    raise ConfigError(f"{s.dashed}={value!r} must be {kind} {rng}{note}.")
