"""The explicit forward/backward (torch reference backend) against transformers' autograd models.

Ground truth: transformers' Qwen2ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM in fp32 with the same random weights, loss =
mean cross-entropy over unmasked targets (ignore_index -100). Our model's gradients are sums over target
tokens (see llmq_ray/model/decoder.py), so they are divided by the target count before comparing.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from _helpers import our_model_from_hf, random_batch, train_settings

from llmq_ray.model.hf_io import export_hf, hf_state_dict
from llmq_ray.model import build_model
from llmq_ray.model.build import Recompute

# Shapes: GQA and MHA, tied and untied heads, odd sizes, llama3 and linear rope scaling.
HF_CASES = {
    "qwen2-gqa-untied-odd": (transformers.Qwen2Config, dict(
        hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False, rope_theta=10000.0), "Qwen2ForCausalLM"),
    "qwen2-mha-tied": (transformers.Qwen2Config, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=512, tie_word_embeddings=True, rope_theta=1e6), "Qwen2ForCausalLM"),
    "llama-gqa-tied-rope-scaling": (transformers.LlamaConfig, dict(
        hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, vocab_size=1000, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}), "LlamaForCausalLM"),
    # Qwen3: QK-norm, no QKV bias, head_dim independent of hidden / heads (32 x 6 = 192 != 96)
    "qwen3-gqa-tied-wide-heads": (transformers.Qwen3Config, dict(
        hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=32, vocab_size=1000, tie_word_embeddings=True, rope_theta=1e6), "Qwen3ForCausalLM"),
    "qwen3-gqa-untied-narrow-heads": (transformers.Qwen3Config, dict(
        hidden_size=128, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=777, tie_word_embeddings=False, rope_theta=10000.0), "Qwen3ForCausalLM"),
    "llama-gqa-untied": (transformers.LlamaConfig, dict(
        hidden_size=80, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=777, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "linear", "factor": 4.0}), "LlamaForCausalLM"),
}
B, T = 2, 24


def _random_hf_model(case: str, seed: int = 0):
    cls, kwargs, arch = HF_CASES[case]
    hf_cfg = cls(**kwargs, architectures=[arch])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # norm weights away from 1 so their grads matter
            else:
                p.normal_(0.0, 0.08)
    return model


def _our_model(hf_model, tmp_path, dtype=torch.float32, **kwargs):
    return our_model_from_hf(hf_model, tmp_path, B, T, dtype, **kwargs)


def _batch(vocab: int, seed: int = 1):
    return random_batch(vocab, B, T, seed)


def _our_grads(model, inputs, targets):
    model.zero_grads()
    model.forward_backward(inputs, targets)
    count = model.target_count.item()
    loss = model.loss_sum.item() / count
    grads = hf_state_dict(model.layout, model.grads.float() / count)
    return loss, grads


def _hf_grads(hf_model, inputs, targets):
    hf_model.zero_grad()
    logits = hf_model(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in hf_model.named_parameters()}


def _cos_rel(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a, b = ours.double().flatten(), ref.double().flatten()
    cos = (a @ b / (a.norm() * b.norm())).item()
    rel = ((a - b).norm() / b.norm()).item()
    return cos, rel


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_loss_and_every_gradient_match_transformers_fp32(case, tmp_path):
    hf = _random_hf_model(case)
    ours = _our_model(hf, tmp_path)
    inputs, targets = _batch(ours.cfg.vocab_size)
    loss, grads = _our_grads(ours, inputs, targets)
    ref_loss, ref_grads = _hf_grads(hf, inputs, targets)
    assert abs(loss - ref_loss) / ref_loss <= 1e-5, (loss, ref_loss)
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, ref in ref_grads.items():
        cos, rel = _cos_rel(grads[name], ref)
        assert cos >= 0.99999 and rel <= 1e-4, f"{name}: cosine {cos:.7f}, relative error {rel:.2e}"


@pytest.mark.parametrize("case", ["qwen2-gqa-untied-odd", "llama-gqa-tied-rope-scaling", "qwen3-gqa-tied-wide-heads"])
def test_bf16_gradients_follow_fp32(case, tmp_path):
    hf = _random_hf_model(case)
    fp32 = _our_model(hf, tmp_path / "a")
    bf16 = _our_model(hf, tmp_path / "b", dtype=torch.bfloat16)
    inputs, targets = _batch(fp32.cfg.vocab_size)
    loss32, g32 = _our_grads(fp32, inputs, targets)
    loss16, g16 = _our_grads(bf16, inputs, targets)
    assert abs(loss16 - loss32) / loss32 < 1e-2
    for name, ref in g32.items():
        cos, _ = _cos_rel(g16[name], ref)
        assert cos >= 0.99, f"{name}: bf16 vs fp32 gradient cosine {cos:.5f}"


RECOMPUTE_FLAGS = ["swiglu", "norm", "ffn", "qkv", "att", "block"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_flags_are_bit_identical_and_save_memory(dtype, tmp_path):
    hf = _random_hf_model("qwen2-gqa-untied-odd")
    base = _our_model(hf, tmp_path / "base", dtype=dtype)
    inputs, targets = _batch(base.cfg.vocab_size)
    base.zero_grads()
    base.forward_backward(inputs, targets)
    base_bytes = base.activation_bytes()["per_layer"]
    report = {"none": base_bytes}
    for flag in RECOMPUTE_FLAGS:
        model = _our_model(hf, tmp_path / flag, dtype=dtype, recompute=Recompute(**{flag: True}))
        model.zero_grads()
        model.forward_backward(inputs, targets)
        assert torch.equal(model.loss_sum, base.loss_sum), flag
        assert torch.equal(model.grads, base.grads), f"--recompute-{flag} changed the gradients"
        report[flag] = model.activation_bytes()["per_layer"]
        assert report[flag] < base_bytes, f"--recompute-{flag} did not shrink activation memory"
    print("activation bytes per layer:", report)
    # implications make the bigger flags save at least as much as the ones they imply
    assert report["ffn"] < report["swiglu"]
    assert report["att"] < report["qkv"]
    assert report["block"] < min(report[f] for f in RECOMPUTE_FLAGS if f != "block")


def test_lmhead_chunks_agree(tmp_path):
    hf = _random_hf_model("qwen2-mha-tied")
    one = _our_model(hf, tmp_path / "1")
    four = _our_model(hf, tmp_path / "4", head_chunks=4)
    inputs, targets = _batch(one.cfg.vocab_size)
    loss1, g1 = _our_grads(one, inputs, targets)
    loss4, g4 = _our_grads(four, inputs, targets)
    assert abs(loss1 - loss4) / loss1 <= 1e-6
    for name, ref in g1.items():
        err = ((g4[name] - ref).norm() / ref.norm()).item()
        assert err <= 1e-6, f"{name}: lmhead-chunks 4 vs 1 relative error {err:.2e}"


@pytest.mark.parametrize("case", ["qwen2-gqa-untied-odd", "llama-gqa-tied-rope-scaling",
                                  "qwen3-gqa-untied-narrow-heads"])
def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
    hf = _random_hf_model(case)
    ours = _our_model(hf, tmp_path)
    # change the weights so the export can't pass by echoing the import
    gen = torch.Generator().manual_seed(5)
    ours.params.add_(0.01 * torch.randn(ours.params.shape, generator=gen))
    inputs, _ = _batch(ours.cfg.vocab_size)
    our_logits = ours.logits_for(inputs)
    out = export_hf(str(tmp_path / "export"), ours.cfg, ours.layout, ours.params, dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = loaded(inputs).logits
    err = ((our_logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert err <= 1e-5, f"exported model's logits differ by {err:.2e} (relative to max |logit|)"


def test_bad_batch_shape_is_a_clear_error(tmp_path):
    hf = _random_hf_model("qwen2-mha-tied")
    ours = _our_model(hf, tmp_path)
    with pytest.raises(ValueError, match=r"batch must be \(2, 24\)"):
        ours.forward_backward(torch.zeros(2, 23, dtype=torch.long), torch.zeros(2, 23, dtype=torch.long))


def _gpt2_hf_model():
    from test_gpt2 import _random_hf_model as random_gpt2

    return random_gpt2()  # vocabulary 301: the padded LM head (llmq_ray/model/layers/lm_head.py) trains here too


@pytest.mark.parametrize("family", ["qwen3-gqa-untied-narrow-heads", "llama-gqa-tied-rope-scaling", "gpt2"])
def test_hf_round_trip_load_train_two_steps_export_and_transformers_gives_our_logits(family, tmp_path):
    """The fine-tuning round trip as the workers run it: an HF folder loaded into a TrainEngine (fp32), two
    AdamW steps, the export loaded by transformers: its logits equal ours within 1e-5 relative to the largest,
    and the steps changed the weights (the export cannot pass by echoing the import)."""
    from llmq_ray.backends import get_backend
    from llmq_ray.engine.train_engine import TrainEngine
    from llmq_ray.model.config import config_from_hf_dict
    from llmq_ray.model.hf_io import load_hf_weights

    hf = _gpt2_hf_model() if family == "gpt2" else _random_hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    cfg = config_from_hf_dict(hf.config.to_dict())
    opts = train_settings(model=str(tmp_path / "hf"), batch_size=B, seq_len=T, model_dtype="fp32",
                        master_dtype="fp32", opt_m_dtype="fp32", opt_v_dtype="fp32", learning_rate=1e-2)
    engine = TrainEngine(cfg, opts, get_backend("torch"), init_weights=False)
    load_hf_weights(str(tmp_path / "hf"), engine.layout, engine.params)
    engine.reset_optimizer_from_params()
    before = engine.full_params().clone()
    for step in range(2):
        engine.micro_step(*_batch(cfg.vocab_size, seed=10 + step), last=True)
        engine.update(1e-2, step + 1)
    after = engine.full_params()
    assert (after - before).abs().max() > 1e-3
    inputs, _ = _batch(cfg.vocab_size, seed=3)
    ours = engine.model.logits_for(inputs)
    folder = export_hf(str(tmp_path / "export"), cfg, engine.layout, after, dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = loaded(inputs).logits
    err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert err <= 1e-5, f"{family}: the exported model's logits differ by {err:.2e} (relative to max |logit|)"
