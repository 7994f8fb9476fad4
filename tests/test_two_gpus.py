"""ZeRO-1 on two GPUs over NCCL: the overlapped gradient reduce and weight gather, eager and in CUDA graphs; ZeRO-3
with kept FP8 weight copies.

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

from _helpers import exit_after, fp8_layer_copy_gib, spawn_gloo_ranks, train_settings

from llmq_ray.engine.train_engine import TrainEngine, make_backend
from llmq_ray.model.config import PRESETS
from _helpers import checked_settings, train_settings

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
        opts = train_settings(model="Qwen2.5-0.5B", batch_size=2, seq_len=256, grad_accumulation=2,
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


def _kept_rank(rank: int, port: int, out_dir: str) -> None:
    """ZeRO-3 e4m3 on GPU ``rank`` over NCCL (Triton, deterministic attention, 4 layers of 0.5B widths): 2 steps
    of 2 micro-steps without kept FP8 copies, then with a --kept-quants-gib that differs between the ranks (room
    for layer 0 on rank 0, for every layer on rank 1). Saves losses, weights, kept layers and the gathers."""
    from llmq_ray.actors.collectives import init_group

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    comm = init_group(f"tcp://127.0.0.1:{port}", rank, 2, device, timeout_s=120)
    cfg = dataclasses.replace(PRESETS["Qwen2.5-0.5B"], num_layers=4, name="qwen0.5b-4layers")
    out = {}
    for kept in (False, True):
        opts = train_settings(model="Qwen2.5-0.5B", batch_size=2, seq_len=256, grad_accumulation=2, zero_level=3,
                            model_dtype="bf16", matmul_dtype="e4m3", opt_m_dtype="bf16", opt_v_dtype="bf16",
                            deterministic_attention=True, grad_clip=0.0)
        if kept:
            gib = fp8_layer_copy_gib(e, 1 if rank == 0 else cfg.num_layers)  # e: the run without
            opts = train_settings(opts, kept_quants_gib=gib)
        e = TrainEngine(cfg, opts, make_backend("triton", opts, device), comm)
        gathered = []
        real_gather = e.store._gather
        e.store._gather = lambda lo, hi, buf: (gathered.append((lo, hi)), real_gather(lo, hi, buf))[1]
        gen = torch.Generator().manual_seed(1)
        losses = []
        for step in range(2):
            for micro in range(2):
                batch = torch.randint(0, cfg.vocab_size, (4, 257), generator=gen)[2 * rank:2 * rank + 2]
                e.micro_step(batch[:, :-1].to(device), batch[:, 1:].to(device), last=micro == 1)
            losses.append(e.update(1e-3, step + 1).loss)
        kept_layers = sorted({e.model.lin.layer_of[key][0] for key, _ in e.model.lin.kept})
        out[kept] = (losses, e.full_params().cpu().clone(), kept_layers, len(gathered))
    torch.save(out, f"{out_dir}/rank{rank}.pt")


def test_two_gpu_zero3_kept_copies_skip_the_same_gathers_on_both_ranks(tmp_path):
    """The NCCL counterpart of tests/test_zero3.py's gloo test: both ranks keep layer 0's copies (the least
    budget), skip its gather in each step's second forward, and train bit for bit as without kept copies."""
    spawn_gloo_ranks(lambda r, port: (_kept_rank, r, port, str(tmp_path)), exit_after, 2, timeout_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert r[True][2] == [0] and r[False][2] == []
        assert r[True][0] == r[False][0]
        assert torch.equal(r[True][1], r[False][1])
        assert r[True][3] == r[False][3] - 2
