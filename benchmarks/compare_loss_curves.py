"""Compare the per-step train losses of two runs' JSON logs (e.g. 1 GPU with grad accumulation against N GPUs
over the same global batch): a table every ``--every`` steps, the largest relative difference, final evals.

    python benchmarks/compare_loss_curves.py out/curve_1gpu/log.jsonl out/curve_2gpu/log.jsonl --labels "1 GPU" "2 GPUs"
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
    args = p.parse_args(argv)
    try:
        (sa, ea), (sb, eb) = read_losses(args.a), read_losses(args.b)
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
    worst = max(abs(x - y) / abs(x) for x, y in zip(sa[:n], sb[:n]))
    print(f"max relative loss difference over {n} steps: {worst:.2e}; final eval {ea[-1:]} vs {eb[-1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
