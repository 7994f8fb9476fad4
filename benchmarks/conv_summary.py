"""Summary of a multi-seed loss check (issue 25's numerics point): for each kind of run and seed, the mean train
loss of the last 20 steps and every eval; for each kind, the mean, standard deviation and range of the final eval
over its seeds -- "within the bf16 seeds' own spread" is read off these lines.

    python benchmarks/conv_summary.py OUT bf16 dly --seeds 42 43 44 45 --steps 300

reads OUT/conv_<kind>_<seed>.json (the runs' --log-file), as benchmarks/loss_check.sh writes
them. A run with fewer than --steps step records or no eval is reported as incomplete and left out of the means.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.observe.runlog import read_log  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the folder holding conv_<kind>_<seed>.json")
    p.add_argument("kinds", nargs="+", help="kinds of run, e.g. bf16 dly")
    p.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44, 45])
    p.add_argument("--steps", type=int, default=300, help="steps a complete run logged")
    a = p.parse_args(argv)
    done = {}
    for kind in a.kinds:
        for seed in a.seeds:
            try:
                log = read_log(os.path.join(a.out, f"conv_{kind}_{seed}.json"))
            except Exception as exc:  # a run that never started writes no log: say so and go on
                print(f"CONV {kind} {seed}: no log ({exc})")
                continue
            steps = [r["loss"] for r in log if r.get("log") == "step"]
            evals = [r["loss"] for r in log if r.get("log") == "eval"]
            if len(steps) < a.steps or not evals:
                print(f"CONV {kind} {seed}: incomplete ({len(steps)} steps)")
                continue
            done[kind, seed] = (sum(steps[-20:]) / 20, evals)
            print(f"CONV {kind} {seed}: train (last 20) {done[kind, seed][0]:.4f}, eval "
                  + " / ".join(f"{e:.4f}" for e in evals))
    for kind in a.kinds:
        got = [done[kind, s] for s in a.seeds if (kind, s) in done]
        if len(got) >= 2:
            train, final = [g[0] for g in got], [g[1][-1] for g in got]
            print(f"MEAN {kind} ({len(got)} seeds): train {statistics.mean(train):.4f} "
                  f"(sd {statistics.stdev(train):.3f}), final eval {statistics.mean(final):.4f} "
                  f"(sd {statistics.stdev(final):.3f}, range {min(final):.4f}-{max(final):.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
