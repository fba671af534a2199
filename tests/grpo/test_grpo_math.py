"""Hand-computed values for every advantage normalizer, reweighting loss and aggregation."""

import math

import pytest
import torch

from rlvr import (
    aggregate_loss_across_microbatch,
    compute_group_normalized_rewards,
    compute_policy_gradient_loss,
    compute_rollout_rewards,
)
from rlvr.grpo import PRESETS, REWEIGHTINGS, pass_at_k, register_normalizer, register_reweighting

EPS = 1e-6


# --- advantages -------------------------------------------------------------------------------------


def test_grpo_std_advantages_by_hand():
    # group [1,0,0,0]: mean 0.25, unbiased std sqrt((0.75^2 + 3*0.25^2)/3) = 0.5
    adv, meta = compute_group_normalized_rewards([1, 0, 0, 0], 4, "mean", EPS, "std")
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + EPS)
    torch.testing.assert_close(adv, expected)
    assert meta["zero_adv_frac"] == 0.0


def test_grpo_std_two_of_four():
    adv, _ = compute_group_normalized_rewards([1, 1, 0, 0], 4)
    s = math.sqrt(1 / 3)  # deviations ±0.5, sum of squares 1, divided by n-1 = 3
    torch.testing.assert_close(adv, torch.tensor([0.5, 0.5, -0.5, -0.5]) / (s + EPS))


def test_maxrl_mean_normalizer_by_hand():
    adv, _ = compute_group_normalized_rewards([1, 0, 0, 0], 4, "mean", 0.0, "mean")
    torch.testing.assert_close(adv, torch.tensor([3.0, -1.0, -1.0, -1.0]))


def test_rloo_leave_one_out_advantages_by_hand():
    # group [1, 0, 0, 0]: baselines (sum - r_i) / 3 = [0, 1/3, 1/3, 1/3] -> [1, -1/3, -1/3, -1/3];
    # group [1, 1, 0, 2]: sum 4, baselines [1, 1, 4/3, 2/3] -> [0, 0, -4/3, 4/3]
    adv, meta = compute_group_normalized_rewards([1, 0, 0, 0, 1, 1, 0, 2], 4, "loo", EPS, "none")
    third = 1 / 3
    torch.testing.assert_close(adv, torch.tensor([1.0, -third, -third, -third, 0.0, 0.0, -4 * third, 4 * third]))
    # the leave-one-out advantage is G / (G - 1) times the mean-baseline one (Kool et al. 2019)
    centred, _ = compute_group_normalized_rewards([1, 0, 0, 0, 1, 1, 0, 2], 4, "mean", EPS, "none")
    torch.testing.assert_close(adv, centred * 4 / 3)
    assert meta["zero_adv_frac"] == 0.0
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_group_normalized_rewards([1, 0], 1, "loo", EPS, "none")


def test_dr_grpo_and_rft_advantages():
    adv, _ = compute_group_normalized_rewards([1, 0, 0, 0, 1, 1, 1, 0], 4, "mean", EPS, "none")
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]))
    adv, meta = compute_group_normalized_rewards([1, 0, 0, 0, 0, 0, 0, 0], 4, "none", EPS, "none")
    torch.testing.assert_close(adv, torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]))


