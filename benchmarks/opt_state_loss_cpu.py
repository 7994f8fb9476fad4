"""Does an 8-bit Adam state keep the loss? A CPU screen before any kernel is written.

A small Qwen2 (transformers, 4 layers, hidden 128) learns tiny-shakespeare as bytes (vocabulary 256, so a step
takes milliseconds on a CPU) with llmq-ray's reference AdamW (backends/torch_ref_optim.adamw_update: the exact
rounding of every state dtype) applied to each parameter, for each choice of moment dtypes and a few seeds;
printed: the mean eval loss over the seeds' last evaluations and their spread. What it can say: whether a
format's rounding noise costs loss at this scale and learning rate, not how a 0.5B model on the GPU fares.

    python benchmarks/opt_state_loss_cpu.py --steps 400 --seeds 0 1 2 --variants bf16/bf16 bf16/e4m3 e4m3/e4m3

A variant is M/V: the first and second moment's dtypes (fp32, bf16, e4m3; e4m3 v is
backends/fp8_second_moment.py). The weights are fp32 (no master), so only the moments differ.

Seen on the 2-core CPU machine (2026-11-28, the command above with --variants bf16/bf16 bf16/e4m3 e4m3/bf16
e4m3/e4m3 --steps 500; 3 seeds, ~70 s a run), final eval loss by seed 0 / 1 / 2, and mean:

    bf16/bf16   1.7356 / 1.8085 / 1.9214   mean 1.8218 (sd 0.094)
    bf16/e4m3   1.7455 / 1.8135 / 2.0418   mean 1.8669 (sd 0.155)   vs bf16/bf16: +0.6% / +0.3% / +6.3%
    e4m3/bf16   1.8121 / 2.0524 / 1.8857   mean 1.9167 (sd 0.123)   +4.4% / +13.5% / -1.9%
    e4m3/e4m3   1.8429 / 2.1986 / 1.9877   mean 2.0097 (sd 0.179)   +6.2% / +21.6% / +3.5%

At this scale and learning rate every 8-bit moment costs loss on average, mostly by staying longer on the
early plateau (the evals at step 100 differ most); both in 8 bits is the worst. Three seeds with this spread
are a screen, not a verdict; the 0.5B GPU check of e4m3 m (+0.8% pooled over 8 seeds) was milder.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from llmq_ray.backends import fp8_moment, fp8_second_moment  # noqa: E402
from llmq_ray.backends import torch_ref_optim as ref  # noqa: E402
from llmq_ray.data_pipeline.text_inputs import tiny_shakespeare_path  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}


def make_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


class State:
    """One parameter's moments in the chosen dtypes (e4m3 ones with their block scales)."""

    def __init__(self, n: int, m_dtype: torch.dtype, v_dtype: torch.dtype):
        self.m = torch.zeros(n, dtype=m_dtype)
        self.v = torch.zeros(n, dtype=v_dtype)
        blocks = fp8_moment.num_blocks(n)
        self.m_scale = torch.ones(blocks) if m_dtype == torch.float8_e4m3fn else None
        self.v_scale = torch.ones(blocks) if v_dtype == torch.float8_e4m3fn else None


def run(variant: str, seed: int, steps: int, data: torch.Tensor, eval_data: torch.Tensor, lr: float,
        batch: int, seq: int) -> list[float]:
    m_name, v_name = variant.split("/")
    model = make_model(seed)
    params = [p for p in model.parameters()]
    states = [State(p.numel(), DTYPES[m_name], DTYPES[v_name]) for p in params]
    gen = torch.Generator().manual_seed(1000 + seed)
    evals = []
    for step in range(1, steps + 1):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq] for s in starts.tolist()])
        out = model(input_ids=x, labels=x)
        model.zero_grad(set_to_none=True)
        out.loss.backward()
        warm = min(1.0, step / 50)
        cos = 0.5 * (1 + math.cos(math.pi * step / steps))
        for i, (p, s) in enumerate(zip(params, states)):
            flat = p.data.view(-1)
            ref.adamw_update(flat, p.grad.view(-1), s.m, s.v, master=None, lr=lr * warm * (0.1 + 0.9 * cos),
                             beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0 if p.dim() < 2 else 0.1,
                             step=step, grad_scale=1.0, seed=seed * 1_000_003 + step * 1009 + i,
                             m_scale=s.m_scale, v_scale=s.v_scale)
        if step % 100 == 0 or step == steps:
            with torch.no_grad():
                n = (eval_data.numel() - 1) // seq
                xs = eval_data[:n * seq].view(n, seq)
                evals.append(float(model(input_ids=xs, labels=xs).loss))
    return evals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=["bf16/bf16", "bf16/e4m3", "e4m3/e4m3"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args()
    for variant in a.variants:
        m, _, v = variant.partition("/")
        if m not in DTYPES or v not in DTYPES:
            ap.error(f"--variants: {variant!r} is not M/V with M and V among {sorted(DTYPES)}")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    raw = open(tiny_shakespeare_path(), "rb").read()
    data = torch.tensor(list(raw), dtype=torch.long)
    eval_data, data = data[:32768], data[32768:]
    print(f"{len(raw):,} bytes; {a.steps} steps of {a.batch} x {a.seq}; lr {a.lr}; seeds {a.seeds}")
    for variant in a.variants:
        finals = []
        for seed in a.seeds:
            evals = run(variant, seed, a.steps, data, eval_data, a.lr, a.batch, a.seq)
            finals.append(evals[-1])
            print(f"  {variant} seed {seed}: eval every 100 steps {[round(e, 4) for e in evals]}", flush=True)
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        print(f"{variant}: final eval mean {statistics.mean(finals):.4f} sd {sd:.4f} "
              f"range {min(finals):.4f}-{max(finals):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
