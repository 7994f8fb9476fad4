"""HF weights in and out (llmq_ray.model.hf_io) against real transformers models, plus HF config parsing.

Tiny random Qwen2 / Llama models (odd sizes, GQA, tied and untied heads) are built with transformers and
saved with ``save_pretrained``; every parameter is randomized (HF would init norms to 1 and biases to 0,
which would hide a swapped mapping). Comparisons are exact: loading and exporting only move bits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from llmq_ray.model.config import config_from_hf_dict, load_hf_config  # noqa: E402
from llmq_ray.errors import CheckpointError, ConfigError  # noqa: E402
from llmq_ray.model.hf_io import export_hf, hf_state_dict, hf_tensor_map, load_hf_weights  # noqa: E402
from llmq_ray.model.params import ParamLayout  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _qwen_tied():
    cfg = transformers.Qwen2Config(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, vocab_size=1000,
                                   tie_word_embeddings=True, rope_theta=123456.0, rms_norm_eps=1e-6,
                                   max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    return _randomize(transformers.Qwen2ForCausalLM(cfg), 0)


def _qwen_untied():
    cfg = transformers.Qwen2Config(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, vocab_size=1000,
                                   tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=512,
                                   bos_token_id=5, eos_token_id=7)
    return _randomize(transformers.Qwen2ForCausalLM(cfg), 1)


def _llama_untied():
    # head_dim 32 != hidden / heads (24): out_w is [C, Hq*D] = [96, 128], not square.
    cfg = transformers.LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1003,
                                   tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   rope_scaling=dict(LLAMA3_SCALING), max_position_embeddings=256,
                                   bos_token_id=0, eos_token_id=3)
    return _randomize(transformers.LlamaForCausalLM(cfg), 2)


def _llama_tied():
    cfg = transformers.LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, vocab_size=1000,
                                   tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=256)
    return _randomize(transformers.LlamaForCausalLM(cfg), 3)


BUILDERS = {"qwen_tied": _qwen_tied, "qwen_untied": _qwen_untied, "llama_untied": _llama_untied,
            "llama_tied": _llama_tied}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (folder with the saved fp32 HF model, {hf name: tensor} of that model)."""
    out = {}
    for name, build in BUILDERS.items():
        model = build()
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (str(folder), {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _load(folder, cfg=None, dtype=torch.float32):
    cfg = cfg or load_hf_config(folder)
    layout = ParamLayout(cfg)
    flat = torch.full((layout.numel,), float("nan"), dtype=dtype)
    load_hf_weights(folder, layout, flat)
    return cfg, layout, flat


def _expected_views(cfg, sd):
    """Our views written out by hand from the HF state dict (independent of hf_tensor_map)."""
    exp = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        exp["lm_head"] = sd["lm_head.weight"]
    for layer in range(cfg.num_layers):
        a, m, o = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp.", f"layers.{layer}."
        exp[o + "qkv_w"] = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]])
        if cfg.qkv_bias:
            exp[o + "qkv_b"] = torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]])
        exp[o + "out_w"] = sd[a + "o_proj.weight"]
        exp[o + "up_gate_w"] = torch.cat([sd[m + "up_proj.weight"], sd[m + "gate_proj.weight"]])
        exp[o + "down_w"] = sd[m + "down_proj.weight"]
        exp[o + "ln1_w"] = sd[f"model.layers.{layer}.input_layernorm.weight"]
        exp[o + "ln2_w"] = sd[f"model.layers.{layer}.post_attention_layernorm.weight"]
    return exp


def _assert_views_equal(layout, flat, expected_views):
    views = layout.views(flat)
    assert set(views) == set(expected_views)
    for name, want in expected_views.items():
        assert views[name].dtype == flat.dtype
        assert torch.equal(views[name], want.to(flat.dtype)), name


# ====================================================================================== name map

@pytest.mark.parametrize("which", list(BUILDERS))
def test_name_map_matches_transformers_and_covers_every_row_once(saved, which):
    folder, sd = saved[which]
    cfg = load_hf_config(folder)
    layout = ParamLayout(cfg)
    table = hf_tensor_map(layout)
    hf_names = set(sd) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(table) == hf_names
    for name, t in table.items():
        assert t.shape == tuple(sd[name].shape), name
    for slot in layout:
        ranges = sorted((t.row_start, t.row_end) for t in table.values() if t.slot == slot.name)
        assert ranges[0][0] == 0 and ranges[-1][1] == slot.shape[0], slot.name
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), slot.name  # no gap, no overlap


# ====================================================================================== import

