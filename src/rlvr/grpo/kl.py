"""KL to a frozen reference policy, per token, and the reference itself.

With ``x = logp - ref_logp`` (the policy's and the reference's log-probs of the sampled token), and
``r = exp(-x) = p_ref / p``, the three estimators of KL(p || p_ref) named by Schulman (2020,
"Approximating KL Divergence") are

=============  ================================  ==============================================
``k1`` (kl)    ``x``                             unbiased, can be negative, high variance
``k2`` (mse)   ``x^2 / 2``                       biased, low variance, gradient x (a squared error)
``k3``         ``r - 1 - log r = exp(-x) - 1 + x``  unbiased, always >= 0, low variance
(low_var_kl)
=============  ================================  ==============================================

``k3`` clamps ``-x`` to [-20, 20] before the exponential and its result to [-10, 10], as verl does
(``kl_penalty`` in ``verl/trainer/ppo/core_algos.py``), so one token far from the reference cannot make
the loss overflow. The names in parentheses are verl's.

A run adds ``kl_coef * kl_t`` to every token's loss before aggregation (``kl_in: loss``, as GRPO and
TRL do) or subtracts ``kl_coef * sum_t kl_t`` from each sequence's reward (``kl_in: reward``, as
PPO-RLHF does). ``Reference`` is what the train step runs for the reference's log-probs: a frozen
copy of the initial policy, or the policy itself with its LoRA adapters turned off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

KlFn = Callable[[torch.Tensor], torch.Tensor]
"""``fn(x)``: the per-token estimate from the log-ratio ``x = logp - ref_logp`` (B, T)."""

K3_LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0


def _k1(x: torch.Tensor) -> torch.Tensor:
    return x


def _k2(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x.square()


def _k3(x: torch.Tensor) -> torch.Tensor:
    log_r = (-x).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (torch.exp(log_r) - 1.0 - log_r).clamp(-K3_BOUND, K3_BOUND)


KL_ESTIMATORS: dict[str, KlFn] = {"k1": _k1, "k2": _k2, "k3": _k3}
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_estimator_names() -> list[str]:
    return [*KL_ESTIMATORS, *KL_ALIASES]


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate (B, T) of ``kind`` (``k1``, ``k2``, ``k3`` or the aliases ``kl``, ``mse``,
    ``low_var_kl``) from the policy's and the reference's log-probs (B, T) of the sampled tokens.
    Differentiable in ``logprobs``. ``ValueError`` for an unknown kind."""
    name = KL_ALIASES.get(kind, kind)
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}: choose one of {', '.join(kl_estimator_names())}")
    return KL_ESTIMATORS[name](logprobs - ref_logprobs.to(logprobs.dtype))


@dataclass(frozen=True)
class Reference:
    """The reference policy a train step computes log-probs under (no gradient)."""

    model: torch.nn.Module
    """A frozen copy of the initial policy (plain, or sharded like the policy), or the policy itself."""
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    """Entered around each reference forward: for a LoRA policy, the adapters turned off."""
