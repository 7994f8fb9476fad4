"""ZeRO-3 in one process (llmq_ray/zero3.py): the layer-by-layer gather/reduce machinery, checkpoints, memory.

The 2-worker equality (gloo, through Ray) is ``test_runtime.py::test_two_workers_match_one_worker[3]``.
With one rank every "broadcast" is the owner's copy into the gather buffer and every "reduce" lands on
itself, so a ZeRO-3 engine must train *bit-identically* to a ZeRO-2 one: same kernels on the same values,
only read from rotating layer buffers (prefetched one layer ahead, in reverse in the backward) and with
each layer's gradient added into the shard accumulator as soon as its backward is done.
"""

from __future__ import annotations

import pytest
import torch

from backends import get_backend
from llmq_ray.config import PRESETS
from llmq_ray.engine import Communicator, TrainEngine
from llmq_ray.options import TrainOptions
from llmq_ray.resume import load_engine_checkpoint, save_engine_checkpoint


def _batch(step: int, micro: int, opts):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, 512, (opts.batch_size, opts.seq_len + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


def _steps(engine, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        for micro in range(engine.opts.grad_accumulation):
            engine.micro_step(*_batch(step, micro, engine.opts))
        losses.append(engine.update(2e-3, step + 1).loss)
    return losses


def _engine(model: str, zero: int, **kw) -> TrainEngine:
    opts = TrainOptions(model=model, batch_size=2, seq_len=16, grad_accumulation=2, zero_level=zero, **kw)
    return TrainEngine(PRESETS[model], opts, get_backend("torch"))


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])  # tied head + qkv bias; untied head, no bias
def test_zero3_one_rank_is_bit_identical_to_zero2(model):
    z2, z3 = _engine(model, 2), _engine(model, 3)
    assert z3.params is None and z3.store is not None  # no full weight buffer
    assert torch.equal(z3.full_params(), z2.full_params())  # the sharded init draws the same values
    l2, l3 = _steps(z2, 0, 3), _steps(z3, 0, 3)
    assert l3 == l2 and l2[-1] < l2[0]
    assert torch.equal(z3.full_params(), z2.full_params())
    assert torch.equal(z3.grad_shard, z2.grad_shard)
    # eval goes through the same gathers
    batches = [_batch(99, 0, z2.opts)]
    assert z3.evaluate(batches) == z2.evaluate(batches)


def test_zero3_checkpoint_resumes_bit_exact_and_loads_into_zero2(tmp_path):
    """Save a ZeRO-3 engine after 2 of 4 steps: a fresh ZeRO-3 engine and a ZeRO-2 engine (same checkpoint
    format: master/m/v of the flat shard) both continue exactly like the uninterrupted run."""
    full = _engine("tiny-llama", 3)
    losses = _steps(full, 0, 2)
    folder = save_engine_checkpoint(str(tmp_path), 2, full)
    losses += _steps(full, 2, 4)
    for zero in (3, 2):
        e = _engine("tiny-llama", zero)
        load_engine_checkpoint(folder, e)
        assert _steps(e, 2, 4) == losses[2:], zero
        assert torch.equal(e.full_params(), full.full_params())


def test_zero3_refuses_a_layer_that_is_not_gathered():
    e = _engine("tiny", 3)
    e.micro_step(*_batch(0, 0, e.opts))
    # after a micro-step the backward left layers 0 and 1 in the two buffers; after an update none
    assert tuple(e.store.view("layers.1.qkv_w", grads=False).shape) == (PRESETS["tiny"].qkv_channels, 64)
    e.update(1e-3, 1)
    with pytest.raises(RuntimeError, match="layer 1 is not gathered"):
        e.store.view("layers.1.qkv_w", grads=False)


class _Rank1Of4(Communicator):
    """Rank 1 of 4 without peers: enough to build an engine (collectives are the base class's no-ops)."""

    rank, world_size = 1, 4


def test_memory_table_shows_sharded_weights():
    """8 layers over 4 ranks: ZeRO-3 holds a quarter of the weights plus two layers and the [V, C] head buffer
    (and the same for gradients) instead of the full flat buffers."""
    import dataclasses

    from llmq_ray.memory_table import memory_dict, memory_table

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=8, name="tiny8")
    opts = TrainOptions(model="tiny", batch_size=2, seq_len=16, zero_level=2)
    z2 = TrainEngine(cfg, opts, get_backend("torch"), _Rank1Of4())
    z3 = TrainEngine(cfg, dataclasses.replace(opts, zero_level=3), get_backend("torch"), _Rank1Of4())
    a, b = memory_dict(memory_table(z2)), memory_dict(memory_table(z3))
    s = z3.store
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    assert b["weights"] == nb(s.params_shard) + nb(s.plain) + 2 * nb(s.layer_bufs[0]) + nb(s.head_buf)
    assert nb(s.params_shard) == a["weights"] // 4
    assert b["weights"] < 0.6 * a["weights"]
    # ZeRO-2 keeps the full gradient buffer (the backward's scratch) + the shard accumulator and its temporary
    assert b["grads"] == nb(s.plain_grads) + 2 * nb(s.layer_grads[0]) + nb(s.head_grad) + nb(z3.grad_shard) * 2
    assert b["grads"] < 0.6 * a["grads"]
