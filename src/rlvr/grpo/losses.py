"""Per-token policy-gradient losses, one per importance-reweighting method.

Every method returns the **negative** objective per token (B, T), so minimising it ascends the
objective. ``A`` is one advantage per sequence, broadcast over tokens; ``w_t = exp(logp_t - old_t)``
is the token ratio between the current policy and the one that sampled the rollout.

============  ==========================================================================================
``none``      ``-A * logp_t`` — REINFORCE with a baseline (on-policy: w = 1, so this has the gradient
              of ``noclip``).
``noclip``    ``-A * w_t`` — unclipped importance sampling (off-policy, unbiased, high variance).
``ppo_clip``  ``-min(A w_t, A clip(w_t, 1-eps_low, 1+eps_high))`` — PPO's clipped surrogate per token
              (Schulman et al. 2017; GRPO, Shao et al. 2024); ``grpo`` is another name for it. With
              ``eps_high > eps_low`` it is DAPO's clip-higher (Yu et al. 2025, section 3.1: 0.2 / 0.28).
``gspo``      per sequence ``s = exp(mean_t (logp_t - old_t))`` over response tokens (the geometric
              mean of the token ratios), ``-min(A s, A clip(s, 1-eps_low, 1+eps_high))`` broadcast to every
              token (GSPO, Zheng et al. 2025; their eps is ~3e-4 because s is a per-token average).
``cispo``     ``-sg(min(w_t, 1+eps_high)) * A * logp_t`` — clip the weight, not the update, so clipped
              tokens keep a gradient (CISPO, MiniMax-M1, 2025).
============  ==========================================================================================

The clip range is one number ``eps`` (symmetric) or a pair ``(eps_low, eps_high)``. A method registered
with ``asymmetric_clip=True`` receives the pair (a number ``eps`` arrives as ``(eps, eps)``); the others
receive one number and refuse a pair whose sides differ.

The clip fraction is the share of response tokens (sequences for ``gspo``) where the clipped branch
is the one taken, i.e. where the clipped term is strictly smaller than the unclipped one.

A new method is a function registered with ``register_reweighting``; it is then selectable by name in
``compute_policy_gradient_loss``, ``grpo_train_step``, configs and sweeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ReweightFn = Callable[..., tuple[torch.Tensor, dict]]
ClipRange = float | tuple[float, float]


@dataclass(frozen=True)
class Reweighting:
    fn: ReweightFn
    """``fn(A (B,1), logp (B,T), old (B,T)|None, cliprange|None, mask (B,T) bool|None)``; ``cliprange`` is a
    float, or the pair ``(eps_low, eps_high)`` for a method with ``asymmetric_clip``. An argument is None
    only for a method that does not need it: ``validate_reweighting`` refuses a call without it."""
    needs_old_log_probs: bool = False
    needs_cliprange: bool = False
    needs_response_mask: bool = False
    asymmetric_clip: bool = False


REWEIGHTINGS: dict[str, Reweighting] = {}


def register_reweighting(
    name: str,
    needs_old_log_probs: bool = True,
    needs_cliprange: bool = False,
    needs_response_mask: bool = False,
    asymmetric_clip: bool = False,
) -> Callable[[ReweightFn], ReweightFn]:
    """Decorator registering ``fn`` as an importance-reweighting method selectable by ``name``.

    ``fn`` must return a per-token loss that is zero (with zero gradient) for a sequence whose
    advantage is zero: the train step skips such sequences entirely. ``asymmetric_clip``: ``fn``
    receives the clip range as the pair ``(eps_low, eps_high)``.
    """

    def deco(fn: ReweightFn) -> ReweightFn:
        REWEIGHTINGS[name] = Reweighting(fn, needs_old_log_probs, needs_cliprange, needs_response_mask, asymmetric_clip)
        return fn

    return deco


def _clip_stats(clipped: torch.Tensor, mask: torch.Tensor | None) -> dict:
    clipped = clipped.float()
    if mask is None:
        count, total = clipped.sum(), torch.tensor(float(clipped.numel()), device=clipped.device)
    else:
        m = mask.to(clipped.dtype)
        count, total = (clipped * m).sum(), m.sum()
    return {
        "clip_fraction": (count / total.clamp(min=1)).detach(),
        "clip_count": count.detach(),
        "clip_total": total.detach(),
    }


@register_reweighting("none", needs_old_log_probs=False)
def _reinforce(
    A: torch.Tensor, logp: torch.Tensor, old: torch.Tensor | None, eps: float | None, mask: torch.Tensor | None
) -> tuple[torch.Tensor, dict]:
    return -A * logp, {}


# The methods below are typed with what their needs_* flags guarantee they receive.


@register_reweighting("noclip")
def _noclip(
    A: torch.Tensor, logp: torch.Tensor, old: torch.Tensor, eps: float | None, mask: torch.Tensor | None
) -> tuple[torch.Tensor, dict]:
    ratio = torch.exp(logp - old)
    return -A * ratio, {"ratio_mean": _masked_mean(ratio, mask).detach()}


@register_reweighting("ppo_clip", needs_cliprange=True, asymmetric_clip=True)
def _ppo_clip(
    A: torch.Tensor,
    logp: torch.Tensor,
    old: torch.Tensor,
    eps: tuple[float, float],
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, dict]:
    low, high = eps
    ratio = torch.exp(logp - old)
    unclipped = A * ratio
    clipped = A * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    meta = _clip_stats(clipped < unclipped, mask)
    meta["ratio_mean"] = _masked_mean(ratio, mask).detach()
    return -torch.minimum(unclipped, clipped), meta


# The method's first name, which it shares with the preset ``grpo``; configs that use it keep working.
REWEIGHTING_ALIASES = {"grpo": "ppo_clip"}
for _alias, _name in REWEIGHTING_ALIASES.items():
    REWEIGHTINGS[_alias] = REWEIGHTINGS[_name]


@register_reweighting("gspo", needs_cliprange=True, needs_response_mask=True, asymmetric_clip=True)
def _gspo(
    A: torch.Tensor,
    logp: torch.Tensor,
    old: torch.Tensor,
    eps: tuple[float, float],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict]:
    low, high = eps
    m = mask.to(logp.dtype)
    n_tokens = m.sum(dim=1, keepdim=True).clamp(min=1)
    log_s = ((logp - old) * m).sum(dim=1, keepdim=True) / n_tokens
    s = torch.exp(log_s)
    unclipped = A * s
    clipped = A * torch.clamp(s, 1.0 - low, 1.0 + high)
    has_tokens = mask.any(dim=1, keepdim=True)
    meta = _clip_stats(clipped < unclipped, has_tokens)
    meta["ratio_mean"] = s[has_tokens].mean().detach() if has_tokens.any() else s.new_ones(())
    per_seq = -torch.minimum(unclipped, clipped)
    return per_seq.expand_as(logp), meta


@register_reweighting("cispo", needs_cliprange=True, asymmetric_clip=True)
def _cispo(
    A: torch.Tensor,
    logp: torch.Tensor,
    old: torch.Tensor,
    eps: tuple[float, float],
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, dict]:
    high = eps[1]  # CISPO bounds the weight from above only
    ratio = torch.exp(logp - old)
    weight = torch.clamp(ratio, max=1.0 + high).detach()
    meta = _clip_stats(ratio > 1.0 + high, mask)
    meta["ratio_mean"] = _masked_mean(ratio, mask).detach()
    return -weight * A * logp, meta


def _masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def clip_bounds(cliprange: ClipRange) -> tuple[float, float]:
    """``(eps_low, eps_high)`` of a clip range given as one number (symmetric) or as the pair."""
    if isinstance(cliprange, (tuple, list)):
        low, high = cliprange
        return float(low), float(high)
    return float(cliprange), float(cliprange)


def validate_reweighting(
    name: str,
    old_log_probs: torch.Tensor | None,
    cliprange: ClipRange | None,
    response_mask: torch.Tensor | None = None,
    check_mask: bool = True,
) -> Reweighting:
    """The registered method ``name``, after checking it has the arguments it needs (ValueError if not)."""
    if name not in REWEIGHTINGS:
        raise ValueError(
            f"unknown importance_reweighting_method {name!r}: choose one of {sorted(REWEIGHTINGS)} "
            "or register your own with rlvr.grpo.register_reweighting"
        )
    method = REWEIGHTINGS[name]
    if method.needs_old_log_probs and old_log_probs is None:
        raise ValueError(
            f"importance_reweighting_method={name!r} needs old_log_probs (the sampling policy's log-probs, "
            "shape (B, T)); pass them, or use 'none' for on-policy training"
        )
    if method.needs_cliprange and cliprange is None:
        raise ValueError(
            f"importance_reweighting_method={name!r} needs cliprange (e.g. 0.2 for ppo_clip, 3e-4 for gspo)"
        )
    if check_mask and method.needs_response_mask and response_mask is None:
        raise ValueError(
            f"importance_reweighting_method={name!r} needs response_mask (B, T) to average over response tokens"
        )
    if cliprange is not None:
        low, high = clip_bounds(cliprange)
        if low <= 0 or high <= 0:
            raise ValueError(f"cliprange must be > 0 on both sides, got {cliprange}")
        if low != high and not method.asymmetric_clip:
            raise ValueError(
                f"importance_reweighting_method={name!r} clips symmetrically; give one cliprange, not "
                f"({low}, {high}) (asymmetric clipping applies to ppo_clip, gspo and cispo)"
            )
    return method


def method_cliprange(method: Reweighting, cliprange: ClipRange | None) -> ClipRange | None:
    """The clip range in the form ``method.fn`` receives it: the pair, or one number."""
    if cliprange is None:
        return None
    return clip_bounds(cliprange) if method.asymmetric_clip else clip_bounds(cliprange)[0]


def compute_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    importance_reweighting_method: str = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: ClipRange | None = None,
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Per-token loss (B, T) and metadata for one reweighting method (see the module docstring).

    ``raw_rewards_or_advantages`` has shape (B,) or (B, 1). ``old_log_probs`` may be longer than
    ``policy_log_probs`` along T (it is cut to T). Raises ``ValueError`` naming the missing or
    unsupported argument.
    """
    method = validate_reweighting(importance_reweighting_method, old_log_probs, cliprange, response_mask)
    logp = policy_log_probs
    A = torch.as_tensor(raw_rewards_or_advantages).to(device=logp.device, dtype=logp.dtype)
    if A.dim() == 1:
        A = A.unsqueeze(-1)
    if A.shape != (logp.shape[0], 1):
        raise ValueError(f"advantages must have shape (B,) or (B, 1) with B={logp.shape[0]}, got {tuple(A.shape)}")
    old = None
    if old_log_probs is not None and method.needs_old_log_probs:
        if old_log_probs.shape[0] != logp.shape[0] or old_log_probs.shape[1] < logp.shape[1]:
            raise ValueError(
                f"old_log_probs has shape {tuple(old_log_probs.shape)}; it needs shape (B, T') with B={logp.shape[0]} "
                f"and T' >= T={logp.shape[1]}"
            )
        old = old_log_probs[:, : logp.shape[1]].to(device=logp.device, dtype=logp.dtype)
    mask = response_mask.to(logp.device).bool() if response_mask is not None else None
    return method.fn(A, logp, old, method_cliprange(method, cliprange), mask)
