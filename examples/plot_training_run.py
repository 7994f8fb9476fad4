"""Plot one or more runs from their JSON logs into a PNG: loss (train + eval), learning rate, gradient norm
and tokens/s against the optimizer step, one colour per log.

    python examples/plot_training_run.py out/log.jsonl [other/log.jsonl ...] --out plot.png \
        [--labels bf16 fp8] [--smooth 10] [--title "Qwen2.5-0.5B"]

Legend: ``--labels`` if given, else the run's ``run_name`` option when it has one, else the log's folder (or
file) name. Train loss is drawn solid (optionally smoothed with a trailing mean over ``--smooth`` steps),
periodic eval losses as dashed lines with dots, the final
(full) eval as a star. Skipped steps (non-finite gradients) are left out. Uses
matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.observe.runlog import read_log, steps_as_one_run  # noqa: E402


def load_log(path: str) -> list[dict]:
    """The records of a run log (JSON Lines, or an earlier version's JSON list)."""
    return read_log(path)


def _f(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def series(records: list[dict]) -> dict[str, list]:
    """Columns to plot: "step" (1-based steps done), "loss", "lr", "norm", "tps" from step records;
    "eval_step", "eval_loss" from periodic eval records; "final_step", "final_loss" from full (final) evals.
    A log that spans resumes is one run: a step trained again after a restart replaces its earlier record."""
    out: dict[str, list] = {k: [] for k in ("step", "loss", "lr", "norm", "tps", "eval_step", "eval_loss",
                                            "final_step", "final_loss")}
    for r in steps_as_one_run(records):
        if not r.get("skipped"):
            out["step"].append(int(r["step"]))
            out["loss"].append(_f(r.get("loss")))
            out["lr"].append(_f(r.get("lr")))
            out["norm"].append(_f(r.get("norm", r.get("grad_norm"))))
            out["tps"].append(_f(r.get("tokens_per_s")))
    for r in records:
        if r["log"] == "eval":
            which = "final" if r.get("full") else "eval"
            out[f"{which}_step"].append(int(r["step"]))
            out[f"{which}_loss"].append(_f(r.get("loss")))
    return out


def run_label(path: str, records: list[dict]) -> str:
    opts = next((r for r in records if r["log"] == "options"), {})
    if opts.get("run_name"):
        return str(opts["run_name"])
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return folder if folder and os.path.basename(path) == "log.jsonl" else os.path.basename(path)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` finite values (window <= 1: unchanged)."""
    if window <= 1:
        return list(values)
    out, buf = [], []
    for v in values:
        if math.isfinite(v):
            buf.append(v)
            buf = buf[-window:]
        out.append(sum(buf) / len(buf) if buf else math.nan)
    return out


def plot(paths: list[str], out: str, labels: list[str] | None = None, smooth_window: int = 1,
         title: str | None = None) -> str:
    """Draw the 2x2 figure of ``paths`` into the PNG ``out``; returns its absolute path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels and len(labels) != len(paths):
        raise ValueError(f"--labels: {len(labels)} labels for {len(paths)} logs")
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax_loss, ax_lr, ax_norm, ax_tps = axes.ravel()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, path in enumerate(paths):
        recs = load_log(path)
        s = series(recs)
        name = labels[i] if labels else run_label(path, recs)
        c = colors[i % len(colors)]
        ax_loss.plot(s["step"], smooth(s["loss"], smooth_window), color=c, lw=1.2, label=f"{name} train")
        if s["eval_step"]:
            ax_loss.plot(s["eval_step"], s["eval_loss"], color=c, ls="--", marker="o", ms=4, label=f"{name} eval")
        if s["final_step"]:
            ax_loss.plot(s["final_step"], s["final_loss"], color=c, ls="none", marker="*", ms=11,
                         label=f"{name} final eval")
        ax_lr.plot(s["step"], s["lr"], color=c, label=name)
        ax_norm.plot(s["step"], s["norm"], color=c, lw=0.9, label=name)
        ax_tps.plot(s["step"], s["tps"], color=c, lw=0.9, label=name)
    for ax, what in ((ax_loss, "loss"), (ax_lr, "learning rate"), (ax_norm, "gradient norm"),
                     (ax_tps, "tokens / s")):
        ax.set_xlabel("step")
        ax.set_ylabel(what)
        ax.set_title(what + (f" (train smoothed over {smooth_window})" if ax is ax_loss and smooth_window > 1 else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_norm.set_yscale("log")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # through a sibling and a rename: an interrupted save never leaves a half-written picture at `out` (nor
    # destroys the one an earlier call wrote there)
    tmp = f"{out}.partial-{os.getpid()}"
    try:
        fig.savefig(tmp, dpi=110, format=os.path.splitext(out)[1].lstrip(".").lower() or "png")
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="JSON logs (out-dir/log.jsonl) of the runs to draw")
    p.add_argument("--out", default="plot.png", help="PNG to write")
    p.add_argument("--labels", nargs="+", default=None, help="legend names, one per log")
    p.add_argument("--smooth", type=int, default=1, help="trailing-mean window of the train loss (steps)")
    p.add_argument("--title", default=None, help="figure title")
    a = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib: pip install 'llmq-ray[plot]'.", file=sys.stderr)
        return 2
    try:
        path = plot(a.logs, a.out, a.labels, a.smooth, a.title)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
