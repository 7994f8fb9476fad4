"""Time the single-process TrainEngine (no Ray) on random tokens: tokens/s, step time, peak memory.

    python benchmarks/engine_step.py --model Qwen2.5-0.5B --backend triton --batch-size 16 --seq-len 1024
    python benchmarks/engine_step.py --model Qwen2.5-0.5B --backend cupy --matmul-dtype e4m3

This isolates the model + optimizer from the Ray runtime (benchmarks/bench_train.py measures the whole
trainer); the difference between the two is Ray's own cost. Steps are timed back to back, so an update
overlapped with the next forward (the default on one GPU) is timed as it runs; ``--split-timing``
synchronizes between the micro-steps and the update to show each (which serializes the overlap). ``--profile`` adds a torch-profiler table of one more step, its
kernel time summed by kind (GEMM, attention, copies, ...: ``KERNELS`` lines) and the idle gaps of the compute
stream with the kernels on either side (``GAPS`` lines).
"""

import argparse
import dataclasses
import time

import torch

from llmq_ray.backends.attention import DeterministicAttention, DocumentMask
from llmq_ray.train.cli import gib_or_auto
from llmq_ray.model.config import PRESETS
from llmq_ray.engine.train_engine import TrainEngine, make_backend
from llmq_ray.engine.wgrad_overlap import enable_wgrad_overlap
from llmq_ray.settings import make_settings  # noqa: E402


KERNEL_CATEGORIES = (  # (category, substrings of the kernel name), first match wins
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "sm90", "scaled_mm", "matmul")),
    ("copy", ("memcpy", "copy", "cat", "elementwise_kernel_with_index")),
    ("memset", ("memset", "fill")),
    ("norm", ("rmsnorm", "norm")),
    ("quant/absmax", ("absmax", "quant", "amax")),
    ("swiglu/rope", ("swiglu", "rope")),
    ("classifier", ("classifier", "softmax", "lmhead", "logits")),
    ("adam", ("adam", "sgd")),
)


def gpu_kernels(prof):
    """(total µs, calls, name) of every GPU kernel of a profile (the torch version's name for the time field)."""
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t > 0 and evt.device_type.name == "CUDA":
            yield t, evt.count, evt.key


def print_kernel_categories(prof, wall_s):
    """Sum the GPU kernel time of one profiled step by kind of kernel (µs per category), next to the wall time.

    Overlapping kernels (side streams) are summed as they are, so the total can exceed the wall time."""
    sums, other = {}, {}
    for t, _, key in gpu_kernels(prof):
        name = key.lower()
        cat = next((c for c, keys in KERNEL_CATEGORIES if any(k in name for k in keys)), None)
        if cat is None:
            other[key[:70]] = other.get(key[:70], 0) + t
            cat = "other"
        sums[cat] = sums.get(cat, 0) + t
    total = sum(sums.values())
    print(f"KERNELS wall {wall_s * 1e3:.1f} ms, GPU kernel time {total / 1e3:.1f} ms "
          f"({total / 1e3 / (wall_s * 1e3) * 100:.0f}% of wall)")
    for cat, t in sorted(sums.items(), key=lambda kv: -kv[1]):
        print(f"KERNELS {cat:14s} {t / 1e3:9.1f} ms {t / total * 100:5.1f}%")
    for name, t in sorted(other.items(), key=lambda kv: -kv[1])[:8]:
        print(f"KERNELS   other: {name} {t / 1e3:.1f} ms")


def print_top_kernels(prof, top: int = 25) -> None:
    """The ``top`` GPU kernels of one profiled step by total time: calls, total ms, mean us, name."""
    for t, count, name in sorted(gpu_kernels(prof), reverse=True)[:top]:
        print(f"TOPKERNEL {t / 1e3:8.1f} ms {count:6d} x {t / count:8.1f} us  {name[:110]}")


def print_stream_gaps(prof, top: int = 12) -> None:
    """Idle time of the busiest CUDA stream (the compute stream) inside one profiled step: the sum of the gaps
    between its kernels, how much of it is in gaps under 20 µs (launch spacing) and the longest gaps with the
    kernels on either side (where the stream waited for the host, another stream or a copy)."""
    by_stream: dict = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_stream.setdefault(e.device_resource_id, []).append((e.time_range.start, e.time_range.end, e.name))
    if not by_stream:
        return
    busy = {s: sum(b - a for a, b, _ in ev) for s, ev in by_stream.items()}
    main_stream = max(busy, key=busy.get)
    ev = sorted(by_stream[main_stream])
    gaps, end, last = [], ev[0][1], ev[0][2]
    for a, b, name in ev[1:]:
        if a > end:
            gaps.append((a - end, last, name))
        if b > end:
            end, last = b, name
    span = end - ev[0][0]
    idle = sum(g for g, _, _ in gaps)
    small = sum(g for g, _, _ in gaps if g < 20)
    print(f"GAPS streams {', '.join(f'{s}: {busy[s] / 1e3:.1f} ms' for s in sorted(busy))}; compute stream "
          f"{main_stream}: span {span / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms in {len(gaps)} gaps "
          f"({small / 1e3:.1f} ms in gaps < 20 us)")
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"GAPS {g / 1e3:8.2f} ms after {before[:50]} before {after[:50]}")


