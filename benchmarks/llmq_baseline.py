"""llm.q as a speed baseline beside ours: run its prebuilt ``train`` binary once and write one JSON record like
bench_train.py's (``benchmarks/speed_table.py`` runs it as a row; ``--llmq-bin`` there).

    python benchmarks/llmq_baseline.py --llmq-bin .anchors/llmq-bin --model Qwen2.5-0.5B --batch-size 32 \
        --grad-accumulation 1 --seq-len 1024 --steps 25 --matmul-dtype bf16 --json out.json

The binary (llm.q built for sm_90 against CUDA 13, linked dynamically; a baseline to measure, never code to copy)
needs its own library and cuBLAS/cuDNN/NCCL on the loader path: the folder of the binary, the ``nvidia/*/lib``
folders of this Python's site-packages (the torch install brings them) and ``/usr/local/cuda/lib64``. It reads
token files in its own .bin format (a 1 KiB int32 header: magic "BIN.TOK\\n", version 2, 4 bytes per token, the
token count, the vocabulary size; then int32 tokens), which this script writes with random tokens, enough for
the run. Training is from scratch (``--from-scratch``), with the settings of our rows: bf16 weights, bf16 Adam m
and v, CUDA graphs, evaluation and checkpoints out of the way.

Its output has one line per step, ``[T] step N ... time: X ms``; tokens/s is B x T x micro-steps / X, and the
record holds the median over the steps after ``--warmup-steps``. A run that times no step (llm.q's e4m3 path
aborts on CUDA 13 builds: "cudaErrorStreamCaptureUnsupported" with graphs) exits 1 with its first error lines.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import site
import statistics
import subprocess
import sys
import tempfile

import numpy as np

STEP_LINE = re.compile(r"\[T\] step\s+(\d+).*?time:\s+(\d+(?:\.\d+)?) ms")
QWEN_VOCAB = 151643


def write_tokens(path: str, n: int, vocab: int = QWEN_VOCAB, seed: int = 0) -> None:
    """n random tokens in llm.q's .bin format (see the module docstring)."""
    header = np.zeros(256, np.int32)
    header[:2] = np.frombuffer(b"BIN.TOK\n", np.int32)
    header[2:7] = (2, 4, n, vocab, 0)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.random.default_rng(seed).integers(0, vocab, n, dtype=np.int32).tobytes())


def loader_path(bin_dir: str) -> str:
    """LD_LIBRARY_PATH for the binary: its folder, the CUDA libraries of the torch install, the system CUDA."""
    libs = [bin_dir]
    for sp in site.getsitepackages():
        libs += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib")))
    libs.append("/usr/local/cuda/lib64")
    old = os.environ.get("LD_LIBRARY_PATH")
    return os.pathsep.join(libs + ([old] if old else []))


def step_times_ms(text: str) -> dict[int, float]:
    """{step: milliseconds} from llm.q's output."""
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(text)}


def record_from_output(text: str, tokens_per_step: int, warmup_steps: int, gpus: int = 1) -> dict | None:
    """The JSON record (bench_train.py's keys) from llm.q's output, or None when fewer than 2 steps were timed.
    ``tokens_per_step`` is one GPU's: its --batch-size is taken as per GPU, as llm.c's is (to be confirmed by the
    first 2-GPU run: a scaling near 50% or 200% would say otherwise); the step moves ``gpus`` times as many."""
    ms = step_times_ms(text)
    timed = [ms[s] for s in sorted(ms) if s >= warmup_steps]
    if len(timed) < 2:
        return None
    step_ms = statistics.median(timed)
    per_gpu = tokens_per_step / step_ms * 1e3
    return {"tokens_per_s": per_gpu * gpus, "tokens_per_s_per_gpu": per_gpu, "world_size": gpus,
            "step_ms": step_ms, "timed_steps": len(timed), "peak_memory_gib": None}


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llmq-bin", required=True, help="folder with llm.q's train binary and libllmq-common.so")
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the median (llm.q counts from 0)")
    p.add_argument("--matmul-dtype", default="bf16", choices=["bf16", "e4m3"])
    p.add_argument("--gpus", type=int, default=1, help="GPUs (llm.q's threads backend, one process)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--json", required=True, help="where the record goes")
    a = p.parse_args(argv)
    binary = os.path.join(os.path.abspath(a.llmq_bin), "train")
    if not os.access(binary, os.X_OK):
        print(f"error: --llmq-bin={a.llmq_bin!r}: no executable 'train' there.", file=sys.stderr)
        return 2
    tokens_per_step = a.batch_size * a.seq_len * a.grad_accumulation
    with tempfile.TemporaryDirectory() as tmp:
        write_tokens(os.path.join(tmp, "train.bin"), tokens_per_step * a.gpus * (a.steps + 2) + 1)
        write_tokens(os.path.join(tmp, "eval.bin"), 64 * 1024 + 1, seed=1)
        cmd = [binary, f"--model={a.model}", "--from-scratch", f"--batch-size={a.batch_size}",
               f"--grad-accumulation={a.grad_accumulation}", f"--seq-len={a.seq_len}", f"--steps={a.steps}",
               f"--matmul-dtype={a.matmul_dtype}", "--model-dtype=bf16", "--opt-m-dtype=bf16", "--opt-v-dtype=bf16",
               f"--gpus={a.gpus}", f"--train-file={tmp}/train.bin", f"--eval-file={tmp}/eval.bin",
               "--ckpt-interval=100000", "--eval-every-n-steps=100000", f"--out-dir={tmp}/out",
               f"--checkpoint-dir={tmp}/ckpt", f"--log-file={tmp}/log.json"]
        if a.cuda_graphs:
            cmd.append("--use-cuda-graphs")
        print("== " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, errors="replace",
                              env=dict(os.environ, LD_LIBRARY_PATH=loader_path(os.path.dirname(binary))))
    text = proc.stdout + proc.stderr
    print(text[-20000:], flush=True)
    record = record_from_output(text, tokens_per_step, a.warmup_steps, a.gpus)
    if record is None:
        errors = [line.strip() for line in text.splitlines() if re.search(r"rror|xception|terminate", line)][:3]
        print(f"llm.q timed no steps (exit status {proc.returncode}): {' | '.join(errors) or 'no error line'}",
              file=sys.stderr)
        return 1
    record.update(gpu=gpu_name(), command=" ".join(cmd), exit_status=proc.returncode)
    with open(a.json, "w") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
