"""The train command: ``python examples/train.py [flags]`` (also installed as ``llmq-train``).

Flags follow llm.q's names; each maps onto a ``TrainOptions`` field (``--grad-accumulation`` ->
``grad_accumulation``) or onto an ``LLMQTrainer`` runtime argument. Flags whose default is "auto" pick a
value for the machine: on a CPU, a tiny Qwen-vocabulary model, fp32, the torch backend and a run of about
two minutes; on a GPU, Qwen2.5-0.5B from scratch in bf16 with the fastest backend. With no
``--train-file`` the run uses tiny-shakespeare (see ``llmq_ray/default_data.py``). The run ends by
printing the eval loss, a short generated sample and where the outputs are.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from llmq_ray.errors import LLMQError
from llmq_ray.options import TrainOptions

AUTO = "auto"

# machine-dependent defaults of the flags that say "auto"
CPU_DEFAULTS = dict(model="tiny-qwen", batch_size=4, seq_len=128, steps=20, learning_rate=3e-3,
                    model_dtype="fp32", eval_every_n_steps=10, eval_num_steps=2, eval_tokens=8192)
GPU_DEFAULTS = dict(model="Qwen2.5-0.5B", batch_size=8, seq_len=1024, steps=100, learning_rate=6e-4,
                    model_dtype="bf16", eval_every_n_steps=25, eval_num_steps=8, eval_tokens=32768)


def gib_or_auto(text: str) -> float | str:
    """argparse type of --opt-resident-gib: a number of GiB, or "auto"."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="examples/train.py", description="Train a Llama-family model with llmq-ray (one Ray worker per GPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model and data")
    m.add_argument("--model", default=AUTO, help="preset name (e.g. Qwen2.5-0.5B, tiny-qwen), HF folder or HF id in the "
                   "local cache; auto: tiny-qwen on CPU, Qwen2.5-0.5B on GPU")
    m.add_argument("--from-scratch", action="store_true", help="random init instead of the model's weights "
                   "(implied for presets, which have no weights)")
    m.add_argument("--train-file", default=None, help="glob of token shards (.bin/.parquet, see `python -m "
                   "data_pipeline.tokenize`); default: tiny-shakespeare, tokenized once into ~/.cache/llmq_ray")
    m.add_argument("--eval-file", default=None, help="glob of eval shards; default: the eval split of the default data")
    m.add_argument("--synthetic-data", action="store_true", help="train on uniform random tokens (benchmarks; no files)")
    m.add_argument("--no-ray-data", action="store_true", help="read shards in the workers directly instead of through Ray Data")
    s = p.add_argument_group("batch and schedule")
    s.add_argument("--batch-size", type=int, default=None, help="micro-batch rows per worker (auto: 4 CPU / 8 GPU)")
    s.add_argument("--seq-len", type=int, default=None, help="tokens per row (auto: 128 CPU / 1024 GPU)")
    s.add_argument("--grad-accumulation", type=int, default=1, help="micro-steps per optimizer step")
    s.add_argument("--steps", type=int, default=None, help="optimizer steps (auto: 20 CPU / 100 GPU)")
    s.add_argument("--learning-rate", "--lr", type=float, default=None, help="peak learning rate (auto: 3e-3 CPU tiny / 6e-4 GPU)")
    s.add_argument("--warmup", type=int, default=None, help="linear warmup steps (auto: steps // 10)")
    s.add_argument("--final-lr-fraction", type=float, default=0.1, help="final lr as a fraction of the peak")
    s.add_argument("--lr-schedule", default="cosine", choices=["cosine", "linear", "wsd", "constant"], help="lr decay after warmup")
    s.add_argument("--beta-1", type=float, default=0.9, help="AdamW beta1")
    s.add_argument("--beta-2", type=float, default=0.95, help="AdamW beta2")
    s.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (matrices and embeddings)")
    s.add_argument("--grad-clip", type=float, default=1.0, help="clip the global L2 gradient norm to this (0: off)")
    s.add_argument("--seed", type=int, default=42, help="seed of the init, the data order and stochastic rounding")
    e = p.add_argument_group("eval and outputs")
    e.add_argument("--eval-every-n-steps", type=int, default=None, help="eval every N steps (0: only at the end; auto: 10 CPU / 25 GPU)")
    e.add_argument("--eval-num-steps", type=int, default=None, help="batches per periodic eval (the final eval reads the whole eval file)")
    e.add_argument("--out-dir", default="out", help="folder of the export (out-dir/export) and the log")
    e.add_argument("--log-file", default=None, help="JSON log (default: out-dir/log.json), rewritten atomically")
    e.add_argument("--wandb-project", default=None, help="log live to this W&B project (WANDB_MODE honoured)")
    e.add_argument("--wandb-run-name", default=None, help="W&B run name (default: W&B's)")
    e.add_argument("--log-gpu-util", type=int, default=0,
                   help="sample GPU clocks/power/temperature/utilization every N steps into the log (0: off)")
    e.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is off anyway when stdout is not a terminal)")
    e.add_argument("--no-export", action="store_true", help="do not write the HF export at the end")
    e.add_argument("--export-dtype", default=None, choices=["fp32", "bf16"], help="dtype of the export (default: model dtype)")
    e.add_argument("--sample-tokens", type=int, default=48, help="tokens of the generated sample printed at the end (0: none)")
    e.add_argument("--prompt", default="\n", help="prompt of the sample at the end")
    c = p.add_argument_group("checkpoints and fault tolerance")
    c.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default: out-dir/ckpt)")
    c.add_argument("--ckpt-interval", type=int, default=0, help="checkpoint every N optimizer steps (0: never)")
    c.add_argument("--ckpt-keep-n", "--ckpt-keep", dest="ckpt_keep_n", type=int, default=2,
                   help="keep the newest N valid checkpoints (1 is allowed but risky)")
    c.add_argument("--ckpt-major", type=int, default=0, help="keep the checkpoints of steps that are multiples of N forever (0: none)")
    c.add_argument("--continue", dest="resume", nargs="?", const="latest", default=None, metavar="STEP|DIR",
                   help="resume from the newest valid checkpoint of --checkpoint-dir (incomplete ones are skipped "
                   "with a warning), from that step, or from a checkpoint folder; any number of workers")
    c.add_argument("--max-restarts", type=int, default=3, help="after a worker dies or hangs, rebuild the group and "
                   "resume from the last checkpoint up to N times (needs --ckpt-interval)")
    c.add_argument("--step-timeout-s", type=float, default=1800.0,
                   help="a step that takes longer than this (seconds) counts as a hung worker: the group is "
                        "rebuilt from the last checkpoint (default 1800, Ray Train's process-group timeout)")
    c.add_argument("--skip-update-on-spike", action="store_true", help="skip the update of a step whose loss or "
                   "grad-norm z-score exceeds --spike-threshold (spikes are always logged as warnings)")
    c.add_argument("--spike-window", type=int, default=128, help="steps in the spike guard's z-score window")
    c.add_argument("--spike-threshold", type=float, default=6.0, help="z-score above which a step is a loss or grad-norm spike")
    n = p.add_argument_group("numerics and memory")
    n.add_argument("--model-dtype", default=AUTO, choices=[AUTO, "fp32", "bf16"], help="weights, activations, grads (auto: bf16 GPU / fp32 CPU)")
    n.add_argument("--matmul-dtype", default=None, choices=["fp32", "bf16", "e4m3"], help="dtype of the block GEMMs (default: model dtype)")
    n.add_argument("--gradient-dtype", default=None, choices=["e4m3", "e5m2"], help="FP8 backward operands (with --matmul-dtype e4m3)")
    n.add_argument("--master-dtype", default="fp32", choices=["fp32", "bf16"], help="master weights")
    n.add_argument("--opt-m-dtype", default="fp32", choices=["fp32", "bf16"], help="AdamW first moment")
    n.add_argument("--opt-v-dtype", default="fp32", choices=["fp32", "bf16"], help="AdamW second moment")
    for name, what in (("swiglu", "the SwiGLU output"), ("norm", "the RMSNorm outputs"),
                       ("ffn", "the MLP up/gate projection (implies swiglu)"), ("qkv", "the QKV projection"),
                       ("att", "attention (implies qkv)"), ("block", "the whole block (implies all)")):
        n.add_argument(f"--recompute-{name}", action="store_true", help=f"recompute {what} in the backward instead of storing it")
    n.add_argument("--lmhead-chunks", type=int, default=1, help="run the LM head + loss in N row chunks (less memory)")
    n.add_argument("--use-cuda-graphs", action="store_true", help="replay each micro-step's forward + backward from a CUDA graph (GPU only)")
    n.add_argument("--no-overlap-update", dest="overlap_update", action="store_false",
                   help="one GPU, ZeRO-1: run the optimizer update before the next forward instead of beside it "
                   "(same results; for comparisons)")
    n.add_argument("--overlap-wgrad-sms", type=int, default=0, metavar="SMS",
                   help="model-dtype GEMMs: run each block's weight-gradient GEMMs on a side stream sized for SMS SMs, "
                   "beside the memory-bound kernels of the backward (H100: 100 of 132; same gradients; default 0: off)")
    n.add_argument("--deterministic-attention", action="store_true",
                   help="triton backend: run the attention backward through llmq-ray's own kernels, which give the "
                   "same bits on every run (cuDNN's may not), and keep the libraries' default GEMM algorithms instead of "
                   "timing alternatives, so a resumed run reproduces the uninterrupted one")
    n.add_argument("--attn-bwd-chunks", type=int, default=1,
                   help="run the attention backward over the batch in N chunks (less scratch memory; same result)")
    o = p.add_argument_group("host offloading (pinned host memory; the state streams through the GPU in pipelined chunks)")
    o.add_argument("--offload-master", action="store_true", help="keep the master weights in host memory")
    o.add_argument("--offload-opt-m", action="store_true", help="keep Adam's first moment in host memory")
    o.add_argument("--offload-opt-v", action="store_true", help="keep Adam's second moment in host memory")
    o.add_argument("--offload-gradients", action="store_true",
                   help="keep the sharded gradient accumulator in host memory (needs --zero-level 2 or 3)")
    o.add_argument("--offload-residual", action="store_true",
                   help="keep the per-layer residual stream saved for the backward in host memory")
    o.add_argument("--persistent-quants", action="store_true",
                   help="with --matmul-dtype e4m3: keep every layer's FP8 weight copies for the whole step (always "
                   "so below ZeRO-3; under ZeRO-3 each layer is then gathered once per step instead of every pass)")
    o.add_argument("--offload-quants", action="store_true",
                   help="keep the persistent FP8 weight copies in host memory, fetched one layer ahead "
                   "(needs --persistent-quants)")
    o.add_argument("--transient-quants", action="store_true",
                   help="with --matmul-dtype e4m3: make each layer's FP8 weight copies when the layer runs and keep only "
                   "two layers' worth (the ZeRO-3 default), also under ZeRO-1/2: saves as many bytes as the bf16 "
                   "block weights (13 GiB at 7B) for one weight quantization per layer and pass")
    o.add_argument("--opt-resident-gib", type=gib_or_auto, default=0.0, metavar="G|auto",
                   help="with --offload-master/--offload-opt-m/--offload-opt-v: keep this many GiB of that state on "
                   "the GPU (the chunks updated first) and stream only the rest (same results, less PCIe traffic); "
                   "'auto': as much as the GPU has free after set-up, less 2 GiB")
    o.add_argument("--use-zero-copy", action="store_true",
                   help="the optimizer kernel reads/writes the offloaded host state directly instead of streaming "
                   "it (not supported on CUDA yet)")
    o.add_argument("--opt-chunk-size", type=int, default=1 << 25,
                   help="elements per optimizer chunk: the unit offloaded state streams in (and of the "
                   "stochastic-rounding seeds)")
    d = p.add_argument_group("devices and parallelism")
    d.add_argument("--device", default=AUTO, choices=[AUTO, "cuda", "cpu"], help="cuda: one worker per GPU (NCCL); cpu: CPU workers over gloo")
    d.add_argument("--backend", default=AUTO, choices=[AUTO, "torch", "triton", "cupy"], help="kernels (auto: fastest on GPU, torch on CPU)")
    d.add_argument("--gpus", type=int, default=0, help="GPUs to train on (0: all GPUs of the Ray cluster)")
    d.add_argument("--workers", type=int, default=None, help="worker actors (CPU runs; on GPU the same as --gpus)")
    d.add_argument("--cpus-per-worker", type=int, default=None, help="CPU cores reserved per worker (auto)")
    d.add_argument("--zero-level", type=int, default=1, choices=[1, 2, 3],
                   help="1: shard optimizer state; 2: + gradients; 3: + weights (gathered per layer, one ahead)")
    d.add_argument("--shard-gradients", action="store_true", help="shard gradients too (same as --zero-level 2)")
    d.add_argument("--shard-weights", action="store_true", help="shard weights too (same as --zero-level 3)")
    d.add_argument("--ray-address", default=None, help="address of a running Ray cluster (default: join or start a local one)")
    return p


