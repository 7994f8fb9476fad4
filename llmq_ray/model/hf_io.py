"""Weights in and out in Hugging Face format (safetensors), for ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``LlamaForCausalLM`` and ``GPT2LMHeadModel``.

Our parameters live in one flat buffer (``llmq_ray.model.params.ParamLayout``); HF checkpoints hold one tensor per
``nn.Linear`` / norm. The two differ only in naming and in two fusions, so the whole translation is a table
of rows:

=============================================  ==========================================  ===================
HF name                                        our slot [rows]                             HF shape
=============================================  ==========================================  ===================
model.embed_tokens.weight                      embed                                       [V, C]
lm_head.weight (absent when tied)              lm_head                                     [V, C]
model.layers.{l}.self_attn.q_proj.weight       layers.{l}.qkv_w [0, Hq*D)                  [Hq*D, C]
model.layers.{l}.self_attn.k_proj.weight       layers.{l}.qkv_w [Hq*D, (Hq+Hkv)*D)         [Hkv*D, C]
model.layers.{l}.self_attn.v_proj.weight       layers.{l}.qkv_w [(Hq+Hkv)*D, (Hq+2Hkv)*D)  [Hkv*D, C]
model.layers.{l}.self_attn.{q,k,v}_proj.bias   layers.{l}.qkv_b (same rows; Qwen2 only)    [H*D]
model.layers.{l}.self_attn.o_proj.weight       layers.{l}.out_w                            [C, Hq*D]
model.layers.{l}.mlp.up_proj.weight            layers.{l}.up_gate_w [0, I)                 [I, C]
model.layers.{l}.mlp.gate_proj.weight          layers.{l}.up_gate_w [I, 2I)                [I, C]
model.layers.{l}.mlp.down_proj.weight          layers.{l}.down_w                           [C, I]
model.layers.{l}.input_layernorm.weight        layers.{l}.ln1_w                            [C]
model.layers.{l}.post_attention_layernorm...   layers.{l}.ln2_w                            [C]
model.norm.weight                              final_norm                                  [C]
=============================================  ==========================================  ===================

GPT-2 (``GPT2LMHeadModel``) has its own table. Its projections are ``Conv1D`` modules that store the weight
*transposed*, [in, out], so each of the four matrices is the transpose of one whole slot of ours (``transposed``
in ``HFTensor``; c_attn's columns [q | k | v] are our rows [q; k; v]):

=============================================  ==========================================  ===================
HF name                                        our slot                                    HF shape
=============================================  ==========================================  ===================
transformer.wte.weight                         embed                                       [V, C]
transformer.wpe.weight                         pos_embed                                   [P, C]
transformer.h.{l}.ln_1.weight / .bias          layers.{l}.ln1_w / ln1_b                    [C]
transformer.h.{l}.attn.c_attn.weight           layers.{l}.qkv_w, transposed                [C, 3C]
transformer.h.{l}.attn.c_attn.bias             layers.{l}.qkv_b                            [3C]
transformer.h.{l}.attn.c_proj.weight / .bias   layers.{l}.out_w (transposed) / out_b       [C, C] / [C]
transformer.h.{l}.ln_2.weight / .bias          layers.{l}.ln2_w / ln2_b                    [C]
transformer.h.{l}.mlp.c_fc.weight / .bias      layers.{l}.up_w (transposed) / up_b         [C, I] / [I]
transformer.h.{l}.mlp.c_proj.weight / .bias    layers.{l}.down_w (transposed) / down_b     [I, C] / [C]
transformer.ln_f.weight / .bias                final_norm / final_norm_b                   [C]
=============================================  ==========================================  ===================

Checkpoints saved from the bare ``GPT2Model`` (OpenAI's published ``model.safetensors``) name the same tensors
without the ``transformer.`` prefix; loading takes either. Their causal-mask buffers (``attn.bias``,
``attn.masked_bias``) are not parameters and are skipped.

Because fused tensors are split along rows (dim 0) and our views are row-major, every HF tensor maps to one
*contiguous* range of the flat buffer: loading is a sequence of ``copy_`` calls into views, exporting a
sequence of slices. Both directions are exact (bit for bit) when the dtypes agree.

Safety and memory: checkpoints are read only through ``safetensors.safe_open`` (no pickle, ever), one tensor
at a time, so peak host memory is the flat buffer plus the largest single tensor. Exports are written into a
temporary sibling folder and renamed into place, so an interrupted export never leaves a folder that looks
complete.

Exports to an object store (``export_hf_to_uri``; ``--out-dir s3://bucket/run`` puts the export at
``s3://bucket/run/export``): a store has no rename, so the folder is written into a local staging folder on
the exporting worker's node (``$LLMQ_RAY_CACHE/staging``) and uploaded file by file (``upload_export``): first
whatever export was at the URI is removed (its ``_EXPORT_COMPLETE`` marker first), then every file but
``config.json``, then ``config.json``, then the marker ``_EXPORT_COMPLETE`` last (JSON: every file's name and
size). **An export on a store is complete when ``_EXPORT_COMPLETE`` is there**, and its files are then
exactly the ones the marker lists; a reader that only looks for ``config.json`` never finds it beside missing
weights either. ``set_aside_export`` keeps an earlier run's export by copying it (marker last) to another
prefix before the new one is uploaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import warnings
from typing import Iterable

import torch

from llmq_ray import storage
from llmq_ray.model.config import ModelConfig
from llmq_ray.errors import CheckpointError, ModelConfigError
from llmq_ray.model.params import ParamLayout
from llmq_ray.model.weight_files import INDEX_FILE, SINGLE_FILE, find_tensor_files


# Files copied from ``tokenizer_source`` into an export when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "tokenizer.model", "added_tokens.json", "chat_template.jinja")

# Tensors some checkpoints carry that are not parameters (older transformers saved the rotary buffer; GPT-2
# checkpoints its causal-mask buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

# Export dtypes and the names config.json uses for them.
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Above this many bytes an export is split into several shard files plus an index (HF's own convention).
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one HF tensor lives in our layout: rows [row_start, row_end) of slot ``slot``.

    ``shape`` is the HF tensor's shape: (row_end - row_start,) + slot.shape[1:], or, ``transposed`` (GPT-2's
    Conv1D weights, always a whole 2-D slot), the slot's shape reversed: the HF tensor is the slot's transpose.
    """

    hf_name: str
    slot: str
    row_start: int
    row_end: int
    shape: tuple[int, ...]
    transposed: bool = False


