"""Supervised fine-tuning data: chat jsonl -> tokens + assistant-only target masks -> windows -> loss.

Everything runs on a tiny local HF tokenizer folder built here (a byte-level BPE trained in milliseconds on a
few sentences, the three ChatML specials, and a ChatML chat template written for this test with the structure of
Qwen's: a default system prompt when the conversation has none, ``<|im_start|>role\\ncontent<|im_end|>\\n`` per
message, ``<|im_start|>assistant\\n`` as the generation prompt), so nothing is downloaded. Its 320 ids fit the
``tiny`` model preset's vocabulary (512), so the same shards feed the torch reference model.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from llmq_ray.data_pipeline.order import rank_order
from _helpers import DEFAULT_SYSTEM, TEMPLATE, train_settings, write_chatml_tokenizer

from llmq_ray.data_pipeline.shards import open_shard
from llmq_ray.data_pipeline.stream import EvalStream, TokenStream, build_spec
from llmq_ray.data_pipeline.tokenize import main as tokenize_main
from llmq_ray.data_pipeline.tokenize import tokenize_chat
from llmq_ray.errors import DataError

CONVERSATIONS = [
    [{"role": "system", "content": "You are a fox."}, {"role": "user", "content": "Hi fox"},
     {"role": "assistant", "content": "The dog."}, {"role": "user", "content": "Again?"},
     {"role": "assistant", "content": "The lazy dog jumps over the brown fox."}],
    [{"role": "user", "content": "Only a question, no answer"}],  # skipped: nothing to learn
    [{"role": "user", "content": "What jumps?"}, {"role": "assistant", "content": "A quick brown fox "},
     {"role": "user", "content": "trailing user turn"}],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "Unicode: fuchs \u00fc \u4f60\u597d"},
     {"role": "assistant", "content": "Ok \u00fc\n\nbye"}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_chatml_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _write_jsonl(path, conversations, extra_lines=()):
    with open(path, "w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def _rendered(conv) -> str:
    """What the template must give, written out by hand (independent of the template machinery)."""
    msgs = conv if conv and conv[0]["role"] == "system" else [{"role": "system", "content": DEFAULT_SYSTEM}] + conv
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)


def _all_tokens(out):
    """(tokens, target mask) of eval.bin then train-000.bin, ... concatenated: the whole stream in order."""
    meta = json.load(open(os.path.join(out, "meta.json")))
    names = ([meta["eval"]["file"]] if meta["eval"] else []) + [t["file"] for t in meta["train"]]
    toks, mask = [], []
    for n in names:
        s = open_shard(os.path.join(out, n))
        assert s.has_masks
        toks.append(np.asarray(s.tokens))
        mask.append(s.target_mask(0, len(s)))
    return np.concatenate(toks), np.concatenate(mask), meta


@pytest.fixture(scope="module")
def chat_out(tok_dir, tmp_path_factory):
    """The conversations above, twice (so the stream spans an eval file and several train shards), tokenized
    through the command line."""
    d = tmp_path_factory.mktemp("chat")
    src = _write_jsonl(d / "chat.jsonl", CONVERSATIONS * 2)
    out = str(d / "out")
    rc = tokenize_main(["--chat", src, "--tokenizer", tok_dir, "--out", out, "--eval-tokens", "50",
                        "--shard-tokens", "64", "--no-progress"])
    assert rc == 0
    return out


def test_chat_tokens_round_trip_and_mask_holds_exactly_the_assistant_turns(chat_out, hf_tok):
    toks, mask, meta = _all_tokens(chat_out)
    kept = [c for c in CONVERSATIONS * 2 if any(m["role"] == "assistant" for m in c)]
    # decoding every token gives the template's text, one <|endoftext|> after each conversation
    assert hf_tok.decode(toks.tolist()) == "".join(_rendered(c) + "<|endoftext|>" for c in kept)
    # decoding only the targets gives the assistant contents, each with its end-of-turn token (not the "\n")
    want = "".join(m["content"] + "<|im_end|>" for c in kept for m in c if m["role"] == "assistant")
    assert hf_tok.decode(toks[mask].tolist()) == want
    assert meta["masked"] is True and meta["chat"]["conversations"] == len(kept)
    assert meta["chat"]["skipped_no_assistant"] == 2 and meta["chat"]["chat_template"] == TEMPLATE
    assert meta["chat"]["train_targets"] + meta["eval"]["targets"] == int(mask.sum())
    assert len(meta["train"]) > 2 and meta["eval"]["tokens"] == 50
    assert sorted(os.listdir(chat_out)) == ["eval.bin", "meta.json"] + [t["file"] for t in meta["train"]]


def _expected_targets(tokens, hf_tok) -> np.ndarray:
    """Independently of the tokenizer's prefix renderings: walk the stream and mark every token after an
    "<|im_start|>assistant\\n" header up to and including the next <|im_end|>."""
    start, end = hf_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    out = np.zeros(len(tokens), dtype=bool)
    i = 0
    while i < len(tokens):
        if tokens[i] == start:
            j, header = i + 1, ""
            while not header.endswith("\n"):
                header += hf_tok.decode([int(tokens[j])])
                j += 1
            if header == "assistant\n":
                k = j
                while tokens[k] != end:
                    k += 1
                out[j:k + 1] = True
                i = k
        i += 1
    return out


def test_windows_mask_targets_exactly_at_non_assistant_positions(chat_out, hf_tok):
    toks, mask, meta = _all_tokens(chat_out)
    expect = _expected_targets(toks, hf_tok)
    np.testing.assert_array_equal(mask, expect)
    T, B = 16, 3
    # sequential reader over eval + train files (file order is the stream order: eval.bin sorts first)
    pattern = [os.path.join(chat_out, n) for n in ["eval.bin"] + [t["file"] for t in meta["train"]]]
    spec = build_spec(pattern, T)
    assert list(spec.paths) == pattern
    offsets = np.cumsum((0,) + spec.n_tokens)
    seen = 0
    files, wins = rank_order(spec.counts, 0, 0, 0, 1, shuffle=False, drop_tail=False)
    for b, (inputs, targets) in enumerate(EvalStream(pattern, T, B, spec=spec)):
        for r in range(B):
            k = b * B + r
            if k >= len(files):
                assert (targets[r] == -100).all()
                continue
            s = offsets[files[k]] + wins[k] * T
            np.testing.assert_array_equal(inputs[r].numpy(), toks[s:s + T])
            want = np.where(expect[s + 1:s + T + 1], toks[s + 1:s + T + 1], -100)
            np.testing.assert_array_equal(targets[r].numpy(), want)
            seen += 1
    assert seen == len(files) > 5
    # the shuffled training reader (plain path; the Ray Data path shares read_windows, tests/test_stream.py)
    train = pattern[1:]
    stream = TokenStream(train, T, B, seed=5, use_ray=False, prefetch=0)
    files, wins = rank_order(stream.spec.counts, 5, 0, 0, 1)
    base = offsets[1:]
    for b in range(len(files) // B):
        inputs, targets = stream.next_batch()
        for r in range(B):
            s = base[files[b * B + r]] + wins[b * B + r] * T
            want = np.where(expect[s + 1:s + T + 1], toks[s + 1:s + T + 1], -100)
            np.testing.assert_array_equal(targets[r].numpy(), want)
    stream.close()


def _one_window(tok_dir, tmp_path, name, conv):
    """One conversation tokenized alone into one shard, read back as a single window of all its tokens."""
    out = str(tmp_path / name)
    tokenize_chat([_write_jsonl(tmp_path / f"{name}.jsonl", [conv])], out, tok_dir, eval_tokens=0)
    n = open_shard(os.path.join(out, "train-000.bin")).info.n_tokens
    (inputs, targets), = list(EvalStream(os.path.join(out, "train-*.bin"), n - 1, 1))
    return inputs, targets


def _loss_and_grads(inputs, targets):
    from llmq_ray.backends import get_backend
    from llmq_ray.model.config import PRESETS
    from llmq_ray.model.params import init_params
    from llmq_ray.model import build_model

    model = build_model(PRESETS["tiny"], get_backend("torch"), batch=1, seq=inputs.shape[1],
                       dtype=torch.float32)
    init_params(model.layout, model.params, seed=7)
    model.zero_grads()
    model.forward_backward(inputs, targets)
    return model.loss_sum.clone(), int(model.target_count), model.grads.clone()


def test_masked_tokens_contribute_exactly_zero_gradient(tok_dir, tmp_path):
    """Two conversations differing only in the user turn after the last assistant turn: those tokens are
    masked targets, and as inputs they only feed later, masked positions; loss and every gradient are the same
    bits. A different assistant token (same token count) changes both."""
    head = [{"role": "user", "content": "Hi fox"}, {"role": "assistant", "content": "The lazy dog."}]
    x_a, y_a = _one_window(tok_dir, tmp_path, "a", head + [{"role": "user", "content": "QQQQ jumps"}])
    x_b, y_b = _one_window(tok_dir, tmp_path, "b", head + [{"role": "user", "content": "ZZZZ fox"}])
    x_c, y_c = _one_window(tok_dir, tmp_path, "c", [head[0], {"role": "assistant", "content": "The lazy fox."},
                                                    {"role": "user", "content": "QQQQ jumps"}])
    assert x_a.shape == x_b.shape == x_c.shape and not torch.equal(x_a, x_b) and not torch.equal(x_a, x_c)
    assert torch.equal(y_a != -100, y_b != -100) and (y_a != -100).sum() > 3
    loss_a, n_a, g_a = _loss_and_grads(x_a, y_a)
    loss_b, n_b, g_b = _loss_and_grads(x_b, y_b)
    loss_c, n_c, g_c = _loss_and_grads(x_c, y_c)
    assert n_a == n_b == n_c == int((y_a != -100).sum())
    assert torch.equal(loss_a, loss_b) and torch.equal(g_a, g_b)
    assert not torch.equal(loss_a, loss_c) and not torch.equal(g_a, g_c)


def test_a_step_whose_targets_are_all_masked_divides_by_no_zero():
    """The step's loss and gradients are normalised by the global target count, clamped to >= 1: an all-masked
    step reports loss 0 and gradient norm 0, and the update stays finite."""
    from llmq_ray.backends import get_backend
    from llmq_ray.engine.train_engine import TrainEngine
    from llmq_ray.model.config import PRESETS

    e = TrainEngine(PRESETS["tiny"], train_settings(model="tiny", batch_size=2, seq_len=8), get_backend("torch"))
    x = torch.arange(16).view(2, 8) % 50
    e.micro_step(x, torch.full((2, 8), -100), last=True)
    stats = e.update(1e-3, 1)
    assert stats.loss == 0.0 and stats.grad_norm == 0.0 and not stats.skipped and stats.tokens == 0
    assert torch.isfinite(e.params).all()


@pytest.mark.parametrize("line, message", [
    ('{"text": "not chat"}', r"chat\.jsonl: line 2 has no \"messages\" list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"chat\.jsonl: line 2: message 1 has role 'bot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', r"chat\.jsonl: line 2: message 1 is not an object"),
    ('{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     r"chat\.jsonl: line 2: the chat template fails on this conversation \(.*role tool is not supported"),
    ("{not json", r"chat\.jsonl: line 2 is not valid JSON"),
])
def test_bad_lines_are_one_error_naming_file_and_line(tok_dir, tmp_path, line, message):
    src = _write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS[:1], [line])
    with pytest.raises(DataError, match=message):
        tokenize_chat([src], str(tmp_path / "out"), tok_dir, eval_tokens=0)
    assert not os.path.exists(tmp_path / "out" / "meta.json")  # nothing half-written is published
    assert os.listdir(tmp_path / "out") == []


def test_a_separator_the_template_emits_inside_conversations_is_refused(tok_dir, hf_tok, tmp_path):
    """The conversation separator is what --document-masking cuts windows at: a separator that ends every turn
    (here <|im_end|>, as a Llama-3 Instruct folder's <|eot_id|> would) would cut conversations into turns."""
    src = _write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS[:1])
    im_end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(DataError, match=r"chat\.jsonl: line 1: the conversation separator, token \d+ "
                                        r"\('<\|im_end\|>'\), occurs inside the rendered conversation"):
        tokenize_chat([src], str(tmp_path / "out"), tok_dir, eval_tokens=0, eos_id=im_end)


