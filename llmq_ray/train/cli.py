"""The train command: ``python examples/train.py [flags]`` (also installed as ``llmq-train``).

Flags follow llm.q's names; each is a setting of the tree (llmq_ray/settings/tree.py), ``--grad-accumulation`` ->
``grad_accumulation``, and the old boolean spellings of a merged choice stay as aliases (``--persistent-quants`` is
``--fp8-weight-copies persistent``, ``--shard-weights`` is ``--zero-level 3``). The CLI keeps no defaults of its
own: a flag not given is not passed on, so the API and the CLI share the tree's defaults, which ``--help`` prints. ``--config run.toml`` reads settings from a file
(``llmq_ray/train/config_file.py``; flags on the command line win) and ``--print-config`` prints the resolved ones. Defaults that say "auto" suit the machine:
on a CPU a tiny Qwen-vocabulary model, fp32, the torch backend and a run of about two minutes; on a GPU
Qwen2.5-0.5B from scratch in bf16 with the fastest backend. With no ``--train-file`` the run uses the
tiny-shakespeare corpus that ships with llmq-ray (see ``llmq_ray/train/default_data.py``). The run ends by printing the
eval loss, a short generated sample and where the outputs are.

Exit codes: 0 finished; 2 a user error (one sentence on stderr: a bad flag, file, folder or checkpoint; every
check that needs no GPU runs before Ray starts); 1 any other failure; 143 / 130 / 129 stopped by SIGTERM /
SIGINT / SIGHUP after writing a checkpoint (see ``llmq_ray/train/stop_signals.py``; a second signal abandons it).

Importing this module and checking the input imports neither torch nor Ray: a mistake ends in well under a
second on a small machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from llmq_ray.errors import LLMQError

AUTO = "auto"
CLI_ONLY = {"config": None, "print_config": False}  # the flags of this command alone (beside its command-only settings)


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block before it) and an unknown flag is answered with the
    closest valid one."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        if message.startswith("unrecognized arguments:"):
            from llmq_ray.settings import closest

            flags = [o for a in self._actions for o in a.option_strings]
            unknown = message.split(":", 1)[1].split()
            first = next((u.split("=")[0] for u in unknown if u.startswith("--")), None)
            if first:
                message = f"unrecognized argument {first}{closest(first, flags)}"
        self.exit(2, f"error: {message} (`{self.prog} --help` lists every flag)\n")


def gib_or_auto(text: str) -> float | str:
    """argparse type of --opt-resident-gib and --kept-quants-gib: a number of GiB, or "auto"."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="llmq-train" if os.path.basename(sys.argv[0]) == "llmq-train" else "examples/train.py",
        description="Train a Llama / Qwen / GPT-2 model with llmq-ray (one Ray worker per GPU).",
        epilog=_presets_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS)  # a flag not given is not passed on: the trainer's default applies
    g = p.add_argument_group("config file")
    g.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file (keys: the flags' names with "
                   "underscores, at the top level or in tables); flags on the command line win")
    g.add_argument("--print-config", action="store_true",
                   help="print every resolved setting as TOML (a config file for this run) and exit without training")
    _add_settings(p)
    _add_defaults_to_help(p)
    return p


def _presets_epilog() -> str:
    """The model presets, for the end of ``--help`` (``--model NAME``)."""
    import textwrap

    from llmq_ray.model.config import PRESETS

    return "model presets (--model NAME; an HF folder or an HF id in the local cache works too):\n" + \
        textwrap.fill(", ".join(PRESETS), width=100, initial_indent="  ", subsequent_indent="  ")


def parse_bool(text: str) -> bool:
    """argparse type of a dotted boolean (``--speed.use_cuda_graphs true``)."""
    value = text.strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


_PARSERS = {"int": int, "float": float, "str": str, "gib_or_auto": gib_or_auto}


