"""What each estimator does, measured: closed-form difficulty weights against binned synthetic rollouts
with known pass rates, the gradient variance of a case worked by hand, importance-ratio statistics by
hand, and the trainer and ``rlvr report`` producing all of it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from rlvr import compute_group_normalized_rewards
from rlvr.experiments import load_runs
from rlvr.experiments.estimators import formula_text, max_relative_deviation, run_estimator, weighting_by_setting
from rlvr.experiments.report import main as report_main
from rlvr.grpo.diagnostics import advantage_mass, importance_statistics, predicted_group_weight
from rlvr.grpo.variance import gradient_variance, variance_metrics

EPS = 1e-6
PAIRS = [("mean", "none"), ("mean", "std"), ("mean", "mean"), ("none", "none"), ("loo", "none")]


# --- closed forms -------------------------------------------------------------------------------------


@pytest.mark.parametrize("baseline,normalizer", PAIRS)
@pytest.mark.parametrize("group_size", [4, 8])
def test_closed_form_mass_equals_the_advantages(baseline, normalizer, group_size):
    for k in range(group_size + 1):
        rewards = torch.tensor([1.0] * k + [0.0] * (group_size - k))
        adv, _ = compute_group_normalized_rewards(rewards, group_size, baseline, EPS, normalizer)
        on_correct = adv[:k].abs().sum().item()
        on_incorrect = adv[k:].abs().sum().item()
        want = advantage_mass(baseline, normalizer, group_size, k, EPS)
        assert on_correct == pytest.approx(want[0], rel=1e-5, abs=1e-6), (k, on_correct, want)
        assert on_incorrect == pytest.approx(want[1], rel=1e-5, abs=1e-6), (k, on_incorrect, want)


def test_closed_form_by_hand():
    # G = 4, one success (p = 1/4): advantages 0.75, -0.25 x 3 before normalising; unbiased std 0.5.
    assert advantage_mass("mean", "none", 4, 1) == (0.75, 0.75)
    assert advantage_mass("mean", "std", 4, 1) == pytest.approx((1.5, 1.5))
    assert advantage_mass("mean", "mean", 4, 1) == pytest.approx((3.0, 3.0))  # MaxRL: [3, -1, -1, -1]
    assert advantage_mass("none", "none", 4, 1) == (1.0, 0.0)
    assert advantage_mass("loo", "none", 4, 1) == pytest.approx((1.0, 1.0))  # RLOO: [1, -1/3, -1/3, -1/3]
    # the summed shapes: 2 G p (1 - p), 2 sqrt(G (G - 1) p (1 - p)), 2 G (1 - p), G p
    p = 0.25
    assert sum(advantage_mass("mean", "std", 4, 1)) == pytest.approx(2 * math.sqrt(12 * p * (1 - p)))
    assert sum(advantage_mass("mean", "mean", 4, 1)) == pytest.approx(2 * 4 * (1 - p))
    # solved and unsolved groups carry no weight under a mean baseline; RFT weighs a solved group fully
    assert advantage_mass("mean", "std", 4, 0) == advantage_mass("mean", "mean", 4, 4) == (0.0, 0.0)
    assert advantage_mass("none", "none", 4, 4) == (4.0, 0.0)
    with pytest.raises(ValueError, match="no closed-form advantage mass"):
        advantage_mass("mean", "median", 4, 1)
    # aggregation: sequence divides by B; constant weighs each side by its mean length over C
    assert predicted_group_weight("mean", "none", 4, 1, "sequence", 16) == pytest.approx(1.5 / 16)
    assert predicted_group_weight(
        "mean", "none", 4, 1, "constant", 16, 512.0, correct_length=10, incorrect_length=20
    ) == pytest.approx((0.75 * 10 + 0.75 * 20) / 512)


# --- binned weights from synthetic rollouts with known pass rates --------------------------------------

G, B, C = 4, 16, 512.0
LEN_CORRECT, LEN_INCORRECT = 10, 20
SETTINGS = {  # name: (baseline, normalizer, loss normalization)
    "grpo": ("mean", "std", "sequence"),
    "dr_grpo": ("mean", "none", "constant"),
    "maxrl": ("mean", "mean", "constant"),
    "rft": ("none", "none", "constant"),
}


def _config(baseline, normalizer, loss_norm) -> dict:
    return {
        "seed": 0,
        "rollout": {"group_size": G, "n_prompts_per_rollout_batch": B // G},
        "optim": {"train_batch_size": B},
        "algorithm": {
            "baseline": baseline,
            "advantage_normalizer": normalizer,
            "loss_normalization": loss_norm,
            "normalization_constant": C if loss_norm == "constant" else None,
            "advantage_eps": EPS,
            "reweighting": "none",
        },
    }


def _synthetic_dump(step: int, successes: list[int], baseline: str, normalizer: str) -> list[dict]:
    """Groups with the given numbers of successes; correct responses have 10 trained tokens, wrong 20."""
    rewards = torch.tensor([float(i < k) for k in successes for i in range(G)])
    adv, _ = compute_group_normalized_rewards(rewards, G, baseline, EPS, normalizer)
    return [
        {
            "step": step,
            "group": i // G,
            "reward": float(r),
            "advantage": float(a),
            "n_train_tokens": LEN_CORRECT if r == 1 else LEN_INCORRECT,
            "n_tokens": 99,
        }
        for i, (r, a) in enumerate(zip(rewards.tolist(), adv.tolist()))
    ]


def _synthetic_sweep(root: Path) -> Path:
    from test_plot import write_run

    for name, (baseline, normalizer, loss_norm) in SETTINGS.items():
        for seed in (0, 1):
            dumps = {
                5: _synthetic_dump(5, [0, 1, 2, 3], baseline, normalizer),
                10: _synthetic_dump(10, [4, 1, 2, 1], baseline, normalizer),
            }
            write_run(
                root / name / f"seed_{seed}",
                [{"step": 5, "train/reward": 0.4}, {"step": 10, "train/reward": 0.5}],
                {**_config(baseline, normalizer, loss_norm), "seed": seed},
                rollouts=dumps,
            )
    return root


def test_binned_weights_match_the_formulas_on_synthetic_rollouts(tmp_path):
    bins = weighting_by_setting(load_runs(_synthetic_sweep(tmp_path / "sweep")))
    assert set(bins) == set(SETTINGS)
    # Per seed, pass rates 0, 1/4 (x3), 2/4 (x2), 3/4, 1 over two dumps; two seeds double the counts.
    for b in bins.values():
        assert b.n_groups.tolist() == [2, 6, 4, 2, 2]
        assert b.p.tolist() == [0, 0.25, 0.5, 0.75, 1.0]
        assert b.share.sum() == pytest.approx(1.0)
        assert (b.correct_length, b.incorrect_length) == (LEN_CORRECT, LEN_INCORRECT)
        assert max_relative_deviation(b) < 1e-5
        torch.testing.assert_close(
            torch.tensor(b.mean_weight), torch.tensor(b.closed_form), rtol=1e-5, atol=0, check_dtype=False
        )  # class-constant lengths: the run-length curve is exact too
    # Worked by hand. GRPO, sequence over B = 16: W = 2 sqrt(G (G-1)) sqrt(p (1-p)) / B
    s = 2 * math.sqrt(12)
    want = [0.0, s * math.sqrt(3 / 16) / B, s * 0.5 / B, s * math.sqrt(3 / 16) / B, 0.0]
    assert bins["grpo"].mean_weight.tolist() == pytest.approx(want, rel=1e-5)
    assert want[1] == pytest.approx(0.1875)  # 2 sqrt(12 * 3/16) = 3, / 16
    # Dr. GRPO, constant C = 512: W = G p (1-p) (n+ + n-) / C = 4 p (1-p) 30 / 512
    assert bins["dr_grpo"].mean_weight.tolist() == pytest.approx(
        [0, 0.75 * 30 / C, 1.0 * 30 / C, 0.75 * 30 / C, 0], rel=1e-5
    )
    # MaxRL: W = G (1-p) (n+ + n-) / C for p > 0, 0 for an unsolved group
    assert bins["maxrl"].mean_weight.tolist() == pytest.approx([0, 3 * 30 / C, 2 * 30 / C, 1 * 30 / C, 0], rel=1e-5)
    # RFT: W = G p n+ / C = k 10 / C: the solved group weighs most
    assert bins["rft"].mean_weight.tolist() == pytest.approx([0, 10 / C, 20 / C, 30 / C, 40 / C], rel=1e-6)
    assert bins["rft"].share[-1] == pytest.approx(2 * 40 / (2 * 40 + 6 * 10 + 4 * 20 + 2 * 30))
    assert formula_text(bins["grpo"].est) == "W = 6.928 sqrt(p(1-p)) / B = 0.433 sqrt(p(1-p))  (G=4, B=16)"


def test_rlvr_plot_writes_the_weighting_figures(tmp_path):
    from rlvr.experiments.plot import main as plot_main

    root = _synthetic_sweep(tmp_path / "sweep")
    assert plot_main([str(root), "--out", str(tmp_path / "p"), "--metrics", "train/reward"]) == 0
    figures = json.loads((tmp_path / "p" / "figures.json").read_text())
    assert (
        figures["estimators/weighting"] == "weighting.png"
        and figures["estimators/weighting_shapes"] == "weighting_shapes.png"
    )
    assert (tmp_path / "p" / "estimators" / "weighting.png").stat().st_size > 20_000
    assert "estimators/variance" not in figures  # nothing logged it


def test_weighting_without_closed_form_still_bins(tmp_path):
    from test_plot import write_run

    rows = _synthetic_dump(1, [1, 2, 3, 0], "mean", "none")
    for r in rows[:4]:
        r["reward"] = 0.5  # partial credit: not 0/1
    write_run(
        tmp_path / "r", [{"step": 1, "train/reward": 0.1}], _config("mean", "none", "constant"), rollouts={1: rows}
    )
    b = weighting_by_setting(load_runs(tmp_path / "r"))["r"]
    assert not b.binary and b.closed_form is None and len(b.p) == 10 and b.n_groups.sum() == 4
    assert run_estimator(load_runs(tmp_path / "r")[0]).group_size == G


# --- gradient variance: a case worked by hand -----------------------------------------------------------


class Unigram(torch.nn.Module):
    """p(token) = softmax(theta), whatever the context: the score of token y is e_y - softmax(theta)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(vocab))

    def forward(self, input_ids, use_cache=False, **kwargs):
        return CausalLMOutputWithPast(logits=self.theta.expand(*input_ids.shape, self.theta.numel()))


