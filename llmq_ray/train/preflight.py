"""Pre-flight: the checks of a run that need no GPU and no Ray, done in the driver before ``ray.init``.

A mistake found after Ray and the workers have started costs 30-120 s on a small machine and minutes with a
real model; found here it costs well under a second and ends in one sentence (the CLI exits with code 2).
This module therefore imports nothing heavy (no torch, no Ray): numpy for the token files, pyarrow only when
a Parquet/Arrow file is named, NVML only to count the local GPUs.

What is checked (``LLMQTrainer.__init__`` calls these in this order; nothing is written until all passed):

* every data file of ``--train-file`` / ``--eval-file``: the header and the file size it promises, the
  token ids (every id for files up to ``FULL_SCAN_TOKENS``, evenly spaced samples of ``SAMPLE_TOKENS`` beyond,
  ``SCAN_BUDGET_TOKENS`` over all files; the workers scan every id when they open the files), that they fit
  the model's vocabulary, and that the train and the eval files hold a window each (``check_windows``);
* ``--out-dir``, ``--checkpoint-dir`` and the folder of ``--log-file``: a folder or creatable as one, and
  writable (``os.access``, which also sees a read-only mount); on an object store: a scheme that resolves and a
  store that answers (``check_locations``);
* ``--log-file`` naming an existing log is refused unless the run continues it; a fresh run whose
  checkpoint folder already holds checkpoints is refused (its retention would delete them);
* ``--workers`` against this machine's CPUs (a local Ray only; a cluster is checked after it is joined);
* ``--backend`` triton or cupy where the run trains on CPU (``--device=cpu``, or a local Ray without a GPU);
* the optional packages a flag needs (``--wandb-project``: wandb; ``--log-gpu-util``: nvidia-ml-py);
* run as a Ray job's entrypoint: the grace ``ray job stop`` gives before SIGKILL, against the stop's checkpoint
  (a warning, ``check_ray_job_stop_grace``).

The ``--continue`` target (present, every file's sha256, the model) is checked by ``llmq_ray.checkpoints.verify``;
``keep_global_batch`` reconciles a resumed run's batch with the checkpoint's.
"""

from __future__ import annotations

import os
from typing import Optional

from llmq_ray.errors import CheckpointError, ConfigError, DataError

FULL_SCAN_TOKENS = 1 << 24   # files up to 16M tokens (64 MB of int32) have every id checked (~0.02 s each)
SAMPLE_TOKENS = 1 << 20      # larger files: this many ids in 64 evenly spaced runs
SCAN_BUDGET_TOKENS = 1 << 28  # ids read over all files; beyond it only headers and sizes (a dataset of 1000s of files)
_TEXT_SUFFIXES = (".txt", ".json", ".jsonl", ".md", ".csv", ".tsv")


# ---------------------------------------------------------------------------------------------------- data
def token_counts(pattern: str, flag: str, vocab_size: int) -> tuple[list[str], list[int]]:
    """Resolve ``pattern`` and check every file it matches; returns (files, tokens of each file).

    DataError (one sentence naming the file and, where it applies, the token index and byte offset) for an
    empty glob, a file that is not a token shard (text, wrong magic), a truncated or over-long file, an
    empty shard, or a token id outside [0, vocab_size)."""
    from llmq_ray.data_pipeline.sources import ARROW_SUFFIXES, resolve_files

    try:
        files = resolve_files(pattern)
    except DataError as exc:
        raise DataError(f"{flag}: {exc}") from None
    budget = [SCAN_BUDGET_TOKENS]
    counts = [_check_arrow_file(path, vocab_size) if path.endswith(ARROW_SUFFIXES)
              else _check_bin_file(path, vocab_size, budget) for path in files]
    return files, counts


def check_token_files(pattern: str, flag: str, vocab_size: int) -> tuple[list[str], int]:
    """``token_counts``' checks; returns (files, total tokens)."""
    files, counts = token_counts(pattern, flag, vocab_size)
    return files, sum(counts)


