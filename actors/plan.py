"""``RunPlan``: what the trainer decided at start, travelling (pickled) with the resolved settings from the driver to
the coordinator and on to every worker.

The settings tree (llmq_ray/settings/) says what the user asked for, resolved for the machine; the plan adds
only what is decided once Ray knows the cluster and the checkpoint folder: how many workers, which checkpoint a
run resumes from, whether a restarted coordinator appends to the log, the rendezvous ports. Paths are resolved
on the node that opens them: on a cluster without a shared disk, the train and eval files must be visible on
every worker's node and the out-dir on the coordinator's (the driver's) node, or be object-store URIs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from llmq_ray.settings import RunSettings


@dataclasses.dataclass
class RunPlan:
    """A run's settings (resolved: no "auto" left but the memory-dependent GiB values) and the start's decisions."""

    settings: RunSettings
    world_size: int = 1
    resume_from: Optional[str] = None     # the checkpoint folder to start from (None: from scratch)
    append_log: bool = False              # append to the run's log (a coordinator restarted by the driver)
    rendezvous_ports: Optional[tuple] = None  # (lo, hi) from --rendezvous-port-range (None: any free port)
    # the test hook: faults injected on purpose (actors/fault_injection.py lists the kinds), read by the trainer
    # from the environment variable LLMQ_RAY_TEST_FAULT; None in real runs
    fault: Optional[object] = None
    # the name of the run's worker placement groups ("" for none): Ray ties a group that an actor made to the job,
    # not to that actor, so the driver removes a lost coordinator's group by this name (actors/placement.py)
    placement_name: str = ""

    @property
    def checkpoints_on(self) -> bool:
        """Checkpoints are written during the run (every N steps or every M minutes): restarts can resume."""
        c = self.settings.checkpoints
        return c.ckpt_interval > 0 or c.ckpt_minutes > 0

    @property
    def ckpt_dir(self) -> str:
        c, o = self.settings.checkpoints, self.settings.observe
        return c.checkpoint_dir or os.path.join(o.out_dir, "ckpt")

    @property
    def data_parallel_size(self) -> int:
        """How many workers read batches of their own: world_size / --tensor-parallel (the ranks of a
        tensor-parallel group compute one batch between them)."""
        return self.world_size // self.settings.parallel.tensor_parallel

    @property
    def reads_with_ray_data(self) -> bool:
        """The train batches come from Ray Data tasks (a file is read, --no-ray-data not given): those tasks need
        CPUs of the cluster besides the workers' own."""
        d = self.settings.data
        return d.use_ray_data and not d.synthetic_data

    @property
    def tokens_per_step(self) -> int:
        d = self.settings.data
        return d.batch_size * d.seq_len * d.grad_accumulation * self.data_parallel_size