def _hand_batch():
    # Vocabulary 3, theta = 0: scores s_y = e_y - 1/3, |s_y|^2 = 2/3, s_a.s_b = -1/3, s_0 + s_1 + s_2 = 0.
    # Groups of two samples: tokens (0, 1) rewarded (1, 0); tokens (2, 2) both rewarded; tokens (0, 2)
    # rewarded (0, 1).
    input_ids = torch.zeros(6, 1, dtype=torch.long)
    labels = torch.tensor([[0], [1], [2], [2], [0], [2]])
    mask = torch.ones(6, 1, dtype=torch.bool)
    return input_ids, labels, mask, torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])


def _hand_variance(model, **kwargs):
    """``gradient_variance`` of the hand batch in groups of two, constant normalisation by 1."""
    return gradient_variance(model, *_hand_batch(), 2, "constant", 1.0, **kwargs)


def test_gradient_variance_by_hand():
    """U = (s0, 2 s2, s2), S = (-s2, 2 s2, -s1), mean rewards (1/2, 1, 1/2); J = 3, so ghat_j = 3 g_j.
    no baseline, ghat = (3 s0, 6 s2, 3 s2): squared norms 6 + 24 + 6 = 36, mean s0 + 3 s2 with
      |.|^2 = 14/3, trace (36 - 3 * 14/3) / 2 = 11.
    mean baseline, g = U - mean(r) S = (s0 + s2/2, 0, s2 + s1/2): |g_1|^2 = |g_3|^2 = 1/2, mean
      (s2 - s1)/2 with |.|^2 = 1/2, trace (9 - 3/2) / 2 = 3.75; leave-one-out is twice it: trace 15.
    projections on the other groups' leave-one-out mean: g_loo = (2 s0 + s2, 0, s1 + 2 s2), so the
      directions are (s1 + 2 s2, s0 + 2 s2, 2 s0 + s2) / sqrt(2); no baseline projects to
      (-3, 6, 0) / sqrt(2): variance ((-4)^2 + 5^2 + 1) / 2 / 2 = 10.5; leave-one-out to (-3, 0, -3) / sqrt(2):
      1.5; mean baseline 1.5 / 4.
    GRPO's std normaliser: groups 1 and 3 divided by 1/sqrt(2), group 2 has no signal: 2 x mean baseline.
    baseline term = no baseline - leave-one-out: ghat = 3 (s1, 2 s2, s0), squared norms 36, mean s2
      (|.|^2 = 2/3), trace (36 - 2) / 2 = 17: bias ratio 3 (2/3) / 17 = 2/17.
    Each group's rows are run once per reward value: the sums are exact."""
    model = Unigram(3)
    input_ids, labels, mask, rewards = _hand_batch()
    out = _hand_variance(model, baseline="mean", advantage_normalizer="std", advantage_eps=EPS)
    assert out["n_groups"] == 3
    want = {
        "no_baseline": (11.0, 10.5),
        "mean_baseline": (3.75, 0.375),
        "leave_one_out": (15.0, 1.5),
        "run": (7.5, 0.75),
    }
    for name, (trace, projected) in want.items():
        assert out[name]["trace"] == pytest.approx(trace, rel=1e-5), name
        assert out[name]["projected"] == pytest.approx(projected, rel=1e-5), name
    assert out["no_baseline"]["mean_norm"] == pytest.approx(math.sqrt(14 / 3), rel=1e-5)
    assert out["no_baseline"]["mean_projection"] == pytest.approx(1 / math.sqrt(2), rel=1e-5)
    assert out["leave_one_out"]["mean_projection"] == pytest.approx(-2 / math.sqrt(2), rel=1e-5)
    assert out["baseline_bias_ratio"] == pytest.approx(2 / 17, rel=1e-5)
    # |X_class|^2 per sample: correct |s0|^2, |2 s2|^2 / 2, |s2|^2 -> mean 8/9; incorrect |s1|^2, |s0|^2 -> 2/3
    assert out["score_energy_correct"] == pytest.approx(8 / 9, rel=1e-5)
    assert out["score_energy_incorrect"] == pytest.approx(2 / 3, rel=1e-5)
    assert model.theta.grad is None  # measured without touching .grad
    # recomputed, not kept
    again = _hand_variance(model, baseline="mean", advantage_normalizer="std", advantage_eps=EPS, keep_bytes=0)
    assert variance_metrics(again) == pytest.approx(variance_metrics(out))
    # Sequence normalisation over B = 6 rows of one token: every gradient is a sixth, variances 1/36.
    seq = gradient_variance(
        model, input_ids, labels, mask, rewards, 2, "sequence", baseline="none", advantage_normalizer="none"
    )
    assert seq["no_baseline"]["trace"] == pytest.approx(11 / 36, rel=1e-5)
    assert "run" not in seq  # the run's estimator is no_baseline already
    metrics = variance_metrics(out)
    assert metrics["variance/no_baseline/trace"] == out["no_baseline"]["trace"] and metrics["variance/n_groups"] == 3
    with pytest.raises(ValueError, match="two whole groups"):
        gradient_variance(model, input_ids[:2], labels[:2], mask[:2], rewards[:2], 2, "constant", 1.0)


