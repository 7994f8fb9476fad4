"""benchmarks/speed_table.py: the grid it plans, the table it prints (SOL / MFU from the records, failed rows
kept), the time limit of a row, and one real row through Ray on the CPU."""

import importlib.util
import json
import pathlib
import signal
import sys
import time

import numpy as np

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("speed_table", ROOT / "benchmarks" / "speed_table.py")
speed_table = importlib.util.module_from_spec(spec)
sys.modules["speed_table"] = speed_table  # dataclasses look their module up there
spec.loader.exec_module(speed_table)

from llmq_ray.model.config import PRESETS  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"


def arg(row, flag):
    return row.argv[row.argv.index(flag) + 1]


def test_plan_rows_is_the_issue_grid():
    rows = speed_table.plan_rows(["Qwen2.5-0.5B", "Qwen2.5-1.5B"], ["triton", "torch"], ["bf16", "e4m3"], 1024,
                                 overlap_wgrad_sms=100, hf_baseline=True)
    setups = [(r.model, r.setup) for r in rows]
    for model in ("Qwen2.5-0.5B", "Qwen2.5-1.5B"):
        mine = [s for m, s in setups if m == model]
        assert mine == ["llmq-ray triton, bf16, CUDA graphs, through Ray",
                        "llmq-ray triton, bf16, CUDA graphs, wgrads on a side stream (100 SMs), through Ray",
                        "llmq-ray triton, e4m3, CUDA graphs, through Ray",
                        "llmq-ray torch, bf16, through Ray",
                        "HF transformers + torch.compile + bf16 autocast + fused AdamW"]
    by = {(r.model, r.setup): r for r in rows}
    # the triton rows run at the shapes of issue 6's bars
    r05 = by[("Qwen2.5-0.5B", "llmq-ray triton, e4m3, CUDA graphs, through Ray")]
    assert [arg(r05, f) for f in ("--batch-size", "--grad-accumulation", "--matmul-dtype")] == ["32", "1", "e4m3"]
    assert "--fp8-delayed-swiglu-scale" not in r05.argv
    # issue 25 times at least 5 steps after the warm-up: 1.5B runs 7 steps, 2 of them warm-up
    r15e = by[("Qwen2.5-1.5B", "llmq-ray triton, e4m3, CUDA graphs, through Ray")]
    assert int(arg(r15e, "--steps")) - int(arg(r15e, "--warmup-steps")) >= 5
    delayed = speed_table.plan_rows(["Qwen2.5-0.5B"], ["triton"], ["e4m3"], 1024, 0, False, fp8_head=True,
                                    fp8_delayed=True)
    assert [r.setup for r in delayed] == ["llmq-ray triton, e4m3 (LM head too) (delayed SwiGLU scale), CUDA graphs, "
                                          "through Ray"]
    assert "--fp8-delayed-swiglu-scale" in delayed[0].argv and arg(delayed[0], "--lmhead-dtype") == "e4m3"
    r15 = by[("Qwen2.5-1.5B", "llmq-ray triton, bf16, CUDA graphs, wgrads on a side stream (100 SMs), through Ray")]
    assert [arg(r15, f) for f in ("--batch-size", "--grad-accumulation", "--overlap-wgrad-sms")] == ["16", "16", "100"]
    assert "--matmul-dtype" not in r15.argv and r15.matmul_dtype == "bf16"
    for r in rows:
        if r.kind == "ours":
            assert arg(r, "--opt-m-dtype") == arg(r, "--opt-v-dtype") == "bf16" and arg(r, "--seq-len") == "1024"
            assert ("--use-cuda-graphs" in r.argv) == ("triton" in r.setup)
        else:
            assert r.argv[0].endswith("hf_baseline.py") and arg(r, "--model") == r.model


def test_plan_rows_without_overlap_or_baseline_and_on_cpu():
    rows = speed_table.plan_rows(["tiny"], ["torch"], ["bf16", "e4m3"], 64, 0, False, device="cpu")
    assert [r.setup for r in rows] == ["llmq-ray torch, fp32, through Ray"]  # the reference runs bf16 only
    assert arg(rows[0], "--device") == "cpu" and arg(rows[0], "--workers") == "1" and "--gpus" not in rows[0].argv


def fake_row(model, matmul, tps, gpu=H100, **kw):
    row = speed_table.Row(model, f"setup {matmul}", "ours", matmul, 16, 1, ["bench_train.py"])
    row.record = {"gpu": gpu, "tokens_per_s_per_gpu": tps, "step_ms": 1000.0, "peak_memory_gib": 12.25, **kw}
    return row


