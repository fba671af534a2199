"""A user's own estimator: DAPO's "clip-higher" as one registered reweighting method.

PPO/GRPO clip the token ratio w = pi / pi_old symmetrically to [1 - eps, 1 + eps]. DAPO (Yu et al.
2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", section 3.1) decouples the
two sides: the upper bound 1 + eps_high with eps_high = 0.28 > eps_low = 0.2 lets the probability
of an unlikely token that earned a positive advantage grow further before the clip stops its
gradient, which they found keeps entropy from collapsing. Per token the loss is

    -min(A w, A clip(w, 1 - eps_low, 1 + eps_high))

This file changes exactly that one thing. Importing it registers the method under the name
``clip_higher``; the config's ``cliprange`` is eps_low and ``EPS_HIGH`` the upper side. Select it
with ``importance_reweighting_method: clip_higher`` and load this file as a plugin (see
docs/custom_estimator.md).
"""

import torch

from rlvr.grpo import register_reweighting

EPS_HIGH = 0.28
"""Upper clip range (DAPO's value); the lower one is the config's ``cliprange`` (0.2 in DAPO)."""


@register_reweighting("clip_higher", needs_old_log_probs=True, needs_cliprange=True)
def clip_higher(A, logp, old, eps, mask):
    """A (B, 1), logp and old (B, T), eps = eps_low, mask (B, T) bool or None -> loss (B, T), metadata."""
    ratio = torch.exp(logp - old)
    unclipped = A * ratio
    clipped = A * torch.clamp(ratio, 1.0 - eps, 1.0 + EPS_HIGH)
    # The clipped branch is taken where it is strictly smaller; count it over response tokens only.
    took_clip = (clipped < unclipped).float()
    m = torch.ones_like(took_clip) if mask is None else mask.to(took_clip.dtype)
    count, total = (took_clip * m).sum().detach(), m.sum().detach()
    # clip_count / clip_total let the train step sum the clip fraction over microbatches.
    meta = {"clip_fraction": count / total.clamp(min=1), "clip_count": count, "clip_total": total}
    return -torch.minimum(unclipped, clipped), meta