@pytest.mark.parametrize("loss_norm", ["sequence", "constant"])
def test_gradient_variance_equals_the_train_steps_gradients(tiny_model, tiny_tokenizer, loss_norm):
    """On a real transformer with responses of different lengths: each group's estimate is the gradient of
    the train step's own loss (compute_policy_gradient_loss + aggregate_loss_across_microbatch over the
    whole batch) with every other group's advantages set to zero."""
    from rlvr import (
        aggregate_loss_across_microbatch,
        compute_policy_gradient_loss,
        get_response_log_probs,
        tokenize_prompt_and_output,
    )

    prompts = ["Tom has 3 cards.", "Mia eats 2 of 7 apples.", "What is 4 + 4?"]
    responses = [" 7", " seven cards and more", " 5 apples", " five", " 8", " it is 8 or so"]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    batch = tokenize_prompt_and_output([p for p in prompts for _ in range(2)], responses, tiny_tokenizer)
    G, J, C = 2, 3, 40.0
    params = [p for p in tiny_model.parameters()]

    def group_estimate(advantages):
        lp = get_response_log_probs(tiny_model, batch["input_ids"], batch["labels"])["log_probs"]
        per_token, _ = compute_policy_gradient_loss(advantages, lp, "none")
        loss = aggregate_loss_across_microbatch(per_token, batch["response_mask"], loss_norm, C)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return -J * torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])

    def trace(advantage_fn):
        per_group = []
        for j in range(J):
            adv = torch.zeros(G * J)
            r = rewards[j * G : (j + 1) * G]
            adv[j * G : (j + 1) * G] = advantage_fn(r)
            per_group.append(group_estimate(adv).double())
        stacked = torch.stack(per_group)
        return float(((stacked - stacked.mean(0)) ** 2).sum() / (J - 1))

    def measured(**estimator):
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["response_mask"]
        return gradient_variance(tiny_model, ids, labels, mask, rewards, G, loss_norm, C, **estimator)

    out = measured(baseline="mean", advantage_normalizer="mean", advantage_eps=0.0)
    assert out["no_baseline"]["trace"] == pytest.approx(trace(lambda r: r), rel=1e-4)
    assert out["mean_baseline"]["trace"] == pytest.approx(trace(lambda r: r - r.mean()), rel=1e-4)
    assert out["leave_one_out"]["trace"] == pytest.approx(trace(lambda r: (r - r.mean()) * G / (G - 1)), rel=1e-4)
    assert out["run"]["trace"] == pytest.approx(trace(lambda r: (r - r.mean()) / r.mean()), rel=1e-4)  # MaxRL
    rloo = measured(baseline="loo", advantage_normalizer="none")
    assert rloo["run"]["trace"] == pytest.approx(trace(lambda r: r - (r.sum() - r) / (G - 1)), rel=1e-4)


