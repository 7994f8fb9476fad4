"""The from-scratch initialization (llmq_ray.model.params.init_params): its values depend only on the seed and
the tensor's name -- not on how many threads draw them, nor on which shard of the flat buffer asks."""

from __future__ import annotations

import hashlib

import pytest
import torch

from llmq_ray.model.config import PRESETS
from llmq_ray.model.params import ParamLayout, init_params


@pytest.fixture(scope="module")
def layout() -> ParamLayout:
    return ParamLayout(PRESETS["tiny"])


def drawn_with_threads(layout: ParamLayout, threads: int, start: int = 0, end: int | None = None) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flat = torch.full(((end or layout.numel) - start,), float("nan"))
        init_params(layout, flat, seed=11, start=start)
        return flat
    finally:
        torch.set_num_threads(before)


def test_values_do_not_depend_on_the_number_of_drawing_threads(layout):
    one = drawn_with_threads(layout, 1)
    assert not torch.isnan(one).any()
    assert torch.equal(one, drawn_with_threads(layout, 4))


def test_a_shard_gets_the_full_buffers_values(layout):
    full = drawn_with_threads(layout, 2)
    lo, hi = layout.numel // 3 + 5, 2 * layout.numel // 3 + 7  # cuts through tensors at both ends
    assert torch.equal(drawn_with_threads(layout, 2, lo, hi), full[lo:hi])


def test_each_tensor_is_its_own_seeded_normal_draw(layout):
    """The scheme in the docstring, checked tensor by tensor: matrices N(0, 0.02) from a generator seeded by
    sha256("seed:name"), the residual projections scaled by 1/sqrt(2L), norm weights one, biases zero."""
    flat = drawn_with_threads(layout, 3)
    residual_std = 0.02 / (2 * layout.cfg.num_layers) ** 0.5
    for slot in layout:
        got = flat[slot.offset:slot.end].view(slot.shape)
        leaf = slot.name.rsplit(".", 1)[-1]
        if leaf.endswith("norm") or leaf.endswith("_w") and leaf.startswith(("ln", "q_norm", "k_norm")):
            assert torch.equal(got, torch.ones_like(got)), slot.name
        elif leaf.endswith("_b"):
            assert torch.equal(got, torch.zeros_like(got)), slot.name
        else:
            digest = hashlib.sha256(f"11:{slot.name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            scale = residual_std if leaf in ("out_w", "down_w") else 0.02
            want = torch.empty(slot.shape).normal_(0.0, scale, generator=gen)
            assert torch.equal(got, want), slot.name
