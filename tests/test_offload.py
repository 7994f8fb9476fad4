"""Host offloading (llmq_ray/engine/offload.py) and --attn-bwd-chunks: every flag changes where state lives or how a
kernel is split, never the numbers.

Each flag is compared against the same run without it, single process, bf16 weights with an fp32 master and
bf16 Adam moments (so the stochastic-rounding seeds must line up chunk for chunk), ZeRO-2 (so the gradient
accumulator exists), 3 steps x 2 micro-steps, and a small --opt-chunk-size so the optimizer's shard streams
through the staging slots in many chunks: per-step losses, final weights and the whole optimizer state
must be bit-identical (``torch.equal``). On a CPU device "host" memory is ordinary memory and copies are
synchronous, but the code path (slots, chunk boundaries, write-backs, residual prefetch) is the one CUDA runs.
"""

from __future__ import annotations

import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.model.config import PRESETS
from llmq_ray.engine.train_engine import TrainEngine
from llmq_ray.errors import ConfigError
from llmq_ray.engine.offload import StagedChunks, fixed_chunks
from _helpers import checked_settings, train_settings

BASE = dict(model="tiny", batch_size=2, seq_len=16, grad_accumulation=2, model_dtype="bf16", master_dtype="fp32",
            opt_m_dtype="bf16", opt_v_dtype="bf16", opt_chunk_size=5000, zero_level=2, learning_rate=1e-3)
STEPS = 3
# --opt-resident-gib that keeps 3 of the shard's chunks of fp32 master + bf16 m + bf16 v (8 bytes/element) on device
KEEP_3_CHUNKS = 3.5 * BASE["opt_chunk_size"] * 8 / 2**30


def _train(backend: str = "torch", device: str = "cpu", **flags):
    opts = train_settings(**{**BASE, **flags})
    engine = TrainEngine(PRESETS["tiny"], opts, get_backend(backend, device))
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(STEPS):
        for _ in range(opts.data.grad_accumulation):
            x = torch.randint(0, PRESETS["tiny"].vocab_size, (opts.data.batch_size, opts.data.seq_len + 1), generator=gen)
            engine.micro_step(x[:, :-1], x[:, 1:])
        losses.append(engine.update(1e-3, step + 1).loss)
    return losses, engine


@pytest.fixture(scope="module")
def reference():
    return _train()


FLAGS = [dict(offload_master=True), dict(offload_opt_m=True), dict(offload_opt_v=True),
         dict(offload_gradients=True), dict(offload_residual=True), dict(attn_bwd_chunks=2),
         dict(offload_master=True, offload_opt_m=True, offload_opt_v=True, offload_gradients=True, use_zero_copy=True),
         dict(offload_master=True, offload_opt_m=True, offload_opt_v=True, offload_gradients=True,
              offload_residual=True, zero_level=3),
         dict(offload_master=True, offload_opt_m=True, offload_opt_v=True, opt_resident_gib=KEEP_3_CHUNKS)]


@pytest.mark.parametrize("flags", FLAGS, ids=["-".join(f) for f in FLAGS])
def test_offload_flag_is_bit_identical(reference, flags):
    ref_losses, ref = reference
    losses, e = _train(**flags)
    assert losses == ref_losses
    assert ref_losses[-1] != ref_losses[0]  # the weights moved
    assert torch.equal(e.full_params(), ref.full_params())
    for name, t in e.optimizer.state_tensors().items():
        assert torch.equal(t, ref.optimizer.state_tensors()[name]), name
    opt = e.optimizer
    assert len(opt.chunks) > 4  # the shard really went through many chunks
    expected_host = {k for k, f in (("master", "offload_master"), ("m", "offload_opt_m"), ("v", "offload_opt_v"))
                     if flags.get(f)}
    assert opt.offloaded == expected_host
    assert len(opt.resident_at) == (3 if flags.get("opt_resident_gib") else 0)
    if flags.get("use_zero_copy"):
        assert opt.staging is None  # the kernel works on the host tensors themselves
    else:
        assert (opt.staging is not None) == bool(expected_host or flags.get("offload_gradients"))
    if flags.get("offload_residual"):
        res, ref_res = e.model.acts.residual, ref.model.acts.residual
        assert len(res.host) == PRESETS["tiny"].num_layers
        for layer in range(PRESETS["tiny"].num_layers):  # the host copies hold the last micro-step's x_l
            assert torch.equal(res.host[layer], ref_res[layer]), layer