def test_gradient_variance_of_a_per_sample_baseline_by_hand(monkeypatch):
    """RLOO's baseline differs between the samples of a group: b_i = (sum r - r_i) / (G - 1), so
    r_i - b_i = G / (G - 1) (r_i - mean r), the leave-one-out estimator itself (trace 15, projected 1.5 in
    test_gradient_variance_by_hand). Under the std normaliser groups 1 and 3 (std 1/sqrt(2)) are scaled by
    sqrt(2) and group 2 has no signal: twice both figures. A weight that tells two samples of one reward
    apart is not a sum over reward classes: that run has no `run` estimator and the rest still come."""
    from rlvr.grpo.advantages import BASELINES

    model = Unigram(3)
    for normalizer, (trace, projected) in {"none": (15.0, 1.5), "std": (30.0, 3.0)}.items():
        out = _hand_variance(model, baseline="loo", advantage_normalizer=normalizer, advantage_eps=EPS)
        assert out["run"]["trace"] == pytest.approx(trace, rel=1e-5), normalizer
        assert out["run"]["projected"] == pytest.approx(projected, rel=1e-5), normalizer
    monkeypatch.setitem(BASELINES, "by_position", lambda r, eps: torch.arange(r.shape[1], dtype=r.dtype).expand_as(r))
    out = _hand_variance(model, baseline="by_position", advantage_normalizer="none")
    assert "run" not in out and out["leave_one_out"]["trace"] == pytest.approx(15.0, rel=1e-5)