def test_plan_rows_for_two_gpus_and_every_zero_level():
    """Issue 27's matrix: one GPU at ZeRO-1 and 2 GPUs x ZeRO-1/2/3 for our rows (CUDA graphs only at ZeRO-1, which
    alone can be captured), and llm.q once per GPU count."""
    rows = speed_table.plan_rows(["Qwen2.5-0.5B"], ["triton"], ["bf16"], 1024, 0, False,
                                 llmq_bin="/x/llmq-bin", gpus=[1, 2], zero_levels=[1, 2, 3])
    ours = [r for r in rows if r.kind == "ours"]
    assert len(ours) == 4 and len([r for r in rows if r.kind == "llmq"]) == 2
    for r in ours:
        argv = " ".join(r.argv)
        zero = int(argv.split("--zero-level ")[1].split()[0]) if "--zero-level" in argv else 1
        assert ("--use-cuda-graphs" in argv) == (zero == 1), argv
        assert ("2 GPUs" in r.setup) == ("--gpus 2" in argv)
    assert [r.argv[r.argv.index("--gpus") + 1] for r in rows if r.kind == "llmq"] == ["1", "2"]


def test_table_computes_sol_against_the_dtype_peak_and_mfu_against_bf16():
    fpt = PRESETS["Qwen2.5-0.5B"].flops_per_token(1024)
    tps = 0.5 * 989e12 / fpt  # 50% of the bf16 peak
    bf16, fp8 = fake_row("Qwen2.5-0.5B", "bf16", tps), fake_row("Qwen2.5-0.5B", "e4m3", tps)
    m_bf16, m_fp8 = speed_table.row_metrics(bf16, 1024), speed_table.row_metrics(fp8, 1024)
    assert m_bf16["sol"] == pytest.approx(0.5) and m_bf16["mfu"] == pytest.approx(0.5)
    assert m_fp8["sol"] == pytest.approx(0.5 * 989 / 1979) and m_fp8["mfu"] == pytest.approx(0.5)
    failed = speed_table.Row("Qwen2.5-1.5B", "broken", "ours", "bf16", 16, 16, ["bench_train.py"],
                             error="exit status 2")
    table = speed_table.format_table([bf16, fp8, failed], 1024)
    lines = table.splitlines()
    assert f"**{tps:,.0f}**" in lines[4] and "| 50.0% | 50.0% | 12.2 GiB |" in lines[4]
    assert "| 25.0% | 50.0% |" in lines[5]
    assert "failed (exit status 2)" in lines[6]  # a failed row stays in the table
    assert "[3] `python bench_train.py`" in table and H100 in table


def test_unknown_gpu_gives_no_sol():
    m = speed_table.row_metrics(fake_row("Qwen2.5-0.5B", "bf16", 1000.0, gpu=None), 1024)
    assert m["sol"] is None and m["mfu"] is None


def test_merge_refuses_mixed_sequence_lengths(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(speed_table.rows_to_json([fake_row("Qwen2.5-0.5B", "bf16", 1.0)], 1024)))
    b.write_text(json.dumps(speed_table.rows_to_json([fake_row("Qwen2.5-1.5B", "bf16", 2.0)], 2048)))
    rows, seq = speed_table.rows_from_json([str(a)])
    assert seq == 1024 and rows[0].record["tokens_per_s_per_gpu"] == 1.0
    with pytest.raises(SystemExit, match="different --seq-len"):
        speed_table.rows_from_json([str(a), str(b)])


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_hanging_row_is_stopped_and_reported(tmp_path, sigint):
    """The row gets SIGINT at its time-out and stops at once, also when the caller runs with SIGINT ignored (a
    background job of a script, a pytest-xdist worker), which a child would otherwise inherit."""
    row = speed_table.Row("tiny", "sleeps", "ours", "bf16", 1, 1, ["-c", "import time; time.sleep(120)"])
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler)
    try:
        t0 = time.monotonic()
        speed_table.run_row(row, timeout_s=1.0, log_path=str(tmp_path / "log"))
        seconds = time.monotonic() - t0
    finally:
        signal.signal(signal.SIGINT, before)
    assert seconds < 15, seconds  # SIGKILL would only come after 30 s more
    assert row.record is None and row.error == "timed out after 1 s"


def test_the_hf_baseline_rows_get_their_own_time_limit(tmp_path, monkeypatch):
    """torch.compile of the HF baseline takes minutes on a fresh machine; its rows run under --hf-timeout-s, every
    other row under --row-timeout-s."""
    seen = []

    def fake_run_row(row, timeout_s, log_path, env=None):
        seen.append((row.kind, timeout_s))
        row.error = "not run"
        return row

    monkeypatch.setattr(speed_table, "run_row", fake_run_row)
    rc = speed_table.main(["--models", "Qwen2.5-0.5B", "--backends", "triton", "--matmul-dtypes", "bf16",
                           "--row-timeout-s", "12", "--hf-timeout-s", "321", "--log", str(tmp_path / "log")])
    assert rc == 1  # no row measured anything
    assert seen == [("ours", 12.0), ("hf", 321.0)]


