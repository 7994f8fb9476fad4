"""Speed-of-light (SOL) and MFU: how close a run's tokens/s come to what the GPU's tensor cores could do.

FLOPs per token (``ModelConfig.flops_per_token``, DESIGN §5) = 6 x (all matmul weights incl. the LM head)
+ 6 x L x (heads x head_dim) x T for causal attention (forward + backward; the 6 = 2 FLOPs per
multiply-add x 3 GEMMs: forward, dgrad, wgrad).

    achieved FLOP/s per GPU = tokens/s per GPU x FLOPs/token
    SOL = achieved / peak of the matmul dtype in use (bf16, or fp8 with --matmul-dtype e4m3)
    MFU = achieved / bf16 peak (comparable across dtypes)

Peaks are the vendors' dense (no sparsity) tensor-core numbers in TFLOP/s. An unknown GPU (or the CPU)
has no peak: SOL and MFU are then None and the console shows "-".
"""

from __future__ import annotations

from typing import Optional

# name fragment (lower case, most specific first) -> (bf16 dense TFLOP/s, fp8 dense TFLOP/s or None)
PEAK_TFLOPS: list[tuple[str, tuple[float, Optional[float]]]] = [
    ("h100 pcie", (756.0, 1513.0)),
    ("h100 nvl", (835.0, 1671.0)),
    ("h100", (989.0, 1979.0)),      # SXM (HBM3)
    ("h200", (989.0, 1979.0)),
    ("h800", (989.0, 1979.0)),
    ("gh200", (989.0, 1979.0)),
    ("b200", (2250.0, 4500.0)),
    ("a100", (312.0, None)),
    ("a800", (312.0, None)),
    ("l40s", (362.0, 733.0)),
    ("l4", (121.0, 242.0)),
    ("rtx 4090", (165.0, 330.0)),
    ("rtx 5090", (209.5, 419.0)),
    ("a10g", (70.0, None)),
]


def peak_tflops(gpu_name: str | None, matmul_dtype: str = "bf16") -> Optional[float]:
    """Dense tensor-core peak of ``gpu_name`` (as torch.cuda.get_device_name reports it) for the dtype,
    or None when unknown. ``matmul_dtype``: "bf16" (also for fp32 models: TF32 is not counted) or "e4m3"."""
    if not gpu_name:
        return None
    name = gpu_name.lower()
    for fragment, (bf16, fp8) in PEAK_TFLOPS:
        if fragment in name:
            return fp8 if matmul_dtype == "e4m3" else bf16
    return None


def sol_fraction(tokens_per_s_per_gpu: float, flops_per_token: float, peak: Optional[float]) -> Optional[float]:
    """Achieved / peak FLOP/s (0..1), or None without a peak."""
    if not peak:
        return None
    return tokens_per_s_per_gpu * flops_per_token / (peak * 1e12)


def sol_record(cfg, seq_len: int, gpu_name: str | None, matmul_dtype: str | None) -> dict:
    """The JSON log's "sol" record: FLOPs/token and the peaks used (None where unknown)."""
    dtype = "e4m3" if matmul_dtype == "e4m3" else "bf16"
    return {"flops_per_token": cfg.flops_per_token(seq_len), "gpu": gpu_name, "matmul_dtype": dtype,
            "peak_tflops": peak_tflops(gpu_name, dtype), "peak_tflops_bf16": peak_tflops(gpu_name, "bf16")}
