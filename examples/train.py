"""Train with llmq-ray from the command line; with no arguments, a short run that suits this machine.

    python examples/train.py                      # CPU: tiny-qwen on tiny-shakespeare, ~2 minutes
    python examples/train.py --model Qwen2.5-0.5B --from-scratch --train-file 'data/web/train-*.bin' \
        --eval-file data/web/eval.bin --batch-size 16 --seq-len 1024 --steps 2000 --gpus 8
    python examples/train.py --help               # every flag, with its default

See llmq_ray/settings/defaults.py for what the "auto" defaults pick, docs/running-on-ray.md for the Ray dashboard, and
docs/stopping-and-resuming.md for SIGTERM / Ctrl-C, --continue and the exit codes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
