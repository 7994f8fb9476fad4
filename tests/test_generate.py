"""KV-cache generation (llmq_ray.model.generate) against transformers and against our own no-cache forward.

Tiny random Qwen2 (tied head, QKV bias), Qwen3 (QK-norm, head_dim 24 != 64 / 4) and Llama (untied head, llama3
rope scaling) models with GQA, in fp32, weights ~ N(0, 0.15) (embeddings and head 0.05) and norm weights away from 1 so that greedy continuations vary.
They are saved with ``save_pretrained`` and read back with ``load_for_generation``, the path a user's export
takes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llmq_ray.backends import get_backend  # noqa: E402
from llmq_ray.model.generate import Generator, load_for_generation, sample_next  # noqa: E402
from llmq_ray.model import build_model  # noqa: E402
from _helpers import train_settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_NEW = 20
CASES = {
    "qwen2-gqa-tied": (transformers.Qwen2Config, dict(
        hidden_size=64, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=397, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
        "Qwen2ForCausalLM"),
    "qwen3-gqa-untied-qk-norm": (transformers.Qwen3Config, dict(
        hidden_size=64, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, vocab_size=389, tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
        "Qwen3ForCausalLM"),
    "llama-gqa-untied-rope-scaling": (transformers.LlamaConfig, dict(
        hidden_size=72, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=411, tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, bos_token_id=1, eos_token_id=2),
        "LlamaForCausalLM"),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is faster, and on a busy CI machine a second thread's
    OpenMP wake-ups cost milliseconds per op (softmax of 50 numbers took 10 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _build(name: str, tmp_path_factory):
    """(transformers model, its saved folder, our Generator loaded from that folder)."""
    cls, kwargs, arch = CASES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**kwargs, architectures=[arch])).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # blocks outweigh the embeddings, else a tied model just repeats its last token
                p.normal_(0.0, 0.05 if "embed" in name or "lm_head" in name else 0.15)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return hf, str(folder), load_for_generation(str(folder), "cpu", torch.float32)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen_case(tmp_path_factory):
    return _build("qwen2-gqa-tied", tmp_path_factory)


def _prompts(vocab: int, batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_equals_transformers_generate(case):
    hf, _, gen = case
    prompts = _prompts(gen.cfg.vocab_size)
    ours = gen.generate(prompts, N_NEW)
    ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=N_NEW,
                      eos_token_id=None, pad_token_id=0)
    assert ours == ref[:, prompts.shape[1]:].tolist()
    assert all(len(row) == N_NEW and len(set(row)) >= 4 for row in ours)  # non-trivial continuations
    assert ours[0] != ours[1]


def test_cached_logits_equal_full_forward(case):
    """Prefill + one-token steps give the logits of one no-cache forward over the whole sequence, both ours
    (the training model, torch reference backend) and transformers'."""
    hf, _, gen = case
    prompts = _prompts(gen.cfg.vocab_size, seed=2)
    b, p = prompts.shape
    new = torch.tensor(gen.generate(prompts, N_NEW))
    full = torch.cat([prompts, new], dim=1)  # [B, P + N]
    steps = [gen.prefill(prompts.tolist(), p + N_NEW, all_logits=True)]  # [B, P, V]
    for t in range(N_NEW - 1):
        steps.append(gen.forward(new[:, t:t + 1], p + t, all_logits=True))
    cached = torch.cat(steps, dim=1)  # logits predicting tokens 1 .. P+N-1
    assert cached.shape == (b, p + N_NEW - 1, gen.cfg.vocab_size)

    train = build_model(gen.cfg, get_backend("torch"), batch=b, seq=full.shape[1], params=gen.params)
    ours_full = train.logits_for(full)[:, :-1]
    torch.testing.assert_close(cached, ours_full, rtol=0, atol=1e-5)
    with torch.no_grad():
        hf_full = hf(full).logits[:, :-1].float()
    torch.testing.assert_close(cached, hf_full, rtol=0, atol=1e-4)
    assert cached.abs().max() > 0.5  # logits of substance, not near zero
    # the greedy tokens are the argmax of the cached logits
    assert torch.equal(cached[:, p - 1:].argmax(-1), new)


