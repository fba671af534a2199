"""CPU tests for run loading, aggregation across seeds (hand-computed), and the PNGs of ``rlvr plot``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlvr.experiments import aggregate, final_values, load_runs
from rlvr.experiments.plot import main as plot_main
from rlvr.experiments.plot import metric_filename, plot_final_vs_lr, plot_runs
from rlvr.experiments.runs import t95
from rlvr.training.metrics_log import read_metrics


def write_run(
    run_dir: Path,
    rows: list[dict],
    config: dict | None = None,
    finished: bool = True,
    rollouts: dict[int, list[dict]] | None = None,
) -> Path:
    """A synthetic run directory in the trainer's layout."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config or {}))
    with (run_dir / "metrics.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for step, dump in (rollouts or {}).items():
        (run_dir / "rollouts").mkdir(exist_ok=True)
        with (run_dir / "rollouts" / f"step_{step}.jsonl").open("w") as f:
            for r in dump:
                f.write(json.dumps(r) + "\n")
    if finished:
        (run_dir / "summary.json").write_text(json.dumps({"status": "finished"}))
    return run_dir


def hand_sweep(root: Path) -> Path:
    """Two settings; setting ``a`` has seeds with train/reward [0,1,2], [2,3,4], [1,2,6] at steps 0..2."""
    a_series = {0: [0.0, 1.0, 2.0], 1: [2.0, 3.0, 4.0], 2: [1.0, 2.0, 6.0]}
    for seed, vals in a_series.items():
        rows = [{"step": s, "train/reward": v, "train/loss": -v} for s, v in enumerate(vals)]
        rows[-1]["val/reward"] = [0.5, 0.7, 0.6][seed]
        rows[0]["val/reward"] = 0.1
        write_run(root / "a" / f"seed_{seed}", rows, {"seed": seed, "optim": {"lr": 1e-5}, "algorithm": "grpo"})
    for seed in (0, 1):
        rows = [{"step": s, "train/reward": 10.0 + seed, "train/clip_fraction": 0.1 * (s + 1)} for s in range(3)]
        rows[-1]["val/reward"] = 0.2 + 0.1 * seed
        write_run(root / "b" / f"seed_{seed}", rows, {"seed": seed, "optim": {"lr": 3e-5}, "algorithm": "grpo"})
    return root


def test_load_runs_groups_by_layout_and_reads_seed(tmp_path):
    runs = load_runs(hand_sweep(tmp_path / "sweep"))
    assert [(r.setting, r.seed) for r in runs] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert all(r.finished for r in runs)
    with pytest.raises(FileNotFoundError):
        load_runs(tmp_path / "nothing_here")


def test_aggregate_minmax_hand_values(tmp_path):
    runs = [r for r in load_runs(hand_sweep(tmp_path / "sweep")) if r.setting == "a"]
    agg = aggregate(runs, "train/reward")
    assert agg.steps.tolist() == [0, 1, 2]
    np.testing.assert_allclose(agg.mean, [1.0, 2.0, 4.0])
    np.testing.assert_allclose(agg.lo, [0.0, 1.0, 2.0])
    np.testing.assert_allclose(agg.hi, [2.0, 3.0, 6.0])
    assert agg.n.tolist() == [3, 3, 3]


def test_aggregate_ci95_hand_values(tmp_path):
    runs = [r for r in load_runs(hand_sweep(tmp_path / "sweep")) if r.setting == "a"]
    agg = aggregate(runs, "train/reward", band="ci95")
    # step 2: values 2, 4, 6 -> mean 4, sample sd 2, half-width t(2) * 2 / sqrt(3) with t(2) = 4.303
    half = 4.303 * 2.0 / math.sqrt(3.0)
    assert agg.mean[2] == pytest.approx(4.0)
    assert agg.lo[2] == pytest.approx(4.0 - half)
    assert agg.hi[2] == pytest.approx(4.0 + half)
    # step 0: values 0, 2, 1 -> sd 1
    assert agg.hi[0] - agg.mean[0] == pytest.approx(4.303 / math.sqrt(3.0))
    assert t95(1) == pytest.approx(12.706) and t95(1000) == pytest.approx(1.962, abs=2e-3)


def test_aggregate_unequal_lengths_and_sparse_eval(tmp_path):
    write_run(tmp_path / "s" / "seed_0", [{"step": 0, "x": 1.0}, {"step": 1, "x": 3.0}, {"step": 2, "x": 5.0}])
    write_run(tmp_path / "s" / "seed_1", [{"step": 0, "x": 3.0}], finished=False)
    runs = load_runs(tmp_path / "s")
    agg = aggregate(runs, "x")
    assert agg.n.tolist() == [2, 1, 1]
    np.testing.assert_allclose(agg.mean, [2.0, 3.0, 5.0])
    np.testing.assert_allclose(agg.lo, [1.0, 3.0, 5.0])
    ci = aggregate(runs, "x", band="ci95")
    assert ci.lo[1] == ci.hi[1] == 3.0  # one run: the interval collapses onto the mean


def test_read_metrics_drops_partial_line_and_keeps_last_duplicate(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x": 2}\n{"step": 1, "x": 7}\n{"step": 2, "x"')
    rows = read_metrics(path, one_row_per_step=True)
    assert [(r["step"], r["x"]) for r in rows] == [(0, 1), (1, 7)]


def test_final_values_best_worst(tmp_path):
    finals = final_values(load_runs(hand_sweep(tmp_path / "sweep")))
    a = finals["a"]
    assert a.values == {"seed_0": 0.5, "seed_1": 0.7, "seed_2": 0.6}
    assert a.mean == pytest.approx(0.6) and a.min == 0.5 and a.max == 0.7 and a.n == 3
    assert a.std == pytest.approx(0.1)
    assert a.best == ("seed_1", 0.7) and a.worst == ("seed_0", 0.5)
    assert finals["b"].mean == pytest.approx(0.25)


def _png_ok(path: Path, min_bytes: int = 15_000) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > min_bytes


def test_plot_runs_writes_pngs(tmp_path):
    runs = load_runs(hand_sweep(tmp_path / "sweep"))
    written = plot_runs(runs, tmp_path / "plots")
    assert {"overview", "train/reward", "train/loss", "val/reward", "train/clip_fraction", "final_vs_lr"} <= set(
        written
    )
    assert written["train/clip_fraction"].name == "train_clip_fraction.png"
    for path in written.values():
        assert _png_ok(path), path
    assert metric_filename("train/pass@1") == "train_pass@1.png"


def test_lr_plot_only_when_lr_varies(tmp_path):
    runs = [r for r in load_runs(hand_sweep(tmp_path / "sweep")) if r.setting == "a"]
    assert plot_final_vs_lr(runs, tmp_path / "lr.png") is None


def test_plot_cli_selected_metrics_and_band(tmp_path, capsys):
    root = hand_sweep(tmp_path / "sweep")
    rc = plot_main(
        [str(root / "a"), str(root / "b"), "--out", str(tmp_path / "p"), "--metrics", "train/reward", "--band", "ci95"]
    )
    assert rc == 0
    assert _png_ok(tmp_path / "p" / "train_reward.png")
    assert not (tmp_path / "p" / "train_loss.png").exists()
    assert "5 runs in 2 settings" in capsys.readouterr().out
