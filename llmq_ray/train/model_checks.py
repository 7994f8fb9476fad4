"""The rules between the settings and the model's family, checked before Ray starts: one sentence each.

These need the model's config (its family), so they cannot live with the other rules in llmq_ray/settings/rules.py,
which know only the settings; the model itself asserts the same conditions without naming flags.
"""

from __future__ import annotations

from llmq_ray.errors import ConfigError
from llmq_ray.model.config import ModelConfig
from llmq_ray.settings import RunSettings


def check_model_settings(cfg: ModelConfig, s: RunSettings) -> None:
    """ConfigError for a setting the model's family does not take."""
    if not cfg.is_gpt2:
        return
    if s.parallel.tensor_parallel > 1:
        raise ConfigError("--tensor-parallel does not take GPT-2 yet.")
    if s.data.document_masking and not s.data.reset_positions:
        raise ConfigError("--document-masking with GPT-2 needs --reset-positions: its learned positions must restart "
                          "at every document start for a document to be computed as if alone.")
    scale = s.numerics.swiglu_fp8_scale
    if scale in ("delayed", "smooth"):
        raise ConfigError(f"--swiglu-fp8-scale {scale} is for the SwiGLU MLP; GPT-2's GELU MLP does not take it.")
    if s.speed.overlap_wgrad_sms:
        raise ConfigError("--overlap-wgrad-sms is built for the Llama-family block; GPT-2 does not take it yet.")
