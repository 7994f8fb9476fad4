"""Every rule between settings, written once, grouped by section: ``validate(settings)`` raises one ConfigError
sentence naming the flags for the first combination that makes no sense.

It runs on a resolved tree (llmq_ray/settings/defaults.py: no "auto" left where a rule reads a number), before
Ray starts; the model and the engine only assert what these rules already guarantee. The rules that need the
model's config (its sizes, its family) are the train layer's (llmq_ray/train/model_checks.py and the trainer's
pre-flight); the range of a single field comes from its metadata (``ge``, ``gt``, ...).

Sentences name command-line flags (``--zero-level``); ``LLMQTrainer`` rewrites them into its keywords for API
callers (``api_names``).
"""

from __future__ import annotations

import re

from llmq_ray.errors import ConfigError
from llmq_ray.settings.fields import AUTO, check_range
from llmq_ray.settings.tree import RunSettings


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _gib_or_auto(value) -> bool:
    """A --kept-quants-gib / --opt-resident-gib value: a finite number >= 0 (GiB) or "auto"."""
    import math

    if value == AUTO:
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def validate(s: RunSettings) -> RunSettings:
    """Check every field's range, then every rule, section by section; returns ``s``."""
    from llmq_ray.settings import all_settings

    for f in all_settings():
        check_range(f, getattr(getattr(s, f.section), f.name))
    for rule in (data_rules, optim_rules, numerics_rules, memory_rules, speed_rules, parallel_rules,
                 checkpoint_rules, observe_rules):
        rule(s)
    return s


def data_rules(s: RunSettings) -> None:
    d = s.data
    _need(d.document_separator is None or d.document_masking,
          f"--document-separator={d.document_separator} needs --document-masking (alone it does nothing).")
    _need(not d.reset_positions or d.document_masking,
          "--reset-positions needs --document-masking: positions restart at document starts.")
    _need(not (d.synthetic_data and d.train_file),
          f"--synthetic-data and --train-file={d.train_file} both say what to train on; pass one of them.")
    m = s.memory
    n = d.batch_size * d.seq_len
    _need(n % m.lmhead_chunks == 0, f"--lmhead-chunks={m.lmhead_chunks} must divide --batch-size x --seq-len = {n}.")
    _need(d.batch_size % m.attn_bwd_chunks == 0,
          f"--attn-bwd-chunks={m.attn_bwd_chunks} must divide --batch-size={d.batch_size}.")


def optim_rules(s: RunSettings) -> None:
    from llmq_ray.lr_schedule import learning_rate_at

    o = s.optim
    # the schedule's own checks (--warmup in [0, --steps), wsd cooldown room)
    learning_rate_at(0, base_lr=o.learning_rate, total_steps=o.steps, warmup_steps=o.warmup, schedule=o.lr_schedule,
                     final_lr_fraction=o.final_lr_fraction, cooldown_fraction=o.cooldown_fraction)


def numerics_rules(s: RunSettings) -> None:
    n, fp8 = s.numerics, s.numerics.matmul_dtype == "e4m3"
    _need(not (n.model_dtype == "fp32" and n.master_dtype == "bf16"),
          "--master-dtype=bf16 with --model-dtype=fp32 makes no sense: the master copy would be less precise than "
          "the weights it updates; use --master-dtype=fp32.")
    _need(n.matmul_dtype in (None, n.model_dtype, "bf16", "e4m3"),
          f"--matmul-dtype={n.matmul_dtype!r} must be the model dtype or e4m3.")
    _need(n.matmul_dtype != "bf16" or n.model_dtype == "bf16", "--matmul-dtype=bf16 needs --model-dtype=bf16.")
    _need(n.gradient_dtype is None or fp8, f"--gradient-dtype={n.gradient_dtype} only applies with --matmul-dtype=e4m3.")
    _need(not fp8 or n.model_dtype == "bf16", "--matmul-dtype=e4m3 needs --model-dtype=bf16.")
    _need(n.lmhead_dtype in (None, AUTO, n.model_dtype, "e4m3"),
          f"--lmhead-dtype={n.lmhead_dtype!r} must be the model dtype or e4m3.")
    _need(n.lmhead_dtype != "e4m3" or n.model_dtype == "bf16", "--lmhead-dtype=e4m3 needs --model-dtype=bf16.")
    scale = n.swiglu_fp8_scale
    _need(scale in (AUTO, "current") or fp8,
          f"--swiglu-fp8-scale {scale} needs --matmul-dtype e4m3: it sets how an FP8 GEMM's input is scaled.")
    _need(not (scale == "smooth" and s.speed.use_cuda_graphs),
          "--swiglu-fp8-scale smooth does not run under --use-cuda-graphs yet (the pair has not been run on a GPU).")
    _need(n.fp8_monitor_every == 0 or fp8,
          "--fp8-monitor-every needs --matmul-dtype e4m3: it reports the scales of the FP8 down projection.")
    _need(not (n.opt_m_dtype == "e4m3" and s.memory.offload_opt_m),
          "--opt-m-dtype=e4m3 cannot be combined with --offload-opt-m: the 8-bit first moment (1 byte per "
          "parameter) is meant to stay on the GPU.")


