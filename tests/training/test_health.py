"""The health signals on synthetic metric streams: each fires when its condition starts, names the
setting to change, stays quiet while the condition holds and fires again once it has cleared."""

from __future__ import annotations

import pytest

from rlvr.config import HealthConfig
from rlvr.training.health import SIGNALS, HealthMonitor, summarize


def healthy(step: int, **over: object) -> dict:
    """One step's metrics of a run that is doing fine."""
    m = {
        "step": step,
        "train/reward": 0.4,
        "train/entropy": 0.5,
        "train/response_length": 40.0,
        "train/truncated_frac": 0.05,
        "train/zero_adv_frac": 0.5,
        "train/grad_norm": 1.0,
        "train/grad_norm_max": 1.2,
        "train/loss": 0.01,
        "train/skipped_nonfinite": 0,
    }
    m.update(over)
    return m


def stream(monitor: HealthMonitor, rows: list[dict]) -> list[tuple[int, str]]:
    return [(w.step, w.signal) for row in rows for w in monitor.observe(row)]


def test_a_healthy_stream_raises_nothing() -> None:
    rows = [healthy(s, **({"val/reward": 0.2 + 0.01 * s} if s % 5 == 0 else {})) for s in range(1, 41)]
    assert stream(HealthMonitor(HealthConfig()), rows) == []


def test_validation_drop_fires_once_below_the_best_and_again_after_recovering() -> None:
    mon = HealthMonitor(HealthConfig(val_drop=0.1))
    rows = [
        {"step": 0, "val/reward": 0.2},
        healthy(10, **{"val/reward": 0.55}),
        healthy(20, **{"val/reward": 0.46}),  # 0.09 below: under the threshold
        healthy(30, **{"val/reward": 0.40}),  # 0.15 below: fires
        healthy(31),  # no validation: still in that state, quiet
        healthy(40, **{"val/reward": 0.30}),  # still below: quiet
        healthy(50, **{"val/reward": 0.60}),  # new best: clears
        healthy(60, **{"val/reward": 0.45}),  # fires again
    ]
    assert stream(mon, rows) == [(30, "val_drop"), (60, "val_drop")]
    assert (mon.best_val, mon.best_val_step) == (0.60, 50)


def test_validation_drop_message_names_the_best_step_and_the_learning_rate() -> None:
    mon = HealthMonitor(HealthConfig())
    mon.observe({"step": 20, "val/reward": 0.551})
    (w,) = mon.observe(healthy(50, **{"val/reward": 0.364}))
    assert "0.364 is 0.187 below its best, 0.551 at step 20" in w.message
    assert "optim.lr" in w.message and "checkpoints/best" in w.message
    assert w.line().startswith("rlvr: health warning at step 50 [val_drop]: ")


def test_ties_move_the_best_to_the_later_step() -> None:
    mon = HealthMonitor(HealthConfig())
    mon.observe({"step": 10, "val/reward": 0.5})
    mon.observe({"step": 20, "val/reward": 0.5})
    assert mon.best_val_step == 20


def test_entropy_collapse_is_judged_on_the_mean_of_recent_steps() -> None:
    mon = HealthMonitor(HealthConfig(entropy_min=0.01, patience=3))
    entropies = [0.6, 0.004, 0.004, 0.3, 0.004, 0.004, 0.004, 0.004]
    rows = [healthy(s, **{"train/entropy": e}) for s, e in enumerate(entropies, 1)]
    warnings = [w for r in rows for w in mon.observe(r)]
    # Means of three from step 3: 0.203, 0.103, 0.103, 0.103, 0.004 (step 7: fires), 0.004 (quiet: it holds).
    assert [(w.step, w.signal) for w in warnings] == [(7, "entropy")]
    assert "0.004 nats over the last 3 steps" in warnings[0].message and "started at 0.6" in warnings[0].message
    # A step that trains on nothing (every group all-equal) measures no entropy and changes nothing.
    assert mon.observe(healthy(9, **{"train/entropy": None})) == [] and mon.active == ["entropy"]


