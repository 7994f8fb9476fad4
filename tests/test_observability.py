"""Observability pieces of issue 7: W&B logging, the plot script, the progress bar, NVML GPU stats, the memory
table, the SOL peak table and tokenizer files for lm-eval-ready exports."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import sys
import time
import types

import pytest
import torch

from _helpers import FakeTTY, train_settings
from llmq_ray.backends import get_backend
from llmq_ray.model.config import PRESETS
from llmq_ray.engine.train_engine import TrainEngine
from llmq_ray.errors import ConfigError
from _helpers import checked_settings, train_settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_log(path: str, steps: int = 12, eval_every: int = 4, lr0: float = 1e-3, nan_at: int | None = None) -> str:
    """A JSON log shaped like the coordinator's (actors/coordinator.py), written through RunLog."""
    from llmq_ray.observe.runlog import RunLog

    log = RunLog(path)
    log.add("options", model="tiny", steps=steps, learning_rate=lr0, run_name=None)
    log.add("gpu", rank=0, device="cpu", name="cpu", node_ip="127.0.0.1", local_rank=0, pid=1)
    log.add("sol", flops_per_token=1e6, gpu=None, matmul_dtype="bf16", peak_tflops=None, peak_tflops_bf16=None)
    log.add("dataset", synthetic=True)
    log.add("allocator", rank=0, weights=1000, grads=1000)
    for s in range(steps):
        loss = float("nan") if s == nan_at else 6.0 - 0.3 * s
        log.add("step", step=s + 1, lr=lr0 * (1 - s / steps), loss=loss, norm=1.0 / (s + 1), targets=512,
                tokens=512, seconds=0.1, tokens_per_s=5120.0 + s, sol=None, skipped=s == nan_at,
                worker_seconds=0.09, ray_overhead_seconds=0.01, data_seconds=0.001, memory=[100 + s, 200 + s])
        if (s + 1) % eval_every == 0:
            log.add("eval", step=s + 1, loss=6.1 - 0.3 * s, targets=1024, seconds=0.2, full=False, batches=2)
    log.add("gpu_util", rank=0, step=steps, index=0, name="fake", sm_clock_mhz=1980, power_w=650.5,
            temperature_c=61, gpu_util_pct=99)
    log.add("eval", step=steps, loss=2.5, targets=4096, seconds=0.5, full=True, batches=8)
    log.add("summary", steps=steps, train_loss=2.7, eval_loss=2.5, tokens_per_s=5100.0)
    log.flush()
    return path


# ---------------------------------------------------------------------------------------------- W&B
def test_record_to_wandb_maps_the_json_log_fields():
    from llmq_ray.observe.wandb_logger import record_to_wandb

    what, data, step = record_to_wandb({"log": "step", "step": 5, "lr": 2e-4, "loss": 3.5, "norm": 0.7,
                                        "tokens_per_s": 4.5e4, "seconds": 0.18, "sol": 0.45, "skipped": False,
                                        "memory": [10, 30], "targets": 99})
    assert (what, step) == ("log", 5)  # W&B step = the record's: steps done = the [T] line's 1-based number
    assert data == {"train/loss": 3.5, "train/grad_norm": 0.7, "train/lr": 2e-4, "train/tokens_per_s": 4.5e4,
                    "train/step_seconds": 0.18, "train/sol": 0.45, "train/skipped": 0,
                    "train/memory_bytes_max": 30.0}
    what, data, step = record_to_wandb({"log": "eval", "step": 5, "loss": 3.9, "seconds": 1.0, "full": True})
    assert (what, step) == ("log", 5) and data == {"eval/loss": 3.9, "eval/seconds": 1.0, "eval/final_loss": 3.9}
    what, data, step = record_to_wandb({"log": "gpu_util", "rank": 1, "step": 10, "index": 1, "name": "H100",
                                        "sm_clock_mhz": 1980, "power_w": 600.0, "temperature_c": None})
    assert (what, step) == ("log", 10) and data == {"gpu1/sm_clock_mhz": 1980.0, "gpu1/power_w": 600.0}
    nan_step = record_to_wandb({"log": "step", "step": 1, "loss": "nan", "norm": "inf"})[1]
    assert math.isnan(nan_step["train/loss"]) and math.isinf(nan_step["train/grad_norm"])
    assert record_to_wandb({"log": "options", "model": "tiny"}) == ("config", {"model": "tiny"}, None)
    assert record_to_wandb({"log": "allocator", "rank": 0, "weights": 5})[1] == {"memory/rank0/weights": 5}
    assert record_to_wandb({"log": "summary", "steps": 3})[0] == "summary"
    assert record_to_wandb({"log": "something-new"}) is None
    what, data, step = record_to_wandb({"log": "fp8_monitor", "step": 10, "swiglu_absmax": [1.5, 40.0], "max": 40.0,
                                        "max_layer": 1, "saturated_share": [0.0, 0.002],
                                        "saturated_share_max": 0.002})
    assert (what, step) == ("log", 10) and data == {"fp8/swiglu_absmax/layer00": 1.5,
                                                    "fp8/swiglu_absmax/layer01": 40.0, "fp8/swiglu_absmax/max": 40.0,
                                                    "fp8/saturated_share/layer00": 0.0,
                                                    "fp8/saturated_share/layer01": 0.002,
                                                    "fp8/saturated_share/max": 0.002}


