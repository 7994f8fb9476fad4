"""Checkpoint <-> TrainEngine: what one rank writes, and how a rank is put back into the saved state.

The storage of record of a rank is its optimizer shard (``engine.optimizer.state_tensors()``: "master",
"m", "v" over the global flat range [engine.shard_start, engine.shard_end)). The full model-dtype
``params`` buffer is derived state: after loading, each rank refreshes its own slice from the master
(``ShardedAdamW.load_state_tensors``) and the ranks all-gather the slices, exactly like the end of an
update. The one other piece of training state is the delayed FP8 SwiGLU scales (--fp8-delayed-swiglu-scale:
per-layer maxima of the last forward and backward, ``TrainEngine.fp8_scale_state``): small and different on
every worker, they go into the manifest as JSON, one entry per worker (``fp8_scale_state_json``), and come
back with ``restore_fp8_scale_state``, so an e4m3 resume is bit-exact too. Nothing else needs saving:
initialization and stochastic-rounding seeds are pure functions of (seed, step, flat offset), and the step
number comes from the manifest.

Single process (tests, notebooks)::

    path = save_engine_checkpoint(ckpt_dir, step, engine, data_state=[stream.state()])
    manifest = load_engine_checkpoint(path, engine2)           # or resolve_continue(...) first
    stream2.restore(data_state_for_rank(manifest, 0, 1))
    train_steps(engine2, batches, start_step=manifest["step"])   # tests/_engine_loop.py

Under Ray every worker calls ``engine_checkpoint_tensors`` + ``write_rank_shard`` (save, returning its
``fp8_scale_state_json`` to the coordinator), or ``load_checkpoint`` + ``restore_engine`` +
``restore_fp8_scale_state`` (load; a collective: all ranks must call it). ``save_checkpoint`` writes a whole
checkpoint of given tensors in one process. This is the top module of ``llmq_ray.checkpoints`` (it imports
the engine and torch); the others never import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from llmq_ray.checkpoints.layout import (STATE_NAMES, build_manifest, data_state_for_rank, fp8_scale_state_for_rank,
                                         restore_rng, rng_state, step_dir)
from llmq_ray.checkpoints.local import (begin_checkpoint, discard_tmp, finalize_checkpoint, load_checkpoint,
                                        write_rank_shard)
from llmq_ray.checkpoints.retention import apply_retention
from llmq_ray.engine.train_engine import TrainEngine
from llmq_ray.errors import CheckpointError
from llmq_ray.settings.overrides import flat

__all__ = ["engine_checkpoint_tensors", "restore_engine", "save_engine_checkpoint", "load_engine_checkpoint",
           "data_state_for_rank", "save_checkpoint", "fp8_scale_state_json", "restore_fp8_scale_state"]


def save_checkpoint(ckpt_dir: str, step: int, shards: Sequence[tuple[int, int, Mapping[str, torch.Tensor]]], *,
                    config, options: Any = None, data_state: Sequence[Mapping | None] | None = None,
                    rng: Mapping | None = None, extra: Mapping[str, Any] | None = None,
                    keep_n: int | None = 2, major_every: int = 0,
                    fp8_scale_state: Sequence[Mapping | None] | None = None, tensor_parallel: int = 1) -> str:
    """Single process: write a whole checkpoint (all ``shards`` = [(start, end, {"master","m","v"})], one per
    rank) with the protocol of local.py and apply retention. Returns the final folder. ``keep_n=None`` skips
    retention; ``fp8_scale_state``: one ``fp8_scale_state_json`` per worker, of ``tensor_parallel``-sized groups
    (``layout.build_manifest``)."""
    tmp = begin_checkpoint(ckpt_dir, step)
    try:
        records = [write_rank_shard(tmp, r, tensors, start, end) for r, (start, end, tensors) in enumerate(shards)]
        manifest = build_manifest(step, config=config, world_size=len(shards), options=options,
                                  data_state=data_state, rng=rng, extra=extra, fp8_scale_state=fp8_scale_state,
                                  tensor_parallel=tensor_parallel)
        final = finalize_checkpoint(tmp, step_dir(ckpt_dir, step), manifest, records=records)
    except BaseException:
        discard_tmp(tmp)  # a no-op when the failure path already removed it
        raise
    if keep_n is not None:
        apply_retention(ckpt_dir, keep_n=keep_n, major_every=major_every, protect=[final])
    return final


def fp8_scale_state_json(engine: TrainEngine) -> dict[str, list[float]]:
    """This rank's delayed FP8 scales (``TrainEngine.fp8_scale_state``) as JSON lists for the manifest ({} when
    the run has none). An fp32 value goes through a Python float and its repr exactly, so the resume restores
    the same bits."""
    return {k: [float(x) for x in t.detach().to("cpu", torch.float32).tolist()]
            for k, t in engine.fp8_scale_state().items()}


def restore_fp8_scale_state(engine: TrainEngine, manifest: Mapping[str, Any], rank: int, world_size: int,
                            tensor_parallel: int = 1) -> None:
    """Put worker ``rank`` of ``world_size`` back to the delayed FP8 scales its checkpoint saved
    (``layout.fp8_scale_state_for_rank``: its own on the saved number of workers, else the elementwise maximum
    over the saved workers). A checkpoint without them (an older one, or one of a run without the delayed
    scale) leaves the engine measuring afresh in its first step, as before; a run without the delayed scale
    ignores saved ones."""
    saved = fp8_scale_state_for_rank(manifest, rank, world_size, tensor_parallel)
    engine.load_fp8_scale_state({k: torch.tensor(v, dtype=torch.float32) for k, v in saved.items()})


def engine_checkpoint_tensors(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """This rank's state for ``write_rank_shard``: {"master", "m", "v"}, 1-D over
    [engine.shard_start, engine.shard_end). These are the optimizer's live buffers (no copy): write them
    before the next update."""
    return dict(engine.optimizer.state_tensors())


def restore_engine(engine: TrainEngine, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load a rank's saved {"master", "m", "v"} (for exactly its [shard_start, shard_end)) into ``engine``.

    1. ``optimizer.load_state_tensors``: copies m, v and the master (converting fp32/bf16 if the dtypes
       changed) and sets params[shard_start:shard_end] from the master (rounded to nearest, which is what
       an update leaves there);
    2. every rank's working copy of the weights is refreshed by ``engine.sync_weights()`` (the all-gather
       of the params shards; under ZeRO-3 the replicated norms/biases). With one process that is a no-op
       (the shard is the whole buffer); with W ranks it is a **collective**: every rank must call
       ``restore_engine`` at the same point.

    Gradient accumulators are reset, so the next ``micro_step`` starts a fresh step."""
    missing = [k for k in STATE_NAMES if k not in tensors]
    if missing:
        raise CheckpointError(f"restore_engine: the loaded state lacks {missing}.")
    engine.optimizer.load_state_tensors({k: tensors[k] for k in STATE_NAMES})
    engine.sync_weights()
    engine.micro_steps_done = 0
    if engine.grads is not None:
        engine.grads.zero_()
    if engine.grad_shard is not None:
        engine.grad_shard.zero_()


