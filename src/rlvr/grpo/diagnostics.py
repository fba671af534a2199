"""What an estimator does to the gradient, in numbers: difficulty weighting and importance ratios.

**Difficulty weighting.** A sample's tokens enter the loss as ``-A_i * a_i * log p`` with ``a_i`` the
aggregation's per-token coefficient (``1 / (B n_i)`` for ``sequence`` normalisation over a batch of
B sequences, ``1 / C`` for ``constant``). The *gradient weight* of a group is the sum of the
absolute coefficients over its tokens, ``W = sum_i |A_i| n_i a_i``: how hard the update pulls on that
prompt, before the per-token scores. With binary rewards a group with k successes out of G has pass
rate p = k / G, and its *advantage mass* ``sum_i |A_i|`` has a closed form for every (baseline,
normalizer) pair, split into the part on correct samples and the part on incorrect ones:

======================  ==================================  ===================================
baseline / normalizer   on correct samples                  on incorrect samples
======================  ==================================  ===================================
mean / none (Dr. GRPO)  G p (1 - p)                         G p (1 - p)
mean / std (GRPO)       G p (1 - p) / (s + eps)             G p (1 - p) / (s + eps)
mean / mean (MaxRL)     G p (1 - p) / (p + eps)             G p (1 - p) / (p + eps)
none / none (RFT)       G p                                 0
======================  ==================================  ===================================

with ``s = sqrt(G p (1 - p) / (G - 1))`` the unbiased group std. Summed: ``2 G p (1 - p)``,
``2 sqrt(G (G - 1)) sqrt(p (1 - p))`` (eps -> 0), ``2 G (1 - p)`` (p > 0) and ``G p``. Then
``W = (mass_correct + mass_incorrect) / B`` under ``sequence`` normalisation and
``W = (mass_correct * n_correct + mass_incorrect * n_incorrect) / C`` under ``constant``, where
n_correct and n_incorrect are the mean response lengths of the group's correct and incorrect samples;
both are exact. ``docs/theory.md`` derives them. A custom (baseline, normalizer) pair gets its
closed form with ``register_advantage_mass``.

**Importance ratios.** ``importance_statistics`` summarises the token ratios ``w = exp(logp - old)``
and the sequence ratios ``s = exp(mean_t (logp - old))`` (GSPO's) of one optimizer step: quantiles,
the share of tokens (sequences) on which a PPO clip of ``token_eps`` (a GSPO clip of ``seq_eps``)
would take the clipped branch, and two sample estimates of the per-token KL(old || current) over the
sampled tokens: ``k1 = mean(-log w)`` (unbiased, can be negative) and ``k3 = mean(w - 1 - log w)``
(unbiased and never negative, since E_old[w] = 1; Schulman 2020, "Approximating KL divergence").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from rlvr.grpo.aggregate import get_aggregation
from rlvr.grpo.presets import DEFAULT_CLIPRANGE

MassFn = Callable[[int, float, float], tuple[float, float]]
"""``fn(group_size, p, eps) -> (mass on correct samples, mass on incorrect samples)`` for binary rewards."""

ADVANTAGE_MASS: dict[tuple[str, str], MassFn] = {}


def register_advantage_mass(baseline: str, normalizer: str) -> Callable[[MassFn], MassFn]:
    """Decorator: the closed-form advantage mass of (``baseline``, ``normalizer``) for binary rewards,
    ``fn(G, p, eps) -> (sum of |A| over correct samples, sum over incorrect samples)``."""

    def deco(fn: MassFn) -> MassFn:
        ADVANTAGE_MASS[(baseline, normalizer)] = fn
        return fn

    return deco


def _centred_mass(G: int, p: float) -> float:
    # Mean baseline: the k correct samples have A = (1 - p) / d and the G - k incorrect ones -p / d, so
    # each side sums to G p (1 - p) / d (the advantages sum to zero).
    return G * p * (1.0 - p)


@register_advantage_mass("mean", "none")
def _mass_mean_none(G: int, p: float, eps: float) -> tuple[float, float]:
    m = _centred_mass(G, p)
    return m, m


@register_advantage_mass("loo", "none")
def _mass_loo_none(G: int, p: float, eps: float) -> tuple[float, float]:
    if G < 2:
        raise ValueError("the leave-one-out baseline needs group_size >= 2")
    m = G / (G - 1) * _centred_mass(G, p)  # the leave-one-out advantage is G / (G - 1) times the centred one
    return m, m


@register_advantage_mass("mean", "std")
def _mass_mean_std(G: int, p: float, eps: float) -> tuple[float, float]:
    if G < 2:
        raise ValueError("the std normalizer needs group_size >= 2")
    m = _centred_mass(G, p)
    if m == 0.0:
        return 0.0, 0.0
    std = math.sqrt(G * p * (1.0 - p) / (G - 1))  # unbiased: sum of squared deviations G p (1 - p), over G - 1
    return m / (std + eps), m / (std + eps)


@register_advantage_mass("mean", "mean")
def _mass_mean_mean(G: int, p: float, eps: float) -> tuple[float, float]:
    m = _centred_mass(G, p)
    if m == 0.0:
        return 0.0, 0.0
    return m / (p + eps), m / (p + eps)


@register_advantage_mass("none", "none")
def _mass_none_none(G: int, p: float, eps: float) -> tuple[float, float]:
    return G * p, 0.0


def advantage_mass(
    baseline: str, normalizer: str, group_size: int, successes: int, eps: float = 0.0
) -> tuple[float, float]:
    """Closed-form ``(sum |A| over correct samples, over incorrect ones)`` of a group of ``group_size``
    binary rewards with ``successes`` ones. ``ValueError`` for a pair without a registered closed form."""
    if not 0 <= successes <= group_size:
        raise ValueError(f"successes must be in [0, {group_size}], got {successes}")
    try:
        fn = ADVANTAGE_MASS[(baseline, normalizer)]
    except KeyError:
        raise ValueError(
            f"no closed-form advantage mass for baseline={baseline!r}, normalizer={normalizer!r}; "
            f"known: {sorted(ADVANTAGE_MASS)} (add one with register_advantage_mass)"
        ) from None
    return fn(group_size, successes / group_size, eps)


def token_coefficient(
    loss_normalization: str, n_tokens: float, batch_size: int, normalization_constant: float | None
) -> float:
    """The aggregation's weight on one token of an ``n_tokens``-token response in a batch of ``batch_size``."""
    aggregation = get_aggregation(loss_normalization, normalization_constant)
    return float(1.0 / aggregation.divisor(n_tokens, batch_size, normalization_constant))


