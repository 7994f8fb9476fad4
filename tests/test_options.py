"""Flag combinations that make no sense end in one ConfigError naming the flag(s)."""

import pytest

from llmq_ray.backends import get_backend
from llmq_ray.model.config import PRESETS
from llmq_ray.errors import ConfigError
from llmq_ray.model import build_model
from llmq_ray.model.build import Recompute
from _helpers import checked_settings, train_settings

BAD = [
    (dict(batch_size=0), "--batch-size=0"),
    (dict(grad_accumulation=-1), "--grad-accumulation=-1"),
    (dict(seq_len=1), "--seq-len=1"),
    (dict(model_dtype="fp16"), "--model-dtype='fp16'"),
    (dict(master_dtype="bf16", model_dtype="fp32"), "--master-dtype=bf16 with --model-dtype=fp32"),
    (dict(opt_m_dtype="int8"), "--opt-m-dtype='int8'"),
    (dict(matmul_dtype="e4m3", model_dtype="fp32"), "--matmul-dtype=e4m3 needs --model-dtype=bf16"),
    (dict(gradient_dtype="e5m2"), "--gradient-dtype=e5m2 only applies with --matmul-dtype=e4m3"),
    (dict(lmhead_dtype="e4m3", model_dtype="fp32"), "--lmhead-dtype=e4m3 needs --model-dtype=bf16"),
    (dict(lmhead_dtype="e5m2", model_dtype="bf16"), "--lmhead-dtype='e5m2' must be one of"),
    (dict(zero_level=4), "--zero-level=4"),
    (dict(grad_clip=-1.0), "--grad-clip=-1.0"),
    (dict(beta_2=1.0), "--beta-2=1.0"),
    (dict(opt_m_dtype="e4m3", offload_opt_m=True), "--opt-m-dtype=e4m3 cannot be combined with --offload-opt-m"),
    (dict(fp8_monitor_every=5), "--fp8-monitor-every needs --matmul-dtype e4m3"),
    (dict(fp8_monitor_every=-1, model_dtype="bf16", matmul_dtype="e4m3"), "--fp8-monitor-every=-1 must be an integer >= 0"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_nonsense_flags_raise_one_clear_error(kwargs, message):
    with pytest.raises(ConfigError) as info:
        checked_settings(**kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_defaults_are_valid():
    checked_settings()


def test_recompute_implications():
    assert Recompute(ffn=True).resolved().swiglu
    assert Recompute(att=True).resolved().qkv
    block = Recompute(block=True).resolved()
    assert all(getattr(block, f) for f in ("swiglu", "norm", "ffn", "qkv", "att"))


def test_lmhead_chunks_must_divide_rows_and_seq_len_must_fit():
    cfg = PRESETS["tiny"]
    with pytest.raises(ConfigError, match="--lmhead-chunks=3 must divide --batch-size x --seq-len = 32"):
        checked_settings(model="tiny", batch_size=2, seq_len=16, lmhead_chunks=3)
    with pytest.raises(ValueError, match="3 LM-head chunks must be >= 1 and divide the 32 rows"):  # the model's own
        build_model(cfg, get_backend("torch"), batch=2, seq=16, head_chunks=3)
    with pytest.raises(ValueError, match="a window of 4096 tokens is longer than the model's"):
        build_model(cfg, get_backend("torch"), batch=1, seq=4096)


def test_unknown_backend_and_preset_are_clear_errors():
    from llmq_ray.model.config import resolve_model

    with pytest.raises(ConfigError, match="--backend='nope' is not a known backend"):
        get_backend("nope")
    with pytest.raises(ConfigError, match="model 'no-such-model' is neither a preset"):
        resolve_model("no-such-model")
