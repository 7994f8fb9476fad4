"""The defaults of a run, in one place: ``LLMQTrainer`` applies them and the CLI shows them.

Two sources, each read by both the API and the CLI (the CLI holds no default of its own: a flag the user
does not give is not passed on, and its help text prints the value from here):

* the settings tree (llmq_ray/settings.py): every setting's default, which ``TrainOptions`` and
  ``LLMQTrainer.__init__``'s keywords take (a test keeps the keywords equal to the tree);
* ``MACHINE_DEFAULTS`` for the values that say "auto": they depend on the machine (a short tiny-model run on
  a CPU, Qwen2.5-0.5B in bf16 on a GPU), and ``resolve_option_fields`` fills them in.

``api_names`` turns the flag names in an error sentence (``--warmup=5``) into the keyword arguments of the
API (``warmup=5``), so a user of ``LLMQTrainer(...)`` reads the names they wrote.
"""

from __future__ import annotations

import dataclasses
import re

from llmq_ray.options import TrainOptions

AUTO = "auto"

# the machine-dependent values of the "auto" defaults (TrainOptions fields and two eval settings)
MACHINE_DEFAULTS = {
    "cpu": dict(model="tiny-qwen", batch_size=4, seq_len=128, steps=20, learning_rate=3e-3, model_dtype="fp32",
                eval_every_n_steps=10, eval_num_steps=2, eval_tokens=8192),
    "cuda": dict(model="Qwen2.5-0.5B", batch_size=8, seq_len=1024, steps=100, learning_rate=6e-4,
                 model_dtype="bf16", eval_every_n_steps=25, eval_num_steps=8, eval_tokens=32768),
}
AUTO_OPTION_FIELDS = ("model", "batch_size", "seq_len", "steps", "learning_rate", "model_dtype")
OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(TrainOptions))

# how the rest of the auto values follow from the others (shown in the CLI's help)
DERIVED = {
    "from_scratch": "auto: yes for a preset (which has no weights), no for an HF folder or id",
    "warmup": "auto: steps // 10, at most 100",
}


def resolve_option_fields(given: dict, device: str) -> TrainOptions:
    """A TrainOptions from the fields the caller gave; the rest from TrainOptions' defaults, except the
    "auto" ones (``AUTO_OPTION_FIELDS`` from ``MACHINE_DEFAULTS[device]``, ``from_scratch`` and ``warmup``
    derived as ``DERIVED`` says). A matmul dtype equal to the model dtype means "the model dtype"."""
    auto = MACHINE_DEFAULTS[device]
    fields = {k: v for k, v in given.items() if not (k in AUTO_OPTION_FIELDS + tuple(DERIVED) and v == AUTO)}
    for k in AUTO_OPTION_FIELDS:
        fields.setdefault(k, auto[k])
    if fields.get("from_scratch") is None:
        from llmq_ray.model.config import PRESETS

        fields["from_scratch"] = fields["model"] in PRESETS
    if fields.get("warmup") is None:
        fields["warmup"] = min(int(fields["steps"]) // 10, 100) if isinstance(fields["steps"], int) else 0
    opts = TrainOptions(**fields)
    if opts.matmul_dtype == opts.model_dtype:
        opts.matmul_dtype = None
    if opts.lmhead_dtype == opts.model_dtype:
        opts.lmhead_dtype = None
    return opts


def resolve_eval(eval_every_n_steps, eval_num_steps, has_eval_file: bool, device: str) -> tuple:
    """(eval_every_n_steps, eval_num_steps) with "auto" resolved: periodic evals only with an eval file."""
    auto = MACHINE_DEFAULTS[device]
    every = (auto["eval_every_n_steps"] if has_eval_file else 0) if eval_every_n_steps == AUTO else eval_every_n_steps
    num = auto["eval_num_steps"] if eval_num_steps == AUTO else eval_num_steps
    return every, num


def api_defaults() -> dict:
    """{keyword argument: default} of ``LLMQTrainer(...)`` as the settings tree (llmq_ray/settings.py) defines
    them, with the auto ones described (for the CLI's help)."""
    from llmq_ray.settings import all_settings

    out = {s.name: s.default for s in all_settings()}
    for k in AUTO_OPTION_FIELDS:
        out[k] = (f"auto: {MACHINE_DEFAULTS['cpu'][k]} on CPU, {MACHINE_DEFAULTS['cuda'][k]} on GPU")
    out.update(DERIVED)
    for k in ("eval_every_n_steps", "eval_num_steps"):
        cpu, gpu = MACHINE_DEFAULTS["cpu"][k], MACHINE_DEFAULTS["cuda"][k]
        out[k] = f"auto: {cpu} on CPU, {gpu} on GPU" + (" (0 without an eval file)" if k == "eval_every_n_steps" else "")
    return out


# flags whose keyword argument is not the flag's name with underscores
_FLAG_TO_KWARG = {"continue": "resume", "lr": "learning_rate", "ckpt-keep": "ckpt_keep_n",
                  "no-ray-data": "use_ray_data=False", "no-export": "export=False",
                  "no-checkpoint-on-exit": "checkpoint_on_exit=False", "no-overlap-update": "overlap_update=False",
                  "no-progress": "progress=False", "shard-weights": "shard_weights",
                  "elastic": "elastic=True"}
_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


def api_names(message: str, known: set[str]) -> str:
    """``message`` with each ``--flag`` that maps onto a keyword argument in ``known`` written as that
    keyword (``--warmup=5`` -> ``warmup=5``); text inside backticks (a command to run) is left alone."""
    def one(m: re.Match) -> str:
        flag = m.group(1)
        kw = _FLAG_TO_KWARG.get(flag, flag.replace("-", "_"))
        return kw if kw.split("=")[0] in known else m.group(0)

    parts = message.split("`")
    return "`".join(_FLAG.sub(one, p) if i % 2 == 0 else p for i, p in enumerate(parts))
