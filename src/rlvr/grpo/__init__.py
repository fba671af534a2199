"""The GRPO math as independent axes: advantages (baseline × normalizer), per-token loss
(reweighting method), aggregation (sequence or constant), each a registry that a plugin extends
(``register_baseline``/``register_normalizer``, ``register_reweighting``, ``register_aggregation``), the KL
to a reference (``kl``), and what an estimator does to the gradient (``diagnostics``: closed-form difficulty weights and
importance-ratio statistics; ``variance``: gradient variance with and without a baseline)."""

from rlvr.grpo.advantages import (
    BASELINES,
    NORMALIZERS,
    compute_group_normalized_rewards,
    compute_rollout_rewards,
    pass_at_k,
    register_baseline,
    register_normalizer,
)
from rlvr.grpo.aggregate import AGGREGATIONS, aggregate_loss_across_microbatch, register_aggregation
from rlvr.grpo.diagnostics import ADVANTAGE_MASS, advantage_mass, importance_statistics, register_advantage_mass
from rlvr.grpo.kl import KL_ESTIMATORS, Reference, kl_estimator_names, kl_penalty
from rlvr.grpo.losses import REWEIGHTINGS, compute_policy_gradient_loss, register_reweighting
from rlvr.grpo.presets import DEFAULT_CLIPRANGE, PRESETS, Preset, get_preset
from rlvr.grpo.variance import gradient_variance

__all__ = [
    "BASELINES",
    "NORMALIZERS",
    "REWEIGHTINGS",
    "AGGREGATIONS",
    "register_aggregation",
    "PRESETS",
    "DEFAULT_CLIPRANGE",
    "Preset",
    "get_preset",
    "compute_group_normalized_rewards",
    "compute_rollout_rewards",
    "pass_at_k",
    "register_baseline",
    "register_normalizer",
    "register_reweighting",
    "aggregate_loss_across_microbatch",
    "compute_policy_gradient_loss",
    "ADVANTAGE_MASS",
    "advantage_mass",
    "register_advantage_mass",
    "importance_statistics",
    "gradient_variance",
    "KL_ESTIMATORS",
    "Reference",
    "kl_estimator_names",
    "kl_penalty",
]