class _TritonAttention(DeterministicAttention):
    """--triton-attention: our Triton forward (given one document per window: plain causal) and, as
    --deterministic-attention's provider, our Triton backward."""

    name = "triton"

    def __init__(self, device):
        super().__init__(device)
        self._one_doc = {}

    def forward(self, out, lse, qkv, n_q_heads, n_kv_heads, documents=None):
        from llmq_ray.backends.triton import attention_fwd

        if documents is None:  # one mask per shape, made once (not in every timed forward)
            documents = self._one_doc.get(qkv.shape[:2])
            if documents is None:
                documents = DocumentMask(torch.zeros(qkv.shape[:2], dtype=torch.int32, device=qkv.device))
                documents.refresh()
                self._one_doc[qkv.shape[:2]] = documents
        attention_fwd.attention_forward(out, lse, qkv, n_q_heads, n_kv_heads, documents)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--backend", default="torch", choices=["torch", "triton", "cupy"],
                    help="kernels: torch reference, triton, or cupy (CUDA C++ through CuPy/NVRTC)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--grad-accumulation", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warmup steps)")
    ap.add_argument("--model-dtype", default="bf16")
    ap.add_argument("--matmul-dtype", default=None, help="e4m3 for FP8 block GEMMs")
    ap.add_argument("--gradient-dtype", default=None, help="e4m3 or e5m2 (with --matmul-dtype e4m3)")
    ap.add_argument("--lmhead-dtype", default=None, help="e4m3: the LM head's GEMMs in FP8 too")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one step (torch profiler)")
    ap.add_argument("--master-dtype", default="fp32")
    ap.add_argument("--opt-dtype", default="bf16", help="Adam m and v dtype")
    ap.add_argument("--opt-m-dtype", default=None, help="Adam m dtype (e4m3 too); default --opt-dtype")
    ap.add_argument("--opt-v-dtype", default=None, help="Adam v dtype; default --opt-dtype")
    ap.add_argument("--fp8-delayed-swiglu-scale", action="store_true",
                    help="e4m3: the SwiGLU backward's FP8 gradient in one pass at the previous backward's scale")
    ap.add_argument("--recompute", default="", help="comma list: swiglu,norm,ffn,qkv,att,block")
    ap.add_argument("--lmhead-chunks", type=int, default=1)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay the micro-step from a CUDA graph")
    ap.add_argument("--offload-opt", action="store_true", help="Adam m and v in pinned host memory")
    ap.add_argument("--opt-resident-gib", type=gib_or_auto, default=0.0,
                    help="of the offloaded Adam state, keep this many GiB on the GPU ('auto': what set-up left free)")
    ap.add_argument("--transient-quants", action="store_true", help="e4m3: FP8 weight copies per layer and pass")
    ap.add_argument("--kept-quants-gib", type=gib_or_auto, default=0.0,
                    help="with per-layer copies: keep this many GiB of them for the whole step ('auto': free less 2 GiB)")
    ap.add_argument("--no-overlap-update", dest="overlap_update", action="store_false",
                    help="the update before the next forward, not beside it")
    ap.add_argument("--unfused-attn-rope-bwd", action="store_true",
                    help="A/B: copy the attention gradients into dqkv, then RoPE backward in place (the old path)")
    ap.add_argument("--overlap-wgrad", type=int, default=0, metavar="SMS",
                    help="model dtype: the block wgrads on a side stream sized for SMS SMs (llmq_ray/engine/wgrad_overlap.py)")
    ap.add_argument("--deterministic-attention", action="store_true",
                    help="triton: the bit-reproducible attention backward instead of cuDNN's")
    ap.add_argument("--split-timing", action="store_true",
                    help="sync between micro-steps and update to time each (the update then cannot overlap)")
    ap.add_argument("--triton-attention-backward", action="store_true",
                    help="the attention backward through our Triton kernel (--deterministic-attention's) while the "
                         "GEMMs keep their tuned algorithms: what that kernel alone changes")
    ap.add_argument("--triton-attention", action="store_true",
                    help="forward and backward through our Triton kernels (the forward with one document per "
                         "window, i.e. plain causal): what replacing cuDNN's attention altogether changes")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="replace the preset's vocabulary size (e.g. GPT-2's 50257 by 50304, a multiple of 64) to "
                         "measure what an unaligned vocabulary costs")
    ap.add_argument("--fp8-tiles", action="append", default=[], metavar="KIND=BM,BK,WARPS",
                    help="triton: replace a tile shape of the FP8 transposing kernels (a key of "
                         "llmq_ray.backends.triton.fp8.TILES; benchmarks/fp8_tiles.py times them)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for spec in args.fp8_tiles:
        from llmq_ray.backends.triton import fp8 as triton_fp8

        kind, _, dims = spec.partition("=")
        if kind not in triton_fp8.TILES or len(dims.split(",")) != 3:
            ap.error(f"--fp8-tiles {spec!r}: expected KIND=BM,BK,WARPS with KIND one of {sorted(triton_fp8.TILES)}")
        triton_fp8.TILES[kind] = tuple(int(d) for d in dims.split(","))
        print(f"fp8 tiles: {kind} = {triton_fp8.TILES[kind]}", flush=True)
    rec = {f"recompute_{r}": True for r in args.recompute.split(",") if r}
    opts = make_settings(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=3e-4, warmup=0,
                        grad_accumulation=args.grad_accumulation, steps=args.steps + 2, model_dtype=args.model_dtype,
                        master_dtype=args.master_dtype, opt_m_dtype=args.opt_m_dtype or args.opt_dtype,
                        opt_v_dtype=args.opt_v_dtype or args.opt_dtype,
                        fp8_delayed_swiglu_scale=args.fp8_delayed_swiglu_scale,
                        lmhead_chunks=args.lmhead_chunks, matmul_dtype=args.matmul_dtype,
                        lmhead_dtype=args.lmhead_dtype,
                        gradient_dtype=args.gradient_dtype, use_cuda_graphs=args.cuda_graphs,
                        offload_opt_m=args.offload_opt, offload_opt_v=args.offload_opt,
                        transient_quants=args.transient_quants, kept_quants_gib=args.kept_quants_gib,
                        opt_resident_gib=args.opt_resident_gib, overlap_update=args.overlap_update,
                        deterministic_attention=args.deterministic_attention, **rec)
    cfg = PRESETS[args.model]
    if args.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=args.vocab_size)
    backend = make_backend(args.backend, opts, args.device)
    if args.unfused_attn_rope_bwd:
        def unfused(dqkv, dout, out, lse, qkv, cos, sin, n_q, n_kv):  # attention backward, then RoPE in place
            backend.attention_backward(dqkv, dout, out, lse, qkv, n_q, n_kv)
            backend.rope_backward(dqkv, cos, sin, n_q, n_kv)

        backend.attention_rope_backward = unfused
    engine = TrainEngine(cfg, opts, backend)
    if args.triton_attention_backward:  # after the engine checked the backend against the options
        from llmq_ray.backends.attention import DeterministicAttention

        backend.attention = DeterministicAttention(backend.device)
    if args.triton_attention:
        backend.attention = _TritonAttention(backend.device)
    if args.overlap_wgrad:
        enable_wgrad_overlap(engine.model, args.overlap_wgrad)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    inputs, targets = batch[:, :-1].to(args.device), batch[:, 1:].to(args.device)
    times = []
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for step in range(args.steps + 2):
        for k in range(args.grad_accumulation):
            engine.micro_step(inputs, targets, last=k + 1 == args.grad_accumulation)
        if args.split_timing:
            sync()
            t_micro = time.perf_counter() - t0
        stats = engine.update(1e-4, step + 1)  # reads loss and norm: a host sync on the compute stream
        if args.split_timing:
            sync()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        split = (f" (micro-steps {t_micro * 1e3:.1f} ms, then update {(times[-1] - t_micro) * 1e3:.1f} ms)"
                 if args.split_timing else "")
        print(f"step {step}: loss {stats.loss:.4f} norm {stats.grad_norm:.3f} {times[-1] * 1e3:.1f} ms{split}",
              flush=True)
        t0 = t1
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync()
            t_prof = time.perf_counter()
            for _ in range(args.grad_accumulation):
                engine.micro_step(inputs, targets)
            engine.update(1e-4, args.steps + 3)
            sync()
            prof_wall = time.perf_counter() - t_prof
        print(prof.key_averages().table(sort_by="cuda_time_total" if args.device == "cuda" else "cpu_time_total",
                                        row_limit=25, max_name_column_width=60))
        if args.device == "cuda":
            print_kernel_categories(prof, wall_s=prof_wall)
            print_top_kernels(prof)
            print_stream_gaps(prof)
    step_time = sorted(times[2:])[len(times[2:]) // 2]
    tokens = args.batch_size * args.seq_len * args.grad_accumulation
    flops = cfg.flops_per_token(args.seq_len) * tokens / step_time
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    print(f"RESULT model={args.model} backend={args.backend} B={args.batch_size} T={args.seq_len} "
          f"dtype={args.model_dtype} matmul={args.matmul_dtype or args.model_dtype} graphs={int(args.cuda_graphs)} median_step_ms={step_time * 1e3:.1f} tokens_per_s={tokens / step_time:.0f} "
          f"TFLOPs={flops / 1e12:.1f} MFU_vs_989={flops / 989e12 * 100:.1f}% peak_mem_GiB={peak:.1f}")


if __name__ == "__main__":
    main()
