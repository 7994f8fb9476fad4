"""The train command: ``python examples/train.py [flags]`` (also installed as ``llmq-train``).

Flags follow llm.q's names; each maps onto a keyword argument of ``LLMQTrainer`` (a ``TrainOptions`` field such
as ``--grad-accumulation`` -> ``grad_accumulation``, or a runtime argument such as ``--checkpoint-dir``). The
CLI keeps no defaults of its own: a flag not given is not passed on, so the API and the CLI share one set of
defaults (``llmq_ray/train/run_defaults.py``), which ``--help`` prints. ``--config run.toml`` reads settings from a file
(``llmq_ray/train/config_file.py``; flags on the command line win) and ``--print-config`` prints the resolved ones. Defaults that say "auto" suit the machine:
on a CPU a tiny Qwen-vocabulary model, fp32, the torch backend and a run of about two minutes; on a GPU
Qwen2.5-0.5B from scratch in bf16 with the fastest backend. With no ``--train-file`` the run uses the
tiny-shakespeare corpus that ships with llmq-ray (see ``llmq_ray/train/default_data.py``). The run ends by printing the
eval loss, a short generated sample and where the outputs are.

Exit codes: 0 finished; 2 a user error (one sentence on stderr: a bad flag, file, folder or checkpoint; every
check that needs no GPU runs before Ray starts); 1 any other failure; 143 / 130 / 129 stopped by SIGTERM /
SIGINT / SIGHUP after writing a checkpoint (see ``llmq_ray/train/stop_signals.py``; a second signal abandons it).

Importing this module and checking the input imports neither torch nor Ray: a mistake ends in well under a
second on a small machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from llmq_ray.errors import LLMQError

AUTO = "auto"
CLI_ONLY = {"sample_tokens": 48, "prompt": "\n", "config": None, "print_config": False}  # not the trainer's
API_ONLY = ("verbose", "fault", "handle_signals", "cli")  # trainer keywords with no flag: for programs and tests


class Parser(argparse.ArgumentParser):
    """argparse, but an unknown flag is answered with the closest valid one."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        if message.startswith("unrecognized arguments:"):
            from llmq_ray.train.config_file import closest

            flags = [o for a in self._actions for o in a.option_strings]
            unknown = message.split(":", 1)[1].split()
            first = next((u.split("=")[0] for u in unknown if u.startswith("--")), None)
            if first:
                message = f"unrecognized argument {first}{closest(first, flags)}"
        super().error(message)