def test_ragged_batch_equals_each_prompt_alone(case):
    """Left-padded rows see neither the padding nor each other: same tokens and logits as alone."""
    _, _, gen = case
    v = gen.cfg.vocab_size
    rows = [_prompts(v, 1, 4, seed=3)[0].tolist(), _prompts(v, 1, 11, seed=4)[0].tolist(),
            _prompts(v, 1, 8, seed=5)[0].tolist()]
    together = gen.generate(rows, 12)
    assert together == [gen.generate([r], 12)[0] for r in rows]
    batch_logits = gen.prefill(rows, 12)
    for i, r in enumerate(rows):
        torch.testing.assert_close(batch_logits[i], gen.prefill([r], 12)[0], rtol=0, atol=1e-5)


def test_eos_stops_each_row(case):
    _, _, gen = case
    prompts = _prompts(gen.cfg.vocab_size, seed=6)
    free = gen.generate(prompts, N_NEW)
    eos = free[0][5]  # a token row 0 emits at step 5 (or earlier)
    stopped = gen.generate(prompts, N_NEW, eos_token_id=eos)
    for row, ref in zip(stopped, free):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert row == ref[:cut]
    assert len(stopped[0]) <= 6 and stopped[0][-1] == eos
    # a list of eos ids works too, and stopping every row early ends generation
    assert gen.generate(prompts, N_NEW, eos_token_id=[free[0][0], free[1][0]]) == [[free[0][0]], [free[1][0]]]


def test_sampling_is_seeded_and_top_k_1_is_greedy(case):
    _, _, gen = case
    prompts = _prompts(gen.cfg.vocab_size, seed=7)
    a = gen.generate(prompts, N_NEW, temperature=1.0, seed=11)
    assert a == gen.generate(prompts, N_NEW, temperature=1.0, seed=11)
    assert a != gen.generate(prompts, N_NEW, temperature=1.0, seed=12)
    assert a != gen.generate(prompts, N_NEW)
    assert gen.generate(prompts, N_NEW, temperature=0.7, top_k=1, seed=3) == gen.generate(prompts, N_NEW)


def test_sample_next_follows_softmax_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample_next(logits, 0.5, None, gen), minlength=5).float() / 4000
    torch.testing.assert_close(counts, torch.softmax(logits[0] / 0.5, -1), rtol=0, atol=0.03)
    top2 = sample_next(logits, 1.0, 2, gen)
    assert set(top2.tolist()) == {0, 1}
    torch.testing.assert_close((top2 == 0).float().mean(), torch.sigmoid(torch.tensor(1.0)), rtol=0, atol=0.03)
    assert torch.equal(sample_next(logits[:3], 0.0, None, None), torch.zeros(3, dtype=torch.long))


def test_bad_input_is_a_clear_error(case):
    _, _, gen = case
    with pytest.raises(ValueError, match="outside"):
        gen.generate([[1, gen.cfg.vocab_size]], 3)
    with pytest.raises(ValueError, match="empty"):
        gen.generate([[1, 2], []], 3)
    with pytest.raises(ValueError, match="top_k"):
        gen.generate([1, 2], 3, temperature=1.0, top_k=0)
    assert gen.generate([5, 6, 7], 0) == [[]]
    assert len(gen.generate([5, 6, 7], 4)[0]) == 4  # a flat list is one prompt


def test_generator_on_a_bf16_buffer_runs(case):
    _, folder, gen32 = case
    gen = load_for_generation(folder, "cpu", "bf16")
    assert gen.params.dtype == torch.bfloat16 and gen.k_cache is None
    out = gen.generate(_prompts(gen.cfg.vocab_size, seed=8), 6)
    assert gen.k_cache.dtype == torch.bfloat16 and gen.k_cache.shape == (
        gen.cfg.num_layers, 2, gen.cfg.num_kv_heads, 7 + 6, gen.cfg.head_dim)
    assert [len(r) for r in out] == [6, 6]
    # first greedy token agrees with fp32 unless fp32's top two logits are within bf16 noise
    logits32 = gen32.prefill(_prompts(gen.cfg.vocab_size, seed=8).tolist(), 8)
    top2 = logits32.topk(2, dim=-1).values
    for i in range(2):
        if top2[i, 0] - top2[i, 1] > 0.2:
            assert out[i][0] == logits32[i].argmax().item()


