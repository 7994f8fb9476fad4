"""The train CLI and the logging helpers, without starting Ray (fast)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from llmq_ray.train import cli
from llmq_ray.observe.metrics import peak_tflops, sol_fraction
from llmq_ray.observe.runlog import RunLog, atomic_write_json, eval_line, read_log, step_line

LLM_Q_FLAGS = ["--model", "--from-scratch", "--train-file", "--eval-file", "--batch-size", "--seq-len",
               "--grad-accumulation", "--steps", "--learning-rate", "--warmup", "--final-lr-fraction",
               "--lr-schedule", "--beta-1", "--beta-2", "--weight-decay", "--grad-clip", "--eval-every-n-steps",
               "--eval-num-steps", "--model-dtype", "--matmul-dtype", "--opt-m-dtype", "--opt-v-dtype",
               "--recompute-swiglu", "--recompute-norm", "--recompute-ffn", "--recompute-qkv", "--recompute-att",
               "--recompute-block", "--lmhead-chunks", "--gpus", "--zero-level", "--shard-gradients", "--out-dir",
               "--checkpoint-dir", "--ckpt-interval", "--continue", "--log-file", "--seed", "--backend", "--device",
               "--workers"]


def test_every_flag_exists_with_help():
    parser = cli.build_parser()
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    for flag in LLM_Q_FLAGS:
        assert flag in actions, flag
    for a in parser._actions:
        if a.option_strings and a.dest != "help":
            assert a.help and len(a.help) > 10, a.option_strings


def _trainer(argv, tmp_path):
    """The LLMQTrainer the CLI would build for ``argv`` (its checks run; Ray is not started)."""
    from llmq_ray.train.trainer import LLMQTrainer

    args = cli.build_parser().parse_args(argv + ["--out-dir", str(tmp_path)])
    return LLMQTrainer(cli=True, verbose=False, **cli.trainer_kwargs(args))


def test_cpu_auto_defaults_and_explicit_flags(tmp_path):
    t = _trainer(["--device", "cpu", "--synthetic-data"], tmp_path)
    opts = rt = t.settings
    assert opts.model.model == "tiny-qwen" and opts.model.from_scratch and opts.numerics.model_dtype == "fp32"
    assert (opts.data.batch_size, opts.data.seq_len, opts.optim.steps, opts.optim.warmup) == (4, 128, 20, 2)
    assert rt.parallel.device == "cpu" and rt.data.synthetic_data and rt.observe.eval_every_n_steps == 0
    t = _trainer(["--device", "cpu", "--model", "tiny", "--batch-size", "3", "--seq-len", "32",
                  "--grad-accumulation", "2", "--zero-level", "2", "--lr", "1e-3", "--recompute-block",
                  "--synthetic-data", "--adam-eps", "1e-6", "--cooldown-fraction", "0.3"], tmp_path)
    opts = rt = t.settings
    assert (opts.data.batch_size, opts.data.seq_len, opts.data.grad_accumulation, opts.parallel.zero_level) == (3, 32, 2, 2)
    assert opts.optim.learning_rate == 1e-3 and opts.memory.recompute_block and opts.parallel.zero_level == 2
    assert opts.optim.adam_eps == 1e-6 and opts.optim.cooldown_fraction == 0.3


def test_api_and_cli_share_their_defaults(tmp_path):
    """The CLI passes on only the flags given: LLMQTrainer() with the same arguments resolves every option
    and runtime setting the same way, and --help prints the trainer's defaults."""
    from llmq_ray.settings import all_settings
    from llmq_ray.settings.defaults import auto_help
    from llmq_ray.train.trainer import LLMQTrainer

    for argv, kw in ((["--device", "cpu", "--synthetic-data"], dict(device="cpu", synthetic_data=True)),
                     (["--device", "cpu", "--synthetic-data", "--model", "tiny", "--ckpt-interval", "5",
                       "--no-ray-data", "--continue"],
                      dict(device="cpu", synthetic_data=True, model="tiny", ckpt_interval=5, use_ray_data=False,
                           resume="latest"))):
        if "--continue" in argv:  # needs a checkpoint: compare the kwargs the CLI produces instead
            args = cli.build_parser().parse_args(argv)
            assert cli.trainer_kwargs(args) == kw
            continue
        via_cli = _trainer(argv, tmp_path)
        via_api = LLMQTrainer(out_dir=str(tmp_path), verbose=False, **kw)
        assert via_cli.settings == via_api.settings  # the run id is drawn when a run starts, not here
    helps = {a.dest: a.help for a in cli.build_parser()._actions if a.help != argparse.SUPPRESS}
    d = {**{s.name: s.default for s in all_settings()}, **auto_help()}
    for dest in ("grad_accumulation", "ckpt_keep_n", "max_restarts", "step_timeout_s", "beta_2", "opt_chunk_size"):
        assert f"(default: {d[dest]})" in helps[dest], (dest, helps[dest])
    assert "auto: tiny-qwen on CPU" in helps["model"]


