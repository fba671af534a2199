"""Gradient variance of several advantage estimators, measured on the same rollouts by re-scoring them.

The policy gradient of a batch is a sum over its groups (one prompt's G samples each; groups are
independent of each other, samples within a group are not once a baseline couples them). With
``l_i = a_i * sum_t log p(y_it)`` a sample's aggregated log-probability (``a_i`` the aggregation's
token coefficient, as in the train step), group j contributes ``g_j = sum_i A_i grad l_i`` to the
ascent direction. Any advantage of the form ``A_i = (r_i - b_j) / d_j`` (a per-group baseline and
normalizer) gives ``g_j = (U_j - b_j S_j) / d_j`` with

    U_j = sum_i r_i grad l_i        S_j = sum_i grad l_i,

so the per-group gradient of every such estimator comes from the same two vectors. Both are sums of
``X_jv = sum_{i: r_i = v} grad l_i`` over the group's distinct reward values v (``U_j = sum_v v X_jv``,
``S_j = sum_v X_jv``), and each ``X_jv`` is one forward and backward over those rows only: with 0/1
rewards the two together cost one forward and backward of the group. The estimators compared
(``ESTIMATORS``):

* ``no_baseline``: ``A = r`` (REINFORCE);
* ``mean_baseline``: ``A = r - mean(r)`` (Dr. GRPO's advantage; ``(G - 1) / G`` times leave-one-out);
* ``leave_one_out``: ``A_i = r_i - mean_{k != i} r_k = G / (G - 1) (r_i - mean(r))``: the baseline of
  sample i does not depend on sample i, so this gradient has the expectation of ``no_baseline``'s;
* ``run``: the run's own (baseline, normalizer), when it is none of the above.

With J groups, ``ghat_j = J g_j`` estimates the batch gradient ``gbar = mean_j ghat_j`` from one
group; the reported variance is the trace of its sample covariance,
``sum_j |ghat_j - gbar|^2 / (J - 1)``, and the *projected* variance is the sample variance of
``<ghat_j, u_-j>`` with ``u_-j`` the unit vector along the leave-one-out mean of the other groups (the
same directions for every estimator, each independent of the group it measures). The variance of the
batch gradient itself is these divided by J. Across groups both include how much the prompts' true
gradients differ, which is the same for every estimator with the same expectation (no baseline and
leave-one-out), so their difference is the estimators' own noise.

**Why a baseline may not help.** With 0/1 rewards, ``g_j`` of the mean baseline is
``(1 - p) X_j,correct - p X_j,incorrect``: it shrinks the correct samples' scores and adds the
incorrect ones'. ``score_energy_correct`` / ``_incorrect`` is ``|X_jv|^2`` per sample of the class,
averaged over groups: when incorrect (typically less likely) samples have much larger scores, the
baseline adds more variance than it removes.

**Bias check.** ``no_baseline - leave_one_out`` is the baseline term ``sum_i b_i grad l_i`` with
``b_i = mean_{k != i} r_k``, which has expectation zero when ``a_i`` does not depend on the sample
(``constant`` normalisation). If its mean is zero, ``J |mean_j d_j|^2 / tr Cov(d)`` has expectation
1 (``baseline_bias_ratio``); a value far above 1 measures a bias. Under ``sequence`` normalisation
``a_i = 1 / (B n_i)`` depends on the response length and the term need not vanish in expectation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlvr.grpo.advantages import compute_group_normalized_rewards
from rlvr.grpo.aggregate import get_aggregation
from rlvr.training.logprobs import DEFAULT_CHUNK_TOKENS, get_response_log_probs

ESTIMATORS = ("no_baseline", "mean_baseline", "leave_one_out", "run")


def _flat_grad(loss: torch.Tensor, params: Sequence[torch.Tensor], retain: bool) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)])


def _coefficients(rewards: torch.Tensor, group_size: int, baseline: str, normalizer: str, eps: float) -> dict:
    """Per group j and estimator: ``(c_U, c_S)`` such that ``g_j = c_U U_j + c_S S_j``."""
    G = group_size
    r = rewards.double().view(-1, G)
    mean = r.mean(dim=1)
    ones, zeros = torch.ones_like(mean), torch.zeros_like(mean)
    coef = {
        "no_baseline": (ones, zeros),
        "mean_baseline": (ones, -mean),
        "leave_one_out": (ones * G / (G - 1), -mean * G / (G - 1)),
        # sum_i b_i grad l_i with b_i = (sum r - r_i) / (G - 1): (G mean S - U) / (G - 1)
        "baseline_term": (-ones / (G - 1), mean * G / (G - 1)),
    }
    if (baseline, normalizer) not in (("none", "none"), ("mean", "none")):
        advantages, _ = compute_group_normalized_rewards(rewards, G, baseline, eps, normalizer)
        run = _affine_in_reward(advantages.double().view(-1, G), r)
        if run is not None:
            coef["run"] = run
    return coef


def _affine_in_reward(weights: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per group j, ``(c_U, c_S)`` with ``weights[j, i] = c_U r_ji + c_S``, or None when some group's weights
    are not affine in its rewards. A group baseline (one value a group) or a per-sample one such as the
    leave-one-out mean (``b_i = (sum r - r_i) / (G - 1)``) is; the estimator sums scores by reward class,
    so a weight that told two samples of equal reward apart could not be written this way."""
    lo, hi = r.min(dim=1).values, r.max(dim=1).values
    spread = hi - lo
    at_lo = weights.gather(1, r.argmin(dim=1, keepdim=True)).squeeze(1)
    at_hi = weights.gather(1, r.argmax(dim=1, keepdim=True)).squeeze(1)
    # A group of equal rewards has U = r S: all of its weight goes on S.
    c_u = torch.where(spread > 0, (at_hi - at_lo) / spread.clamp(min=1e-300), torch.zeros_like(spread))
    c_s = at_lo - c_u * lo
    fitted = c_u[:, None] * r + c_s[:, None]
    # The advantages come in float32: a fit within its rounding is exact.
    if not torch.allclose(fitted, weights, rtol=1e-5, atol=1e-6):
        return None
    return c_u, c_s


