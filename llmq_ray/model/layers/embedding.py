"""The token embedding and GPT-2's learned positions, as pieces.

    x_0 = wte[tokens]                       wte [V, C], tokens [N] int64, x_0 [N, C] model dtype
    x_0 += wpe[positions]                   GPT-2: wpe [P, C], positions 0..T-1 in every window (or, with
                                            reset positions, each token's position inside its document)

The backward scatter-adds the rows of dL/dx_0 [N, C] into the tables' gradients (dwte, dwpe +=), so a token
that occurs twice gets both rows' sums. A plan that splits the vocabulary (llmq_ray/parallel/tensor.py) replaces
the token embedding with one of the same two methods that looks up only its rows.
"""

from __future__ import annotations

import torch

from llmq_ray.backends.base import Backend


class Embedding:
    """x_0 = table[tokens] and its backward (the backend's lookup and scatter-add)."""

    def __init__(self, backend: Backend):
        self.be = backend

    def forward(self, out: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor) -> None:
        self.be.embedding_forward(out, tokens, table)

    def backward(self, dtable: torch.Tensor, tokens: torch.Tensor, dout: torch.Tensor) -> None:
        self.be.embedding_backward(dtable, tokens, dout)


class LearnedPositions:
    """x_0 += wpe[positions] for windows of ``seq_len`` (``positions`` [B, T] int64, or None for 0..T-1)."""

    def __init__(self, backend: Backend, seq_len: int):
        self.be, self.seq_len = backend, seq_len

    def forward(self, out: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None) -> None:
        self.be.position_embedding_forward(out, table, self.seq_len, positions)

    def backward(self, dtable: torch.Tensor, dout: torch.Tensor, positions: torch.Tensor | None) -> None:
        self.be.position_embedding_backward(dtable, dout, self.seq_len, positions)
