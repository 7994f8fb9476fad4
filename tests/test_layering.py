"""Imports point one way: examples -> train -> actors -> engine -> model -> backends.

Every module of the ``llmq_ray`` namespace belongs to one layer (``LAYERS`` below; the folders ``backends/``,
``actors/`` and ``data_pipeline/`` are layers of their own). A module may import from its own layer, from a lower
one, and from the leaf modules everyone may use (errors, options and small utilities that import nothing above
them). The test parses every module with ``ast`` -- imports inside functions count too, since a lazy import is
still a dependency -- and fails naming the file, the line and the arrow that points up.

``llmq_ray/`` is still one flat folder, so its modules are mapped to layers by name here; when it is split into
subpackages the table becomes the folder names.
"""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ORDER = ["leaf", "backends", "data_pipeline", "model", "engine", "observe", "actors", "train", "examples"]
LAYERS = {
    "leaf": {"errors", "options", "config", "host_memory", "lr_schedule", "metrics", "heap"},
    "model": {"params", "model", "linear", "hf_io", "generate", "tokenizer_files",
              # the block wgrads' side stream: used by the linears; the planned schedule will own it
              "wgrad_overlap"},
    "engine": {"engine", "zero3", "offload", "update_overlap", "cuda_graphs", "optim", "train_loop",
               "checkpoint", "resume", "spike_guard"},
    "observe": {"progress", "runlog", "wandb_logger", "gpu_stats", "memory_table"},
    "train": {"trainer", "cli", "run_defaults", "config_file", "preflight", "stop_signals", "default_data"},
}
FOLDERS = {"backends": "backends", "data_pipeline": "data_pipeline", "actors": "actors"}


def _layer_of_module(name: str) -> str | None:
    """The layer of a dotted module name of the llmq_ray namespace (None: not ours)."""
    parts = name.split(".")
    if parts[0] != "llmq_ray":
        return None
    if len(parts) == 1:
        return "leaf"
    if parts[1] in FOLDERS:
        return FOLDERS[parts[1]]
    for layer, mods in LAYERS.items():
        if parts[1] in mods:
            return layer
    raise AssertionError(f"llmq_ray.{parts[1]} is in no layer: add it to LAYERS in tests/test_layering.py")


def _sources():
    for top, layer in [("llmq_ray", None), ("backends", "backends"), ("actors", "actors"),
                       ("data_pipeline", "data_pipeline"), ("examples", "examples")]:
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, REPO)
                    if layer is None:
                        mod = f[:-3]
                        own = "leaf" if mod == "__init__" else _layer_of_module(f"llmq_ray.{mod}")
                    else:
                        own = layer
                    yield rel, path, own


def _imports(path: str):
    tree = ast.parse(open(path).read(), path)
    package = os.path.relpath(os.path.dirname(path), REPO).split(os.sep)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside its own folder
                base = {"backends": "llmq_ray.backends", "actors": "llmq_ray.actors",
                        "data_pipeline": "llmq_ray.data_pipeline"}.get(package, "llmq_ray")
                yield node.lineno, f"{base}.{node.module}" if node.module else base
            elif node.module:
                yield node.lineno, node.module
                if node.module == "llmq_ray":
                    for a in node.names:
                        yield node.lineno, f"llmq_ray.{a.name}"


def test_every_module_is_in_a_layer():
    for name in os.listdir(os.path.join(REPO, "llmq_ray")):
        if name.endswith(".py") and name != "__init__.py":
            _layer_of_module(f"llmq_ray.{name[:-3]}")


def test_imports_point_down():
    up = []
    for rel, path, own in _sources():
        for line, name in _imports(path):
            target = _layer_of_module(name)
            if target is None or target == "leaf" or target == own:
                continue
            if ORDER.index(target) > ORDER.index(own):
                up.append(f"{rel}:{line}: {own} imports {name} ({target})")
    assert not up, "imports that point up:\n" + "\n".join(up)