def hf_tensor_map(layout: ParamLayout) -> dict[str, HFTensor]:
    """Every HF state-dict name of ``layout.cfg`` -> where it lives in the flat layout (in a stable order).

    The entries of one slot cover its rows exactly once, so filling all of them fills the whole buffer.
    """
    cfg = layout.cfg
    slots = layout.slots
    out: dict[str, HFTensor] = {}

    def add(hf_name: str, slot: str, start: int | None = None, end: int | None = None):
        full = slots[slot].shape
        start = 0 if start is None else start
        end = full[0] if end is None else end
        out[hf_name] = HFTensor(hf_name, slot, start, end, (end - start,) + tuple(full[1:]))

    if cfg.is_gpt2:
        return _gpt2_tensor_map(layout, add, out)

    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    add("model.embed_tokens.weight", "embed")
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", "lm_head")
    for layer in range(cfg.num_layers):
        hf, our = f"model.layers.{layer}.", f"layers.{layer}."
        for proj, (start, end) in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
            add(f"{hf}self_attn.{proj}.weight", our + "qkv_w", start, end)
            if cfg.qkv_bias:
                add(f"{hf}self_attn.{proj}.bias", our + "qkv_b", start, end)
        if cfg.qk_norm:
            add(f"{hf}self_attn.q_norm.weight", our + "q_norm_w")
            add(f"{hf}self_attn.k_norm.weight", our + "k_norm_w")
        add(f"{hf}self_attn.o_proj.weight", our + "out_w")
        add(f"{hf}mlp.up_proj.weight", our + "up_gate_w", 0, i)
        add(f"{hf}mlp.gate_proj.weight", our + "up_gate_w", i, 2 * i)
        add(f"{hf}mlp.down_proj.weight", our + "down_w")
        add(f"{hf}input_layernorm.weight", our + "ln1_w")
        add(f"{hf}post_attention_layernorm.weight", our + "ln2_w")
    add("model.norm.weight", "final_norm")
    return out