def gib_or_auto(text: str) -> float | str:
    """argparse type of --opt-resident-gib: a number of GiB, or "auto"."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="examples/train.py", description="Train a Llama-family model with llmq-ray (one Ray worker per GPU).",
        argument_default=argparse.SUPPRESS)  # a flag not given is not passed on: the trainer's default applies
    g = p.add_argument_group("config file")
    g.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file (keys: the flags' names with "
                   "underscores, at the top level or in tables); flags on the command line win")
    g.add_argument("--print-config", action="store_true",
                   help="print every resolved setting as TOML (a config file for this run) and exit without training")
    m = p.add_argument_group("model and data")
    m.add_argument("--model", help="preset name (e.g. Qwen2.5-0.5B, tiny-qwen), HF folder or HF id in the "
                   "local cache")
    m.add_argument("--from-scratch", action="store_true", help="random init instead of the model's weights "
                   "(implied for presets, which have no weights)")
    m.add_argument("--train-file", help="glob of token shards (.bin/.parquet, see `python -m "
                   "llmq_ray.data_pipeline.tokenize`); default: tiny-shakespeare, tokenized once into ~/.cache/llmq_ray")
    m.add_argument("--eval-file", help="glob of eval shards; default: the eval split of the default data")
    m.add_argument("--synthetic-data", action="store_true", help="train on uniform random tokens (benchmarks; no files)")
    m.add_argument("--no-ray-data", dest="use_ray_data", action="store_false",
                   help="read shards in the workers directly instead of through Ray Data")
    s = p.add_argument_group("batch and schedule")
    s.add_argument("--batch-size", type=int, help="micro-batch rows per worker")
    s.add_argument("--seq-len", type=int, help="tokens per row")
    s.add_argument("--grad-accumulation", type=int, help="micro-steps per optimizer step")
    s.add_argument("--steps", type=int, help="optimizer steps")
    s.add_argument("--learning-rate", "--lr", type=float, help="peak learning rate")
    s.add_argument("--warmup", type=int, help="linear warmup steps")
    s.add_argument("--final-lr-fraction", type=float, help="final lr as a fraction of the peak")
    s.add_argument("--lr-schedule", choices=["cosine", "linear", "wsd", "constant"], help="lr decay after warmup")
    s.add_argument("--beta-1", type=float, help="AdamW beta1")
    s.add_argument("--beta-2", type=float, help="AdamW beta2")
    s.add_argument("--cooldown-fraction", type=float, help="wsd schedule: the fraction of the steps spent decaying")
    s.add_argument("--adam-eps", type=float, help="AdamW epsilon")
    s.add_argument("--weight-decay", type=float, help="AdamW decoupled weight decay (matrices and embeddings)")
    s.add_argument("--grad-clip", type=float, help="clip the global L2 gradient norm to this (0: off)")
    s.add_argument("--seed", type=int, help="seed of the init, the data order and stochastic rounding")
    e = p.add_argument_group("eval and outputs")
    e.add_argument("--eval-every-n-steps", type=int, help="eval every N steps (0: only at the end)")
    e.add_argument("--eval-num-steps", type=int, help="batches per periodic eval (the final eval reads the whole eval file)")
    e.add_argument("--out-dir", help="folder of the export (out-dir/export) and the log")
    e.add_argument("--log-file", help="the run log, JSON Lines: one record per line as it happens "
                   "(default: out-dir/log.jsonl)")
    e.add_argument("--wandb-project", help="log live to this W&B project (WANDB_MODE honoured)")
    e.add_argument("--wandb-run-name", help="W&B run name (default: W&B's)")
    e.add_argument("--log-gpu-util", type=int,
                   help="sample GPU clocks/power/temperature/utilization every N steps into the log (0: off)")
    e.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it is off anyway when stdout is not a terminal)")
    e.add_argument("--no-export", dest="export", action="store_false", help="do not write the HF export at the end")
    e.add_argument("--no-final-eval", dest="final_eval", action="store_false",
                   help="skip the eval over the whole eval file at the end")
    e.add_argument("--export-dtype", choices=["fp32", "bf16"], help="dtype of the export (default: model dtype)")
    e.add_argument("--sample-tokens", type=int, default=48, help="tokens of the generated sample printed at the end (0: none)")
    e.add_argument("--prompt", default="\n", help="prompt of the sample at the end")
    c = p.add_argument_group("checkpoints and fault tolerance")
    c.add_argument("--checkpoint-dir", help="where checkpoints go (default: out-dir/ckpt)")
    c.add_argument("--ckpt-interval", type=int, help="checkpoint every N optimizer steps (0: never)")
    c.add_argument("--ckpt-keep-n", "--ckpt-keep", dest="ckpt_keep_n", type=int,
                   help="keep the newest N valid checkpoints (1 is allowed but risky)")
    c.add_argument("--ckpt-major", type=int, help="keep the checkpoints of steps that are multiples of N forever (0: none)")
    c.add_argument("--continue", dest="resume", nargs="?", const="latest", metavar="STEP|DIR",
                   help="resume from the newest valid checkpoint of --checkpoint-dir (incomplete ones are skipped "
                   "with a warning), from that step, or from a checkpoint folder; any number of workers")
    c.add_argument("--no-checkpoint-on-exit", dest="checkpoint_on_exit", action="store_false",
                   help="on SIGTERM / SIGINT / SIGHUP stop without writing a checkpoint of the last step (by default one "
                   "is written, also with --ckpt-interval 0)")
    c.add_argument("--allow-batch-change", action="store_true",
                   help="--continue on another worker count keeps --grad-accumulation as given instead of adjusting it "
                   "to keep the checkpoint's global batch")
    c.add_argument("--max-restarts", type=int, help="after a worker dies or hangs, rebuild the group and "
                   "resume from the last checkpoint up to N times (needs --ckpt-interval)")
    c.add_argument("--collective-timeout-s", type=float,
                   help="a torch.distributed collective that waits longer than this (seconds) fails its rank")
    c.add_argument("--call-timeout-s", type=float,
                   help="seconds a worker call other than a step may take (set-up, eval, checkpoints, export)")
    c.add_argument("--step-timeout-s", type=float,
                   help="a step that takes longer than this (seconds) counts as a hung worker: the group is "
                        "rebuilt from the last checkpoint (1800 s is Ray Train's process-group timeout)")
    c.add_argument("--skip-update-on-spike", action="store_true", help="skip the update of a step whose loss or "
                   "grad-norm z-score exceeds --spike-threshold (spikes are always logged as warnings)")
    c.add_argument("--spike-window", type=int, help="steps in the spike guard's z-score window")
    c.add_argument("--spike-threshold", type=float, help="z-score above which a step is a loss or grad-norm spike")
    n = p.add_argument_group("numerics and memory")
    n.add_argument("--model-dtype", choices=[AUTO, "fp32", "bf16"], help="weights, activations, grads")
    n.add_argument("--matmul-dtype", choices=["fp32", "bf16", "e4m3"], help="dtype of the block GEMMs (default: model dtype)")
    n.add_argument("--gradient-dtype", choices=["e4m3", "e5m2"], help="FP8 backward operands (with --matmul-dtype e4m3)")
    n.add_argument("--master-dtype", choices=["fp32", "bf16"], help="master weights")
    n.add_argument("--opt-m-dtype", choices=["fp32", "bf16"], help="AdamW first moment")
    n.add_argument("--opt-v-dtype", choices=["fp32", "bf16"], help="AdamW second moment")
    for name, what in (("swiglu", "the SwiGLU output"), ("norm", "the RMSNorm outputs"),
                       ("ffn", "the MLP up/gate projection (implies swiglu)"), ("qkv", "the QKV projection"),
                       ("att", "attention (implies qkv)"), ("block", "the whole block (implies all)")):
        n.add_argument(f"--recompute-{name}", action="store_true", help=f"recompute {what} in the backward instead of storing it")
    n.add_argument("--lmhead-chunks", type=int, help="run the LM head + loss in N row chunks (less memory)")
    n.add_argument("--use-cuda-graphs", action="store_true", help="replay each micro-step's forward + backward from a CUDA graph (GPU only)")
    n.add_argument("--no-overlap-update", dest="overlap_update", action="store_false",
                   help="one GPU, ZeRO-1: run the optimizer update before the next forward instead of beside it "
                   "(same results; for comparisons)")
    n.add_argument("--overlap-wgrad-sms", type=int, metavar="SMS",
                   help="model-dtype GEMMs: run each block's weight-gradient GEMMs on a side stream sized for SMS SMs, "
                   "beside the memory-bound kernels of the backward (H100: 100 of 132; same gradients; default 0: off)")
    n.add_argument("--gemm", choices=["torch", "cublaslt"],
                   help="the GEMM provider, for any backend: torch (cuBLAS through torch) or cublaslt (FP8 wgrads "
                   "accumulated in the GEMM, algorithms timed once per shape); default: the backend's own "
                   "(triton: cublaslt, torch and cupy: torch)")
    n.add_argument("--deterministic-attention", action="store_true",
                   help="any backend: run the attention backward through llmq-ray's own Triton kernel, which gives the "
                   "same bits on every run (cuDNN's may not), and keep the libraries' default GEMM algorithms instead of "
                   "timing alternatives, so a resumed run reproduces the uninterrupted one")
    n.add_argument("--attn-bwd-chunks", type=int,
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
    o.add_argument("--opt-resident-gib", type=gib_or_auto, metavar="G|auto",
                   help="with --offload-master/--offload-opt-m/--offload-opt-v: keep this many GiB of that state on "
                   "the GPU (the chunks updated first) and stream only the rest (same results, less PCIe traffic); "
                   "'auto': as much as the GPU has free after set-up, less 2 GiB")
    o.add_argument("--use-zero-copy", action="store_true",
                   help="the optimizer kernel reads/writes the offloaded host state directly instead of streaming "
                   "it (not supported on CUDA yet)")
    o.add_argument("--opt-chunk-size", type=int,
                   help="elements per optimizer chunk: the unit offloaded state streams in (and of the "
                   "stochastic-rounding seeds)")
    d = p.add_argument_group("devices and parallelism")
    d.add_argument("--device", choices=[AUTO, "cuda", "cpu"], help="cuda: one worker per GPU (NCCL); cpu: CPU workers over gloo")
    d.add_argument("--backend", choices=[AUTO, "torch", "triton", "cupy"], help="kernels (auto: fastest on GPU, torch on CPU)")
    d.add_argument("--gpus", type=int, help="GPUs to train on (0: all GPUs of the Ray cluster)")
    d.add_argument("--workers", type=int, help="worker actors (CPU runs; on GPU the same as --gpus)")
    d.add_argument("--cpus-per-worker", type=int, help="CPU cores reserved per worker (auto)")
    d.add_argument("--zero-level", type=int, choices=[1, 2, 3],
                   help="1: shard optimizer state; 2: + gradients; 3: + weights (gathered per layer, one ahead)")
    d.add_argument("--shard-gradients", action="store_true", help="shard gradients too (same as --zero-level 2)")
    d.add_argument("--shard-weights", action="store_true", help="shard weights too (same as --zero-level 3)")
    d.add_argument("--ray-address", help="address of a running Ray cluster (default: join or start a local one)")
    _add_defaults_to_help(p)
    return p


def _add_defaults_to_help(parser: argparse.ArgumentParser) -> None:
    """Append each flag's default, read from the trainer (``run_defaults.api_defaults``), to its help."""
    from llmq_ray.train.run_defaults import api_defaults

    defaults = {**api_defaults(), **CLI_ONLY}
    for a in parser._actions:
        if (not a.option_strings or a.dest == "help" or a.nargs == 0 or a.dest not in defaults
                or "default" in (a.help or "")):
            continue
        value = defaults[a.dest]
        shown = "none" if value is None else (repr(value) if isinstance(value, str) and not value.startswith("auto")
                                              else str(value))
        a.help = f"{a.help} (default: {shown})".replace("%", "%%")


