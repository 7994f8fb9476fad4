"""The optimizer: reference AdamW vs torch.optim.AdamW, ZeRO sharding, clipping, stochastic rounding, schedules.

The backend here is a thin shim over ``llmq_ray.backends.torch_ref_optim`` so that these tests pin the optimizer
functions themselves (TorchBackend delegates to the same functions).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmq_ray.backends import torch_ref_optim as ref
from llmq_ray.model.config import PRESETS
from llmq_ray.errors import ConfigError
from llmq_ray.engine.optim import ShardedAdamW, clip_coefficient, global_grad_norm_squared, learning_rate_at
from llmq_ray.model.params import ParamLayout, init_params

F32, BF16 = torch.float32, torch.bfloat16
LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.95), 1e-8

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


class RefOptimBackend:
    """Just the optimizer kernels of the reference backend."""

    adamw_update = staticmethod(ref.adamw_update)
    global_norm_squared = staticmethod(ref.global_norm_squared)
    stochastic_round = staticmethod(ref.stochastic_round)


@pytest.fixture(scope="module")
def layout() -> ParamLayout:
    return ParamLayout(PRESETS["tiny"])  # ~119k parameters; decay run then a 576-element no-decay run


def initial_params(layout: ParamLayout, device="cpu", bf16_representable=False) -> torch.Tensor:
    flat = torch.empty(layout.numel)
    init_params(layout, flat, seed=1)
    if bf16_representable:  # so that fp32 and bf16 runs start from the very same weights
        flat = flat.to(BF16).float()
    return flat.to(device)


def make_grads(layout: ParamLayout, n_steps: int, device="cpu", bf16_representable=False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    grads = [torch.randn(layout.numel, generator=gen) * 0.01 for _ in range(n_steps)]
    if bf16_representable:
        grads = [g.to(BF16).float() for g in grads]
    return [g.to(device) for g in grads]


def make_opt(layout, flat, start=0, end=None, *, master=F32, m=F32, v=F32, seed=0, **kw) -> ShardedAdamW:
    return ShardedAdamW(RefOptimBackend(), layout, flat, start, layout.numel if end is None else end,
                        master_dtype=master, m_dtype=m, v_dtype=v, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                        weight_decay=WD, seed=seed, **kw)


def lr_of(step: int) -> float:
    return learning_rate_at(step - 1, base_lr=LR, total_steps=8, warmup_steps=2, schedule="cosine",
                            final_lr_fraction=0.1)


# ---------------------------------------------------------------------------------------------------- AdamW math
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_matches_torch_adamw(layout, device, foreach):
    """fp32 params and states over several steps, changing lr, both grad_scale kinds, vs torch.optim.AdamW with
    two param groups (decay on embeddings/matrices, none on norms/biases)."""
    flat = initial_params(layout, device)
    torch_params = {s.name: torch.nn.Parameter(flat[s.offset:s.end].view(s.shape).clone()) for s in layout}
    groups = [{"params": [torch_params[s.name] for s in layout if s.decay], "weight_decay": WD},
              {"params": [torch_params[s.name] for s in layout if not s.decay], "weight_decay": 0.0}]
    assert groups[0]["params"] and groups[1]["params"]
    torch_opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=foreach)
    opt = make_opt(layout, flat)
    assert opt.master is None and len(opt.runs) == 2

    worst_abs = worst_rel = 0.0
    for step, grad in enumerate(make_grads(layout, 6, device), start=1):
        scale = torch.tensor(1 / 3, dtype=F32, device=device) if step % 2 else 0.25  # tensor and float
        lr = lr_of(step)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        for s in layout:
            torch_params[s.name].grad = grad[s.offset:s.end].view(s.shape) * scale
        torch_opt.step()
        opt.step(grad, lr=lr, step=step, grad_scale=scale)

        expected = torch.cat([p.detach().reshape(-1) for p in torch_params.values()])
        diff = (flat - expected).abs()
        worst_abs = max(worst_abs, diff.max().item())
        worst_rel = max(worst_rel, (diff.norm() / (expected - initial_params(layout, device)).norm()).item())
        assert worst_abs <= 1e-6, f"step {step}: max |ours - torch| = {worst_abs:.3g}"
        assert worst_rel <= 1e-6, f"step {step}: |ours - torch| / |torch update| = {worst_rel:.3g}"
        # the moments too (state of torch's decay group, first tensor = the embedding)
        st = torch_opt.state[torch_params["embed"]]
        emb = layout.slots["embed"]
        torch.testing.assert_close(opt.m[emb.offset:emb.end].view(emb.shape), st["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(opt.v[emb.offset:emb.end].view(emb.shape), st["exp_avg_sq"], rtol=1e-6, atol=1e-12)
    # the updates are not trivially zero: the comparison above has something to compare
    assert (flat - initial_params(layout, device)).abs().max() > 1e-3


def test_adamw_single_step_is_sign_of_gradient(layout):
    """Step 1 from zero moments: m_hat / sqrt(v_hat) = g/|g|, so p1 = p0 (1 - lr wd) - lr sign(g) exactly as
    AdamW defines it (a check of the bias corrections that does not lean on torch.optim)."""
    flat = initial_params(layout)
    p0 = flat.clone()
    grad = make_grads(layout, 1)[0]
    make_opt(layout, flat).step(grad, lr=LR, step=1, grad_scale=1.0)
    wd = torch.zeros_like(flat)
    wd[:layout.decay_end] = WD
    expected = p0 * (1 - LR * wd) - LR * torch.sign(grad) * (grad.abs() / (grad.abs() + EPS))
    torch.testing.assert_close(flat, expected, rtol=2.5e-7, atol=1e-9)  # <= 2 fp32 ulps
    # the norm weights (no decay) moved by exactly lr in the direction of -grad
    norm = layout.slots["final_norm"]
    torch.testing.assert_close(flat[norm.offset:norm.end], 1.0 - LR * torch.sign(grad[norm.offset:norm.end]),
                               rtol=2.5e-7, atol=0)


# ---------------------------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_equals_unsharded_exactly(layout, world):
    grads = make_grads(layout, 4)
    full = initial_params(layout)
    full_opt = make_opt(layout, full)
    sharded = initial_params(layout)
    ranges = [layout.shard_range(r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.numel
    if world == 3:
        assert ranges[-1][1] - ranges[-1][0] < ranges[0][1] - ranges[0][0], "want an uneven last shard"
    assert any(len(layout.decay_runs(s, e)) == 2 for s, e in ranges), "want a shard with both decay runs"
    shard_opts = [make_opt(layout, sharded, s, e) for s, e in ranges]
    # ZeRO-3 style: a rank that holds only its own shard of the weights (params_offset = start)
    s_last, e_last = ranges[-1]
    own = initial_params(layout)[s_last:e_last].clone()
    own_opt = make_opt(layout, own, s_last, e_last, params_offset=s_last)

    for step, grad in enumerate(grads, start=1):
        full_opt.step(grad, lr=lr_of(step), step=step, grad_scale=0.5)
        for (s, e), o in zip(ranges, shard_opts):
            o.step(grad[s:e].clone(), lr=lr_of(step), step=step, grad_scale=0.5)
        own_opt.step(grad[s_last:e_last].clone(), lr=lr_of(step), step=step, grad_scale=0.5)
    assert torch.equal(sharded, full)
    assert torch.equal(own, full[s_last:e_last])
    assert torch.equal(torch.cat([o.m for o in shard_opts]), full_opt.m)
    assert torch.equal(torch.cat([o.v for o in shard_opts]), full_opt.v)


def test_empty_shard_is_a_no_op(layout):
    flat = initial_params(layout)
    opt = make_opt(layout, flat, layout.numel, layout.numel)
    opt.step(torch.zeros(0), lr=LR, step=1, grad_scale=1.0)
    assert opt.memory_bytes() == 0 and torch.equal(flat, initial_params(layout))


def test_state_round_trip_resumes_bit_for_bit(layout):
    """Save after 3 steps, load into a fresh optimizer over freshly initialized weights, continue: the same bits
    as 6 uninterrupted steps, with bf16 states and bf16 weights (stochastic rounding everywhere)."""
    grads = make_grads(layout, 6)
    for master in (F32, BF16):
        straight = initial_params(layout).to(BF16)
        o1 = make_opt(layout, straight, master=master, m=BF16, v=BF16, seed=7)
        for step, g in enumerate(grads, start=1):
            o1.step(g, lr=lr_of(step), step=step, grad_scale=1.0)

        first = initial_params(layout).to(BF16)
        o2 = make_opt(layout, first, master=master, m=BF16, v=BF16, seed=7)
        for step, g in enumerate(grads[:3], start=1):
            o2.step(g, lr=lr_of(step), step=step, grad_scale=1.0)
        saved = {k: t.clone() for k, t in o2.state_tensors().items()}
        assert set(saved) == {"master", "m", "v"} and all(t.numel() == layout.numel for t in saved.values())

        resumed = initial_params(layout).to(BF16)
        o3 = make_opt(layout, resumed, master=master, m=BF16, v=BF16, seed=7)
        o3.load_state_tensors(saved)
        for step, g in enumerate(grads[3:], start=4):
            o3.step(g, lr=lr_of(step), step=step, grad_scale=1.0)
        assert torch.equal(resumed, straight)
        assert torch.equal(o3.m, o1.m) and torch.equal(o3.v, o1.v)


def test_e4m3_first_moment_round_trip_resumes_bit_for_bit(layout):
    """--opt-m-dtype e4m3: the checkpoint carries m as bf16 values (exact), loading re-quantizes them to the same
    numbers, and 3 + 3 steps equal 6 uninterrupted ones bit for bit (bf16 weights, bf16 v); loaded into another
    sharding (2 shards) the values come back within e4m3's rounding (the blocks are cut elsewhere)."""
    E4M3 = torch.float8_e4m3fn
    grads = make_grads(layout, 6)
    straight = initial_params(layout).to(BF16)
    o1 = make_opt(layout, straight, master=F32, m=E4M3, v=BF16, seed=7, chunk=40_000)  # 3 chunks + the no-decay run
    assert o1.m.dtype == E4M3 and o1.m_scale.numel() == sum(-(-(hi - lo) // 256) for lo, hi, _ in o1.chunks)
    for step, g in enumerate(grads, start=1):
        o1.step(g, lr=lr_of(step), step=step, grad_scale=1.0)

    first = initial_params(layout).to(BF16)
    o2 = make_opt(layout, first, master=F32, m=E4M3, v=BF16, seed=7, chunk=40_000)
    for step, g in enumerate(grads[:3], start=1):
        o2.step(g, lr=lr_of(step), step=step, grad_scale=1.0)
    saved = {k: t.clone() for k, t in o2.state_tensors().items()}
    assert saved["m"].dtype == BF16 and saved["m"].abs().max() > 0
    resumed = initial_params(layout).to(BF16)
    o3 = make_opt(layout, resumed, master=F32, m=E4M3, v=BF16, seed=7, chunk=40_000)
    o3.load_state_tensors(saved)
    # the same numbers (a block whose largest value rounded down to 224 or less may come back as 2q at half the
    # scale: other bytes, the same values, which is all the update reads)
    assert torch.equal(o3.state_tensors()["m"], saved["m"])
    for step, g in enumerate(grads[3:], start=4):
        o3.step(g, lr=lr_of(step), step=step, grad_scale=1.0)
    assert torch.equal(resumed, straight)
    assert torch.equal(o3.state_tensors()["m"], o1.state_tensors()["m"]) and torch.equal(o3.v, o1.v)

    from llmq_ray.backends import fp8_moment

    half = layout.shard_size(2)
    for lo, hi in ((0, half), (half, layout.numel)):  # another world size: other block boundaries
        o = make_opt(layout, initial_params(layout).to(BF16), lo, hi, master=F32, m=E4M3, v=BF16, seed=7)
        o.load_state_tensors({k: t[lo:hi] for k, t in saved.items()})
        want = saved["m"][lo:hi].float()
        # each value rounded to nearest on the grid of its new block (chunk by chunk, as the optimizer cuts)
        expected = torch.cat([fp8_moment.dequantize(*fp8_moment.quantize(want[a - lo:b - lo], None))
                              for a, b, _ in o.chunks]).to(BF16)
        assert torch.equal(o.state_tensors()["m"], expected)


def test_e4m3_first_moment_of_vanishing_gradients_resumes_bit_for_bit(layout):
    """Elements whose gradient is 0 from the start (an embedding row never seen): m decays towards 0 and its
    block's scale reaches the floor (fp8_moment.K_MIN); the stored values stay exact in a bf16 checkpoint, so
    the fp32 m after save, load and 3 more steps equals the uninterrupted run's."""
    from llmq_ray.backends import fp8_moment

    E4M3 = torch.float8_e4m3fn
    grads = [g.clone() for g in make_grads(layout, 6)]
    for g in grads:
        g[:512] = 0.0
    start = torch.zeros(layout.numel)
    start[:512] = torch.linspace(1e-41, 3e-38, 512)  # tiny moments, fp32 subnormals among them: floor-scale blocks

    def fresh():
        o = make_opt(layout, initial_params(layout).to(BF16), master=F32, m=E4M3, v=BF16, seed=3)
        o.load_state_tensors({"master": initial_params(layout), "m": start, "v": torch.full_like(start, 1e-6)})
        return o

    o1 = fresh()
    for step, g in enumerate(grads, start=1):
        o1.step(g, lr=lr_of(step), step=step, grad_scale=1.0)
    o2 = fresh()
    for step, g in enumerate(grads[:3], start=1):
        o2.step(g, lr=lr_of(step), step=step, grad_scale=1.0)
    assert o2.m_scale[:2].tolist() == [2.0 ** fp8_moment.K_MIN] * 2
    saved = {k: t.clone() for k, t in o2.state_tensors().items()}
    o3 = fresh()
    o3.load_state_tensors(saved)
    for step, g in enumerate(grads[3:], start=4):
        o3.step(g, lr=lr_of(step), step=step, grad_scale=1.0)
    m1, m3 = fp8_moment.dequantize(o1.m, o1.m_scale), fp8_moment.dequantize(o3.m, o3.m_scale)
    assert torch.equal(m3, m1) and (m1[:512] != 0).any()


def test_e4m3_first_moment_tracks_fp32(layout):
    """10 steps: the e4m3 first moment (3 significant bits + sign, unbiased rounding, a scale per 256) moves
    the weights like fp32 m within 5% of the total update's norm (measured 3.6%; bf16 m: 0.23%), and without
    bias (mean difference 7e-5 of the mean |update|; assert 1%). Seeds are fixed: this cannot flake."""
    flat0 = initial_params(layout)
    grads = make_grads(layout, 10)
    p32, _ = _run(layout, grads, flat0, F32, F32, F32, F32)
    p8, opt = _run(layout, grads, flat0, F32, F32, torch.float8_e4m3fn, F32)
    update = p32 - flat0
    assert (p8 - p32).norm() <= 0.05 * update.norm()
    assert abs((p8 - p32).mean().item()) <= 0.01 * update.abs().mean().item()
    assert opt.memory_bytes() == layout.numel * (1 + 4) + opt.m_scale.numel() * 4


def test_memory_bytes(layout):
    flat = initial_params(layout).to(BF16)
    n = layout.numel
    assert make_opt(layout, flat, master=F32, m=F32, v=BF16).memory_bytes() == n * (4 + 4 + 2)
    assert make_opt(layout, flat, master=BF16, m=BF16, v=BF16).memory_bytes() == n * (2 + 2)  # no master copy
    with pytest.raises(ValueError, match="the master weights must be fp32 or bf16"):
        make_opt(layout, flat, master=torch.float16)


# ---------------------------------------------------------------------------------------------------- bf16 paths
def _run(layout, grads, flat0, param_dtype, master, m, v, steps=10):
    flat = flat0.to(param_dtype, copy=True)
    opt = make_opt(layout, flat, master=master, m=m, v=v, seed=11)
    for step, g in enumerate(grads[:steps], start=1):
        opt.step(g.to(param_dtype), lr=LR, step=step, grad_scale=1.0)
    return flat.float(), opt


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits): 2^(exponent - 8) with x = mant * 2^exponent."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 8)


def test_bf16_paths_track_fp32(layout):
    """10 steps at lr 1e-3 from the same (bf16-representable) weights and gradients. Tolerances:

    * fp32 master + bf16 weights: the master sees exactly the fp32 path's math, so it must equal the fp32 run
      bit for bit, and the weights must be it rounded to nearest.
    * bf16 m and v (fp32 weights): the moments keep ~8 significant bits (unbiased SR), so each step's update
      is off by well under 1% of lr; over 10 steps |diff| <= 10 * 1% * lr = 1e-4 (assert 2e-4), and the
      difference of the total updates is < 2% of the fp32 total update (measured ~0.25%).
    * bf16 storage of record (bf16 weights without master, or a bf16 master): each step's SR error is below
      one bf16 spacing at the weight's magnitude, and AdamW's update does not feed back on the weight beyond
      the tiny lr*wd term, so after 10 steps the errors add up to at most ~10 spacings of bf16 at
      max(|p0|, |p10|) + 10 lr (the bf16 moments add well under one); assert 12 (measured 4.9; seeds are
      fixed, so this cannot flake). Being unbiased, the mean difference stays ~0 (measured 4e-4 of the mean
      |update|; assert 1%), and the difference is < 20% of the update's norm (measured 7.5%).
    """
    flat0 = initial_params(layout, bf16_representable=True)
    grads = make_grads(layout, 10, bf16_representable=True)
    p32, o32 = _run(layout, grads, flat0, F32, F32, F32, F32)
    update32 = p32 - flat0
    spacing = _bf16_ulp(torch.maximum(flat0.abs(), p32.abs()) + 10 * LR)

    p, opt = _run(layout, grads, flat0, BF16, F32, F32, F32)
    assert torch.equal(opt.master, p32)
    assert torch.equal(p, p32.to(BF16).float())

    p, opt = _run(layout, grads, flat0, F32, F32, BF16, BF16)
    assert opt.m.dtype == BF16 and opt.v.dtype == BF16
    assert (p - p32).abs().max() <= 2e-4
    assert (p - p32).norm() <= 0.02 * update32.norm()

    for param_dtype, master in ((BF16, BF16), (F32, BF16)):  # bf16 weights of record / bf16 master copy
        p, opt = _run(layout, grads, flat0, param_dtype, master, BF16, BF16)
        record = (opt.master if opt.master is not None else p).float()
        assert torch.all((record - p32).abs() <= 12 * spacing)
        assert abs((record - p32).mean().item()) <= 0.01 * update32.abs().mean().item()
        assert (record - p32).norm() <= 0.2 * update32.norm()


def test_bf16_weights_keep_updates_smaller_than_half_a_spacing(layout):
    """The reason for SR: norm weights at 1.0 (bf16 spacing 2^-8 below 1) moved by lr = 1e-3 per step. Round
    to nearest would drop every update; SR must move the mean by the fp32 amount (within 10%)."""
    n = 20000
    p = torch.ones(n, dtype=BF16)
    m, v = torch.zeros(n, dtype=F32), torch.zeros(n, dtype=F32)
    grad = torch.ones(n)  # same sign every step: each step moves p by exactly -lr
    for step in range(1, 11):
        ref.adamw_update(p, grad, m, v, master=None, lr=LR, beta1=0.9, beta2=0.95, eps=EPS, weight_decay=0.0,
                         step=step, grad_scale=1.0, seed=step)
    moved = 1.0 - p.double().mean().item()
    assert abs(moved - 10 * LR) <= 0.1 * 10 * LR, moved
    assert torch.all(p <= 1.0) and (p < 1.0).any()


# ---------------------------------------------------------------------------------------------------- SR
def _not_representable(n: int, seed: int = 0) -> torch.Tensor:
    """fp32 values of both signs and many magnitudes, each 0.3 bf16 spacings above a bf16 value: round to
    nearest or truncation would be off by ~0.3 spacing = 1e-3..2.3e-3 relative; SR must average it out."""
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 8)).to(BF16).float()
    base = base[base != 0]
    return base + torch.sign(base) * 0.3 * _bf16_ulp(base)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_is_unbiased(device):
    x = _not_representable(64).to(device)
    assert torch.all(x.to(BF16).float() != x), "test values must not be bf16-representable"
    reps = 20000
    out = torch.empty(reps, x.numel(), dtype=BF16, device=device)
    ref.stochastic_round(out, x.expand(reps, -1).contiguous(), seed=42)
    lo = x.to(BF16).float()  # round to nearest = the neighbour towards zero (0.3 spacing away)
    hi = lo + torch.sign(x) * _bf16_ulp(lo)
    outf = out.float()
    assert torch.all((outf == lo) | (outf == hi)), "every result must be one of the two bf16 neighbours"
    mean = outf.double().mean(0)
    rel_err = ((mean - x.double()).abs() / x.double().abs()).max().item()
    assert rel_err <= 1e-3, rel_err  # ~1e-5 expected (std of the mean = 0.46 spacing / sqrt(20000))
    # the probability of rounding away from zero is the 0.3 fraction
    frac_hi = (outf == hi).double().mean().item()
    assert abs(frac_hi - 0.3) < 0.01
    # round to nearest would fail the 1e-3 check above: the test can tell biased from unbiased
    assert ((x.to(BF16).double() - x.double()).abs() / x.double().abs()).max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_seeds_and_fixed_points(device):
    x = _not_representable(4096, seed=1).to(device)
    a, b, c = (torch.empty(x.shape, dtype=BF16, device=device) for _ in range(3))
    ref.stochastic_round(a, x, seed=5)
    ref.stochastic_round(b, x, seed=5)
    ref.stochastic_round(c, x, seed=6)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a, c)

    gen = torch.Generator().manual_seed(3)
    exact = torch.cat([(torch.randn(4096, generator=gen) * 100).to(BF16).float(),
                       torch.tensor([0.0, -0.0, 1.0, -2.0, 2.0 ** -133, torch.finfo(BF16).max, -torch.finfo(BF16).max,
                                     torch.finfo(BF16).tiny])]).to(device)
    out = torch.empty(exact.shape, dtype=BF16, device=device)
    for seed in range(5):
        ref.stochastic_round(out, exact, seed=seed)
        assert torch.equal(out.float().view(torch.int32), exact.view(torch.int32)), "representable values change"

    special = torch.tensor([math.inf, -math.inf, math.nan, torch.finfo(F32).max, -torch.finfo(F32).max,
                            3.39e38], device=device)
    out = torch.empty(special.shape, dtype=BF16, device=device)
    ref.stochastic_round(out, special, seed=0)
    assert out[0].item() == math.inf and out[1].item() == -math.inf and math.isnan(out[2].item())
    bf16_max = torch.finfo(BF16).max
    assert out[3].item() == bf16_max and out[4].item() == -bf16_max and out[5].item() == bf16_max  # saturate


