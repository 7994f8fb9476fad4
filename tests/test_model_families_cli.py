"""Each model family trains through the CLI on CPU from a folder with a non-preset config.json (a user's own
small model): Qwen3 (QK-norm, head_dim != hidden / heads), Llama 3.1 (llama3 rope scaling, untied head) and
GPT-2 (learned positions, LayerNorm, GELU MLP). The
loss must fall over 30 steps of the session's learnable synthetic shard."""

import json

import pytest

from llmq_ray.observe.runlog import read_log
from llmq_ray.train import cli

CONFIGS = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 48,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
              "tie_word_embeddings": True, "max_position_embeddings": 128, "attention_bias": False,
              "eos_token_id": 0, "bos_token_id": 0},
    "llama31": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 112, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                "tie_word_embeddings": False, "max_position_embeddings": 128, "eos_token_id": 0,
                "bos_token_id": 0},
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 48, "n_layer": 2, "n_head": 4,
             "n_inner": None, "n_positions": 64, "vocab_size": 512, "activation_function": "gelu_new",
             "layer_norm_epsilon": 1e-5, "eos_token_id": 0, "bos_token_id": 0},
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_small_model_of_each_family_trains_through_the_cli(ray_cluster, shards, tmp_path, family):
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS[family]))
    log = tmp_path / "log.jsonl"
    rc = cli.main(["--model", str(folder), "--from-scratch", "--device", "cpu", "--workers", "1",
                   "--train-file", shards.train, "--eval-file", shards.eval, "--steps", "30", "--batch-size", "4",
                   "--seq-len", "16", "--learning-rate", "1e-2", "--warmup", "2", "--out-dir", str(tmp_path / "out"),
                   "--log-file", str(log), "--no-export", "--sample-tokens", "0", "--no-progress",
                   "--no-ray-data", "--eval-every-n-steps", "0"])
    assert rc == 0
    records = read_log(str(log))
    losses = [r["loss"] for r in records if r.get("log") == "step"]
    final_eval = [r["loss"] for r in records if r.get("log") == "eval"][-1]
    assert len(losses) == 30
    # from ln(512) = 6.24 at the start; noisy per step (64 tokens), so means of five and the final eval
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.25, losses
    assert final_eval < losses[0] - 0.25, (final_eval, losses[0])