def test_variance_table_and_the_baseline_prediction(tmp_path):
    from test_plot import write_run

    from rlvr.experiments.estimators import predicted_baseline_change, variance_table

    # (1 - p) ((1 - p) + p E-/E+): p = 1/2 with incorrect scores 4x as energetic -> 1.25 (more variance);
    # equal energies -> (1 - p): the textbook reduction
    assert predicted_baseline_change(0.5, 1.0, 4.0) == pytest.approx(1.25)
    assert predicted_baseline_change(0.75, 2.0, 2.0) == pytest.approx(0.25)
    assert predicted_baseline_change(0.5, 0.0, 1.0) is None
    rows = [
        {
            "step": 2,
            "train/reward": 0.5,
            "variance/no_baseline/trace": 1.0,
            "variance/mean_baseline/trace": 1.5,
            "variance/leave_one_out/trace": 2.0,
            "variance/score_energy_correct": 1.0,
            "variance/score_energy_incorrect": 4.0,
            "variance/baseline_bias_ratio": 1.0,
        },
        {
            "step": 4,
            "train/reward": 0.75,
            "variance/no_baseline/trace": 2.0,
            "variance/mean_baseline/trace": 3.0,
            "variance/leave_one_out/trace": 0.5,
            "variance/score_energy_correct": 2.0,
            "variance/score_energy_incorrect": 2.0,
            "variance/baseline_bias_ratio": 3.0,
        },
    ]
    write_run(tmp_path / "r", rows, {"seed": 0})
    table = variance_table(load_runs(tmp_path / "r"))
    # no baseline / leave-one-out: 1/2 and 4, geometric mean sqrt(2); the second measurement went up although
    # the prediction (0.25) says down: 1 of 2 agree
    assert "| r | 2 | 1.5 | 2.25 | 1.25 | – | 1.41 (0.5 – 4) | – | 2 | 2 (1 – 4) | 1/2 |" in table
    assert "| r | 4 | 0.75 | 2 | 3 | 1.5 | 0.25 | 1 | – | – | 3 |" in table