def gradient_variance(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    group_size: int,
    loss_normalization: str = "sequence",
    normalization_constant: float | None = None,
    batch_size: int | None = None,
    baseline: str = "mean",
    advantage_normalizer: str = "std",
    advantage_eps: float = 1e-6,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    backbone: Callable[..., Any] | None = None,
    keep_bytes: int = 2**30,
) -> dict:
    """Per-group gradient variance of each estimator on one rollout batch (rows in consecutive groups
    of ``group_size``), without touching ``.grad`` or the weights.

    ``batch_size`` is the B of ``sequence`` normalisation (default: the number of rows); it and
    ``normalization_constant`` only scale every estimator alike. The projections need the mean
    gradient first: the per-group vectors are kept for that when they fit in ``keep_bytes`` (float32,
    on the model's device), else every group is run a second time. Returns
    ``{estimator: {"trace": ..., "projected": ..., "mean_norm": ..., "mean_projection": ...}, ...,
    "baseline_bias_ratio": ..., "n_groups": J}``; ``run`` is present when the run's (baseline,
    normalizer) is not ``no_baseline`` or ``mean_baseline`` already and its advantages are affine in
    the reward within each group (every built-in baseline and normalizer is, the leave-one-out mean
    included). ``projected`` is NaN when fewer than two groups have a non-zero held-out direction.
    """
    G = group_size
    rows = input_ids.shape[0]
    if G < 2 or rows % G or rows // G < 2:
        raise ValueError(f"need at least two whole groups of group_size >= 2; got {rows} rows, group_size={G}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if rewards.numel() != rows:
        raise ValueError(f"got {rewards.numel()} rewards for {rows} rows")
    aggregation = get_aggregation(loss_normalization, normalization_constant)
    B = batch_size or rows
    J = rows // G
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    coef = _coefficients(rewards, G, baseline, advantage_normalizer, advantage_eps)
    lengths = (response_mask.long().cumsum(1).argmax(1) + 1).clamp(min=1)

    def class_score(rows: torch.Tensor) -> torch.Tensor:
        """sum over ``rows`` of grad l_i: one forward and backward of those rows."""
        width = int(lengths[rows].max())
        mask = response_mask[rows, :width].to(device)
        logp = get_response_log_probs(
            model,
            input_ids[rows, :width].to(device),
            labels[rows, :width].to(device),
            chunk_tokens=chunk_tokens,
            backbone=backbone,
        )["log_probs"]
        m = mask.to(logp.dtype)
        seq = (logp * m).sum(dim=1) / aggregation.divisor(m.sum(dim=1), B, normalization_constant)
        return _flat_grad(seq.sum(), params, retain=False)

    energy: dict[str, list[float]] = {
        "correct": [],
        "incorrect": [],
    }  # |X_jv|^2 per sample of the class, for 0/1 rewards

    def group_scores(j: int, record: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        r = rewards[j * G : (j + 1) * G]

        def reward_class(v: float) -> torch.Tensor:
            """X_jv: the score sum of the group's rows with reward v."""
            rows = torch.nonzero(r == v).flatten() + j * G
            X = class_score(rows)
            if record and binary:
                energy["correct" if v == 1.0 else "incorrect"].append(float(X.double().pow(2).sum()) / len(rows))
            return X

        # A group has at least one reward value: the sums start from the first one's class.
        first, *others = torch.unique(r).tolist()
        S = reward_class(first)
        U = first * S
        for v in others:
            X = reward_class(v)
            U = U + v * X
            S = S + X
        return U, S

    def estimate(name: str, j: int, U: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        cu, cs = coef[name]
        return J * (float(cu[j]) * U + float(cs[j]) * S)

    names = list(coef)
    binary = bool(((rewards == 0) | (rewards == 1)).all())
    # Pass 1: the batch gradient and the sum of squared per-group norms of every estimator. The per-group
    # (U_j, S_j) are kept for pass 2 when they fit in keep_bytes, else computed again.
    keep = J * 2 * sum(p.numel() for p in params) * 4 <= keep_bytes
    kept = []
    total: dict[str, torch.Tensor] = {}  # an estimator's sum over the groups seen so far
    sq_norms = {n: 0.0 for n in names}
    for j in range(J):
        U, S = group_scores(j, record=True)
        if keep:
            kept.append((U, S))
        for n in names:
            g = estimate(n, j, U, S)
            total[n] = total[n] + g if n in total else g
            sq_norms[n] += float(g.double().pow(2).sum())
    mean = {n: total[n] / J for n in names}
    # Pass 2: each group's estimates projected on the leave-one-out mean of the *other* groups, a direction
    # independent of the group (a direction fitted to the projected vectors themselves would favour the
    # estimator it was fitted to). Groups whose held-out direction is zero are left out.
    proj: dict[str, list[float]] = {n: [] for n in names}
    for j in range(J):
        U, S = kept[j] if keep else group_scores(j)
        held_out = J * mean["leave_one_out"] - estimate("leave_one_out", j, U, S)
        norm = float(held_out.norm())
        if norm == 0:
            continue
        u = (held_out / norm).double()
        for n in names:
            proj[n].append(float(estimate(n, j, U, S).double() @ u))
    out: dict = {"n_groups": J}
    for n in names:
        mean_sq = float(mean[n].double().pow(2).sum())
        trace = max(0.0, (sq_norms[n] - J * mean_sq) / (J - 1))
        p = proj[n]
        pm = sum(p) / len(p) if p else float("nan")
        out[n] = {
            "trace": trace,
            "projected": sum((x - pm) ** 2 for x in p) / (len(p) - 1) if len(p) > 1 else float("nan"),
            "mean_norm": math.sqrt(mean_sq),
            "mean_projection": pm,
        }
    term = out.pop("baseline_term")
    out["baseline_bias_ratio"] = J * term["mean_norm"] ** 2 / term["trace"] if term["trace"] > 0 else float("nan")
    for cls, values in energy.items():
        if values:
            out[f"score_energy_{cls}"] = sum(values) / len(values)
    return out


def variance_metrics(result: dict) -> dict[str, float]:
    """``gradient_variance``'s result as flat ``variance/...`` metrics for the run log."""
    out = {"variance/n_groups": result["n_groups"], "variance/baseline_bias_ratio": result["baseline_bias_ratio"]}
    for cls in ("correct", "incorrect"):
        if f"score_energy_{cls}" in result:
            out[f"variance/score_energy_{cls}"] = result[f"score_energy_{cls}"]
    for name in ESTIMATORS:
        if name in result:
            for key, value in result[name].items():
                out[f"variance/{name}/{key}"] = value
    return out