def _group_fp8_scale_states(engine: TrainEngine) -> list[dict[str, list[float]]]:
    """Every tensor-parallel rank's ``fp8_scale_state_json`` in rank order (a collective over the group: each
    rank sums its row into zeros); [this rank's] without tensor parallelism."""
    mine = engine.fp8_scale_state()
    if engine.tp is None or not mine:
        return [fp8_scale_state_json(engine)]
    size = engine.tp.plan.size
    names = sorted(mine)
    rows = torch.zeros(size, len(names), *mine[names[0]].shape, dtype=torch.float32, device=engine.device)
    rows[engine.tp.rank] = torch.stack([mine[k].to(rows) for k in names])
    engine.tp.all_reduce_sum(rows)  # one non-zero row per rank: the sum is exact
    return [{k: [float(x) for x in rows[r, i].cpu().tolist()] for i, k in enumerate(names)} for r in range(size)]


def save_engine_checkpoint(ckpt_dir: str, step: int, engine: TrainEngine, *,
                           data_state: Sequence[Mapping | None] | None = None, extra: Mapping[str, Any] | None = None,
                           keep_n: int | None = 2, major_every: int = 0) -> str | None:
    """Single process (world size 1): write the checkpoint of ``step`` (updates completed) and apply
    retention. ``data_state``: [stream.state()]. Returns the checkpoint folder.

    One tensor-parallel group (data-parallel size 1): a collective over the group; the state is gathered into
    the whole model's flat layout (``TrainEngine.tensor_parallel_gather``), so the checkpoint is the one a
    single process would write and resumes on any tensor-parallel size; rank 0 of the group writes it and
    returns the folder, the others return None once it is complete (or raise CheckpointError if it failed)."""
    if engine.comm.world_size != 1:
        raise RuntimeError("save_engine_checkpoint is for one process; under Ray each worker calls "
                           "write_rank_shard and the coordinator finalize_checkpoint.")
    state = engine_checkpoint_tensors(engine)
    scales = _group_fp8_scale_states(engine)
    write = dict(fp8_scale_state=scales, tensor_parallel=len(scales),
                 config=engine.full_cfg, options=flat(engine.settings), data_state=data_state, rng=rng_state(engine.settings.optim.seed),
                 extra=extra, keep_n=keep_n, major_every=major_every)
    if engine.tp is None:
        return save_checkpoint(ckpt_dir, step, [(engine.shard_start, engine.shard_end, state)], **write)
    state = {name: engine.tensor_parallel_gather(t, keep=engine.tp.rank == 0) for name, t in state.items()}
    done = torch.zeros(1, device=engine.device)  # rank 0 says whether the folder is complete: a barrier too
    path = None
    if engine.tp.rank == 0:
        try:
            path = save_checkpoint(ckpt_dir, step, [(0, next(iter(state.values())).numel(), state)], **write)
            done += 1
        finally:  # on failure the others learn it here instead of waiting at their next collective
            engine.tp.all_reduce_sum(done)
        return path
    engine.tp.all_reduce_sum(done)
    if done.item() != 1:
        raise CheckpointError(f"the checkpoint of step {step} in {ckpt_dir} was not written: rank 0 of the "
                              f"tensor-parallel group failed to write it (its error says why).")
    return None


