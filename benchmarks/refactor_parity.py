"""Per-step losses and gradient norms of a fixed matrix of CPU runs, to show a refactor leaves the numerics alone.

    python benchmarks/refactor_parity.py run before.json            # on the commit before the change
    python benchmarks/refactor_parity.py run after.json             # on the change
    python benchmarks/refactor_parity.py compare before.json after.json

``run`` trains every configuration of ``CONFIGS`` through the command line (``examples/train.py``: the flags are
the public interface a refactor must keep) on CPU workers with synthetic tokens, against one Ray instance held
by this script, and writes each run's per-step loss and norm as exact hex floats. ``compare`` reports, per
configuration, whether the two files agree bit for bit, and the largest relative difference where they do not.
``resumed`` rows continue the run of the same name without the suffix from its checkpoint at step 2: their
steps 3-4 must equal the uninterrupted run's, which ``run`` checks too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--synthetic-data", "--device", "cpu",
          "--backend", "torch", "--no-export", "--no-final-eval", "--sample-tokens", "0", "--no-progress",
          "--ckpt-minutes", "0", "--eval-every-n-steps", "0", "--learning-rate", "3e-3", "--warmup", "1"]
# name: (flags, workers); every run is 4 steps of 2 x 32 tokens per worker
CONFIGS = {
    "qwen2-fp32-1w": (["--model", "tiny"], 1),
    "qwen2-fp32-zero1": (["--model", "tiny"], 2),
    "qwen2-fp32-zero2": (["--model", "tiny", "--zero-level", "2"], 2),
    "qwen2-fp32-zero3": (["--model", "tiny", "--zero-level", "3"], 2),
    "qwen2-fp32-tp2": (["--model", "tiny", "--tensor-parallel", "2"], 2),
    "qwen2-fp32-tp2-zero3": (["--model", "tiny", "--tensor-parallel", "2", "--zero-level", "3"], 2),
    "qwen2-bf16-zero1": (["--model", "tiny", "--model-dtype", "bf16"], 2),
    "qwen2-bf16-recompute-block": (["--model", "tiny", "--model-dtype", "bf16", "--recompute-block"], 1),
    "qwen2-bf16-recompute-ffn-att": (["--model", "tiny", "--model-dtype", "bf16", "--recompute-ffn",
                                      "--recompute-att"], 2),
    "qwen2-bf16-offload": (["--model", "tiny", "--model-dtype", "bf16", "--offload-master", "--offload-opt-m",
                            "--offload-residual"], 1),
    "qwen2-bf16-e4m3": (["--model", "tiny", "--model-dtype", "bf16", "--matmul-dtype", "e4m3",
                         "--lmhead-dtype", "bf16"], 1),
    "qwen2-bf16-e4m3-zero3": (["--model", "tiny", "--model-dtype", "bf16", "--matmul-dtype", "e4m3",
                               "--lmhead-dtype", "bf16", "--zero-level", "3"], 2),
    "qwen2-fp32-docmask": (["--model", "tiny", "--document-masking", "--document-separator", "7"], 1),
    "llama-fp32-zero1": (["--model", "tiny-llama"], 2),
    "qwen3-fp32-zero1": (["--model", "tiny-qwen3"], 2),
    "qwen3-bf16-zero3": (["--model", "tiny-qwen3", "--model-dtype", "bf16", "--zero-level", "3"], 2),
    "qwen3-fp32-tp2": (["--model", "tiny-qwen3", "--tensor-parallel", "2"], 2),
    "gpt2-fp32-1w": (["--model", "tiny-gpt2"], 1),
    "gpt2-fp32-zero1": (["--model", "tiny-gpt2"], 2),
    "gpt2-bf16-recompute-block": (["--model", "tiny-gpt2", "--model-dtype", "bf16", "--recompute-block"], 1),
    # configurations only the redesigned command line has (2026-12-02): the e4m3 recipe of before, spelled out now
    # that the delayed SwiGLU scale is e4m3's default (compare with the rows above of the same name without the
    # suffix), and GPT-2 under ZeRO-2/3 (compare with gpt2-fp32-zero1)
    "qwen2-bf16-e4m3-current": (["--model", "tiny", "--model-dtype", "bf16", "--matmul-dtype", "e4m3",
                                 "--lmhead-dtype", "bf16", "--swiglu-fp8-scale", "current"], 1),
    "qwen2-bf16-e4m3-zero3-current": (["--model", "tiny", "--model-dtype", "bf16", "--matmul-dtype", "e4m3",
                                       "--lmhead-dtype", "bf16", "--swiglu-fp8-scale", "current", "--zero-level",
                                       "3"], 2),
    "gpt2-fp32-zero2": (["--model", "tiny-gpt2", "--zero-level", "2"], 2),
    "gpt2-fp32-zero3": (["--model", "tiny-gpt2", "--zero-level", "3"], 2),
    "qwen2-fp32-zero1-resumed": (["--model", "tiny"], 2),
    "qwen3-bf16-zero3-resumed": (["--model", "tiny-qwen3", "--model-dtype", "bf16", "--zero-level", "3"], 2),
}


def _steps(log_path: str) -> list[dict]:
    out = []
    with open(log_path) as f:
        text = f.read()
    records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x]
    for r in records:
        if r.get("log") == "step":
            out.append({"step": r["step"], "loss": float(r["loss"]).hex(), "norm": float(r["norm"]).hex()})
    return out


def run(out_path: str, only: list[str] | None) -> int:
    import ray

    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="disabled")
    os.environ.update(env)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20)
    address = ray.get_runtime_context().gcs_address
    results, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (flags, workers) in CONFIGS.items():
            if only and name not in only and name.removesuffix("-resumed") not in only:
                continue
            out_dir = os.path.join(tmp, name)
            cmd = [sys.executable, os.path.join(ROOT, "examples", "train.py"), *COMMON, *flags,
                   "--workers", str(workers), "--out-dir", out_dir, "--ray-address", address]
            if name.endswith("-resumed"):
                base = os.path.join(tmp, name.removesuffix("-resumed"))
                cmd += ["--continue", os.path.join(base, "ckpt", "step_00000002")]
            else:
                cmd += ["--ckpt-interval", "2", "--ckpt-keep-n", "3"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            if proc.returncode != 0:
                failed.append(name)
                results[name] = {"error": (proc.stdout + proc.stderr)[-1500:]}
                print(f"{name}: exit {proc.returncode}\n{results[name]['error']}", flush=True)
                continue
            results[name] = {"steps": _steps(os.path.join(out_dir, "log.jsonl"))}
            print(f"{name}: {[float.fromhex(s['loss']) for s in results[name]['steps']]}", flush=True)
    ray.shutdown()
    for name in list(results):
        base = name.removesuffix("-resumed")
        if name != base and "steps" in results.get(name, {}) and "steps" in results.get(base, {}):
            tail = [s for s in results[name]["steps"] if s["step"] > 2]
            same = tail == [s for s in results[base]["steps"] if s["step"] > 2]
            print(f"{name}: steps 3-4 {'equal' if same else 'DIFFER from'} the uninterrupted run's")
            failed += [] if same else [name]
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    return 1 if failed else 0


def compare(a_path: str, b_path: str, pairs: list[str] | None = None) -> int:
    """``pairs``: "A=B" compares configuration A of the first file with B of the second (default: each name with
    itself)."""
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    bad = 0
    names = [tuple(x.split("=", 1)) for x in pairs] if pairs else [(n, n) for n in a]
    for name, other in names:
        if other != name:
            b = dict(b, **{name: b.get(other, {"error": f"no {other}"})})
        if name not in b:
            print(f"{name:32s} missing in {b_path}")
            bad += 1
            continue
        sa, sb = a[name].get("steps"), b[name].get("steps")
        if sa is None or sb is None:
            print(f"{name:32s} failed in {'first' if sa is None else 'second'} file")
            bad += 1
            continue
        # the losses and norms in step order (the step numbers themselves went from 0-based to 1-based in the
        # log, as the console prints them: a file from before that change still compares)
        if [(x["loss"], x["norm"]) for x in sa] == [(y["loss"], y["norm"]) for y in sb]:
            print(f"{name:32s} bit-identical ({len(sa)} steps, loss and norm)")
            continue
        rel = max((abs(float.fromhex(x[k]) - float.fromhex(y[k])) / max(abs(float.fromhex(x[k])), 1e-30)
                   for x, y in zip(sa, sb) for k in ("loss", "norm")), default=float("inf"))
        print(f"{name:32s} DIFFERENT: largest relative difference {rel:.3e}")
        bad += 1
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train every configuration, write the per-step losses")
    r.add_argument("out", help="JSON file to write")
    r.add_argument("--only", nargs="*", help="configuration names (default: all)")
    c = sub.add_parser("compare", help="compare two files of `run`")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--pairs", nargs="*", help="A=B: configuration A of the first file against B of the second")
    args = p.parse_args(argv)
    return run(args.out, args.only) if args.cmd == "run" else compare(args.a, args.b, args.pairs)


if __name__ == "__main__":
    sys.exit(main())
