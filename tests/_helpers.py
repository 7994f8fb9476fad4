"""Small helpers shared by several test modules (imported as ``from _helpers import ...``: pytest puts tests/
on sys.path, since tests/ is not a package)."""

import io

import torch


class FakeTTY(io.StringIO):
    """A text stream that says it is a terminal, so progress bars draw on it."""

    def isatty(self):
        return True


def perturb_norms_and_biases(model) -> None:
    """Add 0.5 x N(0, 1) noise (seeded) to the QKV biases and the norm weights of ``model`` in place.

    Trained models have non-zero QKV biases and norm weights away from 1; init has neither, which would hide
    a bias applied at the wrong scale inside the FP8 GEMM."""
    gen = torch.Generator().manual_seed(123)
    for slot in model.layout:
        if slot.name.endswith(("qkv_b", "ln1_w", "ln2_w", "final_norm")):
            view = model.params[slot.offset:slot.end]
            noise = torch.randn(view.shape, generator=gen).to(view.device)
            view.add_((0.5 * noise).to(view.dtype))


def bf16_stochastic_neighbours(got_bf16, want_fp32):
    """Every got is one of the two stochastic-rounding candidates of want: want truncated to bf16 (towards
    zero) or the next bf16 away from zero."""
    bits = want_fp32.float().contiguous().view(torch.int32)
    toward_zero = (bits & -65536).view(torch.float32)
    away = ((bits & -65536) + 65536).view(torch.float32)
    got = got_bf16.float()
    return ((got == toward_zero) | (got == away) | (got == want_fp32)).all().item()