def test_a_failing_row_is_reported(tmp_path):
    row = speed_table.Row("tiny", "fails", "ours", "bf16", 1, 1, ["-c", "import sys; sys.exit(3)"])
    speed_table.run_row(row, timeout_s=60.0, log_path=str(tmp_path / "log"))
    assert row.record is None and row.error == "exit status 3"


def test_one_real_row_through_ray_on_cpu(ray_cluster, tmp_path, monkeypatch):
    """The whole path: bench_train.py through Ray on a CPU worker, its JSON record, the table and --merge.

    The row's driver (a process of its own, as in a real table) joins the test session's Ray through RAY_ADDRESS
    instead of starting a local instance: Ray waits a fixed 30 s for a new node to register (ray/_private/node.py,
    not configurable), which a busy 2-core machine can exceed (this test failed so, 1 run of 792, when it started
    its own). Everything the row does after ``ray.init`` -- placement, the CPU worker, the steps, its record -- is
    the same on either Ray."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.get_runtime_context().gcs_address)  # the rows inherit it
    out = tmp_path / "table.json"
    argv = ["--device", "cpu", "--models", "tiny", "--backends", "torch", "--seq-len", "32", "--row-timeout-s", "180",
            "--log", str(tmp_path / "log"), "--json-out", str(out), "--markdown-out", str(tmp_path / "table.md")]
    assert speed_table.main(argv) == 0, (tmp_path / "log").read_text()[-3000:]
    assert "Connecting to existing Ray cluster at address" in (tmp_path / "log").read_text()  # the session's
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["error"] is None and row["record"]["tokens_per_s"] > 0 and row["record"]["args"]["backend"] == "torch"
    table = (tmp_path / "table.md").read_text()
    assert "| tiny | llmq-ray torch, fp32, through Ray [1] | 8 x 1 | **" in table
    assert speed_table.main(["--merge", str(out)]) == 0
    assert not list(tmp_path.glob("*.tmp*"))  # the JSON and markdown were renamed into place


def test_llmq_rows_run_at_the_triton_rows_shapes():
    rows = speed_table.plan_rows(["Qwen2.5-0.5B"], ["triton"], ["bf16", "e4m3"], 1024, 0, True, llmq_bin="/x/bin")
    assert [r.kind for r in rows] == ["ours", "ours", "llmq", "llmq", "hf"]
    for ours, llmq in zip(rows[:2], rows[2:4]):
        assert llmq.argv[0].endswith("llmq_baseline.py") and arg(llmq, "--llmq-bin") == "/x/bin"
        assert llmq.matmul_dtype == ours.matmul_dtype == arg(llmq, "--matmul-dtype")
        for flag in ("--batch-size", "--grad-accumulation", "--seq-len", "--steps", "--warmup-steps"):
            assert arg(llmq, flag) == arg(ours, flag), flag

    shaped = speed_table.plan_rows(["Qwen2.5-0.5B"], ["triton"], ["bf16"], 1024, 0, False, llmq_bin="/x/bin",
                                   triton_shape=(32, 8, 6, 2))
    for row in shaped:  # --triton-shape moves ours and llm.q's together
        assert (row.batch, row.micro_steps) == (32, 8)
        assert [arg(row, f) for f in ("--batch-size", "--grad-accumulation", "--steps", "--warmup-steps")] == \
            ["32", "8", "6", "2"]


def test_llmq_output_becomes_a_record(tmp_path):
    spec = importlib.util.spec_from_file_location("llmq_baseline", ROOT / "benchmarks" / "llmq_baseline.py")
    llmq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llmq)
    text = "\n".join(f"[T] step {s:4d} [ 12.5%] | time:  {ms} ms | norm 1.0 | loss 11.9" for s, ms in
                     enumerate([900, 215, 210, 205, 220]))
    rec = llmq.record_from_output(text, 32 * 1024, warmup_steps=1)
    assert rec["step_ms"] == 212.5 and rec["timed_steps"] == 4
    assert rec["tokens_per_s_per_gpu"] == 32 * 1024 / 212.5 * 1e3
    assert llmq.record_from_output("Thread 0 exited with uncaught exception", 1, 1) is None
    path = tmp_path / "train.bin"
    llmq.write_tokens(str(path), 1000)
    header = np.fromfile(path, np.int32, 256)
    assert header[:2].tobytes() == b"BIN.TOK\n" and list(header[2:6]) == [2, 4, 1000, 151643]
    assert path.stat().st_size == 1024 + 4 * 1000
    assert llmq.main(["--llmq-bin", str(tmp_path), "--model", "x", "--batch-size", "1", "--json", "o"]) == 2
