"""What a checkpoint is: its folder and file names, and the schema of its manifest (building, reading, and the
entries a resumed rank takes from it). The lowest module of ``llmq_ray.checkpoints``: it imports no other.

Layout::

    <ckpt_dir>/step_00000012/               step = optimizer updates completed (resume at 0-based step 12)
        rank_00000.safetensors              rank 0's shard: 1-D "master", "m", "v" over the flat range
        rank_00001.safetensors              [start, end) (also in the file's metadata), in their own dtypes
        manifest.json                       written LAST: step, model config, options, data state per rank,
                                            RNG, world size, layout numel, each file's size and sha256, and
                                            (--fp8-delayed-swiglu-scale) each worker's FP8 scale state

A checkpoint being written lives in ``<ckpt_dir>/.step_00000012.tmp-<id>/`` (local.py renames it into place);
every reader ignores such folders. On an object store a checkpoint is the ``step_*`` prefix with the same
files (remote.py). Checkpoints are safetensors + JSON only: loading one never unpickles anything.

Importing this module does not import torch (``import torch`` takes about a second): the CLI resolves
--continue in a pre-flight before anything heavy is loaded. ``rng_state`` / ``restore_rng`` import it when
called.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from llmq_ray import storage
from llmq_ray.errors import CheckpointError
from llmq_ray.model.config import ModelConfig
from llmq_ray.model.params import ParamLayout

FORMAT = "llmq-ray-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE_NAMES = ("master", "m", "v")
FP8_SCALE_STATE = "fp8_scale_state"  # the manifest's key of the delayed FP8 scales, one entry per worker
STEP_RE = re.compile(r"^step_(\d{8})$")
TMP_RE = re.compile(r"^\.step_(\d{8})\.tmp-[0-9a-zA-Z]+$")
OLD_RE = re.compile(r"^\.step_(\d{8})\.old-[0-9a-zA-Z]+$")  # a replaced checkpoint, removed after the rename
RANK_FILE_RE = re.compile(r"^rank_(\d{5})\.safetensors$")


class CheckpointWarning(UserWarning):
    """A checkpoint folder was skipped (incomplete or corrupt), or a risky retention setting was chosen."""


def reason_of_os_error(exc: BaseException) -> str:
    """The short reason of an I/O failure for a sentence: an OSError's strerror, else the message."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


# ---------------------------------------------------------------------------------------------------- names
def step_name(step: int) -> str:
    """``step_XXXXXXXX`` (8 digits) for a step number."""
    step = int(step)
    if not 0 <= step <= 99_999_999:
        raise CheckpointError(f"checkpoint step {step} is outside [0, 99999999]; it cannot be named step_XXXXXXXX.")
    return f"step_{step:08d}"


def step_dir(ckpt_dir: str, step: int) -> str:
    """The final folder of the checkpoint of ``step`` inside ``ckpt_dir`` (a path or a URI)."""
    return storage.join(ckpt_dir, step_name(step))


def rank_file_name(rank: int) -> str:
    """``rank_RRRRR.safetensors`` (5 digits)."""
    return f"rank_{int(rank):05d}.safetensors"


