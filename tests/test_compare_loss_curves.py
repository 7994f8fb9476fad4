"""benchmarks/compare_loss_curves.py: the noise verdict against a reference run, and the plot."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compare_loss_curves", ROOT / "benchmarks" / "compare_loss_curves.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def write_log(path, losses, final_eval):
    lines = [{"log": "step", "step": i, "loss": x} for i, x in enumerate(losses)] + [{"log": "eval", "loss": final_eval}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


def test_second_run_is_within_or_outside_the_reference_noise(tmp_path, capsys):
    a = write_log(tmp_path / "a.json", [10.0, 8.0, 7.0, 6.0], 6.5)
    ref = write_log(tmp_path / "ref.json", [10.0, 8.1, 7.0, 6.1], 6.6)   # noise: 0.1 / 6.0 = 1.67e-02
    close = write_log(tmp_path / "close.json", [10.0, 8.0, 7.05, 6.05], 6.55)   # 0.05 / 6.0 = 8.3e-03
    far = write_log(tmp_path / "far.json", [10.0, 8.0, 7.0, 6.3], 6.9)   # 0.3 / 6.0 = 5e-02
    png = tmp_path / "curves.png"
    assert compare.main([a, close, "--reference", ref, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "max relative loss difference over 4 steps: 8.33e-03" in out and "noise (first run vs reference): 1.67e-02" in out
    assert "is within the noise" in out
    assert png.exists() or "no plot" in out
    assert compare.main([a, far, "--reference", ref]) == 0
    assert "is OUTSIDE the noise" in capsys.readouterr().out


def test_a_log_without_steps_is_refused(tmp_path, capsys):
    a = write_log(tmp_path / "a.json", [10.0], 9.0)
    empty = write_log(tmp_path / "b.json", [], 9.0)
    assert compare.main([a, empty]) == 2
    assert "no step records in" in capsys.readouterr().err