def test_api_errors_name_keyword_arguments(tmp_path):
    """The same mistake through the CLI names the flag, through the API the keyword argument."""
    from llmq_ray.errors import ConfigError
    from llmq_ray.train.trainer import LLMQTrainer

    with pytest.raises(ConfigError, match=r"^warmup must be an integer in \[0, steps\)"):
        LLMQTrainer(device="cpu", synthetic_data=True, steps=10, warmup=50, out_dir=str(tmp_path), verbose=False)
    with pytest.raises(ConfigError, match=r"^ckpt_keep_n=0 must be"):
        LLMQTrainer(device="cpu", synthetic_data=True, ckpt_keep_n=0, out_dir=str(tmp_path), verbose=False)
    with pytest.raises(ConfigError, match=r"^--warmup must be an integer in \[0, --steps\)"):
        _trainer(["--device", "cpu", "--synthetic-data", "--steps", "10", "--warmup", "50"], tmp_path)


@pytest.mark.parametrize("flag,base", [
    ("--opt-resident-gib", ["--offload-opt-m"]),
    ("--kept-quants-gib", ["--model-dtype", "bf16", "--matmul-dtype", "e4m3", "--transient-quants"])])
def test_gib_flags_take_a_number_or_auto(capsys, flag, base):
    base = ["--device", "cpu", "--synthetic-data", *base]
    key = flag[2:].replace("-", "_")
    for text, want in (("2.5", 2.5), ("auto", "auto"), ("AUTO", "auto")):
        kw = cli.trainer_kwargs(cli.build_parser().parse_args(base + [flag, text]))
        assert kw[key] == want
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(base + [flag, "lots"])
    assert flag in capsys.readouterr().err


def test_checkpoint_flags_reach_the_trainer(tmp_path):
    t = _trainer(["--device", "cpu", "--synthetic-data"], tmp_path)
    rt = t.settings
    assert t.resume is False and rt.checkpoints.ckpt_interval == 0 and rt.checkpoints.ckpt_keep_n == 2 and rt.checkpoints.max_restarts == 3
    assert rt.checkpoints.step_timeout_s == 1800.0 and t.settings.checkpoints.checkpoint_on_exit and not t.settings.checkpoints.allow_batch_change
    base = ["--device", "cpu", "--synthetic-data"]
    kw = cli.trainer_kwargs(cli.build_parser().parse_args(
        base + ["--ckpt-interval", "100", "--ckpt-keep-n", "3", "--ckpt-major", "1000", "--continue",
                "--max-restarts", "5", "--skip-update-on-spike", "--spike-window", "16", "--spike-threshold", "4.5",
                "--step-timeout-s", "90", "--no-checkpoint-on-exit", "--allow-batch-change"]))
    assert kw["step_timeout_s"] == 90.0 and kw["checkpoint_on_exit"] is False and kw["allow_batch_change"] is True
    assert (kw["ckpt_interval"], kw["ckpt_keep_n"], kw["ckpt_major"], kw["resume"]) == (100, 3, 1000, "latest")
    assert (kw["max_restarts"], kw["skip_update_on_spike"], kw["spike_window"], kw["spike_threshold"]) == (5, True, 16, 4.5)
    for arg in ("12", "/some/ckpt/step_00000012"):
        assert cli.trainer_kwargs(cli.build_parser().parse_args(base + ["--continue", arg]))["resume"] == arg


def _micro_checkpoint(ckpt_dir: str, step: int) -> str:
    """A complete checkpoint of a model that is not the CLI's tiny preset (a 16-wide micro model)."""
    import torch

    from llmq_ray.checkpoints import resume as ck
    from llmq_ray.model.config import ModelConfig
    from llmq_ray.model.params import ParamLayout

    micro = ModelConfig("qwen2", 16, 32, 1, 2, 1, 64, tie_word_embeddings=True, qkv_bias=True, name="micro")
    n = ParamLayout(micro).numel
    state = {"master": torch.zeros(n), "m": torch.zeros(n), "v": torch.zeros(n)}
    return ck.save_checkpoint(ckpt_dir, step, [(0, n, state)], config=micro, keep_n=None)


