"""The PyTorch baseline a user would otherwise pick: HF transformers model + torch.compile + bf16 autocast +
fused AdamW, from scratch on random tokens. Prints tokens/s and peak memory in the same format as
benchmarks/engine_step.py, so both land in one table from one run.

    python benchmarks/hf_baseline.py --model Qwen2.5-0.5B --batch-size 16 --seq-len 1024
"""

import argparse
import time

import torch
import transformers

from llmq_ray.config import PRESETS


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    cfg = PRESETS[args.model]
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_fn = model if args.no_compile else torch.compile(model)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    times = []
    for step in range(args.steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_fn(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {step}: loss {loss.item():.4f} {times[-1] * 1e3:.1f} ms", flush=True)
    step_time = sorted(times[3:])[len(times[3:]) // 2]
    ntok = args.batch_size * args.seq_len
    flops = cfg.flops_per_token(args.seq_len) * ntok / step_time
    print(f"RESULT model={args.model} backend=hf-compile-autocast B={args.batch_size} T={args.seq_len} dtype=bf16 "
          f"median_step_ms={step_time * 1e3:.1f} tokens_per_s={ntok / step_time:.0f} TFLOPs={flops / 1e12:.1f} "
          f"MFU_vs_989={flops / 989e12 * 100:.1f}% peak_mem_GiB={torch.cuda.max_memory_allocated() / 2**30:.1f}")


if __name__ == "__main__":
    main()
