"""GPT-2 (llm.c's model): the explicit forward/backward against transformers' GPT2LMHeadModel, the HF round trip,
training with the engine, FP8 and recompute, and the config refusals.

Ground truth: transformers' GPT2LMHeadModel in fp32 with random weights (LayerNorm weights and biases away from
1 / 0, so that their gradients matter), loss = mean cross-entropy over unmasked targets. Our gradients are sums
over target tokens, so they are divided by the target count before comparing. The presets' published configs are
checked by tests/test_preset_configs.py (tests/data/hf_configs/gpt2*/config.json).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import transformers
from _helpers import our_model_from_hf, random_batch, train_settings

from llmq_ray.backends import get_backend
from llmq_ray.engine.train_engine import TrainEngine
from llmq_ray.errors import ConfigError
from llmq_ray.model.config import PRESETS, config_from_hf_dict
from llmq_ray.model.generate import Generator
from llmq_ray.model.hf_io import export_hf, hf_state_dict, load_hf_weights
from llmq_ray.model.params import init_params
from llmq_ray.model import build_model
from llmq_ray.model.build import Recompute
from _helpers import checked_settings, train_settings

HF_KW = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=301, n_positions=64, bos_token_id=0, eos_token_id=0,
             architectures=["GPT2LMHeadModel"])
B, T = 2, 24
GRAD_COS, GRAD_REL = 0.99999, 1e-4  # every parameter's gradient, fp32, against transformers' autograd


def _random_hf_model(seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**HF_KW, **kw})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # LayerNorm weights away from 1 ...
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)  # ... and every bias (LayerNorm's too) away from 0
            else:
                p.normal_(0.0, 0.08)
    return model


def _our_model(hf_model, tmp_path, dtype=torch.float32, **kwargs):
    return our_model_from_hf(hf_model, tmp_path, B, T, dtype, **kwargs)


def _batch(vocab: int, seed: int = 1):
    return random_batch(vocab, B, T, seed)


def _cos_rel(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a, b = ours.double().flatten(), ref.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item(), ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    hf = _random_hf_model()
    return hf, _our_model(hf, tmp_path_factory.mktemp("gpt2"))


def test_logits_loss_and_every_gradient_match_transformers_fp32(hf_and_ours):
    hf, ours = hf_and_ours
    inputs, targets = _batch(ours.cfg.vocab_size)
    ours.zero_grads()
    ours.forward_backward(inputs, targets)
    count = ours.target_count.item()
    loss = ours.loss_sum.item() / count
    grads = hf_state_dict(ours.layout, ours.grads.float() / count)

    hf.zero_grad()
    logits = hf(inputs).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-100)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) / ref_loss.item() <= 1e-5, (loss, ref_loss.item())
    torch.testing.assert_close(ours.logits_for(inputs), logits.detach(), rtol=1e-4, atol=1e-4)
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, ref in ref_grads.items():
        cos, rel = _cos_rel(grads[name], ref)
        assert cos >= GRAD_COS and rel <= GRAD_REL, f"{name}: cosine {cos:.7f}, relative error {rel:.2e}"


def test_export_loads_in_transformers_with_our_logits_and_generation_matches(hf_and_ours, tmp_path):
    cfg = hf_and_ours[1].cfg
    ours = build_model(cfg, get_backend("torch"), batch=B, seq=T)
    init_params(ours.layout, ours.params, seed=5)  # our own weights (biases zero, LayerNorms one) ...
    gen = torch.Generator().manual_seed(9)
    ours.params[ours.layout.decay_end:ours.layout.numel].add_(
        0.3 * torch.randn(ours.layout.numel - ours.layout.decay_end, generator=gen))  # ... all of them nonzero
    inputs, _ = _batch(cfg.vocab_size, seed=4)
    want = ours.logits_for(inputs)
    folder = export_hf(str(tmp_path / "export"), cfg, ours.layout, ours.params, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        torch.testing.assert_close(hf(inputs).logits, want, rtol=1e-4, atol=1e-4)
    # and back: loading the export fills the same flat buffer, bit for bit
    again = torch.zeros_like(ours.params)
    load_hf_weights(folder, ours.layout, again)
    assert torch.equal(again, ours.params)
    # the KV-cache generator's prefill is the training forward's
    prefill = Generator(cfg, ours.layout, ours.params).prefill(inputs.tolist(), T + 4, all_logits=True)
    torch.testing.assert_close(prefill, want, rtol=1e-4, atol=1e-4)


def _saved(hf, tmp_path) -> str:
    hf.save_pretrained(tmp_path / "full")
    return str(tmp_path / "full")


def test_openai_style_checkpoint_without_the_prefix_and_with_mask_buffers_loads_silently(hf_and_ours, tmp_path):
    """OpenAI's published model.safetensors holds a bare GPT2Model's names ("h.0.attn.c_attn.weight",
    "wte.weight") and the causal-mask buffers "h.{l}.attn.bias"."""
    from safetensors.torch import save_file

    hf, ours = hf_and_ours
    tensors = {n: t.contiguous() for n, t in hf.transformer.state_dict().items()}
    assert "h.0.attn.c_attn.weight" in tensors and not any(n.startswith("transformer.") for n in tensors)
    for layer in range(hf.config.n_layer):
        tensors[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    (tmp_path / "bare").mkdir()
    save_file(tensors, str(tmp_path / "bare" / "model.safetensors"), metadata={"format": "pt"})
    flat, ref = torch.zeros_like(ours.params), torch.zeros_like(ours.params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_hf_weights(str(tmp_path / "bare"), ours.layout, flat)
    load_hf_weights(_saved(hf, tmp_path), ours.layout, ref)
    assert torch.equal(flat, ref)


@pytest.mark.parametrize("flag", ["norm", "swiglu", "ffn", "qkv", "att", "block"])
def test_recompute_is_bit_identical(hf_and_ours, flag, tmp_path):
    hf, base = hf_and_ours
    load_hf_weights(_saved(hf, tmp_path), base.layout, base.params)
    inputs, targets = _batch(base.cfg.vocab_size)
    base.zero_grads()
    base.forward_backward(inputs, targets)
    model = build_model(base.cfg, get_backend("torch"), batch=B, seq=T, params=base.params.clone(),
                       recompute=Recompute(**{flag: True}))
    model.zero_grads()
    model.forward_backward(inputs, targets)
    assert torch.equal(model.loss_sum, base.loss_sum) and torch.equal(model.grads, base.grads), flag
    assert model.activation_bytes()["per_layer"] < base.activation_bytes()["per_layer"]


def test_e4m3_gradients_follow_bf16(hf_and_ours, tmp_path):
    hf, _ = hf_and_ours
    runs = {}
    for mm in (None, "e4m3"):
        model = _our_model(hf, tmp_path / str(mm), dtype=torch.bfloat16, block_dtype=mm)
        inputs, targets = _batch(model.cfg.vocab_size)
        model.zero_grads()
        model.forward_backward(inputs, targets)
        runs[mm] = model
    l16, l8 = runs[None].loss_sum.item(), runs["e4m3"].loss_sum.item()
    assert runs["e4m3"].lin.fp8 and abs(l8 - l16) / l16 < 0.01, (l8, l16)
    for slot in runs[None].layout:
        cos, _ = _cos_rel(runs["e4m3"].grads[slot.offset:slot.end].float(), runs[None].grads[slot.offset:slot.end].float())
        assert cos >= 0.98, f"{slot.name}: e4m3 vs bf16 gradient cosine {cos:.4f}"


def test_tiny_gpt2_trains_with_the_engine():
    """20 steps on a repeating token pattern: the loss falls by half, and the position table and the LayerNorm
    biases (initialised to 0) move, so their gradients reach the optimizer."""
    cfg = PRESETS["tiny-gpt2"]
    opts = train_settings(model="tiny-gpt2", batch_size=4, seq_len=32, learning_rate=3e-3, seed=1)
    e = TrainEngine(cfg, opts, get_backend("torch"))
    pos, ln_b = e.layout.slots["pos_embed"], e.layout.slots["layers.0.ln1_b"]
    pos0 = e.params[pos.offset:pos.end].clone()
    assert torch.equal(e.params[ln_b.offset:ln_b.end], torch.zeros(cfg.hidden_size))
    x = (torch.arange(33) % 7 + 10).repeat(4, 1)
    losses = []
    for step in range(20):
        e.micro_step(x[:, :-1], x[:, 1:], last=True)
        losses.append(e.update(3e-3, step + 1).loss)
    assert losses[-1] < 0.5 * losses[0], losses
    assert not torch.equal(e.params[pos.offset:pos.end], pos0)
    assert not torch.equal(e.params[ln_b.offset:ln_b.end], torch.zeros(cfg.hidden_size))


def test_presets_have_the_published_parameter_counts():
    counts = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}
    for name, count in counts.items():
        assert PRESETS[name].num_parameters() == count, name
    cfg = PRESETS["gpt2"]
    assert dataclasses.replace(config_from_hf_dict(cfg.to_hf_dict()), name="gpt2") == cfg


@pytest.mark.parametrize("change, words", [
    ({"activation_function": "gelu"}, r"activation_function 'gelu' is not supported"),
    ({"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx=true is not supported\.$"),
    ({"reorder_and_upcast_attn": True}, r"reorder_and_upcast_attn=true is not supported\.$"),
])
def test_gpt2_variants_that_change_the_math_are_refused_in_one_sentence(change, words):
    with pytest.raises(ConfigError, match=words):
        config_from_hf_dict({**PRESETS["tiny-gpt2"].to_hf_dict(), **change}, source="g/config.json")


def test_what_gpt2_does_not_take_yet_is_refused():
    cfg = PRESETS["tiny-gpt2"]
    from llmq_ray.train.model_checks import check_model_settings

    with pytest.raises(ConfigError, match="GPT-2's GELU MLP does not take it"):  # the user's sentence, before Ray
        check_model_settings(cfg, train_settings(model="tiny-gpt2", matmul_dtype="e4m3", swiglu_fp8_scale="delayed"))
    with pytest.raises(ValueError, match="GPT-2's GELU MLP has no SwiGLU"):  # the model's own assertion
        build_model(cfg, get_backend("torch"), batch=1, seq=8, block_dtype="e4m3",
                    swiglu_scale="delayed")
    with pytest.raises(ValueError, match="is longer than the model's 256 positions"):
        build_model(cfg, get_backend("torch"), batch=1, seq=cfg.max_position_embeddings + 1)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_vocabulary_padded_inside_the_head_gives_the_unpadded_loss_and_gradients(chunks):
    """GPT-2's vocabulary (here 100) is padded to a multiple of 64 inside the model-dtype LM head (its rows would
    not be 16-byte aligned for cuBLAS): losses, dx and dW (accumulated onto what dW held) equal torch autograd's
    cross-entropy over the unpadded logits within 1e-6 relative (fp32), a masked row (-100) gives 0 loss and 0 dx,
    and the padded logits' gradient is exactly 0."""
    from llmq_ray.model.layers.lm_head import LMHead

    be = get_backend("torch", torch.device("cpu"))
    n, c, v = 8, 16, 100
    head = LMHead(be, v, c, n // chunks, chunks, torch.float32, fp8=False)
    assert head.logits.shape == (n // chunks, 128)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, c, generator=gen), torch.randn(v, c, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[3] = -100
    dw0 = torch.randn(v, c, generator=gen)
    losses, dx, dw = torch.empty(n), torch.empty(n, c), dw0.clone()
    head.run(x, w, losses, targets, dx, dw)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(xr @ wr.t(), targets, reduction="none", ignore_index=-100)
    want.sum().backward()
    for name, got, ref in (("losses", losses, want.detach()), ("dx", dx, xr.grad), ("dw", dw, dw0 + wr.grad)):
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-6, f"{name}: max relative difference {err:.2e}"
    assert losses[3] == 0 and (dx[3] == 0).all()
    assert (head.logits[:, v:] == 0).all()  # dlogits of the padded columns (the last chunk's)
