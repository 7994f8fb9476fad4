"""The speed table in one run: the trainer through Ray for a grid of model x backend x matmul dtype, and, for
each model, the PyTorch baseline a user would otherwise pick (HF transformers + torch.compile + bf16 autocast +
fused AdamW, ``hf_baseline.py``), on the same GPU, one after the other.

    python benchmarks/speed_table.py --models Qwen2.5-0.5B Qwen2.5-1.5B --json-out $OUT/table.json
    python benchmarks/speed_table.py --models Qwen2.5-1.5B --overlap-wgrad-sms 100   # + a side-stream bf16 row
    python benchmarks/speed_table.py --merge a.json b.json     # one table from the JSON of several calls

Every row runs as its own subprocess (``bench_train.py`` or ``hf_baseline.py``, each writing one JSON record)
under ``--row-timeout-s`` (the HF baseline under ``--hf-timeout-s``: torch.compile of its model and loss took 70 s
at 0.5B and over 110 s at 1.5B on a fresh H200 machine, 2026-11-29). On a time-out it gets SIGINT first, so Ray
shuts down and frees the GPU for the next row. A failed row stays in the table as "failed" with its exit status;
it is never left out. Each row's output is appended to ``--log``.

What runs per model (``ROW_SHAPES``: the batch and micro-steps of issue 6's bars for the triton rows; smaller
and shorter for the torch reference, which is slow and keeps fp32 logits; the baseline at the batch of the
llm.q and PyTorch anchors measured on the H100, B=16 at 0.5B):
- triton, bf16 and e4m3 (``--matmul-dtypes``), with CUDA graphs;
- triton, bf16, with the block wgrads on a side stream, if ``--overlap-wgrad-sms`` > 0;
- torch (the reference backend), bf16;
- llm.q (its prebuilt binary, ``llmq_baseline.py``) at the triton rows' shapes, one row per matmul dtype, when
  ``--llmq-bin`` names its folder: every speed claim is a ratio measured side by side;
- the HF baseline, unless ``--no-hf-baseline``.

All of ours run from scratch on random tokens, with fp32 master weights, bf16 Adam m and v, and ZeRO-1.

The printed table, in markdown, has one line per row: tokens/s per GPU, step time, SOL against the peak of the
dtype in use, MFU against the bf16 peak, and peak memory. The exact command follows each line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from llmq_ray.model.config import PRESETS  # noqa: E402
from llmq_ray.observe.metrics import peak_tflops, sol_fraction  # noqa: E402
from llmq_ray.observe.runlog import atomic_write_json, atomic_write_text  # noqa: E402

# model -> shapes: triton (batch, micro-steps, steps, warm-up steps), torch (the same), hf (batch, steps)
ROW_SHAPES = {
    "Qwen2.5-0.5B": {"triton": (32, 1, 25, 5), "torch": (16, 1, 12, 4), "hf": (16, 10)},
    "Qwen2.5-1.5B": {"triton": (16, 16, 7, 2), "torch": (8, 1, 10, 3), "hf": (8, 10)},
    "Qwen3-1.7B": {"triton": (16, 4, 6, 2), "torch": (8, 1, 8, 3), "hf": (8, 8)},
    # GPT-2 as llm.c trains it: 124M at large batches (its runs use B=64), 1558M at B=16
    "gpt2": {"triton": (64, 2, 10, 3), "torch": (16, 1, 10, 3), "hf": (32, 10)},
    "gpt2-xl": {"triton": (16, 4, 6, 2), "torch": (8, 1, 8, 3), "hf": (8, 8)},
}
DEFAULT_SHAPES = {"triton": (16, 1, 12, 4), "torch": (8, 1, 8, 3), "hf": (8, 8)}


@dataclass
class Row:
    """One line of the table: what to run (``argv``, after the Python executable) and, once run, its record."""
    model: str
    setup: str            # what the line says the row is
    kind: str             # "ours" (bench_train.py), "llmq" (llmq_baseline.py) or "hf" (hf_baseline.py)
    matmul_dtype: str     # "bf16" or "e4m3": which peak SOL is measured against
    batch: int
    micro_steps: int
    argv: list[str]
    record: dict | None = None
    error: str | None = field(default=None)


def plan_rows(models, backends, matmul_dtypes, seq_len, overlap_wgrad_sms, hf_baseline, device="cuda",
              llmq_bin=None, fp8_head=False, gpus=(1,), zero_levels=(1,), triton_shape=None, fp8_delayed=False):
    """The rows of the grid, in the order they run (each model's rows together, then llm.q's, its baseline
    last). ``triton_shape`` (batch, micro-steps, steps, warm-up steps) replaces ``ROW_SHAPES``' triton shape of
    every model, for the triton/cupy rows and llm.q's beside them (e.g. a larger global batch per step).
    ``fp8_delayed``: the e4m3 rows take --fp8-delayed-swiglu-scale."""
    rows = []
    for model in models:
        shapes = dict(ROW_SHAPES.get(model, DEFAULT_SHAPES))
        if triton_shape:
            shapes["triton"] = tuple(triton_shape)
        for backend in backends:
            b, g, steps, warm = shapes["triton" if backend != "torch" else "torch"]
            dtypes = matmul_dtypes if backend != "torch" else ["bf16"]
            for dtype in dtypes:
                for n_gpus in gpus:
                    for zero in zero_levels:
                        if n_gpus == 1 and zero != 1 and 1 in zero_levels:
                            continue  # one GPU shards nothing: its ZeRO-1 row is the baseline of the others
                        rows += _our_rows(model, backend, dtype, b, g, steps, warm, seq_len, device, fp8_head,
                                          n_gpus, zero, overlap_wgrad_sms, fp8_delayed)
        if llmq_bin:
            b, g, steps, warm = shapes["triton"]
            for dtype in matmul_dtypes:
                for n_gpus in gpus:
                    argv = [os.path.join(HERE, "llmq_baseline.py"), "--llmq-bin", llmq_bin, "--model", model,
                            "--batch-size", str(b), "--grad-accumulation", str(g), "--seq-len", str(seq_len),
                            "--steps", str(steps), "--warmup-steps", str(warm), "--matmul-dtype", dtype,
                            "--gpus", str(n_gpus)]
                    on = "" if n_gpus == 1 else f", {n_gpus} GPUs"
                    rows.append(Row(model, f"llm.q, {dtype}, CUDA graphs (its prebuilt binary){on}", "llmq", dtype,
                                    b, g, argv))
        if hf_baseline:
            b, steps = shapes["hf"]
            argv = [os.path.join(HERE, "hf_baseline.py"), "--model", model, "--batch-size", str(b),
                    "--seq-len", str(seq_len), "--steps", str(steps)]
            rows.append(Row(model, "HF transformers + torch.compile + bf16 autocast + fused AdamW", "hf", "bf16",
                            b, 1, argv))
    return rows


def _our_rows(model, backend, dtype, b, g, steps, warm, seq_len, device, fp8_head, n_gpus, zero,
              overlap_wgrad_sms, fp8_delayed=False) -> list[Row]:
    """bench_train.py rows of one model, backend, dtype, GPU count and ZeRO level: the plain row and, for
    triton bf16 at ZeRO-1 with ``overlap_wgrad_sms``, the one with the wgrads on a side stream. CUDA graphs for
    triton on CUDA at ZeRO-1 (ZeRO-2/3 reduce per layer during the backward and cannot be captured)."""
    rows = []
    side_row = overlap_wgrad_sms and dtype == "bf16" and backend == "triton" and zero == 1
    for sms in [0] + ([overlap_wgrad_sms] if side_row else []):
        argv = [os.path.join(HERE, "bench_train.py"), "--device", device, "--backend", backend,
                "--model", model, "--batch-size", str(b), "--grad-accumulation", str(g),
                "--seq-len", str(seq_len), "--steps", str(steps), "--warmup-steps", str(warm),
                "--opt-m-dtype", "bf16", "--opt-v-dtype", "bf16"]
        argv += ["--gpus", str(n_gpus)] if device == "cuda" else ["--workers", str(n_gpus)]
        # the CPU runs the model in fp32 (bench_train.py's default there): say so
        setup = f"llmq-ray {backend}, {dtype if device == 'cuda' or dtype == 'e4m3' else 'fp32'}"
        if dtype == "e4m3":
            argv += ["--matmul-dtype", "e4m3"]
            if fp8_head:
                argv += ["--lmhead-dtype", "e4m3"]
                setup += " (LM head too)"
            if fp8_delayed:
                argv += ["--fp8-delayed-swiglu-scale"]
                setup += " (delayed SwiGLU scale)"
        if zero != 1:
            argv += ["--zero-level", str(zero)]
            setup += f", ZeRO-{zero}"
        if n_gpus != 1:
            setup += f", {n_gpus} {'GPUs' if device == 'cuda' else 'workers'}"
        if backend == "triton" and device == "cuda" and zero == 1:
            argv.append("--use-cuda-graphs")
            setup += ", CUDA graphs"
        if sms:
            argv += ["--overlap-wgrad-sms", str(sms)]
            setup += f", wgrads on a side stream ({sms} SMs)"
        rows.append(Row(model, setup + ", through Ray", "ours", dtype, b, g, argv))
    return rows


def _default_sigint() -> None:
    """In the row's process before exec: SIGINT back to its default. A process started from a background job of a
    script (``cmd &``) or from a pytest-xdist worker inherits SIGINT ignored, and a Python child then never sees
    the time-out's SIGINT (it would wait 30 s for SIGKILL, and Ray would not shut down its actors)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_row(row: Row, timeout_s: float, log_path: str, env: dict | None = None) -> Row:
    """Run one row's subprocess (its output appended to ``log_path``) and read back its JSON record."""
    with tempfile.TemporaryDirectory() as tmp:
        json_path = os.path.join(tmp, "row.json")
        cmd = [sys.executable, *row.argv, "--json", json_path]
        with open(log_path, "a") as log:
            log.write(f"== {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=_default_sigint)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGINT)  # Ray's driver shuts down its actors on SIGINT
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                row.error = f"timed out after {timeout_s:.0f} s"
                return row
            finally:
                try:  # whatever the row left behind in its session (Ray's raylet, workers)
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            log.write(f"== rc {rc}\n")
        if rc != 0 or not os.path.exists(json_path):
            row.error = f"exit status {rc}" + ("" if rc else ", no JSON record")
            return row
        with open(json_path) as f:
            row.record = json.load(f)
    return row


def row_metrics(row: Row, seq_len: int) -> dict:
    """tokens/s per GPU, step ms, SOL (dtype peak), MFU (bf16 peak), peak memory GiB; None where unknown."""
    r = row.record
    tps = r.get("tokens_per_s_per_gpu", r.get("tokens_per_s"))
    fpt = PRESETS[row.model].flops_per_token(seq_len) if row.model in PRESETS else None
    fraction = lambda dtype: sol_fraction(tps, fpt, peak_tflops(r.get("gpu"), dtype)) if fpt else None  # noqa: E731
    return {"tokens_per_s": tps, "step_ms": r.get("step_ms"), "sol": fraction(row.matmul_dtype),
            "mfu": fraction("bf16"), "peak_memory_gib": r.get("peak_memory_gib")}


def format_table(rows: list[Row], seq_len: int) -> str:
    """The markdown table and, below it, each row's command."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [f"T={seq_len}, from scratch on random tokens, tokens/s per GPU (median of the timed steps; one GPU unless "
             "the setup says more)",
             "",
             "| model | setup | B x micro-steps | tokens/s | step ms | SOL (dtype peak) | MFU (bf16 peak) "
             "| peak memory |",
             "|---|---|---|---|---|---|---|---|"]
    gpus = sorted({r.record.get("gpu") for r in rows if r.record and r.record.get("gpu")})
    for i, row in enumerate(rows, 1):
        head = f"| {row.model} | {row.setup} [{i}] | {row.batch} x {row.micro_steps} |"
        if row.record is None:
            lines.append(f"{head} failed ({row.error}) | | | | |")
            continue
        m = row_metrics(row, seq_len)
        mem = "-" if m["peak_memory_gib"] is None else f"{m['peak_memory_gib']:.1f} GiB"
        lines.append(f"{head} **{m['tokens_per_s']:,.0f}** | {m['step_ms']:,.1f} | {pct(m['sol'])} | "
                     f"{pct(m['mfu'])} | {mem} |")
    lines += ["", f"GPU: {', '.join(gpus) or 'unknown'}. Commands:"]
    shown = lambda a: os.path.relpath(a, os.path.dirname(HERE)) if a.startswith(HERE) else a  # noqa: E731
    lines += [f"[{i}] `python {' '.join(shown(a) for a in row.argv)}`" for i, row in enumerate(rows, 1)]
    return "\n".join(lines)


def rows_to_json(rows: list[Row], seq_len: int) -> dict:
    return {"seq_len": seq_len, "rows": [row.__dict__ for row in rows]}


def rows_from_json(paths: list[str]) -> tuple[list[Row], int]:
    rows, seq_lens = [], set()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        seq_lens.add(data["seq_len"])
        rows += [Row(**r) for r in data["rows"]]
    if len(seq_lens) > 1:
        raise SystemExit(f"--merge: the files were measured at different --seq-len values {sorted(seq_lens)}; "
                         f"merge only runs of one sequence length.")
    return rows, seq_lens.pop() if seq_lens else 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=["Qwen2.5-0.5B", "Qwen2.5-1.5B"], help="presets")
    p.add_argument("--backends", nargs="+", default=["triton", "torch"], choices=["triton", "torch", "cupy"])
    p.add_argument("--matmul-dtypes", nargs="+", default=["bf16", "e4m3"], choices=["bf16", "e4m3"],
                   help="for the fast backends (the torch reference runs bf16 only)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--overlap-wgrad-sms", type=int, default=0,
                   help=">0: also a triton bf16 row with the block wgrads on a side stream of this many SMs")
    p.add_argument("--no-hf-baseline", dest="hf_baseline", action="store_false", help="leave out the HF baseline")
    p.add_argument("--gpus", nargs="+", type=int, default=[1], help="GPU counts (CPU: worker counts) of our and llm.q's rows")
    p.add_argument("--zero-levels", nargs="+", type=int, default=[1], choices=[1, 2, 3], help="ZeRO levels of our rows")
    p.add_argument("--fp8-head", action="store_true", help="the e4m3 rows run the LM head in FP8 too (--lmhead-dtype e4m3)")
    p.add_argument("--fp8-delayed-swiglu-scale", dest="fp8_delayed", action="store_true",
                   help="the e4m3 rows quantize the SwiGLU input/gradient at the previous pass's scale")
    p.add_argument("--triton-shape", nargs=4, type=int, default=None, metavar=("BATCH", "MICRO", "STEPS", "WARMUP"),
                   help="batch, micro-steps per step, steps in all and warm-up steps (STEPS - WARMUP are timed) of "
                        "the triton/cupy and llm.q rows, instead of each model's default shape")
    p.add_argument("--llmq-bin", default=None, help="folder of llm.q's prebuilt train binary: adds its rows")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the script")
    p.add_argument("--row-timeout-s", type=float, default=150.0, help="time limit of one row")
    p.add_argument("--hf-timeout-s", type=float, default=400.0,
                   help="time limit of an HF baseline row (its torch.compile takes minutes on a fresh machine)")
    p.add_argument("--log", default="speed_table.log", help="every row's output is appended here")
    p.add_argument("--json-out", default=None, help="write the rows and their records here (for --merge)")
    p.add_argument("--markdown-out", default=None, help="write the table here too")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="print one table from earlier --json-out files instead of running anything")
    a = p.parse_args(argv)
    if a.merge:
        rows, seq_len = rows_from_json(a.merge)
    else:
        unknown = [m for m in a.models if m not in PRESETS]
        if unknown:
            p.error(f"--models: {', '.join(unknown)} is not a preset; choose from {', '.join(sorted(PRESETS))}")
        seq_len = a.seq_len
        rows = plan_rows(a.models, a.backends, a.matmul_dtypes, seq_len, a.overlap_wgrad_sms,
                         a.hf_baseline and a.device == "cuda", a.device, a.llmq_bin, fp8_head=a.fp8_head,
                         gpus=a.gpus, zero_levels=a.zero_levels, triton_shape=a.triton_shape,
                         fp8_delayed=a.fp8_delayed)
        path = [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]  # the rows import this checkout
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
        for i, row in enumerate(rows, 1):
            run_row(row, a.hf_timeout_s if row.kind == "hf" else a.row_timeout_s, a.log, env)
            status = row.error or f"{row_metrics(row, seq_len)['tokens_per_s']:,.0f} tokens/s"
            print(f"[{i}/{len(rows)}] {row.model} | {row.setup}: {status}", flush=True)
            if a.json_out:  # after every row, so a cut-off run keeps what it measured
                atomic_write_json(a.json_out, rows_to_json(rows[:i], seq_len))
    table = format_table(rows, seq_len)
    print("\n" + table)
    if a.markdown_out:
        atomic_write_text(a.markdown_out, table + "\n")
    return 0 if all(r.record is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