def test_healthy_low_entropy_of_a_sharpened_policy_is_not_a_collapse() -> None:
    # The GPU study's warm start sits near 0.02 nats and its learning runs end at 0.003 to 0.03.
    mon = HealthMonitor(HealthConfig())
    rows = [healthy(s, **{"train/entropy": 0.02 - 0.0003 * s}) for s in range(1, 51)]
    assert stream(mon, rows) == []


def test_response_length_collapse_and_cap() -> None:
    mon = HealthMonitor(HealthConfig(length_collapse=0.3, truncated_max=0.5))
    rows = [
        healthy(1, **{"train/response_length": 50.0}),
        healthy(2, **{"train/response_length": 16.0}),  # 0.32 x the first: not yet
        healthy(3, **{"train/response_length": 14.0}),  # 0.28 x: fires
        healthy(4, **{"train/truncated_frac": 0.6, "train/response_length": 64.0}),  # at the cap
    ]
    assert stream(mon, rows) == [(3, "length_collapse"), (4, "length_cap")]


def test_no_signal_needs_patience_and_says_which_way_the_task_is_off() -> None:
    mon = HealthMonitor(HealthConfig(no_signal_max=0.9, patience=3))
    solved = [healthy(s, **{"train/zero_adv_frac": 0.95, "train/reward": 0.97}) for s in (1, 2, 3)]
    warnings = [w for r in solved for w in mon.observe(r)]
    assert [(w.step, w.signal) for w in warnings] == [(3, "no_signal")]
    assert "solved" in warnings[0].message and "rollout.group_size" in warnings[0].message
    mon = HealthMonitor(HealthConfig(no_signal_max=0.9, patience=3))
    hopeless = [healthy(s, **{"train/zero_adv_frac": 1.0, "train/reward": 0.0}) for s in (1, 2, 3)]
    (w,) = [w for r in hopeless for w in mon.observe(r)]
    assert "almost every answer is wrong" in w.message
    # An interruption of the streak starts the count again.
    mon = HealthMonitor(HealthConfig(no_signal_max=0.9, patience=3))
    rows = [healthy(s, **{"train/zero_adv_frac": z}) for s, z in enumerate([0.95, 0.95, 0.5, 0.95, 0.95], 1)]
    assert stream(mon, rows) == []


def test_off_policy_clip_and_ratio_drift_read_the_update_records() -> None:
    mon = HealthMonitor(HealthConfig(clip_fraction_max=0.2, ratio_kl_max=0.1))
    calm = healthy(1, updates=[{"token_clip_frac": 0.01, "kl_k3": 0.001}, {"token_clip_frac": 0.02, "kl_k3": 0.004}])
    # kl_k3 (0.08 + 0.14) / 2 = 0.11 >= 0.1; one update clipped 25 % of its tokens.
    clipped = healthy(2, updates=[{"token_clip_frac": 0.05, "kl_k3": 0.08}, {"token_clip_frac": 0.25, "kl_k3": 0.14}])
    assert stream(mon, [calm, clipped]) == [(2, "clip"), (2, "ratio_drift")]
    (drift,) = HealthMonitor(HealthConfig(ratio_kl_max=0.1)).observe(healthy(1, updates=[{"kl_k3": 0.11}]))
    assert "by KL 0.11 (k3, the mean over this step's 1 update;" in drift.message


def test_ratio_drift_is_the_mean_over_the_steps_updates_not_its_largest() -> None:
    # In off-policy runs that learned, single updates' KL went several times past the threshold while
    # each step's mean stayed below it: one small batch's KL is no sign of drift.
    mon = HealthMonitor(HealthConfig(ratio_kl_max=0.1))
    one_wild = [{"kl_k3": 0.6}] + [{"kl_k3": 0.01}] * 31  # mean (0.6 + 0.31) / 32 = 0.0284
    assert stream(mon, [healthy(s, updates=one_wild) for s in range(1, 5)]) == []
    drifting = [{"kl_k3": 0.1 + 0.01 * i} for i in range(4)]  # mean 0.115
    assert stream(mon, [healthy(5, updates=drifting)]) == [(5, "ratio_drift")]


