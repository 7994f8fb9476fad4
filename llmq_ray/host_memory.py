"""Host memory the device can stream from: the one helper the model, the linears and the engine's offloading
all need, in a leaf module so that the model does not import the engine's offload machinery."""

from __future__ import annotations

import torch


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled 1-D host tensor [numel] that ``device`` can stream from: pinned for CUDA, plain for CPU."""
    pin = torch.device(device).type == "cuda"
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)
