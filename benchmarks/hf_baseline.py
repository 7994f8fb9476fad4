"""The PyTorch baseline a user would otherwise pick: HF transformers model + torch.compile + bf16 autocast +
fused AdamW, from scratch on random tokens. Prints tokens/s and peak memory in the same format as
benchmarks/engine_step.py, and with ``--json FILE`` one record in bench_train.py's shape, so that
benchmarks/speed_table.py puts both in one table from one run.

    python benchmarks/hf_baseline.py --model Qwen2.5-0.5B --batch-size 16 --seq-len 1024

By default the forward and the cross-entropy are compiled together, as one function: a careful user
compiles the loss with the model, which lets inductor fuse the fp32 upcast of the [B*T, V] logits into the loss
instead of writing them out. ``--no-compile-loss`` compiles the model alone, the loss eager (the form measured
before 2026-11-24).
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import transformers

from llmq_ray.model.config import PRESETS


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-compile", action="store_true", help="eager PyTorch (no torch.compile)")
    ap.add_argument("--no-compile-loss", dest="compile_loss", action="store_false",
                    help="compile the model alone and compute the loss eagerly")
    ap.add_argument("--json", default=None, help="also write the result to this JSON file")
    args = ap.parse_args()
    cfg = PRESETS[args.model]
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    compiled = "nothing" if args.no_compile else "model and loss" if args.compile_loss else "model"
    run_model = torch.compile(model) if compiled == "model" else model

    def forward_loss(inputs, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = run_model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))

    step_fn = torch.compile(forward_loss) if compiled == "model and loss" else forward_loss
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    times = []
    for step in range(args.steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step_fn(inputs, labels)
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
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    print(f"RESULT model={args.model} backend=hf-compile-autocast B={args.batch_size} T={args.seq_len} dtype=bf16 "
          f"median_step_ms={step_time * 1e3:.1f} tokens_per_s={ntok / step_time:.0f} TFLOPs={flops / 1e12:.1f} "
          f"MFU_vs_989={flops / 989e12 * 100:.1f}% peak_mem_GiB={peak_gib:.1f}")
    if args.json:
        record = {"command": " ".join(["hf_baseline.py"] + sys.argv[1:]),
                  "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "gpu": torch.cuda.get_device_name(), "world_size": 1, "args": vars(args),
                  "tokens_per_s": ntok / step_time, "tokens_per_s_per_gpu": ntok / step_time,
                  "step_ms": step_time * 1e3, "peak_memory_gib": peak_gib}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    # Leave without the interpreter's exit handlers: inductor's handler that shuts its compile-worker pool down
    # waited 300 s for a worker that never exited after a complete run (H200 machine, 2026-11-29), which made the
    # speed table time the finished row out. Everything this script writes is closed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