def test_gradient_spike_against_the_recent_median() -> None:
    mon = HealthMonitor(HealthConfig(grad_spike=10.0))
    rows = [healthy(s, **{"train/grad_norm": 1.0, "train/grad_norm_max": 1.0}) for s in range(1, 6)]
    rows.append(healthy(6, **{"train/grad_norm": 3.0, "train/grad_norm_max": 9.9}))  # 9.9 x the median: quiet
    rows.append(healthy(7, **{"train/grad_norm": 4.0, "train/grad_norm_max": 12.0}))  # 12 x: fires
    assert stream(mon, rows) == [(7, "grad_spike")]
    # Too little history: no spike can be measured yet.
    mon = HealthMonitor(HealthConfig(grad_spike=10.0))
    assert stream(mon, [healthy(1), healthy(2, **{"train/grad_norm_max": 100.0})]) == []


def test_gradient_spike_compares_a_steps_largest_norm_with_recent_largest_norms() -> None:
    # Many updates a step: the largest norm sits far above the mean every step. That is the step's
    # shape, not a spike; only a largest norm far above the recent largest ones is.
    mon = HealthMonitor(HealthConfig(grad_spike=10.0))
    rows = [healthy(s, **{"train/grad_norm": 0.2, "train/grad_norm_max": 3.0}) for s in range(1, 11)]
    assert stream(mon, rows) == []
    assert mon.observe(healthy(11, **{"train/grad_norm": 0.3, "train/grad_norm_max": 29.0})) == []  # 9.7 x 3.0
    (spike,) = mon.observe(healthy(12, **{"train/grad_norm": 0.4, "train/grad_norm_max": 30.0}))  # 10 x: fires
    assert spike.signal == "grad_spike" and "30 is 10 x the recent steps' median 3:" in spike.message


def test_skipped_nonfinite_steps_warn_when_the_count_grows() -> None:
    mon = HealthMonitor(HealthConfig())
    rows = [healthy(1), healthy(2, **{"train/skipped_nonfinite": 1}), healthy(3, **{"train/skipped_nonfinite": 1})]
    rows.append(healthy(4, **{"train/skipped_nonfinite": 3}))
    warnings = [w for r in rows for w in mon.observe(r)]
    assert [(w.step, w.signal) for w in warnings] == [(2, "nonfinite"), (4, "nonfinite")]
    assert warnings[1].message.startswith("2 optimizer step(s)")


def test_disabled_monitor_and_state_round_trip() -> None:
    assert HealthMonitor(HealthConfig(enabled=False)).observe(healthy(1, **{"train/entropy": 0.0})) == []
    rows = [healthy(s, **{"val/reward": v}) for s, v in [(10, 0.5), (20, 0.3), (30, 0.5), (40, 0.2)]]
    whole = HealthMonitor(HealthConfig())
    expected = stream(whole, rows)
    first = HealthMonitor(HealthConfig())
    got = stream(first, rows[:2])
    resumed = HealthMonitor.from_state(HealthConfig(), first.state_dict())
    assert got + stream(resumed, rows[2:]) == expected == [(20, "val_drop"), (40, "val_drop")]


@pytest.mark.parametrize("signal", SIGNALS)
def test_every_signal_has_a_threshold_or_rule_documented(signal: str) -> None:
    import rlvr.training.health

    assert f"``{signal}``" in (rlvr.training.health.__doc__ or "")


def test_summarize_counts_by_signal() -> None:
    records = [
        {"signal": "val_drop", "step": 30, "message": "a"},
        {"signal": "entropy", "step": 31, "message": "b"},
        {"signal": "val_drop", "step": 60, "message": "c"},
    ]
    assert summarize(records) == {
        "val_drop": {"count": 2, "first_step": 30, "message": "a"},
        "entropy": {"count": 1, "first_step": 31, "message": "b"},
    }