def group_gradient_weight(
    advantages: Sequence[float],
    n_tokens: Sequence[float],
    loss_normalization: str,
    batch_size: int,
    normalization_constant: float | None = None,
) -> float:
    """Measured ``W = sum_i |A_i| n_i a_i`` of one group (see the module docstring)."""
    if len(advantages) != len(n_tokens):
        raise ValueError(f"{len(advantages)} advantages but {len(n_tokens)} lengths; pass one of each per sample")
    return sum(
        abs(a) * n * token_coefficient(loss_normalization, n, batch_size, normalization_constant)
        for a, n in zip(advantages, n_tokens)
    )


def predicted_group_weight(
    baseline: str,
    normalizer: str,
    group_size: int,
    successes: int,
    loss_normalization: str,
    batch_size: int,
    normalization_constant: float | None = None,
    eps: float = 0.0,
    correct_length: float = 0.0,
    incorrect_length: float = 0.0,
) -> float:
    """The closed-form ``W`` of a group with ``successes`` of ``group_size`` correct: exact under
    ``sequence`` normalisation; under ``constant`` exact when the lengths are the group's mean lengths
    of correct and incorrect responses (a prediction when they are a run's averages)."""
    on_correct, on_incorrect = advantage_mass(baseline, normalizer, group_size, successes, eps)
    if loss_normalization == "sequence":
        return (on_correct + on_incorrect) / batch_size
    return (on_correct * correct_length + on_incorrect * incorrect_length) * token_coefficient(
        loss_normalization, 1, batch_size, normalization_constant
    )


# --- importance ratios per optimizer step -------------------------------------------------------------

