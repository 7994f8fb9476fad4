"""ZeRO-3 in one process (llmq_ray/parallel/data.py): the layer-by-layer gather/reduce machinery, checkpoints, memory.

The 2-worker equality (gloo, through Ray) is ``test_runtime.py::test_two_workers_match_one_worker[3]``.
With ``--matmul-dtype e4m3`` the bit-identity also covers where the FP8 weight copies are made (per layer from
each gather, once per step with --persistent-quants, in host memory with --offload-quants).
With one rank every "broadcast" is the owner's copy into the gather buffer and every "reduce" lands on
itself, so a ZeRO-3 engine must train *bit-identically* to a ZeRO-2 one: same kernels on the same values,
only read from rotating layer buffers (prefetched one layer ahead, in reverse in the backward) and with
each layer's gradient added into the shard accumulator as soon as its backward is done.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _helpers import fp8_layer_copy_gib, gloo_group, spawn_gloo_ranks, train_settings

from llmq_ray.backends import get_backend
from llmq_ray.model.config import PRESETS
from llmq_ray.engine.communicator import Communicator
from llmq_ray.engine.train_engine import TrainEngine
from _helpers import checked_settings, train_settings
from llmq_ray.checkpoints.resume import load_engine_checkpoint, save_engine_checkpoint


def _batch(step: int, micro: int, opts):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, 512, (opts.data.batch_size, opts.data.seq_len + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


def _steps(engine, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        for micro in range(engine.settings.data.grad_accumulation):
            engine.micro_step(*_batch(step, micro, engine.settings))
        losses.append(engine.update(2e-3, step + 1).loss)
    return losses


def _engine(model: str, zero: int, **kw) -> TrainEngine:
    opts = train_settings(model=model, batch_size=2, seq_len=16, grad_accumulation=2, zero_level=zero, **kw)
    return TrainEngine(PRESETS[model], opts, get_backend("torch"))


E4M3 = dict(model_dtype="bf16", matmul_dtype="e4m3")
# (model, options of both engines, options of the ZeRO-3 one only, where ZeRO-3 keeps the FP8 weight copies)
CASES = [("tiny", {}, {}, None),  # tied head + qkv bias
         ("tiny-llama", {}, {}, None),  # untied head, no bias
         ("tiny", E4M3, {}, "layer"),  # FP8 copies made per layer from each gather
         ("tiny-llama", E4M3, dict(persistent_quants=True), "persistent"),  # each layer gathered once per step
         ("tiny", E4M3, dict(persistent_quants=True, offload_quants=True), "host")]


@pytest.mark.parametrize("model,common,z3_only,quants", CASES, ids=["tiny", "tiny-llama", "tiny-e4m3",
                                                                     "tiny-llama-e4m3-persistent", "tiny-e4m3-offload"])
def test_zero3_one_rank_is_bit_identical_to_zero2(model, common, z3_only, quants):
    z2, z3 = _engine(model, 2, **common), _engine(model, 3, **common, **z3_only)
    assert z3.model.lin.fp8 == (quants is not None)
    if quants:
        assert z3.model.lin.quants == quants and z2.model.lin.quants == "persistent"
    assert z3.params is None and z3.store is not None  # no full weight buffer
    assert torch.equal(z3.full_params(), z2.full_params())  # the sharded init draws the same values
    l2, l3 = _steps(z2, 0, 3), _steps(z3, 0, 3)
    assert l3 == l2 and l2[-1] < l2[0]
    assert torch.equal(z3.full_params(), z2.full_params())
    assert torch.equal(z3.grad_shard, z2.grad_shard)
    # eval goes through the same gathers
    batches = [_batch(99, 0, z2.settings)]
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


@pytest.mark.parametrize("copies", ["per-pass", "persistent", "kept-all", "kept-1"])
def test_zero3_e4m3_gathers_per_pass_or_once_per_step(copies):
    """Per-layer FP8 copies need each layer's bf16 weights in every pass: L gathers in the first forward, then
    L - 2 per pass (the two layers in the buffers carry over between forward and backward), so
    L + 3 (L - 2) for 2 micro-steps; --persistent-quants needs them once per step (L). With --kept-quants-gib
    (per-layer copies, some kept for the step) a layer whose copies are all kept is gathered only until both its
    layouts are made: in the first forward and backward (L + (L - 2) with every layer kept); keeping layer 0
    only saves its gathers in the second micro-step's forward (the backward's last layer, 0, is always in a
    buffer already). Losses and weights equal the run without kept copies bit for bit."""
    import dataclasses

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=4, name="tiny4")

    def engine(**kw):
        opts = train_settings(model="tiny", batch_size=2, seq_len=16, grad_accumulation=2, zero_level=3, **E4M3, **kw)
        return TrainEngine(cfg, opts, get_backend("torch"))
    plain = engine()
    kw = {"per-pass": {}, "persistent": dict(persistent_quants=True),
          "kept-all": dict(kept_quants_gib=fp8_layer_copy_gib(plain, cfg.num_layers)),
          "kept-1": dict(kept_quants_gib=fp8_layer_copy_gib(plain, 1))}[copies]
    e = engine(**kw)
    L = cfg.num_layers
    kept_layers = {e.model.lin.layer_of[key][0] for key, _ in e.model.lin.kept}
    assert kept_layers == {"kept-all": set(range(L)), "kept-1": {0}}.get(copies, set())
    layers = {e.store.units[layer]: layer for layer in range(L)}
    gathered = []
    real_gather = e.store._gather
    e.store._gather = lambda lo, hi, buf: (gathered.append((lo, hi)), real_gather(lo, hi, buf))[1]
    want = {"per-pass": L + 3 * (L - 2), "persistent": L, "kept-all": L + (L - 2), "kept-1": L + 3 * (L - 2) - 1}
    for step in range(2):
        gathered.clear()
        for micro in range(2):
            e.micro_step(*_batch(step, micro, e.settings))
        e.update(2e-3, step + 1)
        per_step = sum(1 for r in gathered if r in layers)
        assert per_step == want[copies], (step, per_step)
    if copies != "per-pass":
        assert _steps(e, 2, 3) == (_steps(plain, 0, 2), _steps(plain, 2, 3))[1]
        assert torch.equal(e.full_params(), plain.full_params())
    if copies in ("persistent", "kept-all"):  # the skipped layers' buffers are the gradients' only: reading
        e.micro_step(*_batch(5, 0, e.settings))   # their weights is refused
        e.micro_step(*_batch(5, 1, e.settings))
        with pytest.raises(RuntimeError, match="layer 1 is not gathered"):
            e.store.view("layers.1.qkv_w", grads=False)


def test_zero3_refuses_a_layer_that_is_not_gathered():
    e = _engine("tiny", 3)
    e.micro_step(*_batch(0, 0, e.settings))
    # after a micro-step the backward left layers 0 and 1 in the two buffers; after an update none
    assert tuple(e.store.view("layers.1.qkv_w", grads=False).shape) == (PRESETS["tiny"].qkv_channels, 64)
    e.update(1e-3, 1)
    with pytest.raises(RuntimeError, match="layer 1 is not gathered"):
        e.store.view("layers.1.qkv_w", grads=False)


class _Rank1Of4(Communicator):
    """Rank 1 of 4 without peers: enough to build an engine (collectives are the base class's no-ops)."""

    rank, world_size = 1, 4


def test_memory_table_shows_sharded_weights_and_gradients():
    """8 layers over 4 ranks. ZeRO-2 keeps the whole weights but, instead of ZeRO-1's full gradient buffer,
    only the shard accumulator (exactly a quarter of it) plus the backward's scratch: two layers' gradients and
    the [V, C] head buffer. ZeRO-3 has the same gradient buffers and holds a quarter of the weights plus two
    layers and the head buffer."""
    import dataclasses

    from llmq_ray.observe.memory_table import memory_dict, memory_table

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=8, name="tiny8")
    opts = train_settings(model="tiny", batch_size=2, seq_len=16, zero_level=1)
    z1, z2, z3 = (TrainEngine(cfg, train_settings(opts, zero_level=z), get_backend("torch"), _Rank1Of4())
                  for z in (1, 2, 3))
    m1, m2, m3 = (memory_dict(memory_table(e)) for e in (z1, z2, z3))
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    # ZeRO-2: gradients that persist across micro-steps are 1/4 of ZeRO-1's; the rest is per-layer scratch
    s2 = z2.store
    assert z2.grads is None and nb(z2.grad_shard) * 4 == m1["grads"] == nb(z1.grads)
    scratch = nb(s2.plain_grads) + 2 * nb(s2.layer_grads[0]) + nb(s2.head_grad)
    assert m2["grads"] == nb(z2.grad_shard) + scratch
    assert m2["grads"] < 0.75 * m1["grads"] and m2["weights"] == m1["weights"]
    # ZeRO-3: the same gradient buffers, and sharded weights
    s = z3.store
    assert m3["grads"] == m2["grads"]
    assert m3["weights"] == nb(s.params_shard) + nb(s.plain) + 2 * nb(s.layer_bufs[0]) + nb(s.head_buf)
    assert nb(s.params_shard) == m1["weights"] // 4
    assert m3["weights"] < 0.6 * m1["weights"]


