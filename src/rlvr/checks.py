"""The checks of a training config against the rest of rlvr, run by each command before anything loads.

``rlvr.config`` knows its own fields only. What a value may be that a registry or another package
decides is checked here, one module above the pieces it checks: the estimator names (``rlvr.grpo``'s
registries, which plugins extend), the engine names, the sizes of a fresh model, the task's prompt,
data and reward (``rlvr.task.build``) and the number of processes. ``resolve_config`` fills the
defaults that follow from other fields and those registries; ``validate_config`` reports every problem
found here and in ``TrainConfig.validate`` together.
"""

from __future__ import annotations

import dataclasses

import torch

from rlvr.config import ConfigError, TrainConfig
from rlvr.distributed.world import check_prompts_divisible
from rlvr.engines import engine_names
from rlvr.environments import env_problems
from rlvr.grpo import (
    AGGREGATIONS,
    BASELINES,
    DEFAULT_CLIPRANGE,
    NORMALIZERS,
    PRESETS,
    REWEIGHTINGS,
    kl_estimator_names,
)
from rlvr.modeling import MODEL_SIZES
from rlvr.task.build import task_config_problems


def resolve_config(config: TrainConfig) -> TrainConfig:
    """A copy of ``config`` with every default that depends on other fields filled in: the preset's axes, the
    clip range of the reweighting method, the Dr. GRPO normalisation constant, the devices (idempotent)."""
    r = config.rollout
    if r.rollout_batch_size is not None:
        if r.group_size < 1 or r.rollout_batch_size % r.group_size:
            raise ConfigError(
                f"rollout.rollout_batch_size={r.rollout_batch_size} is not divisible by rollout.group_size={r.group_size}; "
                "make it a multiple of the group size (or set rollout.n_prompts_per_rollout_batch instead)"
            )
        r = dataclasses.replace(
            r, n_prompts_per_rollout_batch=r.rollout_batch_size // r.group_size, rollout_batch_size=None
        )
    a = config.algorithm
    if a.preset not in PRESETS:
        raise ConfigError(f"unknown algorithm.preset {a.preset!r}: choose one of {', '.join(sorted(PRESETS))}")
    preset = PRESETS[a.preset]
    cfg = dataclasses.replace(config, rollout=r)
    o = cfg.optim
    train_batch_size = cfg.rollout_batch_size if o.train_batch_size is None else o.train_batch_size
    o = dataclasses.replace(o, train_batch_size=train_batch_size)
    if a.cliprange is not None and a.cliprange_low is not None and a.cliprange != a.cliprange_low:
        raise ConfigError(
            f"algorithm.cliprange={a.cliprange} and algorithm.cliprange_low={a.cliprange_low} disagree; "
            "set cliprange (both sides) or cliprange_low/cliprange_high, not both"
        )
    cliprange_low = next(
        (c for c in (a.cliprange_low, a.cliprange, DEFAULT_CLIPRANGE.get(a.reweighting)) if c is not None), None
    )
    a = dataclasses.replace(
        a,
        baseline=a.baseline or preset.baseline,
        advantage_normalizer=a.advantage_normalizer or preset.advantage_normalizer,
        loss_normalization=a.loss_normalization or preset.loss_normalization,
        cliprange=cliprange_low,
        cliprange_low=cliprange_low,
        cliprange_high=a.cliprange_high if a.cliprange_high is not None else cliprange_low,
    )
    aggregation = AGGREGATIONS.get(a.loss_normalization or "")
    if a.normalization_constant is None and aggregation is not None and aggregation.needs_normalization_constant:
        # Dr. GRPO: batch size x max generation length, where the batch is what one optimizer
        # step sees; on-policy that is the rollout batch.
        a = dataclasses.replace(a, normalization_constant=float(train_batch_size * r.max_new_tokens))
    if o.logprob_batch_size is None and o.gradient_accumulation_steps >= 1:
        o = dataclasses.replace(o, logprob_batch_size=max(1, train_batch_size // o.gradient_accumulation_steps))
    policy_device = cfg.policy_device
    engine = cfg.engine
    if policy_device == "auto" or engine.device == "auto":
        n_gpu = torch.cuda.device_count()
        if policy_device == "auto":
            policy_device = "cuda:0" if n_gpu else "cpu"
        if engine.device == "auto":
            engine = dataclasses.replace(
                engine, device="cuda:1" if n_gpu >= 2 and engine.name != "hf" else policy_device
            )
    return dataclasses.replace(cfg, algorithm=a, optim=o, policy_device=policy_device, engine=engine)


def registry_problems(config: TrainConfig) -> list[str]:
    """What is wrong with the names that registries and other packages decide (one line each)."""
    problems: list[str] = []
    a = config.algorithm

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    need(a.baseline in BASELINES, f"unknown algorithm.baseline {a.baseline!r}: choose one of {sorted(BASELINES)}")
    need(
        a.advantage_normalizer in NORMALIZERS,
        f"unknown algorithm.advantage_normalizer {a.advantage_normalizer!r}: choose one of {sorted(NORMALIZERS)}",
    )
    need(
        a.loss_normalization in AGGREGATIONS,
        f"unknown algorithm.loss_normalization {a.loss_normalization!r}: use {' or '.join(AGGREGATIONS)}",
    )
    need(
        a.reweighting in REWEIGHTINGS,
        f"unknown algorithm.reweighting {a.reweighting!r}: choose one of {sorted(REWEIGHTINGS)}",
    )
    reweighting = REWEIGHTINGS.get(a.reweighting)
    if reweighting is not None:
        need(
            not reweighting.needs_cliprange or a.cliprange is not None,
            f"algorithm.reweighting={a.reweighting!r} clips, so it needs algorithm.cliprange (e.g. 0.2)",
        )
        need(
            a.cliprange_high is None or a.cliprange_high == a.cliprange_low or reweighting.asymmetric_clip,
            f"algorithm.reweighting={a.reweighting!r} does not clip asymmetrically; drop "
            "algorithm.cliprange_high or use ppo_clip, gspo or cispo",
        )
        need(
            config.engine.max_staleness != 1 or reweighting.needs_old_log_probs,
            "engine.max_staleness=1 samples every batch with weights one step old, and "
            f"algorithm.reweighting={a.reweighting!r} does not correct for that. Set algorithm.reweighting to "
            "grpo (also called ppo_clip: PPO token clip, cliprange 0.2), noclip, gspo or cispo (or max_staleness=0)",
        )
    need(
        a.kl_estimator in kl_estimator_names(),
        f"unknown algorithm.kl_estimator {a.kl_estimator!r}: choose one of {', '.join(kl_estimator_names())}",
    )
    if a.loss_normalization in AGGREGATIONS and AGGREGATIONS[a.loss_normalization].needs_normalization_constant:
        need(
            a.normalization_constant is not None and a.normalization_constant > 0,
            f"algorithm.loss_normalization={a.loss_normalization} needs a positive algorithm.normalization_constant "
            "(Dr. GRPO: train batch size x max_new_tokens)",
        )
    problems += task_config_problems(config)
    problems += env_problems(config)
    e = config.engine
    need(e.name in engine_names(), f"unknown engine.name {e.name!r}: choose one of {', '.join(engine_names())}")
    need(
        config.model.fresh is None or config.model.fresh in MODEL_SIZES,
        f"unknown model.fresh size {config.model.fresh!r}: choose one of {sorted(MODEL_SIZES)}",
    )
    return problems


def validate_config(config: TrainConfig) -> list[str]:
    """``TrainConfig.validate`` with the problems of ``registry_problems``: raise ``ConfigError`` naming
    every problem; return (and emit) the warnings. Call on a resolved config (``resolve_config``)."""
    return config.validate(registry_problems(config))


def check_world(config: TrainConfig, world_size: int) -> None:
    """Checks that need the number of processes (after the process group starts, before the model loads)."""
    strategy = config.data_parallel_strategy(world_size)
    if world_size == 1 and strategy != "fsdp":
        return
    if strategy == "none":
        raise ConfigError(
            f"torchrun started {world_size} processes but distributed.strategy is none; set it to ddp or fsdp "
            "(or auto), or run one process"
        )
    check_prompts_divisible(config.rollout.n_prompts_per_rollout_batch, world_size)
    problems = []
    if config.engine.name in ("hf-worker", "vllm") or config.engine.max_staleness:
        problems.append(
            f"engine.name={config.engine.name} (max_staleness={config.engine.max_staleness}) with several trainer "
            "processes: each rank samples its share with an in-process engine; use engine.name hf, hf-fast or auto "
            "(see docs/scaling.md)"
        )
    if config.algorithm.kl_reference_device is not None:
        problems.append(
            "algorithm.kl_reference_device places the reference in one process; with several ranks it sits on "
            "each rank's device: drop the setting"
        )
    if config.model.compile:
        problems.append(
            "model.compile trains through a compiled stand-in for the decoder that bypasses the data-parallel "
            "wrapper; set model.compile false under ddp or fsdp"
        )
    if config.log.gradient_variance_every:
        problems.append("log.gradient_variance_every is a one-process diagnostic; set it to 0 under ddp or fsdp")
    if config.optim.shared_prefix:
        problems.append("optim.shared_prefix packs microbatches in one process; set it false under ddp or fsdp")
    if problems:
        raise ConfigError("; ".join(problems))