def _add_settings(parser: argparse.ArgumentParser) -> None:
    """One flag per setting of the tree (llmq_ray/settings/tree.py), section by section: ``--name-with-dashes``
    (or, for a boolean that defaults to True, its ``--no-...`` form), the llm.q aliases, the dotted spelling
    ``--<section>.<name>`` (booleans take true/false there) and the old boolean spellings of a choice
    (``--persistent-quants``), each setting its choice's value."""
    from llmq_ray.settings import all_settings, sections

    docs = {name: (cls.__doc__ or "").strip().rstrip(".") for name, cls in sections()}
    groups: dict = {}
    for s in all_settings():
        if s.section not in groups:
            doc = docs[s.section]
            groups[s.section] = parser.add_argument_group(
                f"{s.section} -- {doc[:1].lower() + doc[1:]}",
                f"each also as --{s.section}.<name> VALUE (booleans: true or false), <name> as in a config file")
        g, m = groups[s.section], s.meta
        kw = dict(dest=s.name, help=m["help"])
        if m["command_only"]:
            kw["default"] = s.default  # read by this command itself
        if s.is_bool:
            if s.default is True:
                g.add_argument(m["negative"] or "--no-" + s.name.replace("_", "-"), action="store_false", **kw)
            else:
                g.add_argument(s.dashed, *m["flags"], action="store_true", **kw)
            g.add_argument(f"--{s.dotted}", dest=s.name, type=parse_bool, help=argparse.SUPPRESS)
            continue
        kind = m["parse"] or s.type.split(" |")[0]
        if kind == "bool":  # a value that may also be a boolean (--continue [STEP|DIR])
            kind = "str"
        kw["type"] = _PARSERS[kind]
        for key in ("choices", "metavar", "nargs", "const"):
            if m[key] is not None:
                kw[key] = m[key]
        if kw.get("choices") and s.default == AUTO and AUTO not in kw["choices"]:
            kw["choices"] = (AUTO, *kw["choices"])
        names = [*m["flags"], s.dashed] if s.name == "resume" else [s.dashed, *m["flags"]]  # usage: --continue
        g.add_argument(*names, **kw)
        g.add_argument(f"--{s.dotted}", **{**kw, "help": argparse.SUPPRESS})
        for old, (on, off) in m["aliases"].items():
            g.add_argument("--" + old.replace("_", "-"), dest=old, action="store_true",
                           help=f"the same as --{s.name.replace('_', '-')} {on}")
            g.add_argument(f"--{s.section}.{old}", dest=old, type=parse_bool, help=argparse.SUPPRESS)


def _add_defaults_to_help(parser: argparse.ArgumentParser) -> None:
    """Append each flag's default, read from the tree (the "auto" ones described by llmq_ray/settings/defaults.py),
    to its help."""
    from llmq_ray.settings import all_settings
    from llmq_ray.settings.defaults import auto_help

    defaults = {**{s.name: s.default for s in all_settings()}, **auto_help(), **CLI_ONLY}
    for a in parser._actions:
        if (not a.option_strings or a.dest == "help" or a.nargs == 0 or a.dest not in defaults
                or a.help == argparse.SUPPRESS or "default" in (a.help or "")):
            continue
        value = defaults[a.dest]
        shown = "none" if value is None else (repr(value) if isinstance(value, str) and not value.startswith("auto")
                                              else str(value))
        a.help = f"{a.help} (default: {shown})".replace("%", "%%")


def config_keys() -> set[str]:
    """The keys a config file may hold: every setting of the tree, and the old boolean spellings of a choice."""
    from llmq_ray.settings import aliases, all_settings

    return {s.name for s in all_settings()} | set(aliases())


