"""CupyBackend: hand-written CUDA C++ kernels (``kernels/*.cu``, compiled by NVRTC through CuPy) for every
non-GEMM, non-attention op of backends/base.py, and for the ``TORCH_DEFAULT_OPS`` of Qwen3 and GPT-2 but the
position embedding: the QK-norm (``qk_norm.cu``), LayerNorm with the fused residual add (``layernorm.cu``) and
GELU-tanh (``gelu.cu``) override the base class's torch defaults; ``position_embedding_forward`` / ``_backward``
stay on those defaults.

GEMMs and attention are components (backends/base.py): by default the ``torch`` GEMM provider and the ``sdpa``
attention provider (cuBLAS and cuDNN through torch); ``--gemm cublaslt`` gives it the Triton backend's GEMMs.
``bias_backward`` and ``fused_classifier_fp8`` (the FP8 LM head's classifier, --lmhead-dtype e4m3) have no kernel
here: they are the torch reference's, listed in ``FALLBACKS`` (and so on the start-up line). Each
method here checks shapes and picks a launch geometry on the host, then launches one kernel (two or three
where a deterministic cross-block reduction is needed) on torch's current stream, on the tensors' own memory,
with no host sync. Each kernel has a 16-byte-vector variant and a scalar one (VEC = 1) for rows or pointers
that are not 16-byte multiples; model dtypes are fp32 and bf16: a tensor of another dtype (never one of a
training run) goes to the torch reference's kernel for that call, as does (for the QK-norm, LayerNorm and GELU
kernels) a non-contiguous tensor or a row too long to be held in registers.
"""

from __future__ import annotations

import torch

from llmq_ray.backends.cupy import _runtime as rt
from llmq_ray.backends.cupy._runtime import T_NAME, VEC, aligned, cdiv, f32, i32, i64, ptr, u64
from llmq_ray.backends.base import Backend, check_adamw_shards, check_stochastic_round_args
from llmq_ray.backends.torch_ref import TorchBackend
from llmq_ray.backends.torch_ref_optim import check_m_scale, derive_seed

MODEL_DTYPES = (torch.float32, torch.bfloat16)
BWD_MAX_BLOCKS = 1024   # partial weight-gradient rows of the norms' backward: fixed, so the sum order depends on N only
REDUCE_BLOCKS = 1024    # partials of global_norm_squared: likewise a function of the size only
SMEM_FLOATS = 12288     # 48 KiB of dynamic shared memory for the norms' backward: per-block partial rows
EMB_CHUNK = 32          # sorted positions per block of embedding_backward (CHUNK in embedding.cu)
M8_TILE = 1024          # elements per block iteration of adamw with an e4m3 m (M8_TILE in adamw.cu)


def _contiguous(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"cupy backend: expected a contiguous tensor, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")


def _round32(n: int) -> int:
    return max(32, cdiv(n, 32) * 32)


def _vec(dtype: torch.dtype, n: int, *tensors: torch.Tensor | None) -> int:
    """VEC (16 bytes of ``dtype``) when rows of ``n`` elements and every pointer allow it, else 1."""
    v = VEC[dtype]
    return v if n % v == 0 and aligned(*tensors) else 1


def _row_layout(nvec: int, vec: int, prefer_small_k: bool) -> tuple[int, int]:
    """(K, TX): K vectors per thread, TX threads per row (multiple of 32, <= 1024), fewest idle lanes.
    Ties go to the larger K in the forward (a warp per row, no shared-memory step) and to the smaller K in the
    backward (fewer registers: it keeps x, dy, w and the dweight partial of its columns)."""
    best = None
    for k in rt.row_ks(vec):
        tx = _round32(cdiv(nvec, k))
        if tx > 1024:
            continue
        key = (tx * k - nvec, k if prefer_small_k else -k)
        if best is None or key < best[0]:
            best = (key, k, tx)
    if best is None:
        raise ValueError(f"cupy backend: rows of {nvec * vec} elements are too long for the rmsnorm kernels")
    return best[1], best[2]