def load_engine_checkpoint(folder: str, engine: TrainEngine, *, restore_global_rng: bool = True) -> dict:
    """Load ``folder`` into this rank's ``engine`` (any saved world size; collective when W > 1, see
    ``restore_engine``) and return the manifest; the caller restores its data stream from
    ``data_state_for_rank(manifest, rank, world_size)`` and continues at ``manifest["step"]``."""
    if engine.tp is not None:  # the whole model's state (one data-parallel rank), this rank's part of it
        from llmq_ray.parallel.tensor import shard_params
        from llmq_ray.model.params import ParamLayout

        if engine.comm.world_size != 1:
            raise RuntimeError("load_engine_checkpoint takes one tensor-parallel group (data-parallel size 1).")
        full_layout = ParamLayout(engine.full_cfg)
        tensors, manifest = load_checkpoint(folder, expected_config=engine.full_cfg, shard_start=0,
                                            shard_end=full_layout.numel, device=engine.device)
        tensors = {k: shard_params(engine.tp.plan, full_layout, t, engine.tp.rank) for k, t in tensors.items()}
    else:
        tensors, manifest = load_checkpoint(folder, expected_config=engine.cfg, world_size=engine.comm.world_size,
                                            rank=engine.comm.rank, shard_start=engine.shard_start,
                                            shard_end=engine.shard_end, device=engine.device)
    restore_engine(engine, tensors)
    if engine.tp is not None:
        restore_fp8_scale_state(engine, manifest, engine.tp.rank, engine.tp.plan.size, engine.tp.plan.size)
    else:
        restore_fp8_scale_state(engine, manifest, engine.comm.rank, engine.comm.world_size)
    if restore_global_rng and manifest.get("rng"):
        restore_rng(manifest["rng"])
    return manifest
