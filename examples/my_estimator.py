"""A user's own estimator: dual-clip PPO as one registered reweighting method.

PPO/GRPO clip the token ratio w = pi / pi_old to [1 - eps, 1 + eps] and take the smaller of the
clipped and unclipped objectives. For a token with a negative advantage that leaves the loss
-A w unbounded as w grows: one stale token with a huge ratio can dominate the update. Dual-clip PPO
(Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning",
section 3.3) caps that side too, at -A c for a constant c > 1 (they use c = 3). Per token the loss is

    l = -min(A w, A clip(w, 1 - eps, 1 + eps))      (PPO)
    l = min(l, -A c)  where A < 0                   (the second clip)

This file changes exactly that one thing. Importing it registers the method under the name
``dual_clip``; the config's ``cliprange`` is eps and ``RATIO_CAP`` is c. Select it with
``algorithm.reweighting: dual_clip`` and load this file as a plugin (see docs/custom_estimator.md).
"""

import torch

from rlvr.grpo import register_reweighting

RATIO_CAP = 3.0
"""c: a negative-advantage token's loss stops growing once its ratio passes c (Ye et al.'s value)."""


@register_reweighting("dual_clip", needs_old_log_probs=True, needs_cliprange=True)
def dual_clip(A, logp, old, eps, mask):
    """A (B, 1), logp and old (B, T), eps float, mask (B, T) bool or None -> loss (B, T), metadata."""
    ratio = torch.exp(logp - old)
    unclipped = -A * ratio
    ppo = torch.maximum(unclipped, -A * torch.clamp(ratio, 1.0 - eps, 1.0 + eps))
    loss = torch.where(A < 0, torch.minimum(ppo, -A * RATIO_CAP), ppo)
    # A token counts as clipped where either clip replaced the unclipped loss; over response tokens only.
    took_clip = (loss != unclipped).float()
    m = torch.ones_like(took_clip) if mask is None else mask.to(took_clip.dtype)
    count, total = (took_clip * m).sum().detach(), m.sum().detach()
    # clip_count / clip_total let the train step sum the clip fraction over microbatches.
    meta = {"clip_fraction": count / total.clamp(min=1), "clip_count": count, "clip_total": total}
    return loss, meta
