"""The block wgrads on a side stream (llmq_ray/engine/wgrad_overlap.py), checked on the CPU.

On the CPU ``defer`` runs each wgrad as late as an in-order side stream could: only when the model waits for it
(or for one submitted after it). Every buffer a pending wgrad reads must then still hold its value, so a wait
the model lacks shows as gradients that differ from the plain backward's. Same kernels, same order of each
sum: the gradients must be bit-identical. On the GPU (``-m gpu``): the real side stream under CUDA graphs
replays the eager bits, and against the plain backward the results differ only by the wgrads' algorithm.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import checked_settings, perturb_norms_and_biases, train_settings
from llmq_ray.backends import get_backend
from llmq_ray.model.config import PRESETS
from llmq_ray.engine.train_engine import TrainEngine
from llmq_ray.errors import ConfigError
from llmq_ray.model import build_model
from llmq_ray.model.build import Recompute
from llmq_ray.settings.rules import validate
from llmq_ray.model.params import init_params
from llmq_ray.engine.schedule import Schedule
from llmq_ray.engine.wgrad_overlap import WgradOverlap, enable_wgrad_overlap

CFG = PRESETS["tiny"]
B, T = 2, 16


def _model(overlap: bool, recompute: Recompute = Recompute()):
    model = build_model(CFG, get_backend("torch"), batch=B, seq=T, dtype=torch.float32, recompute=recompute)
    init_params(model.layout, model.params, seed=7)
    perturb_norms_and_biases(model)
    if overlap:
        enable_wgrad_overlap(model, sm_count=100, mode="defer")
    return model


def _grads(model, micro_steps: int = 2):
    gen = torch.Generator().manual_seed(5)
    model.zero_grads()
    for _ in range(micro_steps):  # the second micro-step accumulates into the gradients
        tokens = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        if model.lin.overlap is not None:
            assert model.lin.overlap.pending == []  # joined at the end of every micro-step
    return model.grads.clone(), (model.loss_sum / model.target_count).item()


RECOMPUTE = {"stored": Recompute(), "norm": Recompute(norm=True),
             "swiglu": Recompute(swiglu=True), "ffn": Recompute(ffn=True),
             "att": Recompute(att=True), "block": Recompute(block=True)}


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_deferred_wgrads_give_the_same_gradients(recompute):
    """Two micro-steps; each deferred wgrad also checks its dy and x are unchanged since it was submitted."""
    rc = RECOMPUTE[recompute].resolved()
    g_plain, loss_plain = _grads(_model(False, rc))
    model = _model(True, rc)
    g_overlap, loss_overlap = _grads(model)
    assert model.lin.overlap.submitted == 2 * 4 * CFG.num_layers
    assert loss_overlap == loss_plain
    assert torch.equal(g_overlap, g_plain)


@pytest.mark.parametrize("dropped", ["down_w", "out_w"])
def test_a_missing_wait_is_caught(dropped):
    """Without the wait before an RMSNorm backward overwrites d_residual in place, the deferred down (or
    attention-out) wgrad finds its dy changed. (The waits for up_gate_w and qkv_w are implied by these two when
    ln1 is stored: the side stream runs in order.)"""
    model = _model(True)
    real_wait = model._wait_wgrad
    model._wait_wgrad = lambda *names: real_wait(*(n for n in names if n != dropped))
    with pytest.raises(AssertionError, match=f"input 0 of the pending wgrad '{dropped}' was overwritten"):
        _grads(model, micro_steps=1)


def test_the_recompute_wait_is_needed():
    model = _model(True, RECOMPUTE["norm"].resolved())
    real_wait = model._wait_wgrad
    model._wait_wgrad = lambda *names: real_wait(*(n for n in names if names != ("qkv_w",)))
    with pytest.raises(AssertionError, match="input 1 of the pending wgrad 'qkv_w' was overwritten"):
        _grads(model, micro_steps=1)


def test_only_for_the_model_dtype_path_and_a_valid_sm_count():
    model = build_model(CFG, get_backend("torch"), batch=B, seq=T, dtype=torch.bfloat16,
                       block_dtype="e4m3")
    with pytest.raises(ConfigError, match="does not apply to FP8 block GEMMs"):
        enable_wgrad_overlap(model, sm_count=100)
    with pytest.raises(ConfigError, match="a wgrad side stream of 0 SMs: the count must be between 1 and"):
        enable_wgrad_overlap(_model(False), sm_count=0)


@pytest.mark.parametrize("bad, message", [
    (dict(overlap_wgrad_sms=-1), "--overlap-wgrad-sms=-1 must be an integer >= 0"),
    (dict(model_dtype="bf16", matmul_dtype="e4m3"), "does not apply with --matmul-dtype=e4m3"),
    (dict(zero_level=3), "--zero-level 3"),
    (dict(zero_level=2), "--zero-level 2"),
    (dict(offload_residual=True), "--offload-residual"),
])
def test_the_option_refuses_what_it_cannot_run(bad, message):
    opts = train_settings(model="tiny", batch_size=2, seq_len=16, **{"overlap_wgrad_sms": 100, **bad})
    with pytest.raises(ConfigError, match=message):
        validate(opts)


def test_the_flag_reaches_the_engine_and_keeps_the_results():
    """--overlap-wgrad-sms from the command line to the engine's model (on the CPU each wgrad runs at once, so
    two steps of two micro-steps give the same weights; the GPU tests below check the side stream)."""
    from llmq_ray.train.cli import build_parser, trainer_kwargs
    from llmq_ray.model.config import PRESETS
    from llmq_ray.settings import make_settings
    from llmq_ray.settings.defaults import resolve
    from llmq_ray.settings.rules import validate

    weights = {}
    for sms in (0, 64):
        argv = ["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--synthetic-data",
                "--device", "cpu", "--overlap-wgrad-sms", str(sms)]
        kw = trainer_kwargs(build_parser().parse_args(argv))
        opts = validate(resolve(make_settings(**kw), "cpu", presets=PRESETS, has_eval_file=False, swiglu_mlp=True))
        assert opts.speed.overlap_wgrad_sms == sms
        engine = TrainEngine(CFG, opts, get_backend("torch"))
        assert (engine.model.lin.overlap is not None) == bool(sms)
        gen = torch.Generator().manual_seed(5)
        for step in range(2):
            for _ in range(2):
                tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=gen)
                engine.micro_step(tokens[:, :-1], tokens[:, 1:])
            engine.update(lr=1e-3, step=step + 1)
        if sms:
            assert engine.model.lin.overlap.sm_count == sms
            assert engine.model.lin.overlap.submitted == 2 * 2 * 4 * CFG.num_layers
        weights[sms] = engine.full_params().clone()
    assert torch.equal(weights[0], weights[64])


def test_wait_runs_everything_submitted_before_in_order():
    ran = []
    ov = WgradOverlap(Schedule("cpu"), sm_count=8, mode="defer")
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
def test_gpu_side_stream_gives_the_serial_bits_and_graphs_replay_them():
    """Four layers at Qwen2.5-0.5B widths, bf16, 3 steps x 2 micro-steps, --deterministic-attention (cuDNN's
    backward is not bit-reproducible). The same SM-targeted wgrads run (a) in order on the compute stream,
    (b) on the side stream, made to start late (a spin of ~1 ms before each), (c) on the side stream inside CUDA
    graphs: (b) and (c) must give (a)'s losses and weights bit for bit; a missing wait would let (b) read an
    overwritten input."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_cuda_graphs import _train

    kw = dict(deterministic=True, wgrad_sms=100)
    serial_losses, serial_w = _train("triton", False, None, wgrad_mode="serial", **kw)
    late_losses, late_w = _train("triton", False, None, wgrad_delay=2_000_000, **kw)
    graph_losses, graph_w = _train("triton", True, None, **kw)
    print(f"wgrad overlap: losses serial {serial_losses} late side stream {late_losses} graphs {graph_losses}")
    assert late_losses == serial_losses and torch.equal(late_w, serial_w)
    assert graph_losses == serial_losses and torch.equal(graph_w, serial_w)


