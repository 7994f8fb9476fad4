"""Every setting of a run, defined once: a tree of dataclasses, one per section.

    RunSettings
      model        ModelSettings       which model, and where its weights come from
      data         DataSettings        token shards, batch shape
      optim        OptimSettings       optimizer and learning-rate schedule
      numerics     NumericsSettings    dtypes
      memory       MemorySettings      recomputation, chunking, host offloading
      speed        SpeedSettings       CUDA graphs, overlaps, GEMM / attention providers
      parallel     ParallelSettings    devices, backend, workers, ZeRO
      checkpoints  CheckpointSettings  checkpoints, resume, failures
      observe      ObserveSettings     eval, log, W&B, export, progress

Each field is one setting: its name is the keyword argument of ``LLMQTrainer`` and the key of a config file,
its default the API's (``"auto"``: chosen for the machine, see llmq_ray/train/run_defaults.py), and its
metadata (``setting(...)``) the help text and the command-line spellings. Everything else is generated from here:

* the command line (llmq_ray/train/cli.py): every field is a flag, ``--name-with-dashes`` (llm.q's names; a
  boolean that defaults to True is turned off with ``--no-...``), extra llm.q aliases (``flags``: ``--lr``) and
  the dotted spelling ``--<section>.<name>`` (``--optim.lr 3e-4``, ``--speed.use_cuda_graphs true``);
* config files (llmq_ray/train/config_file.py): ``name = value`` at the top level, or ``short = value`` in the
  section's table (``[optim] lr = 3e-4``);
* ``TrainOptions`` (llmq_ray/options.py), the engine's flat view: the fields a training step reads, with
  ``train_default`` where the API's default is "auto".

Why our own small layer instead of a config library: the flags must keep llm.q's spellings and negations, the
defaults must stay "auto" until the machine is known, and the option dataclass must stay importable without
torch or Ray in the leaf of the package; tyro / simple-parsing / jsonargparse each fix one of those differently
(generated names, eager defaults, extra dependencies in the leaf).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

AUTO = "auto"
NO_TRAIN_DEFAULT = object()


def setting(default: Any, help: str, *, flags: tuple = (), short: str | None = None, negative: str | None = None,
            choices: tuple | None = None, metavar: str | None = None, nargs: str | None = None, const: Any = None,
            train_default: Any = NO_TRAIN_DEFAULT, runtime: bool = False, command_only: bool = False,
            parse: str | None = None):
    """One setting (a dataclass field). ``help``: one line for ``--help``; ``flags``: llm.q aliases beside
    ``--name-with-dashes``; ``short``: the name in its section (``--optim.lr``; default: the field name);
    ``negative``: the flag that turns off a default-True boolean (default ``--no-name-with-dashes``);
    ``choices`` / ``metavar`` / ``nargs`` / ``const``: as argparse's; ``train_default``: TrainOptions' default
    where this one is "auto"; ``runtime``: a setting of the run around the training step (data files, devices,
    checkpoints, outputs), which is an ``LLMQTrainer`` keyword but not a TrainOptions field; ``command_only``: a
    setting of the command, not of the trainer (the sample it prints); ``parse``: the name of the value parser
    when the annotation does not say (``gib_or_auto``)."""
    meta = dict(help=help, flags=tuple(flags), short=short, negative=negative, choices=choices, metavar=metavar,
                nargs=nargs, const=const, train_default=train_default, runtime=runtime, command_only=command_only,
                parse=parse)
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class ModelSettings:
    """Which model, and where its weights come from."""

    model: str = setting(
        "auto",
        "preset name (e.g. Qwen2.5-0.5B, tiny-qwen), HF folder or HF id in the local cache",
        train_default='tiny')
    from_scratch: bool = setting(
        None,
        "random init instead of the model's weights (implied for presets, which have no weights)",
        train_default=True)


@dataclass
class DataSettings:
    """The token shards and the shape of a batch."""

    train_file: str | None = setting(
        None,
        "glob of token shards (.bin/.parquet, see `python -m llmq_ray.data_pipeline.tokenize`); default: "
        "tiny-shakespeare, tokenized once into ~/.cache/llmq_ray", runtime=True)
    eval_file: str | None = setting(None, "glob of eval shards; default: the eval split of the default data",
                                    runtime=True)
    synthetic_data: bool = setting(False, "train on uniform random tokens (benchmarks; no files)", runtime=True)
    use_ray_data: bool = setting(
        True,
        "read shards in the workers directly instead of through Ray Data",
        negative='--no-ray-data', runtime=True)
    batch_size: int = setting("auto", "micro-batch rows per worker", train_default=4)
    seq_len: int = setting("auto", "tokens per row", train_default=256)
    grad_accumulation: int = setting(1, "micro-steps per optimizer step")
    document_masking: bool = setting(
        False,
        "attention stops at document boundaries inside a packed window: a token attends only to earlier "
        "tokens of its own document (on the GPU: cuDNN's fused forward with a score bias built on the device, "
        "the backward in Triton, skipping the tiles outside each document)")
    document_separator: int | None = setting(
        None,
        "the token that ends each document, for --document-masking; default: the train data's EOS "
        "(its meta.json), else the model's eos_token_id", metavar='ID')
    reset_positions: bool = setting(
        False,
        "with --document-masking: positions restart at 0 at every document start (needed by GPT-2's learned "
        "positions; RoPE models attend by distance, so for them it changes nothing and is implied)")


@dataclass
class OptimSettings:
    """The optimizer and its learning-rate schedule."""

    steps: int = setting("auto", "optimizer steps", train_default=100)
    learning_rate: float = setting("auto", "peak learning rate", flags=("--lr",), short='lr', train_default=0.0003)
    warmup: int = setting(None, "linear warmup steps", train_default=0)
    final_lr_fraction: float = setting(0.1, "final lr as a fraction of the peak")
    lr_schedule: str = setting('cosine', "lr decay after warmup", choices=('cosine', 'linear', 'wsd', 'constant'))
    cooldown_fraction: float = setting(0.2, "wsd schedule: the fraction of the steps spent decaying")
    beta_1: float = setting(0.9, "AdamW beta1")
    beta_2: float = setting(0.95, "AdamW beta2")
    adam_eps: float = setting(1e-08, "AdamW epsilon")
    weight_decay: float = setting(0.1, "AdamW decoupled weight decay (matrices and embeddings)")
    grad_clip: float = setting(1.0, "clip the global L2 gradient norm to this (0: off)")
    seed: int = setting(42, "seed of the init, the data order and stochastic rounding")


@dataclass
class NumericsSettings:
    """The dtypes of weights, GEMMs and optimizer state."""

    model_dtype: str = setting(
        "auto",
        "weights, activations, grads",
        choices=('auto', 'fp32', 'bf16'), train_default='fp32')
    matmul_dtype: str | None = setting(None, "dtype of the block GEMMs", choices=('fp32', 'bf16', 'e4m3'))
    gradient_dtype: str | None = setting(
        None,
        "FP8 backward operands (with --matmul-dtype e4m3)",
        choices=('e4m3', 'e5m2'))
    lmhead_dtype: str | None = setting(
        None,
        "dtype of the LM head's three GEMMs (default: the model dtype; e4m3: FP8, with the loss gradient in e5m2 "
        "written by the classifier; needs --model-dtype bf16)",
        choices=('fp32', 'bf16', 'e4m3'))
    master_dtype: str = setting('fp32', "master weights", choices=('fp32', 'bf16'))
    opt_m_dtype: str = setting('fp32', "AdamW first moment (e4m3: 8 bits with a power-of-two scale per 256)",
                               choices=('fp32', 'bf16', 'e4m3'))
    opt_v_dtype: str = setting('fp32', "AdamW second moment", choices=('fp32', 'bf16'))
    fp8_monitor_every: int = setting(
        0, "e4m3: every N steps, log each layer's largest |SwiGLU output| (the FP8 down projection's input; "
        "JSON log record fp8_monitor, W&B fp8/*); 0: off")
    fp8_delayed_swiglu_scale: bool = setting(
        False,
        "e4m3 (opt-in; kept the loss over 4 seeds of 300 steps): the SwiGLU kernels write the down projection's FP8 input (forward) and the up+gate "
        "gradient (backward) themselves, in one pass, at the scale of the same layer's previous forward / "
        "backward (values beyond it saturate), instead of a separate quantization or a measuring pass (the "
        "forward part needs no recomputation flag); a resumed run measures afresh in its first step, so it is "
        "not bit-exact with the uninterrupted one there")
    fp8_smooth_swiglu: bool = setting(
        False,
        "e4m3 (opt-in, for long runs; not yet checked on a GPU): Smooth-SwiGLU -- divide each channel of the "
        "SwiGLU output by a power of two from its own maximum before the FP8 quantization and fold the factors "
        "back into the down projection exactly, so channels far below a few outliers keep their precision (and "
        "their columns of the weight gradient); costs extra passes over the SwiGLU output and an FP8 copy of the "
        "down projection per micro-step; docs/architecture.md)")


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
    lmhead_chunks: int = setting(1, "run the LM head + loss in N row chunks (less memory)")
    attn_bwd_chunks: int = setting(
        1,
        "run the attention backward over the batch in N chunks (less scratch memory; same result)")
    offload_master: bool = setting(False, "keep the master weights in host memory")
    offload_opt_m: bool = setting(False, "keep Adam's first moment in host memory")
    offload_opt_v: bool = setting(False, "keep Adam's second moment in host memory")
    offload_gradients: bool = setting(
        False,
        "keep the sharded gradient accumulator in host memory (needs --zero-level 2 or 3)")
    offload_residual: bool = setting(
        False,
        "keep the per-layer residual stream saved for the backward in host memory")
    persistent_quants: bool = setting(
        False,
        "with --matmul-dtype e4m3: keep every layer's FP8 weight copies for the whole step (always so "
        "below ZeRO-3; under ZeRO-3 each layer is then gathered once per step instead of every pass)")
    offload_quants: bool = setting(
        False,
        "keep the persistent FP8 weight copies in host memory, fetched one layer ahead (needs "
        "--persistent-quants)")
    transient_quants: bool = setting(
        False,
        "with --matmul-dtype e4m3: make each layer's FP8 weight copies when the layer runs and keep only "
        "two layers' worth (the ZeRO-3 default), also under ZeRO-1/2: saves as many bytes as the bf16 "
        "block weights (13 GiB at 7B) for one weight quantization per layer and pass")
    kept_quants_gib: float | str = setting(
        0.0,
        "with the per-layer FP8 weight copies (--transient-quants, or ZeRO-3's default): keep the copies of the "
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
        "rounding seeds)")


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
        "all-gather between the steps (same results; 2-3% slower at Qwen2.5-0.5B on 2 x H100, so off by default)")
    overlap_tensor_parallel: bool = setting(
        False,
        "--tensor-parallel > 1: start each column-parallel GEMM's input-gradient reduce-scatter as soon as its "
        "dgrad is queued, beside its weight-gradient GEMM (same results; 0.8% slower at Qwen2.5-7B on 2 x H200 in "
        "the one pair measured, so off by default)")
    overlap_wgrad_sms: int = setting(
        0,
        "model-dtype GEMMs: run each block's weight-gradient GEMMs on a side stream sized for SMS SMs, "
        "beside the memory-bound kernels of the backward (H100: 100 of 132; same gradients; default 0: "
        "off)",
        metavar='SMS')
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
        choices=('auto', 'cuda', 'cpu'), runtime=True)
    backend: str = setting(
        "auto",
        "kernels (auto: fastest on GPU, torch on CPU)",
        choices=('auto', 'torch', 'triton', 'cupy'), runtime=True)
    gpus: int = setting(0, "GPUs to train on (0: all GPUs of the Ray cluster)", runtime=True)
    workers: int | None = setting(None, "worker actors (CPU runs; on GPU the same as --gpus)", runtime=True)
    cpus_per_worker: int | None = setting(
        None, "CPU cores reserved per worker (auto: 1 on CPU; on GPU up to 8 of the CPUs free at the start, one "
        "per worker left for Ray Data)", runtime=True)
    zero_level: int = setting(
        1,
        "1: shard optimizer state; 2: + gradients; 3: + weights (gathered per layer, one ahead)",
        choices=(1, 2, 3))
    shard_gradients: bool = setting(False, "shard gradients too (same as --zero-level 2)")
    shard_weights: bool = setting(False, "shard weights too (same as --zero-level 3)")
    tensor_parallel: int = setting(
        1,
        "T: split each block's weights across T workers of one node (attention heads, MLP columns/rows; KV heads "
        "replicated when there are fewer than T); the ZeRO shards split over the workers / T data-parallel ranks",
        metavar="T")
    zero_scope: str = setting(
        "world",
        "world: ZeRO shards over every worker; node: shards within each node and replicates across nodes (one "
        "inter-node all-reduce of the shard; for clusters whose network is slower than NVLink)",
        choices=('world', 'node'))
    ray_address: str | None = setting(None, "address of a running Ray cluster", runtime=True)
    rendezvous_port_range: str | None = setting(
        None,
        "LO-HI: the rendezvous port of the process group is taken from this range on rank 0's node (for firewalled "
        "clusters; default: any free port)",
        metavar="LO-HI", runtime=True)
    socket_ifname: str | None = setting(
        None,
        "network interface the collectives use on every node (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; "
        "default: gloo takes the interface of the IP Ray knows the node by, NCCL chooses itself)",
        runtime=True)
    forward_env: str | None = setting(
        None,
        "comma-separated names of environment variables to pass to every worker, beside those always passed "
        "(AWS_*, GOOGLE_*, AZURE_*, HF_*, NCCL_*, GLOO_*, TORCH_*, WANDB_*, LLMQ_*)",
        runtime=True)


@dataclass
class CheckpointSettings:
    """Checkpoints, resuming and what happens when a worker fails."""

    checkpoint_dir: str | None = setting(None, "where checkpoints go", short='dir', runtime=True)
    ckpt_interval: int = setting(0, "checkpoint every N optimizer steps (0: never)", short='interval', runtime=True)
    ckpt_keep_n: int = setting(
        2,
        "keep the newest N valid checkpoints (1 is allowed but risky)",
        flags=("--ckpt-keep",), short='keep_n', runtime=True)
    ckpt_major: int = setting(
        0,
        "keep the checkpoints of steps that are multiples of N forever (0: none)",
        short='major', runtime=True)
    resume: bool | int | str | None = setting(
        False,
        "resume from the newest valid checkpoint of --checkpoint-dir (incomplete ones are skipped with a "
        "warning), from that step, or from a checkpoint folder; any number of workers",
        flags=("--continue",), metavar='STEP|DIR', nargs="?", const="latest", runtime=True)
    checkpoint_on_exit: bool = setting(
        True,
        "on SIGTERM / SIGINT / SIGHUP stop without writing a checkpoint of the last step (by default one "
        "is written, also with --ckpt-interval 0)", runtime=True)
    allow_batch_change: bool = setting(
        False,
        "--continue on another worker count keeps --grad-accumulation as given instead of adjusting it to "
        "keep the checkpoint's global batch", runtime=True)
    ckpt_minutes: float = setting(
        30.0,
        "also checkpoint every M minutes of training and after the last step (0: off); on by default so that a "
        "lost node or a preempted run never loses more than M minutes", short='minutes', runtime=True)
    max_restarts: int = setting(
        3,
        "after a worker dies or hangs, rebuild the group and resume from the last checkpoint up to N "
        "times", runtime=True)
    elastic: bool = setting(
        False,
        "when fewer workers can be placed than the run had, resume from the last checkpoint on those that can "
        "(resharded; the global batch kept by raising --grad-accumulation) instead of waiting", runtime=True)
    restart_wait_s: float = setting(
        300.0,
        "seconds a restart waits for the cluster to have room for every worker again before giving up "
        "(without --elastic)", runtime=True)
    collective_timeout_s: float = setting(
        300.0,
        "a torch.distributed collective that waits longer than this (seconds) fails its rank", runtime=True)
    call_timeout_s: float = setting(
        1800.0,
        "seconds a worker call other than a step may take (set-up, eval, checkpoints, export)", runtime=True)
    step_timeout_s: float = setting(
        1800.0,
        "a step that takes longer than this (seconds) counts as a hung worker: the group is rebuilt from "
        "the last checkpoint (1800 s is Ray Train's process-group timeout)", runtime=True)
    skip_update_on_spike: bool = setting(
        False,
        "skip the update of a step whose loss or grad-norm z-score exceeds --spike-threshold (spikes are "
        "always logged as warnings)", runtime=True)
    spike_window: int = setting(128, "steps in the spike guard's z-score window", runtime=True)
    spike_threshold: float = setting(6.0, "z-score above which a step is a loss or grad-norm spike", runtime=True)


@dataclass
class ObserveSettings:
    """Evaluation and what the run writes and shows."""

    eval_every_n_steps: int | str = setting("auto", "eval every N steps (0: only at the end)", runtime=True)
    eval_num_steps: int | str = setting(
        "auto",
        "batches per periodic eval (the final eval reads the whole eval file)", runtime=True)
    out_dir: str = setting('out', "folder of the export (out-dir/export) and the log", runtime=True)
    log_file: str | None = setting(None, "the run log, JSON Lines: one record per line as it happens", runtime=True)
    run_id: str | None = setting(
        None,
        "the run's name in the log and as the run_id label of its Ray metrics (default: <UTC time>-<random>)",
        runtime=True)
    wandb_project: str | None = setting(None, "log live to this W&B project (WANDB_MODE honoured)", runtime=True)
    wandb_run_name: str | None = setting(None, "W&B run name", runtime=True)
    log_gpu_util: int = setting(
        0,
        "sample GPU clocks/power/temperature/utilization every N steps into the log (0: off)", runtime=True)
    progress: bool = setting(
        True,
        "no progress bar (it is off anyway when stdout is not a terminal)", runtime=True)
    export: bool = setting(True, "do not write the HF export at the end", runtime=True)
    final_eval: bool = setting(True, "skip the eval over the whole eval file at the end", runtime=True)
    export_dtype: str | None = setting(None, "dtype of the export", choices=('fp32', 'bf16'), runtime=True)
    sample_tokens: int = setting(48, "tokens of the generated sample printed at the end (0: none)", command_only=True)
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


@dataclass(frozen=True)
class Setting:
    """One leaf of the tree, flattened: its section, name, type (as written), default and metadata."""

    section: str
    name: str
    type: str
    default: Any
    meta: dict

    @property
    def short(self) -> str:
        return self.meta["short"] or self.name

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.short}"

    @property
    def dashed(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.type in ("bool", "bool | None")


def sections() -> list[tuple[str, type]]:
    """(section name, its dataclass) in the order of the tree."""
    return [(f.name, f.default_factory) for f in dataclasses.fields(RunSettings)]


def all_settings() -> list[Setting]:
    """Every setting of the tree, section by section."""
    out = []
    for section, cls in sections():
        for f in dataclasses.fields(cls):
            out.append(Setting(section, f.name, f.type if isinstance(f.type, str) else f.type.__name__, f.default,
                               dict(f.metadata)))
    return out


def by_name() -> dict[str, Setting]:
    return {s.name: s for s in all_settings()}


_KINDS = {  # the annotation's words: a test of a value, and how a sentence names them
    "int": (lambda v: isinstance(v, numbers.Integral) and not _is_bool(v), "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not _is_bool(v), "a number"),
    "bool": (lambda v: _is_bool(v), "True or False"),
    "str": (lambda v: isinstance(v, str), "a string"),
}
_FILE_LISTS = ("train_file", "eval_file")  # a list of paths works there too (the data pipeline takes sequences)


def _is_bool(value) -> bool:
    """True / False, and numpy's booleans (a mask's element), which are no ``bool`` subclass."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def plain_path(value):
    """``value`` with an ``os.PathLike`` (a ``pathlib.Path``), alone or in a list, turned into its string: the
    code below takes paths as strings (and URIs: ``s3://...`` is no Path); any other value as it is."""
    import os

    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return type(value)(plain_path(v) for v in value)
    return value


