"""How long --continue's integrity check takes at 7B-scale shard sizes (llmq_ray.checkpoints.verify.verify_checkpoint).

    python benchmarks/verify_checkpoint_speed.py --files 2 --file-gib 4 [--dir /big/disk] [--total-gb 91.4]
        [--single-thread] [--keep]

Why: resolving --continue now hashes every rank file of the candidate checkpoint against its manifest's
sha256 (a same-size corruption is otherwise only found by the workers' load, which then kills the run).
A Qwen2.5-7B checkpoint is its optimizer state, fp32 master + fp32 m + fp32 v = 12 bytes x 7.62e9
parameters = 91.4 GB, split into one rank file per worker (8 ranks: 11.4 GB a file). This script measures
what that check costs on this machine and extrapolates to the whole checkpoint.

What it does: writes ``--files`` synthetic rank files of ``--file-gib`` GiB each through the real
checkpoint protocol (``begin_checkpoint`` -> one valid safetensors file per rank with 1-D fp32 "master",
"m", "v" -> ``finalize_checkpoint``, which writes the manifest and publishes the folder). The files are
streamed (constant memory, any size) from pseudo-random bytes and their sha256 is computed while writing,
independently of the code under test, so the records are real. Then it times ``verify_checkpoint``:

1. cold: the files' pages are dropped from the page cache first (``/proc/sys/vm/drop_caches`` when root
   may write it, else ``posix_fadvise(DONTNEED)`` on each file, which evicts a file's clean pages without
   root). On a VM the host may still cache the virtual disk, so "cold" means cold in this kernel;
2. warm: the same again, the files now in the page cache when they fit in RAM (the CPU-bound case);
3. with ``--single-thread``: cold with one hashing thread, to show what the thread pool gains.

It also measures one core's sha256 speed on a buffer in memory (the ceiling per hashing thread) and prints
GB/s (1e9 bytes) and the extrapolated time for ``--total-gb``. The checkpoint folder is deleted at the
end unless ``--keep``. Nothing is written anywhere else.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.checkpoints import layout, local, verify  # noqa: E402

GIB = 1 << 30
WRITE_CHUNK = 64 << 20  # bytes written (and hashed) per call while generating a file
QWEN25_7B_PARAMS = 7.62e9
BYTES_PER_PARAM = 12  # fp32 master + fp32 m + fp32 v


def _safetensors_header(numel: int, rank: int, start: int, step: int) -> bytes:
    """The header of a safetensors file holding 1-D fp32 "master", "m", "v" of ``numel`` elements each,
    with the metadata ``write_rank_shard`` writes. The format: 8-byte little-endian header length, the JSON
    header (padded with spaces to a multiple of 8), then the raw tensor bytes in offset order."""
    nbytes = 4 * numel
    header = {"__metadata__": {"format": layout.FORMAT, "format_version": str(layout.FORMAT_VERSION), "rank": str(rank),
                               "start": str(start), "end": str(start + numel), "step": str(step)}}
    for i, name in enumerate(layout.STATE_NAMES):
        header[name] = {"dtype": "F32", "shape": [numel], "data_offsets": [i * nbytes, (i + 1) * nbytes]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_rank_file(tmp_dir: str, rank: int, numel: int, start: int, step: int, noise: bytes) -> dict:
    """Stream one rank file into ``tmp_dir`` and return its write record (sha256 computed while writing)."""
    name = layout.rank_file_name(rank)
    path = os.path.join(tmp_dir, name)
    h = hashlib.sha256()
    head = _safetensors_header(numel, rank, start, step)
    left = 3 * 4 * numel
    block = bytearray(noise)
    counter = 0
    with open(path, "wb") as f:
        f.write(head)
        h.update(head)
        while left > 0:
            struct.pack_into("<QQ", block, 0, rank, counter)  # every chunk differs (no dedup, no zero pages)
            counter += 1
            piece = memoryview(block)[:min(left, len(block))]
            f.write(piece)
            h.update(piece)
            left -= len(piece)
        f.flush()
        os.fsync(f.fileno())
    return {"name": name, "rank": rank, "start": start, "end": start + numel, "size": os.path.getsize(path),
            "sha256": h.hexdigest(), "dtypes": {k: "fp32" for k in layout.STATE_NAMES}}


def write_checkpoint(ckpt_dir: str, files: int, file_gib: float, step: int = 1) -> str:
    """A complete checkpoint of ``files`` rank files of about ``file_gib`` GiB each; returns its folder."""
    from llmq_ray.model.config import PRESETS

    numel = max(1, int(file_gib * GIB) // 12)
    noise = os.urandom(WRITE_CHUNK)
    tmp = local.begin_checkpoint(ckpt_dir, step)
    records = [write_rank_file(tmp, r, numel, r * numel, step, noise) for r in range(files)]
    # the manifest of a real run, its layout size replaced by the synthetic one (the ranges tile it)
    manifest = layout.build_manifest(step, config=PRESETS["tiny"], world_size=files,
                                 extra={"synthetic": "benchmarks/verify_checkpoint_speed.py"})
    manifest["layout_numel"] = files * numel
    return local.finalize_checkpoint(tmp, layout.step_dir(ckpt_dir, step), manifest, records=records)


def drop_cache(paths: list[str]) -> str:
    """Evict the files' pages; returns how."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED) per file (not root)"


