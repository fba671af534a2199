"""CPU tests for the worked custom-estimator example (examples/my_estimator.py, DAPO clip-higher):
it registers by being imported as a plugin, is selectable by name, and gives hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr.experiments.plugins import import_plugin
from rlvr.experiments.plugins import main as plugins_main
from rlvr.grpo import REWEIGHTINGS, compute_policy_gradient_loss

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_estimator.py"


@pytest.fixture(scope="module")
def clip_higher_module():
    return import_plugin(str(EXAMPLE))


def _ratios_to_logps(ratios):
    """Current log-probs and zero old log-probs such that exp(logp - old) equals ``ratios``."""
    logp = torch.log(torch.tensor(ratios, dtype=torch.float64)).requires_grad_(True)
    return logp, torch.zeros_like(logp)


def test_registered_by_importing_the_plugin(clip_higher_module):
    assert "clip_higher" in REWEIGHTINGS
    assert REWEIGHTINGS["clip_higher"].needs_old_log_probs and REWEIGHTINGS["clip_higher"].needs_cliprange
    assert import_plugin(str(EXAMPLE)) is clip_higher_module  # a second import does not re-register


def test_hand_values(clip_higher_module):
    # eps_low = 0.2 (cliprange), eps_high = 0.28: the ratio is clipped to [0.8, 1.28].
    logp, old = _ratios_to_logps([[1.0, 1.25, 1.3], [0.7, 0.9, 1.5]])
    A = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, meta = compute_policy_gradient_loss(A, logp, "clip_higher", old_log_probs=old, cliprange=0.2)
    # A=+1: -min(w, clip(w)) = -[1.0, 1.25, 1.28]
    # A=-1: -min(-w, -clip(w)) = [max(0.7, 0.8), 0.9, max(1.5, 1.28)] = [0.8, 0.9, 1.5]
    expected = torch.tensor([[-1.0, -1.25, -1.28], [0.8, 0.9, 1.5]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected)
    # clipped branch taken at (0, 2) and (1, 0): 2 of 6 tokens
    assert float(meta["clip_fraction"]) == pytest.approx(2 / 6)
    # with a mask that drops token (1, 2): 2 of 5
    mask = torch.tensor([[True, True, True], [True, True, False]])
    _, meta = compute_policy_gradient_loss(A, logp, "clip_higher", old_log_probs=old, cliprange=0.2, response_mask=mask)
    assert float(meta["clip_fraction"]) == pytest.approx(2 / 5)
    assert float(meta["clip_count"]) == 2 and float(meta["clip_total"]) == 5


def test_gradient_differs_from_symmetric_clip_only_above_1_plus_eps(clip_higher_module):
    # d(-A w)/d logp = -A w on unclipped tokens, 0 where the clip is active.
    ratios = [[1.1, 1.25, 1.3]]
    A = torch.tensor([1.0], dtype=torch.float64)
    grads = {}
    for method in ("clip_higher", "grpo"):
        logp, old = _ratios_to_logps(ratios)
        loss, _ = compute_policy_gradient_loss(A, logp, method, old_log_probs=old, cliprange=0.2)
        loss.sum().backward()
        grads[method] = logp.grad
    torch.testing.assert_close(grads["clip_higher"], torch.tensor([[-1.1, -1.25, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(grads["grpo"], torch.tensor([[-1.1, 0.0, 0.0]], dtype=torch.float64))


def test_equals_grpo_inside_the_symmetric_range(clip_higher_module):
    torch.manual_seed(0)
    logp = torch.log(torch.empty(4, 5).uniform_(0.81, 1.19)).double()
    old = torch.zeros_like(logp)
    A = torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    a, _ = compute_policy_gradient_loss(A, logp, "clip_higher", old_log_probs=old, cliprange=0.2)
    b, _ = compute_policy_gradient_loss(A, logp, "grpo", old_log_probs=old, cliprange=0.2)
    torch.testing.assert_close(a, b)
    assert (a[3] == 0).all()  # zero advantage -> zero loss (the train step skips such sequences)


def test_missing_arguments_are_named(clip_higher_module):
    logp, old = _ratios_to_logps([[1.0]])
    with pytest.raises(ValueError, match="cliprange"):
        compute_policy_gradient_loss(torch.ones(1), logp, "clip_higher", old_log_probs=old)
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_policy_gradient_loss(torch.ones(1), logp, "clip_higher", cliprange=0.2)


def test_selectable_in_the_train_step(clip_higher_module, tiny_model):
    """Through the whole policy-gradient update on a real (tiny) model: it trains and reports a clip fraction."""
    from rlvr.grpo import policy_gradient_update

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
        input_ids,
        labels,
        mask,
        torch.tensor([1.0, -1.0, 0.5, -0.5]),
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        importance_reweighting_method="clip_higher",
        old_log_probs=old,
        cliprange=0.2,
    )
    assert 0.0 <= meta["clip_fraction"] <= 1.0 and math.isfinite(float(loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))


def test_plugin_launcher_imports_before_running(tmp_path, monkeypatch):
    """``python -m rlvr.experiments.plugins --plugin FILE -- CMD`` imports FILE, then runs CMD."""
    import rlvr.cli

    probe = tmp_path / "probe_cmd.py"
    probe.write_text(
        "from rlvr.grpo import REWEIGHTINGS\n"
        "def main(argv):\n    import builtins\n    builtins._probe = ('clip_higher' in REWEIGHTINGS, argv)\n    return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(rlvr.cli.COMMANDS, "probe", ("probe_cmd", "test"))
    assert plugins_main(["--plugin", str(EXAMPLE), "--", "probe", "--x", "1"]) == 0
    import builtins

    assert builtins._probe == (True, ["--x", "1"])
    del builtins._probe