def step_of(folder: str) -> int | None:
    """The step of a ``step_XXXXXXXX`` folder path, else None."""
    m = STEP_RE.match(os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else None


def step_of_tmp(tmp_dir: str) -> int | None:
    """The step of a ``.step_XXXXXXXX.tmp-<id>`` folder path, else None."""
    m = TMP_RE.match(os.path.basename(os.path.normpath(tmp_dir)))
    return int(m.group(1)) if m else None


def list_step_dirs(ckpt_dir: str) -> list[tuple[int, str]]:
    """All ``step_*`` folders of ``ckpt_dir`` as (step, path), newest first (tmp folders never included).
    On an object store: the ``step_*`` prefixes, complete or not (the manifest decides)."""
    if storage.is_remote(ckpt_dir):
        return sorted(((int(m.group(1)), step_dir(ckpt_dir, int(m.group(1))))
                       for m in map(STEP_RE.match, storage.list_names(ckpt_dir)) if m), reverse=True)
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = STEP_RE.match(name)
        if m and os.path.isdir(os.path.join(ckpt_dir, name)):
            out.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(out, reverse=True)


def has_manifest(folder: str) -> bool:
    """The folder (or checkpoint URI) has its manifest: the cheapest sign of a published checkpoint."""
    path = storage.join(folder, MANIFEST)
    return storage.size_of(path) is not None if storage.is_remote(folder) else os.path.isfile(path)


def folder_exists(folder: str) -> bool:
    """A checkpoint folder is there: a local directory, or on a store any object under the prefix."""
    if storage.is_remote(folder):
        return bool(storage.list_names(folder))
    return os.path.isdir(folder)


# ---------------------------------------------------------------------------------------------------- manifest
def rng_state(seed: int | None = None) -> dict:
    """The RNG state of this process, JSON-ready: {"seed", "torch_cpu" (base64 of torch.get_rng_state())}.

    The training math itself draws no random numbers from global generators (init and the stochastic
    rounding seeds are pure functions of the run's seed, the step and the flat offset), so ``seed`` is what
    reproduces a run; the torch CPU state is saved for code that does use the global generator."""
    import torch

    state = torch.get_rng_state().numpy().tobytes()
    return {"seed": None if seed is None else int(seed), "torch_cpu": base64.b64encode(state).decode("ascii")}


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Set torch's CPU generator back to a ``rng_state()`` (no-op when the entry is absent)."""
    encoded = rng.get("torch_cpu") if rng else None
    if encoded:
        import torch

        raw = base64.b64decode(encoded)
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def build_manifest(step: int, *, config: ModelConfig, world_size: int, options: Any = None,
                   data_state: Sequence[Mapping | None] | None = None, rng: Mapping | None = None,
                   extra: Mapping[str, Any] | None = None,
                   fp8_scale_state: Sequence[Mapping[str, Sequence[float]] | None] | None = None,
                   tensor_parallel: int = 1) -> dict:
    """The manifest of a checkpoint, minus its "files" (which ``finalize_checkpoint`` / ``remote.publish`` add).

    step: optimizer updates completed (the resumed run's first 0-based step). config: the ModelConfig
    (stored with dataclasses.asdict). world_size: the number of optimizer shard files. options: the run's
    options (a dataclass or a dict). data_state: one TokenStream.state() (or None) per worker that trained.
    That is one per shard file, except under --zero-scope node, where every node held a copy of the shards and
    only the first node's were saved: then the N x world_size workers' states are kept, and their count goes
    into the manifest as "data_world_size" (``data_world_size`` reads it). rng: ``rng_state(seed)``.
    fp8_scale_state: one entry per worker in rank order ({name: [L floats]}, empty or None for a worker
    without it; ``fp8_scale_state_for_rank`` reads it back), stored only when some worker has one, with the
    workers' ``tensor_parallel`` size (the entries of tensor-parallel ranks hold their own columns). extra:
    more JSON keys (e.g. the loss history, the export dtype); they must not collide with the reserved ones.
    """
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": int(world_size),
        "layout_numel": ParamLayout(config).numel,
        "model_config": dataclasses.asdict(config),
        "train_options": _jsonable(options),
        "data_state": [None if s is None else dict(s) for s in (data_state or [None] * int(world_size))],
        "rng": dict(rng) if rng is not None else None,
    }
    n_data = len(manifest["data_state"])
    if n_data == 0 or n_data % int(world_size):
        raise CheckpointError(f"build_manifest: {n_data} data states for world size {world_size}.")
    if n_data != int(world_size):
        manifest["data_world_size"] = n_data
    if fp8_scale_state is not None and any(fp8_scale_state):
        manifest[FP8_SCALE_STATE] = {"tensor_parallel": int(tensor_parallel),
                                     "workers": [{k: [float(x) for x in v] for k, v in (s or {}).items()}
                                                 for s in fp8_scale_state]}
    for key, value in (extra or {}).items():
        if key in manifest or key in ("files", FP8_SCALE_STATE):
            raise CheckpointError(f"build_manifest: extra key {key!r} is reserved.")
        manifest[key] = value
    try:
        json.dumps(manifest)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest of step {step} is not JSON-serializable ({exc}).") from exc
    return manifest


def read_manifest(folder: str) -> dict:
    """Parse and sanity-check ``folder/manifest.json`` (a local folder or a checkpoint URI); CheckpointError
    naming the folder otherwise."""
    name = os.path.basename(os.path.normpath(folder))
    path = storage.join(folder, MANIFEST)
    try:
        if storage.is_remote(folder):
            text = storage.read_bytes(path).decode()
        else:
            with open(path) as f:
                text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}: it is incomplete (interrupted while "
                              f"being written?); resume from another one.") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {folder}: cannot read {MANIFEST} ({reason_of_os_error(exc)}).") from exc
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); checkpoint {name} is "
                              f"corrupt, resume from another one.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an llmq-ray checkpoint manifest.")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {version!r}; this llmq-ray reads version "
                              f"{FORMAT_VERSION}.")
    for key in ("step", "world_size", "layout_numel", "model_config", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path} lacks the entry {key!r}; checkpoint {name} is corrupt.")
    return manifest