@pytest.mark.gpu
def test_gpu_side_stream_gradients_match_the_plain_order():
    """One micro-step, Qwen2.5-0.5B widths, 2 layers, bf16: the gradients with the wgrads on the side stream
    (100 SMs, cuBLASLt's algorithm for that target) against the plain order (the tuned GEMMs on the compute
    stream): everything but the block weight gradients is bit-identical (the dgrads are the same GEMMs); those
    are within 2 bf16 steps at each element's magnitude (another algorithm rounds differently)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import dataclasses

    from test_cuda_graphs import _bf16_ulp

    cfg = dataclasses.replace(PRESETS["Qwen2.5-0.5B"], num_layers=2, name="qwen0.5b-2layers")
    grads = []
    for overlap in (False, True):
        be = get_backend("triton", "cuda")
        model = build_model(cfg, be, batch=2, seq=256, dtype=torch.bfloat16)
        init_params(model.layout, model.params, seed=7)
        if overlap:
            enable_wgrad_overlap(model, sm_count=100)
        tokens = torch.randint(0, cfg.vocab_size, (2, 257), generator=torch.Generator().manual_seed(3)).cuda()
        model.zero_grads()
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        grads.append((model.grads.clone(), model.layout, be.gemm.beside_fallbacks))
    (g0, layout, _), (g1, _, fallbacks) = grads
    assert fallbacks == 0
    block = torch.zeros_like(g0, dtype=torch.bool)
    for slot in layout.slots.values():
        if slot.name.endswith(("qkv_w", "out_w", "up_gate_w", "down_w")):
            block[slot.offset:slot.end] = True
    diff = (g1.float() - g0.float()).abs()
    print(f"wgrad overlap vs plain: max |dg| {diff[block].max().item():.3e} (block weights), "
          f"{diff[~block].max().item():.3e} (the rest)")
    assert bool((diff <= 2 * _bf16_ulp(torch.maximum(g0.abs(), g1.abs()))).all())
    assert torch.equal(g1[~block], g0[~block])