def test_uniform_groups_have_zero_advantage_and_are_counted():
    adv, meta = compute_group_normalized_rewards([0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0], 4)
    assert torch.all(adv[:8] == 0)
    assert meta["zero_adv_frac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("value", [0.1, 0.3, 1 / 3])
@pytest.mark.parametrize("group_size", [8, 12, 16])
@pytest.mark.parametrize("normalizer", ["std", "mean", "none"])
def test_equal_partial_credit_groups_have_exactly_zero_advantage(value, group_size, normalizer):
    """Rewards that are equal but not 0 or 1: in float32 the group mean of eight 0.1s is off by one
    rounding step and the std normalizer turns that into a visible advantage; the advantages must be
    exactly 0, the group counted as carrying no signal, and the other group untouched."""
    varied = [value] * (group_size - 1) + [1.0]
    adv, meta = compute_group_normalized_rewards([value] * group_size + varied, group_size, "mean", EPS, normalizer)
    assert torch.equal(adv[:group_size], torch.zeros(group_size))
    assert meta["zero_adv_frac"] == 0.5
    # the varied group: (r - mean) / d worked out by hand
    mean = (value * (group_size - 1) + 1.0) / group_size
    d = {"std": torch.tensor(varied, dtype=torch.float64).std().item() + EPS, "mean": mean + EPS, "none": 1.0}[
        normalizer
    ]
    expect = torch.tensor([(value - mean) / d] * (group_size - 1) + [(1.0 - mean) / d])
    torch.testing.assert_close(adv[group_size:], expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalizer", ["std", "mean", "none"])
def test_advantages_sum_to_zero_per_group_under_mean_baseline(normalizer):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (64,), generator=g).float()
    adv, _ = compute_group_normalized_rewards(rewards, 8, "mean", EPS, normalizer)
    torch.testing.assert_close(adv.view(-1, 8).sum(1), torch.zeros(8), atol=1e-4, rtol=0)


def test_advantage_argument_errors():
    with pytest.raises(ValueError, match="group_size"):
        compute_group_normalized_rewards([1, 0, 1], 2)
    with pytest.raises(ValueError, match="advantage_normalizer"):
        compute_group_normalized_rewards([1, 0], 2, advantage_normalizer="bogus")
    with pytest.raises(ValueError, match="baseline"):
        compute_group_normalized_rewards([1, 0], 2, baseline="median")


def test_registered_normalizer_is_selectable():
    @register_normalizer("test_range")
    def _range(r, eps):
        return r.max(dim=1, keepdim=True).values - r.min(dim=1, keepdim=True).values + eps

    adv, _ = compute_group_normalized_rewards([2, 0, 0, 0], 4, "mean", 0.0, "test_range")
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_compute_rollout_rewards():
    fn = lambda resp, gt: {"format_reward": 1.0, "answer_reward": float(resp == gt), "reward": float(resp == gt)}
    rewards, meta = compute_rollout_rewards(fn, ["1", "2", "3", "3"], ["1", "1", "3", "4"])
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert meta["reward_mean"] == 0.5 and meta["format_reward_mean"] == 1.0
    with pytest.raises(ValueError, match="repeated_ground_truths"):
        compute_rollout_rewards(fn, ["1"], ["1", "2"])


def test_pass_at_k_by_hand():
    # one group of 4 with 1 correct: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6, pass@4 = 1
    p = pass_at_k(torch.tensor([1, 0, 0, 0]), 4, [1, 2, 4])
    assert p[1] == pytest.approx(0.25) and p[2] == pytest.approx(0.5) and p[4] == pytest.approx(1.0)


def test_presets_table():
    as_tuple = {k: (p.baseline, p.advantage_normalizer, p.loss_normalization) for k, p in PRESETS.items()}
    assert as_tuple == {
        "grpo": ("mean", "std", "sequence"),
        "grpo_constant": ("mean", "std", "constant"),
        "dr_grpo": ("mean", "none", "constant"),
        "rft": ("none", "none", "constant"),
        "maxrl": ("mean", "mean", "constant"),
        "rloo": ("loo", "none", "constant"),
    }


# --- per-token losses -------------------------------------------------------------------------------


def test_reinforce_loss_by_hand():
    loss, _ = compute_policy_gradient_loss(torch.tensor([2.0, -1.0]), torch.tensor([[-1.0, -2.0], [-0.5, -3.0]]))
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0], [-0.5, -3.0]]))


def test_noclip_loss_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    loss, _ = compute_policy_gradient_loss(torch.tensor([[2.0]]), logp, "noclip", torch.zeros(1, 2))
    torch.testing.assert_close(loss, torch.tensor([[-3.0, -1.0]]))


def test_ppo_clip_loss_and_clip_fraction_by_hand():
    # rows: A=+1,w=1.5 -> clipped to 1.2; A=-1,w=1.5 -> unclipped 1.5; A=-1,w=0.5 -> clipped 0.8; A=+1,w=0.5 -> 0.5
    A = torch.tensor([1.0, -1.0, -1.0, 1.0])
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]]))
    loss, meta = compute_policy_gradient_loss(A, logp, "grpo", torch.zeros(4, 1), 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2], [1.5], [0.8], [-0.5]]))
    assert meta["clip_fraction"].item() == pytest.approx(0.5)