def _gpt2_tensor_map(layout: ParamLayout, add, out: dict[str, HFTensor]) -> dict[str, HFTensor]:
    """GPT-2's rows of ``hf_tensor_map`` (module docstring): the four Conv1D weights transposed."""
    cfg, slots = layout.cfg, layout.slots

    def conv1d(hf_name: str, slot: str):
        shape = slots[slot].shape
        out[hf_name] = HFTensor(hf_name, slot, 0, shape[0], (shape[1], shape[0]), transposed=True)

    add("transformer.wte.weight", "embed")
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", "lm_head")
    add("transformer.wpe.weight", "pos_embed")
    for layer in range(cfg.num_layers):
        hf, our = f"transformer.h.{layer}.", f"layers.{layer}."
        add(f"{hf}ln_1.weight", our + "ln1_w")
        add(f"{hf}ln_1.bias", our + "ln1_b")
        conv1d(f"{hf}attn.c_attn.weight", our + "qkv_w")
        add(f"{hf}attn.c_attn.bias", our + "qkv_b")
        conv1d(f"{hf}attn.c_proj.weight", our + "out_w")
        add(f"{hf}attn.c_proj.bias", our + "out_b")
        add(f"{hf}ln_2.weight", our + "ln2_w")
        add(f"{hf}ln_2.bias", our + "ln2_b")
        conv1d(f"{hf}mlp.c_fc.weight", our + "up_w")
        add(f"{hf}mlp.c_fc.bias", our + "up_b")
        conv1d(f"{hf}mlp.c_proj.weight", our + "down_w")
        add(f"{hf}mlp.c_proj.bias", our + "down_b")
    add("transformer.ln_f.weight", "final_norm")
    add("transformer.ln_f.bias", "final_norm_b")
    return out


def _embed_name(cfg: ModelConfig) -> str:
    """The HF name of the token embedding (what a tied LM head is)."""
    return "transformer.wte.weight" if cfg.is_gpt2 else "model.embed_tokens.weight"


def _view_of(views: dict[str, torch.Tensor], t: HFTensor) -> torch.Tensor:
    """The view of the flat buffer that holds HF tensor ``t`` (contiguous; for a ``transposed`` tensor the
    transpose of the whole slot, so a ``copy_`` into it or a copy out of it moves the HF layout)."""
    if t.transposed:
        return views[t.slot].t()
    return views[t.slot][t.row_start:t.row_end]


def _check_flat(layout: ParamLayout, flat: torch.Tensor) -> None:
    if flat.dim() != 1 or flat.numel() < layout.numel or not flat.is_floating_point():
        raise ValueError(f"flat must be a 1-D floating-point tensor of at least {layout.numel} elements, "
                         f"got shape {tuple(flat.shape)} and dtype {flat.dtype}")


# ====================================================================================== loading

def _open(file: str):
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file}: cannot be read as safetensors ({exc}).") from exc


