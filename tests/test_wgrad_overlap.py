"""The block wgrads on a side stream (llmq_ray/wgrad_overlap.py), checked on the CPU.

On the CPU ``defer`` runs each wgrad as late as an in-order side stream could: only when the model waits for it
(or for one submitted after it). Every buffer a pending wgrad reads must then still hold its value, so a wait
the model lacks shows as gradients that differ from the plain backward's. Same kernels, same order of each
sum: the gradients must be bit-identical. On the GPU (``-m gpu``): the real side stream under CUDA graphs
replays the eager bits, and against the plain backward the results differ only by the wgrads' algorithm.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import perturb_norms_and_biases
from backends import get_backend
from llmq_ray.config import PRESETS
from llmq_ray.errors import ConfigError
from llmq_ray.model import LlamaModel, RecomputeOptions
from llmq_ray.params import init_params
from llmq_ray.wgrad_overlap import WgradOverlap

CFG = PRESETS["tiny"]
B, T = 2, 16


def _model(overlap: bool, recompute: RecomputeOptions = RecomputeOptions()) -> LlamaModel:
    model = LlamaModel(CFG, get_backend("torch"), batch_size=B, seq_len=T, dtype=torch.float32, recompute=recompute)
    init_params(model.layout, model.params, seed=7)
    perturb_norms_and_biases(model)
    if overlap:
        model.enable_wgrad_overlap(sm_count=100, defer=True)
    return model


def _grads(model: LlamaModel, micro_steps: int = 2):
    gen = torch.Generator().manual_seed(5)
    model.zero_grads()
    for _ in range(micro_steps):  # the second micro-step accumulates into the gradients
        tokens = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        if model.lin.overlap is not None:
            assert model.lin.overlap.pending == []  # joined at the end of every micro-step
    return model.grads.clone(), (model.loss_sum / model.target_count).item()


@pytest.mark.parametrize("recompute", [RecomputeOptions(), RecomputeOptions(block=True).resolved()],
                         ids=["stored", "recompute-block"])
def test_deferred_wgrads_give_the_same_gradients(recompute):
    g_plain, loss_plain = _grads(_model(False, recompute))
    model = _model(True, recompute)
    g_overlap, loss_overlap = _grads(model)
    assert model.lin.overlap.submitted == 2 * 4 * CFG.num_layers
    assert loss_overlap == loss_plain
    assert torch.equal(g_overlap, g_plain)


@pytest.mark.parametrize("dropped", ["down_w", "out_w"])
def test_a_missing_wait_is_caught(dropped):
    """The check above can fail: without the wait before an RMSNorm backward overwrites d_residual in place, the
    deferred down (or attention-out) wgrad reads the overwritten gradient. (The waits for up_gate_w and qkv_w
    are implied by these two when nothing is recomputed: the side stream runs in order.)"""
    g_plain, _ = _grads(_model(False), micro_steps=1)
    model = _model(True)
    real_wait = model._wait_wgrad
    model._wait_wgrad = lambda *names: real_wait(*(n for n in names if n != dropped))
    g_missing, _ = _grads(model, micro_steps=1)
    assert not torch.equal(g_missing, g_plain)


def test_only_for_the_model_dtype_path():
    model = LlamaModel(CFG, get_backend("torch"), batch_size=B, seq_len=T, dtype=torch.bfloat16,
                       matmul_dtype="e4m3")
    with pytest.raises(ConfigError, match="e4m3"):
        model.enable_wgrad_overlap(sm_count=100)


def test_wait_runs_everything_submitted_before_in_order():
    ran = []
    ov = WgradOverlap(torch.device("cpu"), sm_count=8, defer=True)
    for tag in ("a", "b", "a", "c"):
        ov.submit(tag, lambda sm, t=tag: ran.append((t, sm)))
    ov.wait("b")
    assert ran == [("a", 0), ("b", 0)]
    ov.wait("zzz")  # nothing pending under that tag
    ov.wait("a")
    assert ran == [("a", 0), ("b", 0), ("a", 0)] and [t for t, _ in ov.pending] == ["c"]
    ov.wait_all()
    assert [t for t, _ in ran] == ["a", "b", "a", "c"] and ov.pending == [] and ov.submitted == 4


@pytest.mark.gpu
def test_gpu_wgrad_overlap_graphs_replay_eager_and_match_the_plain_order():
    """Four layers at Qwen2.5-0.5B widths, bf16, 3 steps x 2 micro-steps, --deterministic-attention (cuDNN's
    backward is not bit-reproducible): with the wgrads on the side stream (100 SMs), the graph replay equals
    eager bit for bit; against the plain order (wgrads on the compute stream with torch's algorithm) the losses
    agree to 1e-3 and the weights to 2^-6 relative (another GEMM algorithm rounds the wgrads differently)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_cuda_graphs import _train

    plain_losses, plain_w = _train("triton", False, None, deterministic=True)
    eager_losses, eager_w = _train("triton", False, None, deterministic=True, wgrad_sms=100)
    graph_losses, graph_w = _train("triton", True, None, deterministic=True, wgrad_sms=100)
    print(f"wgrad overlap: losses plain {plain_losses} eager {eager_losses} graph {graph_losses}; max |dw| "
          f"overlap-vs-plain {(eager_w.float() - plain_w.float()).abs().max().item()}")
    assert graph_losses == eager_losses and torch.equal(graph_w, eager_w)
    for (a, _), (b, _) in zip(plain_losses, eager_losses):
        assert abs(a - b) <= 1e-3 * abs(a)
    assert torch.allclose(eager_w.float(), plain_w.float(), rtol=2 ** -6, atol=1e-4)
