"""How far Adam's update direction m / sqrt(v) drifts when the first moment is stored in e4m3 blocks (or bf16),
against fp32 m, on synthetic gradients (CPU, seconds; an analysis for issue 25's 8-bit optimizer state).

    python benchmarks/m8_noise.py --sigma 0.5 1.5 3

Each element i draws g_t = N(0, 1) * s_i for 100 steps, with per-element scales s_i log-normal (``--sigma``: the
spread of log s_i, i.e. how different the gradient magnitudes within a block are). m and v follow AdamW (beta1
0.9, beta2 0.95); the stored m is re-rounded after every step exactly as the optimizer stores it
(backends/fp8_moment.py: a power-of-two scale per block, stochastic rounding to e4m3; or bf16 with stochastic
rounding; not implemented in the optimizer: "int8/B", m in int8 blocks (a linear absmax / 127 scale per block,
stochastic rounding), and "e4m3u/B" / "int8u/B", u = m / (sqrt(v) + eps) stored that way and m read back as
u * (sqrt(v) + eps)). Printed: the relative error ||u_q - u|| / ||u|| of u = m / (sqrt(v) + eps), averaged over the last 20
steps, per storage (fp32 = 0 by construction).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.backends import fp8_moment  # noqa: E402
from llmq_ray.backends.torch_ref_optim import _round_chunk  # noqa: E402


def store(m: torch.Tensor, how: str, gen: torch.Generator) -> torch.Tensor:
    """m as the optimizer would store it: "bf16", or "e4m3/B" (blocks of B elements)."""
    if how == "bf16":
        return _round_chunk(m, gen).float()
    block = int(how.split("/")[1])
    if how.startswith("int8"):
        x = m.view(-1, block)
        s = x.abs().amax(dim=1).clamp(min=1e-30) / 127
        q = torch.floor(x / s[:, None] + torch.rand(x.shape, generator=gen)).clamp(-127, 127)
        return (q * s[:, None]).reshape(-1)
    x = m.view(-1, block)
    s = fp8_moment.block_scales(x.abs().amax(dim=1))
    y = (x / s[:, None]).reshape(-1).contiguous()
    r16 = torch.randint(0, 1 << 16, y.shape, generator=gen, dtype=torch.int32)
    return (fp8_moment.sr_e4m3(y, r16).view(-1, block) * s[:, None]).reshape(-1)


def drift(sigma: float, how: str, n: int = 1 << 16, steps: int = 100, b1: float = 0.9, b2: float = 0.95) -> float:
    gen = torch.Generator().manual_seed(0)
    s = torch.exp(torch.randn(n, generator=gen) * sigma)
    m32, mq, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    errs = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * s
        m32 = b1 * m32 + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        d = v.sqrt() + 1e-8
        if how.split("/")[0].endswith("u"):  # the update direction quantized, not m
            mq = store((b1 * mq + (1 - b1) * g) / d, how.replace("u/", "/"), gen) * d
        else:
            mq = store(b1 * mq + (1 - b1) * g, how, gen)
        errs.append(((mq / d - m32 / d).norm() / (m32 / d).norm()).item())
    return sum(errs[-20:]) / 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sigma", type=float, nargs="+", default=[0.5, 1.5, 3.0])
    p.add_argument("--storage", nargs="+", default=["bf16", "e4m3/256", "e4m3/32", "e4m3u/256", "int8/256",
                                                                "int8u/256"])
    a = p.parse_args(argv)
    print("| sigma | " + " | ".join(a.storage) + " |")
    print("|---|" + "---|" * len(a.storage))
    for sigma in a.sigma:
        print(f"| {sigma} | " + " | ".join(f"{100 * drift(sigma, h):.2f}%" for h in a.storage) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