def config_keys() -> set[str]:
    """The settings a config file may hold: every keyword of LLMQTrainer but the API-only ones."""
    from llmq_ray.train.run_defaults import api_defaults

    return set(api_defaults()) - set(API_ONLY)


def trainer_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``LLMQTrainer`` that the user gave on the command line (the flags of this
    command alone, ``--sample-tokens`` and ``--prompt``, left out)."""
    return {k: v for k, v in vars(args).items() if k not in CLI_ONLY}


def print_sample(export_path: str, prompt: str, n_tokens: int, seed: int, device: str) -> None:
    """Generate ``n_tokens`` from the export with the KV-cache sampler and print them (text for Qwen vocab)."""
    from llmq_ray.model.generate import load_for_generation

    gen = load_for_generation(export_path, device=device, dtype="fp32")
    tok = None
    if gen.cfg.vocab_size >= 151643:
        from llmq_ray.data_pipeline.vocab import QwenTiktoken

        tok = QwenTiktoken()
    ids = tok.encode(prompt) if tok is not None else [gen.cfg.bos_token_id or 0]
    out = gen.generate([ids], n_tokens, temperature=0.8, top_k=40, seed=seed, eos_token_id=None)[0]
    text = tok._enc.decode(out) if tok is not None else " ".join(map(str, out))  # tiktoken decode
    print("sample:", repr(prompt + text) if tok is not None else text, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args = build_parser().parse_args(argv)
    trainer = None
    try:
        from llmq_ray.train.trainer import LLMQTrainer

        kwargs = trainer_kwargs(args)
        if getattr(args, "config", None):
            from llmq_ray.train.config_file import read_config

            kwargs = {**read_config(args.config, config_keys()), **kwargs}  # the command line wins
        trainer = LLMQTrainer(cli=True, **kwargs)
        if getattr(args, "print_config", False):
            from llmq_ray.train.config_file import resolved_toml

            print(resolved_toml(trainer.resolved_settings(), args.config or ""), end="")
            return 0
        result = trainer.fit()
        if result.stopped:
            return result.stopped["exit_code"]  # its line ("stopped by SIGTERM after step N; ...") is printed
        if result.export_path and args.sample_tokens > 0:
            print_sample(result.export_path, args.prompt, args.sample_tokens, trainer.opts.seed,
                         trainer.spec.device if trainer.spec else "cpu")
    except LLMQError as exc:
        print(f"error: {exc}", file=sys.stderr)
        from llmq_ray.actors.failures import WorkerError

        return 1 if isinstance(exc, WorkerError) else 2  # 2: the input is at fault; 1: the run failed
    except KeyboardInterrupt:  # before fit() took over the signals (e.g. while the default data is tokenized)
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
