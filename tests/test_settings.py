"""The settings tree (llmq_ray/settings.py) is the one definition of every option: the CLI, config files,
TrainOptions and LLMQTrainer's keywords all follow it; a field without a flag, a drifted default or an unknown
key fails here."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import numpy as np
import pytest

from llmq_ray.options import TrainOptions
from llmq_ray.settings import NO_TRAIN_DEFAULT, RunSettings, all_settings, sections
from llmq_ray.train import cli


def _actions():
    return [a for a in cli.build_parser()._actions if a.option_strings]


def test_the_tree_has_the_sections_and_every_setting_once():
    assert [name for name, _ in sections()] == ["model", "data", "optim", "numerics", "memory", "speed", "parallel",
                                                "checkpoints", "observe"]
    names = [s.name for s in all_settings()]
    assert len(names) == len(set(names)) and len(names) > 80
    assert isinstance(RunSettings().optim.weight_decay, float)
    for s in all_settings():
        assert len(s.meta["help"].split()) >= 2, f"{s.name} has no help text"


def test_every_field_is_a_flag_with_its_help_and_a_dotted_spelling():
    actions = _actions()
    for s in all_settings():
        mine = [a for a in actions if a.dest == s.name]
        shown = [a for a in mine if a.help != argparse.SUPPRESS]
        assert len(shown) == 1, f"{s.name}: {len(shown)} visible flags"
        assert shown[0].help.startswith(s.meta["help"]), s.name  # the field's own help text (+ its default)
        spellings = {o for a in mine for o in a.option_strings}
        assert f"--{s.dotted}" in spellings, s.name
        flat = (s.meta["negative"] or "--no-" + s.name.replace("_", "-")) if s.is_bool and s.default is True \
            else s.dashed
        assert flat in spellings and set(s.meta["flags"]) <= spellings, (s.name, spellings)


def test_llmq_flag_names_keep_working_as_aliases():
    kw = cli.trainer_kwargs(cli.build_parser().parse_args(
        ["--lr", "3e-4", "--ckpt-keep", "3", "--continue", "--no-ray-data", "--recompute-block"]))
    assert kw == dict(learning_rate=3e-4, ckpt_keep_n=3, resume="latest", use_ray_data=False, recompute_block=True)


def test_dotted_overrides_match_the_flat_flags():
    parse = lambda argv: cli.trainer_kwargs(cli.build_parser().parse_args(argv))  # noqa: E731
    assert parse(["--optim.lr", "3e-4", "--checkpoints.interval", "5", "--speed.use_cuda_graphs", "true",
                  "--data.use_ray_data", "false", "--parallel.zero_level", "2"]) == \
        parse(["--lr", "3e-4", "--ckpt-interval", "5", "--use-cuda-graphs", "--no-ray-data", "--zero-level", "2"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--speed.use_cuda_graphs", "maybe"])


def test_train_options_are_generated_from_the_tree():
    fields = {f.name: f for f in dataclasses.fields(TrainOptions)}
    wanted = [s for s in all_settings() if not s.meta["runtime"] and not s.meta["command_only"]]
    assert list(fields) == [s.name for s in wanted]
    for s in wanted:
        default = s.default if s.meta["train_default"] is NO_TRAIN_DEFAULT else s.meta["train_default"]
        assert fields[s.name].default == default, s.name
        assert fields[s.name].default != "auto", f"{s.name}: TrainOptions needs a concrete default"


def test_trainer_keywords_are_the_runtime_settings_with_the_same_defaults():
    from llmq_ray.train.trainer import LLMQTrainer

    params = {k: p for k, p in inspect.signature(LLMQTrainer.__init__).parameters.items()
              if p.kind is p.KEYWORD_ONLY and k not in cli.API_ONLY}
    runtime = {s.name: s for s in all_settings() if s.meta["runtime"]}
    assert set(params) == set(runtime)
    for name, p in params.items():
        assert p.default == runtime[name].default, f"LLMQTrainer({name}=...) default {p.default!r} differs from the tree"


def test_config_file_takes_section_short_names_and_refuses_unknown_keys(tmp_path):
    from llmq_ray.errors import ConfigError
    from llmq_ray.train.config_file import read_config

    short = {(s.section, s.short): s.name for s in all_settings()}
    valid = {s.name for s in all_settings()}
    f = tmp_path / "run.toml"
    f.write_text('steps = 7\n[optim]\nlr = 1e-3\n[checkpoints]\ninterval = 50\nckpt_keep_n = 4\n')
    assert read_config(str(f), valid, short) == dict(steps=7, learning_rate=1e-3, ckpt_interval=50, ckpt_keep_n=4)
    f.write_text('[optim]\nlrr = 1e-3\n')
    with pytest.raises(ConfigError, match=r"\[optim\] 'lrr' is not a setting \(did you mean 'lr'\?\)\.$"):
        read_config(str(f), valid, short)


def test_values_of_the_wrong_type_or_outside_the_choices_are_one_sentence(tmp_path, capsys):
    """The Python API and config files are not type-checked by argparse: a string learning rate, a float batch
    size, a bool where an integer goes, a None where a path goes, a backend that does not exist -- each one
    ConfigError naming the setting (a TypeError deep in the validation, or a silent run, before)."""
    from llmq_ray.errors import ConfigError
    from llmq_ray.settings import check_types
    from llmq_ray.train.trainer import LLMQTrainer

    check_types(dict(learning_rate=1, steps=3, train_file=["a.bin", "b.bin"], matmul_dtype=None, model="tiny",
                     eval_every_n_steps="auto", resume="latest", not_a_setting=object()))
    check_types(dict(resume=4))  # a step number, as the API documents
    check_types(dict(resume=None, export=np.False_))  # None: no resume (resolve_continue); numpy's booleans
    kw = dict(device="cpu", synthetic_data=True, out_dir=str(tmp_path), verbose=False, model="tiny")
    for bad, sentence in [
            (dict(learning_rate="1e-3"), "learning_rate='1e-3' must be a number, not str."),
            (dict(batch_size=2.0), "batch_size=2.0 must be an integer, not float."),
            (dict(grad_accumulation=True), "grad_accumulation=True must be an integer, not bool."),
            (dict(seq_len=None), "seq_len=None must be an integer, not NoneType."),
            (dict(out_dir=None), "out_dir=None must be a string, not NoneType."),
            (dict(use_cuda_graphs=1), "use_cuda_graphs=1 must be True or False, not int."),
            (dict(backend="jax"), "backend='jax' must be one of auto, torch, triton, cupy."),
            (dict(eval_file=[]), "eval_file=[] must be a path (a string) or a non-empty list of paths, not list."),
            (dict(warmup="soon"), "warmup='soon' must be an integer, not str.")]:
        with pytest.raises(ConfigError) as caught:
            LLMQTrainer(**{**kw, **bad})
        assert str(caught.value) == sentence
    # what the API took before the check and still takes: "auto" where the trainer resolves it (also a config
    # file's `warmup = "auto"`), resume=None, and pathlib paths (turned into strings), alone or in a list
    from llmq_ray.data_pipeline.shards import write_shard

    write_shard(str(tmp_path / "t.bin"), np.arange(1000, dtype=np.int32) % 512, 512)
    t = LLMQTrainer(**{**kw, "synthetic_data": False, "train_file": [tmp_path / "t.bin"], "out_dir": tmp_path / "p",
                       "warmup": "auto", "from_scratch": "auto", "resume": None, "steps": 30})
    assert t.runtime["train_file"] == [str(tmp_path / "t.bin")] and t.runtime["out_dir"] == str(tmp_path / "p")
    assert t.opts.warmup == 3 and t.opts.from_scratch is True and t.resume is None
    f = tmp_path / "run.toml"  # a config file's values reach the trainer as TOML typed them
    f.write_text('[optim]\nlr = "1e-3"\n')
    assert cli.main(["--device", "cpu", "--synthetic-data", "--out-dir", str(tmp_path / "o"), "--config", str(f)]) == 2
    assert capsys.readouterr().err == f"error: --config {f}: --learning-rate='1e-3' must be a number, not str.\n"
