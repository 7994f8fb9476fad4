"""Qwen3 dense (QK-norm, no QKV bias, head_dim set by the config): presets and training.

The exactness against transformers' Qwen3ForCausalLM (loss, every gradient, the HF round trip, KV-cache
generation) is in tests/test_model_vs_hf.py and tests/test_generate.py; here: the presets have the published
sizes, and the engine trains a small Qwen3 whose attention width differs from its hidden size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.engine.train_engine import TrainEngine
from llmq_ray.model.config import PRESETS, config_from_hf_dict
from _helpers import checked_settings, train_settings

# non-embedding parameters of the Qwen3 dense models, as the Qwen3 technical report lists them (billions)
NON_EMBEDDING = {"Qwen3-0.6B": 0.44, "Qwen3-1.7B": 1.4, "Qwen3-4B": 3.6, "Qwen3-8B": 6.95, "Qwen3-14B": 13.2}


@pytest.mark.parametrize("name", sorted(NON_EMBEDDING))
def test_presets_have_the_published_sizes(name):
    cfg = PRESETS[name]
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 128
    embedding = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    non_embedding = (cfg.num_parameters() - embedding) / 1e9
    assert non_embedding == pytest.approx(NON_EMBEDDING[name], rel=0.01), non_embedding


def test_preset_round_trips_through_its_hf_config():
    cfg = PRESETS["Qwen3-4B"]
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["Qwen3ForCausalLM"] and d["attention_bias"] is False and d["head_dim"] == 128
    again = config_from_hf_dict(d)
    assert dataclasses.replace(again, name=cfg.name) == cfg and again.qk_norm


def test_attention_bias_and_sliding_window_are_refused():
    from llmq_ray.errors import ConfigError

    d = PRESETS["Qwen3-0.6B"].to_hf_dict()
    with pytest.raises(ConfigError, match="attention_bias=true is not supported"):
        config_from_hf_dict({**d, "attention_bias": True}, source="q3/config.json")
    with pytest.raises(ConfigError, match="use_sliding_window=true is not supported"):
        config_from_hf_dict({**d, "use_sliding_window": True}, source="q3/config.json")


def test_tiny_qwen3_trains_and_its_qk_norm_weights_learn():
    """20 steps on a repeating token pattern: the loss falls by half, and the QK-norm weights (initialised to
    ones) move, so their gradients reach the optimizer."""
    opts = train_settings(model="tiny-qwen3", batch_size=4, seq_len=32, learning_rate=3e-3, seed=1)
    e = TrainEngine(PRESETS["tiny-qwen3"], opts, get_backend("torch"))
    slot = e.layout.slots["layers.0.q_norm_w"]
    assert torch.equal(e.params[slot.offset:slot.end], torch.ones(32))
    pattern = torch.arange(33) % 7 + 10
    x = pattern.repeat(4, 1)
    losses = []
    for step in range(20):
        e.micro_step(x[:, :-1], x[:, 1:], last=True)
        losses.append(e.update(3e-3, step + 1).loss)
    assert losses[-1] < 0.5 * losses[0], losses
    assert not torch.equal(e.params[slot.offset:slot.end], torch.ones(32))