# --- importance ratios by hand ------------------------------------------------------------------------


def test_importance_statistics_by_hand():
    log_w = torch.log(torch.tensor([2.0, 1.0, 0.5, 1.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    stats = importance_statistics(log_w, adv, torch.tensor([1e-3, -1e-3, 1e-5]), torch.tensor([1.0, -1.0, 1.0]))
    assert stats["n_tokens"] == 4 and stats["n_sequences"] == 3
    # PPO clip at 0.2 takes the clipped branch on token 0 (A > 0, w = 2) and token 2 (A < 0, w = 0.5)
    assert stats["token_clip_frac"] == 0.5
    # GSPO clip at 3e-4: sequences 0 and 1 leave the band in the direction their advantage pushes; 2 does not
    assert stats["seq_clip_frac"] == pytest.approx(2 / 3)
    # k1 = mean(-log w) = 0; k3 = mean(w - 1 - log w) = ((1 - log 2) + (-0.5 + log 2)) / 4 = 0.125
    assert stats["kl_k1"] == pytest.approx(0.0, abs=1e-12)
    assert stats["kl_k3"] == pytest.approx(0.125)
    assert (stats["token_ratio_min"], stats["token_ratio_q50"], stats["token_ratio_max"]) == pytest.approx(
        (0.5, 1.0, 2.0)
    )
    assert stats["token_ratio_mean"] == pytest.approx(1.125)
    assert stats["seq_ratio_max"] == pytest.approx(math.exp(1e-3))
    assert importance_statistics(torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0)) == {}


def test_update_curves_by_phase_and_kl_growth(tmp_path):
    from test_plot import write_run

    from rlvr.experiments.estimators import kl_growth_exponent, offpolicy_table, update_curves

    rows = []
    for step in (1, 2, 3, 4, 5, 6):
        ups = [
            {
                "update": j,
                "kl_k3": step * 1e-4 * (j - 1) ** 2,
                "entropy": float(step),
                "token_ratio_q99": 1 + 0.01 * j,
                "skipped_nonfinite": False,
                "n_trained_tokens": 3 if step == 1 else 1,
            }
            for j in (1, 2, 3, 4)
        ]
        rows.append({"step": step, "train/reward": 0.5, "updates": ups})
    write_run(tmp_path / "r", rows, {"seed": 0})
    c = update_curves("r", load_runs(tmp_path / "r"), n_phases=2)
    assert c.phases == [(1, 3), (4, 6)] and c.updates.tolist() == [1, 2, 3, 4]
    # token-weighted mean over the phase's rollout steps: step 1's updates trained on 3 tokens, the others on 1
    assert c.values["entropy"][:, 0].tolist() == pytest.approx([(3 * 1 + 2 + 3) / 5, 5.0])
    # token-weighted mean step (3 + 2 + 3 + 4 + 5 + 6) / 8 = 2.875, times 1e-4 (j-1)^2
    assert c.overall["kl_k3"].tolist() == pytest.approx([0, 2.875e-4, 1.15e-3, 2.5875e-3])
    assert update_curves("r", load_runs(tmp_path / "r"), n_phases=4).phases == [(1, 3), (4, 6)]  # >= 3 steps each
    assert kl_growth_exponent(c) == pytest.approx(2.0)
    assert "skipped_nonfinite" not in c.values  # flags are not curves
    row = offpolicy_table({"r": c}).splitlines()[-1]
    assert row.startswith("| r | 1.01 → 1.04 |") and row.endswith("| 2.00 |")  # first and last quarter: one update each


# --- the trainer logs what the figures need; rlvr report draws them ----------------------------------------


def _offpolicy_run(gsm8k_path, tokenizer, out, variance_every):
    from test_trainer import run, tiny_config

    from rlvr.config import AlgorithmConfig, LogConfig, OptimConfig
    from rlvr.modeling import build_model, small_olmo2_config

    model = build_model(small_olmo2_config(tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)
    cfg = tiny_config(
        gsm8k_path,
        algorithm=AlgorithmConfig(preset="grpo", reweighting="none"),
        optim=OptimConfig(lr=3e-3, train_batch_size=2, gradient_accumulation_steps=1),
        log=LogConfig(progress=False, val_samples=2, gradient_variance_every=variance_every),
    )
    run(cfg, out, model, tokenizer)
    return model


def test_trainer_logs_updates_and_variance_without_changing_training(gsm8k_path, tiny_tokenizer, tmp_path):
    from rlvr.training.metrics_log import read_metrics

    measured = _offpolicy_run(gsm8k_path, tiny_tokenizer, tmp_path / "run", variance_every=1)
    plain = _offpolicy_run(gsm8k_path, tiny_tokenizer, tmp_path / "plain", variance_every=0)
    for a, b in zip(measured.parameters(), plain.parameters()):
        assert torch.equal(a, b)  # re-scoring the batch neither moves the weights nor leaves gradients behind
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    for r in rows:
        ups = r["updates"]
        assert [u["update"] for u in ups] == [1, 2, 3, 4]  # 8 rollouts, 2 per optimizer step
        first = next(u for u in ups if u.get("n_tokens"))
        if first["update"] == 1:  # the sampling weights: every ratio is 1
            assert first["token_ratio_min"] == pytest.approx(1, abs=1e-4) and first["token_ratio_max"] == pytest.approx(
                1, abs=1e-4
            )
            assert abs(first["kl_k3"]) < 1e-8 and first["token_clip_frac"] == 0
        assert all(0 <= u["entropy"] for u in ups if u["n_trained_tokens"])
        assert r["variance/n_groups"] == 2 and r["variance/no_baseline/trace"] >= 0 and "variance/run/trace" in r
    later = [u for r in rows for u in r["updates"] if u["update"] > 1 and u.get("n_tokens")]
    assert any(u["kl_k3"] > 1e-6 for u in later)  # the policy moved away from the sampling one
    dump = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert all(d["n_train_tokens"] >= 1 for d in dump)
    plain_rows = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    assert not any(k.startswith("variance/") for r in plain_rows for k in r)

    out = tmp_path / "report" / "r.md"
    assert report_main([str(tmp_path / "run"), "--out", str(out)]) == 0
    text = out.read_text()
    for section in (
        "## Difficulty weighting",
        "## Gradient variance with and without a baseline",
        "## Off-policy diagnostics per optimizer step",
    ):
        assert section in text, section
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    for name in ("weighting.png", "weighting_shapes.png", "variance.png", "offpolicy_compare.png", "offpolicy_run.png"):
        assert f"r_figures/estimators/{name}" in links, name
    for link in links:
        data = (out.parent / link).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 10_000, link
    assert "variance_no_baseline_trace.png" not in text  # drawn together, not one figure per metric
