"""What a model is built for: the micro-batch shape, the dtypes and the recipe, in one frozen description.

A model family's constructor takes its ``ModelConfig`` (the architecture: sizes, heads, norms) and a
``ModelBuild`` (how this process runs it: batch and sequence length, model dtype, recompute, the FP8 pieces, the
LM-head and attention-backward chunks, document masking). The engine makes the description in one place
(``model_build`` in llmq_ray/engine/train_engine.py) from whatever settings the run has; a test or a notebook
writes it directly. Everything here is checked on construction with one plain sentence per broken invariant
(``ValueError``): the sentences the user reads, naming the settings, come from the train layer's pre-flight
(llmq_ray/train/model_checks.py) before anything is built, so a failure here is a caller's bug.

``ModelPolicies`` is the one way the engine hands a model what it applies from outside (the model knows nothing
of streams, ranks or host memory): where the saved residual stream lives, where the FP8 weight copies live, and a
plan over the model's pieces (tensor and sequence parallelism, llmq_ray/parallel/tensor.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

SWIGLU_SCALES = ("current", "delayed", "smooth")
WEIGHT_COPIES = ("persistent", "layer")
RECOMPUTE_KINDS = ("swiglu", "norm", "ffn", "qkv", "att", "block")


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Which activation kinds are recomputed in the backward instead of kept per layer (llm.q's set).

    ``ffn`` implies ``swiglu``, ``att`` implies ``qkv``, ``block`` implies all of them and the mid-block residual;
    ``resolved()`` applies that (a model always holds the resolved set)."""

    swiglu: bool = False
    norm: bool = False
    ffn: bool = False
    qkv: bool = False
    att: bool = False
    block: bool = False

    @classmethod
    def of(cls, other) -> "Recompute":
        """The resolved set from anything with the six boolean attributes (None: nothing recomputed)."""
        if other is None:
            return cls()
        return cls(**{k: bool(getattr(other, k)) for k in RECOMPUTE_KINDS}).resolved()

    def resolved(self) -> "Recompute":
        ffn, att = self.ffn or self.block, self.att or self.block
        return Recompute(swiglu=self.swiglu or ffn, norm=self.norm or self.block, ffn=ffn, qkv=self.qkv or att,
                         att=att, block=self.block)

    @property
    def any(self) -> bool:
        return any(getattr(self, k) for k in RECOMPUTE_KINDS)


@dataclasses.dataclass(frozen=True)
class ModelBuild:
    """How one process runs a model: every micro-batch is ``batch`` x ``seq`` tokens (N = their product).

    ``dtype``: the model dtype of weights, gradients and activations. ``recompute``: a ``Recompute`` (or anything
    with its six booleans; stored resolved). ``block_dtype`` "e4m3" runs the four block GEMMs in FP8 (None: the
    model dtype), ``grad_fp8`` their gradient operands' FP8 format ("e4m3" / "e5m2"); ``weight_copies``
    where the FP8 weight copies are made (llmq_ray/model/layers/linear.py): "persistent" (every layer, once per
    step) or "layer" (two device slots, made per layer). ``swiglu_scale``: the scale of the down projection's FP8
    input -- "current" (its own absmax), "delayed" (the last pass's, llmq_ray/model/llama.py) or "smooth"
    (per-channel factors, llmq_ray/model/layers/smooth_swiglu.py); SwiGLU families only. ``head_chunks``: row
    chunks of the LM head (the [N, V] logits never exist), ``head_dtype`` "e4m3" for its FP8 GEMMs.
    ``attention_chunks``: the attention backward in that many slices of the batch. ``separator``: a token
    id that ends a document (attention stays inside documents; None: off); ``restart_positions``: learned positions
    restart at each document (GPT-2)."""

    batch: int
    seq: int
    dtype: torch.dtype = torch.float32
    recompute: Any = None
    block_dtype: str | None = None
    grad_fp8: str | None = None
    weight_copies: str = "persistent"
    swiglu_scale: str = "current"
    head_chunks: int = 1
    head_dtype: str | None = None
    attention_chunks: int = 1
    separator: int | None = None
    restart_positions: bool = False

    def __post_init__(self):
        object.__setattr__(self, "recompute", Recompute.of(self.recompute))
        b, t = self.batch, self.seq

        def need(ok: bool, sentence: str) -> None:
            if not ok:
                raise ValueError(sentence)

        need(isinstance(b, int) and isinstance(t, int) and b >= 1 and t >= 1,
             f"a micro-batch of {b} x {t} tokens: both must be integers >= 1")
        need(self.head_chunks >= 1 and (b * t) % self.head_chunks == 0,
             f"{self.head_chunks} LM-head chunks must be >= 1 and divide the {b * t} rows of a micro-batch")
        need(self.attention_chunks >= 1 and b % self.attention_chunks == 0,
             f"{self.attention_chunks} attention-backward chunks must be >= 1 and divide the batch of {b}")
        need(self.block_dtype in (None, "e4m3"), f"block GEMMs in {self.block_dtype!r}: None or 'e4m3'")
        need(self.grad_fp8 in (None, "e4m3", "e5m2"), f"FP8 gradients in {self.grad_fp8!r}")
        need(self.head_dtype in (None, "e4m3"), f"an LM head in {self.head_dtype!r}: None or 'e4m3'")
        need(self.weight_copies in WEIGHT_COPIES, f"FP8 weight copies {self.weight_copies!r}: one of {WEIGHT_COPIES}")
        need(self.swiglu_scale in SWIGLU_SCALES, f"SwiGLU scale {self.swiglu_scale!r}: one of {SWIGLU_SCALES}")
        need(not self.restart_positions or self.separator is not None,
             "positions restart at document starts: that needs a document separator")

    @property
    def rows(self) -> int:
        """N = batch_size * seq_len, the token rows of a micro-batch."""
        return self.batch * self.seq

    @property
    def fp8(self) -> bool:
        return self.block_dtype == "e4m3"

    @property
    def store_xt(self) -> bool:
        """FP8 without recomputation keeps q(x^T) of each block GEMM input for the wgrad (layers/linear.py)."""
        return not self.recompute.any


@dataclasses.dataclass(frozen=True)
class ModelPolicies:
    """What the engine applies to a model from outside, handed over once, at construction.

    ``residuals``: makes the store of the saved residual stream, ``residuals(num_layers, rows, hidden, dtype,
    device)`` -> an object indexed by layer 0..L, iterable over its device buffers, with ``host_tensors()`` and
    ``begin``/``end`` unit hooks (None: L+1 device buffers; llmq_ray/engine/offload.py keeps them on the host).
    ``block_linears``: makes the block GEMMs' ``BlockLinears`` (same arguments; None: the class itself; the engine's
    host-kept FP8 copies subclass it). ``plan``: applied over the model's pieces after they are made: ``rows(n)``
    -> the [start, end) of the N token rows this process keeps of the residual stream, and ``apply(model)``, which
    may replace the model's pieces (projections, norms, embedding, head) with its own (None: nothing applied)."""

    residuals: Callable | None = None
    block_linears: Callable | None = None
    plan: Any = None