def load_hf_weights(folder_or_file: str, layout: ParamLayout, flat: torch.Tensor) -> None:
    """Fill ``flat`` (1-D, any float dtype and device, >= layout.numel elements) from an HF checkpoint.

    ``folder_or_file``: a model folder (``model.safetensors`` or ``model.safetensors.index.json`` + shards),
    a ``.safetensors`` file or an index ``.json``. Tensors are read one by one through ``safe_open`` and cast
    (bf16 / fp16 / fp32 -> ``flat.dtype``) by ``copy_`` into their views, so nothing is unpickled and the
    whole checkpoint is never in memory at once.

    Tied models: a checkpoint's ``lm_head.weight`` is ignored (with a warning if it differs from the
    embedding). Tensors we have no slot for produce one warning (rotary ``inv_freq`` buffers and GPT-2's mask
    buffers silently). GPT-2: names without the ``transformer.`` prefix (a bare ``GPT2Model``'s) are read too.
    Raises CheckpointError naming the file and tensor for a missing tensor, a wrong shape, a non-float
    tensor, a missing shard, or a folder without safetensors.
    """
    _check_flat(layout, flat)
    source, where = find_tensor_files(folder_or_file)
    expected = hf_tensor_map(layout)
    tied = layout.cfg.tie_word_embeddings
    stored = {name: name for name in where}  # our HF name -> the name in the file
    if layout.cfg.is_gpt2:
        stored = {("transformer." + n if "transformer." + n in expected and "transformer." + n not in where else n): n
                  for n in where}
        where = {ours: where[n] for ours, n in stored.items()}
    embed_name = _embed_name(layout.cfg)
    for name, t in expected.items():
        if name not in where:
            hint = (" (the config says tie_word_embeddings=false; an untied model needs its own LM head)"
                    if name == "lm_head.weight" else "")
            raise CheckpointError(f"{source}: tensor {name!r} of shape {list(t.shape)} is missing{hint}.")
    extras = [n for n in where if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
              and not (tied and n == "lm_head.weight")]
    if extras:
        shown = ", ".join(extras[:5]) + (f" and {len(extras) - 5} more" if len(extras) > 5 else "")
        warnings.warn(f"{source}: ignoring {len(extras)} tensor(s) this {layout.cfg.architecture} model has "
                      f"no parameter for: {shown}.", stacklevel=2)

    views = layout.views(flat)
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(where[name], []).append(name)
    if tied and "lm_head.weight" in where:
        by_file.setdefault(where["lm_head.weight"], []).append("lm_head.weight")
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                shape = tuple(f.get_slice(stored[name]).get_shape())
                want = expected[embed_name if name == "lm_head.weight" and tied else name].shape
                if shape != want:
                    raise CheckpointError(f"{file}: tensor {stored[name]!r} has shape {list(shape)}, expected "
                                          f"{list(want)} for this config.")
                tensor = f.get_tensor(stored[name])
                if not tensor.is_floating_point():
                    raise CheckpointError(f"{file}: tensor {stored[name]!r} has dtype {tensor.dtype}, expected a "
                                          f"floating-point dtype (bf16, fp16 or fp32; quantized checkpoints "
                                          f"are not supported).")
                if name == "lm_head.weight" and tied:
                    _check_tied_head(file, tensor, views["embed"], embed_name)
                else:
                    _view_of(views, expected[name]).copy_(tensor)
                del tensor


def _check_tied_head(file: str, head: torch.Tensor, embed: torch.Tensor, embed_name: str) -> None:
    """A tied model uses the embedding as LM head; warn if the checkpoint's own head is different.

    Compared in the buffer's dtype, chunk by chunk, so a large vocabulary costs no extra full copy. The
    caller reads the head after the embedding (it is queued last, and the embedding's file comes first).
    """
    rows = 4096
    for r in range(0, head.shape[0], rows):
        if not torch.equal(head[r:r + rows].to(embed.device, embed.dtype), embed[r:r + rows]):
            warnings.warn(f"{file}: the config ties the LM head to the embedding, but this checkpoint's "
                          f"'lm_head.weight' differs from {embed_name!r}; using the embedding "
                          f"(check tie_word_embeddings in config.json).", stacklevel=3)
            return


# ====================================================================================== export