def _gloo_rank(rank: int, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks: ZeRO-3 e4m3, per-layer and persistent FP8 copies, 3 steps of 1 micro-step each;
    rank r takes micro-batch r of the single worker's 2. Rank 0 saves losses and the gathered weights."""
    with gloo_group(rank, 2, port) as comm:
        out = {}
        for persistent in (False, True):
            opts = train_settings(model="tiny", batch_size=2, seq_len=16, grad_accumulation=1, zero_level=3,
                                grad_clip=0.0, persistent_quants=persistent, **E4M3)
            e = TrainEngine(PRESETS["tiny"], opts, get_backend("torch"), comm)
            losses = []
            for step in range(3):
                e.micro_step(*_batch(step, rank, opts))
                losses.append(e.update(2e-3, step + 1).loss)
            out[persistent] = (losses, e.full_params())
        if rank == 0:
            torch.save(out, f"{out_dir}/rank0.pt")


def test_zero3_e4m3_two_gloo_ranks_match_one(tmp_path):
    """2 gloo processes (grad_accumulation 1) == 1 process (grad_accumulation 2) on the same micro-batches,
    bit for bit: the FP8 weight copies are made from whole gathered layers (global absmax), the persistent
    mode skips the same gathers on both ranks (else the collectives would not match up and hang), and a sum
    of two bf16 gradients rounds once whichever rank adds it. Clipping is off (the norm's summation order
    differs between 1 and 2 ranks)."""
    spawn_gloo_ranks(lambda r, port: (r, port, str(tmp_path)), _gloo_rank, 2)
    dist = torch.load(tmp_path / "rank0.pt")
    for persistent in (False, True):
        one = _engine("tiny", 3, **E4M3, grad_clip=0.0, persistent_quants=persistent)
        losses = _steps(one, 0, 3)
        assert dist[persistent][0] == losses, persistent
        assert torch.equal(dist[persistent][1], one.full_params()), persistent


def _kept_rank(rank: int, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks, ZeRO-3 e4m3 with 2 micro-steps, 4 layers: 2 steps without kept FP8 copies, then 2 with a
    --kept-quants-gib that differs between the ranks (as "auto" does when their free memory differs: rank 0 has
    room for layer 0's copies, rank 1 for every layer's). Saves its losses, weights, kept layers and gathers."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=4, name="tiny4")  # 2 layers would stay in the buffers
    with gloo_group(rank, 2, port) as comm:
        out = {}
        for kept in (False, True):
            opts = train_settings(model="tiny", batch_size=2, seq_len=16, grad_accumulation=2, zero_level=3,
                                grad_clip=0.0, **E4M3)
            if kept:
                probe = TrainEngine(cfg, opts, get_backend("torch"), comm)
                gib = fp8_layer_copy_gib(probe, 1 if rank == 0 else cfg.num_layers)
                opts = train_settings(opts, kept_quants_gib=gib)
            e = TrainEngine(cfg, opts, get_backend("torch"), comm)
            gathered = []
            real_gather = e.store._gather
            e.store._gather = lambda lo, hi, buf: (gathered.append((lo, hi)), real_gather(lo, hi, buf))[1]
            losses = []
            for step in range(2):
                for micro in range(2):
                    e.micro_step(*_batch(step, 2 * micro + rank, opts))
                losses.append(e.update(2e-3, step + 1).loss)
            kept_layers = sorted({e.model.lin.layer_of[key][0] for key, _ in e.model.lin.kept})
            out[kept] = (losses, e.full_params(), kept_layers, len(gathered))
        torch.save(out, f"{out_dir}/rank{rank}.pt")


def test_zero3_kept_copies_are_the_same_on_every_rank_and_skip_the_same_gathers(tmp_path):
    """ZeRO-3 skips gathering a layer whose FP8 copies are all kept, so the ranks must keep the same copies: with
    a different --kept-quants-gib per rank both keep what fits on the one with the least (layer 0), skip the
    same gathers (else the collectives would not match up and the ranks would hang), and train bit for bit as
    the same two ranks without kept copies."""
    spawn_gloo_ranks(lambda r, port: (r, port, str(tmp_path)), _kept_rank, 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert r[True][2] == [0] and r[False][2] == []
        assert r[True][0] == r[False][0]
        assert torch.equal(r[True][1], r[False][1])
        assert r[True][3] == r[False][3] - 2  # layer 0 in each step's second forward
    assert ranks[0][True][3] == ranks[1][True][3]


def _zero12_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One of ``world`` gloo ranks: 3 fp32 steps of ZeRO-1, then of ZeRO-2, each rank on its own micro-batches;
    rank 0 saves both runs' losses, gradient shards and final weights."""
    with gloo_group(rank, world, port) as comm:
        out = {}
        for zero in (1, 2):
            opts = train_settings(model="tiny-llama", batch_size=2, seq_len=16, grad_accumulation=1, zero_level=zero)
            e = TrainEngine(PRESETS["tiny-llama"], opts, get_backend("torch"), comm)
            losses, shards = [], []
            for step in range(3):
                e.micro_step(*_batch(step, rank, opts))
                if zero == 2:  # the reduced shard, before the update consumes it
                    shards.append(e.grad_shard.clone())
                losses.append(e.update(2e-3, step + 1).loss)
            out[zero] = (losses, shards, e.full_params().clone())
        if rank == 0:
            torch.save(out, f"{out_dir}/rank0.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_zero2_equals_zero1_bit_for_bit_on_gloo_ranks(tmp_path, world):
    """ZeRO-2 (each layer's gradients reduced onto their owners during the backward, no full gradient buffer)
    against ZeRO-1 (one reduce-scatter of the full buffer at the update), fp32 on 2 and 4 gloo processes: the
    same per-step losses and the same final weights, bit for bit. One micro-step per update: with more, the two
    sum over ranks and micro-steps in a different order, which rounds differently."""
    spawn_gloo_ranks(lambda r, port: (r, world, port, str(tmp_path)), _zero12_rank, world)
    out = torch.load(tmp_path / "rank0.pt")
    (l1, _, p1), (l2, shards, p2) = out[1], out[2]
    assert l1 == l2 and len(set(l1)) == 3  # equal, and every update changed the model
    assert all(bool(s.abs().sum() > 0) for s in shards)
    assert torch.equal(p1, p2)


def _zero1_overlap_rank(rank: int, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks: 3 steps of ZeRO-1 (bf16 weights, fp32 master, 2 micro-steps, small optimizer chunks
    that straddle units and shards), with the gradient reduce in the last backward and the per-unit weight
    broadcasts after the update, then with both off; rank 0 saves losses, weights and optimizer state."""
    with gloo_group(rank, 2, port) as comm:
        out = {}
        for overlap in (True, False):
            opts = train_settings(model="tiny-llama", batch_size=2, seq_len=16, grad_accumulation=2, zero_level=1,
                                model_dtype="bf16", master_dtype="fp32", opt_chunk_size=3000,
                                overlap_comm=overlap)
            e = TrainEngine(PRESETS["tiny-llama"], opts, get_backend("torch"), comm)
            assert (e.grad_reduce is not None) == overlap and (e.overlap is not None) == overlap
            losses = []
            for step in range(3):
                for micro in range(2):
                    e.micro_step(*_batch(step, 2 * rank + micro, opts), last=micro == 1)
                assert e._grads_reduced == overlap
                if overlap and step == 0:
                    with pytest.raises(RuntimeError, match="call update"):
                        e.micro_step(*_batch(step, 0, opts))
                losses.append(e.update(2e-3, step + 1).loss)
            e.join_update()
            out[overlap] = (losses, e.full_params().clone(),
                            {k: v.clone() for k, v in e.optimizer.state_tensors().items()})
        if rank == 0:
            torch.save(out, f"{out_dir}/rank0.pt")


def test_zero1_overlapped_reduce_and_gather_equal_the_plain_order_on_gloo_ranks(tmp_path):
    """ZeRO-1 on 2 gloo processes: reducing each unit's gradients onto its owners during the last backward
    (llmq_ray/engine/grad_reduce.py) and broadcasting each unit's updated weights from its owners
    (llmq_ray/engine/update_overlap.py) give exactly what one reduce-scatter and one all-gather give: the same
    losses, weights and optimizer state, bit for bit (rank-ordered sums on gloo)."""
    spawn_gloo_ranks(lambda r, port: (r, port, str(tmp_path)), _zero1_overlap_rank, 2)
    out = torch.load(tmp_path / "rank0.pt")
    (l_on, p_on, s_on), (l_off, p_off, s_off) = out[True], out[False]
    assert l_on == l_off and len(set(l_on)) == 3
    assert torch.equal(p_on, p_off)
    assert s_on.keys() == s_off.keys() and all(torch.equal(s_on[k], s_off[k]) for k in s_on)


def _gpt2_rank(rank: int, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks: tiny-gpt2 (tied head, learned positions in the embedding unit) for 3 fp32 steps of
    2 micro-steps under ZeRO-1, ZeRO-2 and ZeRO-3, each rank on its own micro-batches; rank 0 saves the losses."""
    with gloo_group(rank, 2, port) as comm:
        out = {}
        for zero in (1, 2, 3):
            opts = train_settings(model="tiny-gpt2", batch_size=2, seq_len=16, grad_accumulation=2, zero_level=zero)
            e = TrainEngine(PRESETS["tiny-gpt2"], opts, get_backend("torch"), comm)
            losses = []
            for step in range(3):
                for micro in range(2):
                    e.micro_step(*_batch(step, 2 * rank + micro, opts))
                losses.append(e.update(2e-3, step + 1).loss)
            out[zero] = (losses, e.full_params().clone())
        if rank == 0:
            torch.save(out, f"{out_dir}/rank0.pt")


def test_gpt2_trains_under_zero2_and_zero3_as_under_zero1_on_two_gloo_ranks(tmp_path):
    """GPT-2's position table is gathered and reduced with the token embedding (one unit, llmq_ray/parallel/data.py),
    so ZeRO-2 and ZeRO-3 take it like the other families: on 2 gloo processes their per-step losses equal ZeRO-1's
    within 1e-5 (the sums over ranks and micro-steps run in another order) and every update changed the model."""
    spawn_gloo_ranks(lambda r, port: (r, port, str(tmp_path)), _gpt2_rank, 2)
    out = torch.load(tmp_path / "rank0.pt")
    base, base_params = out[1]
    assert len(set(base)) == 3
    for zero in (2, 3):
        losses, params = out[zero]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, base)), (zero, losses, base)
        assert torch.allclose(params.float(), base_params.float(), rtol=0, atol=1e-5), zero