def _cli_error(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_checkpoint_errors_are_one_sentence(tmp_path, capsys):
    """Checked before Ray starts: no checkpoint, a checkpoint of another model, a missing shard file; a
    newer incomplete folder is skipped with a warning."""
    base = ["--device", "cpu", "--model", "tiny", "--synthetic-data", "--out-dir", str(tmp_path)]
    err = _cli_error(base + ["--continue"], capsys)
    assert "--continue: no valid checkpoint in" in err and str(tmp_path / "ckpt") in err
    err = _cli_error(base + ["--continue", "7"], capsys)
    assert "there is no checkpoint step_00000007" in err

    folder = _micro_checkpoint(str(tmp_path / "ckpt"), 4)
    os.makedirs(tmp_path / "ckpt" / "step_00000009")  # incomplete (no manifest): skipped with a warning
    assert cli.main(base + ["--continue"]) == 2
    err = capsys.readouterr().err
    assert "warning: skipping checkpoint" in err and "step_00000009" in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "checkpoint step_00000004 was written for hidden_size=16, this run has" in lines[0]

    os.remove(os.path.join(folder, "rank_00000.safetensors"))
    err = _cli_error(base + ["--continue", folder], capsys)
    assert "is missing its shard file rank_00000.safetensors" in err

    err = _cli_error(base + ["--ckpt-keep-n", "0"], capsys)
    assert "--ckpt-keep-n=0 must be an integer >= 1" in err
    err = _cli_error(base + ["--ckpt-interval", "-1"], capsys)
    assert "--ckpt-interval=-1 must be an integer >= 0" in err


def test_glob_that_matches_nothing(tmp_path, capsys):
    assert cli.main(["--device", "cpu", "--train-file", str(tmp_path / "none-*.bin")]) == 2
    err = capsys.readouterr().err
    assert "none-*.bin" in err and err.count("\n") == 1


def test_pydoc_fallback_when_no_shakespeare(tmp_path, monkeypatch, capsys):
    """Without tiny-shakespeare and without a network, the default data is Python's pydoc topics."""
    from llmq_ray.data_pipeline import text_inputs
    from llmq_ray.train import default_data
    from llmq_ray.errors import DataError

    def missing():
        raise DataError("not here")

    monkeypatch.setattr(text_inputs, "tiny_shakespeare_path", missing)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    train, evalf, desc = default_data.default_dataset(eval_tokens=4096)
    out = capsys.readouterr().out
    assert "pydoc_data.topics" in out and desc.startswith("pydoc-topics")
    from llmq_ray.data_pipeline.sources import resolve_files

    assert resolve_files(train) and os.path.isfile(evalf)
    with open(os.path.join(os.path.dirname(evalf), "meta.json")) as f:
        assert json.load(f)["train_tokens"] > 50_000


def test_console_lines_have_llmq_shape():
    line = step_line(11, 100, 0.183, 1.2345, 6.1234, 44800.0, 0.451)
    assert line.startswith("[T] step    12 [ 12.0%]")
    for part in ("time:    183 ms", "norm   1.2345", "loss   6.1234", "tps   44.8k", "sol  45.1%"):
        assert part in line
    assert step_line(0, 1, 0.1, 1.0, 2.0, 10.0, None).endswith("sol     -")
    assert "[V] step    50" in eval_line(50, 100, 1.2, 5.4321, 8) and "eval loss   5.4321" in eval_line(50, 100, 1.2, 5.4321, 8)


def test_run_log_is_json_lines_appended_record_by_record(tmp_path):
    """Each record reaches the file as one line when it is added (no waiting for a flush); a last line cut short
    by a crash is skipped by read_log and cut off by a resumed run before it appends; a fresh run keeps an
    earlier log aside; an earlier version's single JSON list is read, and rewritten as lines on resume."""
    path = tmp_path / "sub" / "log.jsonl"
    path.parent.mkdir()
    log = RunLog(str(path))
    log.add("options", model="tiny")
    log.add("step", step=1, loss=1.0)  # step numbers as on the console: the first step is 1
    log.add("step", step=2, loss=float("nan"))
    lines = path.read_text().splitlines()
    assert [json.loads(x)["log"] for x in lines] == ["options", "step", "step"]  # before any flush()
    log.flush()
    with open(path, "a") as f:  # a crash while the next record was being written
        f.write('{"log": "step", "step": 3, "lo')
    assert [r.get("step") for r in read_log(str(path))] == [None, 1, 2]
    resumed = RunLog(str(path), resume=True)
    assert resumed.previous_last_step == 2
    resumed.add("resume", step=2)
    assert [r["log"] for r in read_log(str(path))] == ["options", "step", "step", "resume"]
    assert path.read_text().count("\n") == 4  # the cut line is gone, the new record on a line of its own
    with pytest.raises(ValueError, match=r"log.jsonl line 2 is not valid JSON"):
        bad = tmp_path / "bad" / "log.jsonl"
        bad.parent.mkdir()
        bad.write_text('{"log": "options"}\nnot json\n{"log": "end"}\n')
        read_log(str(bad))
    fresh = RunLog(str(path))
    fresh.add("options", model="next")
    assert fresh.set_aside and os.path.basename(fresh.set_aside).startswith("log.before-")
    assert [r["model"] for r in read_log(str(path))] == ["next"]
    assert len(read_log(fresh.set_aside)) == 4
    legacy = tmp_path / "old" / "log.json"
    legacy.parent.mkdir()
    legacy.write_text(json.dumps([{"log": "options", "model": "tiny"}, {"log": "step", "step": 1}]))
    assert len(read_log(str(legacy))) == 2
    RunLog(str(legacy), resume=True).add("resume", step=1)
    assert [json.loads(x)["log"] for x in legacy.read_text().splitlines()] == ["options", "step", "resume"]


def test_atomic_write_json_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "meta.json"
    atomic_write_json(str(path), {"a": 1})

    class Boom:
        def __repr__(self):
            raise RuntimeError("cannot serialize")

    with pytest.raises(RuntimeError):
        atomic_write_json(str(path), {"x": Boom()})
    assert json.load(open(path)) == {"a": 1} and os.listdir(tmp_path) == ["meta.json"]  # no temporary left


def test_sol_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "e4m3") == 1979.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("Some Future GPU") is None and peak_tflops(None) is None
    assert sol_fraction(100_000, 3e9, 989.0) == pytest.approx(100_000 * 3e9 / 989e12)
    assert sol_fraction(1.0, 1.0, None) is None