def check_windows(pattern: str, flag: str, vocab_size: int, seq_len: int) -> int:
    """``token_counts``' checks, then at least one window of ``seq_len`` + 1 tokens: windows never span two files
    (``data_pipeline/order.py``), so files that are each shorter than a window hold none, whatever their sum.
    Returns the number of windows; DataError naming ``flag`` when there is none."""
    from llmq_ray.data_pipeline.order import windows_per_file

    files, counts = token_counts(pattern, flag, vocab_size)
    windows = int(windows_per_file(counts, seq_len).sum())
    if windows == 0:
        named = pattern if isinstance(pattern, str) else ", ".join(map(str, pattern))
        if len(files) == 1:
            held = f"holds {counts[0]} tokens, fewer than one window of --seq-len + 1 = {seq_len + 1} tokens"
        else:
            held = (f"is {len(files)} files of at most {max(counts)} tokens each, fewer than one window of "
                    f"--seq-len + 1 = {seq_len + 1} tokens (a window never spans two files)")
        raise DataError(f"{flag} {named} {held}.")
    return windows


def data_eos_id(pattern: str) -> Optional[int]:
    """The ``eos_id`` in the meta.json beside the first local file ``pattern`` matches (what
    ``python -m llmq_ray.data_pipeline.tokenize`` appended after every document); None if there is none."""
    import json

    from llmq_ray.data_pipeline.sources import resolve_files

    try:
        files = resolve_files(pattern)
    except DataError:
        return None
    meta = os.path.join(os.path.dirname(files[0]), "meta.json") if files else None
    if not meta or not os.path.isfile(meta):
        return None
    try:
        with open(meta) as f:
            eos = json.load(f).get("eos_id")
    except (OSError, ValueError, AttributeError):
        return None
    return eos if isinstance(eos, int) else None


def separator_seen(pattern: str, token: int, scan_tokens: int = 10_000_000) -> Optional[bool]:
    """Whether ``token`` occurs in the first ``scan_tokens`` tokens of the first local .bin shard ``pattern``
    matches (None: not a local .bin shard, not checked). --document-masking uses it to refuse a separator that
    would mask nothing."""
    import numpy as np

    from llmq_ray.data_pipeline.shards import Shard, read_header
    from llmq_ray.data_pipeline.sources import resolve_files

    try:
        files = resolve_files(pattern)
        if not files or not files[0].endswith(".bin") or not os.path.isfile(files[0]):
            return None
        tokens = Shard(read_header(files[0])).tokens
    except DataError:
        return None
    return bool(np.any(np.asarray(tokens[:scan_tokens]) == token))


def _check_bin_file(path: str, vocab_size: int, budget: list) -> int:
    """Header, size and (within ``budget[0]`` tokens, decreased here) the token ids of one shard."""
    from llmq_ray.data_pipeline.shards import HEADER_BYTES, Shard, check_token_ids, read_header

    try:
        info = read_header(path)
    except DataError as exc:
        if ("wrong magic" in str(exc) or "truncated token shard" in str(exc)) and _looks_like_text(path):
            raise DataError(f"{path} is a text file, not a token shard; tokenize it first with `python -m "
                            f"llmq_ray.data_pipeline.tokenize --input {path} --out DIR` and pass --train-file 'DIR/train-*.bin'.") from None
        raise
    if info.n_tokens == 0:
        raise DataError(f"{path}: the token shard holds no tokens.")
    tokens = Shard(info).tokens  # memory-mapped: only the ids checked below are read
    itemsize = info.token_dtype.itemsize
    scan = min(info.n_tokens, FULL_SCAN_TOKENS if info.n_tokens <= FULL_SCAN_TOKENS else SAMPLE_TOKENS)
    if scan > budget[0]:
        return info.n_tokens  # the budget is spent: the workers check these ids when they open the file
    budget[0] -= scan
    if info.n_tokens <= FULL_SCAN_TOKENS:
        check_token_ids(tokens, vocab_size, path, HEADER_BYTES, itemsize)
    else:
        runs, per = 64, SAMPLE_TOKENS // 64
        for k in range(runs):
            lo = (info.n_tokens - per) * k // (runs - 1)
            check_token_ids(tokens[lo:lo + per], vocab_size, path, HEADER_BYTES, itemsize, first_index=lo)
    return info.n_tokens