def _cuda_here() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def resolve_args(a: argparse.Namespace) -> tuple[TrainOptions, dict]:
    """Fill the "auto" flags for this machine; returns (TrainOptions, LLMQTrainer runtime kwargs)."""
    device = a.device if a.device != AUTO else ("cuda" if _cuda_here() else "cpu")
    auto = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    pick = lambda value, key: auto[key] if value in (None, AUTO) else value  # noqa: E731
    model = pick(a.model, "model")
    from llmq_ray.config import PRESETS

    steps = pick(a.steps, "steps")
    warmup = a.warmup if a.warmup is not None else min(steps // 10, 100)
    opts = TrainOptions(
        model=model, from_scratch=a.from_scratch or model in PRESETS, batch_size=pick(a.batch_size, "batch_size"),
        seq_len=pick(a.seq_len, "seq_len"), grad_accumulation=a.grad_accumulation, steps=steps,
        learning_rate=pick(a.learning_rate, "learning_rate"), warmup=warmup, final_lr_fraction=a.final_lr_fraction,
        lr_schedule=a.lr_schedule, beta_1=a.beta_1, beta_2=a.beta_2, weight_decay=a.weight_decay,
        grad_clip=a.grad_clip, model_dtype=pick(a.model_dtype, "model_dtype"), matmul_dtype=a.matmul_dtype,
        gradient_dtype=a.gradient_dtype, master_dtype=a.master_dtype, opt_m_dtype=a.opt_m_dtype,
        opt_v_dtype=a.opt_v_dtype, recompute_swiglu=a.recompute_swiglu, recompute_norm=a.recompute_norm,
        recompute_ffn=a.recompute_ffn, recompute_qkv=a.recompute_qkv, recompute_att=a.recompute_att,
        recompute_block=a.recompute_block, lmhead_chunks=a.lmhead_chunks, attn_bwd_chunks=a.attn_bwd_chunks,
        offload_master=a.offload_master, offload_opt_m=a.offload_opt_m, offload_opt_v=a.offload_opt_v,
        offload_gradients=a.offload_gradients, offload_residual=a.offload_residual, use_zero_copy=a.use_zero_copy,
        opt_resident_gib=a.opt_resident_gib,
        persistent_quants=a.persistent_quants, offload_quants=a.offload_quants,
        transient_quants=a.transient_quants,
        opt_chunk_size=a.opt_chunk_size, zero_level=a.zero_level, shard_gradients=a.shard_gradients,
        shard_weights=a.shard_weights, use_cuda_graphs=a.use_cuda_graphs, overlap_update=a.overlap_update,
        overlap_wgrad_sms=a.overlap_wgrad_sms, deterministic_attention=a.deterministic_attention,
        seed=a.seed)
    if opts.matmul_dtype == opts.model_dtype:
        opts.matmul_dtype = None
    train_file, eval_file = a.train_file, a.eval_file
    if not a.synthetic_data and train_file is None:
        from llmq_ray.default_data import default_dataset

        train_file, default_eval, desc = default_dataset(eval_tokens=auto["eval_tokens"])
        eval_file = eval_file or default_eval
        print(f"data: {desc}", flush=True)
    runtime = dict(train_file=train_file, eval_file=eval_file, synthetic_data=a.synthetic_data,
                   use_ray_data=not a.no_ray_data, device=device, backend=a.backend, gpus=a.gpus,
                   workers=a.workers, cpus_per_worker=a.cpus_per_worker,
                   eval_every_n_steps=pick(a.eval_every_n_steps, "eval_every_n_steps") if eval_file else 0,
                   eval_num_steps=pick(a.eval_num_steps, "eval_num_steps"), out_dir=a.out_dir,
                   log_file=a.log_file, export=not a.no_export, export_dtype=a.export_dtype,
                   checkpoint_dir=a.checkpoint_dir, ckpt_interval=a.ckpt_interval, ckpt_keep_n=a.ckpt_keep_n,
                   ckpt_major=a.ckpt_major, resume=a.resume if a.resume is not None else False,
                   max_restarts=a.max_restarts, step_timeout_s=a.step_timeout_s, skip_update_on_spike=a.skip_update_on_spike,
                   spike_window=a.spike_window, spike_threshold=a.spike_threshold, ray_address=a.ray_address,
                   wandb_project=a.wandb_project, wandb_run_name=a.wandb_run_name, log_gpu_util=a.log_gpu_util,
                   progress=not a.no_progress)
    return opts, runtime


def print_sample(export_path: str, prompt: str, n_tokens: int, seed: int, device: str) -> None:
    """Generate ``n_tokens`` from the export with the KV-cache sampler and print them (text for Qwen vocab)."""
    from llmq_ray.generate import load_for_generation

    gen = load_for_generation(export_path, device=device, dtype="fp32")
    tok = None
    if gen.cfg.vocab_size >= 151643:
        from data_pipeline.vocab import QwenTiktoken

        tok = QwenTiktoken()
    ids = tok.encode(prompt) if tok is not None else [gen.cfg.bos_token_id or 0]
    out = gen.generate([ids], n_tokens, temperature=0.8, top_k=40, seed=seed, eos_token_id=None)[0]
    text = tok._enc.decode(out) if tok is not None else " ".join(map(str, out))  # tiktoken decode
    print("sample:", repr(prompt + text) if tok is not None else text, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args = build_parser().parse_args(argv)
    try:
        opts, runtime = resolve_args(args)
        from llmq_ray.trainer import LLMQTrainer

        result = LLMQTrainer(opts, **runtime).fit()
        if result.export_path and args.sample_tokens > 0:
            print_sample(result.export_path, args.prompt, args.sample_tokens, args.seed,
                         "cuda" if runtime["device"] == "cuda" and _cuda_here() else "cpu")
    except LLMQError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    m = result.metrics
    if m["eval_loss"] is not None:
        print(f"eval loss: {m['eval_loss']:.4f}")
    if m.get("restarts") or m.get("skipped_steps"):
        print(f"robustness: {m['restarts']} automatic restart(s), {m['skipped_steps']} skipped update(s), "
              f"{m['warnings']} warning(s) in the log")
    ckpt = result.checkpoint_paths[-1] if result.checkpoint_paths else "-"
    print(f"outputs: export {result.export_path or '-'} | checkpoint {ckpt} | log {result.log_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