RATIO_QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def _default_clip(loss: str) -> float:
    eps = DEFAULT_CLIPRANGE[loss]
    if eps is None:
        raise ValueError(f"DEFAULT_CLIPRANGE[{loss!r}] is None; the logged clip fractions need a clip range")
    return eps


TOKEN_EPS = _default_clip("ppo_clip")
"""Reference band of the token clip fraction logged for every method (PPO's default)."""
SEQ_EPS = _default_clip("gspo")
"""Reference band of the sequence clip fraction logged for every method (GSPO's default)."""


def _quantile_name(q: float) -> str:
    return f"q{round(q * 100):02d}"


def _summary(prefix: str, ratio: torch.Tensor) -> dict[str, float]:
    x = ratio.double()
    qs = torch.quantile(x, torch.tensor(RATIO_QUANTILES, dtype=x.dtype, device=x.device)).tolist()
    out = {f"{prefix}_{_quantile_name(q)}": v for q, v in zip(RATIO_QUANTILES, qs)}
    out.update({f"{prefix}_min": x.min().item(), f"{prefix}_max": x.max().item(), f"{prefix}_mean": x.mean().item()})
    return out


def _clip_taken(ratio: torch.Tensor, adv: torch.Tensor, eps: float) -> torch.Tensor:
    # min(A w, A clip(w)) takes the clipped branch when A > 0 and w > 1 + eps, or A < 0 and w < 1 - eps.
    return ((adv > 0) & (ratio > 1 + eps)) | ((adv < 0) & (ratio < 1 - eps))


def importance_statistics(
    token_log_ratio: torch.Tensor,
    token_advantage: torch.Tensor,
    seq_log_ratio: torch.Tensor,
    seq_advantage: torch.Tensor,
    token_eps: float = TOKEN_EPS,
    seq_eps: float = SEQ_EPS,
) -> dict[str, float]:
    """Ratios of one optimizer step: ``token_log_ratio`` (N,) is ``logp - old`` of every response token
    that went through the model and ``token_advantage`` (N,) its sequence's advantage; ``seq_log_ratio``
    (S,) the mean log-ratio of each sequence, ``seq_advantage`` (S,) its advantage. Returns floats:
    ``token_ratio_q01 .. q99 / min / max / mean`` and the same for ``seq_ratio``, ``token_clip_frac``,
    ``seq_clip_frac``, ``kl_k1``, ``kl_k3``, ``n_tokens``, ``n_sequences``. Empty input gives ``{}``."""
    if token_log_ratio.numel() == 0 or seq_log_ratio.numel() == 0:
        return {}
    lr = token_log_ratio.detach().double().flatten()
    w = torch.exp(lr)
    s = torch.exp(seq_log_ratio.detach().double().flatten())
    out: dict[str, float] = {"n_tokens": int(lr.numel()), "n_sequences": int(s.numel())}
    out.update(_summary("token_ratio", w))
    out.update(_summary("seq_ratio", s))
    out["token_clip_frac"] = (
        _clip_taken(w, token_advantage.detach().flatten().to(w.device), token_eps).double().mean().item()
    )
    out["seq_clip_frac"] = _clip_taken(s, seq_advantage.detach().flatten().to(s.device), seq_eps).double().mean().item()
    out["kl_k1"] = (-lr).mean().item()
    out["kl_k3"] = (w - 1 - lr).mean().item()
    return out


def update_record(loss: float, meta: dict) -> dict:
    """One optimizer step's diagnostics for the run log: importance statistics (when the update saw old
    log-probs), entropy, gradient norm, loss, the method's own clip fraction and the KL to the reference. Non-finite values
    become None so the record stays valid JSON."""
    record = dict(meta.get("importance", {}))
    record.update(
        {
            "loss": float(loss),
            "grad_norm": meta.get("grad_norm"),
            "entropy": meta.get("entropy") if meta.get("n_tokens") else None,
            "n_trained_tokens": meta.get("n_tokens", 0),
            "skipped_nonfinite": bool(meta.get("skipped_nonfinite")),
        }
    )
    if "clip_fraction" in meta:
        record["clip_fraction"] = meta["clip_fraction"]
    if "kl_ref" in meta:
        record["kl_ref"] = meta["kl_ref"]
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