def trainer_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``LLMQTrainer`` that the user gave on the command line (the flags of this
    command alone and its command-only settings, ``--sample-tokens`` and ``--prompt``, left out)."""
    from llmq_ray.settings import all_settings

    command_only = {s.name for s in all_settings() if s.meta["command_only"]}
    return {k: v for k, v in vars(args).items() if k not in CLI_ONLY and k not in command_only}


def print_sample(export_path: str, prompt: str, n_tokens: int, seed: int, device: str) -> None:
    """Generate ``n_tokens`` from the export with the KV-cache sampler and print them (text for Qwen vocab)."""
    from llmq_ray.model.generate import load_for_generation

    gen = load_for_generation(export_path, device=device, dtype="fp32")
    tok = None
    if gen.cfg.vocab_size >= 151643:
        from llmq_ray.data_pipeline.vocab import QwenTiktoken

        tok = QwenTiktoken()
    ids = tok.encode(prompt) if tok is not None else [gen.cfg.bos_token_id or 0]
    out = gen.generate([ids], n_tokens, temperature=0.8, top_k=40, seed=seed, eos_token_id=None)[0]
    text = tok._enc.decode(out) if tok is not None else " ".join(map(str, out))  # tiktoken decode
    print("sample:", repr(prompt + text) if tok is not None else text, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args = build_parser().parse_args(argv)
    trainer = None
    try:
        from llmq_ray.train.trainer import LLMQTrainer

        kwargs = trainer_kwargs(args)
        if args.sample_tokens < 0:  # a setting of the command, not of the trainer: checked here
            from llmq_ray.errors import ConfigError

            raise ConfigError(f"--sample-tokens={args.sample_tokens} must be an integer >= 0 (0: no sample).")
        if getattr(args, "config", None):
            from llmq_ray.train.config_file import read_config

            from llmq_ray.errors import ConfigError
            from llmq_ray.settings import all_settings, check_types

            short = {(s.section, s.short): s.name for s in all_settings()}
            config = read_config(args.config, config_keys(), short)
            try:  # TOML types its values itself: a quoted number is a string there
                check_types(config)
            except ConfigError as exc:
                raise ConfigError(f"--config {args.config}: {exc}") from None
            kwargs = {**config, **kwargs}  # the command line wins
        if getattr(args, "print_config", False):  # stdout is the TOML alone (`--print-config > run.toml`)
            import contextlib

            from llmq_ray.train.config_file import resolved_toml

            with contextlib.redirect_stdout(sys.stderr):
                trainer = LLMQTrainer(cli=True, **kwargs)
            print(resolved_toml(trainer.resolved_settings(), getattr(args, "config", None) or ""), end="")
            return 0
        trainer = LLMQTrainer(cli=True, **kwargs)
        result = trainer.fit()
        if result.stopped:
            return result.stopped["exit_code"]  # its line ("stopped by SIGTERM after step N; ...") is printed
        if result.export_path and args.sample_tokens > 0:
            print_sample(result.export_path, args.prompt, args.sample_tokens, trainer.settings.optim.seed,
                         trainer.plan.settings.parallel.device if trainer.plan else "cpu")
    except LLMQError as exc:
        print(f"error: {exc}", file=sys.stderr)
        from llmq_ray.actors.failures import WorkerError

        from llmq_ray.errors import RayStartError

        # 1: the run failed (its workers were up: a worker lost, a checkpoint that could not be written; or Ray did
        # not start); 2: the input is at fault, found before the run started
        started = trainer is not None and trainer.info is not None
        return 1 if isinstance(exc, (WorkerError, RayStartError)) or started else 2
    except KeyboardInterrupt:  # before fit() took over the signals (e.g. while the default data is tokenized)
        print("interrupted", file=sys.stderr)
        return 130
    m = result.metrics
    if m["eval_loss"] is not None:
        print(f"eval loss: {m['eval_loss']:.4f}")
    if m.get("restarts") or m.get("skipped_steps"):
        print(f"robustness: {m['restarts']} automatic restart(s), {m['skipped_steps']} skipped update(s), "
              f"{m['warnings']} warning(s) in the log")
    ckpt = result.checkpoint_paths[-1] if result.checkpoint_paths else "-"
    print(f"outputs: export {result.export_path or '-'} | checkpoint {ckpt} | log {result.log_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
