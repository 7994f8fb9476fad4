"""Speed-of-light (SOL) and MFU: how close a run's tokens/s come to what the GPU's tensor cores could do.

FLOPs per token (``ModelConfig.flops_per_token``) = 6 x (all matmul weights incl. the LM head)
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

# name fragment (lower case, matched as a substring of torch.cuda.get_device_name(); the first match wins, so
# more specific fragments come first) -> (bf16 dense TFLOP/s, fp8 dense TFLOP/s or None without FP8 tensor cores).
# Sources: NVIDIA's datasheets list tensor-core peaks "with sparsity" for Hopper/Ada/Blackwell; the dense figure is
# half of that. For GeForce / Ada / Blackwell-client parts the whitepapers' "with FP32 accumulate" rows are used
# (training GEMMs accumulate in FP32; those parts run FP16-accumulate at twice the rate).
PEAK_TFLOPS: list[tuple[str, tuple[float, Optional[float]]]] = [
    # Hopper. H100 SXM5 datasheet: BF16 1,979 / FP8 3,958 TFLOPS with sparsity. H100 PCIe: 1,513 / 3,026.
    # H100 NVL: 1,671 / 3,341. H200 SXM = H100 SXM's tensor cores (datasheet: 1,979 / 3,958); H200 NVL: 1,671 /
    # 3,341. GH200's Hopper GPU: 1,979 / 3,958. H800 SXM / PCIe: as H100 SXM / PCIe.
    ("h100 pcie", (756.0, 1513.0)),
    ("h100 nvl", (835.0, 1671.0)),
    ("h100", (989.0, 1979.0)),      # SXM (HBM3): "NVIDIA H100 80GB HBM3"
    ("gh200", (989.0, 1979.0)),     # before "h200": "NVIDIA GH200 480GB" contains it
    ("h200 nvl", (835.0, 1671.0)),
    ("h200", (989.0, 1979.0)),      # SXM: "NVIDIA H200"
    ("h800 pcie", (756.0, 1513.0)),
    ("h800", (989.0, 1979.0)),
    # Blackwell datacenter. HGX B200 datasheet (8 GPUs): FP8 72 PFLOPS, BF16 36 PFLOPS with sparsity ->
    # per GPU 4.5 / 2.25 PFLOPS dense. GB200 NVL72 (72 GPUs): FP8 720, BF16 360 PFLOPS sparse -> 5.0 / 2.5 dense.
    ("gb200", (2500.0, 5000.0)),    # before "b200"
    ("b200", (2250.0, 4500.0)),
    # Ampere: A100 datasheet BF16 312 TFLOPS dense (624 sparse), no FP8. A800 likewise.
    ("a100", (312.0, None)),
    ("a800", (312.0, None)),
    # Ada datacenter. L40S datasheet: BF16 733, FP8 1,466 TFLOPS with sparsity. L40: BF16 362.1, FP8 724 sparse.
    # L4: BF16 242, FP8 485 sparse. Order: "l40s", "l40", then "l4" (a substring of both).
    ("l40s", (362.0, 733.0)),
    ("l40", (181.0, 362.0)),
    ("l4", (121.0, 242.0)),
    # GeForce. RTX 4090 (Ada whitepaper): BF16 165.2, FP8 330.3 TFLOPS dense with FP32 accumulate.
    # RTX 5090 (Blackwell GeForce whitepaper): BF16 209.5, FP8 419 TFLOPS dense with FP32 accumulate.
    ("rtx 4090", (165.2, 330.3)),
    ("rtx 5090", (209.5, 419.0)),
    ("a10g", (70.0, None)),         # AWS A10G (BF16 ~70 dense, as AWS documents it); no FP8
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
