"""Rewards of a rollout batch, and group-normalised advantages.

Rollouts come in consecutive groups of ``group_size`` samples of the same prompt. The advantage of
sample i in group g is ``(r_i - b_g) / d_g``, where the **baseline** b and the **normalizer** d are
two independent choices:

=========  ===============================================  ==========================================
baseline   ``mean``: group mean (GRPO, Shao et al. 2024)     ``none``: 0 (RFT: only correct samples move)
           ``loo``: mean of the other G - 1 samples (RLOO,
           Kool et al. 2019; Ahmadian et al. 2024)
normalizer ``std``: group std + eps (GRPO)                   ``mean``: group mean + eps (MaxRL)
           ``none``: 1 (Dr. GRPO, Liu et al. 2025)
=========  ===============================================  ==========================================

Dividing by the std up-weights prompts whose success rate is near 0 or 1 (small std), which Dr. GRPO
calls a question-level difficulty bias; dividing by the mean (MaxRL) up-weights hard prompts in
proportion to 1/p, so that a group with rewards [1, 0, 0, 0] gets advantages [3, -1, -1, -1].
The std is torch's default, the unbiased estimator (divides by G - 1).

New baselines and normalizers are plain functions registered in ``BASELINES`` / ``NORMALIZERS``
(see ``register_baseline`` / ``register_normalizer``); each maps rewards (n_groups, G), in float64, to
(n_groups, 1), or for a baseline of its own per sample (``loo``) to (n_groups, G). The leave-one-out
advantage ``r_i - (sum_j r_j - r_i) / (G - 1)`` equals ``G / (G - 1) (r_i - mean)``: the mean baseline
scaled up, with no bias from the sample's own reward in its baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Reduce = Callable[[torch.Tensor, float], torch.Tensor]


def _mean(r: torch.Tensor, eps: float) -> torch.Tensor:
    return r.mean(dim=1, keepdim=True)


def _zero(r: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.zeros_like(r[:, :1])


def _leave_one_out(r: torch.Tensor, eps: float) -> torch.Tensor:
    G = r.shape[1]
    if G < 2:
        raise ValueError("baseline='loo' needs group_size >= 2 (the mean of the other samples)")
    return (r.sum(dim=1, keepdim=True) - r) / (G - 1)


def _std_plus_eps(r: torch.Tensor, eps: float) -> torch.Tensor:
    return r.std(dim=1, keepdim=True) + eps


def _mean_plus_eps(r: torch.Tensor, eps: float) -> torch.Tensor:
    return r.mean(dim=1, keepdim=True) + eps


def _one(r: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ones_like(r[:, :1])


BASELINES: dict[str, Reduce] = {"mean": _mean, "loo": _leave_one_out, "none": _zero}
NORMALIZERS: dict[str, Reduce] = {"std": _std_plus_eps, "mean": _mean_plus_eps, "none": _one}


def register_baseline(name: str) -> Callable[[Reduce], Reduce]:
    """Decorator: make ``fn(rewards (n_groups, G), eps) -> (n_groups, 1)`` selectable as ``baseline=name``."""

    def deco(fn: Reduce) -> Reduce:
        BASELINES[name] = fn
        return fn

    return deco


def register_normalizer(name: str) -> Callable[[Reduce], Reduce]:
    """Decorator: make ``fn(rewards (n_groups, G), eps) -> (n_groups, 1)`` selectable as ``advantage_normalizer=name``."""

    def deco(fn: Reduce) -> Reduce:
        NORMALIZERS[name] = fn
        return fn

    return deco


def _lookup(table: dict[str, Reduce], kind: str, name: str) -> Reduce:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}: choose one of {sorted(table)} or register your own") from None


def compute_rollout_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[str],
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Score every response. Returns ``raw_rewards`` (B,) float32 and metadata with the mean reward,
    mean format reward and mean answer reward, plus ``format_rewards`` (B,) for per-sample logging."""
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError(
            f"rollout_responses has {len(rollout_responses)} entries but repeated_ground_truths has "
            f"{len(repeated_ground_truths)}; repeat each ground truth group_size times"
        )
    scores = [reward_fn(resp, gt) for resp, gt in zip(rollout_responses, repeated_ground_truths)]
    rewards = torch.tensor([float(s["reward"]) for s in scores], dtype=torch.float32)
    fmt = torch.tensor([float(s.get("format_reward", 0.0)) for s in scores], dtype=torch.float32)
    ans = torch.tensor([float(s.get("answer_reward", s["reward"])) for s in scores], dtype=torch.float32)
    meta = {
        "reward_mean": rewards.mean().item() if len(scores) else 0.0,
        "format_reward_mean": fmt.mean().item() if len(scores) else 0.0,
        "answer_reward_mean": ans.mean().item() if len(scores) else 0.0,
        "format_rewards": fmt,
    }
    return rewards, meta