def copies_placement(s: RunSettings) -> str:
    """Where the FP8 weight copies live: ``--fp8-weight-copies``, its "auto" read as what it resolves to
    (persistent below ZeRO-3, per layer under it)."""
    copies = s.memory.fp8_weight_copies
    if copies == AUTO:
        return "persistent" if s.parallel.zero_level < 3 else "layer"
    return copies


def memory_rules(s: RunSettings) -> None:
    m, n, zero = s.memory, s.numerics, s.parallel.zero_level
    _need(not m.offload_master or n.master_dtype != n.model_dtype,
          f"--offload-master needs a separate master copy, but --master-dtype={n.master_dtype} equals --model-dtype "
          f"(the weights are the master); use --model-dtype bf16 --master-dtype fp32.")
    _need(not m.offload_gradients or zero >= 2,
          "--offload-gradients needs --zero-level 2 or 3: under ZeRO-1 the gradient buffer is the backward's scratch "
          "and stays on the device.")
    _need(not m.use_zero_copy or m.offloads_optimizer or m.offload_gradients,
          "--use-zero-copy only applies with --offload-master, --offload-opt-m, --offload-opt-v or "
          "--offload-gradients (it lets the optimizer kernel read that host memory directly).")
    copies = m.fp8_weight_copies
    _need(copies == AUTO or n.matmul_dtype == "e4m3",
          f"--fp8-weight-copies {copies} only applies with --matmul-dtype e4m3 (it places the FP8 weight copies).")
    k, g = m.kept_quants_gib, m.opt_resident_gib
    _need(_gib_or_auto(k), f"--kept-quants-gib={k!r} must be a number >= 0 or 'auto'.")
    _need(not k or (n.matmul_dtype == "e4m3" and copies_placement(s) == "layer"),
          "--kept-quants-gib only applies to per-layer FP8 weight copies (--matmul-dtype e4m3 with "
          "--fp8-weight-copies layer, the ZeRO-3 default).")
    _need(_gib_or_auto(g), f"--opt-resident-gib={g!r} must be a number >= 0 or 'auto'.")
    _need(not (k == AUTO and g == AUTO),
          "--kept-quants-gib auto and --opt-resident-gib auto both ask for the memory set-up leaves free (the first "
          "would take it all); give one of them a number of GiB.")
    _need(not g or m.offloads_optimizer,
          "--opt-resident-gib only applies with --offload-master, --offload-opt-m or --offload-opt-v (it keeps part "
          "of the offloaded state on the device).")
    _need(not g or not (m.offload_gradients or m.use_zero_copy),
          "--opt-resident-gib cannot be combined with --offload-gradients or --use-zero-copy (their chunks stream "
          "through the device anyway).")


def speed_rules(s: RunSettings) -> None:
    sp, m, zero = s.speed, s.memory, s.parallel.zero_level
    _need(not sp.use_cuda_graphs or (zero < 2 and not m.offload_residual and m.fp8_weight_copies != "host"),
          f"--use-cuda-graphs cannot capture --zero-level {zero if zero > 1 else '2/3'}, --offload-residual or "
          "--fp8-weight-copies host (their per-layer copies and collectives run on side streams); drop one of them.")
    _need(not sp.use_cuda_graphs or s.numerics.matmul_dtype != "e4m3" or copies_placement(s) != "layer",
          "--use-cuda-graphs cannot capture --fp8-weight-copies layer (which layers need quantizing is decided on "
          "the host at every pass); drop one of them.")
    _need(not sp.overlap_wgrad_sms or s.numerics.matmul_dtype in (None, s.numerics.model_dtype),
          f"--overlap-wgrad-sms runs the model-dtype weight-gradient GEMMs beside the backward; it does not apply "
          f"with --matmul-dtype={s.numerics.matmul_dtype}.")
    _need(not sp.overlap_wgrad_sms or zero < 2,
          f"--overlap-wgrad-sms cannot be combined with --zero-level {zero} (which reduces each layer's gradients as "
          "soon as its backward ends, before a side-stream wgrad would be done).")
    _need(not sp.overlap_wgrad_sms or not m.offload_residual,
          "--overlap-wgrad-sms is not verified with --offload-residual (whose fetches run on their own side "
          "stream); drop one of them.")


