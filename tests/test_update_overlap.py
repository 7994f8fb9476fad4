"""The optimizer update overlapped with the next forward (llmq_ray/engine/update_overlap.py).

The overlap only reorders when work is queued: chunks are updated in the order the forward needs them, on a
side stream, and the next micro-step zeroes each unit's gradients only after waiting for that unit's chunks.
So every run must give the same bits as the same run with ``overlap_update=False``: per-step losses, final
weights and the whole optimizer state (``torch.equal``), with bf16 weights, an fp32 master and bf16 moments
(stochastic rounding: the seeds must follow the chunks, not the order), a small chunk size (many chunks, some
straddling two units) and an eval between steps. On the CPU there are no streams (the order and the deferred
zeroing still run); the GPU test runs the real side stream with the Adam state in pinned host memory.
"""

from __future__ import annotations

import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.model.config import PRESETS
from llmq_ray.engine.train_engine import TrainEngine
from _helpers import checked_settings, train_settings
from llmq_ray.model.params import ParamLayout
from llmq_ray.engine.update_overlap import chunk_order, unit_ranges

BASE = dict(batch_size=2, seq_len=16, grad_accumulation=2, model_dtype="bf16", master_dtype="fp32",
            opt_m_dtype="bf16", opt_v_dtype="bf16", opt_chunk_size=3000, learning_rate=1e-3)
STEPS = 3


def _train(model: str = "tiny", backend: str = "torch", device: str = "cpu", **flags):
    cfg = PRESETS[model]
    opts = train_settings(model=model, **{**BASE, **flags})
    engine = TrainEngine(cfg, opts, get_backend(backend, device))
    gen = torch.Generator().manual_seed(0)
    losses, evals = [], []
    for step in range(STEPS):
        for _ in range(opts.data.grad_accumulation):
            x = torch.randint(0, cfg.vocab_size, (opts.data.batch_size, opts.data.seq_len + 1), generator=gen).to(device)
            engine.micro_step(x[:, :-1], x[:, 1:])
        losses.append(engine.update(1e-3, step + 1).loss)
        if step == 0:  # an eval right after an update: it must see the updated weights
            x = torch.randint(0, cfg.vocab_size, (opts.data.batch_size, opts.data.seq_len + 1), generator=gen).to(device)
            evals.append(engine.evaluate([(x[:, :-1], x[:, 1:])]))
    return losses, evals, engine


def _assert_same(a, b):
    (losses_a, evals_a, ea), (losses_b, evals_b, eb) = a, b
    assert losses_a == losses_b and evals_a == evals_b and losses_a[0] != losses_a[-1]
    assert torch.equal(ea.full_params().cpu(), eb.full_params().cpu())
    for name, t in ea.optimizer.state_tensors().items():
        assert torch.equal(t.cpu(), eb.optimizer.state_tensors()[name].cpu()), name


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])  # untied LM head (a "head" unit) and tied
def test_chunk_order_covers_every_unit_once(model):
    cfg = PRESETS[model]
    layout = ParamLayout(cfg)
    units = unit_ranges(layout)
    covered = sorted(r for ranges in units.values() for r in ranges)
    assert covered[0][0] == 0 and covered[-1][1] == layout.numel
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # the units tile the flat buffer
    assert ("head" in units) == (not cfg.tie_word_embeddings)
    engine = TrainEngine(cfg, train_settings(model=model, **BASE), get_backend("torch"))
    chunks = engine.optimizer.chunks
    order, ready_after = chunk_order(chunks, units)
    assert sorted(order) == list(range(len(chunks))) and order != list(range(len(chunks)))
    assert sorted((str(u) for us in ready_after.values() for u in us)) == sorted(map(str, units))
    pos = {j: p for p, j in enumerate(order)}
    for j, us in ready_after.items():
        for u in us:  # every chunk touching u is updated no later than the chunk that signals u
            touching = [k for k, (lo, hi, _) in enumerate(chunks) if any(a < hi and lo < b for a, b in units[u])]
            assert max(pos[k] for k in touching) == pos[j], u
    # the forward's order: the embedding (and the norms) first, then layer by layer, the LM head last
    signal = sorted((pos[j], u) for j, us in ready_after.items() for u in us)
    names = [u for _, u in signal]
    assert names[0] == "embed" and names[1:cfg.num_layers + 1] == list(range(cfg.num_layers))


@pytest.mark.parametrize("model,flags", [("tiny", {}), ("tiny-llama", dict(offload_opt_m=True, offload_opt_v=True)),
                                         ("tiny", dict(model_dtype="fp32", opt_m_dtype="fp32", opt_v_dtype="fp32"))],
                         ids=["bf16", "tied-offloaded", "fp32"])
def test_overlapped_update_is_bit_identical(model, flags):
    on = _train(model, **flags)
    off = _train(model, overlap_update=False, **flags)
    assert on[2].overlap is not None and off[2].overlap is None
    _assert_same(on, off)


def test_next_micro_step_zeroes_gradients_per_unit():
    """After an update the gradients are not zeroed at once but at each unit's first use; after the next
    micro-step every unit has been zeroed and waited for."""
    _, _, e = _train()
    store = e.model.store
    assert store.ready  # the last update left its per-unit events (None on the CPU)
    x = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 17))
    e.micro_step(x[:, :-1], x[:, 1:])
    assert not store.ready and not store.unzeroed


@pytest.mark.parametrize("flags", [dict(zero_level=2), dict(zero_level=3)])
def test_no_overlap_where_the_update_must_finish_first(flags):
    assert TrainEngine(PRESETS["tiny"], train_settings(model="tiny", **BASE, **flags),
                       get_backend("torch")).overlap is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_overlapped_update_on_cuda_is_bit_identical(backend):
    """The side stream for real: Adam state in pinned host memory, streamed while the next forward runs."""
    flags = dict(offload_opt_m=True, offload_opt_v=True)
    on = _train("tiny", backend, "cuda", **flags)
    off = _train("tiny", backend, "cuda", overlap_update=False, **flags)
    assert on[2].overlap.stream is not None
    _assert_same(on, off)
