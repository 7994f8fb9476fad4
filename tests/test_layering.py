"""Imports point one way: examples -> train -> actors -> observe -> checkpoints -> engine -> parallel -> model ->
data_pipeline -> backends.

A module's layer is its folder: ``llmq_ray/<layer>/`` for model, parallel, engine, checkpoints, observe and train, and the
top-level folders ``backends/``, ``data_pipeline/``, ``actors/`` and ``examples/``. The modules directly in
``llmq_ray/`` are the leaf (errors, the settings package and small utilities that import nothing above them): everyone may
import them. A module may import from its own layer, from a lower one and from the leaf. The test parses every
module with ``ast`` -- imports inside functions count too, since a lazy import is still a dependency -- and fails
naming the file, the line and the arrow that points up.
"""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ORDER = ["leaf", "backends", "data_pipeline", "model", "parallel", "engine", "checkpoints", "observe", "actors",
         "train", "examples"]
SUBPACKAGES = {"model", "parallel", "engine", "checkpoints", "observe", "train"}
FOLDERS = {"backends": "backends", "data_pipeline": "data_pipeline", "actors": "actors"}
# the only modules allowed directly in llmq_ray/: the leaf
# (settings is a package of the leaf: llmq_ray/settings/ imports nothing above it either)
LEAF = {"__init__", "errors", "settings", "storage", "host_memory", "lr_schedule", "heap", "net"}


def _layer_of_module(name: str) -> str | None:
    """The layer of a dotted module name of the llmq_ray namespace (None: not ours)."""
    parts = name.split(".")
    if parts[0] != "llmq_ray":
        return None
    if len(parts) == 1:
        return "leaf"
    if parts[1] in FOLDERS:
        return FOLDERS[parts[1]]
    if parts[1] in SUBPACKAGES:
        return parts[1]
    if parts[1] in LEAF:
        return "leaf"
    if parts[1] == "LLMQTrainer":  # the lazy top-level re-export
        return "train"
    raise AssertionError(f"llmq_ray.{parts[1]} is in no layer: put it in a subpackage (or LEAF in "
                         "tests/test_layering.py if everyone may import it)")


def _sources():
    for top, layer in [("llmq_ray", None), ("backends", "backends"), ("actors", "actors"),
                       ("data_pipeline", "data_pipeline"), ("examples", "examples")]:
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, REPO)
                    if layer is None:
                        sub = os.path.relpath(path, os.path.join(REPO, "llmq_ray")).split(os.sep)
                        own = _layer_of_module("llmq_ray." + ".".join(sub)[:-3])
                        if sub == ["__init__.py"]:
                            own = "examples"  # the package's public face: lazily re-exports LLMQTrainer
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
        if name.endswith(".py"):
            _layer_of_module(f"llmq_ray.{name[:-3]}")
        elif os.path.isdir(os.path.join(REPO, "llmq_ray", name)) and name != "__pycache__":
            assert name in SUBPACKAGES or name in LEAF, f"llmq_ray/{name}/ is not a known layer"


def test_every_layer_says_its_job():
    import importlib

    for sub in sorted(SUBPACKAGES):
        doc = importlib.import_module(f"llmq_ray.{sub}").__doc__
        assert doc and len(doc.split()) > 10, f"llmq_ray/{sub}/__init__.py has no docstring saying its job"


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


def test_the_model_reads_weights_through_typed_views():
    """The forward/backward addresses parameters as ``w.blocks[l].qkv_w`` (llmq_ray/model/params.py), not by
    composing the layout's string names; the names stay in the layout, the HF mapping and the checkpoints."""
    import re

    composed = []
    for name in ("decoder.py", "llama.py", "gpt2.py"):
        src = open(os.path.join(REPO, "llmq_ray", "model", name)).read()
        composed += re.findall(r"""\b[wg]\[\s*(?:f?["']|p\s*\+)|f?["']layers\.""", src)
    assert not composed, composed