def check_types(values: dict, auto: frozenset = frozenset()) -> None:
    """ConfigError (one sentence naming the flag) for a value of the wrong type or outside the setting's
    choices, for every key of ``values`` that is a setting; other keys are ignored. Paths as strings
    (``plain_path`` first).

    The command line's parser converts and checks its flags itself; this is for the Python API and config
    files, where ``learning_rate="1e-3"`` or ``batch_size = 2.0`` would otherwise surface as a TypeError deep in
    the validation, or pass (``grad_accumulation=True``). A value equal to the setting's default passes (several
    default to None or "auto" whatever their type), and so does "auto" for the settings named in ``auto``
    (those the caller resolves from it: ``warmup``, ``from_scratch``)."""
    from llmq_ray.errors import ConfigError

    known = by_name()
    for name, value in values.items():
        s = known.get(name)
        default = s is not None and type(value) is type(s.default) and value == s.default
        if s is None or default or (value is None and s.default is None) or (name in auto and value == AUTO):
            continue
        kinds = [k.strip() for k in s.type.split("|")]
        ok = any(_KINDS[k][0](value) for k in kinds if k in _KINDS) or (value is None and "None" in kinds)
        wanted = " or ".join(_KINDS[k][1] for k in kinds if k in _KINDS)
        if name in _FILE_LISTS:
            wanted = "a path (a string) or a non-empty list of paths"
            if isinstance(value, (list, tuple)):
                ok = bool(value) and all(isinstance(v, str) for v in value)
        if not ok:
            raise ConfigError(f"{s.dashed}={value!r} must be {wanted}, not {type(value).__name__}.")
        choices = s.meta["choices"]
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{s.dashed}={value!r} must be one of {', '.join(map(str, choices))}.")