def core_sha256_rate(mib: int = 512) -> float:
    """One thread's sha256 speed over a buffer in memory, bytes/s (no I/O)."""
    buf = os.urandom(64 << 20)
    h = hashlib.sha256()
    t0 = time.perf_counter()
    for _ in range(mib // 64):
        h.update(buf)
    return (mib << 20) / (time.perf_counter() - t0)


def timed_verify(folder: str, max_workers: int | None = None) -> float:
    t0 = time.perf_counter()
    verify.verify_checkpoint(folder, max_workers=max_workers)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=2, help="rank files in the synthetic checkpoint (default 2)")
    p.add_argument("--file-gib", type=float, default=4.0, help="GiB per rank file (7B on 8 ranks: 10.6 GiB)")
    p.add_argument("--dir", default=None, help="parent folder for the checkpoint (default: a temporary folder)")
    p.add_argument("--total-gb", type=float, default=QWEN25_7B_PARAMS * BYTES_PER_PARAM / 1e9,
                   help="checkpoint size to extrapolate to, GB (default: Qwen2.5-7B's 91.4)")
    p.add_argument("--single-thread", action="store_true", help="also time a cold pass with one hashing thread")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    a = p.parse_args()
    if a.files < 1 or a.file_gib <= 0:
        p.error("--files must be >= 1 and --file-gib > 0.")

    root = tempfile.mkdtemp(prefix="llmq-verify-", dir=a.dir)
    try:
        t0 = time.perf_counter()
        folder = write_checkpoint(os.path.join(root, "ckpt"), a.files, a.file_gib)
        manifest = layout.read_manifest(folder)
        paths = [os.path.join(folder, f["name"]) for f in manifest["files"]]
        total = sum(f["size"] for f in manifest["files"])
        print(f"wrote {a.files} rank file(s) x {manifest['files'][0]['size'] / GIB:.2f} GiB = {total / 1e9:.2f} GB "
              f"in {time.perf_counter() - t0:.1f} s to {folder}")
        from safetensors import safe_open

        with safe_open(paths[0], framework="numpy") as f:  # the files are real safetensors (header only read)
            assert f.metadata()["start"] == "0" and sorted(f.keys()) == sorted(layout.STATE_NAMES)

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        core = core_sha256_rate()
        print(f"machine: {cpus} usable CPU(s), hash_workers({a.files}) = {verify.hash_workers(a.files)} thread(s); "
              f"one core's sha256 in memory: {core / 1e9:.2f} GB/s")
        runs = [("cold", None, True), ("warm", None, False)]
        if a.single_thread:
            runs.append(("cold, 1 thread", 1, True))
        for label, workers, cold in runs:
            how = drop_cache(paths) if cold else "page cache kept from the previous pass"
            seconds = timed_verify(folder, workers)
            rate = total / seconds
            print(f"verify_checkpoint {label:>15}: {seconds:7.2f} s for {total / 1e9:.2f} GB = {rate / 1e9:.2f} GB/s "
                  f"-> {a.total_gb:.1f} GB in {a.total_gb * 1e9 / rate:6.1f} s  [{how}]")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > 0.8 * ram:
            print(f"note: {total / GIB:.1f} GiB of files against {ram / GIB:.1f} GiB of RAM: the warm pass is only "
                  f"partly cached.")
    finally:
        if a.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