def hf_state_dict(layout: ParamLayout, flat: torch.Tensor, dtype: torch.dtype | None = None,
                  names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors (fresh, contiguous copies in ``dtype``, default flat.dtype) of ``names`` (default
    all), e.g. for ``model.load_state_dict(..., strict=False)`` in tests or for writing safetensors."""
    _check_flat(layout, flat)
    dtype = dtype or flat.dtype
    table = hf_tensor_map(layout)
    views = layout.views(flat)
    out = {}
    for name in (table if names is None else names):
        # copy=True: the result must not share storage with flat (safetensors refuses shared tensors and a
        # caller must not be able to write into the training buffer through it).
        out[name] = _view_of(views, table[name]).detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        # (a transposed GPT-2 weight is a strided view: .contiguous() writes it in HF's [in, out] layout)
    return out


def _plan_shards(table: dict[str, HFTensor], elem_bytes: int, max_bytes: int) -> list[list[str]]:
    """Greedy split of the tensors (in table order) into groups of at most ``max_bytes`` (a single larger
    tensor gets a group of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in table.items():
        nbytes = elem_bytes * int(torch.Size(t.shape).numel())
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def export_hf(out_dir: str, cfg: ModelConfig, layout: ParamLayout, flat: torch.Tensor,
              dtype: torch.dtype = torch.bfloat16, tokenizer_source: str | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write the model in ``flat`` as an HF folder that ``transformers.AutoModelForCausalLM`` loads.

    Writes ``config.json`` (``cfg.to_hf_dict`` with ``torch_dtype`` and transformers 5's ``dtype``),
    ``generation_config.json`` (bos/eos), the weights in ``dtype`` (bf16, fp16 or fp32) as
    ``model.safetensors`` -- or, above ``max_shard_bytes`` (5 GB by default, e.g. for >= 7B models),
    ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json`` -- and the tokenizer files
    found in the folder ``tokenizer_source``. A tied head writes no ``lm_head.weight``.

    Everything goes into a temporary sibling folder first, which then replaces ``out_dir`` by rename; an
    existing ``out_dir`` is swapped out only once the new one is complete. Only one shard's tensors are in
    memory at a time. Returns the absolute path of ``out_dir``.
    """
    if dtype not in _DTYPE_NAMES:
        raise ModelConfigError(f"export dtype {dtype} is not supported; use one of bfloat16, float16, float32.")
    if dataclasses.replace(layout.cfg, name=cfg.name) != cfg:
        raise ValueError(f"export_hf: the layout was built for config {layout.cfg.name!r}, which differs from "
                         f"the config {cfg.name!r} being exported")
    if cfg.architecture in ("llama", "qwen3") and cfg.qkv_bias:
        raise ModelConfigError(f"model config {cfg.name!r}: a llama model with QKV bias has no HF equivalent "
                          f"(HF's attention_bias also adds an o_proj bias); it cannot be exported.")
    _check_flat(layout, flat)
    tok_files: list[str] = []
    if tokenizer_source is not None:
        if os.path.isdir(tokenizer_source):
            tok_files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_source, f))]
        if not tok_files:
            raise ModelConfigError(f"tokenizer source {tokenizer_source!r} is not a folder with tokenizer files "
                              f"(expected some of {', '.join(TOKENIZER_FILES[:5])}).")

    out_dir = os.path.abspath(out_dir)
    parent, base = os.path.dirname(out_dir), os.path.basename(out_dir)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise CheckpointError(f"{out_dir}: export target exists and is not a folder.")
        if os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "config.json")):
            raise CheckpointError(f"{out_dir}: export target is a non-empty folder that is not an HF model "
                                  f"(no config.json); refusing to replace it, choose another folder.")
    os.makedirs(parent, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(parent, f".{base}.tmp-{tag}")
    os.makedirs(tmp)
    try:
        _write_export(tmp, cfg, layout, flat, dtype, max_shard_bytes)
        for f in tok_files:
            shutil.copyfile(os.path.join(tokenizer_source, f), os.path.join(tmp, f))
        _swap_into_place(tmp, out_dir, os.path.join(parent, f".{base}.old-{tag}"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


EXPORT_MARKER = "_EXPORT_COMPLETE"  # written last into an export on an object store (the module docstring)


def export_hf_to_uri(uri: str, cfg: ModelConfig, layout: ParamLayout, flat: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16, tokenizer_source: str | None = None,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """``export_hf`` to a URI (an object store): written into a staging folder on this node, then
    ``upload_export``; the staging folder is removed. Returns ``uri``."""
    folder = storage.staging_dir("export")
    try:
        local = export_hf(os.path.join(folder, "export"), cfg, layout, flat, dtype=dtype,
                          tokenizer_source=tokenizer_source, max_shard_bytes=max_shard_bytes)
        upload_export(local, uri)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return uri


def upload_export(local_dir: str, uri: str) -> None:
    """Upload the export folder ``local_dir`` to ``uri`` so that no reader ever sees half of it: the export
    there before is removed (marker first), then every file but config.json, config.json, the marker last."""
    files = sorted(os.path.relpath(os.path.join(d, f), local_dir).replace(os.sep, "/")
                   for d, _, names in os.walk(local_dir) for f in names)
    order = [f for f in files if f != "config.json"] + [f for f in files if f == "config.json"]
    there = storage.list_files(uri)
    if there and EXPORT_MARKER not in there and "config.json" not in there:
        raise CheckpointError(f"{uri}: export target holds files that are not an HF model export (no config.json, "
                              f"no {EXPORT_MARKER}); refusing to replace them, choose another location.")
    remove_export(uri)
    for name in order:
        storage.upload(os.path.join(local_dir, name), storage.join(uri, name))
    sizes = {f: os.path.getsize(os.path.join(local_dir, f)) for f in files}
    storage.write_bytes(storage.join(uri, EXPORT_MARKER), json.dumps({"files": sizes}, indent=1).encode())


def export_complete(uri: str) -> bool:
    """An export on a store is complete: its ``_EXPORT_COMPLETE`` marker is there."""
    return storage.size_of(storage.join(uri, EXPORT_MARKER)) is not None


def remove_export(uri: str) -> None:
    """Remove the export (or anything) at ``uri``: the marker first, so that it stops counting as complete
    before any of its files goes."""
    if export_complete(uri):
        storage.delete_tree(storage.join(uri, EXPORT_MARKER))
    storage.delete_tree(uri)


def set_aside_export(uri: str, kept: str) -> None:
    """Keep the export at ``uri`` as ``kept`` (copied file by file, config.json and the marker last), then
    remove it from ``uri``."""
    files = storage.list_files(uri)
    last = [f for f in ("config.json", EXPORT_MARKER) if f in files]
    for name in [f for f in files if f not in last] + last:
        storage.copy_file(storage.join(uri, name), storage.join(kept, name))
    remove_export(uri)


def _write_export(folder: str, cfg: ModelConfig, layout: ParamLayout, flat: torch.Tensor,
                  dtype: torch.dtype, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    table = hf_tensor_map(layout)
    elem = torch.empty((), dtype=dtype).element_size()
    groups = _plan_shards(table, elem, max_shard_bytes)
    # transformers refuses safetensors files whose metadata lacks format=pt.
    metadata = {"format": "pt"}
    if len(groups) == 1:
        files = [SINGLE_FILE]
    else:
        n = len(groups)
        files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map = {}
    for file, names in zip(files, groups):
        tensors = hf_state_dict(layout, flat, dtype, names)  # one shard in memory at a time
        save_file(tensors, os.path.join(folder, file), metadata=metadata)
        _fsync(os.path.join(folder, file))
        weight_map.update({name: file for name in names})
        del tensors
    if len(files) > 1:
        total = sum(elem * int(torch.Size(t.shape).numel()) for t in table.values())
        _write_json(os.path.join(folder, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})

    name = _DTYPE_NAMES[dtype]
    config = cfg.to_hf_dict(torch_dtype=name)
    config["dtype"] = name  # transformers >= 5 reads "dtype"; older versions "torch_dtype"
    _write_json(os.path.join(folder, "config.json"), config)
    gen = {k: v for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id)) if v is not None}
    _write_json(os.path.join(folder, "generation_config.json"), gen)


def _swap_into_place(new: str, target: str, old: str) -> None:
    """Rename the complete folder ``new`` to ``target``; an existing ``target`` is moved to ``old`` first
    (``os.replace`` cannot replace a non-empty folder) and deleted afterwards, or restored on failure."""
    had_old = os.path.exists(target)
    if had_old:
        os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        if had_old:
            os.replace(old, target)
        raise
    if had_old:
        shutil.rmtree(old, ignore_errors=True)
