"""Token shards of packed documents for timing --document-masking (random tokens: the speed does not depend on
them): documents of a uniform random length in [--min-len, --max-len] tokens, each ending with --eos, written
back to back, and a meta.json naming that EOS (as the tokenizer's output does, so the trainer finds the
separator).

    python benchmarks/make_packed_docs.py /tmp/docs --tokens 8000000            # Qwen2.5's vocabulary and EOS
    python benchmarks/bench_train.py --train-file '/tmp/docs/train-*.bin' --document-masking ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.data_pipeline.shards import write_shard  # noqa: E402


def packed_documents(n_tokens: int, min_len: int, max_len: int, eos: int, vocab: int, seed: int) -> np.ndarray:
    """int32 [n_tokens]: random non-EOS tokens in documents of min_len..max_len tokens (EOS included)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, n_tokens, dtype=np.int32)
    tokens[tokens == eos] = (eos + 1) % vocab
    ends = np.cumsum(rng.integers(min_len, max_len + 1, n_tokens // min_len + 1)) - 1
    tokens[ends[ends < n_tokens]] = eos
    return tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--tokens", type=int, default=8_000_000)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--eos", type=int, default=151643, help="Qwen2.5's <|endoftext|>")
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    tokens = packed_documents(a.tokens, a.min_len, a.max_len, a.eos, a.vocab_size, a.seed)
    write_shard(os.path.join(a.out_dir, "train-000.bin"), tokens, a.vocab_size)
    with open(os.path.join(a.out_dir, "meta.json"), "w") as f:
        json.dump({"eos_id": a.eos, "documents": int((tokens == a.eos).sum())}, f)
    print(f"{a.tokens} tokens, {(tokens == a.eos).sum()} documents of {a.min_len}..{a.max_len} -> {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