# ---------------------------------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("device", DEVICES)
def test_global_norm_and_clip(device):
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(1000, generator=gen).to(device), (torch.randn(37, 5, generator=gen) * 3).to(device),
             torch.randn(300, generator=gen).to(BF16).to(device)]
    norm = global_grad_norm_squared(RefOptimBackend(), grads).sqrt()
    assert norm.dtype == F32 and norm.dim() == 0 and norm.device.type == torch.device(device).type
    expected = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads]))
    assert abs(norm.item() - expected.item()) <= 1e-6 * expected.item()
    assert global_grad_norm_squared(RefOptimBackend(), grads[0]).item() == pytest.approx(
        grads[0].double().square().sum().item(), rel=1e-6)

    n = norm.item()
    coef = clip_coefficient(norm, 1.0)  # ||g|| ~ 40 > 1: clipped
    assert coef.dtype == F32 and coef.device == norm.device
    assert coef.item() == float(np.float32(1.0) / np.float32(n))  # exactly clip/||g|| in fp32
    assert coef.item() < 1.0
    assert clip_coefficient(norm, n * 2).item() == 1.0  # below the threshold: exactly 1
    assert clip_coefficient(norm, 0.0).item() == 1.0  # clipping off
    assert clip_coefficient(norm, -1.0).item() == 1.0
    for bad in (math.inf, math.nan):
        t = torch.tensor(bad, device=device)
        assert math.isnan(clip_coefficient(t, 1.0).item()) and math.isnan(clip_coefficient(t, 0.0).item())
    inf_grads = [grads[0].clone()]
    inf_grads[0][3] = math.inf
    inf_norm = global_grad_norm_squared(RefOptimBackend(), inf_grads).sqrt()
    assert not torch.isfinite(clip_coefficient(inf_norm, 1.0))