def test_wandb_logger_offline_writes_a_local_run(tmp_path, monkeypatch):
    """WANDB_MODE=offline: no network, the run lands under dir/wandb with our keys in its .wandb file;
    export_wandb.py replays a whole JSON log the same way."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log = _fake_log(str(tmp_path / "run1" / "log.jsonl"))
    exporter = _load_example("export_wandb")
    assert exporter.main(["--log", log, "--project", "llmq-test", "--run-name", "replay",
                          "--dir", str(tmp_path / "wb")]) == 0
    runs = [d for d in os.listdir(tmp_path / "wb" / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    folder = tmp_path / "wb" / "wandb" / runs[0]
    keys = (b"train/loss", b"train/grad_norm", b"train/lr", b"train/tokens_per_s", b"eval/loss", b"gpu0/power_w",
            b"replay")
    deadline = time.monotonic() + 20.0
    while True:  # W&B's service process may still be writing the run file when finish() returns
        blob = b"".join(open(folder / f, "rb").read() for f in os.listdir(folder) if f.endswith(".wandb"))
        if all(k in blob for k in keys) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for key in keys:
        assert key in blob, key


def test_wandb_logger_calls(monkeypatch):
    """The logger's calls into wandb (a fake module): init arguments, steps never going backwards, config,
    summary, finish once."""
    calls = []

    class Run:
        def __init__(self):
            self.config = types.SimpleNamespace(update=lambda d, allow_val_change: calls.append(("config", d)))
            self.summary = {}

        def log(self, data, step):
            calls.append(("log", step, dict(data)))

        def finish(self, exit_code=0):
            calls.append(("finish", exit_code))

    run = Run()
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    from llmq_ray.observe.wandb_logger import WandbLogger

    lg = WandbLogger("proj", "name", {"lr": 1e-3}, dir=None)
    assert calls[0] == ("init", {"project": "proj", "name": "name", "config": {"lr": 1e-3}, "dir": None,
                                 "mode": "offline"})
    lg.log_record({"log": "step", "step": 10, "loss": 2.0})
    lg.log_record({"log": "eval", "step": 10, "loss": 2.1})
    lg.log_record({"log": "step", "step": 4, "loss": 9.0})  # a step repeated after a restart: not sent
    lg.log_record({"log": "sol", "flops_per_token": 7.0})
    lg.log_record({"log": "summary", "eval_loss": 2.1, "tokens_per_s": float("inf")})
    lg.finish()
    lg.finish()
    assert [c[1] for c in calls if c[0] == "log"] == [10, 10] and lg.dropped == 1
    assert ("config", {"sol/flops_per_token": 7.0}) in calls
    assert run.summary == {"eval_loss": 2.1, "tokens_per_s": "inf"}
    assert [c for c in calls if c[0] == "finish"] == [("finish", 0)]


# ---------------------------------------------------------------------------------------------- plot
def test_plot_training_run_writes_a_png(tmp_path, monkeypatch):
    plot = _load_example("plot_training_run")
    a = _fake_log(str(tmp_path / "bf16" / "log.jsonl"))
    b = _fake_log(str(tmp_path / "fp8" / "log.jsonl"), steps=20, lr0=2e-3, nan_at=5)
    s = plot.series(plot.load_log(b))
    assert len(s["step"]) == 19 and 6 not in s["step"]  # the skipped step is left out
    assert s["step"][:3] == [1, 2, 3] and s["eval_step"] == [4, 8, 12, 16, 20] and s["final_loss"] == [2.5]
    assert plot.run_label(a, plot.load_log(a)) == "bf16"
    assert plot.smooth([1.0, 3.0, math.nan, 5.0], 2) == [1.0, 2.0, 2.0, 4.0]
    out = tmp_path / "plots" / "cmp.png"
    assert plot.main([a, b, "--out", str(out), "--smooth", "3", "--title", "t"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image

    img = matplotlib.image.imread(str(out))
    assert img.shape[0] > 600 and img.shape[1] > 1000 and img[..., :3].std() > 0.05  # a real drawing
    assert plot.main([a, b, "--labels", "only-one", "--out", str(out)]) == 2
    # a save that fails half-way leaves the earlier picture whole and no partial file beside it
    from matplotlib.figure import Figure

    def broken_save(self, path, **kw):
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_save)
    assert plot.main([a, b, "--out", str(out)]) == 2
    assert out.read_bytes() == data and os.listdir(out.parent) == ["cmp.png"]


# ---------------------------------------------------------------------------------------------- progress
class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_bar_draws_rate_and_eta_on_a_tty(monkeypatch):
    from llmq_ray.observe.progress import Progress, format_duration

    monkeypatch.delenv("LLMQ_NO_PROGRESS", raising=False)
    tty, clock = FakeTTY(), FakeClock()
    bar = Progress(100, "train", unit="step", stream=tty, width=10, min_interval=0.0, clock=clock)
    assert bar.enabled
    clock.t += 20.0
    bar.update(25, loss="3.412")
    assert bar.rate() == pytest.approx(1.25) and bar.eta() == pytest.approx(60.0)
    line = bar.render()
    assert line == "train [##--------]  25/100  25.0% |  1.25 step/s | ETA 01:00, loss=3.412"
    assert tty.getvalue().endswith("\r" + line)
    bar.write("[T] step 25")
    assert "[T] step 25\n" in tty.getvalue() and tty.getvalue().endswith(line)
    clock.t += 60.0
    bar.update(75)
    bar.close()
    assert tty.getvalue().endswith("100/100 100.0% |  1.25 step/s | ETA 00:00, loss=3.412\n")
    assert format_duration(3725) == "1:02:05" and format_duration(None) == "?"


def test_progress_bar_is_off_without_tty_or_when_disabled(monkeypatch):
    from llmq_ray.observe.progress import Progress

    monkeypatch.delenv("LLMQ_NO_PROGRESS", raising=False)
    for stream, enabled in ((io.StringIO(), True), (FakeTTY(), False)):
        bar = Progress(10, "eval", stream=stream, enabled=enabled, min_interval=0.0)
        assert not bar.enabled
        bar.update(5)
        bar.write("[V] line")
        bar.close()
        assert stream.getvalue() == "[V] line\n"  # log lines still printed, no bar, no \r
    monkeypatch.setenv("LLMQ_NO_PROGRESS", "1")
    assert not Progress(10, stream=FakeTTY()).enabled
    # unknown total, and the redraw throttle
    monkeypatch.delenv("LLMQ_NO_PROGRESS")
    tty, clock = FakeTTY(), FakeClock()
    bar = Progress(None, "tokenize", unit="doc", stream=tty, min_interval=1.0, clock=clock)
    for _ in range(5):
        clock.t += 0.1
        bar.update(1)
    assert tty.getvalue().count("\r") == 1  # drawn once in the first update, then throttled
    assert bar.render().startswith("tokenize 5 doc | 10.00 doc/s | elapsed 00:00")


def test_eval_bar_replaces_the_training_bar_while_an_eval_runs(monkeypatch):
    """EvalBar, fed the coordinator's reports, draws an eval bar over batches in place of the training bar,
    starts over when another eval begins, erases itself when the eval is over, and the training bar comes
    back with the next log line. Off without a terminal, with --no-progress, or LLMQ_NO_PROGRESS."""
    from llmq_ray.observe.progress import EvalBar, Progress

    monkeypatch.delenv("LLMQ_NO_PROGRESS", raising=False)
    tty, clock = FakeTTY(), FakeClock()
    train = Progress(10, "train", unit="step", stream=tty, width=10, min_interval=0.0, clock=clock)
    train.update(4)
    train_line = train.render()
    ev = EvalBar(tty, under=train, clock=clock)
    ev.show(None)  # no eval running: nothing happens
    assert tty.getvalue().endswith("\r" + train_line)
    ev.show({"done": 0, "total": 8, "full": False})
    assert tty.getvalue().endswith("\r" + " " * len(train_line) + "\r" + "\r" + ev.bar.render())
    clock.t += 2.0
    ev.show({"done": 6, "total": 8, "full": False})
    line = ev.bar.render()
    assert line.startswith("eval [") and " 6/8  75.0% |  3.00 batch/s | ETA 00:00" in line
    assert tty.getvalue().endswith("\r" + line)
    ev.show({"done": 1, "total": 37, "full": True})  # the next eval began between two polls
    assert ev.bar.render().startswith("final eval [") and " 1/37 " in ev.bar.render()
    ev.show(None)
    assert ev.bar is None
    text = tty.getvalue()
    last = text.rsplit("final eval [", 1)[1]
    assert last.endswith("\r") and last.split("\r", 1)[1].strip() == ""  # the eval line was erased
    train.write("[V] step 4 | eval loss 3.1")
    assert tty.getvalue().endswith("[V] step 4 | eval loss 3.1\n\r" + train.render())
    assert train.render().startswith("train [####------]  4/10")

    for stream, enabled in ((io.StringIO(), True), (FakeTTY(), False)):  # no terminal; --no-progress
        off = EvalBar(stream, enabled=enabled)
        off.show({"done": 3, "total": 8, "full": True})
        off.end()
        assert not off.enabled and off.bar is None and stream.getvalue() == ""
    monkeypatch.setenv("LLMQ_NO_PROGRESS", "1")
    assert not EvalBar(FakeTTY()).enabled


# ---------------------------------------------------------------------------------------------- NVML
def test_gpu_stats_none_without_nvml(monkeypatch):
    from llmq_ray.observe import gpu_stats as gs

    gs._reset_for_tests()
    if not torch.cuda.is_available():
        assert gs.gpu_stats(0) is None  # the real pynvml on this machine: no driver, no crash
        assert gs.nvml_index_for_torch_device(0) is None
    gs._reset_for_tests()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert gs.gpu_stats(0) is None
    assert gs.GpuUtilLogger(1, index=0).maybe_sample(1) is None
    gs._reset_for_tests()


def test_gpu_stats_with_fake_pynvml(monkeypatch):
    from llmq_ray.observe import gpu_stats as gs

    class NotSupported(Exception):
        pass

    fake = types.ModuleType("pynvml")
    fake.NVML_CLOCK_SM, fake.NVML_CLOCK_MEM, fake.NVML_TEMPERATURE_GPU = 1, 2, 0
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetCount = lambda: 2

    def handle(i):
        if i >= 2:
            raise NotSupported("invalid index")
        return ("h", i)

    fake.nvmlDeviceGetHandleByIndex = handle
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    fake.nvmlDeviceGetClockInfo = lambda h, c: {1: 1980, 2: 2619}[c]
    fake.nvmlDeviceGetMaxClockInfo = lambda h, c: 1980
    fake.nvmlDeviceGetPowerUsage = lambda h: 612_345  # mW
    fake.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    fake.nvmlDeviceGetTemperature = lambda h, s: 64
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=97, memory=41)
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=60 * 2**30, total=80 * 2**30, free=20 * 2**30)

    def reasons(h):
        raise NotSupported("not on this GPU")

    fake.nvmlDeviceGetCurrentClocksEventReasons = reasons
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gs._reset_for_tests()
    s = gs.gpu_stats(1)
    assert set(s) == set(gs.STAT_KEYS)
    assert s == {"index": 1, "name": "NVIDIA H100 80GB HBM3", "sm_clock_mhz": 1980, "mem_clock_mhz": 2619,
                 "max_sm_clock_mhz": 1980, "power_w": pytest.approx(612.345), "power_limit_w": pytest.approx(700.0),
                 "temperature_c": 64, "gpu_util_pct": 97, "mem_util_pct": 41, "memory_used_bytes": 60 * 2**30,
                 "memory_total_bytes": 80 * 2**30, "throttle_reasons": None}
    assert gs.gpu_stats(5) is None  # no such device
    sampler = gs.GpuUtilLogger(every_n_steps=10, index=0)
    assert sampler.maybe_sample(5) is None
    got = sampler.maybe_sample(20)
    assert got["step"] == 20 and got["power_w"] == pytest.approx(612.345)
    assert gs.GpuUtilLogger(0, index=0).maybe_sample(10) is None  # --log-gpu-util 0: off
    gs._reset_for_tests()


# ---------------------------------------------------------------------------------------------- memory table
def _reachable_bytes(engine) -> int:
    """Independent count: bytes of every distinct storage among the tensors in the attributes (and lists /
    dicts of them, to any depth) of engine, engine.model and engine.optimizer."""
    seen_obj, seen_storage, total = set(), set(), 0
    stack = [engine, engine.model, engine.optimizer]
    while stack:
        o = stack.pop()
        if id(o) in seen_obj:
            continue
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            ptr = o.untyped_storage().data_ptr()
            if ptr not in seen_storage:
                seen_storage.add(ptr)
                total += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and type(o).__module__.split(".")[0] == "llmq_ray":
            stack.extend(vars(o).values())
    return total


@pytest.mark.parametrize("kw", [dict(),
                                dict(model_dtype="bf16", matmul_dtype="e4m3", zero_level=2, recompute_ffn=True)],
                         ids=["fp32-zero1", "bf16-fp8-zero2"])
def test_memory_table_adds_up_to_what_is_allocated(kw):
    from llmq_ray.observe.memory_table import TENSOR_ROWS, format_memory_table, memory_dict, memory_table, tensor_bytes

    opts = train_settings(batch_size=2, seq_len=64, **kw)
    e = TrainEngine(PRESETS["tiny"], opts, get_backend("torch"))
    rows = memory_table(e)
    assert [n for n, _ in rows] == list(TENSOR_ROWS)  # CPU: no device rows
    t = memory_dict(rows)
    assert tensor_bytes(rows) == _reachable_bytes(e)
    nb = lambda x: x.numel() * x.element_size()  # noqa: E731
    assert t["weights"] == nb(e.params) and t["adam_m"] == nb(e.optimizer.m) and t["adam_v"] == nb(e.optimizer.v)
    assert t["master"] == (0 if e.optimizer.master is None else nb(e.optimizer.master))
    grads = [e.grads] if e.store is None else e.store.tensors()["grads"]  # ZeRO-2: per-layer scratch
    assert t["grads"] == sum(nb(g) for g in grads) + (0 if e.grad_shard is None else nb(e.grad_shard))
    a = e.model.acts
    act_bufs = [*a.residual, *a.rstd1, *a.rstd2, *(b for bufs in a._store.values() for b in bufs)]
    assert t["activations"] == sum(nb(b) for b in act_bufs)
    # the measured table and the model's own accounting agree (L+1 residuals included)
    assert t["activations"] == e.model.activation_bytes()["total"]
    fp8 = e.model.lin.fp8_bytes()
    assert fp8 <= t["fp8"] <= fp8 + 4096 and (fp8 > 0) == (opts.numerics.matmul_dtype == "e4m3")
    assert t["scratch"] >= nb(e.model.logits) + nb(e.model.d_residual)
    if kw:
        assert t["master"] == 2 * t["weights"] and e.grads is None and t["grads"] > nb(e.grad_shard)
    text = format_memory_table(rows, title="memory (rank 0)")
    lines = text.splitlines()
    assert lines[0] == "memory (rank 0)" and "sum of tensors" in lines[-1]
    assert len({len(ln) for ln in lines[1:]}) == 1  # aligned columns
    assert f"{tensor_bytes(rows) / 2**20:.2f} MiB" in lines[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_table_matches_cuda_allocated():
    from llmq_ray.observe.memory_table import memory_dict, memory_table, tensor_bytes

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    opts = train_settings(model="tiny-qwen", batch_size=4, seq_len=256, model_dtype="bf16", matmul_dtype="e4m3")
    e = TrainEngine(PRESETS["tiny-qwen"], opts, get_backend("torch", "cuda"))
    torch.cuda.synchronize()
    rows = memory_table(e)
    d = memory_dict(rows)
    assert {"cuda_allocated", "free", "total"} <= set(d)
    engine_alloc = torch.cuda.memory_allocated() - base
    assert abs(tensor_bytes(rows) - engine_alloc) < 4 * 2**20, (tensor_bytes(rows), engine_alloc)
    assert d["free"] < d["total"]


# ---------------------------------------------------------------------------------------------- SOL peaks
def test_sol_peak_table_covers_current_gpus():
    from llmq_ray.observe.metrics import peak_tflops

    # torch.cuda.get_device_name() strings -> (bf16 dense, fp8 dense) TFLOP/s from the vendor datasheets
    want = {
        "NVIDIA H100 80GB HBM3": (989.0, 1979.0), "NVIDIA H100 PCIe": (756.0, 1513.0),
        "NVIDIA H100 NVL": (835.0, 1671.0), "NVIDIA H200": (989.0, 1979.0), "NVIDIA H200 NVL": (835.0, 1671.0),
        "NVIDIA GH200 480GB": (989.0, 1979.0), "NVIDIA A100-SXM4-80GB": (312.0, None),
        "NVIDIA A100 80GB PCIe": (312.0, None), "NVIDIA L40S": (362.0, 733.0), "NVIDIA L40": (181.0, 362.0),
        "NVIDIA L4": (121.0, 242.0), "NVIDIA GeForce RTX 4090": (165.2, 330.3),
        "NVIDIA GeForce RTX 5090": (209.5, 419.0), "NVIDIA B200": (2250.0, 4500.0),
    }
    for name, (bf16, fp8) in want.items():
        assert (peak_tflops(name), peak_tflops(name, "e4m3")) == (bf16, fp8), name
    for unknown in ("Tesla T4", "NVIDIA GeForce GTX 1080", "cpu", "", None):
        assert peak_tflops(unknown) is None and peak_tflops(unknown, "e4m3") is None


# ---------------------------------------------------------------------------------------------- tokenizer files
@pytest.fixture(scope="module")
def qwen_tok_dir(tmp_path_factory):
    from llmq_ray.model.tokenizer_files import write_qwen_tokenizer_files

    folder = tmp_path_factory.mktemp("qwen_tok")
    paths = write_qwen_tokenizer_files(str(folder))
    assert [os.path.basename(p) for p in paths] == ["tokenizer.json", "tokenizer_config.json",
                                                    "special_tokens_map.json"]
    return str(folder)


def test_export_with_qwen_tokenizer_files_loads_in_autotokenizer(qwen_tok_dir, tmp_path):
    """The export folder (weights + our tokenizer files) is what lm_eval --model hf opens: AutoTokenizer gives
    llmq_ray.data_pipeline.vocab's Qwen ids."""
    from transformers import AutoTokenizer

    from llmq_ray.data_pipeline.vocab import QWEN_EOS_ID, QwenTiktoken
    from llmq_ray.model.hf_io import export_hf
    from llmq_ray.model.params import ParamLayout

    cfg = PRESETS["tiny"]
    layout = ParamLayout(cfg)
    out = export_hf(str(tmp_path / "export"), cfg, layout, torch.zeros(layout.numel), dtype=torch.float32,
                    tokenizer_source=qwen_tok_dir)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, f)), f
    tok = AutoTokenizer.from_pretrained(out)
    qwen = QwenTiktoken()
    texts = ["Hello, world! 123", "What is the capital of France?", "def foo(): return 42\n\n    x = [1, 2]",
             "你好世界", "这是上下文。", "🚀 Café e\u0301", "  leading spaces\tand\ttabs\r\n"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == qwen.encode(text), text
        assert tok(text)["input_ids"] == qwen.encode(text), text  # no BOS added by default
        assert tok.decode(qwen.encode(text)) == __import__("unicodedata").normalize("NFC", text)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == QWEN_EOS_ID
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [151644, 151645]
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_tokenizer_source_for_export(tmp_path, monkeypatch):
    from llmq_ray.model import tokenizer_files as tf

    hf = tmp_path / "hf_model"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    assert tf.tokenizer_source_for_export(str(hf), 128256) == str(hf)  # the model's own tokenizer wins
    assert tf.tokenizer_source_for_export(None, 512) is None  # tiny synthetic vocabulary: none
    monkeypatch.setattr(tf, "qwen_tokenizer_folder", lambda: "QWEN")
    assert tf.tokenizer_source_for_export(None, 151936) == "QWEN"
    assert tf.tokenizer_source_for_export(str(tmp_path), 151936) == "QWEN"  # folder without tokenizer files


def test_export_without_the_qwen_tokenizer_package_still_exports(monkeypatch, capsys):
    """A Qwen-vocabulary export on a machine without qwen-tokenizer: one warning, no tokenizer files, the
    weights still go out (seen on the GPU machine, whose image lacks the package)."""
    import builtins

    from llmq_ray.model import tokenizer_files

    real_import = builtins.__import__

    def no_qwen(name, *args, **kwargs):
        if name.startswith("qwen_tokenizer"):
            raise ModuleNotFoundError("No module named 'qwen_tokenizer'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(tokenizer_files, "_CACHED_FOLDER", None, raising=False)
    monkeypatch.setattr(builtins, "__import__", no_qwen)
    assert tokenizer_files.tokenizer_source_for_export(None, 151936) is None
    err = capsys.readouterr().err
    assert "the export gets no tokenizer files" in err and "qwen_tokenizer" in err


def test_fp8_monitor_is_each_layers_largest_swiglu_output_over_the_step():
    """--fp8-monitor-every: per layer, the max over the step's micro-steps of max|SwiGLU output| (the FP8 down
    projection's input). The last layer's value is checked against its SwiGLU buffer, which the forward leaves
    holding that layer's output of the last micro-step."""
    opts = train_settings(model="tiny", batch_size=2, seq_len=32, model_dtype="bf16", matmul_dtype="e4m3",
                        grad_accumulation=2, fp8_monitor_every=1)
    e = TrainEngine(PRESETS["tiny"], opts, get_backend("torch"))
    gen = torch.Generator().manual_seed(3)
    vocab = PRESETS["tiny"].vocab_size
    e.monitor_begin()
    per_micro = []
    for _ in range(2):
        x = torch.randint(0, vocab, (2, 33), generator=gen)
        e.micro_step(x[:, :-1], x[:, 1:])
        per_micro.append(e.model.amax[:, 3].clone())
        last = e.model.acts.get("swiglu", PRESETS["tiny"].num_layers - 1).float().abs().max()
        assert per_micro[-1][-1] == last
    e.update(1e-3, 1)
    taken = e.monitor_take()
    got = taken["swiglu_absmax"]
    assert got == torch.maximum(*per_micro).tolist() and len(got) == PRESETS["tiny"].num_layers
    assert all(v > 0 for v in got) and e.monitor_take() is None  # taken once
    # current scaling: each tensor's own maximum is its scale, nothing is clipped and nothing is counted
    assert taken["saturated_share"] is None and taken["saturated_elements"] == 0
    bf16 = TrainEngine(PRESETS["tiny"], train_settings(model="tiny", batch_size=2, seq_len=32), get_backend("torch"))
    with pytest.raises(ValueError, match="the FP8 monitor reports the scales of FP8 block GEMMs"):
        bf16.monitor_begin()


def test_fp8_monitor_counts_the_values_saturated_at_a_delayed_scale():
    """--fp8-delayed-swiglu-scale: values beyond the earlier maximum saturate at the FP8 maximum, and the monitor
    reports per layer the share of the down projection's FP8 inputs that sit there -- equal, layer by layer, to
    torch's own float8 cast at the (halved by hand) delayed scale (kernel_checks.check_saturated_share; the GPU
    run with the triton backend is tests/test_fp8_gpu.py)."""
    import kernel_checks

    kernel_checks.check_saturated_share("torch", "cpu")


def test_fp8_monitors_of_the_ranks_merge_with_nan_winning():
    from llmq_ray.actors.telemetry import merge_fp8_monitors

    assert merge_fp8_monitors([[1.0, 7.0, 2.0], [3.0, 5.0, 2.5]]) == ([3.0, 7.0, 2.5], 1)
    for monitors in ([[1.0, 5.0], [float("nan"), 9.0]], [[float("nan"), 9.0], [1.0, 5.0]]):
        per_layer, top = merge_fp8_monitors(monitors)  # whatever the rank order
        assert math.isnan(per_layer[0]) and per_layer[1] == 9.0 and top == 0
    from llmq_ray.actors.telemetry import merge_saturated_shares

    # the share over all ranks' elements; a rank that counted nothing (a pass at current scales) adds nothing,
    # and none counting anything is "not measured" (None), not a share of 0
    assert merge_saturated_shares([{"saturated_share": [0.5, 0.0], "saturated_elements": 100},
                                   {"saturated_share": [0.25, 0.1], "saturated_elements": 300},
                                   {"saturated_share": None, "saturated_elements": 0}]) == [0.3125, 0.075]
    assert merge_saturated_shares([{"saturated_share": None, "saturated_elements": 0}]) is None