def test_every_setting_has_a_flag():
    """Every setting of the tree (every LLMQTrainer keyword) is a flag, and so is every old spelling of a choice."""
    from llmq_ray.settings import aliases, all_settings

    dests = {a.dest for a in cli.build_parser()._actions if a.option_strings}
    missing = sorted(({s.name for s in all_settings()} | set(aliases())) - dests)
    assert not missing, f"settings without a flag: {missing}"


def test_config_file_with_command_line_overrides_and_print_config(tmp_path, capsys):
    """--config x.toml --steps 5 --print-config: the file's settings, the flag on top, every resolved setting
    printed as TOML; that output is itself a config file that resolves to the same settings."""
    cfg = tmp_path / "x.toml"
    cfg.write_text('model = "tiny"\nsteps = 3\n[optim]\nlearning_rate = 1e-3\n[data]\nsynthetic_data = true\n'
                   'device = "cpu"\n')
    out = str(tmp_path / "out")
    assert cli.main(["--config", str(cfg), "--steps", "5", "--out-dir", out, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "\nsteps = 5\n" in printed and "\nlearning_rate = 0.001\n" in printed and '\nmodel = "tiny"\n' in printed
    again = tmp_path / "again.toml"
    again.write_text(printed)
    assert cli.main(["--config", str(again), "--print-config"]) == 0
    assert capsys.readouterr().out.split("\n")[1:] == printed.split("\n")[1:]  # the same, but the source line
    assert not os.path.exists(out)  # printing trains nothing and writes nothing
    # without --config (an AttributeError traceback before)
    assert cli.main(["--device", "cpu", "--synthetic-data", "--steps", "7", "--out-dir", out, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# resolved by llmq-ray; use it with --config\n") and "\nsteps = 7\n" in printed


def test_unknown_names_are_refused_with_the_closest_valid_one(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlearnig_rate = 3e-4\n")
    err = _cli_error(["--config", str(bad), "--device", "cpu", "--synthetic-data"], capsys)
    assert "[optim] 'learnig_rate' is not a setting (did you mean 'learning_rate'?)" in err
    with pytest.raises(SystemExit) as info:
        cli.main(["--learnig-rate", "3e-4"])
    assert info.value.code == 2
    assert "unrecognized argument --learnig-rate (did you mean '--learning-rate'?)" in capsys.readouterr().err
    (tmp_path / "twice.toml").write_text("steps = 3\n[optim]\nsteps = 4\n")
    err = _cli_error(["--config", str(tmp_path / "twice.toml")], capsys)
    assert "'steps' is given twice" in err


def test_a_periodic_eval_of_no_batches_and_a_negative_sample_are_refused(tmp_path, capsys):
    """--eval-num-steps 0 evaluated nothing and logged an eval loss of 0.0 at every --eval-every-n-steps."""
    base = ["--device", "cpu", "--model", "tiny", "--synthetic-data", "--out-dir", str(tmp_path)]
    err = _cli_error(base + ["--eval-num-steps", "0", "--eval-every-n-steps", "1"], capsys)
    assert err == ("error: --eval-num-steps=0 must be an integer >= 1 (the batches of each periodic eval; "
                   "--eval-every-n-steps 0 alone turns periodic evals off).")
    err = _cli_error(base + ["--eval-every-n-steps", "-1"], capsys)
    assert err == "error: --eval-every-n-steps=-1 must be an integer >= 0 (0: only the final eval)."
    # the command's own sample: a negative length printed nothing, silently
    err = _cli_error(base + ["--sample-tokens", "-1"], capsys)
    assert err == "error: --sample-tokens=-1 must be an integer >= 0 (0: no sample)."


def test_print_config_is_a_config_file_with_the_default_data(tmp_path, capsys):
    """`--print-config > run.toml` then `--config run.toml`: with the default data the "data: ..." line goes to
    stderr, so stdout is TOML alone; the run id is not pinned (a new one per run) and device/backend that stay
    "auto" until Ray starts say so; the file resolves to the same settings."""
    import tomllib

    out = str(tmp_path / "out")
    assert cli.main(["--device", "cpu", "--out-dir", out, "--steps", "3", "--print-config"]) == 0
    captured = capsys.readouterr()
    doc = tomllib.loads(captured.out)  # valid TOML: nothing but the settings on stdout
    assert "data: " in captured.err and "data: " not in captured.out
    assert doc["data"]["train_file"].endswith(".bin") and doc["optim"]["steps"] == 3
    assert "run_id" not in doc["observe"] and "# run_id = (a new one per run" in captured.out
    assert doc["parallel"]["device"] == "cpu" and doc["parallel"]["backend"] == "auto"
    assert 'backend = "auto"  # resolved when the run starts' in captured.out
    run = tmp_path / "run.toml"
    run.write_text(captured.out)
    assert cli.main(["--config", str(run), "--print-config"]) == 0
    again = capsys.readouterr().out
    assert again.split("\n")[1:] == captured.out.split("\n")[1:]  # the same settings (the first line names the file)


def test_help_lists_the_presets_and_uses_the_readme_spellings(capsys):
    """--help ends with the model presets; its usage line says --continue (the README's word), not --resume;
    every old spelling of a merged choice is still offered beside the choice."""
    from llmq_ray.model.config import PRESETS

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    epilog = text[text.index("model presets"):]
    assert all(name in epilog for name in PRESETS)
    usage = text[:text.index("\n\n")]
    assert "--continue" in usage and "--resume" not in usage
    for flag in ("--fp8-weight-copies", "--persistent-quants", "--transient-quants", "--offload-quants",
                 "--swiglu-fp8-scale", "--fp8-delayed-swiglu-scale", "--fp8-smooth-swiglu", "--zero-level",
                 "--shard-gradients", "--shard-weights"):
        assert flag in text, flag


def test_a_misspelt_flag_is_one_line_without_the_usage_block(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--batch-sise", "4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unrecognized argument --batch-sise (did you mean "
                                                   "'--batch-size'?)"), err


def test_every_flag_of_before_the_settings_redesign_is_still_offered():
    """The redesign merged choices and moved fields, but no spelling a user or a script had may go away: every
    option string of the command line before it (recorded in tests/data) is still accepted, with a value where it
    took one, and the old booleans of a merged choice land on that choice."""
    path = os.path.join(os.path.dirname(__file__), "data", "cli_flags_2026-12-01.txt")
    before = [x for x in open(path).read().split("\n") if x and not x.startswith("#")]
    actions = {o: a for a in cli.build_parser()._actions for o in a.option_strings}
    missing = [f for f in before if f not in actions]
    assert not missing and len(before) > 200, missing
    kw = cli.trainer_kwargs(cli.build_parser().parse_args(["--memory.transient_quants", "true",
                                                           "--parallel.shard_weights", "true"]))
    from llmq_ray.settings import make_settings

    s = make_settings(**kw)
    assert s.memory.fp8_weight_copies == "layer" and s.parallel.zero_level == 3
