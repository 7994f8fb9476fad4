"""The presets against the published config.json of each model (tests/data/hf_configs/<preset>/config.json, see
the README there): loading the file builds the preset exactly. Also: rope_scaling types that would be silently
wrong are refused in one sentence."""

from pathlib import Path

import pytest

from llmq_ray.errors import ConfigError
from llmq_ray.model.config import PRESETS, config_from_hf_dict, load_hf_config

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
PUBLISHED = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())


def test_the_published_configs_cover_qwen3_and_llama31():
    assert {"Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Llama-3.1-8B", "Llama-3.2-1B",
            "Llama-3.2-3B"} <= set(PUBLISHED)


@pytest.mark.parametrize("name", PUBLISHED)
def test_loading_the_published_config_builds_the_preset(name):
    assert load_hf_config(str(CONFIGS / name)) == PRESETS[name]


def test_llama31_rope_scaling_is_read_and_changes_only_the_low_frequencies():
    cfg = PRESETS["Llama-3.1-8B"]
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    plain = config_from_hf_dict({**cfg.to_hf_dict(), "rope_scaling": None}).rope_inv_freq()
    scaled = cfg.rope_inv_freq()
    assert (scaled[:8] == plain[:8]).all()  # short wavelengths (< 8192 / 4 positions) untouched
    assert (scaled[-4:] == plain[-4:] / 8.0).all()  # long wavelengths (> 8192 positions) divided by the factor


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling of type 'dynamic' is not supported"),
    ({"type": "yarn", "factor": 4.0}, "rope_scaling of type 'yarn' is not supported"),
    ({"rope_type": "linear"}, "needs a positive 'factor'"),
])
def test_rope_scaling_we_cannot_honour_is_refused(scaling, words):
    with pytest.raises(ConfigError, match=words):
        config_from_hf_dict({**PRESETS["tiny-llama"].to_hf_dict(), "rope_scaling": scaling})