def _row_fits(c: int, vec: int) -> bool:
    """Whether a row of ``c`` elements fits the register-row kernels (_row_layout's limit: 1024 threads of K
    vectors)."""
    return cdiv(c // vec, max(rt.row_ks(vec))) <= 1024


def _partial_rows(rows: int, per_iter: int) -> tuple[int, int]:
    """(blocks, rows per block) of a backward kernel that walks ``rows`` rows, ``per_iter`` at a time per block, and
    writes one partial weight-gradient row per block: at most BWD_MAX_BLOCKS blocks, a function of the sizes only,
    so column_sum adds the partials in the same order on every run."""
    blocks = min(cdiv(rows, per_iter), BWD_MAX_BLOCKS)
    rows_per_block = cdiv(rows, blocks)
    return cdiv(rows, rows_per_block), rows_per_block


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_rows(what: str, n: int, c: int, **tensors: torch.Tensor | None) -> None:
    """ValueError unless every given tensor has the size an [n, c] op gives it: [c] for weights and their
    gradients, [n] for per-row statistics, [n, c] otherwise."""
    for name, t in tensors.items():
        if t is None:
            continue
        want = (c,) if name in ("weight", "bias", "dweight", "dbias") else (n,) if name in ("mean", "rstd") else (n, c)
        if tuple(t.shape) != want:
            raise ValueError(f"{what}: {name} has shape {tuple(t.shape)}, expected {list(want)} for rows [{n}, {c}]")


class CupyBackend(Backend):
    """Raw CUDA kernels through CuPy (CUDA only); GEMMs and attention from the providers; ``FALLBACKS``."""

    name = "cupy"
    graph_capturable = True  # launches on torch's current stream, no host sync inside a step
    FALLBACKS = ("bias_backward", "fused_classifier_fp8")

    def __init__(self, device="cuda", **components):
        cupy = rt.require_cupy(torch.device(device))  # before anything touches CUDA: one clear sentence if absent
        super().__init__(device, **components)
        self._reference = TorchBackend(self.device, gemm="torch")  # for dtypes the kernels do not take
        self.k = rt.Kernels(cupy, self.device)

    def compile_all(self) -> float:
        """Compile (or load from CuPy's disk cache) every kernel now instead of at first use; returns seconds."""
        return self.k.compile_all()

    def _launch(self, module, name, grid, block, args, shared_mem=0):
        self.k.launch(module, name, grid, block, args, shared_mem)

    # ------------------------------------------------------------------ embedding
    def embedding_forward(self, out, tokens, table):
        _contiguous(out, table)
        if table.dtype != out.dtype or out.dtype.itemsize not in (2, 4):
            return self._reference.embedding_forward(out, tokens, table)
        tokens = self._token_ids(tokens)
        n, c = tokens.numel(), table.shape[1]
        row_bytes = c * table.element_size()
        word = 16 if row_bytes % 16 == 0 and aligned(out, table) else 4 if row_bytes % 4 == 0 else 2
        w_name = {16: "uint4", 4: "unsigned int", 2: "unsigned short"}[word]
        row_words = row_bytes // word
        total = n * row_words
        if total == 0:
            return
        name = f"emb_fwd<{w_name}, {self._ti(tokens)}>"
        self._launch("embedding", name, self.k.grid_for(total, 256), 256,
                     (ptr(out), ptr(tokens), ptr(table), i64(total), i32(row_words)))

    def embedding_backward(self, dtable, tokens, dout):
        _contiguous(dtable, dout)
        if dtable.dtype not in MODEL_DTYPES or dout.dtype != dtable.dtype:
            return self._reference.embedding_backward(dtable, tokens, dout)
        n, c = tokens.numel(), dtable.shape[1]
        if n == 0:
            return
        sorted_tok, perm = torch.sort(tokens.reshape(-1).long(), stable=True)
        chunks = cdiv(n, EMB_CHUNK)
        head = torch.empty(chunks, c, dtype=torch.float32, device=dout.device)
        vec = _vec(dtable.dtype, c, dtable, dout)
        threads = min(256, _round32(cdiv(c, vec)))
        t = T_NAME[dtable.dtype]
        self._launch("embedding", f"emb_bwd_head<{t}, {vec}>", chunks, threads,
                     (ptr(head), ptr(sorted_tok), ptr(perm), ptr(dout), i32(n), i32(c)))
        self._launch("embedding", f"emb_bwd_segments<{t}, {vec}>", chunks, threads,
                     (ptr(dtable), ptr(head), ptr(sorted_tok), ptr(perm), ptr(dout), i32(n), i32(c), i32(chunks)))

    @staticmethod
    def _token_ids(tokens):
        tokens = tokens.reshape(-1)
        if tokens.dtype not in (torch.int32, torch.int64):
            tokens = tokens.long()
        return tokens.contiguous()

    @staticmethod
    def _ti(tokens) -> str:
        return "int" if tokens.dtype == torch.int32 else "long long"

    # ------------------------------------------------------------------ RMSNorm
    def rmsnorm_forward(self, out, rstd, inp, weight, eps, absmax=None):
        self._rmsnorm_forward(out, rstd, inp, None, None, weight, eps, absmax)

    def fused_residual_rmsnorm_forward(self, residual, out, rstd, inp1, inp2, weight, eps, absmax=None):
        self._rmsnorm_forward(out, rstd, inp1, inp2, residual, weight, eps, absmax)

    def _rmsnorm_forward(self, out, rstd, inp, inp2, residual, weight, eps, absmax):
        _contiguous(out, rstd, inp, inp2, residual, weight)
        dtype = inp.dtype
        if dtype not in MODEL_DTYPES or any(t is not None and t.dtype != dtype for t in (out, inp2, residual, weight)):
            if residual is None:
                return self._reference.rmsnorm_forward(out, rstd, inp, weight, eps, absmax)
            return self._reference.fused_residual_rmsnorm_forward(residual, out, rstd, inp, inp2, weight, eps, absmax)
        n, c = inp.shape
        vec = _vec(dtype, c, out, inp, inp2, residual, weight)
        k, tx = _row_layout(c // vec, vec, prefer_small_k=False)
        ty = max(1, 256 // tx)
        if absmax is not None:
            self.k.zero_u32(absmax)
        if n == 0:
            return
        self._launch("rmsnorm", f"rmsnorm_fwd<{T_NAME[dtype]}, {vec}, {k}>", cdiv(n, ty), (tx, ty),
                     (ptr(out), ptr(rstd), ptr(inp), ptr(inp2), ptr(residual), ptr(weight), ptr(absmax), i32(n),
                      i32(c), f32(eps)))

    def rmsnorm_backward(self, dinp, dweight, dout, inp, weight, rstd, dresidual=None, absmax=None):
        _contiguous(dinp, dweight, dout, inp, weight, rstd, dresidual)
        dtype = inp.dtype
        if dtype not in MODEL_DTYPES or any(t is not None and t.dtype != dtype
                                            for t in (dinp, dweight, dout, weight, dresidual)):
            return self._reference.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, dresidual, absmax)
        n, c = inp.shape
        if absmax is not None:
            self.k.zero_u32(absmax)
        if n == 0:
            return
        vec = _vec(dtype, c, dinp, dout, inp, weight, dresidual)
        k, tx = _row_layout(c // vec, vec, prefer_small_k=True)
        ty = max(1, min(256 // tx, SMEM_FLOATS // c))
        blocks, rows_per_block = _partial_rows(n, ty)
        part = torch.empty(blocks, c, dtype=torch.float32, device=inp.device)
        smem = ty * c * 4 if ty > 1 else 0
        self._launch("rmsnorm", f"rmsnorm_bwd<{T_NAME[dtype]}, {vec}, {k}>", blocks, (tx, ty),
                     (ptr(dinp), ptr(part), ptr(dout), ptr(inp), ptr(weight), ptr(rstd), ptr(dresidual), ptr(absmax),
                      i32(n), i32(c), i32(rows_per_block)), shared_mem=smem)
        self._column_sum(dweight, part)

    def _column_sum(self, out, part):
        """out[C] += part[P, C].sum(0) (``column_sum`` of reduce.cu: fp32 partial rows, contiguous, summed per
        column in a fixed order, one rounding into out's dtype)."""
        p, c = part.shape
        self._launch("reduce", f"column_sum<{T_NAME[out.dtype]}>", cdiv(c, 32), (32, 32),
                     (ptr(out), ptr(part), i32(p), i32(c)))

    # ------------------------------------------------------------------ QK-norm (Qwen3)
    def qk_norm_forward(self, qkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads, eps):
        """``qk_norm_fwd`` (kernels/qk_norm.cu): one pass over the q/k heads of qkv, in place; saved and rstd for
        the backward (Backend.qk_norm_forward)."""
        plan = self._qk_norm_plan("qk_norm_forward", qkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads)
        if plan is None:
            return self._reference.qk_norm_forward(qkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads, eps)
        rows, h, d, vec, k, g = plan
        if rows == 0:
            return
        self._launch("qk_norm", f"qk_norm_fwd<{T_NAME[qkv.dtype]}, {vec}, {k}>", cdiv(rows, 256 // g), 256,
                     (ptr(qkv), ptr(saved), ptr(rstd), ptr(q_weight), ptr(k_weight), i32(rows), i32(h),
                      i32(n_q_heads), i64((n_q_heads + 2 * n_kv_heads) * d), i32(d), i32(g), f32(eps)))

    def qk_norm_backward(self, dqkv, dq_weight, dk_weight, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads):
        """``qk_norm_bwd`` (dx in place on dqkv's q/k heads, one partial row per block and weight) and two
        ``column_sum`` launches into dq_weight / dk_weight: deterministic (Backend.qk_norm_backward)."""
        plan = self._qk_norm_plan("qk_norm_backward", dqkv, saved, rstd, q_weight, k_weight, n_q_heads, n_kv_heads,
                                  dq_weight=dq_weight, dk_weight=dk_weight)
        if plan is None:
            return self._reference.qk_norm_backward(dqkv, dq_weight, dk_weight, saved, rstd, q_weight, k_weight,
                                                    n_q_heads, n_kv_heads)
        rows, h, d, vec, k, g = plan
        if rows == 0:
            return
        groups = min(256 // g, SMEM_FLOATS // (2 * d))  # head rows in flight per block
        groups = max(32 // g, groups - groups % (32 // g))  # whole warps
        blocks, rows_per_block = _partial_rows(rows, groups)
        part = torch.empty(2, blocks, d, dtype=torch.float32, device=dqkv.device)
        smem = groups * 2 * d * 4 if groups > 1 else 0
        self._launch("qk_norm", f"qk_norm_bwd<{T_NAME[dqkv.dtype]}, {vec}, {k}>", blocks, groups * g,
                     (ptr(dqkv), ptr(part), ptr(saved), ptr(rstd), ptr(q_weight), ptr(k_weight), i32(rows), i32(h),
                      i32(n_q_heads), i64((n_q_heads + 2 * n_kv_heads) * d), i32(d), i32(g), i32(rows_per_block)),
                     shared_mem=smem)
        self._column_sum(dq_weight, part[0])
        self._column_sum(dk_weight, part[1])

    @staticmethod
    def _qk_norm_plan(what, qkv, saved, rstd, q_weight, k_weight, n_q, n_kv, **grads):
        """(head rows R, H = Hq + Hkv, D, VEC, K, G) for the qk_norm kernels, or None for a call the torch default
        takes (a dtype other than fp32/bf16, mixed dtypes, a non-contiguous tensor, a head dim beyond 32 x 8
        vectors). Shapes that do not fit the contract raise ValueError."""
        h, d = n_q + n_kv, qkv.shape[-1]
        if qkv.dim() < 2 or qkv.shape[-2] != n_q + 2 * n_kv:
            raise ValueError(f"{what}: qkv {tuple(qkv.shape)} is not [..., Hq + 2*Hkv = {n_q + 2 * n_kv}, D]")
        n = qkv.numel() // ((n_q + 2 * n_kv) * d) if d else 0
        if tuple(saved.shape) != (n, h, d) or tuple(rstd.shape) != (n, h):
            raise ValueError(f"{what}: saved {tuple(saved.shape)} / rstd {tuple(rstd.shape)} must be [{n}, {h}, {d}] "
                             f"/ [{n}, {h}]")
        for name, t in (("q_weight", q_weight), ("k_weight", k_weight), *grads.items()):
            if tuple(t.shape) != (d,):
                raise ValueError(f"{what}: {name} {tuple(t.shape)} must be [{d}]")
        dtype = qkv.dtype
        tensors = (qkv, saved, rstd, q_weight, k_weight, *grads.values())
        if (dtype not in MODEL_DTYPES or any(t.dtype != dtype for t in (saved, q_weight, k_weight))
                or rstd.dtype != torch.float32 or any(t.dtype not in MODEL_DTYPES for t in grads.values())
                or not all(t.is_contiguous() for t in tensors)):
            return None
        vec = _vec(dtype, d, qkv, saved, q_weight, k_weight)
        nvec = d // vec
        k = next((k for k in rt.QK_K if 32 * k >= nvec), None)
        if k is None:
            return None
        return n * h, h, d, vec, k, _pow2(cdiv(nvec, k))

    # ------------------------------------------------------------------ LayerNorm (GPT-2)
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias, eps, absmax=None):
        """``layernorm_fwd`` (kernels/layernorm.cu): one read of inp, one write of out, mean/rstd in fp32, the
        fused max|out| (Backend.layernorm_forward)."""
        self._layernorm_forward(out, mean, rstd, inp, None, None, weight, bias, eps, absmax)

    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias, eps,
                                         absmax=None):
        """``layernorm_fwd`` with the residual add fused in: the rounded residual is what gets normalised, so a
        recompute through layernorm_forward(residual) gives the same bits (Backend.fused_residual_layernorm_forward)."""
        self._layernorm_forward(out, mean, rstd, inp1, inp2, residual, weight, bias, eps, absmax)

    def _layernorm_forward(self, out, mean, rstd, inp, inp2, residual, weight, bias, eps, absmax):
        dtype = inp.dtype
        tensors = (out, mean, rstd, inp, inp2, residual, weight, bias)
        if not self._layernorm_ok(dtype, inp, (out, inp2, residual, weight, bias), (mean, rstd), tensors, absmax):
            return self._reference_layernorm_forward(out, mean, rstd, inp, inp2, residual, weight, bias, eps, absmax)
        n, c = inp.shape
        _check_rows("layernorm_forward", n, c, out=out, inp2=inp2, residual=residual, mean=mean, rstd=rstd,
                    weight=weight, bias=bias)
        vec = _vec(dtype, c, out, inp, inp2, residual, weight, bias)
        if not _row_fits(c, vec):
            return self._reference_layernorm_forward(out, mean, rstd, inp, inp2, residual, weight, bias, eps, absmax)
        k, tx = _row_layout(c // vec, vec, prefer_small_k=False)
        ty = max(1, 256 // tx)
        if absmax is not None:
            self.k.zero_u32(absmax)
        if n == 0:
            return
        self._launch("layernorm", f"layernorm_fwd<{T_NAME[dtype]}, {vec}, {k}>", cdiv(n, ty), (tx, ty),
                     (ptr(out), ptr(mean), ptr(rstd), ptr(inp), ptr(inp2), ptr(residual), ptr(weight), ptr(bias),
                      ptr(absmax), i32(n), i32(c), f32(eps)))

    def _reference_layernorm_forward(self, out, mean, rstd, inp, inp2, residual, weight, bias, eps, absmax):
        if residual is None:
            return self._reference.layernorm_forward(out, mean, rstd, inp, weight, bias, eps, absmax)
        return self._reference.fused_residual_layernorm_forward(residual, out, mean, rstd, inp, inp2, weight, bias,
                                                                eps, absmax)

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, dresidual=None, absmax=None):
        """``layernorm_bwd`` (dinp, + dresidual, + max|dinp|, one partial row per block for the weight and one for
        the bias) and two ``column_sum`` launches into dweight / dbias: deterministic (Backend.layernorm_backward)."""
        dtype = inp.dtype
        tensors = (dinp, dweight, dbias, dout, inp, weight, mean, rstd, dresidual)
        if not self._layernorm_ok(dtype, inp, (dinp, dout, weight, dresidual), (mean, rstd), tensors, absmax,
                                  grads=(dweight, dbias)):
            return self._reference.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, dresidual,
                                                      absmax)
        n, c = inp.shape
        _check_rows("layernorm_backward", n, c, dinp=dinp, dout=dout, dresidual=dresidual, mean=mean, rstd=rstd,
                    weight=weight, dweight=dweight, dbias=dbias)
        vec = _vec(dtype, c, dinp, dout, inp, weight, dresidual)
        if not _row_fits(c, vec):
            return self._reference.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, dresidual,
                                                      absmax)
        if absmax is not None:
            self.k.zero_u32(absmax)
        if n == 0:
            return
        k, tx = _row_layout(c // vec, vec, prefer_small_k=True)
        ty = max(1, min(256 // tx, SMEM_FLOATS // (2 * c)))
        blocks, rows_per_block = _partial_rows(n, ty)
        part = torch.empty(2, blocks, c, dtype=torch.float32, device=inp.device)
        smem = ty * 2 * c * 4 if ty > 1 else 0
        self._launch("layernorm", f"layernorm_bwd<{T_NAME[dtype]}, {vec}, {k}>", blocks, (tx, ty),
                     (ptr(dinp), ptr(part), ptr(dout), ptr(inp), ptr(weight), ptr(mean), ptr(rstd), ptr(dresidual),
                      ptr(absmax), i32(n), i32(c), i32(rows_per_block)), shared_mem=smem)
        self._column_sum(dweight, part[0])
        self._column_sum(dbias, part[1])

    @staticmethod
    def _layernorm_ok(dtype, inp, same_dtype, stats, tensors, absmax, grads=()) -> bool:
        """Whether the layernorm kernels take the call: fp32/bf16 [N, C] rows, one dtype for the model-dtype
        tensors, fp32 statistics and absmax, weight/bias gradients fp32 or bf16, everything contiguous; otherwise
        the call goes to the torch default (as does a row too long for registers: _row_fits)."""
        if dtype not in MODEL_DTYPES or inp.dim() != 2:
            return False
        if any(t is not None and t.dtype != dtype for t in same_dtype):
            return False
        if any(t.dtype != torch.float32 for t in stats) or any(t.dtype not in MODEL_DTYPES for t in grads):
            return False
        if absmax is not None and (absmax.dtype != torch.float32 or absmax.numel() != 1):
            return False
        return all(t is None or t.is_contiguous() for t in tensors)

    # ------------------------------------------------------------------ RoPE
    def rope_forward(self, qkv, cos, sin, n_q_heads, n_kv_heads):
        self._rope(qkv, cos, sin, n_q_heads, n_kv_heads, inverse=False)

    def rope_backward(self, dqkv, cos, sin, n_q_heads, n_kv_heads):
        self._rope(dqkv, cos, sin, n_q_heads, n_kv_heads, inverse=True)

    def _rope(self, qkv, cos, sin, n_q, n_kv, inverse):
        b, t, h, d = qkv.shape
        if qkv.stride(3) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
            raise ValueError("rope: qkv's head dim and cos/sin rows must be contiguous")
        if d % 2 or h != n_q + 2 * n_kv:
            raise ValueError(f"rope: qkv {tuple(qkv.shape)} does not match Hq={n_q}, Hkv={n_kv}")
        if qkv.dtype not in MODEL_DTYPES or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            return (self._reference.rope_backward if inverse else self._reference.rope_forward)(qkv, cos, sin, n_q, n_kv)
        half = d // 2
        esize = qkv.element_size()
        vec = VEC[qkv.dtype]
        strides_ok = all((s * esize) % 16 == 0 for s in qkv.stride()[:3]) and cos.stride(0) % 4 == 0
        if half % vec or not strides_ok or not aligned(qkv, cos, sin):
            vec = 1
        n_heads = n_q + n_kv
        total = b * t * n_heads * (half // vec)
        if total == 0:
            return
        sb, st, sh, _ = qkv.stride()
        self._launch("rope", f"rope<{T_NAME[qkv.dtype]}, {vec}>", self.k.grid_for(total, 256), 256,
                     (ptr(qkv), ptr(cos), ptr(sin), i32(t), i32(n_heads), i32(half), i64(sb), i64(st), i64(sh),
                      i64(cos.stride(0)), i64(total), i32(1 if inverse else 0)))

    # ------------------------------------------------------------------ SwiGLU
    def swiglu_forward(self, out, inp, absmax=None):
        _contiguous(out, inp)
        n, i = out.shape
        if out.dtype not in MODEL_DTYPES or inp.dtype != out.dtype or tuple(inp.shape) != (n, 2 * i):
            return self._reference.swiglu_forward(out, inp, absmax)
        vec = _vec(out.dtype, i, out, inp)
        total = n * (i // vec)
        if absmax is not None:
            self.k.zero_u32(absmax)
        if total == 0:
            return
        self._launch("swiglu", f"swiglu_fwd<{T_NAME[out.dtype]}, {vec}>", self.k.grid_for(total, 256), 256,
                     (ptr(out), ptr(inp), ptr(absmax), i64(n), i32(i)))

    def swiglu_backward(self, dinp, dout, inp, absmax=None):
        _contiguous(dinp, dout, inp)
        n, i = dout.shape
        if dout.dtype not in MODEL_DTYPES or inp.dtype != dout.dtype or dinp.dtype != dout.dtype:
            return self._reference.swiglu_backward(dinp, dout, inp, absmax)
        vec = _vec(dout.dtype, i, dinp, dout, inp)
        total = n * (i // vec)
        if absmax is not None:
            self.k.zero_u32(absmax)
        if total == 0:
            return
        self._launch("swiglu", f"swiglu_bwd<{T_NAME[dout.dtype]}, {vec}>", self.k.grid_for(total, 256), 256,
                     (ptr(dinp), ptr(dout), ptr(inp), ptr(absmax), i64(n), i32(i)))

    # ------------------------------------------------------------------ GELU-tanh (GPT-2)
    def gelu_tanh_forward(self, out, inp, absmax=None):
        """``gelu_fwd`` (kernels/gelu.cu): element-wise, the fused max|out| (Backend.gelu_tanh_forward)."""
        if not self._gelu_ok(out, inp, absmax):
            return self._reference.gelu_tanh_forward(out, inp, absmax)
        self._gelu("gelu_fwd", (out, inp), absmax)

    def gelu_tanh_backward(self, dinp, dout, inp, absmax=None):
        """``gelu_bwd``: the tanh recomputed from inp, the fused max|dinp| (Backend.gelu_tanh_backward)."""
        if not self._gelu_ok(dinp, inp, absmax, dout):
            return self._reference.gelu_tanh_backward(dinp, dout, inp, absmax)
        self._gelu("gelu_bwd", (dinp, dout, inp), absmax)

    @staticmethod
    def _gelu_ok(out, inp, absmax, other=None) -> bool:
        for t in (out,) if other is None else (out, other):
            if t.shape != inp.shape:
                raise ValueError(f"gelu_tanh: shapes differ: {tuple(t.shape)} vs inp {tuple(inp.shape)}")
        tensors = (out, inp) if other is None else (out, other, inp)
        return (inp.dtype in MODEL_DTYPES and all(t.dtype == inp.dtype and t.is_contiguous() for t in tensors)
                and (absmax is None or (absmax.dtype == torch.float32 and absmax.numel() == 1)))

    def _gelu(self, kernel, tensors, absmax):
        inp = tensors[-1]
        n = inp.numel()
        vec = VEC[inp.dtype] if n % VEC[inp.dtype] == 0 and aligned(*tensors) else 1
        if absmax is not None:
            self.k.zero_u32(absmax)
        if n == 0:
            return
        self._launch("gelu", f"{kernel}<{T_NAME[inp.dtype]}, {vec}>", self.k.grid_for(n // vec, 256), 256,
                     (*(ptr(t) for t in tensors), ptr(absmax), i64(n)))

    # ------------------------------------------------------------------ FP8 quantization
    def absmax(self, out, inp):
        _contiguous(inp)
        if inp.dtype not in MODEL_DTYPES or out.dtype != torch.float32:
            return self._reference.absmax(out, inp)
        n = inp.numel()
        vec = VEC[inp.dtype] if aligned(inp) else 1
        self.k.zero_u32(out)
        if n == 0:
            return
        self._launch("reduce", f"absmax_kernel<{T_NAME[inp.dtype]}, {vec}>", self.k.grid_for(n // vec + 1, 256), 256,
                     (ptr(out), ptr(inp), i64(n)))

    def _fp8_ok(self, q, inp) -> bool:
        return q.dtype in rt.FP8_FMT and inp.dtype in MODEL_DTYPES

    def quantize(self, out, descale, inp, absmax):
        _contiguous(out, inp)
        if not self._fp8_ok(out, inp) or out.shape != inp.shape:
            return self._reference.quantize(out, descale, inp, absmax)
        n = inp.numel()
        vec = VEC[inp.dtype] if aligned(inp) and aligned(out, to=VEC[inp.dtype]) else 1
        name = f"quantize_flat<{T_NAME[inp.dtype]}, {vec}, {rt.FP8_FMT[out.dtype]}>"
        self._launch("fp8", name, self.k.grid_for(n // vec + 1, 256), 256,
                     (ptr(out), ptr(descale), ptr(inp), ptr(absmax), i64(n)))

    def quantize_transpose(self, out_t, descale, inp, absmax):
        _contiguous(out_t, inp)
        if not self._fp8_ok(out_t, inp) or inp.dim() != 2:
            return self._reference.quantize_transpose(out_t, descale, inp, absmax)
        self._quantize_tiles(None, out_t, descale, inp, absmax)

    def quantize_with_transpose(self, out, out_t, descale, inp, absmax):
        _contiguous(out, out_t, inp)
        if out.dtype != out_t.dtype:
            raise ValueError(f"quantize_with_transpose: out is {out.dtype} but out_t is {out_t.dtype}")
        if not self._fp8_ok(out_t, inp) or inp.dim() != 2:
            return self._reference.quantize_with_transpose(out, out_t, descale, inp, absmax)
        self._quantize_tiles(out, out_t, descale, inp, absmax)

    def _quantize_tiles(self, out, out_t, descale, inp, absmax):
        m, k = inp.shape
        if tuple(out_t.shape) != (k, m) or (out is not None and out.shape != inp.shape):
            raise ValueError(f"quantize_transpose: out_t {tuple(out_t.shape)} must be the transpose of inp "
                             f"{tuple(inp.shape)}")
        v = VEC[inp.dtype]
        vec = v if k % v == 0 and aligned(inp) and aligned(out, to=v) else 1
        vec_store = int(m % 16 == 0 and aligned(out_t))
        name = f"quantize_tiles<{T_NAME[inp.dtype]}, {vec}, {rt.FP8_FMT[out_t.dtype]}>"
        self._launch("fp8", name, (max(1, cdiv(m, 64)), max(1, cdiv(k, 64))), 256,
                     (ptr(out), ptr(out_t), ptr(descale), ptr(inp), ptr(absmax), i32(m), i32(k), i32(vec_store)))

    # ------------------------------------------------------------------ loss
    def fused_classifier(self, logits, losses, targets, dloss=1.0, write_dlogits=True):
        _contiguous(losses)
        n, v = logits.shape
        if logits.stride(1) != 1:
            raise ValueError("fused_classifier: logits rows must be contiguous")
        if logits.dtype not in MODEL_DTYPES or losses.dtype != torch.float32:
            return self._reference.fused_classifier(logits, losses, targets, dloss, write_dlogits)
        if n == 0:
            return
        targets = self._token_ids(targets)
        vec = VEC[logits.dtype]
        if v % vec or (logits.stride(0) * logits.element_size()) % 16 or not aligned(logits):
            vec = 1
        threads = min(1024, _round32(v // vec))
        name = f"classifier<{T_NAME[logits.dtype]}, {vec}, {self._ti(targets)}>"
        self._launch("classifier", name, n, threads,
                     (ptr(logits), ptr(losses), ptr(targets), i32(v), i64(logits.stride(0)), f32(dloss),
                      i32(1 if write_dlogits else 0)))

    # ------------------------------------------------------------------ optimizer
    def adamw_update(self, param, grad, m, v, *, master, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                     seed, m_scale=None):
        """One launch of ``adamw<VEC>`` (kernels/adamw.cu) over flat [n] shards: param [n] fp32|bf16, grad [n]
        fp32|bf16, m [n] fp32|bf16|e4m3, v [n] fp32|bf16, master None or [n] fp32|bf16; grad_scale a float or a
        0-d tensor (read on the device). VEC = 4 when every pointer is aligned to 4 of its elements, else 1.

        fp32/bf16 m: a grid-stride loop of 4 elements per thread. e4m3 m (torch.float8_e4m3fn, with ``m_scale``
        [ceil(n/256)] fp32 power-of-two block scales, backends/fp8_moment.py): the kernel sees m as bytes and
        the non-null m_scale selects its block path, 256 threads per block and 1024 elements (4 scale blocks)
        per iteration, because the new scale of each 256-element block needs the block-wide absmax of the new
        m before any of its elements can be rounded; m and m_scale are rewritten in place. It is the same
        kernel (not a second one) so that the instantiations listed in _runtime.MODULES cover it.
        """
        _contiguous(param, grad, m, v, master, m_scale)
        n = check_adamw_shards(param, grad, m, v, master, step, MODEL_DTYPES)
        check_m_scale(m, m_scale)
        if grad.dtype not in MODEL_DTYPES:  # the CUDA kernel reads the gradient as fp32 or bf16 only
            raise TypeError(f"adamw_update: grad must be fp32 or bf16, got {grad.dtype}")
        if n == 0:
            return
        scale_t = None
        if isinstance(grad_scale, torch.Tensor):
            scale_t = grad_scale.to(param.device, torch.float32, non_blocking=True).reshape(())
        tensors = (param, grad, m, v, master)
        vec = 4 if all(t is None or t.data_ptr() % (4 * t.element_size()) == 0 for t in tensors) else 1
        bf = [i32(0 if t is None or t.dtype != torch.bfloat16 else 1) for t in tensors]
        args = (ptr(param), ptr(grad), ptr(m), ptr(m_scale), ptr(v), ptr(master), *bf, ptr(scale_t),
                f32(0.0 if scale_t is not None else float(grad_scale)), i64(n), f32(1.0 - lr * weight_decay),
                f32(beta2), f32(1.0 - beta1), f32(1.0 - beta2), f32((1.0 - beta2 ** step) ** 0.5),
                f32(-(lr / (1.0 - beta1 ** step))), f32(eps), u64(derive_seed(seed, "m")),
                u64(derive_seed(seed, "v")), u64(derive_seed(seed, "p")), i32(1 if (1.0 - beta1) < 0.5 else 0))
        if m_scale is not None:  # 256 threads (the kernel assumes it) per tile of M8_TILE elements
            grid = self.k.grid_for(cdiv(n, M8_TILE) * 256, 256)
        else:
            grid = self.k.grid_for(cdiv(n, vec), 256)
        self._launch("adamw", f"adamw<{vec}>", grid, 256, args)

    def global_norm_squared(self, out, tensor):
        if out.dtype != torch.float32 or out.numel() != 1:
            raise TypeError(f"global_norm_squared: out must be an fp32 scalar tensor, got {out.dtype} "
                            f"{tuple(out.shape)}")
        _contiguous(tensor)
        if tensor.dtype not in MODEL_DTYPES:
            return self._reference.global_norm_squared(out, tensor)
        n = tensor.numel()
        if n == 0:
            return
        vec = VEC[tensor.dtype] if aligned(tensor) else 1
        blocks = max(1, min(cdiv(n, 256 * 8), REDUCE_BLOCKS))  # a function of n only: same bits every run
        part = torch.empty(blocks, dtype=torch.float32, device=tensor.device)
        t = T_NAME[tensor.dtype]
        self._launch("reduce", f"sumsq_partial<{t}, {vec}>", blocks, 256, (ptr(part), ptr(tensor), i64(n)))
        self._launch("reduce", "finish_sum", 1, 1024, (ptr(out), ptr(part), i32(blocks)))

    def stochastic_round(self, out, inp, seed):
        _contiguous(out, inp)
        n = check_stochastic_round_args(out, inp)
        if n == 0:
            return
        vec = 4 if aligned(inp) and aligned(out, to=8) else 1
        self._launch("adamw", f"stochastic_round<{vec}>", self.k.grid_for(cdiv(n, vec), 256), 256,
                     (ptr(out), ptr(inp), i64(n), u64(int(seed) & ((1 << 63) - 1))))
