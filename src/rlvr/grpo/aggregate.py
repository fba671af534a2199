"""Reducing a per-token loss (B, T) to a scalar over response tokens.

``sequence`` (GRPO): mean over each sequence's response tokens, then mean over sequences; long and
short responses weigh the same per sequence, so each token of a long wrong answer is penalised less
(the length bias named by Dr. GRPO, Liu et al. 2025).

``constant`` (Dr. GRPO): the sum of response-token losses divided by one constant fixed for all of
training (batch size × max generation length), so every token weighs the same.
"""

from __future__ import annotations

import torch


def aggregate_loss_across_microbatch(per_token_policy_gradient_loss: torch.Tensor, mask: torch.Tensor,
                                     loss_normalization: str = "sequence", normalization_constant: float | None = None):
    loss = per_token_policy_gradient_loss
    m = mask.to(device=loss.device, dtype=loss.dtype)
    if m.shape != loss.shape:
        raise ValueError(f"mask has shape {tuple(m.shape)} but the loss has shape {tuple(loss.shape)}; they must match")
    if loss_normalization == "sequence":
        per_seq = (loss * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)
        return per_seq.mean()
    if loss_normalization == "constant":
        if normalization_constant is None or normalization_constant <= 0:
            raise ValueError(
                "loss_normalization='constant' needs a positive normalization_constant "
                "(Dr. GRPO: rollout batch size × max generation length, fixed for all of training)"
            )
        return (loss * m).sum() / normalization_constant
    raise ValueError(f"unknown loss_normalization {loss_normalization!r}: use 'sequence' or 'constant'")
