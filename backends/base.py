"""The Backend interface: every kernel the model, the optimizer and the trainer call.

A backend is a bag of kernels over *preallocated* torch tensors. Nothing here allocates the big buffers,
keeps state between calls (beyond compiled-kernel caches) or knows about Ray or distribution: the model owns
the buffers, the actors own the process groups. That is what lets the same model run on the PyTorch
reference (`torch_ref`, the ground truth, CPU and CUDA), on Triton (`triton`) and on raw CUDA (`cupy`).

Conventions used in every docstring below:

* ``N`` = B*T rows (tokens of a micro-batch), ``C`` = hidden size, ``V`` = vocabulary, ``I`` = MLP
  intermediate size, ``Hq``/``Hkv`` = query / key-value heads, ``D`` = head dim.
* "model dtype" is fp32 or bf16 (``--model-dtype``): weights as used, activations, gradients.
  Statistics that feed a division or an exponent (``rstd``, attention log-sum-exp, losses, absmax, norms)
  are always fp32.
* All tensors are contiguous unless said otherwise; kernels never change their inputs unless the docstring
  says "in place".
* "accumulate" means ``out += result`` (gradient accumulation over micro-steps / layers); otherwise
  ``out`` is overwritten.
* Scalars that change every step (lr, step) are Python numbers; scalars produced on the device (absmax,
  norms) stay device tensors so that no kernel forces a host sync.

FP8 scaling convention (per-tensor "current" scaling): for a tensor ``x`` with ``amax = max|x|`` the
quantized tensor is ``q = saturate(x * s)`` with ``s = fp8_max / amax``, and its *descale* is
``1 / s``: ``x ≈ q.float() * descale``. Descales are what ``matmul_fp8`` takes (as cuBLASLt and
``torch._scaled_mm`` do).

How a backend is put together (``get_backend(name, device, gemm=..., attention=...)``):

* its own kernels: every op of ``KERNEL_OPS`` that its class defines;
* components any backend can take: the GEMMs (``GEMM_OPS``) come from a GEMM provider (backends/gemm.py:
  ``torch`` or ``cublaslt``, ``--gemm``) and the attention (``ATTENTION_OPS``) from an attention provider
  (backends/attention.py: ``sdpa`` or ``deterministic``, ``--deterministic-attention``); a backend class may not
  define those ops itself;
* ``COMPOSED_OPS`` have a default here made of the backend's own ops, which a backend may replace with a fused
  kernel;
* everything else it does not implement must be listed in its ``FALLBACKS``: those ops are the torch reference's
  (backends/torch_ref.py), bound at construction. A class that neither implements nor lists an op is refused
  when it is defined (``__init_subclass__``), so nothing is inherited silently; ``describe()`` is the start-up
  line that names the fallbacks (``cupy: 19 native ops, 1 from torch: bias_backward; GEMM torch, attention sdpa``).
* ``TORCH_DEFAULT_OPS`` are the exception, on purpose and by name: ops a newer architecture brought (Qwen3's
  QK-norm; GPT-2's LayerNorm with bias, GELU-tanh and learned position embedding) whose default here *is* written
  in torch operations, so every backend inherits a correct op (CPU and CUDA, any dtype) until it gets a fused
  kernel of its own, which then simply overrides the method. They are outside ``KERNEL_OPS`` (neither counted
  on the start-up line nor listed in ``FALLBACKS``); the model calls them only for the architecture that
  needs them, so the Llama/Qwen2 path never runs one.

========================================  ==========================================================
op (default in torch ops, on this class)  used by
========================================  ==========================================================
qk_norm_forward / qk_norm_backward        Qwen3 (per-head RMSNorm of q and k before RoPE)
layernorm_forward / layernorm_backward    GPT-2 (ln_1, ln_2, ln_f: LayerNorm with weight and bias)
fused_residual_layernorm_forward          GPT-2 (a block's residual add and the next LayerNorm)
gelu_tanh_forward / gelu_tanh_backward    GPT-2 (the MLP's activation, HF's "gelu_new")
position_embedding_forward / _backward    GPT-2 (wpe: positions 0..T-1 of every window)
========================================  ==========================================================

A backend's own kernel for one of them is a method of the same name and contract on its class. The triton and
cupy backends have their own for all of them but the position embedding (backends/triton/qk_norm.py, layernorm.py,
gelu.py; backends/cupy/kernels/qk_norm.cu, layernorm.cu, gelu.cu); the torch reference runs the defaults.
"""

from __future__ import annotations

import torch


