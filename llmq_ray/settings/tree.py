"""Every setting of a run, defined once: a tree of dataclasses, one per section.

    RunSettings
      model        ModelSettings       which model, and where its weights come from
      data         DataSettings        token shards, batch shape
      optim        OptimSettings       optimizer and learning-rate schedule
      numerics     NumericsSettings    dtypes and the FP8 recipe
      memory       MemorySettings      recomputation, chunking, host offloading, FP8 weight copies
      speed        SpeedSettings       CUDA graphs, overlaps, GEMM / attention providers
      parallel     ParallelSettings    devices, backend, workers, ZeRO, tensor parallelism
      checkpoints  CheckpointSettings  checkpoints, resume, failures
      observe      ObserveSettings     eval, log, W&B, export, progress

Each field is one setting (its metadata: llmq_ray/settings/fields.py): its name is the keyword of
``LLMQTrainer(**overrides)`` and the key of a config file, its default the one every entry point uses
(``"auto"``: resolved for the machine by llmq_ray/settings/defaults.py), its help the ``--help`` line. The
command line (llmq_ray/train/cli.py), config files and ``--print-config`` are generated from here; the rules
between fields are in llmq_ray/settings/rules.py. The resolved tree travels whole to the coordinator, the
workers and the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmq_ray.settings.fields import setting


@dataclass
class ModelSettings:
    """Which model, and where its weights come from."""

    model: str = setting(
        "auto",
        "preset name (e.g. Qwen2.5-0.5B, tiny-qwen), HF folder or HF id in the local cache")
    from_scratch: bool = setting(
        None,
        "random init instead of the model's weights (implied for presets, which have no weights)")


@dataclass
class DataSettings:
    """The token shards and the shape of a batch."""

    train_file: str | None = setting(
        None,
        "glob of token shards (.bin/.parquet, see `python -m llmq_ray.data_pipeline.tokenize`); default: "
        "tiny-shakespeare, tokenized once into ~/.cache/llmq_ray")
    eval_file: str | None = setting(None, "glob of eval shards; default: the eval split of the default data")
    synthetic_data: bool = setting(False, "train on uniform random tokens (benchmarks; no files)")
    use_ray_data: bool = setting(
        True,
        "read shards in the workers directly instead of through Ray Data",
        negative='--no-ray-data')
    batch_size: int = setting("auto", "micro-batch rows per worker", ge=1)
    seq_len: int = setting("auto", "tokens per row", ge=2)
    grad_accumulation: int = setting(1, "micro-steps per optimizer step", ge=1)
    document_masking: bool = setting(
        False,
        "attention stops at document boundaries inside a packed window: a token attends only to earlier "
        "tokens of its own document (on the GPU: llmq-ray's Triton kernels, forward and backward, skipping the "
        "tiles outside each document)")
    document_separator: int | None = setting(
        None,
        "the token that ends each document, for --document-masking; default: the train data's EOS "
        "(its meta.json), else the model's eos_token_id", metavar='ID', ge=0, note="a token id")
    reset_positions: bool = setting(
        False,
        "with --document-masking: positions restart at 0 at every document start (needed by GPT-2's learned "
        "positions; RoPE models attend by distance, so for them it changes nothing and is implied)")


@dataclass
class OptimSettings:
    """The optimizer and its learning-rate schedule."""

    steps: int = setting("auto", "optimizer steps", ge=1)
    learning_rate: float = setting("auto", "peak learning rate", flags=("--lr",), short='lr', gt=0)
    warmup: int = setting(None, "linear warmup steps (default: steps // 10, at most 100)", ge=0)
    final_lr_fraction: float = setting(0.1, "final lr as a fraction of the peak", ge=0, le=1)
    lr_schedule: str = setting('cosine', "lr decay after warmup", choices=('cosine', 'linear', 'wsd', 'constant'))
    cooldown_fraction: float = setting(0.2, "wsd schedule: the fraction of the steps spent decaying", ge=0, le=1)
    beta_1: float = setting(0.9, "AdamW beta1", ge=0, lt=1)
    beta_2: float = setting(0.95, "AdamW beta2", ge=0, lt=1)
    adam_eps: float = setting(1e-08, "AdamW epsilon", gt=0)
    weight_decay: float = setting(0.1, "AdamW decoupled weight decay (matrices and embeddings)", ge=0)
    grad_clip: float = setting(1.0, "clip the global L2 gradient norm to this (0: off)", ge=0,
                              note="0 turns clipping off")
    seed: int = setting(42, "seed of the init, the data order and stochastic rounding")


@dataclass
class NumericsSettings:
    """The dtypes of weights, GEMMs and optimizer state."""

    model_dtype: str = setting(
        "auto",
        "weights, activations, grads",
        choices=('auto', 'fp32', 'bf16'))
    matmul_dtype: str | None = setting(None, "dtype of the block GEMMs", choices=('fp32', 'bf16', 'e4m3'))
    gradient_dtype: str | None = setting(
        None,
        "FP8 backward operands (with --matmul-dtype e4m3)",
        choices=('e4m3', 'e5m2'))
    lmhead_dtype: str | None = setting(
        "auto",
        "dtype of the LM head's three GEMMs (auto: e4m3 with --matmul-dtype e4m3, else the model dtype; e4m3: "
        "FP8, with the loss gradient in e5m2 written by the classifier; needs --model-dtype bf16)",
        choices=('auto', 'fp32', 'bf16', 'e4m3'))
    master_dtype: str = setting('fp32', "master weights", choices=('fp32', 'bf16'))
    opt_m_dtype: str = setting('fp32', "AdamW first moment (e4m3: 8 bits with a power-of-two scale per 256)",
                               choices=('fp32', 'bf16', 'e4m3'))
    opt_v_dtype: str = setting('fp32', "AdamW second moment", choices=('fp32', 'bf16'))
    fp8_monitor_every: int = setting(
        0, "e4m3: every N steps, log each layer's largest |SwiGLU output| (the FP8 down projection's input; "
        "JSON log record fp8_monitor, W&B fp8/*); 0: off", ge=0, note="0: off")
    swiglu_fp8_scale: str = setting(
        "auto",
        "e4m3: how the down projection's FP8 input (the SwiGLU output) and the up+gate gradient are scaled -- "
        "current: from the tensor's own maximum, in a separate pass; delayed: the SwiGLU kernels write the FP8 "
        "values themselves at the scale of the same layer's previous pass (values beyond it saturate; the scales "
        "are part of the checkpoint); smooth: Smooth-SwiGLU, a power-of-two factor per channel folded back into "
        "the down projection (for long runs; not with --use-cuda-graphs); auto: delayed for SwiGLU models with "
        "--matmul-dtype e4m3, else current",
        choices=('auto', 'current', 'delayed', 'smooth'),
        aliases={"fp8_delayed_swiglu_scale": ("delayed", "current"), "fp8_smooth_swiglu": ("smooth", None)})

    @property
    def torch_dtype(self):
        """The model dtype as a torch dtype (torch is imported here only: the tree itself needs none)."""
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.model_dtype]


@dataclass
class MemorySettings:
    """Less memory for more compute or PCIe traffic: recomputation, chunking, host offloading."""

    recompute_swiglu: bool = setting(False, "recompute the SwiGLU output in the backward instead of storing it")
    recompute_norm: bool = setting(False, "recompute the RMSNorm outputs in the backward instead of storing it")
    recompute_ffn: bool = setting(
        False,
        "recompute the MLP up/gate projection (implies swiglu) in the backward instead of storing it")
    recompute_qkv: bool = setting(False, "recompute the QKV projection in the backward instead of storing it")
    recompute_att: bool = setting(False, "recompute attention (implies qkv) in the backward instead of storing it")
    recompute_block: bool = setting(
        False,
        "recompute the whole block (implies all) in the backward instead of storing it")
    lmhead_chunks: int = setting(1, "run the LM head + loss in N row chunks (less memory)", ge=1)
    attn_bwd_chunks: int = setting(
        1,
        "run the attention backward over the batch in N chunks (less scratch memory; same result)", ge=1)
    offload_master: bool = setting(False, "keep the master weights in host memory")
    offload_opt_m: bool = setting(False, "keep Adam's first moment in host memory")
    offload_opt_v: bool = setting(False, "keep Adam's second moment in host memory")
    offload_gradients: bool = setting(
        False,
        "keep the sharded gradient accumulator in host memory (needs --zero-level 2 or 3)")
    offload_residual: bool = setting(
        False,
        "keep the per-layer residual stream saved for the backward in host memory")
    fp8_weight_copies: str = setting(
        "auto",
        "e4m3: where the FP8 copies of the block weights (W and W^T) live -- persistent: every layer's, on the "
        "device for the whole step; layer: made per layer when it runs, two layers' worth (as many bytes less as "
        "the bf16 block weights); host: every layer's in pinned host memory, fetched one layer ahead; auto: "
        "persistent below ZeRO-3, layer under ZeRO-3 (from each gather)",
        choices=('auto', 'persistent', 'layer', 'host'),
        aliases={"persistent_quants": ("persistent", None), "transient_quants": ("layer", None),
                 "offload_quants": ("host", None)})
    kept_quants_gib: float | str = setting(
        0.0,
        "with the per-layer FP8 weight copies (--fp8-weight-copies layer, or ZeRO-3's default): keep the copies of the "
        "first block matrices that fit in this many GiB for the whole optimizer step instead of re-making them "
        "in every pass (forward, recomputation, backward) of every micro-step (the same bytes, less traffic; "
        "under ZeRO-3 a layer whose copies are all kept is gathered only until they are made); "
        "'auto': what set-up left free, less 2 GiB, on the rank with the least under ZeRO-3 (not together with "
        "--opt-resident-gib auto)",
        metavar='G|auto', parse="gib_or_auto")
    opt_resident_gib: float | str = setting(
        0.0,
        "with --offload-master/--offload-opt-m/--offload-opt-v: keep this many GiB of that state on the "
        "GPU (the chunks updated first) and stream only the rest (same results, less PCIe traffic); "
        "'auto': as much as the GPU has free after set-up, less 2 GiB",
        metavar='G|auto', parse="gib_or_auto")
    use_zero_copy: bool = setting(
        False,
        "the optimizer kernel reads/writes the offloaded host state directly instead of streaming it (not "
        "supported on CUDA yet)")
    opt_chunk_size: int = setting(
        33554432,
        "elements per optimizer chunk: the unit offloaded state streams in (and of the stochastic- "
        "rounding seeds)", ge=1)

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_master or self.offload_opt_m or self.offload_opt_v


@dataclass
class SpeedSettings:
    """How the kernels run: CUDA graphs, overlaps, the GEMM and attention providers."""

    use_cuda_graphs: bool = setting(False, "replay each micro-step's forward + backward from a CUDA graph (GPU only)")
    overlap_update: bool = setting(
        True,
        "one GPU, ZeRO-1: run the optimizer update before the next forward instead of beside it (same "
        "results; for comparisons)")
    overlap_comm: bool = setting(
        False,
        "several GPUs, ZeRO-1: reduce each layer's gradients onto their owners during the step's last backward "
        "and gather each layer's updated weights beside the next forward, instead of one reduce-scatter and one "
        "all-gather between the steps (same results; measured slower at 0.5B on two GPUs, docs/performance.md)")
    overlap_tensor_parallel: bool = setting(
        False,
        "--tensor-parallel > 1: start each column-parallel GEMM's input-gradient reduce-scatter as soon as its "
        "dgrad is queued, beside its weight-gradient GEMM (same results; not measured faster, docs/performance.md)")
    overlap_wgrad_sms: int = setting(
        0,
        "model-dtype GEMMs: run each block's weight-gradient GEMMs on a side stream sized for SMS SMs, "
        "beside the memory-bound kernels of the backward (same gradients; 0: off)",
        metavar='SMS', ge=0, note="0: off, else a number of SMs")
    gemm: str | None = setting(
        None,
        "the GEMM provider, for any backend: torch (cuBLAS through torch) or cublaslt (FP8 wgrads "
        "accumulated in the GEMM, algorithms timed once per shape); default: the backend's own (triton: "
        "cublaslt, torch and cupy: torch)",
        choices=('torch', 'cublaslt'))
    deterministic_attention: bool = setting(
        False,
        "any backend: run the attention backward through llmq-ray's own Triton kernel, which gives the "
        "same bits on every run (cuDNN's may not), and keep the libraries' default GEMM algorithms "
        "instead of timing alternatives, so a resumed run reproduces the uninterrupted one")


@dataclass
class ParallelSettings:
    """Devices, kernels and how the work is split over the workers."""

    device: str = setting(
        "auto",
        "cuda: one worker per GPU (NCCL); cpu: CPU workers over gloo",
        choices=('auto', 'cuda', 'cpu'))
    backend: str = setting(
        "auto",
        "kernels (auto: fastest on GPU, torch on CPU)",
        choices=('auto', 'torch', 'triton', 'cupy'))
    gpus: int = setting(0, "GPUs to train on (0: all GPUs of the Ray cluster)", ge=0)
    workers: int | None = setting(None, "worker actors (CPU runs; on GPU the same as --gpus)", ge=1)
    cpus_per_worker: int | None = setting(
        None, "CPU cores reserved per worker (auto: 1 on CPU; on GPU up to 8 of the CPUs free at the start, one "
        "per worker left for Ray Data)", ge=1)
    zero_level: int = setting(
        1,
        "1: shard optimizer state; 2: + gradients; 3: + weights (gathered per layer, one ahead)",
        choices=(1, 2, 3), aliases={"shard_gradients": (2, None), "shard_weights": (3, None)}, at_least=True)
    tensor_parallel: int = setting(
        1,
        "T: split each block's weights across T workers of one node (attention heads, MLP columns/rows; KV heads "
        "replicated when there are fewer than T); the ZeRO shards split over the workers / T data-parallel ranks",
        metavar="T", ge=1)
    zero_scope: str = setting(
        "world",
        "world: ZeRO shards over every worker; node: shards within each node and replicates across nodes (one "
        "inter-node all-reduce of the shard; for clusters whose network is slower than NVLink)",
        choices=('world', 'node'))
    ray_address: str | None = setting(None, "address of a running Ray cluster")
    dashboard: bool = setting(
        True,
        "start the run's own local Ray without its dashboard (saves its processes; no effect when joining a cluster)")
    rendezvous_port_range: str | None = setting(
        None,
        "LO-HI: the rendezvous port of the process group is taken from this range on rank 0's node (for firewalled "
        "clusters; default: any free port)",
        metavar="LO-HI")
    socket_ifname: str | None = setting(
        None,
        "network interface the collectives use on every node (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; "
        "default: gloo takes the interface of the IP Ray knows the node by, NCCL chooses itself)")
    forward_env: str | None = setting(
        None,
        "comma-separated names of environment variables to pass to every worker, beside those always passed "
        "(AWS_*, GOOGLE_*, AZURE_*, HF_*, NCCL_*, GLOO_*, TORCH_*, WANDB_*, LLMQ_*)")


@dataclass
class CheckpointSettings:
    """Checkpoints, resuming and what happens when a worker fails."""

    checkpoint_dir: str | None = setting(None, "where checkpoints go", short='dir')
    ckpt_interval: int = setting(0, "checkpoint every N optimizer steps (0: never)", short='interval', ge=0)
    ckpt_keep_n: int = setting(
        2,
        "keep the newest N valid checkpoints (1 is allowed but risky)",
        flags=("--ckpt-keep",), short='keep_n', ge=1, note="default 2")
    ckpt_major: int = setting(
        0,
        "keep the checkpoints of steps that are multiples of N forever (0: none)",
        short='major', ge=0)
    resume: bool | int | str | None = setting(
        False,
        "resume from the newest valid checkpoint of --checkpoint-dir (incomplete ones are skipped with a "
        "warning), from that step, or from a checkpoint folder; any number of workers",
        flags=("--continue",), metavar='STEP|DIR', nargs="?", const="latest")
    checkpoint_on_exit: bool = setting(
        True,
        "on SIGTERM / SIGINT / SIGHUP stop without writing a checkpoint of the last step (by default one "
        "is written, also with --ckpt-interval 0)")
    allow_batch_change: bool = setting(
        False,
        "--continue on another worker count keeps --grad-accumulation as given instead of adjusting it to "
        "keep the checkpoint's global batch")
    ckpt_minutes: float = setting(
        30.0,
        "also checkpoint every M minutes of training and after the last step (0: off); on by default so that a "
        "lost node or a preempted run never loses more than M minutes", short='minutes', ge=0)
    max_restarts: int = setting(
        3,
        "after a worker dies or hangs, rebuild the group and resume from the last checkpoint up to N "
        "times", ge=0)
    elastic: bool = setting(
        False,
        "when fewer workers can be placed than the run had, resume from the last checkpoint on those that can "
        "(resharded; the global batch kept by raising --grad-accumulation) instead of waiting")
    restart_wait_s: float = setting(
        300.0,
        "seconds a restart waits for the cluster to have room for every worker again before giving up "
        "(without --elastic)", ge=0)
    collective_timeout_s: float = setting(
        300.0,
        "a torch.distributed collective that waits longer than this (seconds) fails its rank", gt=0,
        note="seconds, default 300")
    call_timeout_s: float = setting(
        1800.0,
        "seconds a worker call other than a step may take (set-up, eval, checkpoints, export)", gt=0,
        note="seconds, default 1800")
    step_timeout_s: float = setting(
        1800.0,
        "a step that takes longer than this (seconds) counts as a hung worker: the group is rebuilt from "
        "the last checkpoint (1800 s is Ray Train's process-group timeout)", gt=0,
        note="seconds, default 1800: a step that takes longer counts as a hung worker")
    skip_update_on_spike: bool = setting(
        False,
        "skip the update of a step whose loss or grad-norm z-score exceeds --spike-threshold (spikes are "
        "always logged as warnings)")
    spike_window: int = setting(128, "steps in the spike guard's z-score window", ge=2)
    spike_threshold: float = setting(6.0, "z-score above which a step is a loss or grad-norm spike", gt=0)


@dataclass
class ObserveSettings:
    """Evaluation and what the run writes and shows."""

    eval_every_n_steps: int | str = setting("auto", "eval every N steps (0: only at the end)", ge=0,
                                            note="0: only the final eval")
    eval_num_steps: int | str = setting(
        "auto",
        "batches per periodic eval (the final eval reads the whole eval file)", ge=1,
        note="the batches of each periodic eval; --eval-every-n-steps 0 alone turns periodic evals off")
    out_dir: str = setting('out', "folder of the export (out-dir/export) and the log")
    log_file: str | None = setting(None, "the run log, JSON Lines: one record per line as it happens")
    run_id: str | None = setting(
        None,
        "the run's name in the log and as the run_id label of its Ray metrics (default: <UTC time>-<random>)")
    wandb_project: str | None = setting(None, "log live to this W&B project (WANDB_MODE honoured)")
    wandb_run_name: str | None = setting(None, "W&B run name")
    log_gpu_util: int = setting(
        0,
        "sample GPU clocks/power/temperature/utilization every N steps into the log (0: off)", ge=0)
    progress: bool = setting(
        True,
        "no progress bar (it is off anyway when stdout is not a terminal)")
    export: bool = setting(True, "do not write the HF export at the end")
    final_eval: bool = setting(True, "skip the eval over the whole eval file at the end")
    export_dtype: str | None = setting(None, "dtype of the export", choices=('fp32', 'bf16'))
    sample_tokens: int = setting(48, "tokens of the generated sample printed at the end (0: none)", command_only=True,
                                ge=0, note="0: no sample")
    prompt: str = setting('\n', "prompt of the sample at the end", command_only=True)

@dataclass
class RunSettings:
    """The whole tree: one instance of every section."""

    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    optim: OptimSettings = dataclasses.field(default_factory=OptimSettings)
    numerics: NumericsSettings = dataclasses.field(default_factory=NumericsSettings)
    memory: MemorySettings = dataclasses.field(default_factory=MemorySettings)
    speed: SpeedSettings = dataclasses.field(default_factory=SpeedSettings)
    parallel: ParallelSettings = dataclasses.field(default_factory=ParallelSettings)
    checkpoints: CheckpointSettings = dataclasses.field(default_factory=CheckpointSettings)
    observe: ObserveSettings = dataclasses.field(default_factory=ObserveSettings)


def sections() -> list[tuple[str, type]]:
    """(section name, its dataclass) in the order of the tree."""
    return [(f.name, f.default_factory) for f in dataclasses.fields(RunSettings)]

