"""A worker's batches: its share of the train shards (``TokenStream``), or random tokens for benchmarks.

Both sources hand out ``(inputs, targets)`` int64 [B, T] on the CPU, pinned when CUDA is present, so the
engine's ``.to(device, non_blocking=True)`` is an asynchronous copy.
"""

from __future__ import annotations

import base64

import torch

from llmq_ray.actors.plan import RunPlan
from llmq_ray.errors import DataError


class RandomTokenStream:
    """Uniform random tokens in [0, vocab): each batch is B rows of T+1 tokens (inputs = [:, :T],
    targets = [:, 1:]), drawn from a CPU generator seeded by (seed, rank), so a run is reproducible and
    ranks see different data. No files needed: this is what ``benchmarks/bench_train.py`` trains on."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, rank: int, seed: int):
        self.vocab, self.T, self.B = vocab_size, seq_len, batch_size
        self.rank = rank
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self.pin = torch.cuda.is_available()

    def next_batch(self):
        tokens = torch.randint(0, self.vocab, (self.B, self.T + 1), generator=self.gen, dtype=torch.int64)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if self.pin:
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs, targets

    def state(self) -> dict:
        """The generator's state (base64), so a resumed run draws the same tokens."""
        raw = self.gen.get_state().numpy().tobytes()
        return {"random": True, "rank": self.rank, "generator": base64.b64encode(raw).decode("ascii")}

    def restore(self, state: dict) -> None:
        """Continue after ``state`` when it is this rank's (after a world-size change: rank 0's state is
        handed to every rank, and the other ranks keep their own seeds rather than repeat rank 0's tokens)."""
        if state.get("generator") and state.get("rank", 0) == self.rank:
            raw = bytearray(base64.b64decode(state["generator"]))
            self.gen.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())

    def close(self) -> None:
        pass


def train_source(plan: RunPlan, vocab_size: int, rank: int):
    """The worker's endless batch source for ``plan``: data-parallel rank ``rank`` of ``plan.data_parallel_size``
    (the worker's rank unless --tensor-parallel groups share one source)."""
    o = plan.settings
    if plan.settings.data.synthetic_data:
        return RandomTokenStream(vocab_size, o.data.seq_len, o.data.batch_size, rank, o.optim.seed)
    if not plan.settings.data.train_file:
        raise DataError("no --train-file given (pass a glob of token shards, or --synthetic-data for random tokens).")
    from llmq_ray.data_pipeline.stream import TokenStream

    return TokenStream(plan.settings.data.train_file, o.data.seq_len, o.data.batch_size, rank=rank, world_size=plan.data_parallel_size,
                       seed=o.optim.seed, use_ray=plan.settings.data.use_ray_data, vocab_size=vocab_size)


def eval_source(plan: RunPlan, vocab_size: int, rank: int, max_batches=None):
    """An EvalStream over ``plan.settings.data.eval_file`` for data-parallel rank ``rank`` (None when there is no eval file)."""
    if not plan.settings.data.eval_file:
        return None
    from llmq_ray.data_pipeline.stream import EvalStream

    o = plan.settings
    return EvalStream(plan.settings.data.eval_file, o.data.seq_len, o.data.batch_size, rank=rank, world_size=plan.data_parallel_size,
                      vocab_size=vocab_size, max_batches=max_batches)
