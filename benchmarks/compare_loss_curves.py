"""Compare the per-step train losses of two runs' JSON logs (e.g. 1 GPU with grad accumulation against N GPUs
over the same global batch): a table every ``--every`` steps, the largest relative difference, final evals.

    python benchmarks/compare_loss_curves.py out/curve_1gpu/log.jsonl out/curve_2gpu/log.jsonl --labels "1 GPU" "2 GPUs"
    python benchmarks/compare_loss_curves.py g1.json g2.json --reference g1b.json --plot curves.png

``--reference`` names a third run that differs from the first only by what must not matter (e.g. the same
global batch summed in another order on one GPU): its distance from the first run is the noise, and the second
run is "within the noise" when its largest relative difference from the first is no larger than that.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.observe.runlog import read_log  # noqa: E402


def read_losses(path: str) -> tuple[list[float], list[float]]:
    """(train losses per step, eval losses) of a run's log (records with log = "step" / "eval")."""
    log = read_log(path)
    return ([r["loss"] for r in log if r.get("log") == "step"], [r["loss"] for r in log if r.get("log") == "eval"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="JSON log of the reference run")
    p.add_argument("b", help="JSON log of the run compared with it")
    p.add_argument("--labels", nargs=2, default=["a", "b"], help="column names")
    p.add_argument("--every", type=int, default=3, help="print every N-th step")
    p.add_argument("--reference", default=None, help="JSON log of a noise-reference run (see above)")
    p.add_argument("--plot", default=None, help="write a PNG of the curves here (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        (sa, ea), (sb, eb) = read_losses(args.a), read_losses(args.b)
        sr, er = read_losses(args.reference) if args.reference else ([], [])
    except (OSError, ValueError, KeyError) as exc:
        print(f"cannot compare: {exc}", file=sys.stderr)
        return 2
    n = min(len(sa), len(sb))
    if n == 0:
        print(f"cannot compare: no step records in {args.a if not sa else args.b}", file=sys.stderr)
        return 2
    print(f"step  {args.labels[0]:>12}  {args.labels[1]:>12}")
    for i in range(0, n, args.every):
        print(f"{i:4d}  {sa[i]:12.4f}  {sb[i]:12.4f}")
    worst = max_relative_difference(sa[:n], sb[:n])
    print(f"max relative loss difference over {n} steps: {worst:.2e}; final eval {ea[-1:]} vs {eb[-1:]}")
    if args.reference:
        noise = max_relative_difference(sa[:n], sr[:n])
        verdict = "within" if worst <= noise else "OUTSIDE"
        print(f"noise (first run vs reference): {noise:.2e}, final eval {er[-1:]}; the second run is {verdict} "
              "the noise")
    if args.plot:
        plot_curves(args.plot, {args.labels[0]: sa, args.labels[1]: sb, **({"reference": sr} if sr else {})})
    return 0


def max_relative_difference(a: list[float], b: list[float]) -> float:
    """max_i |a_i - b_i| / |a_i| over the common steps (inf if there are none)."""
    n = min(len(a), len(b))
    return max((abs(x - y) / abs(x) for x, y in zip(a[:n], b[:n])), default=float("inf"))


def plot_curves(path: str, curves: dict[str, list[float]]) -> None:
    """Train loss per step of each run into one PNG (skipped with a note if matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"no plot: {exc}")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (label, losses), style in zip(curves.items(), ("-", "--", ":")):
        ax.plot(losses, style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
