"""The tokenize command: Qwen ids, tiny-shakespeare shards, EOS between documents, jsonl/parquet/HF inputs."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmq_ray.data_pipeline import text_inputs
from llmq_ray.data_pipeline.shards import open_shard
from llmq_ray.data_pipeline.tokenize import tokenize_files
from llmq_ray.data_pipeline.vocab import QWEN_EOS_ID, QwenTiktoken
from llmq_ray.errors import DataError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED = os.path.join(REPO, "data_pipeline", "corpora", "tinyshakespeare.txt.gz")

# Ids that Qwen2 / Qwen2.5 tokenizers are published to give for these strings (collected from public
# tokenizer tests and tokenize-endpoint outputs; see README.md, "Is the default vocabulary Qwen2.5's?").
QWEN25_GOLDEN = {
    "Hello world": [9707, 1879],
    "Hello, world!": [9707, 11, 1879, 0],
    "Hello, world! 123": [9707, 11, 1879, 0, 220, 16, 17, 18],
    "Hello\nworld": [9707, 198, 14615],
    "2+2=?": [17, 10, 17, 19884],
    "What is the capital of France?": [3838, 374, 279, 6722, 315, 9625, 30],
    "The quick brown fox.": [785, 3974, 13876, 38835, 13],
    "def foo(): return 42": [750, 15229, 4555, 470, 220, 19, 17],
    "你好世界": [108386, 99489],
    "这是上下文。": [100346, 102285, 16744, 1773],
    "🚀": [145836],
    "Qwen3-ASR: test 123!": [48, 16948, 18, 12, 1911, 49, 25, 1273, 220, 16, 17, 18, 0],
}


@pytest.fixture(scope="module")
def qwen():
    return QwenTiktoken()


def _tokens(path):
    return np.asarray(open_shard(path).tokens).tolist()


def test_qwen_vocabulary_gives_published_qwen25_ids(qwen):
    for text, ids in QWEN25_GOLDEN.items():
        assert qwen.encode(text) == ids, text
    assert qwen.eos_id == QWEN_EOS_ID == 151643 and qwen.vocab_size == 151646
    assert qwen.encode("<|endoftext|>") != [QWEN_EOS_ID]  # literal text never becomes EOS


@pytest.fixture(scope="module")
def shakespeare_out(tmp_path_factory):
    """tiny-shakespeare tokenized by tokenize_files from the copy in the repository: $LLMQ_DATA_DIR unset and
    XDG_CACHE_HOME a fresh folder, so neither the user's data nor the user's cache takes part."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LLMQ_DATA_DIR", raising=False)
        mp.setenv("XDG_CACHE_HOME", str(cache))
        out = str(tmp_path_factory.mktemp("ts") / "tiny-shakespeare-qwen")
        meta = tokenize_files(["tiny-shakespeare"], out, shard_tokens=100_000, eval_tokens=32768, workers=1)
    return out, meta, cache


def test_embedded_corpus_is_package_data():
    """The corpus lives in the repository (gzip, ~434 KB) and pyproject.toml ships it with data_pipeline."""
    import ast
    import fnmatch
    import gzip
    import re

    assert os.path.abspath(text_inputs.EMBEDDED_TINY_SHAKESPEARE) == os.path.abspath(EMBEDDED)
    assert 300_000 < os.path.getsize(EMBEDDED) < 600_000
    with gzip.open(EMBEDDED, "rb") as f:
        text = f.read()
    assert len(text) == text_inputs.TINY_SHAKESPEARE_BYTES and text.startswith(b"First Citizen:\nBefore we proceed")
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    try:
        import tomllib  # Python 3.11+

        patterns = tomllib.loads(pyproject)["tool"]["setuptools"]["package-data"]["llmq_ray.data_pipeline"]
    except ImportError:  # 3.10: the line itself (a TOML list of plain strings is a Python literal)
        section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
        patterns = ast.literal_eval(re.search(r'^"llmq_ray\.data_pipeline"\s*=\s*(\[.*\])$', section, re.M).group(1))
    rel = os.path.relpath(EMBEDDED, os.path.join(REPO, "data_pipeline"))
    assert any(fnmatch.fnmatch(rel, p) for p in patterns), (rel, patterns)


