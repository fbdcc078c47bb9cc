"""benchmarks/continuation_curve.py reads a train run's metrics into a learning curve."""
import json
from pathlib import Path

import pytest

from conftest import load_script


def _module():
    return load_script("benchmarks/continuation_curve.py")


def _write(run: Path, recs: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_points_take_the_training_seconds_of_their_step_and_resumed_steps_count_once(tmp_path):
    cc = _module()
    ev = lambda step, tau: {"step": step, "tau_code": tau, "tau_chat": tau - 0.1,
                            "row_accept_code": [0.4, 0.3, 0.2, 0.1, 0.05], "row_accept_chat": [0.3]}
    _write(tmp_path / "r", [
        {"step": 10, "loss": 3.0, "wall_s": 5.0},
        {"step": 20, "loss": 2.9, "wall_s": 10.0}, ev(20, 1.50),
        {"step": 30, "loss": 2.8, "wall_s": 15.0},
        # stopped after step 30, resumed from the step-20 checkpoint: steps 30.. again
        {"step": 30, "loss": 2.8, "wall_s": 16.0},
        {"step": 40, "loss": 2.7, "wall_s": 21.0}, ev(40, 1.60),
        {"step": 40, "loss": 2.7, "wall_s": 22.0}, ev(40, 1.61),
    ])
    pts = cc.read_curve(tmp_path / "r")
    assert [p["step"] for p in pts] == [20, 40]
    assert pts[0]["train_s"] == 10.0 and pts[0]["rows_code"] == [0.4, 0.3, 0.2, 0.1]
    assert pts[1]["tau_code"] == 1.61 and pts[1]["train_s"] == 22.0
    assert pts[1]["tau_chat"] == pytest.approx(1.51)


def test_a_folder_without_metrics_is_named(tmp_path):
    with pytest.raises(SystemExit, match="--runs .*no metrics.jsonl"):
        _module().read_curve(tmp_path)


def test_the_plot_is_written(tmp_path):
    cc = _module()
    pts = [{"step": s, "train_s": 60.0 * s, "tau_code": 1.5, "tau_chat": 1.4} for s in (0, 1)]
    cc.plot({"curves": {"a": pts}, "title": "t"}, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_references_are_drawn_beside_the_curves(tmp_path):
    cc = _module()
    pts = [{"step": s, "train_s": 60.0 * s, "tau_code": 1.5, "tau_chat": 1.4} for s in (0, 1)]
    cc.plot({"curves": {"a": pts}, "references": {"shipped": {"tau_code": 1.6, "tau_chat": 1.55}}, "x": "steps"},
            tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000