@pytest.mark.parametrize("which", list(BUILDERS))
def test_import_fills_every_view_with_its_hf_tensor(saved, which):
    folder, sd = saved[which]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean transformers checkpoint has nothing to warn about
        cfg, layout, flat = _load(folder)
    assert not torch.isnan(flat).any()
    _assert_views_equal(layout, flat, _expected_views(cfg, sd))


def test_import_accepts_file_paths_and_a_larger_buffer(saved):
    folder, sd = saved["qwen_untied"]
    cfg = load_hf_config(folder)
    layout = ParamLayout(cfg)
    flat = torch.zeros(layout.numel + 7)  # ZeRO pads the flat buffer to a multiple of the world size
    load_hf_weights(os.path.join(folder, "model.safetensors"), layout, flat)
    _assert_views_equal(layout, flat, _expected_views(cfg, sd))
    assert torch.equal(flat[layout.numel:], torch.zeros(7))


def test_sharded_checkpoint_imports_identically(saved, tmp_path):
    folder, sd = saved["llama_untied"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") and len(shards) > 2
    _, _, flat_single = _load(folder)
    cfg, layout, flat_sharded = _load(str(tmp_path))
    assert torch.equal(flat_single, flat_sharded)
    _assert_views_equal(layout, flat_sharded, _expected_views(cfg, sd))
    # The index file itself is accepted as the path too.
    flat2 = torch.zeros(layout.numel)
    load_hf_weights(str(tmp_path / "model.safetensors.index.json"), layout, flat2)
    assert torch.equal(flat2, flat_single)


def test_bf16_checkpoint_casts_into_fp32_buffer_and_back(saved, tmp_path):
    folder, sd = saved["qwen_tied"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    cfg, layout, flat = _load(str(tmp_path), dtype=torch.float32)
    assert flat.dtype == torch.float32
    _assert_views_equal(layout, flat, {k: v.to(torch.bfloat16).float() for k, v in _expected_views(cfg, sd).items()})
    # fp32 checkpoint into a bf16 buffer rounds like .to(bfloat16).
    _, _, flat16 = _load(folder, dtype=torch.bfloat16)
    _assert_views_equal(layout, flat16, {k: v.to(torch.bfloat16) for k, v in _expected_views(cfg, sd).items()})


# ====================================================================================== export

@pytest.mark.parametrize("which", list(BUILDERS))
def test_export_loads_in_transformers_with_identical_weights_and_config(saved, which, tmp_path):
    folder, sd = saved[which]
    cfg, layout, flat = _load(folder)
    out = export_hf(str(tmp_path / "export"), cfg, layout, flat, dtype=torch.float32)
    assert out == str(tmp_path / "export")
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporary folder left behind

    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    got = model.state_dict()
    assert set(got) == set(sd)
    for name, want in sd.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want), name
    if cfg.tie_word_embeddings:
        assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()

    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config_from_hf_dict(config) == dataclasses.replace(cfg, name="config.json")
    assert dataclasses.replace(load_hf_config(out), name=cfg.name) == cfg
    with open(os.path.join(out, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen.get("bos_token_id") == cfg.bos_token_id and gen.get("eos_token_id") == cfg.eos_token_id
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not cfg.tie_word_embeddings)
        assert f.metadata() == {"format": "pt"}


def test_export_bf16_matches_rounded_weights(saved, tmp_path):
    folder, sd = saved["llama_untied"]
    cfg, layout, flat = _load(folder)
    out = export_hf(str(tmp_path / "bf16"), cfg, layout, flat)  # bf16 is the default
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    got = model.state_dict()
    for name, want in sd.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], want.to(torch.bfloat16)), name
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.rope_parameters["factor"] == LLAMA3_SCALING["factor"]


def test_export_shards_above_max_shard_bytes(saved, tmp_path):
    folder, sd = saved["qwen_untied"]
    cfg, layout, flat = _load(folder)
    out = export_hf(str(tmp_path / "sharded"), cfg, layout, flat, dtype=torch.float32, max_shard_bytes=100_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and "model.safetensors" not in files
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in sd.values())
    got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    layout2 = ParamLayout(load_hf_config(out))
    flat2 = torch.zeros(layout2.numel)
    load_hf_weights(out, layout2, flat2)
    assert torch.equal(flat2, flat)


def test_hf_state_dict_copies_do_not_alias_the_buffer(saved):
    folder, _ = saved["qwen_tied"]
    _, layout, flat = _load(folder)
    before = flat.clone()
    sd = hf_state_dict(layout, flat)
    for t in sd.values():
        t.zero_()
    assert torch.equal(flat, before)


