"""The repository documents itself: no file cites a document outside it, and the paths the docs name exist.

* No tracked file mentions a path or a note outside the repository that a reader cannot open (the team's
  shared folder beside the checkout, its machine and design notes): facts learnt from them are written down
  where they are used instead.
* Every repository path named in the README, docs/, the examples, the tests and the modules' docstrings
  (``benchmarks/bench_train.py``, ``docs/stopping-and-resuming.md``, ...) exists. The dated records
  (``benchmarks/results/``, ``benchmarks/LOG.md``) may name files that were removed since (reverted experiments,
  the per-call scripts): they are history, and are only held to the first rule.
* benchmarks/ holds named recipes and tools, not one script per GPU call: no ``benchmarks/archive/``, no
  ``device_*.sh`` beside the shared preamble ``device_lib.sh``, and every shell script there is listed in
  benchmarks/README.md. The per-call scripts live in git history; the records name the commit of each.
"""

from __future__ import annotations

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the team's notes outside the repository, spelt in pieces so that this file does not cite them itself
_NOTES = ("environment", "design", "layout", "kinds", "method", "hopper", "readme_data")
_OUTSIDE_DIR = ".." + "/" + "shared"
OUTSIDE = re.compile("|".join([re.escape(_OUTSIDE_DIR), "/work/" + "shared",
                               r"\b(" + "|".join(n.upper() for n in _NOTES) + r")\.md\b", r"\b" + "design".upper() + " §"]))
PATH = re.compile(r"(?<![\w./-])((?:benchmarks|docs|examples|tests|llmq_ray|actors|backends|data_pipeline)/"
                  r"[\w./-]+\.(?:sh|py|md|png|json|toml))")
HISTORY = ("benchmarks/results/", "benchmarks/LOG.md")


def _tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [p for p in out.split() if p.endswith((".md", ".py", ".sh", ".toml", ".txt", ".cfg"))
            and os.path.isfile(os.path.join(REPO, p))]


def test_no_file_cites_a_path_outside_the_repository():
    bad = []
    for p in _tracked_text_files():
        with open(os.path.join(REPO, p), errors="replace") as f:
            bad += [f"{p}:{i}: {line.strip()[:100]}" for i, line in enumerate(f, 1) if OUTSIDE.search(line)]
    assert not bad, "\n".join(bad)


def test_paths_named_in_the_docs_exist():
    missing = []
    for p in _tracked_text_files():
        if p.startswith(HISTORY) or p == "tests/test_repo_hygiene.py":
            continue
        with open(os.path.join(REPO, p), errors="replace") as f:
            for i, line in enumerate(f, 1):
                for m in PATH.finditer(line):
                    ref = m.group(1).rstrip(".")
                    if ref.startswith("llmq_ray/") and p == "tests/test_packaging.py":
                        continue  # paths inside the built wheel
                    if not os.path.exists(os.path.join(REPO, ref)):
                        missing.append(f"{p}:{i}: {ref}")
    assert not missing, "\n".join(missing)


def test_benchmarks_hold_named_recipes_not_per_call_scripts():
    tracked = subprocess.run(["git", "ls-files", "benchmarks"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    scripts = [p for p in tracked if p.endswith(".sh") and os.path.isfile(os.path.join(REPO, p))]
    with open(os.path.join(REPO, "benchmarks", "README.md")) as f:
        listed = f.read()
    per_call = [p for p in tracked if p.startswith("benchmarks/archive/")
                or (os.path.basename(p).startswith("device_") and p != "benchmarks/device_lib.sh")]
    bad = [f"{p}: a per-call script (keep it in git history; name its commit in benchmarks/LOG.md)" for p in per_call]
    bad += [f"{p}: a shell script benchmarks/README.md does not list as a recipe" for p in scripts
            if p not in per_call and f"`{os.path.basename(p)}" not in listed]
    assert not bad, "\n".join(bad)

