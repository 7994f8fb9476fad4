"""The training step's options: ``TrainOptions``, a flat validated dataclass generated from the settings tree.

Each field is defined once, with its help text, in llmq_ray/settings.py; the CLI (llmq_ray/train/cli.py) is
generated from the same tree (``--grad-accumulation`` -> ``grad_accumulation``), and ``LLMQTrainer`` takes the
fields as keyword arguments. ``validate()`` turns flag combinations that make no sense into one ConfigError
sentence naming the flags. Also here: ``RecomputeOptions`` (what the model reads) and ``DTYPES``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from llmq_ray.errors import ConfigError
from llmq_ray.settings import NO_TRAIN_DEFAULT, all_settings

if TYPE_CHECKING:  # torch is imported only when a property needs it: the CLI validates its input before
    import torch   # anything heavy is imported (a bad flag ends in well under a second)

DTYPE_NAMES = ("fp32", "bf16")


def _gib_or_auto(value) -> bool:
    """Whether a --kept-quants-gib / --opt-resident-gib value is valid: a finite number >= 0 (GiB) or "auto"."""
    if value == "auto":
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


@dataclasses.dataclass(frozen=True)
class RecomputeOptions:
    """llm.q's recompute flags, as the model reads them. ``resolved()`` applies their implications."""

    swiglu: bool = False
    norm: bool = False
    ffn: bool = False      # implies swiglu
    qkv: bool = False
    att: bool = False      # implies qkv
    block: bool = False    # implies all of the above, and the mid-block residual

    def resolved(self) -> "RecomputeOptions":
        block = self.block
        ffn = self.ffn or block
        att = self.att or block
        return RecomputeOptions(swiglu=self.swiglu or ffn, norm=self.norm or block, ffn=ffn,
                                qkv=self.qkv or att, att=att, block=block)


