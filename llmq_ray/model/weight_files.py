"""Where an HF checkpoint's tensors are: the safetensors files of a model folder, an index or one file.

Torch-free on purpose (safetensors headers are read through its numpy framework), so that the check before a
run (llmq_ray/train/trainer.py) can find a model folder's weights without importing torch; the loading itself is
llmq_ray/model/hf_io.py's ``load_hf_weights``.
"""

from __future__ import annotations

import json
import os

from llmq_ray.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def find_tensor_files(path: str) -> tuple[str, dict[str, str]]:
    """Resolve ``path`` to (description for errors, {tensor name: safetensors file}).

    ``path`` is a folder (``model.safetensors.index.json`` preferred, then ``model.safetensors``, then a
    single other ``*.safetensors``), a ``.safetensors`` file, or an ``.index.json`` file.
    """
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            return _read_index(index)
        single = os.path.join(path, SINGLE_FILE)
        if not os.path.isfile(single):
            found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if len(found) != 1:
                has_bin = any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(path))
                hint = (" (pickled .bin/.pt weights are never loaded; convert them to safetensors first)"
                        if has_bin else "")
                what = "no safetensors file" if not found else f"{len(found)} safetensors files but no index"
                raise CheckpointError(f"{path}: {what} found; expected {SINGLE_FILE} or {INDEX_FILE}{hint}.")
            single = os.path.join(path, found[0])
        return single, _file_names(single)
    if path.endswith(".json") and os.path.isfile(path):
        return _read_index(path)
    if path.endswith(".safetensors") and os.path.isfile(path):
        return path, _file_names(path)
    raise CheckpointError(f"{path}: no such safetensors file, index.json or model folder.")


def _read_index(index: str) -> tuple[str, dict[str, str]]:
    """Read a sharded checkpoint's index: {tensor name: absolute shard path}; every shard must exist."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index (expected JSON with a 'weight_map' "
                              f"object; {exc}).") from exc
    folder = os.path.dirname(os.path.abspath(index))
    out = {}
    for name, shard in weight_map.items():
        file = os.path.join(folder, shard)
        if not os.path.isfile(file):
            raise CheckpointError(f"{index}: shard file {shard!r} (holding {name!r}) does not exist in {folder}.")
        out[name] = file
    return index, out


def _file_names(file: str) -> dict[str, str]:
    """{tensor name: ``file``} from the file's header (nothing else is read)."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            return {name: file for name in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file}: cannot be read as safetensors ({exc}).") from exc
