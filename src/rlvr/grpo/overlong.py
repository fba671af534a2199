"""DAPO's overlong handling (Yu et al. 2025, section 3.4): a soft length penalty in the reward, and
no loss on responses cut by the length limit.

**Soft overlong punishment** (their equation 13). With ``L_max`` the longest response
(``rollout.max_new_tokens``) and a buffer of ``L_cache`` tokens before it, a response of ``|y|``
tokens gets the reward term

    0                                  |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
    -1                                 |y| > L_max

scaled by ``penalty`` (verl's ``overlong_penalty_factor``; 1 in the paper): the penalty grows linearly
through the buffer and is ``-penalty`` at the limit. A response is never longer than ``L_max`` here
(the engine cuts it there), so the last case never applies.

**Overlong filtering**: a response the limit cut (finish reason ``length``) carries no loss, so that a
reasoning chain that was merely cut off is not punished as if it were wrong.
"""

from __future__ import annotations

import torch


def soft_overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """The reward term (B,) float32 of responses of ``lengths`` (B,) tokens under DAPO's soft overlong
    punishment (module docstring); all zeros when ``buffer`` is 0."""
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_length:
        raise ValueError(f"the overlong buffer ({buffer}) must not exceed the longest response ({max_length})")
    start = max_length - buffer
    inside = (start - lengths) / buffer
    term = torch.where(lengths > max_length, torch.full_like(lengths, -1.0), inside.clamp(max=0.0))
    return penalty * term


def truncated_masked(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``response_mask`` (B, T) with the rows of the ``truncated`` (B,) bool responses emptied."""
    return response_mask.masked_fill(torch.as_tensor(truncated, dtype=torch.bool).unsqueeze(1), 0)