def __getattr__(name: str):
    """``DTYPES`` ({"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}) is built on
    first use, importing torch (e4m3 only for --opt-m-dtype)."""
    if name == "DTYPES":
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _TrainOptionsBase:
    """What TrainOptions adds to its fields: derived values and ``validate()``."""

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.model_dtype]

    @property
    def recompute(self) -> "RecomputeOptions":
        return RecomputeOptions(swiglu=self.recompute_swiglu, norm=self.recompute_norm, ffn=self.recompute_ffn,
                                qkv=self.recompute_qkv, att=self.recompute_att, block=self.recompute_block)

    @property
    def effective_zero_level(self) -> int:
        return max(self.zero_level, 2 if self.shard_gradients else 0, 3 if self.shard_weights else 0)

    @property
    def quants_placement(self) -> str:
        """Where BlockLinears keeps the FP8 weight copies: "host" (--offload-quants), "persistent" (all layers
        on the device: --persistent-quants, and by default below ZeRO-3, where the bf16 weights are resident
        anyway and quantizing once per step is cheapest) or "layer" (made per layer when it runs: the ZeRO-3
        default, from the gathered weights, and --transient-quants at any level, to save the memory)."""
        if self.offload_quants:
            return "host"
        if self.transient_quants:
            return "layer"
        return "persistent" if self.persistent_quants or self.effective_zero_level < 3 else "layer"

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_master or self.offload_opt_m or self.offload_opt_v

    def validate(self) -> "TrainOptions":
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)

        for flag in ("batch_size", "grad_accumulation", "steps", "lmhead_chunks", "attn_bwd_chunks", "opt_chunk_size"):
            value = getattr(self, flag)
            need(isinstance(value, int) and value >= 1, f"--{flag.replace('_', '-')}={value!r} must be an integer >= 1.")
        need(self.seq_len >= 2, f"--seq-len={self.seq_len} must be at least 2.")
        need(self.learning_rate > 0, f"--learning-rate={self.learning_rate} must be > 0.")
        need(0 <= self.beta_1 < 1 and 0 <= self.beta_2 < 1,
             f"--beta-1={self.beta_1} and --beta-2={self.beta_2} must be in [0, 1).")
        need(self.weight_decay >= 0, f"--weight-decay={self.weight_decay} must be >= 0.")
        need(self.grad_clip >= 0, f"--grad-clip={self.grad_clip} must be >= 0 (0 turns clipping off).")
        for flag in ("model_dtype", "master_dtype", "opt_m_dtype", "opt_v_dtype"):
            value = getattr(self, flag)
            names = DTYPE_NAMES + (("e4m3",) if flag == "opt_m_dtype" else ())
            need(value in names, f"--{flag.replace('_', '-')}={value!r} must be one of {sorted(names)}.")
        need(self.fp8_monitor_every >= 0, f"--fp8-monitor-every={self.fp8_monitor_every} must be >= 0 (0: off).")
        need(not self.fp8_delayed_swiglu_scale or self.matmul_dtype == "e4m3",
             "--fp8-delayed-swiglu-scale needs --matmul-dtype e4m3: it sets the scale of an FP8 gradient.")
        need(not self.fp8_smooth_swiglu or self.matmul_dtype == "e4m3",
             "--fp8-smooth-swiglu needs --matmul-dtype e4m3: it rescales the down projection's FP8 input.")
        need(not (self.fp8_smooth_swiglu and self.fp8_delayed_swiglu_scale),
             "--fp8-smooth-swiglu and --fp8-delayed-swiglu-scale both set how the down projection's FP8 input is "
             "scaled; use one of them.")
        need(not (self.fp8_smooth_swiglu and self.use_cuda_graphs),
             "--fp8-smooth-swiglu does not run under --use-cuda-graphs yet (the pair has not been run on a GPU).")
        need(self.fp8_monitor_every == 0 or self.matmul_dtype == "e4m3",
             "--fp8-monitor-every needs --matmul-dtype e4m3: it reports the scales of the FP8 down projection.")
        need(not (self.opt_m_dtype == "e4m3" and self.offload_opt_m),
             "--opt-m-dtype=e4m3 cannot be combined with --offload-opt-m: the 8-bit first moment (1 byte per "
             "parameter) is meant to stay on the GPU.")
        need(not (self.model_dtype == "fp32" and self.master_dtype == "bf16"),
             "--master-dtype=bf16 with --model-dtype=fp32 makes no sense: the master copy would be less precise "
             "than the weights it updates; use --master-dtype=fp32.")
        need(self.gemm in (None, "torch", "cublaslt"), f"--gemm={self.gemm!r} must be torch or cublaslt.")
        need(self.matmul_dtype in (None, self.model_dtype, "bf16", "e4m3"),
             f"--matmul-dtype={self.matmul_dtype!r} must be the model dtype or e4m3.")
        if self.matmul_dtype == "bf16":
            need(self.model_dtype == "bf16", "--matmul-dtype=bf16 needs --model-dtype=bf16.")
        need(self.gradient_dtype in (None, "e4m3", "e5m2"),
             f"--gradient-dtype={self.gradient_dtype!r} must be e4m3 or e5m2.")
        need(self.gradient_dtype is None or self.matmul_dtype == "e4m3",
             f"--gradient-dtype={self.gradient_dtype} only applies with --matmul-dtype=e4m3.")
        need(self.matmul_dtype != "e4m3" or self.model_dtype == "bf16",
             "--matmul-dtype=e4m3 needs --model-dtype=bf16.")
        need(self.lmhead_dtype in (None, self.model_dtype, "e4m3"),
             f"--lmhead-dtype={self.lmhead_dtype!r} must be the model dtype or e4m3.")
        need(self.lmhead_dtype != "e4m3" or self.model_dtype == "bf16",
             "--lmhead-dtype=e4m3 needs --model-dtype=bf16.")
        need(self.zero_level in (1, 2, 3), f"--zero-level={self.zero_level} must be 1, 2 or 3.")
        need(self.document_separator is None or (isinstance(self.document_separator, int)
                                                 and not isinstance(self.document_separator, bool)
                                                 and self.document_separator >= 0),
             f"--document-separator={self.document_separator!r} must be a token id (an integer >= 0).")
        need(self.document_separator is None or self.document_masking,
             f"--document-separator={self.document_separator} needs --document-masking (alone it does nothing).")
        need(not self.reset_positions or self.document_masking,
             "--reset-positions needs --document-masking: positions restart at document starts.")
        need(self.batch_size % self.attn_bwd_chunks == 0,
             f"--attn-bwd-chunks={self.attn_bwd_chunks} must divide --batch-size={self.batch_size}.")
        need(not self.offload_master or self.master_dtype != self.model_dtype,
             f"--offload-master needs a separate master copy, but --master-dtype={self.master_dtype} equals "
             f"--model-dtype (the weights are the master); use --model-dtype bf16 --master-dtype fp32.")
        need(not self.offload_gradients or self.effective_zero_level >= 2,
             "--offload-gradients needs --zero-level 2 or 3: under ZeRO-1 the gradient buffer is the backward's "
             "scratch and stays on the device.")
        need(not self.use_zero_copy or self.offloads_optimizer or self.offload_gradients,
             "--use-zero-copy only applies with --offload-master, --offload-opt-m, --offload-opt-v or "
             "--offload-gradients (it lets the optimizer kernel read that host memory directly).")
        k = self.kept_quants_gib
        need(_gib_or_auto(k), f"--kept-quants-gib={k!r} must be a number >= 0 or 'auto'.")
        need(not k or (self.matmul_dtype == "e4m3" and self.quants_placement == "layer"),
             "--kept-quants-gib only applies to per-layer FP8 weight copies (--matmul-dtype e4m3 with "
             "--transient-quants, or ZeRO-3 without --persistent-quants).")
        g = self.opt_resident_gib
        need(_gib_or_auto(g), f"--opt-resident-gib={g!r} must be a number >= 0 or 'auto'.")
        need(not (k == "auto" and g == "auto"),
             "--kept-quants-gib auto and --opt-resident-gib auto both ask for the memory set-up leaves free (the "
             "first would take it all); give one of them a number of GiB.")
        need(not self.opt_resident_gib or self.offloads_optimizer,
             "--opt-resident-gib only applies with --offload-master, --offload-opt-m or --offload-opt-v (it keeps "
             "part of the offloaded state on the device).")
        need(not self.opt_resident_gib or not (self.offload_gradients or self.use_zero_copy),
             "--opt-resident-gib cannot be combined with --offload-gradients or --use-zero-copy (their chunks "
             "stream through the device anyway).")
        need(not self.persistent_quants or self.matmul_dtype == "e4m3",
             "--persistent-quants only applies with --matmul-dtype e4m3 (it keeps the FP8 weight copies).")
        need(not self.offload_quants or self.persistent_quants,
             "--offload-quants needs --persistent-quants (only persistent FP8 weight copies can live in host memory).")
        need(not self.transient_quants or self.matmul_dtype == "e4m3",
             "--transient-quants only applies with --matmul-dtype e4m3 (it places the FP8 weight copies).")
        need(not self.transient_quants or not (self.persistent_quants or self.offload_quants),
             "--transient-quants contradicts --persistent-quants and --offload-quants (copies made per layer are "
             "not kept); pick one.")
        need(not self.use_cuda_graphs or (self.effective_zero_level < 2 and not self.offload_residual
                                          and not self.offload_quants),
             f"--use-cuda-graphs cannot capture --zero-level {self.effective_zero_level if self.effective_zero_level > 1 else '2/3'}, "
             "--offload-residual or --offload-quants (their per-layer copies and collectives run on side streams); "
             "drop one of them.")
        need(not self.use_cuda_graphs or not self.transient_quants,
             "--use-cuda-graphs cannot capture --transient-quants (which layers need quantizing is decided on the "
             "host at every pass); drop one of them.")
        need(isinstance(self.overlap_wgrad_sms, int) and self.overlap_wgrad_sms >= 0,
             f"--overlap-wgrad-sms={self.overlap_wgrad_sms!r} must be 0 (off) or a number of SMs.")
        need(not self.overlap_wgrad_sms or self.matmul_dtype in (None, self.model_dtype),
             f"--overlap-wgrad-sms runs the model-dtype weight-gradient GEMMs beside the backward; it does not apply "
             f"with --matmul-dtype={self.matmul_dtype}.")
        need(not self.overlap_wgrad_sms or self.effective_zero_level < 2,
             f"--overlap-wgrad-sms cannot be combined with --zero-level {self.effective_zero_level} (which reduces "
             "each layer's gradients as soon as its backward ends, before a side-stream wgrad would be done).")
        t = self.tensor_parallel
        need(isinstance(t, int) and not isinstance(t, bool) and t >= 1,
             f"--tensor-parallel={t!r} must be an integer >= 1.")
        if t > 1:
            for bad, what in ((self.use_cuda_graphs, "--use-cuda-graphs"),
                              (self.offload_gradients, "--offload-gradients"),
                              (self.overlap_comm, "--overlap-comm"), (bool(self.overlap_wgrad_sms), "--overlap-wgrad-sms"),
                              (self.zero_scope == "node", "--zero-scope node")):
                need(not bad, f"--tensor-parallel={t} does not run with {what} yet; drop one of them.")
            need((self.batch_size * self.seq_len) % t == 0,
                 f"--tensor-parallel={t} must divide --batch-size x --seq-len = {self.batch_size * self.seq_len} "
                 "(sequence parallelism splits a micro-batch's tokens over the group).")
        need(not self.overlap_wgrad_sms or not self.offload_residual,
             "--overlap-wgrad-sms is not verified with --offload-residual (whose fetches run on their own side "
             "stream); drop one of them.")
        return self


def _option_fields() -> list:
    """(name, type, field) of every setting the training step reads: the tree's settings that are neither
    runtime nor command-only, with ``train_default`` where the API's default is "auto"."""
    out = []
    for s in all_settings():
        if s.meta["runtime"] or s.meta["command_only"]:
            continue
        default = s.default if s.meta["train_default"] is NO_TRAIN_DEFAULT else s.meta["train_default"]
        out.append((s.name, s.type, dataclasses.field(default=default)))
    return out


TrainOptions = dataclasses.make_dataclass("TrainOptions", _option_fields(), bases=(_TrainOptionsBase,))
TrainOptions.__module__ = __name__  # pickled by reference (Ray ships it to the workers)
TrainOptions.__doc__ = """The options a training step reads, as one flat dataclass: ``opts.batch_size``, ``opts.zero_level``.

Its fields are generated from the settings tree (llmq_ray/settings.py, where each one is defined with its help
text); defaults are the tree's, or its ``train_default`` where the API says "auto" (resolved per machine by
llmq_ray/train/run_defaults.py). ``validate()`` turns combinations that make no sense into one ConfigError
sentence naming the flags."""