def test_templates_that_rewrite_earlier_turns_are_refused(tok_dir, tmp_path, capsys):
    """A template that renders an assistant turn differently once later turns follow (as Qwen3's thinking
    template drops earlier reasoning) leaves no exact span: one error naming the line and the message. The
    command line prints it as one line and exits 2."""
    rewriting = TEMPLATE.replace("message['content'] + '<|im_end|>'",
                                 "(message['content'] if loop.last or message['role'] != 'assistant' else 'old')"
                                 " + '<|im_end|>'")
    (tmp_path / "t.jinja").write_text(rewriting)
    src = _write_jsonl(tmp_path / "chat.jsonl", [CONVERSATIONS[3], CONVERSATIONS[0]])
    rc = tokenize_main(["--chat", src, "--tokenizer", tok_dir, "--chat-template", str(tmp_path / "t.jinja"),
                        "--out", str(tmp_path / "out"), "--eval-tokens", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "chat.jsonl: line 2: the rendering of messages 1-3 is not a prefix" in err
    assert "assistant tokens of message 3 cannot be told exactly" in err
    # the built-in vocabulary has no chat template: --chat asks for a folder
    with pytest.raises(DataError, match="--chat needs --tokenizer FOLDER"):
        tokenize_chat([src], str(tmp_path / "o2"), "qwen")