def test_tiny_shakespeare_lookup_order(tmp_path, monkeypatch):
    """$LLMQ_DATA_DIR first, else the embedded copy decompressed once into the cache (atomically, byte count
    checked), and a download only when the embedded copy is missing."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("LLMQ_DATA_DIR", raising=False)

    def no_network(*a, **k):
        raise OSError("no network in this test")

    monkeypatch.setattr(text_inputs.urllib.request, "urlopen", no_network)
    path = text_inputs.tiny_shakespeare_path()
    assert path == str(cache / "llmq_ray" / "tinyshakespeare.txt")
    assert os.path.getsize(path) == text_inputs.TINY_SHAKESPEARE_BYTES
    assert os.listdir(cache / "llmq_ray") == ["tinyshakespeare.txt"]  # no temporary file left behind
    mtime = os.stat(path).st_mtime_ns
    assert text_inputs.tiny_shakespeare_path() == path and os.stat(path).st_mtime_ns == mtime  # decompressed once

    with open(path, "r+b") as f:  # a truncated cache file is replaced
        f.truncate(1000)
    assert text_inputs.tiny_shakespeare_path() == path and os.path.getsize(path) == text_inputs.TINY_SHAKESPEARE_BYTES

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tinyshakespeare.txt").write_text("my own copy\n")
    monkeypatch.setenv("LLMQ_DATA_DIR", str(mine))
    assert text_inputs.tiny_shakespeare_path() == str(mine / "tinyshakespeare.txt")
    monkeypatch.setenv("LLMQ_DATA_DIR", str(tmp_path / "empty"))  # set, but without the file: embedded copy
    assert text_inputs.tiny_shakespeare_path() == path

    # a broken install without the embedded file: the cache if it has the file, else a download (here failing)
    monkeypatch.setattr(text_inputs, "EMBEDDED_TINY_SHAKESPEARE", str(tmp_path / "missing.txt.gz"))
    assert text_inputs.tiny_shakespeare_path() == path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache2"))
    with pytest.raises(DataError, match="downloading it failed .no network in this test."):
        text_inputs.tiny_shakespeare_path()
    assert not os.path.exists(tmp_path / "cache2" / "llmq_ray" / "tinyshakespeare.txt")


def test_tiny_shakespeare_shards(shakespeare_out):
    out, meta, _ = shakespeare_out
    assert sorted(os.listdir(out)) == ["eval.bin", "meta.json", "train-000.bin", "train-001.bin", "train-002.bin"]
    ev = _tokens(os.path.join(out, "eval.bin"))
    train = [_tokens(os.path.join(out, f"train-00{i}.bin")) for i in range(3)]
    assert len(ev) == 32768 and [len(t) for t in train] == [100_000, 100_000, 69_062]
    assert len(ev) + sum(map(len, train)) == 301_830  # 301,829 Qwen tokens + one EOS
    assert ev[:10] == [5338, 46217, 510, 10227, 582, 10354, 894, 4623, 11, 6723]  # "First Citizen:\nBefore we proceed"
    assert train[0][:10] == [13095, 1381, 2034, 510, 94914, 1172, 11, 429, 279, 42283]
    assert train[2][-6:] == [3658, 33123, 1947, 47628, 624, QWEN_EOS_ID]
    h = open_shard(os.path.join(out, "train-000.bin")).info
    assert (h.format, h.version, h.vocab_size, h.has_masks) == ("llmq", 2, 151646, False)
    assert meta["train_tokens"] == 269_062 and meta["eos_id"] == QWEN_EOS_ID


def test_cli_with_two_processes_writes_identical_shards(shakespeare_out, tmp_path):
    out, _, cache = shakespeare_out
    out2 = str(tmp_path / "mp")
    env = {k: v for k, v in os.environ.items() if k != "LLMQ_DATA_DIR"}
    env["XDG_CACHE_HOME"] = str(cache)  # the fixture's cache: the embedded copy, already decompressed
    r = subprocess.run([sys.executable, "-m", "llmq_ray.data_pipeline.tokenize", "--input", "tiny-shakespeare", "--out", out2,
                        "--shard-tokens", "100000", "--workers", "2", "--chunk-chars", "100000"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("wrote") and "\r" not in r.stdout  # no progress bar when not a tty
    for name in ("eval.bin", "train-000.bin", "train-001.bin", "train-002.bin"):
        assert open(os.path.join(out, name), "rb").read() == open(os.path.join(out2, name), "rb").read(), name


def test_jsonl_and_parquet_documents_end_with_eos(tmp_path, qwen):
    docs = ["First doc.", "Second, longer document\nwith two lines.", "três"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[:2])) + "\n")
    pq.write_table(pa.table({"body": [docs[2]]}), str(tmp_path / "b.parquet"))
    with pytest.raises(DataError, match=r"b\.parquet: no column 'text' \(columns: body\)"):
        tokenize_files([str(tmp_path / "*.jsonl"), str(tmp_path / "*.parquet")], str(tmp_path / "bad"), eval_tokens=0)
    assert not os.path.exists(tmp_path / "bad" / "train-000.bin") and os.listdir(tmp_path / "bad") == []
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": docs[2]}) + "\n")
    tokenize_files([str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")], str(tmp_path / "ok"), eval_tokens=3)
    expect = []
    for d in docs:
        expect += qwen.encode(d) + [QWEN_EOS_ID]
    got = _tokens(str(tmp_path / "ok" / "eval.bin")) + _tokens(str(tmp_path / "ok" / "train-000.bin"))
    assert got == expect
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl: line 1 has no string field 'text'"):
        tokenize_files([str(tmp_path / "d.jsonl")], str(tmp_path / "bad2"))


def test_local_hf_tokenizer_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"]))
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "x.txt").write_text("the cat sat")
    meta = tokenize_files([str(tmp_path / "x.txt")], str(tmp_path / "o"), tokenizer=str(folder), eval_tokens=0)
    eos = tok.token_to_id("</s>")
    assert meta["eos_id"] == eos and meta["vocab_size"] == tok.get_vocab_size()
    assert _tokens(str(tmp_path / "o" / "train-000.bin")) == tok.encode("the cat sat").ids + [eos]


def test_bad_cli_values_are_one_line_before_any_work(tmp_path, capsys):
    """--out under a file (a NotADirectoryError traceback before), negative --workers / --eos-id (a negative
    EOS id failed later, naming the staging folder): argparse's one line naming the flag, nothing written."""
    from llmq_ray.data_pipeline.tokenize import main

    (tmp_path / "afile").write_text("x")
    (tmp_path / "doc.txt").write_text("hello world\n")
    base = ["--input", str(tmp_path / "doc.txt"), "--no-progress"]
    for args, sentence in [(["--out", str(tmp_path / "afile")], f"--out={tmp_path}/afile cannot be a folder: "
                                                                f"{tmp_path}/afile is a file"),
                           (["--out", str(tmp_path / "afile" / "x")], f"{tmp_path}/afile is a file"),
                           (["--out", str(tmp_path / "o"), "--workers", "-1"], "--workers=-1 must be >= 0"),
                           (["--out", str(tmp_path / "o"), "--eos-id", "-5"], "--eos-id=-5 must be >= 0")]:
        with pytest.raises(SystemExit) as caught:
            main(base + args)
        err = capsys.readouterr().err
        assert caught.value.code == 2 and sentence in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["afile", "doc.txt"]