def test_clip_higher_by_hand_and_as_verl_writes_it():
    # eps_low 0.2, eps_high 0.28 (DAPO): w is clipped to [0.8, 1.28]
    # A=+1: w = 1.0, 1.25, 1.3 -> -[1.0, 1.25, 1.28];  A=-1: w = 0.7, 0.9, 1.5 -> [0.8, 0.9, 1.5]
    ratios = torch.tensor([[1.0, 1.25, 1.3], [0.7, 0.9, 1.5]], dtype=torch.float64)
    logp = torch.log(ratios).requires_grad_(True)
    A = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, meta = compute_policy_gradient_loss(A, logp, "ppo_clip", torch.zeros_like(ratios), (0.2, 0.28))
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -1.25, -1.28], [0.8, 0.9, 1.5]], dtype=torch.float64))
    assert meta["clip_fraction"].item() == pytest.approx(2 / 6)  # at w = 1.3 (A > 0) and w = 0.7 (A < 0)
    # verl, verl/trainer/ppo/core_algos.py compute_policy_loss (vanilla), written out:
    #   pg_losses1 = -A * ratio; pg_losses2 = -A * clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    #   pg_losses = maximum(pg_losses1, pg_losses2)
    peer = torch.maximum(-A[:, None] * ratios, -A[:, None] * torch.clamp(ratios, 1 - 0.2, 1 + 0.28))
    torch.testing.assert_close(loss, peer)
    loss.sum().backward()  # the token at w = 1.25 still moves (symmetric 0.2 would stop it)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.25, 0.0], [0.0, 0.9, 1.5]], dtype=torch.float64))
    # a number is the symmetric pair
    sym, _ = compute_policy_gradient_loss(A, logp.detach(), "ppo_clip", torch.zeros_like(ratios), 0.2)
    pair, _ = compute_policy_gradient_loss(A, logp.detach(), "ppo_clip", torch.zeros_like(ratios), (0.2, 0.2))
    torch.testing.assert_close(sym, pair)


