"""Text generation with a KV cache, straight from the training model's flat parameter buffer.

The math is the training model's (``llmq_ray.model.llama`` / ``gpt2``) for one block, written as plain torch ops under
``torch.no_grad`` (no backend, no saved activations): RMSNorm in fp32, half-split RoPE, causal grouped-query
attention, SwiGLU ``up * silu(gate)``, then the final norm and the (tied or untied) LM head.

Generation runs in two phases:

* **prefill**: the whole prompt [B, P] goes through the model in one forward; every layer writes its keys
  and values into the cache, and only the last position's logits are kept;
* **decode**: one token per step [B, 1]: its query attends to all cached keys, its own k/v are appended.

The cache is two tensors ``k``, ``v`` of shape [L, B, Hkv, T_max, D] (T_max = P + max_new_tokens) in the
params' dtype, allocated once per call. Prompts of unequal length are *left*-padded: row b's prompt fills
slots [pad_b, P), so all rows write step t into the same slot P + t and one decoding step is one batched
forward. Slot s of row b sits at position s - pad_b; keys in slots < pad_b are masked out. The RoPE cos/sin
table is built on the CPU in fp32 exactly as the training model builds it, so prefill logits equal the
training forward's.

GPT-2 (``cfg.is_gpt2``) runs the same loop with its own block: the position table added to the token embedding
(row b's slot s at position s - pad_b, as RoPE would rotate it), LayerNorm with bias, biased projections, no RoPE
and the GELU-tanh MLP; its positions end at ``max_position_embeddings`` (a longer generation is refused).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.nn.functional as F

from llmq_ray.model.config import ModelConfig, resolve_model
from llmq_ray.errors import ModelConfigError
from llmq_ray.model.params import ParamLayout, init_params

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] -> x / rms(x) * weight, statistics in fp32, one rounding back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """GPT-2's LayerNorm over x [..., C]: statistics in fp32, one rounding back to x's dtype."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding: x [B, S, H, D], cos/sin [B, S, D/2] (fp32)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Generator:
    """Greedy / sampled decoding of a Llama-family model whose weights sit in a ``ParamLayout`` flat buffer.

    ``params`` is used in place (named views, no copies); its device and dtype are the generation's.
    """

    def __init__(self, cfg: ModelConfig, layout: ParamLayout, params: torch.Tensor):
        if params.dim() != 1 or not params.is_floating_point():
            raise ValueError(f"params must be a 1-D float buffer, got {params.dtype} {tuple(params.shape)}")
        self.cfg, self.layout, self.params = cfg, layout, params
        self.w = layout.views(params)
        self.head = self.w["embed"] if cfg.tie_word_embeddings else self.w["lm_head"]
        self.device, self.dtype = params.device, params.dtype
        self.k_cache: torch.Tensor | None = None  # [L, B, Hkv, T_max, D]
        self.v_cache: torch.Tensor | None = None
        self.pad = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] left padding of each row
        self._cos = self._sin = None  # [T_max, D/2] fp32 on device

    # ------------------------------------------------------------------ cache
    def reset(self, batch: int, max_len: int) -> None:
        """Make room for ``batch`` rows of ``max_len`` slots (reusing the cache if the shape is the same)."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        if self.k_cache is None or tuple(self.k_cache.shape) != shape:
            self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if cfg.is_gpt2 and max_len > cfg.max_position_embeddings:
            raise ValueError(f"the prompt plus the tokens to generate ({max_len}) exceed GPT-2's learned position "
                             f"table ({cfg.max_position_embeddings} positions); ask for fewer new tokens "
                             f"or give a shorter prompt.")
        if not cfg.is_gpt2 and (self._cos is None or self._cos.shape[0] < max_len):
            angles = torch.arange(max_len, dtype=torch.float32)[:, None] * cfg.rope_inv_freq()[None, :]
            self._cos, self._sin = angles.cos().to(self.device), angles.sin().to(self.device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens [B, S] placed in cache slots [start, start + S); earlier slots must be filled already.

        Returns fp32 logits [B, S, V] with ``all_logits``, else those of the last slot only, [B, V].
        """
        cfg, w = self.cfg, self.w
        b, s = tokens.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        end = start + s
        if self.k_cache is None or self.k_cache.shape[1] != b or end > self.k_cache.shape[3]:
            raise ValueError(f"slots [{start}, {end}) for batch {b} do not fit the cache; call reset() first")
        slots = torch.arange(start, end, device=self.device)
        pos = (slots[None, :] - self.pad[:, None]).clamp(min=0)  # [B, S]
        gpt2 = cfg.is_gpt2
        cos, sin = (None, None) if gpt2 else (self._cos[pos], self._sin[pos])
        # key slot k is visible to query slot q if k <= q and k is not padding (a padded query sees itself,
        # so that its softmax is finite; nothing real ever attends to it)
        key = torch.arange(end, device=self.device)
        visible = (key[None, None, :] <= slots[None, :, None]) & (
            (key[None, None, :] >= self.pad[:, None, None]) | (key[None, None, :] == slots[None, :, None]))
        visible = visible[:, None, None]  # [B, 1, 1, S, end] against scores [B, Hkv, G, S, end]

        eps = cfg.rms_norm_eps

        def norm(x, name):  # RMSNorm, or GPT-2's LayerNorm with its bias
            return _layernorm(x, w[name + "_w"], w[name + "_b"], eps) if gpt2 else _rmsnorm(x, w[name + "_w"], eps)

        x = w["embed"][tokens.to(self.device)]  # [B, S, C]
        if gpt2:  # in fp32, one rounding, as the training forward adds them
            x = (x.float() + w["pos_embed"][pos].float()).to(self.dtype)
        for layer in range(cfg.num_layers):
            p = f"layers.{layer}."
            h = norm(x, p + "ln1")
            qkv = F.linear(h, w[p + "qkv_w"], w.get(p + "qkv_b")).view(b, s, hq + 2 * hkv, d)
            q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv]
            if cfg.qk_norm:  # Qwen3: per-head RMSNorm of queries and keys before RoPE
                q, k = _rmsnorm(q, w[p + "q_norm_w"], cfg.rms_norm_eps), _rmsnorm(k, w[p + "k_norm_w"], cfg.rms_norm_eps)
            if not gpt2:
                q = _rope(q, cos, sin)
                k = _rope(k, cos, sin)
            self.k_cache[layer, :, :, start:end] = k.transpose(1, 2)
            self.v_cache[layer, :, :, start:end] = qkv[:, :, hq + hkv:].transpose(1, 2)
            keys = self.k_cache[layer, :, :, :end].float()[:, :, None]  # [B, Hkv, 1, end, D]
            values = self.v_cache[layer, :, :, :end].float()[:, :, None]
            # query head j uses kv head j // G: view heads as [Hkv, G]
            qg = q.float().view(b, s, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, S, D]
            scores = (qg @ keys.transpose(-1, -2)) * (1.0 / d ** 0.5)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            att = (probs @ values).permute(0, 3, 1, 2, 4).reshape(b, s, hq * d).to(self.dtype)
            x = x + F.linear(att, w[p + "out_w"], w.get(p + "out_b"))
            h = norm(x, p + "ln2")
            if gpt2:
                f = F.linear(h, w[p + "up_w"], w[p + "up_b"]).float()
                x = x + F.linear(F.gelu(f, approximate="tanh").to(self.dtype), w[p + "down_w"], w[p + "down_b"])
            else:
                up, gate = F.linear(h, w[p + "up_gate_w"]).float().chunk(2, dim=-1)
                x = x + F.linear((up * F.silu(gate)).to(self.dtype), w[p + "down_w"])
        if not all_logits:
            x = x[:, -1:]
        final = _layernorm(x, w["final_norm"], w["final_norm_b"], eps) if gpt2 else _rmsnorm(x, w["final_norm"], eps)
        logits = F.linear(final, self.head).float()
        return logits if all_logits else logits[:, 0]

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], max_len: int, all_logits: bool = False) -> torch.Tensor:
        """Reset the cache for len(prompts) rows of ``max_len`` slots, left-pad and run the prompts.

        Returns the logits of ``forward`` (slot P - 1 is every row's last prompt token).
        """
        p = max(len(r) for r in prompts)
        tokens = torch.zeros(len(prompts), p, dtype=torch.long)
        for i, row in enumerate(prompts):
            tokens[i, p - len(row):] = torch.as_tensor(list(row), dtype=torch.long)
        self.reset(len(prompts), max_len)
        self.pad = torch.tensor([p - len(r) for r in prompts], dtype=torch.long, device=self.device)
        return self.forward(tokens.to(self.device), 0, all_logits)

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                 seed: int = 0, eos_token_id: int | Sequence[int] | None = None) -> list[list[int]]:
        """Continue each prompt by up to ``max_new_tokens`` tokens; returns the new tokens of each row.

        ``prompt_ids``: list[int] (one prompt), a list of such lists (any lengths), or an int tensor [B, P].
        ``temperature`` 0 is greedy (argmax); above 0 the logits are divided by it, restricted to the
        ``top_k`` most likely tokens if given, and sampled with a generator seeded by ``seed`` on the params'
        device (same seed, same device and dtype: same tokens). A row stops after it emits any of
        ``eos_token_id`` (the eos is included in its output); the loop ends when every row has stopped.
        """
        rows = _as_rows(prompt_ids)
        v = self.cfg.vocab_size
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(f"prompt {i} is empty; give at least one token")
            if min(row) < 0 or max(row) >= v:
                raise ValueError(f"prompt {i} has token ids outside [0, {v}) of this model's vocabulary")
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError(f"need max_new_tokens >= 0, temperature >= 0, top_k >= 1 "
                             f"(got {max_new_tokens}, {temperature}, {top_k})")
        p = max(len(r) for r in rows)
        if p + max_new_tokens > self.cfg.max_position_embeddings:
            warnings.warn(f"prompt + new tokens ({p + max_new_tokens}) exceed the model's "
                          f"max_position_embeddings ({self.cfg.max_position_embeddings})", stacklevel=2)
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        out: list[list[int]] = [[] for _ in rows]
        if max_new_tokens == 0:
            return out
        gen = torch.Generator(device=self.device).manual_seed(seed) if temperature > 0 else None
        logits = self.prefill(rows, p + max_new_tokens)
        done = [False] * len(rows)
        for step in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, gen)  # [B]
            for i, tok in enumerate(nxt.tolist()):
                if not done[i]:
                    out[i].append(tok)
                    done[i] = tok in eos
            if all(done) or step + 1 == max_new_tokens:
                break
            logits = self.forward(nxt[:, None], p + step)
        return out


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                gen: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row from fp32 logits [B, V]: argmax if temperature == 0, else a sample."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=gen)[:, 0]