# --kept-quants-gib for 1.5 of tiny's 2 layers of FP8 copies (a layer: 43,008 elements per layout, both layouts
# one byte each): layer 0 whole, of layer 1 all but up+gate and down's transposed copy (BlockLinears.kept_copies_plan)
KEEP_1_5_LAYERS = 1.5 * 2 * 43008 / 2**30
QUANT_FLAGS = [dict(persistent_quants=True, offload_quants=True),
               dict(transient_quants=True), dict(transient_quants=True, recompute_block=True),
               dict(transient_quants=True, kept_quants_gib=KEEP_1_5_LAYERS),
               dict(zero_level=3), dict(zero_level=3, kept_quants_gib=KEEP_1_5_LAYERS),
               dict(zero_level=3, persistent_quants=True, offload_quants=True, offload_residual=True,
                    offload_gradients=True, offload_master=True)]


@pytest.fixture(scope="module")
def e4m3_reference():
    return _train(matmul_dtype="e4m3")


@pytest.mark.parametrize("flags", QUANT_FLAGS, ids=["-".join(f) for f in QUANT_FLAGS])
def test_fp8_weight_copies_placement_is_bit_identical(e4m3_reference, flags):
    """--matmul-dtype e4m3: FP8 weight copies kept on the device for the step (the reference), in host memory
    fetched one layer ahead, or made per layer (ZeRO-3, --transient-quants): the same bytes reach every GEMM."""
    ref_losses, ref = e4m3_reference
    losses, e = _train(matmul_dtype="e4m3", **flags)
    assert losses == ref_losses and ref_losses[-1] != ref_losses[0]
    assert torch.equal(e.full_params(), ref.full_params())
    for name, t in e.optimizer.state_tensors().items():
        assert torch.equal(t, ref.optimizer.state_tensors()[name]), name
    lin, ref_lin = e.model.lin, ref.model.lin
    if flags.get("transient_quants"):  # two device slots, no per-layer copies
        assert lin.quants == "layer" and not lin.w_q and len(lin.slots) == 2
    if flags.get("kept_quants_gib"):  # the kept copies hold what the persistent ones hold, made in the last step
        assert sorted(lin.kept) == sorted([(f"layers.0.{n}", t) for n in lin.names for t in (False, True)]
                                          + [("layers.1.qkv_w", False), ("layers.1.qkv_w", True),
                                             ("layers.1.out_w", False), ("layers.1.out_w", True),
                                             ("layers.1.down_w", False)])
        for (key, transposed), copy in lin.kept.items():
            want = ref_lin.wt_q[key] if transposed else ref_lin.w_q[key]
            assert torch.equal(copy.view(torch.uint8), want.view(torch.uint8)), (key, transposed)
    if flags.get("offload_quants"):  # the host copies are the real ones (made in the last step, like ref's)
        assert lin.quants == "host" and len(lin.host_tensors()) == 2 * len(ref_lin.w_q)
        for key in ref_lin.w_q:
            assert torch.equal(lin.w_q[key].view(torch.uint8), ref_lin.w_q[key].view(torch.uint8)), key
            assert torch.equal(lin.wt_q[key].view(torch.uint8), ref_lin.wt_q[key].view(torch.uint8)), key


def test_staged_chunks_round_trip():
    """StagedChunks: load -> compute -> store over uneven chunks, read-modify-write and write-only names."""
    host = torch.arange(23, dtype=torch.float32)
    out = torch.full((23,), -1.0)
    ranges = fixed_chunks(0, 23, 5)
    assert ranges == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert fixed_chunks(7, 12, 5) == [(7, 10), (10, 12)]
    staging = StagedChunks(torch.device("cpu"), {"x": torch.float32, "y": torch.float32}, 5)
    seen = []

    def compute(i, staged):
        seen.append((i, staged["x"].clone()))
        staged["y"].copy_(staged["x"] * 2)
        staged["x"].add_(100)

    staging.run(ranges, {"x": host}, {"x": host, "y": out}, compute)
    assert torch.equal(out, torch.arange(23, dtype=torch.float32) * 2)
    assert torch.equal(host, torch.arange(23, dtype=torch.float32) + 100)
    assert [i for i, _ in seen] == list(range(5)) and torch.equal(seen[4][1], torch.tensor([20.0, 21.0, 22.0]))


