"""The math of one model replica: its configuration, the flat parameter layout and typed per-layer views, the
explicit forward and backward over preallocated buffers (the shared decoder, one module per family, the pieces
under ``layers/``), Hugging Face import and export, generation and the tokenizer files an export carries.

Nothing here knows about streams, ZeRO, offloading, tensor parallelism or Ray: the model declares its units
(embedding, each block, the LM head) and pieces, and the engine hands it, once, the policies it applies over them
(``ModelPolicies``, llmq_ray/model/build.py). Imports only the kernel backends and the leaf modules.

``build_model(cfg, backend, build)`` makes the model of ``cfg``'s family (``FAMILIES``, by ``cfg.family``).
"""

from __future__ import annotations


def _families() -> dict:
    from llmq_ray.model.gpt2 import GPT2Model
    from llmq_ray.model.llama import LlamaModel

    return {"llama": LlamaModel, "gpt2": GPT2Model}


def family_of(cfg):
    """The model class of ``cfg``'s architecture: GPT-2's, or the Llama family's (Llama, Qwen2, Qwen3)."""
    return _families()["gpt2" if cfg.is_gpt2 else "llama"]


def build_model(cfg, backend, build=None, *, params=None, grads=None, weights=None, schedule=None, policies=None,
                **fields):
    """The model of ``cfg``'s family for ``build`` (a ``ModelBuild``; or, without one, its fields as keywords:
    ``build_model(cfg, backend, batch=2, seq=16, dtype=torch.bfloat16)``)."""
    from llmq_ray.model.build import ModelBuild

    if build is None:
        build = ModelBuild(**fields)
    elif fields:
        raise TypeError(f"build_model: a ModelBuild and its fields {sorted(fields)} both given")
    return family_of(cfg)(cfg, backend, build, params=params, grads=grads, weights=weights, schedule=schedule,
                          policies=policies)