def _looks_like_text(path: str) -> bool:
    """A text suffix, or a non-empty start that is NUL-free UTF-8 (a token shard's header has NUL bytes)."""
    if path.lower().endswith(_TEXT_SUFFIXES):
        return True
    with open(path, "rb") as f:
        head = f.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(head) and b"\0" not in head


def _check_arrow_file(path: str, vocab_size: int) -> int:
    """Parquet: the row groups' min/max statistics when written (no data read), else the whole column;
    Arrow IPC: the whole column (``ArrowSource`` reads it into memory anyway)."""
    from llmq_ray.data_pipeline.shards import check_token_ids
    from llmq_ray.data_pipeline.sources import ArrowSource

    if path.endswith(".parquet"):
        n = _parquet_tokens_by_statistics(path, vocab_size)
        if n is not None:
            return n
    src = ArrowSource(path, check_ids=False, vocab_size=vocab_size)
    if src.n_tokens == 0:
        raise DataError(f"{path}: the token column holds no tokens.")
    check_token_ids(src.tokens, vocab_size, path, 0, 0)
    return src.n_tokens


def _parquet_tokens_by_statistics(path: str, vocab_size: int, column: str = "tokens") -> Optional[int]:
    """Token count from a Parquet file's metadata when every row group has min/max statistics of a flat
    integer ``column`` (the ids are then checked against the vocabulary from them); None otherwise."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: cannot read as Parquet: {exc}.") from None
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    if column not in names:
        return None  # a list column ("tokens.list.element") or a missing one: read the column instead
    idx, total = names.index(column), 0
    for g in range(meta.num_row_groups):
        col = meta.row_group(g).column(idx)
        st = col.statistics
        if st is None or not st.has_min_max or not isinstance(st.min, int):
            return None
        if st.min < 0 or st.max >= vocab_size:
            bad = st.max if st.max >= vocab_size else st.min
            raise DataError(f"{path}: row group {g} holds token id {bad}, outside the model's vocabulary of "
                            f"{vocab_size}.")
        total += meta.row_group(g).num_rows
    if total == 0:
        raise DataError(f"{path}: the token column holds no tokens.")
    return total


# ---------------------------------------------------------------------------------------------------- folders
def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def check_writable_dir(path: str, flag: str) -> None:
    """``path`` is a writable folder, or can be created as one (its nearest existing parent is a writable
    folder). Asked with ``os.access``, which also reports a read-only mount to root; nothing is written or
    created here (not even a probe file: a folder's modification time stays as it was)."""
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ConfigError(f"{flag}={path} is a file, not a folder; remove it or choose another folder.")
    base = _nearest_existing(p)
    if not os.path.isdir(base):
        raise ConfigError(f"{flag}={path} cannot be created: {base} is a file, not a folder.")
    if not os.access(base, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only_mount(base) else "permission denied"
        what = "is not writable" if base == p else f"cannot be created in {base}"
        raise ConfigError(f"{flag}={path} {what} ({reason}); choose a folder you can write to.")


def _read_only_mount(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_log_file(path: str, flag: str, resume: bool, explicit: bool) -> None:
    """The JSON log's folder is writable; an existing log is continued only by a continued run.

    ``explicit``: the user named the file (``--log-file``): then a fresh run refuses to touch another run's
    log. The default log of ``--out-dir`` is kept aside by the run instead (``runlog.set_aside_name``). A log
    on an object store gets the same checks through llmq_ray/storage.py (its store was reached already)."""
    from llmq_ray import storage

    if storage.is_remote(path):
        _check_remote_log_file(path, flag, resume, explicit)
        return
    p = os.path.abspath(path)
    if os.path.isdir(p):
        where = f"--log-file={path}" if explicit else f"the log {path} (in --out-dir)"
        raise ConfigError(f"{where} is a folder; name a log file with --log-file, or move the folder away.")
    check_writable_dir(os.path.dirname(p), flag)
    if os.path.exists(p):
        from llmq_ray.observe.runlog import read_log

        if explicit and not resume:
            raise ConfigError(f"{flag}={path} is the log of another run; pass --continue to resume that run and "
                              f"append to its log, or name a new file.")
        if resume:
            try:
                read_log(p)
            except (ValueError, OSError) as exc:
                raise ConfigError(f"{flag}: the run's log cannot be continued: {exc}; move it away or name "
                                  f"another --log-file.") from None


def _check_remote_log_file(uri: str, flag: str, resume: bool, explicit: bool) -> None:
    """``check_log_file`` for a log on an object store: not a "folder" (a prefix with objects under it); an
    existing log only for a continued run, which must be able to read it."""
    import shutil

    import pyarrow.fs as pafs

    from llmq_ray import storage

    fs, inner = storage.filesystem(uri, flag)
    try:
        kind = fs.get_file_info(inner).type
    except OSError as exc:
        raise ConfigError(f"{flag}={uri!r}: cannot reach it ({str(exc).splitlines()[0]}).") from None
    if kind == pafs.FileType.Directory:
        where = f"--log-file={uri}" if explicit else f"the log {uri} (in --out-dir)"
        raise ConfigError(f"{where} is a folder; name a log file with --log-file, or move the folder away.")
    if kind != pafs.FileType.File:
        return
    if explicit and not resume:
        raise ConfigError(f"{flag}={uri} is the log of another run; pass --continue to resume that run and "
                          f"append to its log, or name a new file.")
    if resume:
        from llmq_ray.observe.runlog import read_log

        folder = storage.staging_dir("log-check")
        try:
            local = os.path.join(folder, "log.jsonl")
            storage.download(uri, local)
            read_log(local)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{flag}: the run's log {uri} cannot be continued: "
                              f"{str(exc).replace(local, uri)}; move it away or name another --log-file.") from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def check_fresh_checkpoint_dir(ckpt_dir: str) -> None:
    """A fresh run (no --continue) must not write into a folder that holds another run's checkpoints:
    their steps would mix, and retention would delete the older run's checkpoints."""
    from llmq_ray.checkpoints.layout import has_manifest, list_step_dirs

    have = [(s, p) for s, p in list_step_dirs(ckpt_dir) if has_manifest(p)]
    if have:
        raise CheckpointError(f"--checkpoint-dir {ckpt_dir} already holds checkpoints of a run (newest "
                              f"{os.path.basename(have[0][1].split('?')[0])}); pass --continue to resume it, or choose another "
                              f"--checkpoint-dir / --out-dir.")


# ---------------------------------------------------------------------------------------------------- resources
def local_gpu_count() -> int:
    """GPUs this process may use: NVML's count (fast, no CUDA context; 0 when there is no driver), limited
    by ``CUDA_VISIBLE_DEVICES`` when it is set (NVML ignores it; "" or "-1" hide every GPU)."""
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is optional (llmq-ray[gpu]): the driver's own list of GPUs
        try:
            count = len(os.listdir("/proc/driver/nvidia/gpus"))
        except OSError:
            return 0
        return _limit_to_visible(count, os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return _limit_to_visible(count, visible)


def _limit_to_visible(count: int, visible: Optional[str]) -> int:
    """``count`` GPUs, of which a ``CUDA_VISIBLE_DEVICES`` value lets this process use fewer."""
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if "-1" in entries:  # CUDA stops at the first invalid entry
            entries = entries[:entries.index("-1")]
        count = min(count, len(entries))
    return count


def check_local_resources(device: str, world: Optional[int], gpus: int, cpus_per_worker: Optional[int]) -> list[str]:
    """Workers against this machine (a local Ray instance). Returns warnings; ConfigError when the run
    cannot be placed at all."""
    notes = []
    cpus = os.cpu_count() or 1
    if device == "cpu" and world:
        if world > cpus:
            raise ConfigError(f"--workers={world} asks for {world} CPU workers but this machine has {cpus} CPU(s); "
                              f"use --workers={cpus} or fewer (or --ray-address of a larger Ray cluster).")
        k = cpus_per_worker or 1
        if world * k > cpus:
            notes.append(f"--workers={world} x --cpus-per-worker={k} oversubscribes this machine's {cpus} CPU(s); "
                         f"each step will be slower than with --workers={max(cpus // k, 1)}.")
    if device == "cuda":
        have = local_gpu_count()
        if have == 0:
            raise ConfigError("--device=cuda but this machine has no GPU (NVML finds none); use --device=cpu, or "
                              "--ray-address of a cluster with GPUs.")
        if gpus > have:
            raise ConfigError(f"--gpus={gpus} asks for more GPUs than this machine has ({have}); use --gpus={have} "
                              f"or fewer (or --ray-address of a larger Ray cluster).")
    return notes


def check_backend(backend: str, device: str, machine: str) -> None:
    """A GPU backend (triton, cupy) where the run would train on CPU: ``--device=cpu``, or ``--device=auto`` on a
    machine without a GPU that starts its own Ray (``machine`` is then "cpu"). One sentence naming the flag, before
    Ray starts (otherwise the refusal came from ``_build_spec`` after 20-40 s of Ray start-up)."""
    if backend in ("auto", "torch"):
        return
    if device == "cpu":
        raise ConfigError(f"--backend={backend} needs a GPU; on --device=cpu use --backend=torch.")
    if device == "auto" and machine == "cpu":
        raise ConfigError(f"--backend={backend} needs a GPU and this machine has none (NVML finds none); use "
                          f"--backend=torch, or --ray-address of a Ray cluster with GPUs.")


def check_optional_packages(wandb_project: Optional[str], log_gpu_util: int) -> None:
    """A flag that needs an optional part of llmq-ray names the extra to install (before anything starts)."""
    import importlib.util

    if wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb-project={wandb_project} needs the wandb package: pip install 'llmq-ray[wandb]'.")
    if log_gpu_util and importlib.util.find_spec("pynvml") is None:
        raise ConfigError(f"--log-gpu-util={log_gpu_util} needs NVML's Python binding (nvidia-ml-py): pip install "
                          f"'llmq-ray[gpu]'.")


RAY_JOB_STOP_DEFAULT_S = 3   # Ray 2.60's job supervisor: SIGKILL this long after the stop's SIGTERM, unless set
JOB_STOP_GRACE_S = 60        # warn below a minute: a real model's checkpoint (to an object store) can take longer


def check_ray_job_stop_grace(env) -> list[str]:
    """Warnings for a run that is a Ray job's entrypoint (``ray job submit`` sets ``RAY_JOB_CONFIG_JSON_ENV_VAR``
    in its environment) whose ``ray job stop`` would SIGKILL it before the stop's checkpoint is written.

    Ray's job supervisor sends SIGTERM, waits ``RAY_JOB_STOP_WAIT_TIME_S`` seconds (3 unless the job's
    ``runtime_env`` ``env_vars`` set it; the supervisor runs with those variables, and the entrypoint inherits
    them, so ``env`` shows what the supervisor will use), then SIGKILLs the driver and its children: a stop's
    checkpoint still being written is lost and the run resumes from the one before. ``env``: a mapping such as
    ``os.environ``. Returns [] outside a Ray job or with a grace of ``JOB_STOP_GRACE_S`` or more."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in env:
        return []
    raw = env.get("RAY_JOB_STOP_WAIT_TIME_S")
    try:
        grace = RAY_JOB_STOP_DEFAULT_S if raw is None else int(raw)
    except ValueError:
        return [f"RAY_JOB_STOP_WAIT_TIME_S={raw!r} is not a whole number of seconds, so `ray job stop` may fail to "
                f"stop this job cleanly; set it to the seconds a checkpoint takes to write, e.g. 600, in the job's "
                f"runtime_env env_vars (docs/running-on-ray.md)."]
    if grace >= JOB_STOP_GRACE_S:
        return []
    told = "unset, so Ray's default of 3 s" if raw is None else f"{grace} s"
    return [f"this run is a Ray job and RAY_JOB_STOP_WAIT_TIME_S is {told}: `ray job stop` will SIGKILL it that "
            f"long after its SIGTERM, likely before the stop's checkpoint is written; set it to the seconds a "
            f"checkpoint takes to write, e.g. 600, in the job's runtime_env env_vars (docs/running-on-ray.md)."]


# ---------------------------------------------------------------------------------------------------- resume
def keep_global_batch(manifest: dict, folder: str, batch_size: int, grad_accumulation: int,
                      world: int) -> tuple[int, Optional[str]]:
    """The --grad-accumulation that keeps a checkpoint's global batch (rows per optimizer step) when a run
    resumes it on another worker count, ``world``, with ``batch_size`` rows per worker; returns
    (grad_accumulation, the one line saying so, or None when nothing changes). On the checkpoint's own worker
    count the flags are taken as given. ConfigError when no whole number of micro-steps gives the batch."""
    saved = manifest.get("train_options") or {}
    sw = int(manifest.get("data_world_size", manifest.get("world_size", 1)))  # workers (node scope: > shards)
    sb, sga = saved.get("batch_size"), saved.get("grad_accumulation")
    if not isinstance(sb, int) or not isinstance(sga, int):
        return grad_accumulation, None  # an older checkpoint without the options: nothing to compare
    target = sb * sga * sw
    if world == sw or batch_size * grad_accumulation * world == target:
        return grad_accumulation, None  # the checkpoint's own worker count: the batch flags mean what they say
    name = os.path.basename(os.path.normpath(folder))
    per = batch_size * world
    if target % per:
        raise ConfigError(f"--continue: checkpoint {name} was trained with a global batch of {target} rows "
                          f"({sb} x {sga} x {sw} worker(s)), which --batch-size={batch_size} on {world} worker(s) "
                          f"cannot keep with a whole --grad-accumulation; change --batch-size or the worker count, "
                          f"or pass --allow-batch-change to train on with the new batch.")
    ga = target // per
    return ga, (f"resuming {name} ({sb} rows x {sga} micro-steps on {sw} worker(s)) on {world} worker(s) with "
                f"--batch-size {batch_size}: --grad-accumulation {ga} instead of {grad_accumulation} keeps its global "
                f"batch of {target} rows (--allow-batch-change keeps {grad_accumulation}).")


def check_locations(locations: dict) -> dict:
    """Every location a user gave ({flag: path or URI or None}) resolves to a filesystem (one ConfigError
    sentence naming the flag otherwise, before anything starts). ``file://`` URIs come back as local paths.
    Token-file globs, checkpoints and the outputs (--out-dir: the log and the export; --log-file) may be on any
    filesystem: llmq_ray/storage.py fetches the shards, llmq_ray/checkpoints/remote.py writes and reads
    checkpoints, the run log and the export are staged on a node and uploaded (llmq_ray/observe/runlog.py,
    llmq_ray/model/hf_io.py ``upload_export``); a URI is never turned into a local folder named after it. A
    store that a run writes to (or continues from) and cannot reach is refused here too."""
    from llmq_ray import storage

    out = dict(locations)
    for flag, value in locations.items():
        if not isinstance(value, str) or storage.scheme_of(value) is None:
            continue
        fs, inner = storage.filesystem(value, flag)
        if not storage.is_remote(value):
            out[flag] = inner  # file:///abs/path
        else:  # written to or read from before anything else: an unreachable store is one sentence, in bounded time
            storage.check_reachable(value, flag)
    return out