def test_resident_part_of_offloaded_state_follows_the_update_order_and_checkpoints():
    """--opt-resident-gib under ZeRO-1 (update overlapped, in forward order): the kept chunks are the first of
    the overlap's order, training is bit-identical to the fully streamed run, the host tensors handed to a
    checkpoint hold the kept chunks' current values, loading a state refreshes them, and the memory table
    counts them on the device."""
    from llmq_ray.observe.memory_table import memory_dict, memory_table

    flags = dict(zero_level=1, offload_opt_m=True, offload_opt_v=True, master_dtype="bf16")
    per_chunk = BASE["opt_chunk_size"] * 4  # bf16 m + bf16 v
    ref_losses, ref = _train(**flags)
    losses, e = _train(**flags, opt_resident_gib=5.5 * per_chunk / 2**30)
    opt = e.optimizer
    assert e.overlap is not None and list(opt.resident_at) == e.overlap.order[:5]
    assert losses == ref_losses
    assert torch.equal(e.full_params(), ref.full_params())
    state = {k: t.clone() for k, t in opt.state_tensors().items()}
    for name, t in state.items():
        assert torch.equal(t, ref.optimizer.state_tensors()[name]), name
    kept_m = opt.resident["m"]
    assert kept_m.abs().sum() > 0
    opt.load_state_tensors({k: torch.zeros_like(t) for k, t in state.items()})
    assert kept_m.abs().sum() == 0  # the device part follows a loaded state
    opt.load_state_tensors(state)
    j = e.overlap.order[0]
    lo, hi = opt.chunks[j][0] - opt.start, opt.chunks[j][1] - opt.start
    assert torch.equal(opt._resident_views(j)["m"], state["m"][lo:hi])
    rows, ref_rows = memory_dict(memory_table(e)), memory_dict(memory_table(ref))
    padded = -(-BASE["opt_chunk_size"] // opt.ALIGN) * opt.ALIGN  # each kept chunk starts aligned
    assert rows["adam_m"] == rows["adam_v"] == kept_m.numel() * 2 == 5 * padded * 2
    assert ref_rows["adam_m"] == 0 and rows["host_adam_m"] == ref_rows["host_adam_m"]


def test_resident_auto_takes_what_set_up_left_free(monkeypatch):
    """--opt-resident-gib auto: the budget is the device's free bytes after set-up less the margin (here a
    stand-in for the CUDA query: 3.5 chunks more than the margin -> 3 chunks kept); off CUDA nothing is kept."""
    import llmq_ray.engine.train_engine as engine_module

    flags = dict(offload_master=True, offload_opt_m=True, offload_opt_v=True, opt_resident_gib="auto")
    _, e = _train(**flags)
    assert e.optimizer.resident_at == {}  # CPU: host and device memory are one
    free = engine_module.AUTO_RESIDENT_MARGIN + int(3.5 * BASE["opt_chunk_size"] * 8)
    monkeypatch.setattr(engine_module, "available_device_bytes", lambda device: free)
    ref_losses, ref = _train()
    losses, e = _train(**flags)
    assert len(e.optimizer.resident_at) == 3
    assert losses == ref_losses and torch.equal(e.full_params(), ref.full_params())


def test_memory_table_moves_offloaded_state_to_host_rows():
    from llmq_ray.observe.memory_table import HOST_ROWS, format_memory_table, memory_dict, memory_table, tensor_bytes

    opts = dict(batch_size=2, seq_len=16, model_dtype="bf16", master_dtype="fp32", zero_level=2, opt_chunk_size=4096)
    base = TrainEngine(PRESETS["tiny"], train_settings(**opts), get_backend("torch"))
    off = TrainEngine(PRESETS["tiny"], train_settings(**opts, offload_master=True, offload_opt_m=True,
                                                    offload_opt_v=True, offload_gradients=True,
                                                    offload_residual=True), get_backend("torch"))
    a, b = memory_dict(memory_table(base)), memory_dict(memory_table(off))
    assert not set(HOST_ROWS) & set(a)
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    o = off.optimizer
    assert (b["host_master"], b["host_adam_m"], b["host_adam_v"]) == (nb(o.master), nb(o.m), nb(o.v))
    assert b["master"] == b["adam_m"] == b["adam_v"] == 0 < a["master"]
    assert b["host_grads"] == nb(off.grad_shard) and b["grads"] == a["grads"] - nb(base.grad_shard)
    n, c, L = 32, PRESETS["tiny"].hidden_size, PRESETS["tiny"].num_layers
    assert b["host_activations"] == L * n * c * 2
    assert b["activations"] == a["activations"] - (L - 2) * n * c * 2  # L+1 residuals -> 2 slots + the final one
    staging = o.staging.nbytes() + off._grad_staging.nbytes()
    assert b["other"] == a["other"] + staging
    assert tensor_bytes(memory_table(off)) < tensor_bytes(memory_table(base))
    text = format_memory_table(memory_table(off))
    assert "host: master weights" in text and "host: sum (pinned)" in text


def test_memory_table_moves_fp8_weight_copies():
    """ZeRO-3, e4m3: per-layer copies hold two layers on the device; --persistent-quants all L layers;
    --offload-quants moves those L layers to a host row and keeps two device slots."""
    from llmq_ray.observe.memory_table import memory_dict, memory_table

    opts = dict(BASE, matmul_dtype="e4m3", zero_level=3)
    rows = {}
    for name, flags in (("layer", {}), ("persistent", dict(persistent_quants=True)),
                        ("host", dict(persistent_quants=True, offload_quants=True))):
        e = TrainEngine(PRESETS["tiny"], train_settings(**opts, **flags), get_backend("torch"))
        assert e.model.lin.quants == name
        rows[name] = memory_dict(memory_table(e))
    L = PRESETS["tiny"].num_layers
    s = TrainEngine(PRESETS["tiny"], train_settings(**opts), get_backend("torch")).store
    layer_bytes = 2 * s.layer_bufs[0].numel()  # W_q and W^T_q: one byte per block-weight element each
    assert rows["persistent"]["fp8"] - rows["layer"]["fp8"] == (L - 2) * layer_bytes
    assert rows["host"]["fp8"] == rows["layer"]["fp8"]
    assert rows["host"]["host_fp8"] == L * layer_bytes and "host_fp8" not in rows["persistent"]
    # --transient-quants below ZeRO-3: the same two slots instead of the default all-layer copies
    z1 = dict(opts, zero_level=1)
    default = memory_dict(memory_table(TrainEngine(PRESETS["tiny"], train_settings(**z1), get_backend("torch"))))
    transient = memory_dict(memory_table(TrainEngine(PRESETS["tiny"], train_settings(**z1, transient_quants=True),
                                                     get_backend("torch"))))
    assert default["fp8"] - transient["fp8"] == (L - 2) * layer_bytes
    kept = memory_dict(memory_table(TrainEngine(PRESETS["tiny"], train_settings(
        **z1, transient_quants=True, kept_quants_gib=KEEP_1_5_LAYERS), get_backend("torch"))))
    assert kept["fp8"] - transient["fp8"] == 2 * 43008 + 8192 * 2 + 4096 * 2 + 10240  # kept_copies_plan's choice


BAD = [(dict(use_zero_copy=True), "--use-zero-copy only applies with --offload-master"),
       (dict(offload_gradients=True), "--offload-gradients needs --zero-level 2 or 3"),
       (dict(offload_master=True), "--offload-master needs a separate master copy"),
       (dict(attn_bwd_chunks=3, batch_size=4), "--attn-bwd-chunks=3 must divide --batch-size=4"),
       (dict(opt_chunk_size=0), "--opt-chunk-size=0"),
       (dict(persistent_quants=True, model_dtype="bf16"),
        "--fp8-weight-copies persistent only applies with --matmul-dtype e4m3"),
       (dict(use_cuda_graphs=True, persistent_quants=True, offload_quants=True, model_dtype="bf16",
             matmul_dtype="e4m3"),
        "--use-cuda-graphs cannot capture --zero-level 2/3, --offload-residual or --fp8-weight-copies host"),
       (dict(use_cuda_graphs=True, zero_level=2), "--use-cuda-graphs cannot capture --zero-level 2,"),
       (dict(transient_quants=True, model_dtype="bf16"), "--fp8-weight-copies layer only applies with --matmul-dtype e4m3"),
       (dict(use_cuda_graphs=True, transient_quants=True, model_dtype="bf16", matmul_dtype="e4m3"),
        "--use-cuda-graphs cannot capture --fp8-weight-copies layer"),
       (dict(kept_quants_gib=1.0), "--kept-quants-gib only applies to per-layer FP8 weight copies"),
       (dict(kept_quants_gib=1.0, model_dtype="bf16", matmul_dtype="e4m3", zero_level=1),
        "--kept-quants-gib only applies to per-layer FP8 weight copies"),
       (dict(kept_quants_gib="auto", model_dtype="bf16", matmul_dtype="e4m3", zero_level=3, persistent_quants=True),
        "--kept-quants-gib only applies to per-layer FP8 weight copies"),
       (dict(kept_quants_gib=-2.0, model_dtype="bf16", matmul_dtype="e4m3", transient_quants=True),
        "--kept-quants-gib=-2.0 must be a number >= 0 or 'auto'"),
       (dict(kept_quants_gib="auto", opt_resident_gib="auto", model_dtype="bf16", matmul_dtype="e4m3",
             transient_quants=True, offload_opt_m=True),
        "--kept-quants-gib auto and --opt-resident-gib auto both ask for the memory set-up leaves free"),
       (dict(opt_resident_gib=1.0), "--opt-resident-gib only applies with --offload-master"),
       (dict(opt_resident_gib=-1.0, offload_opt_m=True), "--opt-resident-gib=-1.0 must be a number >= 0"),
       (dict(opt_resident_gib=float("inf"), offload_opt_m=True), "--opt-resident-gib=inf must be a number >= 0"),
       (dict(opt_resident_gib="most", offload_opt_m=True), "--opt-resident-gib='most' must be a number >= 0 or 'auto'"),
       (dict(opt_resident_gib="auto"), "--opt-resident-gib only applies with --offload-master"),
       (dict(opt_resident_gib=1.0, offload_opt_m=True, offload_gradients=True, zero_level=2),
        "--opt-resident-gib cannot be combined with --offload-gradients")]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_nonsense_offload_flags(kwargs, message):
    with pytest.raises(ConfigError) as info:
        checked_settings(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_offload_on_cuda_is_bit_identical(backend):
    """On a GPU: pinned host state and side-stream copies give the same bits as the resident run; zero-copy
    is refused on CUDA (one sentence)."""
    ref_losses2, ref2 = _train(backend, "cuda")
    everything = dict(offload_master=True, offload_opt_m=True, offload_opt_v=True, offload_gradients=True,
                      offload_residual=True)
    runs = [everything, dict(everything, zero_level=3),
            dict(offload_master=True, offload_opt_m=True, offload_opt_v=True, opt_resident_gib=KEEP_3_CHUNKS),
            # ZeRO-1: the update runs on a side stream (update_overlap.py), kept chunks first
            dict(offload_master=True, offload_opt_m=True, offload_opt_v=True, opt_resident_gib=KEEP_3_CHUNKS,
                 zero_level=1)]
    with pytest.raises(ConfigError, match="zero-copy access to offloaded state is not supported on CUDA yet"):
        _train(backend, "cuda", **dict(everything, use_zero_copy=True))
    zero1_ref = _train(backend, "cuda", zero_level=1)  # ZeRO-1 accumulates in the GEMMs: its own reference
    for flags in runs:
        ref_losses, ref = zero1_ref if flags.get("zero_level") == 1 else (ref_losses2, ref2)
        losses, e = _train(backend, "cuda", **flags)
        on_host = e.grad_shard is not None and e.grad_shard.is_pinned()
        assert e.optimizer.m.is_pinned() and on_host == bool(flags.get("offload_gradients")), flags
        assert all(t.is_cuda for t in e.optimizer.resident.values()) and len(e.optimizer.resident_at) == (
            3 if flags.get("opt_resident_gib") else 0), flags
        assert losses == ref_losses, flags
        # the state first, while a side-stream update may still run: state_tensors itself must wait for it
        for name, t in e.optimizer.state_tensors().items():
            assert torch.equal(t.cpu(), ref.optimizer.state_tensors()[name].cpu()), (flags, name)
        assert torch.equal(e.full_params().cpu(), ref.full_params().cpu()), flags
        if flags.get("zero_level") == 1:
            assert e.overlap is not None and list(e.optimizer.resident_at) == e.overlap.order[:3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_weight_copies_on_cuda_are_bit_identical(backend):
    """On a GPU: pinned float8 host copies fetched on the side stream (--offload-quants), and ZeRO-3's
    per-layer / once-per-step copies, give the same bits as the resident e4m3 run."""
    ref_losses, ref = _train(backend, "cuda", matmul_dtype="e4m3")
    for flags in QUANT_FLAGS + [dict(zero_level=3, persistent_quants=True)]:
        losses, e = _train(backend, "cuda", matmul_dtype="e4m3", **flags)
        if flags.get("offload_quants"):
            assert all(t.is_pinned() for t in e.model.lin.host_tensors()), flags
        assert losses == ref_losses, flags
        assert torch.equal(e.full_params().cpu(), ref.full_params().cpu()), flags


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kept_copies_that_do_not_fit_are_refused_in_one_sentence(monkeypatch):
    """--kept-quants-gib G on a GPU: copies larger than what set-up left free end in a ConfigError naming the flag,
    the GiB asked for and the GiB free (here 1,000 bytes free, a stand-in for the CUDA query), not in an
    out-of-memory error from inside the allocation; 'auto' never asks for more than is free."""
    import llmq_ray.engine.train_engine as engine_module

    monkeypatch.setattr(engine_module, "available_device_bytes", lambda device: 1000)
    flags = dict(matmul_dtype="e4m3", zero_level=1, transient_quants=True)
    with pytest.raises(ConfigError, match=r"^1\.0 GiB of kept FP8 weight copies \(0\.00 GiB as planned\) do not fit "
                                          r"in the 0\.00 GiB of device memory set-up left free; keep fewer, or let "
                                          r"the run choose \('auto'\)\.$"):
        _train("torch", "cuda", kept_quants_gib=1.0, **flags)
    _, e = _train("torch", "cuda", kept_quants_gib="auto", **flags)
    assert e.model.lin.kept == {}  # less than the margin free: nothing kept


@pytest.mark.parametrize("kept_layers", [0, 1])
def test_transient_copies_quantize_each_layout_once_per_pass_and_absmax_once_per_step(kept_layers):
    """--transient-quants: the forward GEMM makes only W_q, the dgrad only W^T_q (no both-layout pass over
    the weights), and each weight's absmax is taken once per optimizer step, not at every pass. Four layers,
    so that the two slots are refilled in every pass (with two, each layer would keep its slot all step).
    With --kept-quants-gib for one layer, that layer's copies are made once per step instead."""
    import dataclasses

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=4)
    opts = train_settings(**{**BASE, "zero_level": 1, "matmul_dtype": "e4m3", "transient_quants": True,
                           "kept_quants_gib": kept_layers * 2 * 43008 / 2**30})
    engine = TrainEngine(cfg, opts, get_backend("torch"))
    be, lin = engine.backend, engine.model.lin
    weights = {lin.w[key].data_ptr(): key for key in lin.layer_of}
    calls = {"absmax": [], "quantize": [], "quantize_transpose": [], "quantize_with_transpose": []}
    for name, log in calls.items():
        original = getattr(be, name)

        def wrapped(*args, _original=original, _log=log, **kwargs):
            inp = args[-2] if len(args) >= 2 else None
            if _log is calls["absmax"]:
                inp = args[1]
            if isinstance(inp, torch.Tensor) and inp.data_ptr() in weights:
                _log.append(weights[inp.data_ptr()])
            return _original(*args, **kwargs)
        setattr(be, name, wrapped)
    gen = torch.Generator().manual_seed(0)
    for step in range(2):
        for _ in range(opts.data.grad_accumulation):
            x = torch.randint(0, PRESETS["tiny"].vocab_size, (opts.data.batch_size, opts.data.seq_len + 1), generator=gen)
            engine.micro_step(x[:, :-1], x[:, 1:])
        engine.update(1e-3, step + 1)
    keys = sorted(lin.layer_of)
    kept = [key for key in keys if lin.layer_of[key][0] < kept_layers]
    assert sorted({key for key, _ in lin.kept}) == kept
    passes = 2 * opts.data.grad_accumulation  # steps x micro-steps
    # once per step: the kept layers, and a layer left alone in its slot (layer 2 once layer 0, its slot's other
    # layer, is kept: the slot still holds its copies at the next pass); every pass: the others
    once = {0: [], 1: [0, 2]}[kept_layers]
    made = sorted([key for key in keys if lin.layer_of[key][0] not in once] * passes
                  + [key for key in keys if lin.layer_of[key][0] in once] * 2)
    assert sorted(calls["absmax"]) == sorted(keys * 2)  # once per weight per step
    assert sorted(calls["quantize"]) == made  # forward: W_q only
    assert sorted(calls["quantize_transpose"]) == made  # dgrad: W^T_q only
    assert calls["quantize_with_transpose"] == []