# ---------------------------------------------------------------------------------------------------- schedules
def lr_at(step, schedule, total=110, warmup=10, final=0.1, **kw):
    return learning_rate_at(step, base_lr=1.0, total_steps=total, warmup_steps=warmup, schedule=schedule,
                            final_lr_fraction=final, **kw)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_schedule_warmup_and_end(schedule):
    assert lr_at(0, schedule) == pytest.approx(0.1)  # 1/warmup, not 0
    assert lr_at(4, schedule) == pytest.approx(0.5)
    assert lr_at(9, schedule) == 1.0  # warmup ends at base_lr
    assert lr_at(10, schedule) <= 1.0
    last = lr_at(109, schedule)
    assert last == pytest.approx(1.0 if schedule == "constant" else 0.1, abs=1e-12)
    assert lr_at(500, schedule) == last  # past the end: stays
    values = [lr_at(s, schedule) for s in range(9, 110)]
    assert all(a >= b for a, b in zip(values, values[1:])), "must not increase after warmup"


def test_schedule_shapes():
    # cosine/linear decay from step 9 (last warmup step, at base) to 109: midpoint is step 59
    assert lr_at(59, "cosine") == pytest.approx(0.55, abs=1e-12)
    assert lr_at(59, "linear") == pytest.approx(0.55, abs=1e-12)
    assert lr_at(34, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), abs=1e-12)
    assert lr_at(34, "linear") == pytest.approx(1 - 0.9 * 0.25, abs=1e-12)
    # no warmup: step 0 is base, the last step final
    assert lr_at(0, "cosine", warmup=0) == 1.0 and lr_at(109, "cosine", warmup=0) == pytest.approx(0.1)
    assert learning_rate_at(0, base_lr=3e-4, total_steps=1, warmup_steps=0, schedule="cosine",
                            final_lr_fraction=0.0) == 0.0
    # wsd, 100 steps, cooldown 20%: plateau at base through step 79, linear to final over steps 80..99
    wsd = [lr_at(s, "wsd", total=100, final=0.0) for s in range(100)]
    assert all(x == 1.0 for x in wsd[9:80])
    assert wsd[80] == pytest.approx(1 - 1 / 20) and wsd[89] == pytest.approx(0.5) and wsd[99] == 0.0
    assert lr_at(99, "wsd", total=100, cooldown_fraction=0.5, final=0.0) == 0.0
    assert lr_at(49, "wsd", total=100, cooldown_fraction=0.5) == 1.0
    assert lr_at(50, "wsd", total=100, cooldown_fraction=0.5, final=0.0) == pytest.approx(1 - 1 / 50)
    # constant ignores the final fraction
    assert lr_at(60, "constant", final=0.0) == 1.0


@pytest.mark.parametrize("kwargs, flag", [
    (dict(schedule="exponential"), "--lr-schedule"),
    (dict(total=0, warmup=0), "--steps"),
    (dict(warmup=110), "--warmup"),
    (dict(warmup=-1), "--warmup"),
    (dict(final=1.5), "--final-lr-fraction"),
    (dict(final=-0.1), "--final-lr-fraction"),
    (dict(schedule="wsd", total=100, warmup=90), "--warmup"),  # warmup runs into the cooldown
])
def test_schedule_bad_arguments(kwargs, flag):
    kwargs.setdefault("schedule", "cosine")
    with pytest.raises(ConfigError, match=flag):
        lr_at(0, **kwargs)