def compute_group_normalized_rewards(
    raw_rewards: torch.Tensor | Sequence[float],
    group_size: int,
    baseline: str = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: str = "std",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Advantages (B,) = (r - baseline(group)) / normalizer(group) over consecutive groups of ``group_size``.

    Metadata: reward mean/std/min/max over the batch, ``zero_adv_frac`` (share of groups whose
    advantages are all zero, i.e. that carry no learning signal), and the per-group baselines and
    normalizers.
    """
    r = torch.as_tensor(raw_rewards, dtype=torch.float32).flatten()
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.numel() == 0 or r.numel() % group_size:
        raise ValueError(
            f"got {r.numel()} rewards, which is not a positive multiple of group_size={group_size}; "
            "pass group_size samples for every prompt"
        )
    if advantage_normalizer == "std" and group_size < 2:
        raise ValueError("advantage_normalizer='std' needs group_size >= 2 (the std of one sample is undefined)")
    base_fn = _lookup(BASELINES, "baseline", baseline)
    norm_fn = _lookup(NORMALIZERS, "advantage_normalizer", advantage_normalizer)
    # Group statistics in float64: a group of equal rewards then has a mean exactly equal to its rewards
    # whatever the value (G copies of a float32 sum exactly in float64), so its advantages are exactly 0
    # and the group is counted and skipped as carrying no signal. In float32 the mean of eight 0.1s is
    # off by a rounding step, which the std normalizer then blows up.
    groups = r.view(-1, group_size).double()
    b = base_fn(groups, advantage_eps)
    d = norm_fn(groups, advantage_eps)
    adv = ((groups - b) / d).float().flatten()
    zero_groups = (adv.view(-1, group_size) == 0).all(dim=1)
    meta = {
        "reward_mean": r.mean().item(),
        "reward_std": r.std().item() if r.numel() > 1 else 0.0,
        "reward_max": r.max().item(),
        "reward_min": r.min().item(),
        "zero_adv_frac": zero_groups.float().mean().item(),
        "group_baseline": b.float().flatten(),
        "group_normalizer": d.float().flatten(),
    }
    return adv, meta


def pass_at_k(correct: torch.Tensor, group_size: int, ks: Sequence[int]) -> dict[int, float]:
    """Unbiased pass@k (Chen et al. 2021) per group, averaged: 1 - C(n-c, k) / C(n, k) with n = group_size."""
    groups = torch.as_tensor(correct, dtype=torch.float64).view(-1, group_size)
    c = groups.sum(dim=1)
    n = group_size
    out = {}
    for k in ks:
        if k > n:
            continue
        # prod_{i=n-c+1}^{n} (1 - k/i) is C(n-c, k)/C(n, k) in a numerically stable form.
        vals = []
        for ci in c.tolist():
            ci = int(ci)
            if n - ci < k:
                vals.append(1.0)
                continue
            fail = 1.0
            for i in range(n - ci + 1, n + 1):
                fail *= 1.0 - k / i
            vals.append(1.0 - fail)
        out[k] = float(sum(vals) / len(vals))
    return out