def _write_word_tokenizer(folder: str, vocab_size: int) -> None:
    """A whitespace word-level tokenizer.json: 'w0' .. 'w{V-1}' -> ids 0 .. V-1."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(os.path.join(folder, "tokenizer.json"))


def test_example_script_with_ids_and_with_tokenizer(qwen_case, tmp_path, capsys):
    _, folder, gen = qwen_case
    prompt = _prompts(gen.cfg.vocab_size, 1, 6, seed=9)[0].tolist()
    expected = gen.generate([prompt], 8, eos_token_id=gen.cfg.eos_token_id)[0]
    script = os.path.join(REPO, "examples", "generate.py")
    spec = importlib.util.spec_from_file_location("example_generate", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    # token ids in, token ids out (no tokenizer for this vocabulary)
    ids = ",".join(map(str, prompt))
    assert example.main(["--model", folder, "--prompt-ids", ids, "--max-new-tokens", "8", "--device", "cpu"]) == 0
    assert f"tokens: {' '.join(map(str, expected))}" in capsys.readouterr().out
    # no tokenizer.json and a small vocabulary: text prompts are refused with a hint
    assert example.main(["--model", folder, "--prompt", "hello", "--device", "cpu"]) == 2
    assert "pass token ids with --prompt-ids" in capsys.readouterr().err
    # bad flags: one line naming the flag, no traceback (a CUDA device without CUDA was an AssertionError)
    bad = [(["--max-new-tokens", "-3"], "--max-new-tokens=-3 must be >= 0"),
           (["--temperature", "-1"], "--temperature=-1.0 must be >= 0"), (["--top-k", "0"], "--top-k=0 must be >= 1")]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda"], "--device=cuda but torch finds no CUDA GPU here; use --device cpu"))
    for args, sentence in bad:
        with pytest.raises(SystemExit) as caught:
            example.main(["--model", folder, "--prompt-ids", ids, "--device", "cpu"] + args)
        err = capsys.readouterr().err
        assert caught.value.code == 2 and f"error: {sentence}" in err and "Traceback" not in err, err

    # as a script, with a tokenizer.json in the folder: text in, text out
    with_tok = tmp_path / "with_tok"
    with_tok.mkdir()
    for f in os.listdir(folder):
        os.symlink(os.path.join(folder, f), with_tok / f)
    _write_word_tokenizer(str(with_tok), gen.cfg.vocab_size)
    text = " ".join(f"w{i}" for i in prompt)
    run = subprocess.run([sys.executable, script, "--model", str(with_tok), "--prompt", text, "--max-new-tokens",
                          "8", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == " ".join(f"w{i}" for i in prompt + expected)
    assert lines[1] == f"tokens: {' '.join(map(str, expected))}"


def test_trained_and_exported_model_generates_like_transformers(tmp_path):
    """Train the tiny preset for a few steps (our engine), export it (our HF export), and check that our KV-cache
    greedy generation on the export equals transformers' greedy generate on the very same folder."""
    import transformers

    from llmq_ray.model.config import PRESETS
    from llmq_ray.engine.train_engine import TrainEngine
    from llmq_ray.model.hf_io import export_hf

    cfg = PRESETS["tiny"]
    opts = train_settings(model="tiny", batch_size=4, seq_len=32, steps=30, learning_rate=3e-3, seed=3)
    engine = TrainEngine(cfg, opts, get_backend("torch"))
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, cfg.vocab_size, (8,), generator=gen)
    data = pattern.repeat(40)  # a repeating sequence: a trained model predicts it, so outputs are not trivial
    losses = []
    for step in range(opts.optim.steps):
        starts = torch.randint(0, data.numel() - opts.data.seq_len - 1, (opts.data.batch_size,), generator=gen)
        window = torch.stack([data[s:s + opts.data.seq_len + 1] for s in starts.tolist()])
        engine.micro_step(window[:, :-1], window[:, 1:])
        losses.append(engine.update(3e-3, step + 1).loss)
    assert losses[-1] < losses[0] - 1.0, losses  # it really trained
    folder = export_hf(str(tmp_path / "export"), cfg, engine.layout, engine.params[:engine.layout.numel],
                       dtype=torch.float32)
    ours = load_for_generation(folder, device="cpu", dtype=torch.float32)
    prompts = [pattern[:3].tolist(), pattern[2:7].tolist()]
    got = ours.generate(prompts, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    for prompt, row in zip(prompts, got):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert row == ref, (prompt, row, ref)