def test_only_the_schedule_makes_cuda_streams():
    """Every side stream comes from llmq_ray/engine/schedule.py (by name, made once): no other module of the
    package creates one."""
    found = []
    for top in ("llmq_ray", "backends", "actors", "data_pipeline"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    for i, line in enumerate(open(path), 1):
                        if "torch.cuda.Stream(" in line:
                            found.append(f"{os.path.relpath(path, REPO)}:{i}")
    assert [x.split(":")[0] for x in found] == ["llmq_ray/engine/schedule.py"], found


def test_the_coordinator_imports_and_writes_manifests_without_torch():
    """The coordinator actor's process never needs torch: importing it (with the worker class it creates and the
    placement) and building a checkpoint manifest must not import torch -- which takes ~3 s on a small machine,
    paid by every run's start-up (actors/worker.py says why its imports are inside its methods)."""
    code = """
import sys
from llmq_ray.actors import coordinator, placement, worker
from llmq_ray.actors.checkpointing import _manifest_of
from llmq_ray.actors.plan import RunPlan
from llmq_ray.model.config import PRESETS
from llmq_ray.settings import make_settings
assert "torch" not in sys.modules, "import"
spec = RunPlan(settings=make_settings(model="tiny"), world_size=2)
manifest, records = _manifest_of([({"rank": 0}, {"cursor": 1}), ({"rank": 1}, {"cursor": 1})], spec,
                                 PRESETS["tiny"], 3, {})
assert manifest["world_size"] == 2 and manifest["rng"] == {"seed": 42}, manifest
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _model_raises(name: str) -> list[str]:
    """file:line of every ``raise <name>(...)`` under llmq_ray/model/ (parsed with ast)."""
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "llmq_ray", "model")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    if isinstance(node, ast.Raise) and node.exc is not None:
                        call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                        if isinstance(call, ast.Name) and call.id == name:
                            found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    return found


def test_the_model_raises_no_settings_error():
    """The model asserts its invariants (ValueError, flag-free); the rules between settings are checked once, in
    llmq_ray/settings/rules.py and llmq_ray/train/model_checks.py, before Ray starts. A model file that cannot be
    used is a ModelConfigError (a ConfigError subclass of its own, naming the file, not a flag)."""
    assert not _model_raises("ConfigError"), _model_raises("ConfigError")
    assert _model_raises("ModelConfigError") and _model_raises("ValueError")  # the scan sees raises at all


def test_no_block_code_under_model_names_parallelism_or_offloading():
    """Tensor parallelism and offloading are applied from outside (llmq_ray/parallel/, llmq_ray/engine/): under
    llmq_ray/model/ those words may appear in comments and docstrings only, never in code."""
    import io
    import re
    import tokenize

    found = []
    for root, _, files in os.walk(os.path.join(REPO, "llmq_ray", "model")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            with open(path) as fh:
                toks = list(tokenize.generate_tokens(io.StringIO(fh.read()).readline))
            for i, tok in enumerate(toks):
                if tok.type == tokenize.NAME and re.search(r"tensor_parallel|offload", tok.string):
                    found.append(f"{os.path.relpath(path, REPO)}:{tok.start[0]} {tok.string}")
    assert not found, found


def test_no_flag_name_in_the_errors_below_the_train_layer():
    """The model, the parallelisms and the engine receive settings, never flags: an error they raise says what does
    not fit in their own words (the settings' rules and the train layer name the flags, before Ray starts)."""
    import re

    flag = re.compile(r"--[a-z][a-z0-9]+(-[a-z0-9]+)*")
    found = []
    for layer in ("model", "parallel", "engine"):
        for root, _, files in os.walk(os.path.join(REPO, "llmq_ray", layer)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(root, f)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    if isinstance(node, ast.Raise) and node.exc is not None:
                        for sub in ast.walk(node.exc):
                            if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and flag.search(sub.value):
                                found.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {flag.search(sub.value)[0]}")
    assert not found, found