def check_adamw_shards(param, grad, m, v, master, step: int, dtypes=(torch.float32, torch.bfloat16)) -> int:
    """The argument checks every fused AdamW kernel makes before touching memory: flat 1-D shards of one
    length n (returned), states and weights in ``dtypes``, a 1-based step. Raises ValueError / TypeError."""
    n = param.numel()
    for name, t in (("grad", grad), ("m", m), ("v", v), ("master", master)):
        if t is not None and (t.dim() != 1 or t.numel() != n):
            raise ValueError(f"adamw_update: {name} has shape {tuple(t.shape)}, expected flat [{n}] like param")
    for name, t in (("param", param), ("m", m), ("v", v), ("master", master)):
        if t is not None and t.dtype not in dtypes and not (name == "m" and t.dtype == torch.float8_e4m3fn):
            raise TypeError(f"adamw_update: {name} must be fp32 or bf16, got {t.dtype}")
    if param.dim() != 1:
        raise ValueError(f"adamw_update: param must be a flat 1-D shard, got shape {tuple(param.shape)}")
    if step < 1:
        raise ValueError(f"adamw_update: step is 1-based, got {step}")
    return n


def check_stochastic_round_args(out, inp) -> int:
    """The checks of every stochastic_round kernel: fp32 inp -> bf16 out of one shape. Returns the element count."""
    if out.dtype != torch.bfloat16 or inp.dtype != torch.float32:
        raise TypeError(f"stochastic_round: needs fp32 -> bf16, got {inp.dtype} -> {out.dtype}")
    if out.shape != inp.shape:
        raise ValueError(f"stochastic_round: shapes differ: out {tuple(out.shape)} vs inp {tuple(inp.shape)}")
    return inp.numel()


def dlogits_fp8_scale(dtype: torch.dtype, dloss: float) -> float:
    """The FP8 scale of the LM head's output gradient d = dloss * (softmax - onehot): |d| <= |dloss| always
    (a probability minus at most 1), so s = fp8_max / |dloss| maps the largest possible value to the format's
    largest, computed in fp32 (the value every backend multiplies by). Raises ValueError for dloss == 0."""
    if dloss == 0:
        raise ValueError("dlogits_fp8_scale: dloss must be nonzero")
    fp8_max = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32)
    return float(fp8_max / torch.tensor(abs(dloss), dtype=torch.float32))


GEMM_OPS = ("matmul", "matmul_beside", "prepare_beside", "matmul_fp8")
ATTENTION_OPS = ("attention_forward", "attention_backward", "attention_rope_backward")
COMPOSED_OPS = ("rope_backward_from", "swiglu_backward_fp8", "quantize_with_transpose")
KERNEL_OPS = ("embedding_forward", "embedding_backward", "rmsnorm_forward", "fused_residual_rmsnorm_forward",
              "rmsnorm_backward", "rope_forward", "rope_backward", "rope_backward_from", "swiglu_forward",
              "swiglu_backward", "swiglu_backward_fp8", "bias_backward", "absmax", "quantize", "quantize_transpose",
              "quantize_with_transpose", "fused_classifier", "fused_classifier_fp8", "adamw_update", "global_norm_squared",
              "stochastic_round")
OPS = KERNEL_OPS + GEMM_OPS + ATTENTION_OPS  # every op of the protocol
# ops whose default below is written in torch operations, inherited by every backend until it has a fused kernel
# (module docstring): not kernel ops, so not counted on the start-up line and never in FALLBACKS
TORCH_DEFAULT_OPS = ("qk_norm_forward", "qk_norm_backward", "layernorm_forward", "fused_residual_layernorm_forward",
                     "layernorm_backward", "gelu_tanh_forward", "gelu_tanh_backward", "position_embedding_forward",
                     "position_embedding_backward")

_GELU_K = 0.7978845608028654  # sqrt(2 / pi), the tanh approximation's constant (HF's "gelu_new")
_GELU_C = 0.044715


