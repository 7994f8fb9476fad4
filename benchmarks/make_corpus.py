"""A real-text corpus from what a machine has installed: Python sources and docs, as JSONL documents.

Issue 25's long loss check needs >= 100M tokens of real text on the GPU machine, which has no internet. Its
Python installation holds well over that (the standard library, torch, transformers, ... as .py / .pyi / .md /
.rst / .txt files), so this script walks the given folders, keeps text files of those kinds, drops exact
duplicates (many packages vendor the same files), and writes one JSONL document per file ({"text": ...,
"path": ...}) in a fixed order (sorted paths), until --max-chars. The tokenizer then makes shards from it:

    python benchmarks/make_corpus.py --roots /usr/lib/python3.12 $(python3 -c 'import site;
        print(site.getsitepackages()[0])') --out /tmp/corpus.jsonl --max-chars 500000000
    python -m llmq_ray.data_pipeline.tokenize --input /tmp/corpus.jsonl --out runs/pycorpus --workers 16

(4.4 characters per Qwen token, measured on the standard library's json and email packages: 500M characters
give ~114M tokens.) Written here rather than
taken from a library because it is a file walk with a filter; nothing to reuse.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 2 << 20  # larger "text" files are mostly data tables


def corpus_files(roots: list[str]) -> list[str]:
    """Every file under ``roots`` with a kept suffix, sorted (the corpus order is reproducible)."""
    found = set()
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
            for name in files:
                if name.endswith(SUFFIXES):
                    found.add(os.path.realpath(os.path.join(folder, name)))
    return sorted(found)


def write_corpus(paths: list[str], out: str, max_chars: int) -> dict:
    """Write the JSONL corpus (to ``out``.partial, renamed when complete); returns counts."""
    seen, chars, docs, skipped = set(), 0, 0, 0
    tmp = out + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        for path in paths:
            if chars >= max_chars:
                break
            try:
                if os.path.getsize(path) > MAX_FILE_BYTES:
                    skipped += 1
                    continue
                with open(path, encoding="utf-8") as src:
                    text = src.read()
            except (OSError, UnicodeDecodeError):
                skipped += 1
                continue
            digest = hashlib.sha1(text.encode("utf-8")).digest()
            if not text.strip() or digest in seen:
                skipped += 1
                continue
            seen.add(digest)
            f.write(json.dumps({"text": text, "path": path}) + "\n")
            chars += len(text)
            docs += 1
    os.replace(tmp, out)
    return {"documents": docs, "characters": chars, "skipped": skipped}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", nargs="+", required=True, help="folders to walk")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--max-chars", type=int, default=500_000_000, help="stop after this many characters")
    a = p.parse_args(argv)
    missing = [r for r in a.roots if not os.path.isdir(r)]
    if missing:
        print(f"make_corpus: --roots {', '.join(missing)} is not a folder.", file=sys.stderr)
        return 2
    counts = write_corpus(corpus_files(a.roots), a.out, a.max_chars)
    print(f"{a.out}: {counts['documents']:,} documents, {counts['characters']:,} characters "
          f"({counts['skipped']:,} files skipped: duplicate, empty, not UTF-8 or over {MAX_FILE_BYTES >> 20} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