def parallel_rules(s: RunSettings) -> None:
    p, sp = s.parallel, s.speed
    t = p.tensor_parallel
    if t > 1:
        for bad, what in ((sp.use_cuda_graphs, "--use-cuda-graphs"), (s.memory.offload_gradients, "--offload-gradients"),
                          (sp.overlap_comm, "--overlap-comm"), (bool(sp.overlap_wgrad_sms), "--overlap-wgrad-sms"),
                          (p.zero_scope == "node", "--zero-scope node")):
            _need(not bad, f"--tensor-parallel={t} does not run with {what} yet; drop one of them.")
        n = s.data.batch_size * s.data.seq_len
        _need(n % t == 0, f"--tensor-parallel={t} must divide --batch-size x --seq-len = {n} (sequence parallelism "
                          "splits a micro-batch's tokens over the group).")
    _need(not (p.device == "cpu" and p.gpus), f"--gpus={p.gpus} with --device=cpu: use --workers for CPU workers.")
    _need(not (p.device == "cpu" and p.backend not in (AUTO, "torch")),
          f"--backend={p.backend} needs a GPU; on --device=cpu use --backend=torch.")
    _need(not (p.device == "cpu" and sp.use_cuda_graphs),
          "--use-cuda-graphs needs --device=cuda (GPU workers); drop it for CPU runs.")
    port_range(p.rendezvous_port_range)
    for name in forward_env_names(p.forward_env):
        _need(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None,
              f"--forward-env: {name!r} is not the name of an environment variable; the flag takes names, "
              f"comma-separated (their values are the driver's).")


def checkpoint_rules(s: RunSettings) -> None:
    pass  # every checkpoint setting is checked by its own range; resuming is checked against the files


def observe_rules(s: RunSettings) -> None:
    r = s.observe.run_id
    _need(r is None or (isinstance(r, str) and re.fullmatch(r"[A-Za-z0-9._-]{1,64}", r) is not None),
          f"--run-id={r!r} must be 1-64 letters, digits, '.', '_' or '-' (it becomes a metric label).")


def port_range(text) -> tuple | None:
    """``"29500-29599"`` -> (29500, 29599); None stays None; ConfigError naming the flag otherwise."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(text))
    _need(bool(m) and 1024 <= int(m.group(1)) <= int(m.group(2)) <= 65535,
          f"--rendezvous-port-range={text!r} must be two ports LO-HI with 1024 <= LO <= HI <= 65535 (e.g. 29500-29599).")
    return int(m.group(1)), int(m.group(2))


def forward_env_names(names) -> list[str]:
    """The variable names of --forward-env (comma-separated, blanks ignored)."""
    return [n.strip() for n in (names or "").split(",") if n.strip()]


# flags whose keyword argument is not the flag's name with underscores
_FLAG_TO_KWARG = {"continue": "resume", "lr": "learning_rate", "ckpt-keep": "ckpt_keep_n",
                  "no-ray-data": "use_ray_data=False", "no-export": "export=False",
                  "no-checkpoint-on-exit": "checkpoint_on_exit=False", "no-overlap-update": "overlap_update=False",
                  "no-progress": "progress=False", "elastic": "elastic=True"}
_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


def api_names(message: str, known: set[str]) -> str:
    """``message`` with each ``--flag`` that maps onto a keyword in ``known`` written as that keyword
    (``--warmup=5`` -> ``warmup=5``); text inside backticks (a command to run) is left alone."""
    def one(m: re.Match) -> str:
        flag = m.group(1)
        kw = _FLAG_TO_KWARG.get(flag, flag.replace("-", "_"))
        return kw if kw.split("=")[0] in known else m.group(0)

    parts = message.split("`")
    return "`".join(_FLAG.sub(one, p) if i % 2 == 0 else p for i, p in enumerate(parts))