class Backend:
    """The kernel protocol (every method below, with its shapes and dtypes) and how a backend is assembled
    (module docstring). ``name`` is the registry key."""

    name = "abstract"
    # True when a micro-step's ops never sync with the host, so --use-cuda-graphs can capture them
    # (the torch reference's embedding backward calls torch.unique, which does).
    graph_capturable = False
    DEFAULT_GEMM = "torch"        # the GEMM provider when none is asked for
    FALLBACKS: tuple[str, ...] = ()  # kernel ops this backend takes from the torch reference (explicit)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for op in GEMM_OPS + ATTENTION_OPS:
            if getattr(cls, op) is not getattr(Backend, op):
                raise TypeError(f"{cls.__name__}.{op}: GEMMs and attention are components (backends/gemm.py, "
                                f"backends/attention.py), not backend methods")
        for op in cls.FALLBACKS:
            if op not in KERNEL_OPS:
                raise TypeError(f"{cls.__name__}.FALLBACKS: {op!r} is not a kernel op")
            if getattr(cls, op) is not getattr(Backend, op):
                raise TypeError(f"{cls.__name__}.{op} is both implemented and listed in FALLBACKS")
        missing = [op for op in KERNEL_OPS if op not in COMPOSED_OPS and op not in cls.FALLBACKS
                   and getattr(cls, op) is getattr(Backend, op)]
        if missing:
            raise TypeError(f"{cls.__name__} neither implements nor lists in FALLBACKS: {', '.join(missing)}")

    def __init__(self, device: torch.device | str = "cpu", *, gemm: str | None = None, attention: str = "sdpa",
                 gemm_tuning: bool = True):
        from llmq_ray.backends.attention import ATTENTION_PROVIDERS
        from llmq_ray.backends.gemm import GEMM_PROVIDERS
        from llmq_ray.errors import ConfigError

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" -> "cuda:<current>", so devices compare equal
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        gemm = gemm or self.DEFAULT_GEMM
        if gemm not in GEMM_PROVIDERS:
            raise ConfigError(f"--gemm={gemm!r} is not a GEMM provider; choose one of {sorted(GEMM_PROVIDERS)}.")
        if attention not in ATTENTION_PROVIDERS:
            raise ConfigError(f"attention={attention!r} is not an attention provider; choose one of "
                              f"{sorted(ATTENTION_PROVIDERS)}.")
        self.gemm = GEMM_PROVIDERS[gemm](device, gemm_tuning)
        self.attention = ATTENTION_PROVIDERS[attention](device)
        if self.FALLBACKS:  # bound once: each listed op is the reference's own method
            from llmq_ray.backends.torch_ref import TorchBackend

            reference = TorchBackend(device, gemm="torch", attention="sdpa")
            for op in self.FALLBACKS:
                setattr(self, op, getattr(reference, op))

    @classmethod
    def native_ops(cls) -> list[str]:
        """The kernel ops this backend runs with its own kernels (its composed defaults included)."""
        return [op for op in KERNEL_OPS if op not in cls.FALLBACKS]

    def describe(self) -> str:
        """The start-up line: ``<name>: N native ops, M from torch: <ops>; GEMM <provider>, attention <provider>``."""
        fallbacks = f", {len(self.FALLBACKS)} from torch: {', '.join(self.FALLBACKS)}" if self.FALLBACKS else \
            ", none from torch"
        return (f"{self.name}: {len(self.native_ops())} native ops{fallbacks}; GEMM {self.gemm.name}, "
                f"attention {self.attention.name}")

    # ------------------------------------------------------------------ embedding
    def embedding_forward(self, out: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor) -> None:
        """out[N, C] = table[tokens[N]].  tokens int32/int64 in [0, V); table [V, C] model dtype."""
        raise NotImplementedError

    def embedding_backward(self, dtable: torch.Tensor, tokens: torch.Tensor, dout: torch.Tensor) -> None:
        """dtable[V, C] += scatter-add of dout[N, C] into the rows tokens[N] (accumulate).

        Must be deterministic (the same bits on every run): rows hit by several tokens are summed in a
        fixed order, so recompute and resume tests can compare gradients bit for bit.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ RMSNorm
    def rmsnorm_forward(self, out: torch.Tensor, rstd: torch.Tensor, inp: torch.Tensor,
                        weight: torch.Tensor, eps: float, absmax: torch.Tensor | None = None) -> None:
        """out[N, C] = inp * rstd * weight with rstd[N] (fp32) = 1 / sqrt(mean(inp^2) + eps).

        The mean is taken in fp32. If ``absmax`` (fp32 scalar tensor) is given, it is overwritten with
        max|out| so that out can be quantized to FP8 without another pass over memory.
        """
        raise NotImplementedError

    def fused_residual_rmsnorm_forward(self, residual: torch.Tensor, out: torch.Tensor, rstd: torch.Tensor,
                                       inp1: torch.Tensor, inp2: torch.Tensor, weight: torch.Tensor,
                                       eps: float, absmax: torch.Tensor | None = None) -> None:
        """residual[N, C] = inp1 + inp2 (rounded to model dtype), then rmsnorm_forward(out, rstd, residual).

        This is the residual add of a transformer block fused with the next norm: one read of each input,
        one write of each output.
        """
        raise NotImplementedError

    def rmsnorm_backward(self, dinp: torch.Tensor, dweight: torch.Tensor, dout: torch.Tensor,
                         inp: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                         dresidual: torch.Tensor | None = None, absmax: torch.Tensor | None = None) -> None:
        """Backward of rmsnorm_forward.

        dinp[N, C] = d(out)/d(inp)^T dout  (+ dresidual when given: the residual stream's gradient,
        fused here so the block backward needs no separate add; dinp may alias dresidual);
        dweight[C] += sum_n dout * inp * rstd (accumulate). Internals in fp32. ``absmax`` (optional, fp32
        0-d) overwritten with max|dinp| of the stored values: dinp is the FP8 dy of the projection below.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ QK-norm (Qwen3)
    def qk_norm_forward(self, qkv: torch.Tensor, saved: torch.Tensor, rstd: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, n_q_heads: int, n_kv_heads: int, eps: float) -> None:
        """In place on the query and key heads of qkv[B, T, Hq + 2*Hkv, D] (the QKV GEMM's output, before RoPE):
        each head vector x [D] becomes (x * rstd) * w with rstd = 1/sqrt(mean(x^2) + eps), w = q_weight [D] on
        query heads and k_weight [D] on key heads; value heads are untouched. Keeps x in ``saved`` [N, Hq+Hkv, D]
        (model dtype) and rstd in ``rstd`` [N, Hq+Hkv] (fp32) for the backward. Internals in fp32, one rounding.

        This default is torch operations (TORCH_DEFAULT_OPS: the backends without a kernel of their own inherit
        it; triton and cupy have one, backends/triton/qk_norm.py and backends/cupy/kernels/qk_norm.cu): per head
        vector it reads x once and writes it twice, a few percent of a layer's QKV traffic."""
        x = qkv.view(saved.shape[0], -1, qkv.shape[-1])[:, :n_q_heads + n_kv_heads]
        saved.copy_(x)
        xf = x.float()
        r = torch.rsqrt(xf.square().mean(-1) + eps)
        rstd.copy_(r)
        x.copy_(xf * r[..., None] * self._qk_weights(q_weight, k_weight, n_q_heads, n_kv_heads))

    def qk_norm_backward(self, dqkv: torch.Tensor, dq_weight: torch.Tensor, dk_weight: torch.Tensor,
                         saved: torch.Tensor, rstd: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         n_q_heads: int, n_kv_heads: int) -> None:
        """Backward of qk_norm_forward, in place on the query and key heads of dqkv[B, T, Hq + 2*Hkv, D]: the
        gradient with respect to the normalised heads becomes the one with respect to their inputs (``saved``,
        ``rstd`` from the forward); dq_weight / dk_weight [D] += the weights' gradients, summed over tokens and
        heads (accumulate, like the other norms' weight gradients). Internals in fp32. Default in torch operations
        (TORCH_DEFAULT_OPS), like the forward's."""
        h = n_q_heads + n_kv_heads
        dy = dqkv.view(saved.shape[0], -1, dqkv.shape[-1])[:, :h]
        g = dy.float()
        xhat = saved.float() * rstd[..., None]
        dw = (g * xhat).sum(0)  # [H, D]
        dq_weight += dw[:n_q_heads].sum(0).to(dq_weight.dtype)
        dk_weight += dw[n_q_heads:].sum(0).to(dk_weight.dtype)
        gw = g * self._qk_weights(q_weight, k_weight, n_q_heads, n_kv_heads)
        dy.copy_(rstd[..., None] * (gw - xhat * (gw * xhat).mean(-1, keepdim=True)))

    @staticmethod
    def _qk_weights(q_weight: torch.Tensor, k_weight: torch.Tensor, n_q_heads: int, n_kv_heads: int) -> torch.Tensor:
        """[Hq + Hkv, D] fp32: q_weight on the query heads' rows, k_weight on the key heads'."""
        d = q_weight.shape[0]
        return torch.cat([q_weight.float().expand(n_q_heads, d), k_weight.float().expand(n_kv_heads, d)])

    # ------------------------------------------------------------------ LayerNorm, GELU-tanh, positions (GPT-2)
    def layernorm_forward(self, out: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, inp: torch.Tensor,
                          weight: torch.Tensor, bias: torch.Tensor, eps: float,
                          absmax: torch.Tensor | None = None) -> None:
        """out[N, C] = (inp - mean) * rstd * weight + bias, with mean[N] and rstd[N] (fp32, kept for the backward)
        = the row mean and 1 / sqrt(var + eps) (biased variance), taken in fp32; weight, bias [C] model dtype.
        ``absmax`` (optional, fp32 0-d) overwritten with max|out| of the stored values (the FP8 scale of the GEMM
        that reads out). Default in torch operations (TORCH_DEFAULT_OPS); triton: backends/triton/layernorm.py,
        cupy: backends/cupy/kernels/layernorm.cu."""
        x = inp.float()
        mu = x.mean(-1)
        xc = x - mu[:, None]
        r = torch.rsqrt(xc.square().mean(-1) + eps)
        mean.copy_(mu)
        rstd.copy_(r)
        out.copy_(xc * r[:, None] * weight.float() + bias.float())
        if absmax is not None:
            absmax.copy_(out.abs().amax().float())

    def fused_residual_layernorm_forward(self, residual: torch.Tensor, out: torch.Tensor, mean: torch.Tensor,
                                         rstd: torch.Tensor, inp1: torch.Tensor, inp2: torch.Tensor,
                                         weight: torch.Tensor, bias: torch.Tensor, eps: float,
                                         absmax: torch.Tensor | None = None) -> None:
        """residual[N, C] = inp1 + inp2 (rounded to the model dtype), then layernorm_forward(out, mean, rstd,
        residual, ...): a block's residual add and the next LayerNorm, one op so that a backend can fuse them.
        Default in torch operations (TORCH_DEFAULT_OPS): the add, then layernorm_forward."""
        torch.add(inp1, inp2, out=residual)
        self.layernorm_forward(out, mean, rstd, residual, weight, bias, eps, absmax)

    def layernorm_backward(self, dinp: torch.Tensor, dweight: torch.Tensor, dbias: torch.Tensor,
                           dout: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                           rstd: torch.Tensor, dresidual: torch.Tensor | None = None,
                           absmax: torch.Tensor | None = None) -> None:
        """Backward of layernorm_forward: dinp[N, C] = d(out)/d(inp)^T dout (+ dresidual when given; dinp may
        alias dresidual); dweight[C] += sum_n dout * xhat and dbias[C] += sum_n dout (accumulate), xhat = (inp -
        mean) * rstd from the forward's mean[N], rstd[N] (fp32). Internals in fp32. ``absmax`` (optional, fp32 0-d)
        overwritten with max|dinp| of the stored values: the FP8 dy of the projection below. Default in torch
        operations (TORCH_DEFAULT_OPS)."""
        xhat = (inp.float() - mean[:, None]) * rstd[:, None]
        g = dout.float()
        dweight.add_((g * xhat).sum(0))
        dbias.add_(g.sum(0))
        gw = g * weight.float()
        dx = rstd[:, None] * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
        if dresidual is not None:
            dx = dx + dresidual.float()
        dinp.copy_(dx)
        if absmax is not None:
            absmax.copy_(dinp.abs().amax().float())

    def gelu_tanh_forward(self, out: torch.Tensor, inp: torch.Tensor, absmax: torch.Tensor | None = None) -> None:
        """out[N, I] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) for x = inp[N, I] (GPT-2's "gelu_new"),
        in fp32, written in the model dtype; ``absmax`` (optional, fp32 0-d) overwritten with max|out|. Default in
        torch operations (TORCH_DEFAULT_OPS)."""
        x = inp.float()
        out.copy_(0.5 * x * (1.0 + torch.tanh(_GELU_K * (x + _GELU_C * x * x * x))))
        if absmax is not None:
            absmax.copy_(out.abs().amax().float())

    def gelu_tanh_backward(self, dinp: torch.Tensor, dout: torch.Tensor, inp: torch.Tensor,
                           absmax: torch.Tensor | None = None) -> None:
        """dinp[N, I] = dout[N, I] * gelu_tanh'(inp) for the forward input inp[N, I] (overwritten; fp32 inside,
        model dtype out); ``absmax`` (optional, fp32 0-d) overwritten with max|dinp|: the FP8 scale of the MLP's
        first GEMM's backward. Default in torch operations (TORCH_DEFAULT_OPS)."""
        x = inp.float()
        t = torch.tanh(_GELU_K * (x + _GELU_C * x * x * x))
        grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_K * (1.0 + 3.0 * _GELU_C * x * x)
        dinp.copy_(dout.float() * grad)
        if absmax is not None:
            absmax.copy_(dinp.abs().amax().float())

    def position_embedding_forward(self, out: torch.Tensor, table: torch.Tensor, seq_len: int,
                                   positions: torch.Tensor | None = None) -> None:
        """In place: out[N, C] (the token embedding, N = B * seq_len rows, row n at position n % seq_len) +=
        table[n % seq_len] with table[P, C] (model dtype, P >= seq_len): positions 0..T-1 in every window; or,
        with ``positions`` int [B, T] (--reset-positions: each document from 0), table[positions].
        Summed in fp32, one rounding. Default in torch operations (TORCH_DEFAULT_OPS)."""
        x = out.view(-1, seq_len, out.shape[-1])
        rows = table[:seq_len] if positions is None else table[positions]
        x.copy_(x.float() + rows.float())

    def position_embedding_backward(self, dtable: torch.Tensor, dout: torch.Tensor, seq_len: int,
                                    positions: torch.Tensor | None = None) -> None:
        """dtable[P, C] rows 0..seq_len-1 += dout[N, C] summed over the B windows (accumulate, fp32 sum, a fixed
        order: deterministic); with ``positions`` [B, T], each row into its own position's row (an fp32
        index_add: deterministic on the CPU, atomics on CUDA). Default in torch operations (TORCH_DEFAULT_OPS)."""
        if positions is None:
            d = dtable[:seq_len]
            d.copy_(d.float() + dout.view(-1, seq_len, dout.shape[-1]).float().sum(0))
            return
        acc = dtable.float().index_add_(0, positions.reshape(-1).long(), dout.float())
        dtable.copy_(acc)

    # ------------------------------------------------------------------ RoPE
    def rope_forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     n_q_heads: int, n_kv_heads: int) -> None:
        """Rotary embedding, in place, on the q and k heads of qkv[B, T, Hq + 2*Hkv, D] (v untouched).

        Half-split convention (as HF Llama/Qwen2): for pair (x1 = x[..., :D/2], x2 = x[..., D/2:])
        out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, with cos/sin[T, D/2] fp32 for positions 0..T-1.
        """
        raise NotImplementedError

    def rope_backward(self, dqkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      n_q_heads: int, n_kv_heads: int) -> None:
        """Backward of rope_forward, in place on dqkv[B, T, Hq + 2*Hkv, D]: the inverse rotation."""
        raise NotImplementedError

    def rope_backward_from(self, dqkv: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, n_q_heads: int, n_kv_heads: int) -> None:
        """dqkv[B, T, Hq + 2*Hkv, D] = [rope^-1(dq) | rope^-1(dk) | dv]: the gradient of the pre-RoPE qkv from
        the attention's gradients of the post-RoPE q, k and v, given as separate tensors dq[B, T, Hq, D],
        dk/dv[B, T, Hkv, D] (any strides with a contiguous last dim, as an attention kernel returns them).

        Default: copy them into dqkv, then rope_backward in place. A backend may do both in one pass (the
        copy is what it saves: one read and one write of the q/k part)."""
        dqkv[:, :, :n_q_heads] = dq
        dqkv[:, :, n_q_heads:n_q_heads + n_kv_heads] = dk
        dqkv[:, :, n_q_heads + n_kv_heads:] = dv
        self.rope_backward(dqkv, cos, sin, n_q_heads, n_kv_heads)

    # ------------------------------------------------------------------ SwiGLU
    def swiglu_forward(self, out: torch.Tensor, inp: torch.Tensor, absmax: torch.Tensor | None = None) -> None:
        """out[N, I] = up * silu(gate) where inp[N, 2I] = [up | gate] (the fused up+gate GEMM's output).

        Computed in fp32, written in model dtype; ``absmax`` (optional) overwritten with max|out|.
        """
        raise NotImplementedError

    def swiglu_forward_fp8(self, q: torch.Tensor, q_t: torch.Tensor, descale: torch.Tensor, inp: torch.Tensor,
                           absmax: torch.Tensor, out: torch.Tensor, scale_absmax: torch.Tensor) -> None:
        """Delayed scaling: the down projection's FP8 input from the SwiGLU forward. q[N, I] and q_t[I, N] (one
        FP8 dtype) = quantize_with_transpose(out) at the scale of ``scale_absmax`` (fp32 0-d, an earlier
        max|out|: whatever lies beyond it saturates), where out is what swiglu_forward writes (the model dtype);
        ``absmax`` (fp32 0-d) receives this out's max|out|. A backend may skip writing ``out`` (the triton one
        does it all in one pass); this default writes it ([N, I], scratch) and quantizes it: same bytes."""
        self.swiglu_forward(out, inp, absmax=absmax)
        self.quantize_with_transpose(q, q_t, descale, out, scale_absmax)

    def swiglu_backward(self, dinp: torch.Tensor, dout: torch.Tensor, inp: torch.Tensor,
                        absmax: torch.Tensor | None = None) -> None:
        """dinp[N, 2I] = [d up | d gate] for dout[N, I] and the forward input inp[N, 2I].

        ``absmax`` (optional, fp32 0-d) overwritten with max|dinp| of the stored values: the scale of the
        up+gate GEMM's FP8 backward, taken here so that no extra pass reads dinp.
        """
        raise NotImplementedError

    def swiglu_backward_fp8(self, q: torch.Tensor, q_t: torch.Tensor, descale: torch.Tensor, dout: torch.Tensor,
                            inp: torch.Tensor, absmax: torch.Tensor, dinp: torch.Tensor,
                            scale_absmax: torch.Tensor | None = None) -> None:
        """The up+gate GEMM's FP8 gradient from the SwiGLU backward: q[N, 2I] and q_t[2I, N] (one FP8 dtype)
        = quantize_with_transpose(dinp) at absmax = max|dinp|, where dinp is what swiglu_backward writes (the
        model dtype); ``absmax`` (fp32 0-d) receives max|dinp|. With ``scale_absmax`` (fp32 0-d; delayed
        scaling, e.g. the same layer's absmax from the previous backward) the quantization uses that value
        instead, and whatever lies beyond it saturates at the FP8 maximum. A backend may skip writing dinp (the
        triton one measures the absmax in a first pass and quantizes in a second, or with a delayed scale
        quantizes and measures in one); this default writes ``dinp`` [N, 2I] (scratch) and quantizes it: same
        bytes."""
        self.swiglu_backward(dinp, dout, inp, absmax=absmax)
        self.quantize_with_transpose(q, q_t, descale, dinp, absmax if scale_absmax is None else scale_absmax)

    def swiglu_backward_fp8_writes_dinp(self, dtype: torch.dtype) -> bool:
        """Whether ``swiglu_backward_fp8`` writes its ``dinp`` [N, 2I] for a model in ``dtype`` (as this
        default does). A backend that never touches it returns False, and the model then passes a shape
        without storage (2 bytes per element of the up+gate output less: 0.43 GiB at 7B, B=6)."""
        return True

    # ------------------------------------------------------------------ attention
    def attention_document_mask(self, segments: torch.Tensor, dtype: torch.dtype):
        """The DocumentMask (backends/attention.py) the attention ops below take as ``documents``, over
        ``segments`` [B, T] int32 (the document index of each token, filled by the model, which then calls the
        mask's ``refresh()`` once per forward), for attention in ``dtype``. (The attention provider's.)"""
        return self.attention.document_mask(segments, dtype)

    def attention_forward(self, out: torch.Tensor, lse: torch.Tensor, qkv: torch.Tensor,
                          n_q_heads: int, n_kv_heads: int, documents=None) -> None:
        """Causal grouped-query attention.

        qkv[B, T, Hq + 2*Hkv, D] (post-RoPE), out[B, T, Hq, D] model dtype, lse[B, Hq, T] fp32 the
        log-sum-exp of each softmax row (natural log, of the scaled scores), kept for the backward.
        Query head h reads key/value head h // (Hq / Hkv); scores are scaled by 1/sqrt(D).
        ``documents`` (document masking; a DocumentMask from ``attention_document_mask``): a query attends only
        to keys of its own document. (The attention provider's.)
        """
        self.attention.forward(out, lse, qkv, n_q_heads, n_kv_heads, documents)

    def attention_backward(self, dqkv: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           qkv: torch.Tensor, n_q_heads: int, n_kv_heads: int, documents=None) -> None:
        """dqkv[B, T, Hq + 2*Hkv, D] (overwritten) from dout[B, T, Hq, D] and the forward's out, lse, qkv
        (and ``documents``, as given to the forward, or its ``rows()`` for a slice of the batch).

        dk/dv of a shared kv head sum over the query heads of its group. (The attention provider's.)
        """
        self.attention.backward(dqkv, dout, out, lse, qkv, n_q_heads, n_kv_heads, documents)

    def attention_rope_backward(self, dqkv: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q_heads: int,
                                n_kv_heads: int, documents=None) -> None:
        """dqkv[B, T, Hq + 2*Hkv, D] (overwritten) = the gradient of the *pre-RoPE* qkv: attention_backward,
        then rope_backward (arguments as there). An attention provider whose kernel hands back dq/dk/dv as
        separate tensors feeds them to this backend's rope_backward_from (no copy into dqkv first)."""
        self.attention.rope_backward(self, dqkv, dout, out, lse, qkv, cos, sin, n_q_heads, n_kv_heads, documents)

    # ------------------------------------------------------------------ GEMMs
    def matmul(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, transpose_a: bool = False,
               transpose_b: bool = False, bias: torch.Tensor | None = None, accumulate: bool = False) -> None:
        """out[M, N] (+)= op(a) @ op(b) (+ bias[N]), op = transpose when asked.

        All operands in model dtype, fp32 accumulation inside the GEMM. The three uses in a linear layer
        y = x W^T:  forward ``matmul(y, x, W, transpose_b=True)``; dgrad ``matmul(dx, dy, W)``; wgrad
        ``matmul(dW, dy, x, transpose_a=True, accumulate=True)``. (The GEMM provider's.)
        """
        self.gemm.matmul(out, a, b, transpose_a=transpose_a, transpose_b=transpose_b, bias=bias, accumulate=accumulate)

    def matmul_beside(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, transpose_a: bool = False,
                      transpose_b: bool = False, accumulate: bool = False, sm_count: int = 0) -> None:
        """``matmul`` for a GEMM that runs on a side stream beside the compute stream (llmq_ray/engine/wgrad_overlap.py):
        a backend that can size the GEMM for ``sm_count`` SMs (leaving the rest to the compute stream's kernels)
        does so, with scratch of its own; otherwise it is plain ``matmul``. Shapes and dtypes as ``matmul``'s
        (out[M, N], model dtype). (The GEMM provider's.)"""
        self.gemm.matmul_beside(out, a, b, transpose_a=transpose_a, transpose_b=transpose_b, accumulate=accumulate,
                                sm_count=sm_count)

    def prepare_beside(self, stream) -> None:
        """Make whatever ``matmul_beside`` will need on ``stream`` (scratch; no tensor arguments, so no shapes or
        dtypes), before any CUDA graph captures it. (The GEMM provider's.)"""
        self.gemm.prepare_beside(stream)

    def bias_backward(self, dbias: torch.Tensor, dout: torch.Tensor, absmax: torch.Tensor | None = None) -> None:
        """dbias[N] += dout[M, N].sum(0) (accumulate; fp32 sum). absmax (fp32 0-d) = max|dout| when given: the
        FP8 scale of dout, taken in the same read (the QKV GEMM's backward needs it for dqkv)."""
        raise NotImplementedError

    def matmul_fp8(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_descale: torch.Tensor,
                   b_descale: torch.Tensor, *, bias: torch.Tensor | None = None, accumulate: bool = False) -> None:
        """out[M, N] (+)= (a * a_descale) @ (b * b_descale)^T with a[M, K], b[N, K] in FP8 (row-major, K
        contiguous in both: the "TN" layout FP8 tensor cores need), descales fp32 scalar tensors,
        out in model dtype (+ bias[N]). (The GEMM provider's.)
        """
        self.gemm.matmul_fp8(out, a, b, a_descale, b_descale, bias=bias, accumulate=accumulate)

    # ------------------------------------------------------------------ FP8 quantization
    def absmax(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out (fp32 scalar tensor) = max |inp| (overwritten)."""
        raise NotImplementedError

    def quantize(self, out: torch.Tensor, descale: torch.Tensor, inp: torch.Tensor, absmax: torch.Tensor) -> None:
        """out (FP8, same shape as inp) = saturate(inp * s), s = fp8_max(out.dtype) / absmax; descale = 1/s.

        absmax is an fp32 scalar tensor (usually fused out of the producing kernel). An absmax of 0 gives
        s = 1 (all-zero tensors stay zero).
        """
        raise NotImplementedError

    def quantize_transpose(self, out_t: torch.Tensor, descale: torch.Tensor, inp: torch.Tensor,
                           absmax: torch.Tensor) -> None:
        """As quantize, but out_t[K, M] is the transpose of inp[M, K] (for wgrad / dgrad operands)."""
        raise NotImplementedError

    def quantize_with_transpose(self, out: torch.Tensor, out_t: torch.Tensor, descale: torch.Tensor,
                                inp: torch.Tensor, absmax: torch.Tensor) -> None:
        """Both layouts of one quantization: out[M, K] = quantize(inp), out_t[K, M] = its transpose, same
        scale (descale written once). A gradient dy is needed row-major for dgrad and transposed for wgrad;
        a fused kernel reads it once instead of twice. This default composes the two kernels."""
        self.quantize(out, descale, inp, absmax)
        self.quantize_transpose(out_t, descale, inp, absmax)

    # ------------------------------------------------------------------ loss
    def fused_classifier(self, logits: torch.Tensor, losses: torch.Tensor, targets: torch.Tensor,
                         dloss: float = 1.0, write_dlogits: bool = True) -> None:
        """Cross-entropy over logits[n, V] (model dtype) for targets[n] (int; -100 = masked).

        losses[n] (fp32, overwritten) = logsumexp(logits) - logits[target], 0 for masked rows.
        If write_dlogits, logits is overwritten **in place** with dloss * (softmax(logits) - onehot(target))
        (all zero for masked rows): the LM head's backward starts from there without another [n, V] buffer.
        Softmax in fp32.
        """
        raise NotImplementedError

    def fused_classifier_fp8(self, logits: torch.Tensor, losses: torch.Tensor, targets: torch.Tensor,
                             q: torch.Tensor, q_t: torch.Tensor, descale: torch.Tensor, dloss: float = 1.0) -> None:
        """The classifier of ``fused_classifier`` for an FP8 LM head: losses[n] as there, and the gradient
        d = dloss * (softmax(logits) - onehot(target)) (fp32, zero on masked rows) written straight to FP8 in
        both layouts its GEMMs need -- q[n, V] = saturate(d * s) for the dgrad and q_t[V, n] = q^T for the
        wgrad -- instead of back into logits (which are left unchanged). q and q_t share one FP8 dtype.

        The scale is static, ``s = dlogits_fp8_scale(q.dtype, dloss)``: every |d| <= |dloss|, so no absmax
        pass is needed and no value saturates; descale (fp32 0-d) = 1/s.
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ optimizer
    def adamw_update(self, param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                     master: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, step: int, grad_scale: torch.Tensor | float, seed: int,
                     m_scale: torch.Tensor | None = None) -> None:
        """One AdamW step over flat 1-D shards of equal length (in place on param, m, v, master).

        g = grad * grad_scale (fp32; grad_scale folds in 1/tokens and the clip factor);
        m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
        p = p (1 - lr wd) - lr * (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps)   [torch.optim.AdamW]
        where p is ``master`` when given (fp32 or bf16) and ``param`` otherwise. With a master, param is
        overwritten with master rounded to nearest in the model dtype. Every bf16 tensor that is the
        storage of record (m, v, master, or param without master) is written with **stochastic rounding**
        seeded by ``seed`` (reproducible), so that small updates are not lost on average.
        m may be e4m3 (torch.float8_e4m3fn) with ``m_scale`` [ceil(n/256)] fp32, its power-of-two block scales,
        both rewritten in place (backends/fp8_moment.py: the format and its stochastic rounding).
        """
        raise NotImplementedError

    def global_norm_squared(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """out (fp32 scalar tensor) += sum(tensor^2), summed in fp32 (accumulate; no host sync)."""
        raise NotImplementedError

    def stochastic_round(self, out: torch.Tensor, inp: torch.Tensor, seed: int) -> None:
        """out (bf16) = inp (fp32) rounded up or down to a neighbouring bf16 with probability proportional
        to the distance, so that E[out] = inp. Deterministic for a given seed."""
        raise NotImplementedError

    # ------------------------------------------------------------------ misc
    def synchronize(self) -> None:
        """Wait for all queued kernels (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
