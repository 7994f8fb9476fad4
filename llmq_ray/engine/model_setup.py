"""What the engine builds from the run's settings before it trains: the kernel backend with the components the
settings ask for (``make_backend``), and the model's build description and policies (``model_build``) -- the one
place where settings are read for the model, so the model itself knows no settings, flags or parallelism.
"""

from __future__ import annotations

import functools

from llmq_ray.backends.base import Backend
from llmq_ray.engine.offload import HostWeightCopies, OffloadedResiduals
from llmq_ray.engine.schedule import Schedule
from llmq_ray.errors import ConfigError
from llmq_ray.model.build import ModelBuild, ModelPolicies, Recompute
from llmq_ray.model.config import ModelConfig
from llmq_ray.parallel.tensor_pieces import TensorParallel
from llmq_ray.settings import RunSettings
from llmq_ray.settings.rules import copies_placement


def backend_components(settings: RunSettings) -> dict:
    """The backend components the options ask for (backends/base.py): the GEMM provider (--gemm; None = the
    backend's default), the attention provider and GEMM timing. A bit-reproducible run (--deterministic-attention)
    takes the deterministic attention backward and GEMM algorithms that do not depend on timings."""
    return dict(gemm=settings.speed.gemm, attention="deterministic" if settings.speed.deterministic_attention else "sdpa",
                gemm_tuning=not settings.speed.deterministic_attention)


def make_backend(name: str, settings: RunSettings, device) -> Backend:
    """The kernel backend ``name`` on ``device`` with the components ``settings`` ask for."""
    from llmq_ray.backends import get_backend

    return get_backend(name, device, **backend_components(settings))


def model_build(settings: RunSettings, cfg: ModelConfig, schedule: Schedule,
                tensor_parallel=None) -> tuple[ModelBuild, ModelPolicies]:
    """What the model is built for (``ModelBuild``) and what the engine applies to it from outside
    (``ModelPolicies``: the offloaded residual stream, host-kept FP8 weight copies, the tensor-parallel plan), from
    the run's settings: the one place where the engine reads settings for the model (llmq_ray/model/build.py).

    Where the settings were not resolved (llmq_ray/settings/defaults.py), "auto" FP8 weight copies are persistent
    below ZeRO-3 and per layer under it, and an "auto" SwiGLU FP8 scale is the current one. The document separator: the settings', else (an engine built directly) the
    model's EOS token."""
    data, memory, numerics = settings.data, settings.memory, settings.numerics
    scale = numerics.swiglu_fp8_scale  # "auto" unresolved: the current scale
    copies = copies_placement(settings)
    separator = None
    if data.document_masking:
        separator = data.document_separator if data.document_separator is not None else cfg.eos_token_id
        if separator is None:
            raise ConfigError("document masking needs a separator token: neither the settings nor the model's config "
                              "name one (no EOS token).")
        separator = int(separator)
    build = ModelBuild(batch=data.batch_size, seq=data.seq_len, dtype=numerics.torch_dtype,
                       recompute=Recompute(swiglu=memory.recompute_swiglu, norm=memory.recompute_norm,
                                           ffn=memory.recompute_ffn, qkv=memory.recompute_qkv,
                                           att=memory.recompute_att, block=memory.recompute_block), block_dtype=numerics.matmul_dtype,
                       grad_fp8=numerics.gradient_dtype,
                       weight_copies="persistent" if copies == "host" else copies,
                       swiglu_scale="current" if scale == "auto" else scale, head_chunks=memory.lmhead_chunks,
                       head_dtype="e4m3" if numerics.lmhead_dtype == "e4m3" else None,
                       attention_chunks=memory.attn_bwd_chunks, separator=separator,
                       restart_positions=data.reset_positions)
    policies = ModelPolicies(
        residuals=(functools.partial(OffloadedResiduals, stream=schedule.stream("residual"))
                   if memory.offload_residual else None),
        block_linears=(functools.partial(HostWeightCopies, stream=schedule.stream("fp8-copies"))
                       if copies == "host" else None),
        plan=TensorParallel(tensor_parallel) if tensor_parallel is not None else None)
    return build, policies
