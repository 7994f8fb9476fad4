"""ZeRO-1 on two GPUs over NCCL: the overlapped gradient reduce and weight gather, eager and in CUDA graphs.

Two spawned processes, one GPU each, train a 4-layer model with Qwen2.5-0.5B widths for 3 steps of 2 micro-steps,
once with everything in the plain order (one reduce-scatter at the update, one all-gather after it, eager) and
then with each layer's gradients reduced during the last backward (llmq_ray/engine/grad_reduce.py) and each unit's
weights broadcast after its update (llmq_ray/engine/update_overlap.py), eager and replayed from CUDA graphs (the
reduces captured inside the last micro-step's graph, the first micro-step's graph waiting per unit). With two
ranks every sum is one addition of two values, the same whichever collective does it, and the attention backward
is the deterministic one, so all runs must agree bit for bit: losses, grad norms and weights.
Needs two GPUs (``pytest -m gpu`` on nvidia-h100-x2 / nvidia-h200-x2); skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import pytest
import torch

from _helpers import exit_after

from llmq_ray.engine.train_engine import TrainEngine, make_backend
from llmq_ray.model.config import PRESETS
from llmq_ray.options import TrainOptions

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

RUNS = {"plain": dict(),
        "overlapped": dict(overlap_comm=True),
        "overlapped-graphs": dict(overlap_comm=True, use_cuda_graphs=True)}


def _train_rank(rank: int, port: int, matmul_dtype, out_dir: str) -> None:
    from llmq_ray.actors.collectives import init_group

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    comm = init_group(f"tcp://127.0.0.1:{port}", rank, 2, device, timeout_s=120)
    cfg = dataclasses.replace(PRESETS["Qwen2.5-0.5B"], num_layers=4, name="qwen0.5b-4layers")
    out = {}
    for name, flags in RUNS.items():
        opts = TrainOptions(model="Qwen2.5-0.5B", batch_size=2, seq_len=256, grad_accumulation=2,
                            model_dtype="bf16", matmul_dtype=matmul_dtype, opt_m_dtype="bf16",
                            opt_v_dtype="bf16", deterministic_attention=True, **flags)
        e = TrainEngine(cfg, opts, make_backend("triton", opts, device), comm)
        assert (e.grad_reduce is None) == (name == "plain")
        gen = torch.Generator().manual_seed(1)
        stats = []
        for step in range(3):
            for micro in range(2):
                batch = torch.randint(0, cfg.vocab_size, (4, 257), generator=gen)[2 * rank:2 * rank + 2]
                e.micro_step(batch[:, :-1].to(device), batch[:, 1:].to(device), last=micro == 1)
            s = e.update(1e-3, step + 1)
            stats.append((s.loss, s.grad_norm))
            print(f"rank {rank} {matmul_dtype} {name} step {step}: {stats[-1]}", flush=True)
        out[name] = (stats, e.full_params().cpu().clone())
    if rank == 0:
        torch.save(out, f"{out_dir}/rank0.pt")


@pytest.mark.parametrize("matmul_dtype", [None, "e4m3"])
def test_two_gpu_zero1_overlaps_equal_the_plain_order(tmp_path, matmul_dtype):
    from llmq_ray.actors.collectives import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=exit_after, args=(_train_rank, r, port, matmul_dtype, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    out = torch.load(tmp_path / "rank0.pt")
    plain_stats, plain_w = out["plain"]
    assert len({loss for loss, _ in plain_stats}) == 3
    for name in ("overlapped", "overlapped-graphs"):
        stats, w = out[name]
        print(f"{matmul_dtype} {name}: {stats} vs plain {plain_stats}; max |dw| "
              f"{(w.float() - plain_w.float()).abs().max().item()}")
        assert stats == plain_stats, name
        assert torch.equal(w, plain_w), name
