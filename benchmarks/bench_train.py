"""Time training through the whole Ray runtime: a preset from scratch on random tokens (no data files), or on
the token shards of ``--train-file``.

    python benchmarks/bench_train.py --model Qwen2.5-0.5B --batch-size 16 --seq-len 1024 --steps 30 --gpus 1
    python benchmarks/bench_train.py --device cpu --model tiny --batch-size 4 --seq-len 128 --steps 10

Prints, over the steps after ``--warmup-steps`` (the first ones allocate, compile and form NCCL rings):

* tokens/s (all workers) and per GPU, step time (median), SOL / MFU when the GPU is in the peak table;
* Ray's own overhead: the coordinator's wall time per step minus the time the slowest worker spent inside
  ``train_step`` (that is the Ray call round trip, argument/result serialization and scheduling), in ms and
  as a fraction of the step;
* the time the workers waited for data (zero here: random tokens are generated on the host).

With ``--json FILE`` the numbers are also written as one JSON record (command, GPU, date, results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.train.cli import gib_or_auto  # noqa: E402  (light: argparse and options only)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="Qwen2.5-0.5B", help="preset (trained from scratch)")
    p.add_argument("--batch-size", type=int, default=16, help="micro-batch rows per worker")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row")
    p.add_argument("--grad-accumulation", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps in total")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the statistics")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: one worker per GPU")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (cuda) ...")
    p.add_argument("--workers", type=int, default=None, help="... or CPU workers (cpu)")
    p.add_argument("--backend", default="auto", help="torch, triton, cupy or auto (fastest available)")
    p.add_argument("--model-dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--matmul-dtype", default=None, choices=["bf16", "e4m3"], help="default: the model dtype")
    p.add_argument("--lmhead-dtype", default=None, choices=["bf16", "e4m3"],
                   help="the LM head's GEMMs (default: the model dtype; e4m3: FP8)")
    p.add_argument("--zero-level", type=int, default=1, choices=[1, 2, 3], help="ZeRO level")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                   help="workers per tensor-parallel group (1: none)")
    p.add_argument("--lmhead-chunks", type=int, default=1, help="LM head row chunks")
    p.add_argument("--attn-bwd-chunks", type=int, default=1, help="attention backward batch chunks")
    for what in ("block", "ffn", "swiglu", "norm", "qkv", "att"):
        p.add_argument(f"--recompute-{what}", action="store_true", help=f"recompute {what} in the backward (less memory)")
    for what in ("master", "opt-m", "opt-v", "gradients", "residual"):
        p.add_argument(f"--offload-{what}", action="store_true", help=f"keep {what} in pinned host memory")
    p.add_argument("--use-zero-copy", action="store_true", help="optimizer kernel reads the offloaded host state directly")
    p.add_argument("--fp8-delayed-swiglu-scale", action="store_true",
                   help="e4m3: the SwiGLU backward's FP8 gradient in one pass at the previous backward's scale")
    p.add_argument("--fp8-smooth-swiglu", action="store_true",
                   help="e4m3: Smooth-SwiGLU (per-channel power-of-two factors folded into the down projection)")
    p.add_argument("--transient-quants", action="store_true", help="e4m3: FP8 weight copies per layer, not per step")
    p.add_argument("--kept-quants-gib", type=gib_or_auto, default=0.0,
                   help="with per-layer copies: keep this many GiB of them for the whole step ('auto': free less 2 GiB)")
    p.add_argument("--opt-resident-gib", type=gib_or_auto, default=0.0,
                   help="of the offloaded Adam state, keep this many GiB on the GPU ('auto': what set-up left free)")
    p.add_argument("--use-cuda-graphs", action="store_true", help="replay each micro-step from a CUDA graph")
    p.add_argument("--no-overlap-update", dest="overlap_update", action="store_false",
                   help="one GPU: the update before the next forward, not beside it")
    p.add_argument("--overlap-tensor-parallel", action="store_true",
                   help="--tensor-parallel > 1: the input-gradient reduce-scatters beside the wgrads")
    p.add_argument("--overlap-comm", action="store_true",
                   help="several GPUs, ZeRO-1: per-layer gradient reduces in the last backward, weight gathers "
                        "beside the next forward")
    p.add_argument("--overlap-wgrad-sms", type=int, default=0, metavar="SMS",
                   help="the block wgrads on a side stream sized for SMS SMs (0: off)")
    p.add_argument("--master-dtype", default="fp32", choices=["fp32", "bf16"], help="master weights dtype")
    p.add_argument("--opt-m-dtype", default="fp32", choices=["fp32", "bf16", "e4m3"], help="Adam m dtype")
    p.add_argument("--opt-v-dtype", default="fp32", choices=["fp32", "bf16"], help="Adam v dtype")
    p.add_argument("--memory-table", action="store_true", help="print rank 0's memory table after set-up")
    p.add_argument("--train-file", default=None,
                   help="token shards to train on instead of random tokens (e.g. benchmarks/make_packed_docs.py's)")
    p.add_argument("--document-masking", action="store_true", help="attention stops at document ends (EOS)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = p.parse_args(argv)
    if a.warmup_steps >= a.steps:
        p.error("--warmup-steps must be below --steps")

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from llmq_ray.errors import LLMQError
    from llmq_ray.train.trainer import LLMQTrainer

    dtype = a.model_dtype or ("bf16" if a.device == "cuda" else "fp32")
    kwargs = dict(model=a.model, from_scratch=True, batch_size=a.batch_size, seq_len=a.seq_len,
                  grad_accumulation=a.grad_accumulation, steps=a.steps, learning_rate=3e-4, warmup=0,
                  model_dtype=dtype, matmul_dtype=a.matmul_dtype if a.matmul_dtype != dtype else None,
                  lmhead_dtype=a.lmhead_dtype if a.lmhead_dtype != dtype else None,
                  zero_level=a.zero_level, tensor_parallel=a.tensor_parallel, lmhead_chunks=a.lmhead_chunks, attn_bwd_chunks=a.attn_bwd_chunks,
                  master_dtype=a.master_dtype if dtype == "bf16" else "fp32", opt_m_dtype=a.opt_m_dtype,
                  opt_v_dtype=a.opt_v_dtype, use_zero_copy=a.use_zero_copy, transient_quants=a.transient_quants, kept_quants_gib=a.kept_quants_gib,
                  opt_resident_gib=a.opt_resident_gib,
                  fp8_delayed_swiglu_scale=a.fp8_delayed_swiglu_scale, fp8_smooth_swiglu=a.fp8_smooth_swiglu,
                  use_cuda_graphs=a.use_cuda_graphs, overlap_update=a.overlap_update,
                  overlap_comm=a.overlap_comm, overlap_tensor_parallel=a.overlap_tensor_parallel,
                  overlap_wgrad_sms=a.overlap_wgrad_sms, document_masking=a.document_masking,
                  **{f"recompute_{w}": getattr(a, f"recompute_{w}") for w in ("block", "ffn", "swiglu", "norm", "qkv", "att")},
                  **{f"offload_{w}": getattr(a, f"offload_{w}") for w in ("master", "opt_m", "opt_v", "gradients", "residual")})
    # a run's own out-dir (its log only): two benchmarks at once (a second pytest run) never share its run lock
    out_dir = tempfile.mkdtemp(prefix="llmq-bench-")
    runtime = dict(synthetic_data=a.train_file is None, train_file=a.train_file, device=a.device, backend=a.backend, export=False, final_eval=False,
                   out_dir=out_dir, verbose=False, checkpoint_on_exit=False)
    if a.device == "cuda":
        runtime["gpus"] = a.gpus
    else:
        runtime["workers"] = a.workers or 1
    records = []
    t_setup = time.perf_counter()
    try:
        with LLMQTrainer(**kwargs, **runtime) as t:
            info = t.start()
            setup_s = time.perf_counter() - t_setup  # Ray's start, the workers, the model's init and allocations
            print(f"set-up {setup_s:.1f} s (from the trainer's construction to its first step)", flush=True)
            if a.memory_table:
                from llmq_ray.observe.memory_table import format_memory_table

                print(format_memory_table(list(info["memory"].items()), title="memory (rank 0)"), flush=True)
            for _ in range(a.steps):
                rec = t.train_step()
                records.append(rec)
                print(f"step {rec['step']:3d}: {1000 * rec['seconds']:8.1f} ms (worker {1000 * rec['worker_seconds']:8.1f} ms) "
                      f"loss {rec['loss']:.4f} | {rec['tokens_per_s']:,.0f} tok/s | data {1000 * rec['data_seconds']:.1f} ms"
                      f" | gc {1000 * rec.get('gc_seconds', 0.0):.1f} ms"
                      + (f" | allocator {rec['allocator_events']}" if rec.get("allocator_events") else ""), flush=True)
            world = t.plan.world_size
    except LLMQError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    steady = records[a.warmup_steps:]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    step_s = med([r["seconds"] for r in steady])
    worker_s = med([r["worker_seconds"] for r in steady])
    overhead = med([r["ray_overhead_seconds"] for r in steady])
    tokens = steady[0]["tokens"]
    tps = tokens / step_s
    sols = [r["sol"] for r in steady if r["sol"] is not None]
    res = {"tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world, "step_ms": 1000 * step_s,
           "worker_step_ms": 1000 * worker_s, "ray_overhead_ms": 1000 * overhead,
           "ray_overhead_fraction": overhead / step_s, "sol": med(sols) if sols else None,
           "data_wait_ms": 1000 * med([r["data_seconds"] for r in steady]),
           "peak_memory_gib": max(max(r["memory"]) for r in steady) / 2**30, "setup_s": setup_s}
    print(f"\n{a.model} B={a.batch_size} T={a.seq_len} x{a.grad_accumulation} on {world} x {info['gpu'] or 'cpu'} "
          f"({t.settings.parallel.backend}, {dtype}, ZeRO-{a.zero_level}"
          + (f", tensor-parallel {a.tensor_parallel})" if a.tensor_parallel > 1 else ")"))
    sol_s = "-" if res["sol"] is None else f"{100 * res['sol']:.1f}%"
    print(f"tokens/s {tps:,.0f} ({tps / world:,.0f} per GPU) | step {res['step_ms']:.1f} ms | "
          f"inside train_step {res['worker_step_ms']:.1f} ms | Ray overhead {res['ray_overhead_ms']:.2f} ms "
          f"({100 * res['ray_overhead_fraction']:.2f}%) | sol {sol_s} "
          f"| peak memory {res['peak_memory_gib']:.2f} GiB")
    if a.json:
        rec = {"command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": info["gpu"],
               "world_size": world, "args": vars(a), **res}
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