def check_coverage(records: Sequence[Mapping], numel: int, where: str) -> None:
    """The saved ranges must tile [0, numel) exactly (in any order, empty ranges allowed)."""
    pos = 0
    for r in sorted(records, key=lambda r: (int(r["start"]), int(r["end"]))):
        s, e = int(r["start"]), int(r["end"])
        if s == e:
            continue
        if s != pos or e < s:
            raise CheckpointError(f"{where}: the shard ranges do not tile [0, {numel}) (gap or overlap at "
                                  f"{r.get('name', '?')} [{s}, {e}), expected a start of {pos}).")
        pos = e
    if pos != numel:
        raise CheckpointError(f"{where}: the shards cover [0, {pos}), the model has {numel} parameters.")


def check_config(manifest: Mapping[str, Any], expected_config: ModelConfig, folder: str = "") -> None:
    """CheckpointError naming the first differing field when the checkpoint is of another model.

    The cosmetic ``name`` field is not compared (a preset and an HF folder of the same shape match)."""
    saved = manifest["model_config"]
    ours = json.loads(json.dumps(dataclasses.asdict(expected_config)))
    diffs = [k for k in ours if k != "name" and saved.get(k, "<absent>") != ours[k]]
    diffs += [k for k in saved if k not in ours]
    if diffs:
        k = diffs[0]
        name = os.path.basename(os.path.normpath(folder)) or f"step {manifest.get('step')}"
        more = f" (and {len(diffs) - 1} more fields differ)" if len(diffs) > 1 else ""
        raise CheckpointError(f"checkpoint {name} was written for {k}={saved.get(k, '<absent>')}, this run has "
                              f"{ours.get(k, '<absent>')}{more}; resume with the same model or use another "
                              f"checkpoint dir.")


def data_world_size(manifest: Mapping[str, Any]) -> int:
    """The number of workers that trained the checkpoint (each read its own batches): "world_size" (the
    shard files), unless node-scoped ZeRO kept one copy of the shards for several nodes ("data_world_size")."""
    return int(manifest.get("data_world_size", manifest["world_size"]))


def data_state_for_rank(manifest: Mapping[str, Any], rank: int, world_size: int) -> dict | None:
    """The TokenStream state that rank ``rank`` of ``world_size`` (workers) restores from.

    Same number of workers as saved (``data_world_size``): the rank's own saved state. Another number: rank
    0's (ranks advance in lockstep, so every saved state holds the same epoch and cursor; TokenStream.restore
    rescales the cursor from the state's world_size, which is filled in from the manifest when the state
    lacks it)."""
    states = manifest.get("data_state") or []
    if not states:
        return None
    if data_world_size(manifest) == int(world_size) and rank < len(states):
        return states[rank]
    first = states[0]
    if first is not None and any(s is not None and (s.get("epoch"), s.get("cursor")) != (first.get("epoch"),
                                                                                          first.get("cursor"))
                                 for s in states):
        warnings.warn(f"checkpoint of step {manifest.get('step')}: the saved ranks' data positions differ; "
                      f"resuming on another world size from rank 0's.", CheckpointWarning, stacklevel=2)
    if first is None:
        return None
    # the cursor counts windows per saved rank: TokenStream.restore needs the saved world size to rescale it
    return {**first, "world_size": int(first.get("world_size", data_world_size(manifest)))}


def fp8_scale_state_for_rank(manifest: Mapping[str, Any], rank: int, world_size: int,
                             tensor_parallel: int = 1) -> dict[str, list[float]]:
    """The delayed FP8 scales (--fp8-delayed-swiglu-scale: {name: [L] per-layer maxima}) that worker ``rank`` of
    ``world_size`` (in groups of ``tensor_parallel``) restores; {} when the checkpoint has none (written before
    they were saved, or by a run without the delayed scale): the run then measures afresh in its first step, as
    a fresh run does.

    The same number of workers and tensor-parallel size as saved: the worker's own entry (each data-parallel
    rank saw its own micro-batches, each tensor-parallel rank its own columns, so the entries differ), which
    makes the resume bit-exact. Any other shape: the elementwise maximum over every saved worker's entry -- the
    maximum over the union of what they measured, what one worker seeing all of it would have measured, so
    the first step after such a resume saturates nothing the saved ones would not have."""
    saved = manifest.get(FP8_SCALE_STATE) or {}
    entries = [e or {} for e in saved.get("workers") or []]
    if not entries:
        return {}
    same = len(entries) == int(world_size) and int(saved.get("tensor_parallel", 1)) == int(tensor_parallel)
    if same and 0 <= int(rank) < len(entries):
        return {k: list(v) for k, v in entries[int(rank)].items()}
    out: dict[str, list[float]] = {}
    for name in sorted({k for e in entries for k in e}):
        rows = [e[name] for e in entries if name in e]
        if len({len(r) for r in rows}) != 1:
            raise CheckpointError(f"checkpoint of step {manifest.get('step')}: its {FP8_SCALE_STATE} entries of "
                                  f"{name!r} differ in length; the checkpoint is corrupt.")
        out[name] = [max(col) for col in zip(*rows)]
    return out