def test_asymmetric_clip_in_gspo_and_cispo_and_refused_elsewhere():
    logp = torch.log(torch.tensor([[1.25, 1.25]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    # gspo: s = 1.25, inside [0.8, 1.28] -> -1.25; with (0.2, 0.2) clipped to 1.2
    g, _ = compute_policy_gradient_loss(torch.tensor([1.0]), logp, "gspo", torch.zeros(1, 2), (0.2, 0.28), mask)
    torch.testing.assert_close(g, torch.tensor([[-1.25, -1.25]]))
    # cispo bounds from above by 1 + eps_high: weight min(1.25, 1.28) = 1.25 -> loss -1.25 * logp
    c, meta = compute_policy_gradient_loss(torch.tensor([1.0]), logp, "cispo", torch.zeros(1, 2), (0.2, 0.28))
    torch.testing.assert_close(c, -1.25 * logp)
    assert meta["clip_fraction"].item() == 0.0
    register_reweighting("sym_only_for_test", needs_cliprange=True)(lambda A, lp, old, eps, m: (-A * lp, {}))
    try:
        with pytest.raises(ValueError, match="clips symmetrically"):
            compute_policy_gradient_loss(torch.tensor([1.0]), logp, "sym_only_for_test", torch.zeros(1, 2), (0.2, 0.3))
    finally:
        del REWEIGHTINGS["sym_only_for_test"]
    with pytest.raises(ValueError, match="both sides"):
        compute_policy_gradient_loss(torch.tensor([1.0]), logp, "ppo_clip", torch.zeros(1, 2), (0.2, 0.0))


def test_clip_fraction_ignores_padding():
    A = torch.tensor([1.0])
    logp = torch.log(torch.tensor([[1.5, 1.0, 1.5, 1.5]]))  # tokens 0, 2, 3 would be clipped
    mask = torch.tensor([[True, True, False, False]])
    _, meta = compute_policy_gradient_loss(A, logp, "grpo", torch.zeros(1, 4), 0.2, mask)
    assert meta["clip_fraction"].item() == pytest.approx(0.5)


def test_gspo_weight_is_geometric_mean_over_response_tokens_only():
    # response ratios 4 and 1 -> geometric mean 2; the padded token's huge ratio must be ignored
    logp = torch.log(torch.tensor([[4.0, 1.0, 1000.0], [2.0, 0.5, 1000.0]]))
    mask = torch.tensor([[True, True, False], [True, True, False]])
    loss, meta = compute_policy_gradient_loss(torch.tensor([1.0, 1.0]), logp, "gspo", torch.zeros(2, 3), 0.2, mask)
    # row 0: s = 2 -> clipped to 1.2 -> -1.2 on every token; row 1: s = 1 -> -1
    torch.testing.assert_close(loss, torch.tensor([[-1.2] * 3, [-1.0] * 3]))
    assert meta["clip_fraction"].item() == pytest.approx(0.5)  # one of two sequences


def test_gspo_gradient_is_mean_log_ratio_gradient():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = logp.detach().clone()  # s = 1, inside the clip range
    mask = torch.tensor([[True, True, False]])
    loss, _ = compute_policy_gradient_loss(torch.tensor([2.0]), logp, "gspo", old, 0.2, mask)
    aggregate_loss_across_microbatch(loss, mask).backward()
    # d/dlogp_t of -A * exp(mean_t (logp - old)) = -A * s / n for response tokens, 0 for padding
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))


def test_cispo_keeps_gradient_on_clipped_tokens():
    logp = torch.log(torch.tensor([[1.5, 0.9]])).requires_grad_(True)
    loss, meta = compute_policy_gradient_loss(torch.tensor([2.0]), logp, "cispo", torch.zeros(1, 2), 0.2)
    # weights sg(min(w, 1.2)) = [1.2, 0.9]; loss = -w * A * logp
    torch.testing.assert_close(loss.detach(), -torch.tensor([[1.2, 0.9]]) * 2.0 * logp.detach())
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.4, -1.8]]))
    assert meta["clip_fraction"].item() == pytest.approx(0.5)


def test_old_log_probs_longer_than_T_are_cut():
    logp = torch.zeros(1, 2)
    loss, _ = compute_policy_gradient_loss(torch.tensor([1.0]), logp, "noclip", torch.zeros(1, 5))
    assert loss.shape == (1, 2)


def test_loss_argument_errors():
    logp = torch.zeros(2, 3)
    A = torch.ones(2)
    with pytest.raises(ValueError, match="importance_reweighting_method"):
        compute_policy_gradient_loss(A, logp, "bogus")
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_policy_gradient_loss(A, logp, "noclip")
    with pytest.raises(ValueError, match="cliprange"):
        compute_policy_gradient_loss(A, logp, "grpo", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="response_mask"):
        compute_policy_gradient_loss(A, logp, "gspo", torch.zeros(2, 3), 0.2)
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_policy_gradient_loss(A, logp, "noclip", torch.zeros(2, 2))


# --- aggregation ------------------------------------------------------------------------------------


def test_aggregation_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert aggregate_loss_across_microbatch(loss, mask, "sequence").item() == pytest.approx((1.5 + 4.0) / 2)
    assert aggregate_loss_across_microbatch(loss, mask, "constant", 10.0).item() == pytest.approx(0.7)
    # DAPO's token-level loss: (1 + 2 + 4) over the batch's 3 response tokens
    assert aggregate_loss_across_microbatch(loss, mask, "token").item() == pytest.approx(7 / 3)


def test_sequence_equals_constant_when_lengths_match_the_constant():
    # every sequence has L response tokens and C = B * L: sequence mean of means = constant-normalised sum
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 6, generator=g)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 1:4] = True
    seq = aggregate_loss_across_microbatch(loss, mask, "sequence")
    const = aggregate_loss_across_microbatch(loss, mask, "constant", 4 * 3)
    torch.testing.assert_close(seq, const)


def test_aggregation_errors():
    loss, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="normalization_constant"):
        aggregate_loss_across_microbatch(loss, mask, "constant")
    with pytest.raises(ValueError, match="loss_normalization"):
        aggregate_loss_across_microbatch(loss, mask, "median")
