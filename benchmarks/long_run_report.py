"""Issue 25's long loss check, read from two runs' JSON logs (bf16 and e4m3 on the same data, seed and
schedule): whether the curves end within a tolerance of each other, and a plot of both with the FP8 monitor's
per-layer maxima of the e4m3 run.

    python benchmarks/long_run_report.py runs/long/bf16.json runs/long/e4m3.json --plot long.png

Printed: the tokens each run trained on, the final eval losses and their relative difference, the mean train
loss of the last ``--tail`` steps of each and its relative difference, and "WITHIN" or "OUTSIDE" the
``--tolerance`` (default 1%) for both; then, for the e4m3 run's ``fp8_monitor`` records (``--fp8-monitor-every``),
the largest |SwiGLU output| seen, its layer and step. The plot (matplotlib) has two panels: train loss (a running
mean over ``--tail`` steps) and eval loss of both runs against tokens, and every layer's max |SwiGLU output|
against steps with the e4m3 maximum (448) for reference.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.observe.runlog import read_log  # noqa: E402

E4M3_MAX = 448.0


def summarize(path: str, tail: int) -> dict:
    """Steps, tokens, the per-step train losses, the evals (step, loss) and the fp8_monitor records of a log."""
    log = read_log(path)
    by_step = {}  # a step trained again after a resume from an older checkpoint: its last record counts
    for r in log:
        if r.get("log") == "step":
            by_step[int(r["step"])] = r
    steps = [by_step[k] for k in sorted(by_step)]
    if len(steps) < tail:
        raise SystemExit(f"{path}: {len(steps)} step records, fewer than --tail {tail}.")
    tokens = sum(int(r.get("tokens", 0)) for r in steps)  # each record holds its own step's tokens
    return {"steps": [int(r["step"]) for r in steps], "loss": [float(r["loss"]) for r in steps],
            "tokens": tokens, "tokens_per_step": tokens / len(steps),
            "evals": [(int(r.get("step", 0)), float(r["loss"])) for r in log if r.get("log") == "eval"],
            "monitor": [r for r in log if r.get("log") == "fp8_monitor"]}


def running_mean(xs: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bf16_log")
    p.add_argument("e4m3_log")
    p.add_argument("--tail", type=int, default=100, help="steps averaged for the final train loss")
    p.add_argument("--tolerance", type=float, default=0.01, help="relative difference allowed at the end")
    p.add_argument("--plot", default=None, help="write the PNG here")
    a = p.parse_args(argv)
    runs = {"bf16": summarize(a.bf16_log, a.tail), "e4m3": summarize(a.e4m3_log, a.tail)}
    for name, r in runs.items():
        final_eval = r["evals"][-1][1] if r["evals"] else float("nan")
        r["train_tail"] = sum(r["loss"][-a.tail:]) / a.tail
        r["final_eval"] = final_eval
        print(f"{name}: {len(r['steps'])} steps, {r['tokens'] / 1e6:.3f}M tokens, train (last {a.tail}) "
              f"{r['train_tail']:.4f}, final eval {final_eval:.4f}")
    b, e = runs["bf16"], runs["e4m3"]
    for what in ("train_tail", "final_eval"):
        rel = (e[what] - b[what]) / b[what]
        verdict = "WITHIN" if abs(rel) <= a.tolerance else "OUTSIDE"
        print(f"{what}: e4m3 vs bf16 {rel * 100:+.2f}% -- {verdict} {a.tolerance * 100:g}%")
    if e["monitor"]:
        top = max(e["monitor"], key=lambda r: r["max"])
        print(f"fp8 monitor: {len(e['monitor'])} records, largest |SwiGLU out| {top['max']:.1f} at layer "
              f"{top['max_layer']} step {top['step']} (e4m3 max {E4M3_MAX:g}; per-tensor scaling maps each "
              f"tensor's max onto it)")
        shares = [r for r in e["monitor"] if r.get("saturated_share_max") is not None]
        if shares:
            worst = max(shares, key=lambda r: r["saturated_share_max"])
            print(f"fp8 monitor: largest share of SwiGLU FP8 inputs at the FP8 maximum (delayed scale) "
                  f"{worst['saturated_share_max']:.2e} at step {worst['step']}")
    else:
        print("fp8 monitor: no records in the e4m3 log (run it with --fp8-monitor-every N)")
    if a.plot:
        plot(a.plot, runs, a.tail)
    return 0


def plot(path: str, runs: dict, tail: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"no plot: {exc}")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, r in runs.items():
        tok = [s * r["tokens_per_step"] / 1e6 for s in r["steps"]]
        ax1.plot(tok, running_mean(r["loss"], tail), label=f"{name} train (mean of {tail})")
        if r["evals"]:
            ax1.plot([s * r["tokens_per_step"] / 1e6 for s, _ in r["evals"]], [v for _, v in r["evals"]],
                     "o", label=f"{name} eval")
    ax1.set_xlabel("tokens (M)")
    ax1.set_ylabel("loss")
    ax1.legend()
    mon = runs["e4m3"]["monitor"]
    if mon:
        steps = [r["step"] for r in mon]
        for layer in range(len(mon[0]["swiglu_absmax"])):
            ax2.plot(steps, [r["swiglu_absmax"][layer] for r in mon], lw=0.8)
        ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("max |SwiGLU output| per layer (e4m3 run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
