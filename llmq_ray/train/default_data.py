"""The data a first run trains on when the user names none: tiny-shakespeare, tokenized once and cached.

``default_dataset()`` returns (train glob, eval file, a short description). The text comes from
``llmq_ray.data_pipeline.text_inputs.tiny_shakespeare_path`` ($LLMQ_DATA_DIR, else the copy shipped with the
``data_pipeline`` package, decompressed once into ~/.cache/llmq_ray, else -- only when an install lacks that
copy -- a one-time download). If all of these fail (a broken install on a machine without a network, or an
unwritable cache) it falls back -- saying so in one line -- to a corpus every Python installation carries:
the interpreter's own documentation text (``pydoc_data.topics``, about 465 KB of English). Shards are written
by ``llmq_ray.data_pipeline.tokenize`` (Qwen vocabulary) into ``~/.cache/llmq_ray/data/<name>-qwen-eval<N>/`` and reused
while their ``meta.json`` exists.
"""

from __future__ import annotations

import os

from llmq_ray.errors import DataError


def cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmq_ray")


def pydoc_text_file() -> str:
    """Write the interpreter's pydoc topics (a dict of English help texts) to a text file in the cache."""
    from pydoc_data.topics import topics

    path = os.path.join(cache_root(), "pydoc_topics.txt")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n\n".join(topics[k] for k in sorted(topics)))
        os.replace(tmp, path)
    return path


def tokenized(name: str, text_file: str, eval_tokens: int = 32768) -> tuple[str, str]:
    """Tokenize ``text_file`` into the cache once (the first ``eval_tokens`` tokens become eval.bin);
    returns (train glob, eval file)."""
    folder = os.path.join(cache_root(), "data", f"{name}-qwen-eval{eval_tokens}")
    if not os.path.isfile(os.path.join(folder, "meta.json")):
        from llmq_ray.data_pipeline.tokenize import tokenize_files

        print(f"tokenizing {text_file} into {folder} (once) ...", flush=True)
        tokenize_files([text_file], folder, eval_tokens=eval_tokens, progress=False)
    return os.path.join(folder, "train-*.bin"), os.path.join(folder, "eval.bin")


def default_dataset(verbose: bool = True, eval_tokens: int = 32768) -> tuple[str, str, str]:
    """(train glob, eval file, description) of tiny-shakespeare, or of the pydoc fallback."""
    from llmq_ray.data_pipeline.text_inputs import tiny_shakespeare_path

    try:
        text = tiny_shakespeare_path()
        name = "tiny-shakespeare"
    except DataError:
        if verbose:
            print("tiny-shakespeare is not on this machine and cannot be downloaded: training on Python's own "
                  "documentation text (pydoc_data.topics) instead.", flush=True)
        text, name = pydoc_text_file(), "pydoc-topics"
    train, evalf = tokenized(name, text, eval_tokens)
    return train, evalf, f"{name} ({text})"