def _as_rows(prompt_ids) -> list[list[int]]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]
        if prompt_ids.dim() != 2 or prompt_ids.is_floating_point():
            raise ValueError(f"prompt tensor must be int [B, P], got {prompt_ids.dtype} {tuple(prompt_ids.shape)}")
        return prompt_ids.tolist()
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) for t in prompt_ids):
        return [prompt_ids]
    return [[int(t) for t in row] for row in prompt_ids]


def generate(cfg: ModelConfig, layout: ParamLayout, params_flat: torch.Tensor, prompt_ids, max_new_tokens: int,
             **kwargs) -> list[list[int]]:
    """One-shot ``Generator(cfg, layout, params_flat).generate(prompt_ids, max_new_tokens, **kwargs)``."""
    return Generator(cfg, layout, params_flat).generate(prompt_ids, max_new_tokens, **kwargs)


def load_for_generation(model_dir_or_preset: str, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str = torch.float32, seed: int = 0) -> Generator:
    """A Generator for an HF folder (config.json + safetensors, e.g. our export), an HF id in the local
    cache, or a preset name (random weights from ``init_params(seed)``, for smoke tests only)."""
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise ModelConfigError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}.")
        dtype = _DTYPES[dtype.lower()]
    from llmq_ray.model.hf_io import load_hf_weights

    cfg, folder = resolve_model(model_dir_or_preset)
    layout = ParamLayout(cfg)
    flat = torch.empty(layout.numel, dtype=dtype, device=device)
    if folder is None:
        warnings.warn(f"{model_dir_or_preset!r} is a preset without weights: generating from a random "
                      f"initialization (seed {seed}).", stacklevel=2)
        init_params(layout, flat, seed)
    else:
        load_hf_weights(folder, layout, flat)
    return Generator(cfg, layout, flat)
