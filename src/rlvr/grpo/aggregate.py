"""Reducing a per-token loss (B, T) to a scalar over response tokens: the aggregation axis.

``sequence`` (GRPO): mean over each sequence's response tokens, then mean over sequences; long and
short responses weigh the same per sequence, so each token of a long wrong answer is penalised less
(the length bias named by Dr. GRPO, Liu et al. 2025).

``constant`` (Dr. GRPO): the sum of response-token losses divided by one constant fixed for all of
training (batch size × max generation length), so every token weighs the same.

``token`` (DAPO's token-level loss, Yu et al. 2025, section 3.3): the sum of response-token losses
divided by the number of response tokens in the optimizer step's batch (all of it: every rank's rows,
zero-advantage rows included), which the train step counts before its first microbatch. Every token
of a batch weighs the same, as with ``constant``, but the scale follows the batch's length.

Aggregations are registered in ``AGGREGATIONS`` like the baselines, normalizers and reweighting
methods (``register_aggregation``); each says how a sequence's summed token loss is divided
(``divisor``), which fixes both the loss of a microbatch and the weight of one token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Number = float | torch.Tensor
Divisor = Callable[[Number, int, float | None], Number]


@dataclass(frozen=True)
class Aggregation:
    divisor: Divisor
    """``divisor(n_tokens, batch_size, normalization_constant)``: what a sequence's summed token loss is
    divided by, for ``n_tokens`` response tokens (a float, or a tensor of one count per sequence) in a
    batch of ``batch_size`` sequences."""
    per_sequence: bool
    """The batch loss is a mean over sequences: each microbatch's own mean is scaled by its share of the
    batch's sequences, so that the accumulated gradient equals the whole batch's."""
    needs_normalization_constant: bool = False
    batch_tokens: bool = False
    """The constant is the batch's response-token count, which the train step counts and passes."""


AGGREGATIONS: dict[str, Aggregation] = {}


def register_aggregation(
    name: str, per_sequence: bool, needs_normalization_constant: bool = False, batch_tokens: bool = False
) -> Callable[[Divisor], Divisor]:
    """Decorator: make ``divisor(n_tokens, batch_size, normalization_constant)`` selectable as
    ``loss_normalization=name`` (see ``Aggregation``)."""

    def deco(divisor: Divisor) -> Divisor:
        AGGREGATIONS[name] = Aggregation(divisor, per_sequence, needs_normalization_constant, batch_tokens)
        return divisor

    return deco


@register_aggregation("sequence", per_sequence=True)
def _per_sequence_tokens(n_tokens: Number, batch_size: int, normalization_constant: float | None) -> Number:
    n = n_tokens.clamp(min=1) if isinstance(n_tokens, torch.Tensor) else max(n_tokens, 1)
    return n * batch_size


@register_aggregation("constant", per_sequence=False, needs_normalization_constant=True)
def _fixed_constant(n_tokens: Number, batch_size: int, normalization_constant: float | None) -> Number:
    if normalization_constant is None:  # get_aggregation refuses this before any call reaches here
        raise ValueError("loss_normalization='constant' needs a normalization_constant")
    return normalization_constant


@register_aggregation("token", per_sequence=False, batch_tokens=True)
def _batch_tokens(n_tokens: Number, batch_size: int, normalization_constant: float | None) -> Number:
    if normalization_constant is not None:  # the train step's count over the whole batch
        return normalization_constant
    # Called on one batch directly: its own token count (n_tokens per sequence, or the mean per sequence).
    total = n_tokens.sum() if isinstance(n_tokens, torch.Tensor) else n_tokens * batch_size
    return total.clamp(min=1) if isinstance(total, torch.Tensor) else max(total, 1)


def get_aggregation(name: str, normalization_constant: float | None = None) -> Aggregation:
    """The registered aggregation ``name``, after checking it has the constant it needs (ValueError if not)."""
    if name not in AGGREGATIONS:
        raise ValueError(
            f"unknown loss_normalization {name!r}: choose one of {', '.join(map(repr, AGGREGATIONS))} "
            "or register your own with rlvr.grpo.register_aggregation"
        )
    aggregation = AGGREGATIONS[name]
    if aggregation.needs_normalization_constant and (normalization_constant is None or normalization_constant <= 0):
        raise ValueError(
            f"loss_normalization={name!r} needs a positive normalization_constant "
            "(Dr. GRPO: rollout batch size × max generation length, fixed for all of training)"
        )
    return aggregation


def aggregate_loss_across_microbatch(
    per_token_policy_gradient_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_normalization: str = "sequence",
    normalization_constant: float | None = None,
) -> torch.Tensor:
    loss = per_token_policy_gradient_loss
    m = mask.to(device=loss.device, dtype=loss.dtype)
    if m.shape != loss.shape:
        raise ValueError(f"mask has shape {tuple(m.shape)} but the loss has shape {tuple(loss.shape)}; they must match")
    aggregation = get_aggregation(loss_normalization, normalization_constant)
    if aggregation.per_sequence:
        # The batch is this microbatch: the mean over its sequences of each one's divided sum.
        per_seq = (loss * m).sum(dim=-1) / aggregation.divisor(m.sum(dim=-1), 1, normalization_constant)
        return per_seq.mean()
    return (loss * m).sum() / aggregation.divisor(m.sum(dim=-1), loss.shape[0], normalization_constant)
