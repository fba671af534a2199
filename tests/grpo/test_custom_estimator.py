"""CPU tests for the worked custom-estimator example (examples/my_estimator.py, dual-clip PPO): it
registers by being imported as a plugin, is selectable by name, and gives hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr.experiments.plugins import import_plugin
from rlvr.experiments.plugins import main as plugins_main
from rlvr.grpo import REWEIGHTINGS, compute_policy_gradient_loss

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_estimator.py"


@pytest.fixture(scope="module")
def dual_clip_module():
    return import_plugin(str(EXAMPLE))


def _ratios_to_logps(ratios):
    """Current log-probs and zero old log-probs such that exp(logp - old) equals ``ratios``."""
    logp = torch.log(torch.tensor(ratios, dtype=torch.float64)).requires_grad_(True)
    return logp, torch.zeros_like(logp)


def test_registered_by_importing_the_plugin(dual_clip_module):
    assert "dual_clip" in REWEIGHTINGS
    assert REWEIGHTINGS["dual_clip"].needs_old_log_probs and REWEIGHTINGS["dual_clip"].needs_cliprange
    assert import_plugin(str(EXAMPLE)) is dual_clip_module  # a second import does not re-register


def test_hand_values(dual_clip_module):
    # eps = 0.2 (cliprange), c = 3: PPO's clip to [0.8, 1.2], then a cap of -A c = 3 where A < 0.
    assert dual_clip_module.RATIO_CAP == 3.0
    logp, old = _ratios_to_logps([[1.0, 1.3, 4.0], [0.7, 1.5, 4.0]])
    A = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, meta = compute_policy_gradient_loss(A, logp, "dual_clip", old_log_probs=old, cliprange=0.2)
    # A=+1: -min(w, clip(w)) = -[1.0, 1.2, 1.2] (the second clip never applies to A > 0)
    # A=-1: max(w, clip(w)) = [0.8, 1.5, 4.0], then min(., 3) = [0.8, 1.5, 3.0]
    expected = torch.tensor([[-1.0, -1.2, -1.2], [0.8, 1.5, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected)
    # a clip replaced the unclipped loss at (0, 1), (0, 2), (1, 0) and (1, 2): 4 of 6 tokens
    assert float(meta["clip_fraction"]) == pytest.approx(4 / 6)
    # with a mask that drops token (1, 2): 3 of 5
    mask = torch.tensor([[True, True, True], [True, True, False]])
    _, meta = compute_policy_gradient_loss(A, logp, "dual_clip", old_log_probs=old, cliprange=0.2, response_mask=mask)
    assert float(meta["clip_fraction"]) == pytest.approx(3 / 5)
    assert float(meta["clip_count"]) == 3 and float(meta["clip_total"]) == 5


def test_gradient_differs_from_ppo_clip_only_past_the_cap(dual_clip_module):
    # A = -1: d(w)/d logp = w on unclipped tokens, 0 where a clip is active.
    ratios = [[0.7, 1.5, 4.0]]
    A = torch.tensor([-1.0], dtype=torch.float64)
    grads = {}
    for method in ("dual_clip", "ppo_clip"):
        logp, old = _ratios_to_logps(ratios)
        loss, _ = compute_policy_gradient_loss(A, logp, method, old_log_probs=old, cliprange=0.2)
        loss.sum().backward()
        grads[method] = logp.grad
    torch.testing.assert_close(grads["dual_clip"], torch.tensor([[0.0, 1.5, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(grads["ppo_clip"], torch.tensor([[0.0, 1.5, 4.0]], dtype=torch.float64))


def test_equals_ppo_clip_below_the_cap(dual_clip_module):
    torch.manual_seed(0)
    logp = torch.log(torch.empty(4, 5).uniform_(0.5, 2.9)).double()
    old = torch.zeros_like(logp)
    A = torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    a, _ = compute_policy_gradient_loss(A, logp, "dual_clip", old_log_probs=old, cliprange=0.2)
    b, _ = compute_policy_gradient_loss(A, logp, "ppo_clip", old_log_probs=old, cliprange=0.2)
    torch.testing.assert_close(a, b)
    assert (a[3] == 0).all()  # zero advantage -> zero loss (the train step skips such sequences)


def test_missing_arguments_are_named(dual_clip_module):
    logp, old = _ratios_to_logps([[1.0]])
    with pytest.raises(ValueError, match="cliprange"):
        compute_policy_gradient_loss(torch.ones(1), logp, "dual_clip", old_log_probs=old)
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_policy_gradient_loss(torch.ones(1), logp, "dual_clip", cliprange=0.2)


def test_selectable_in_the_train_step(dual_clip_module, tiny_model):
    """Through the whole policy-gradient update on a real (tiny) model: it trains and reports a clip fraction."""
    from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

    torch.manual_seed(0)
    B, T = 4, 6
    input_ids = torch.randint(0, 100, (B, T))
    labels = torch.randint(0, 100, (B, T))
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 2:] = True
    old = torch.full((B, T), -math.log(100.0))  # far from the model's log-probs: many ratios clip
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    loss, meta = policy_gradient_update(
        tiny_model,
        opt,
        StepBatch(input_ids, labels, mask, torch.tensor([1.0, -1.0, 0.5, -0.5]), old),
        UpdateSpec(2, 1.0, reweighting="dual_clip", cliprange=0.2),
    )
    assert 0.0 <= meta["clip_fraction"] <= 1.0 and math.isfinite(float(loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))


def test_plugin_launcher_imports_before_running(tmp_path, monkeypatch):
    """``python -m rlvr.experiments.plugins --plugin FILE -- CMD`` imports FILE, then runs CMD."""
    import rlvr.cli

    probe = tmp_path / "probe_cmd.py"
    probe.write_text(
        "from rlvr.grpo import REWEIGHTINGS\n"
        "def main(argv):\n    import builtins\n    builtins._probe = ('dual_clip' in REWEIGHTINGS, argv)\n    return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(rlvr.cli.COMMANDS, "probe", ("probe_cmd", "test"))
    assert plugins_main(["--plugin", str(EXAMPLE), "--", "probe", "--x", "1"]) == 0
    import builtins

    assert builtins._probe == (True, ["--x", "1"])
    del builtins._probe