def test_export_replaces_an_existing_export_only_when_complete(saved, tmp_path, monkeypatch):
    import llmq_ray.model.hf_io as hf_io

    folder, sd = saved["qwen_tied"]
    cfg, layout, flat = _load(folder)
    target = tmp_path / "out"
    export_hf(str(target), cfg, layout, flat, dtype=torch.float32)
    (target / "stale.txt").write_text("from an older export")
    snapshot = {f: (target / f).read_bytes() for f in os.listdir(target)}

    # An export that dies after the weights are written leaves the old folder untouched and no debris.
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_io, "_write_json", boom)
    with pytest.raises(OSError, match="disk full"):
        export_hf(str(target), cfg, layout, flat * 2, dtype=torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert {f: (target / f).read_bytes() for f in os.listdir(target)} == snapshot
    # The same failure on a fresh target leaves nothing at all.
    with pytest.raises(OSError):
        export_hf(str(tmp_path / "fresh"), cfg, layout, flat, dtype=torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    monkeypatch.undo()

    export_hf(str(target), cfg, layout, flat * 2, dtype=torch.float32)
    assert not (target / "stale.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]
    got = load_file(str(target / "model.safetensors"))
    assert torch.equal(got["model.norm.weight"], sd["model.norm.weight"] * 2)


def test_export_refuses_to_replace_a_folder_that_is_not_a_model(saved, tmp_path):
    folder, _ = saved["qwen_tied"]
    cfg, layout, flat = _load(folder)
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        export_hf(str(tmp_path), cfg, layout, flat)
    assert (tmp_path / "notes.txt").read_text() == "precious"


def test_export_rejects_bad_arguments(saved, tmp_path):
    folder, _ = saved["qwen_tied"]
    cfg, layout, flat = _load(folder)
    with pytest.raises(ConfigError, match="int8"):
        export_hf(str(tmp_path / "a"), cfg, layout, flat, dtype=torch.int8)
    with pytest.raises(ValueError, match="layout"):
        export_hf(str(tmp_path / "b"), dataclasses.replace(cfg, num_layers=3), layout, flat)
    with pytest.raises(ConfigError, match="tokenizer source"):
        export_hf(str(tmp_path / "c"), cfg, layout, flat, tokenizer_source=str(tmp_path / "nope"))
    assert os.listdir(tmp_path) == []


def test_export_copies_tokenizer_files(saved, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(20)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    tok_dir = tmp_path / "tok"
    fast.save_pretrained(tok_dir)
    folder, _ = saved["qwen_tied"]
    cfg, layout, flat = _load(folder)
    out = export_hf(str(tmp_path / "out"), cfg, layout, flat, tokenizer_source=str(tok_dir))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / f).read_bytes() == (tok_dir / f).read_bytes()
    # (Not AutoTokenizer: transformers 5 picks the tokenizer class from config.json's model_type, and this
    # toy word-level tokenizer is no Qwen2 BPE.)
    loaded = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert loaded("w3 w7 zz")["input_ids"] == [6, 10, 0]


# ====================================================================================== load errors

def _rewrite(src_folder, dst, edit):
    """Copy the single-file checkpoint of src_folder to dst/model.safetensors after edit(tensors)."""
    tensors = load_file(os.path.join(src_folder, "model.safetensors"))
    edit(tensors)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_missing_tensor_names_file_and_tensor(saved, tmp_path):
    folder, _ = saved["llama_untied"]
    cfg = load_hf_config(folder)
    bad = _rewrite(folder, tmp_path, lambda t: t.pop("model.layers.1.mlp.gate_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'model\.layers\.1\.mlp\.gate_proj\.weight'.*"
                                              r"\[200, 96\] is missing"):
        _load(bad, cfg)


def test_untied_model_without_lm_head_is_a_clear_error(saved):
    folder, _ = saved["qwen_tied"]
    cfg = dataclasses.replace(load_hf_config(folder), tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight'.*missing.*tie_word_embeddings=false"):
        _load(folder, cfg)


def test_wrong_shape_says_expected_and_found(saved, tmp_path):
    folder, _ = saved["qwen_tied"]
    cfg = load_hf_config(folder)
    bad = _rewrite(folder, tmp_path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 96)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight'"
                                              r" has shape \[48, 96\], expected \[32, 96\]"):
        _load(bad, cfg)
    # A config of another size than the checkpoint fails the same way, on the first tensor it reads.
    with pytest.raises(CheckpointError, match=r"'model\.embed_tokens\.weight' has shape \[1000, 96\], expected \[1001, 96\]"):
        _load(folder, dataclasses.replace(cfg, vocab_size=1001))


def test_non_float_tensor_is_rejected(saved, tmp_path):
    folder, _ = saved["qwen_tied"]
    bad = _rewrite(folder, tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(96, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype torch\.int8"):
        _load(bad, load_hf_config(folder))


def test_index_naming_a_missing_shard(saved, tmp_path):
    folder, _ = saved["qwen_untied"]
    transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(tmp_path, max_shard_size="50KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(tmp_path / shard)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json: shard file '{shard}'.*does not exist"):
        _load(str(tmp_path), load_hf_config(folder))


def test_folder_without_safetensors(tmp_path, saved):
    layout = ParamLayout(load_hf_config(saved["qwen_tied"][0]))
    flat = torch.zeros(layout.numel)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: no safetensors file found"):
        load_hf_weights(str(tmp_path), layout, flat)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="pickled .bin/.pt weights are never loaded"):
        load_hf_weights(str(tmp_path), layout, flat)
    with pytest.raises(CheckpointError, match="no such safetensors file"):
        load_hf_weights(str(tmp_path / "missing.safetensors"), layout, flat)


def test_corrupt_safetensors_file(tmp_path, saved):
    layout = ParamLayout(load_hf_config(saved["qwen_tied"][0]))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot be read as safetensors"):
        load_hf_weights(str(tmp_path), layout, torch.zeros(layout.numel))


def test_extra_tensors_warn_but_rotary_buffers_are_silent(saved, tmp_path):
    folder, sd = saved["qwen_tied"]
    cfg = load_hf_config(folder)
    rotary = _rewrite(folder, tmp_path / "rotary", lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _load(rotary, cfg)
    extra = _rewrite(folder, tmp_path / "extra", lambda t: t.update({"model.vision_tower.weight": torch.ones(3)}))
    with pytest.warns(UserWarning, match=r"ignoring 1 tensor.*'?model\.vision_tower\.weight"):
        _, layout, flat = _load(extra, cfg)
    _assert_views_equal(layout, flat, _expected_views(cfg, sd))


def test_tied_model_ignores_a_checkpoint_lm_head(saved, tmp_path):
    folder, sd = saved["qwen_tied"]
    cfg = load_hf_config(folder)
    same = _rewrite(folder, tmp_path / "same", lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, layout, flat = _load(same, cfg)
    _assert_views_equal(layout, flat, _expected_views(cfg, sd))
    differs = _rewrite(folder, tmp_path / "differs", lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.warns(UserWarning, match="lm_head.weight' differs"):
        _, layout, flat = _load(differs, cfg)
    _assert_views_equal(layout, flat, _expected_views(cfg, sd))  # the embedding wins


# ====================================================================================== config parsing

def test_load_hf_config_reads_a_transformers_5_config(saved):
    qwen = load_hf_config(saved["qwen_tied"][0])
    raw = json.load(open(os.path.join(saved["qwen_tied"][0], "config.json")))
    # transformers 5 nests rope_theta under rope_parameters; it must not fall back to the default.
    assert "rope_theta" not in raw or raw.get("rope_parameters")
    assert qwen.rope_theta == 123456.0 and qwen.rope_scaling is None
    assert (qwen.architecture, qwen.hidden_size, qwen.intermediate_size, qwen.num_layers) == ("qwen2", 96, 200, 2)
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.head_dim, qwen.vocab_size) == (6, 2, 16, 1000)
    assert qwen.qkv_bias and qwen.tie_word_embeddings
    assert (qwen.bos_token_id, qwen.eos_token_id, qwen.max_position_embeddings) == (1, 2, 512)

    llama = load_hf_config(saved["llama_untied"][0])
    assert llama.rope_theta == 500000.0 and llama.rope_scaling == LLAMA3_SCALING
    assert (llama.architecture, llama.head_dim, llama.num_layers, llama.vocab_size) == ("llama", 32, 3, 1003)
    assert not llama.qkv_bias and not llama.tie_word_embeddings and llama.rms_norm_eps == 1e-5
    assert llama.name == os.path.basename(saved["llama_untied"][0])


def test_config_errors_name_the_problem(saved):
    raw = json.load(open(os.path.join(saved["qwen_tied"][0], "config.json")))
    with pytest.raises(ConfigError, match=r"my/config\.json: architecture 'MistralForCausalLM' is not supported"):
        config_from_hf_dict({**raw, "architectures": ["MistralForCausalLM"]}, source="my/config.json")
    without = {k: v for k, v in raw.items() if k != "intermediate_size"}
    with pytest.raises(ConfigError, match=r"required key 'intermediate_size' is missing"):
        config_from_hf_dict(without)
    with pytest.raises(ConfigError, match="no 'architectures' entry"):
        config_from_hf_dict({k: v for k, v in raw.items() if k != "architectures"})
    llama = json.load(open(os.path.join(saved["llama_untied"][0], "config.json")))
    with pytest.raises(ConfigError, match="attention_bias=true is not supported"):
        config_from_hf_dict({**llama, "attention_bias": True})
    with pytest.raises(ConfigError, match="no such config file"):
        load_hf_config("/nonexistent/folder")
