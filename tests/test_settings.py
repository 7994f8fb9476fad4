"""The settings tree (llmq_ray/settings/) is the one definition of every setting: the CLI, config files,
``--print-config`` and LLMQTrainer's keywords all follow it; a field without a flag, a setting spelled a second
time in another dataclass, or an unknown key fails here."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os

import numpy as np
import pytest

from llmq_ray.settings import RunSettings, aliases, all_settings, make_settings, sections
from llmq_ray.train import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def _dataclass_fields_outside_the_settings() -> list[tuple[str, int, str, str]]:
    """(file, line, class, field) of every field declared in a @dataclass outside llmq_ray/settings/ (the library's
    folders, parsed with ast: a generated dataclass would hide from this, and none is left)."""
    out = []
    for top in ("llmq_ray", "actors", "backends", "data_pipeline", "examples"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            if os.path.join("llmq_ray", "settings") in root:
                continue
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(root, f)
                tree = ast.parse(open(path).read(), path)
                for node in ast.walk(tree):
                    if not isinstance(node, ast.ClassDef):
                        continue
                    decorated = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
                    if not decorated:
                        continue
                    for stmt in node.body:
                        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                            out.append((os.path.relpath(path, REPO), stmt.lineno, node.name, stmt.target.id))
    return out


# fields that share a setting's name but hold something else (no default of their own to drift)
NOT_SETTINGS = {("Result", "log_file"): "the path of the log the run wrote, an output of fit()",
                ("DatasetSpec", "seq_len"): "the window length a shard reader was built with, a required argument"}


def test_no_dataclass_outside_the_settings_spells_a_setting_again():
    """Each setting is defined once: a dataclass elsewhere (a run plan, an engine's view, a model's build
    description) that declares a field named like a setting would be a second definition, with a default of its
    own that can drift (the run spec of before had a ckpt_minutes of 0.0 where the tree said 30.0)."""
    names = {s.name for s in all_settings()} | set(aliases())
    found = [f"{path}:{line} {cls}.{field}" for path, line, cls, field in _dataclass_fields_outside_the_settings()
             if field in names and (cls, field) not in NOT_SETTINGS]
    assert not found, "dataclass fields named like a setting (read it from the settings tree): " + ", ".join(found)


def test_the_check_finds_a_spelled_again_setting(tmp_path, monkeypatch):
    """The check above looks where it should: a dataclass in the library with a setting's name is found."""
    bad = os.path.join(REPO, "llmq_ray", "engine", "_probe_spelled_again.py")
    with open(bad, "w") as f:
        f.write("import dataclasses\n\n@dataclasses.dataclass\nclass Probe:\n    ckpt_minutes: float = 0.0\n")
    try:
        found = [x for x in _dataclass_fields_outside_the_settings() if x[2] == "Probe"]
    finally:
        os.remove(bad)
    assert found and found[0][3] == "ckpt_minutes"


def test_trainer_takes_settings_and_keywords_routed_by_name(tmp_path):
    """LLMQTrainer(settings=None, **overrides): at most 5 named parameters; a keyword lands on its field, an old
    boolean spelling on its choice, and a misspelt one is refused naming the closest setting."""
    from llmq_ray.errors import ConfigError
    from llmq_ray.train.trainer import LLMQTrainer

    named = [k for k, p in inspect.signature(LLMQTrainer.__init__).parameters.items()
             if k != "self" and p.kind is not p.VAR_KEYWORD]
    assert len(named) <= 5 and named[0] == "settings", named
    base = make_settings(model="tiny", steps=7)
    t = LLMQTrainer(base, device="cpu", synthetic_data=True, out_dir=str(tmp_path), verbose=False, batch_size=3,
                    shard_weights=True)
    assert (t.settings.optim.steps, t.settings.data.batch_size, t.settings.parallel.zero_level) == (7, 3, 3)
    assert base.data.batch_size == "auto"  # the caller's tree is not changed
    with pytest.raises(ConfigError, match=r"^LLMQTrainer got an unknown setting 'lerning_rate' \(did you mean "
                                          r"'learning_rate'\?\)"):
        LLMQTrainer(lerning_rate=1e-3, device="cpu", synthetic_data=True, verbose=False)
    with pytest.raises(ConfigError, match=r"settings=\.\.\.\) takes a RunSettings"):
        LLMQTrainer({"steps": 3})


