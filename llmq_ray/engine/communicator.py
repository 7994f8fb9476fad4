"""The collectives interface the engine runs on, and its single-process identity.

The engine (llmq_ray/engine/train_engine.py) and the model's vocab-parallel LM head call only these methods;
``actors/collectives.py`` implements them over torch.distributed (``TorchDistCommunicator``, and
``NodeScopeCommunicator`` for ``--zero-scope node``). Nothing here imports Ray.
"""

from __future__ import annotations

import torch


class Communicator:
    """Collectives over the flat buffers of all ranks. This base class is the single-process identity.

    ``rank`` / ``world_size`` are this rank's place in its *shard group*: the ranks that split the ZeRO
    shards between them (every rank of the run, unless ``--zero-scope node`` makes it the ranks of one node).
    Everything the engine sizes or indexes by shard uses them. ``replica`` / ``replicas``: which copy of the
    shards this group is, and how many copies the run holds (1 unless the shards are replicated per node).
    The shard collectives (``reduce_scatter_sum``, ``all_gather``, ``broadcast``, ``reduce_sum``) leave every
    copy of a shard identical; ``all_reduce_sum`` sums over every rank of the run.
    """

    rank = 0
    world_size = 1
    replica = 0
    replicas = 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """In place: tensor = sum over every rank of the run (data-parallel totals: loss sums, target counts)."""

    def all_reduce_over_shards(self, tensor: torch.Tensor) -> None:
        """In place: tensor = sum over the ranks of one shard group, so each shard counts once (e.g. the squared
        gradient norm of this rank's shard; summing over every copy would count it ``replicas`` times)."""
        self.all_reduce_sum(tensor)

    def reduce_scatter_sum(self, shard_out: torch.Tensor, full: torch.Tensor) -> None:
        """shard_out[S] = (sum over every rank of the run of full[W*S])[rank*S:(rank+1)*S], W = world_size.
        May alias full's own shard."""
        size = shard_out.numel()
        if shard_out.data_ptr() != full[self.rank * size:].data_ptr():
            shard_out.copy_(full[self.rank * size:(self.rank + 1) * size])

    def reduce_scatter_start(self, shard_out: torch.Tensor, full: torch.Tensor):
        """``reduce_scatter_sum`` returning a handle whose ``wait()`` orders later work after it (asynchronous
        where the backend allows; here done at once). ``shard_out`` must not alias ``full``."""
        self.reduce_scatter_sum(shard_out, full)
        return DONE

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full[W*S] = concatenation of the shard group's shards[S] (shard may alias full's own slice)."""
        size = shard.numel()
        if shard.data_ptr() != full[self.rank * size:].data_ptr():
            full[self.rank * size:(self.rank + 1) * size].copy_(shard)

    # ZeRO-3's per-piece collectives: asynchronous, they return a handle whose ``wait()`` orders later work
    # after them. In place; any sizes (pieces of a layer are uneven).
    def broadcast(self, tensor: torch.Tensor, src: int):
        """tensor = shard-group rank ``src``'s tensor, on every rank (every copy of a shard is the same)."""
        return DONE

    def reduce_sum(self, tensor: torch.Tensor, dst: int):
        """On shard-group rank ``dst`` (in every copy): tensor = sum over every rank of the run (other ranks'
        tensors are left undefined)."""
        return DONE


class _Done:
    """The handle of a collective that is already complete."""

    def wait(self) -> None:
        pass


DONE = _Done()  # shared: a group of one rank returns it from its async collectives
