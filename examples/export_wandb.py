"""Replay a finished (or running) run's JSON log into Weights & Biases.

    python examples/export_wandb.py --log out/log.jsonl --project llmq [--run-name qwen-0.5b] [--entity team]

Every record of the log goes through the same mapping as live logging (``llmq_ray.observe.wandb_logger``): options,
sol, dataset, gpu and allocator into the run config; step records as train/* at the step's number; eval
records as eval/loss; gpu_util samples as gpu{rank}/*; the summary into the run summary. Without
``--run-name`` the run is named after the log's folder. ``WANDB_MODE=offline`` writes the run locally (upload
later with ``wandb sync``); ``--dir`` is where W&B writes its files (default: next to the log).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.observe.runlog import read_log  # noqa: E402
from llmq_ray.observe.wandb_logger import WandbLogger  # noqa: E402


def load_records(path: str) -> list[dict]:
    """The records of a JSON log (a list of dicts with a "log" key); ValueError naming the file otherwise."""
    return read_log(path)


def default_run_name(log_path: str) -> str:
    folder = os.path.basename(os.path.dirname(os.path.abspath(log_path)))
    return folder or os.path.splitext(os.path.basename(log_path))[0]


def export(log_path: str, project: str, run_name: str | None = None, entity: str | None = None,
           wandb_dir: str | None = None) -> WandbLogger:
    """Replay ``log_path`` into a new W&B run; returns the finished logger (its ``run`` has the id/dir)."""
    records = load_records(log_path)
    options = next((r for r in records if r["log"] == "options"), {})
    config = {k: v for k, v in options.items() if k != "log"}
    kwargs = {"entity": entity} if entity else {}
    logger = WandbLogger(project, run_name or default_run_name(log_path), config,
                         dir=wandb_dir or os.path.dirname(os.path.abspath(log_path)), **kwargs)
    try:
        logger.log_records([r for r in records if r["log"] != "options"])
    finally:
        logger.finish()
    return logger


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", required=True, help="the run's JSON log (out-dir/log.jsonl)")
    p.add_argument("--project", required=True, help="W&B project")
    p.add_argument("--run-name", default=None, help="W&B run name (default: the log's folder name)")
    p.add_argument("--entity", default=None, help="W&B entity (team or user; default: yours)")
    p.add_argument("--dir", default=None, help="where W&B writes its files (default: the log's folder)")
    a = p.parse_args(argv)
    try:
        logger = export(a.log, a.project, a.run_name, a.entity, a.dir)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {a.log} to W&B project {a.project!r} as run {logger.run.name!r} ({logger.run.dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
