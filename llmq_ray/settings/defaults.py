"""The values of the "auto" defaults, resolved in one place for the machine a run is for.

A setting whose default is ``"auto"`` (or None, for the two derived ones) depends on the machine or on other
settings; ``resolve`` returns the tree with each such value made concrete, so everything after it reads plain
values:

* ``MACHINE_DEFAULTS[machine]``: a short tiny-model run on a CPU, Qwen2.5-0.5B in bf16 on a GPU (model, batch
  shape, steps, learning rate, model dtype, the eval cadence);
* ``from_scratch``: yes for a preset (which has no weights), no for an HF folder or id; ``warmup``: steps // 10,
  at most 100;
* the FP8 recipe of ``--matmul-dtype e4m3`` (the fastest that passed its loss checks): the LM head in FP8 too
  (``lmhead_dtype``), the delayed SwiGLU scale for SwiGLU models (``swiglu_fp8_scale``), the FP8 weight copies
  persistent below ZeRO-3 and per layer under it (``fp8_weight_copies``); each turned off by naming another value;
* a matmul or LM-head dtype equal to the model dtype means "the model dtype" (None).

What is resolved only once Ray knows the cluster (device, backend, workers, CPUs per worker) is the trainer's
(llmq_ray/train/trainer.py); what the GPU's free memory decides (``--kept-quants-gib auto``) the worker's.
"""

from __future__ import annotations

import copy

from llmq_ray.settings.fields import AUTO
from llmq_ray.settings.tree import RunSettings

MACHINE_DEFAULTS = {
    "cpu": dict(model="tiny-qwen", batch_size=4, seq_len=128, steps=20, learning_rate=3e-3, model_dtype="fp32",
                eval_every_n_steps=10, eval_num_steps=2),
    "cuda": dict(model="Qwen2.5-0.5B", batch_size=8, seq_len=1024, steps=100, learning_rate=6e-4,
                 model_dtype="bf16", eval_every_n_steps=25, eval_num_steps=8),
}
# tokens of the default data's eval split (tiny-shakespeare), per machine
DEFAULT_EVAL_TOKENS = {"cpu": 8192, "cuda": 32768}
# how the rest of the auto values follow from the others (shown in the CLI's help)
DERIVED = {
    "from_scratch": "auto: yes for a preset (which has no weights), no for an HF folder or id",
    "warmup": "auto: steps // 10, at most 100",
}


def resolve(settings: RunSettings, machine: str, *, presets=(), has_eval_file: bool | None = None,
            swiglu_mlp: bool | None = None) -> RunSettings:
    """A copy of ``settings`` with every "auto" resolved for ``machine`` ("cpu" or "cuda"). ``presets``: the
    preset model names (``from_scratch``); ``has_eval_file``: periodic evals only with one; ``swiglu_mlp``: the
    model's MLP is SwiGLU (the delayed SwiGLU scale is for it; GPT-2's GELU MLP is not). The eval cadence and
    the FP8 recipe stay "auto" while ``has_eval_file`` / ``swiglu_mlp`` are None (not known yet): the trainer
    resolves in two passes, before and after the data and the model's config are known."""
    s = copy.deepcopy(settings)
    auto = MACHINE_DEFAULTS[machine]
    m, d, o, n, mem, ob = s.model, s.data, s.optim, s.numerics, s.memory, s.observe
    for section, name in ((m, "model"), (d, "batch_size"), (d, "seq_len"), (o, "steps"), (o, "learning_rate"),
                          (n, "model_dtype")):
        if getattr(section, name) == AUTO:
            setattr(section, name, auto[name])
    if m.from_scratch in (None, AUTO):
        m.from_scratch = m.model in presets
    if o.warmup in (None, AUTO):
        o.warmup = min(o.steps // 10, 100) if isinstance(o.steps, int) and not isinstance(o.steps, bool) else 0
    if ob.eval_every_n_steps == AUTO and has_eval_file is not None:
        ob.eval_every_n_steps = auto["eval_every_n_steps"] if has_eval_file else 0
    if ob.eval_num_steps == AUTO:
        ob.eval_num_steps = auto["eval_num_steps"]
    if n.matmul_dtype == n.model_dtype:
        n.matmul_dtype = None
    fp8 = n.matmul_dtype == "e4m3"
    if n.lmhead_dtype == AUTO and swiglu_mlp is not None:
        n.lmhead_dtype = "e4m3" if fp8 and n.model_dtype == "bf16" else None
    if n.lmhead_dtype == n.model_dtype:
        n.lmhead_dtype = None
    if fp8 and n.swiglu_fp8_scale == AUTO and swiglu_mlp is not None:
        n.swiglu_fp8_scale = "delayed" if swiglu_mlp else "current"
    if fp8 and mem.fp8_weight_copies == AUTO:
        mem.fp8_weight_copies = "persistent" if s.parallel.zero_level < 3 else "layer"
    return s


def auto_help() -> dict:
    """{setting: what its "auto" means} for the command line's help."""
    out = {k: f"auto: {MACHINE_DEFAULTS['cpu'][k]} on CPU, {MACHINE_DEFAULTS['cuda'][k]} on GPU"
           for k in ("model", "batch_size", "seq_len", "steps", "learning_rate", "model_dtype", "eval_num_steps")}
    cpu, gpu = MACHINE_DEFAULTS["cpu"]["eval_every_n_steps"], MACHINE_DEFAULTS["cuda"]["eval_every_n_steps"]
    out["eval_every_n_steps"] = f"auto: {cpu} on CPU, {gpu} on GPU (0 without an eval file)"
    out.update(DERIVED)
    return out