def test_merged_choices_keep_their_old_spellings():
    """One choice is one setting: the old booleans map onto it (flags, keywords and config keys alike)."""
    assert make_settings(persistent_quants=True).memory.fp8_weight_copies == "persistent"
    assert make_settings(transient_quants=True).memory.fp8_weight_copies == "layer"
    assert make_settings(offload_quants=True).memory.fp8_weight_copies == "host"
    assert make_settings(fp8_delayed_swiglu_scale=True).numerics.swiglu_fp8_scale == "delayed"
    assert make_settings(fp8_delayed_swiglu_scale=False).numerics.swiglu_fp8_scale == "current"
    assert make_settings(fp8_smooth_swiglu=True).numerics.swiglu_fp8_scale == "smooth"
    assert make_settings(shard_gradients=True).parallel.zero_level == 2
    assert make_settings(zero_level=3, shard_gradients=True).parallel.zero_level == 3  # never lowered
    parse = lambda argv: make_settings(**cli.trainer_kwargs(cli.build_parser().parse_args(argv)))  # noqa: E731
    assert parse(["--persistent-quants", "--offload-quants"]).memory.fp8_weight_copies == "host"
    assert parse(["--shard-weights"]).parallel.zero_level == 3
    assert parse(["--fp8-weight-copies", "layer"]).memory.fp8_weight_copies == "layer"
    assert parse(["--swiglu-fp8-scale", "smooth"]).numerics.swiglu_fp8_scale == "smooth"


def test_the_fast_fp8_recipe_is_what_e4m3_means():
    """--matmul-dtype e4m3 resolves to the recipe that passed its loss checks: FP8 LM head, delayed SwiGLU
    scale (SwiGLU models), persistent copies below ZeRO-3; each part turned off by naming another value."""
    from llmq_ray.settings.defaults import resolve

    def res(swiglu=True, **kw):
        return resolve(make_settings(model_dtype="bf16", matmul_dtype="e4m3", **kw), "cuda", swiglu_mlp=swiglu,
                       has_eval_file=False)

    n = res().numerics
    assert (n.lmhead_dtype, n.swiglu_fp8_scale) == ("e4m3", "delayed")
    assert res().memory.fp8_weight_copies == "persistent" and res(zero_level=3).memory.fp8_weight_copies == "layer"
    assert res(swiglu=False).numerics.swiglu_fp8_scale == "current"  # GPT-2's GELU MLP
    off = res(lmhead_dtype="bf16", swiglu_fp8_scale="current").numerics
    assert (off.lmhead_dtype, off.swiglu_fp8_scale) == (None, "current")
    plain = resolve(make_settings(model_dtype="bf16"), "cuda", swiglu_mlp=True, has_eval_file=False).numerics
    assert (plain.lmhead_dtype, plain.swiglu_fp8_scale) == (None, "auto")  # no FP8 recipe without e4m3


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
    assert t.settings.data.train_file == [str(tmp_path / "t.bin")] and t.settings.observe.out_dir == str(tmp_path / "p")
    assert t.settings.optim.warmup == 3 and t.settings.model.from_scratch is True and t.resume is None
    f = tmp_path / "run.toml"  # a config file's values reach the trainer as TOML typed them
    f.write_text('[optim]\nlr = "1e-3"\n')
    assert cli.main(["--device", "cpu", "--synthetic-data", "--out-dir", str(tmp_path / "o"), "--config", str(f)]) == 2
    assert capsys.readouterr().err == f"error: --config {f}: --learning-rate='1e-3' must be a number, not str.\n"
