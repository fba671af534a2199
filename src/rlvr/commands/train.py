"""`rlvr train`: the GRPO training loop, on- and off-policy, for every preset and reweighting method.

``train()`` is setup, then one ``_rollout_step`` per step followed by validation, logging and a
checkpoint, then the summary. One rollout step is five phases, each a function below:

1. **rollout** (``_rollout``): the ``Rollouts`` of the run (``rlvr.engines.rollouts``) hand over the
   batch of step s: ``n_prompts_per_rollout_batch`` questions (the data is walked in seeded epoch
   permutations, so the batch of step s is a pure function of (seed, s) and resuming needs nothing
   but s), ``group_size`` responses each with a sampling seed that is a function of (seed, s), and
   their tokenisation;
2. **score** (``_score``): reward every response (a grader that raises stops the run);
3. **advantages** (``_advantages``): group-normalised advantages, and the **old log-probs**:
   off-policy runs (several optimizer steps per rollout batch) compute them once, under the sampling
   weights, before the first update; on-policy runs skip this forward (ratio 1) unless the
   reweighting method insists on receiving them. The rewards behind the advantages lose DAPO's soft
   overlong penalty and a KL in the reward when configured; ``rollout.filter_groups`` first replaces
   the groups without signal (``_fill_groups``), ``algorithm.mask_truncated`` then empties the loss
   mask of cut responses (docs/knobs.md);
4. **update** (``_update``): ``epochs_per_rollout_batch`` passes over minibatches of
   ``train_batch_size`` rollouts, one ``policy_gradient_update`` (one optimizer step, zero-advantage
   rollouts skipped) each, as the run's ``UpdateSpec`` says (with the KL to the run's frozen reference
   and the entropy bonus when configured);
5. **dump** the step's rollouts every ``dump_every`` steps;

then the loop **validates** every ``eval_every`` steps (``_validate``), **logs** one line to
``metrics.jsonl`` and **checkpoints** every ``save_every`` steps (and after the last, unless
``save_at_end`` is false).

**Worker engines** (``hf-worker``: their own process and copy of the weights) get their batches
through ``rlvr.engines.async_rollout.AsyncRollouts``: versioned weight loads with the probe check,
and the old log-probs computed on the worker in the same request as the generation, under the
weights that sampled the batch (so that forward leaves the trainer's GPU). Every other engine gets
them through ``SyncRollouts``, which loads the weights into the engine and generates at the call.
``engine.max_staleness`` says how far rollouts run ahead:

* ``0`` (default): synchronous; batch s is sampled by the weights after step s-1 (on-policy).
* ``1``: one-step-async; the worker generates batch s+1 while the trainer trains on batch s, so batch
  s is sampled by the weights after step s-2 (batches 1 and 2 both by the initial weights) and the
  configured importance reweighting corrects the one step of staleness. On resume from a checkpoint
  at step k, batch k+1 is sampled by the checkpoint's weights (on-policy, staleness 0) because the
  weights of step k-1 are not saved; from batch k+2 on the schedule is the usual one.

Every step logs ``rollout/weight_version`` (optimizer steps behind the weights that sampled the batch)
and ``rollout/staleness`` (the trainer's version minus that one).

The math lives in ``rlvr.grpo``; this module only moves data between the pieces, times them and
keeps the run recoverable: non-finite updates are skipped and counted (too many in a row stop the
run), engine and grader failures stop it with the last checkpoint intact, Ctrl-C or SIGTERM finishes
the current step and saves (a second one abandons the step). ``summary.json`` says how the run
ended (``running`` while it runs, so a killed run never reads as finished). The engine, the rollouts
and the metrics logger are closed on every way out of the run.

**The run directory** is locked while a run writes to it (``rlvr.training.rundir``: a second writer is
refused, naming the holder's pid). ``--resume`` continues from the newest checkpoint that passes
its checksums (``rlvr.training.checkpoint.resumable_checkpoint``); a run that stopped before its first
checkpoint has nothing to resume, so it starts again from step 0, under the config given now.
Extending a run (``--resume DIR --n_steps N`` with N larger than before) recomputes the learning-rate
schedule over the new length: the new steps follow the schedule that an N-step run has from that
point on (with a cosine schedule the lr rises back to the value the longer schedule has there).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast

import torch
import tyro
from tqdm.auto import tqdm

from rlvr.checks import check_world, resolve_config, validate_config
from rlvr.commands.evaluate import evaluate
from rlvr.config import (
    RESUMABLE_CHANGES,
    ConfigError,
    TrainConfig,
    check_moved_flags,
    config_differences,
    load_config_file,
    save_config,
    upgrade_moved_keys,
)
from rlvr.distributed.world import (
    GlobalBatch,
    World,
    current_world,
    gather_objects,
    launched_by_torchrun,
    local_rows,
    rank_prompt_range,
    rank_row_range,
    reduce_values,
    shutdown_distributed,
    start_process_group,
)
from rlvr.distributed.wrap import copy_full_weights, unwrap_model, wrap_model
from rlvr.engines import build_engine, resolve_engine_name
from rlvr.engines.async_rollout import AsyncRollouts
from rlvr.engines.base import Engine, SamplingParams, WorkerEngine
from rlvr.engines.fast import unsupported_reason
from rlvr.engines.rollouts import RolloutBatch, RolloutRequest, Rollouts, SyncRollouts, tokenize_groups
from rlvr.environments import episodes_for, get_environment_entry
from rlvr.environments.rollout import episode_fields, episode_metrics
from rlvr.errors import EngineError, GraderError, NonFiniteError, TrainingError, UserError
from rlvr.experiments.plugins import import_plugins
from rlvr.grpo import REWEIGHTINGS, compute_group_normalized_rewards, pass_at_k
from rlvr.grpo.diagnostics import update_record
from rlvr.grpo.kl import Reference, kl_penalty
from rlvr.grpo.overlong import soft_overlong_penalty, truncated_masked
from rlvr.grpo.variance import gradient_variance, variance_metrics
from rlvr.machine import check_machine
from rlvr.modeling import (
    attention_without_cudnn,
    check_model_source,
    fresh_model,
    load_model_and_tokenizer,
    resolve_dtype,
    tokenizer_corpus,
    train_tokenizer,
)
from rlvr.task.build import (
    build_prompt,
    check_chat_rows,
    check_chat_tokenizer,
    load_task_data,
    prepare_reward,
    set_rewards,
    val_sources,
    validation_metrics,
)
from rlvr.task.data_order import batch_indices, derive_seed
from rlvr.task.rewards import row_fields, score_responses
from rlvr.tokens import context_length, longest_prompt
from rlvr.training.checkpoint import (
    BEST_DIR,
    CKPT_DIR,
    LATEST,
    MODEL_DIR,
    checkpoint_dirs,
    damaged_checkpoints,
    load_model_weights,
    load_trainer_state,
    resumable_checkpoint,
    save_best_model,
    save_checkpoint,
    saved_run_config,
)
from rlvr.training.health import HealthMonitor, HealthWarning
from rlvr.training.interrupts import exit_code, sigterm_as_interrupt
from rlvr.training.logprobs import compile_backbone, compute_log_probs_batched
from rlvr.training.lora import adapters_disabled, apply_lora
from rlvr.training.metrics_log import ROLLOUT_SAMPLES, MetricsLogger, truncate_metrics, write_jsonl
from rlvr.training.optim import lr_factor, lr_schedule, make_adamw
from rlvr.training.rundir import RunDirLock
from rlvr.training.scaffold import TrainCallback, TrainingRun
from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlvr.engines.base import Completion
    from rlvr.environments.rollout import Episodes
    from rlvr.task.data import Example
    from rlvr.task.prompts import Prompt
    from rlvr.task.rewards import Reward

_T = TypeVar("_T")

__all__ = [
    "EngineError",
    "GraderError",
    "NonFiniteError",
    "TrainingError",
    "TrainState",
    "MinibatchSpec",
    "UpdateSpec",
    "lr_factor",
    "main",
    "read_summary",
    "train",
]


# ---------------------------------------------------------------------------------------------
# 1. Building the pieces
# ---------------------------------------------------------------------------------------------


def _resolved(value: _T | None, name: str) -> _T:
    """The value of config field ``name``, which ``resolve_config`` fills; a config that was not resolved
    raises ``ValueError``."""
    if value is None:
        raise ValueError(f"{name} is unset: rlvr train takes a resolved config (rlvr.checks.resolve_config)")
    return value


def _load_policy(
    config: TrainConfig, train_examples: Sequence[Example], device: torch.device, dtype: torch.dtype, ckpt: Path | None
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The policy and tokenizer: from the checkpoint's full weights, or as the config says. With LoRA
    the checkpoint's ``model/`` holds merged weights, so the base model comes from the config (the
    adapters come from the checkpoint's shards) and only the tokenizer from the checkpoint."""

    lora = bool(config.model.lora.rank)
    if ckpt is not None and not lora:
        return load_model_and_tokenizer(ckpt / "model", device=device, dtype=dtype)
    if config.model.fresh is not None:
        if ckpt is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(ckpt / "model"))
        else:
            tokenizer = train_tokenizer(
                tokenizer_corpus(train_examples, config.prompt), vocab_size=config.model.tokenizer_vocab_size
            )
        model: torch.nn.Module = fresh_model(config.model.fresh, tokenizer, seed=config.seed, dtype=dtype)
        return model.to(device), tokenizer
    return load_model_and_tokenizer(config.model.name_or_path, device=device, dtype=dtype, flag="model.name_or_path")


def _initial_policy(
    config: TrainConfig, tokenizer: PreTrainedTokenizerBase, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """The run's initial weights, loaded again from its model source: the KL reference of a resumed run
    (the checkpoint holds the trained weights, not these)."""
    if config.model.fresh is not None:
        model: torch.nn.Module = fresh_model(config.model.fresh, tokenizer, seed=config.seed, dtype=dtype)
        return model.to(device)
    return load_model_and_tokenizer(config.model.name_or_path, device=device, dtype=dtype, flag="model.name_or_path")[0]


def _frozen_reference(initial: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``initial`` as the KL reference: in the model dtype on ``device``, in eval mode, without gradients."""
    initial.to(device=device, dtype=dtype).eval()
    return initial.requires_grad_(False)


def _check_engine_runs_model(config: TrainConfig) -> None:
    """``engine.name: hf-fast`` for a local model it cannot run: a ``ConfigError`` before the weights load
    (from the model's config.json; a hub model is checked once loaded, by the engine)."""
    path = Path(config.model.name_or_path)
    if config.engine.name != "hf-fast" or config.model.fresh is not None or not (path / "config.json").is_file():
        return
    from transformers import AutoConfig

    reason = unsupported_reason(AutoConfig.from_pretrained(str(path)))
    if reason:
        raise ConfigError(f"engine.name hf-fast: {reason}")


def _make_engine(config: TrainConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> Engine:

    if config.engine.name == "auto" and resolve_engine_name("auto", model) == "hf":
        warnings.warn(
            f"engine.name auto runs the hf engine: {unsupported_reason(cast(Any, model).config)}", stacklevel=2
        )
    return build_engine(config.engine, model, tokenizer, served_model=config.model.name_or_path)


def _optimizer_and_scheduler(
    config: TrainConfig, model: torch.nn.Module, device: torch.device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    o = config.optim
    optimizer = make_adamw(
        model.parameters(),
        master_weights=o.master_weights,
        lr=o.lr,
        betas=tuple(o.betas),
        weight_decay=o.weight_decay,
        fused=device.type == "cuda" and not config.distributed.cpu_offload,
    )
    total = config.n_steps * config.updates_per_rollout_batch
    return optimizer, lr_schedule(optimizer, total, o.schedule, o.warmup_steps, o.min_lr_ratio)


@dataclass(frozen=True)
class MinibatchSpec:
    """How each rollout batch is cut into optimizer steps (each taken as the run's ``UpdateSpec`` says):
    read from the config once, at setup."""

    train_batch_size: int
    """Rollouts per optimizer step."""
    epochs: int
    """Passes over each rollout batch."""
    shuffle: bool
    """Minibatches in a seeded random order (off-policy runs); on-policy runs take the batch as it is."""
    uses_old_log_probs: bool
    """The update receives the sampling weights' log-probs: the method needs them, or the run is off-policy
    (its updates log importance ratios even without reweighting)."""

    @classmethod
    def from_config(cls, config: TrainConfig) -> MinibatchSpec:
        return cls(
            train_batch_size=config.train_batch_size,
            epochs=config.optim.epochs_per_rollout_batch,
            shuffle=config.off_policy,
            uses_old_log_probs=REWEIGHTINGS[config.algorithm.reweighting].needs_old_log_probs or config.off_policy,
        )


class EngineWeights:
    """The plain model an in-process rollout engine samples from. A plain policy, or a DDP replica's
    module, is read in place; a sharded (FSDP2) or adapted (LoRA) policy is copied into ``copy`` (full
    weights, LoRA merged, gathered tensor by tensor: every rank calls ``current`` together) whenever
    the optimizer has stepped since the last copy."""

    def __init__(
        self,
        policy: torch.nn.Module,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        copy: torch.nn.Module | None = None,
    ) -> None:
        self.policy, self.scheduler, self.copy = policy, scheduler, copy
        self._version: int | None = None
        self.copy_time = 0.0

    def current(self) -> torch.nn.Module:

        if self.copy is None:
            return unwrap_model(self.policy)
        version = self.scheduler.last_epoch
        if version != self._version:
            t0 = time.perf_counter()
            copy_full_weights(self.policy, self.copy)
            self.copy_time, self._version = time.perf_counter() - t0, version
        return self.copy


@dataclass
class RunParts:
    """What every step of a run works with, built once by the setup."""

    model: torch.nn.Module
    """The policy as it trains: plain, or wrapped by DDP or FSDP2, maybe with LoRA adapters."""
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    backbone: Callable[..., Any] | None
    """A compiled stand-in for the model's decoder stack (``model.compile``), else None."""
    update_spec: UpdateSpec
    minibatch_spec: MinibatchSpec
    reward_fn: Callable[..., dict]
    """Grades the training rollouts."""
    val_reward: Reward
    """The configured reward (``reward.fn``, else the prompt's own): validation always grades with it."""
    prompt: Prompt
    """The run's ``Prompt``, bound to the tokenizer."""
    train_examples: list[Example]
    val_examples: list[tuple[str, list[Example]]]
    """``(name, examples)`` per validation set; the first is logged as val/reward, ..."""
    request: RolloutRequest
    """``request(s)``: the prompts and sampling parameters of step s (this rank's share)."""
    engine_weights: EngineWeights
    """The plain model the engine samples from, refreshed from the policy."""
    world: World = field(default_factory=World)
    """This process among the run's data-parallel ranks."""
    rows_held: range = range(0)
    """Rows of each step's global rollout batch (prompt-major) that this rank samples and trains on."""
    sharded_checkpoints: bool = False
    """Checkpoints through torch.distributed.checkpoint (FSDP2, LoRA) rather than one model folder."""
    rollouts: Rollouts | None = None
    """Started with the engine, once the run's summary says it is running."""
    reference: Reference | None = None
    """The frozen initial policy of the KL penalty (``algorithm.kl_coef > 0``), else None."""
    set_rewards: dict[str, Reward] = field(default_factory=dict)
    """The reward of each validation set that names its own (``data.val_sources`` ``reward=NAME``), by set name."""
    episodes: Episodes | None = None
    """Multi-turn sampling (``env.name`` other than single_turn), else None."""


@dataclass
class TrainState:
    """What the loop carries from step to step. The counters and the last rewards travel in every
    checkpoint; ``step`` is the last step logged and ``saved_step`` that of the newest checkpoint."""

    step: int = 0
    nonfinite_total: int = 0
    nonfinite_consecutive: int = 0
    last_val: dict = field(default_factory=dict)
    last_train_reward: float | None = None
    saved_step: int | None = None
    best_val: float | None = None
    best_step: int | None = None
    """The best main validation reward so far and its step: the model in checkpoints/best."""
    health: dict = field(default_factory=dict)
    """The health monitor's state (``rlvr.training.health.HealthMonitor.state_dict``)."""
    in_update: bool = False
    """From a step's first optimizer update until the step is logged: a checkpoint then would hold half a step."""

    @classmethod
    def from_checkpoint(cls, saved: dict) -> TrainState:
        fresh = cls()
        return cls(
            step=saved["step"],
            nonfinite_total=saved.get("nonfinite_total", fresh.nonfinite_total),
            nonfinite_consecutive=saved.get("nonfinite_consecutive", fresh.nonfinite_consecutive),
            last_val=saved.get("last_val", fresh.last_val),
            last_train_reward=saved.get("last_train_reward", fresh.last_train_reward),
            saved_step=saved["step"],
            best_val=saved.get("best_val", fresh.best_val),
            best_step=saved.get("best_step", fresh.best_step),
            health=saved.get("health", fresh.health),
        )

    def checkpoint_record(self, data_position: int) -> dict:
        """The loop state a checkpoint saves (``rlvr.training.checkpoint.save_checkpoint``'s ``state``)."""
        return {
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_consecutive": self.nonfinite_consecutive,
            "last_val": self.last_val,
            "last_train_reward": self.last_train_reward,
            "best_val": self.best_val,
            "best_step": self.best_step,
            "health": self.health,
            "data_position": data_position,
        }


@dataclass
class Scores:
    """The rewards of one batch's responses, row for row."""

    rewards: torch.Tensor
    meta: dict
    """``score_responses``'s: means, the per-row format rewards and the extra numbers the reward logs."""
    ground_truths: list[str]


@dataclass
class TrainBatch:
    """What the updates of one step train on."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor | None
    """The sampling weights' log-probs, when the run uses or checks them."""


# ---------------------------------------------------------------------------------------------
# 2. The phases of one rollout step
# ---------------------------------------------------------------------------------------------


def _rank_prompts(config: TrainConfig, world: World) -> range:
    """Positions, within every global rollout batch, of the prompts this rank samples and trains on."""

    return rank_prompt_range(config.rollout.n_prompts_per_rollout_batch, world.rank, world.world_size)


def _step_examples(
    config: TrainConfig, train_examples: Sequence[Example], step: int, world: World | None = None
) -> list[Example]:
    """This rank's examples of 1-based step ``step`` (all of them in one process)."""
    indices = batch_indices(len(train_examples), config.rollout.n_prompts_per_rollout_batch, step - 1, config.seed)
    positions = _rank_prompts(config, world or World())
    return [train_examples[i] for i in indices[positions.start : positions.stop]]


def _sampling_params(
    config: TrainConfig, step: int, prompt: Prompt | None = None, world: World | None = None
) -> SamplingParams:
    """Step ``step``'s sampling: one seed per prompt position in the global batch, so a rank's prompts are
    seeded as in one process."""

    r = config.rollout
    prompt = prompt or build_prompt(config)
    return SamplingParams(
        n=r.group_size,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop=prompt.stop,
        include_stop_str_in_output=True,
        seed=derive_seed(config.seed, "rollout", step),
        prompt_seeds=tuple(
            derive_seed(config.seed, "rollout", step, i) for i in _rank_prompts(config, world or World())
        ),
    )


def _render_prompts(prompt: Prompt, episodes: Episodes | None, examples: Sequence[Example]) -> list[str]:
    """The model's input for each example: the prompt's, or the opening of its conversation."""
    if episodes is None:
        return [prompt.render_example(ex) for ex in examples]
    return episodes.render(examples, prompt)


def _rollout_request(
    config: TrainConfig,
    train_examples: Sequence[Example],
    prompt: Prompt | None = None,
    world: World | None = None,
    episodes: Episodes | None = None,
) -> RolloutRequest:
    """``request(s)``: this rank's prompts and sampling parameters of 1-based step s (a pure function of the
    seed, s and the rank). ``prompt``: the run's bound ``Prompt`` (default: the config's, which needs no
    tokenizer unless it is chat)."""

    prompt = prompt or build_prompt(config)

    def request(s: int) -> tuple[list[str], SamplingParams]:
        prompts = _render_prompts(prompt, episodes, _step_examples(config, train_examples, s, world))
        return prompts, _sampling_params(config, s, prompt, world)

    return request


def _make_rollouts(
    config: TrainConfig, engine: Engine, tokenizer: PreTrainedTokenizerBase, request: RolloutRequest
) -> Rollouts:
    """``AsyncRollouts`` over an engine that holds its own copy of the weights (hf-worker), else ``SyncRollouts``."""

    if not isinstance(engine, WorkerEngine) and not config.engine.max_staleness:
        return SyncRollouts(engine, tokenizer, request)
    logprob_batch_size = _resolved(config.optim.logprob_batch_size, "optim.logprob_batch_size")
    try:  # AsyncRollouts refuses an engine that is not a WorkerEngine (TypeError)
        return AsyncRollouts(
            cast(WorkerEngine, engine),
            max_staleness=config.engine.max_staleness,
            logprob_batch_size=logprob_batch_size,
            old_log_probs=REWEIGHTINGS[config.algorithm.reweighting].needs_old_log_probs,
            request=request,
            last_step=config.n_steps,
        )
    except (TypeError, ValueError) as e:
        raise EngineError(f"engine.max_staleness={config.engine.max_staleness} cannot run on this engine: {e}") from e


def _rollout(
    step: int, engine_weights: EngineWeights, rollouts: Rollouts, request: RolloutRequest
) -> tuple[RolloutBatch, dict]:
    """Phase 1: step ``step``'s batch from the run's rollouts (sampled ``max_staleness`` steps ago at
    most), and its metrics."""
    metrics: dict = {}
    try:
        model = engine_weights.current()
        if engine_weights.copy is not None:
            metrics["time/engine_copy"] = engine_weights.copy_time
        batch = rollouts.next_batch(step, model)
    except EngineError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the engine raised, the run stops with its cause
        raise EngineError(
            f"the rollout engine failed at step {step}: {type(e).__name__}: {e}. "
            "Check the engine (its log, memory, the server)."
        ) from e
    if batch.step != step or batch.prompts != request(step)[0]:
        raise EngineError(
            f"the rollout queue handed over batch {batch.step} with other prompts at step {step}; this is "
            "a bug in the rollout bookkeeping: please report it"
        )
    metrics.update(batch.metrics(current_version=step - 1))
    return batch, metrics


def _grade(
    reward_fn: Callable[..., dict],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    step: int,
    fields: Sequence[dict] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:

    try:
        raw, meta = score_responses(reward_fn, responses, ground_truths, fields)
    except Exception as e:  # noqa: BLE001 - any grader bug must stop the run, with its cause
        raise GraderError(f"the reward function failed at step {step}: {type(e).__name__}: {e}. Fix the grader.") from e
    if not torch.isfinite(raw).all():
        raise GraderError(
            f"the reward function returned a non-finite reward at step {step}; rewards must be finite numbers"
        )
    return raw, meta


def _score(
    config: TrainConfig,
    step: int,
    batch: RolloutBatch,
    reward_fn: Callable[..., dict],
    examples: list[Example],
    prompt: Prompt,
) -> tuple[Scores, dict]:
    """Phase 2: grade every response against its question's ground truth (and the prompt, its messages
    and the example's other fields); the scores and their metrics."""
    metrics: dict = {}
    G = config.rollout.group_size
    completions = batch.flat_completions
    truths = [ex.ground_truth for ex in examples for _ in range(G)]
    fields = [
        row_fields(ex.fields, text, prompt.example_messages(ex))
        for ex, text in zip(examples, batch.prompts, strict=True)
        for _ in range(G)
    ]
    multi_turn = any("pieces" in c.meta for c in completions)
    if multi_turn:
        fields = [episode_fields(f, c) for f, c in zip(fields, completions, strict=True)]
        metrics.update(episode_metrics(completions))
    t0 = time.perf_counter()
    raw_rewards, reward_meta = _grade(reward_fn, batch.responses, truths, step, fields)
    metrics["time/reward"] = time.perf_counter() - t0
    ks = sorted({k for k in (2**i for i in range(G.bit_length())) if k <= G} | {G})
    metrics.update(
        {
            "train/reward": reward_meta["reward_mean"],
            "train/format_reward": reward_meta["format_reward_mean"],
            "train/answer_reward": reward_meta["answer_reward_mean"],
            "train/response_length": sum(len(c.token_ids) for c in completions) / len(completions),
            "train/truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
            **{f"train/pass@{k}": v for k, v in pass_at_k(raw_rewards > 0.5, G, ks).items()},
            **{f"train/{k}": v for k, v in reward_meta.get("logged", {}).items()},
        }
    )
    return Scores(raw_rewards, reward_meta, truths), metrics


def _signal_free(rewards: torch.Tensor, group_size: int) -> list[bool]:
    """Per group of ``group_size`` consecutive rewards: whether they are all equal (no learning signal)."""
    groups = rewards.view(-1, group_size)
    return (groups == groups[:, :1]).all(dim=1).tolist()


def _fill_groups(
    config: TrainConfig,
    step: int,
    batch: RolloutBatch,
    examples: list[Example],
    scores: Scores,
    run: RunParts,
) -> tuple[RolloutBatch, list[Example], Scores, dict]:
    """``rollout.filter_groups`` (DAPO's dynamic sampling): each group whose rewards are all equal is
    replaced by the group of another prompt, for up to ``filter_max_rounds`` rounds. The replacement of
    the group at global batch position i in round k is a function of (seed, step, k, i) alone (its
    prompt drawn from the training data, its sampling seed), so every rank fills its own places as one
    process would. The filled batch is graded again for its metrics. Logs ``rollout/filter_dropped``
    (signal-free groups met, replacements included), ``rollout/filter_resampled`` (groups sampled
    again), ``rollout/filter_rounds`` and ``rollout/filter_unfilled`` (places still signal-free); with
    the filled batch's grades and the time its generation and grading took, to add to the step's."""
    G, r = config.rollout.group_size, config.rollout
    positions = list(_rank_prompts(config, run.world))
    free = _signal_free(scores.rewards, G)
    prompts, groups, examples = list(batch.prompts), list(batch.completions), list(examples)
    dropped, resampled, rounds, generate_time = sum(free), 0, 0, 0.0
    rollouts = cast(SyncRollouts, run.rollouts)
    for k in range(1, r.filter_max_rounds + 1):
        todo = [j for j, f in enumerate(free) if f]
        if not todo:
            break
        rounds = k
        picks = [derive_seed(config.seed, "filter", step, k, positions[j]) % len(run.train_examples) for j in todo]
        new_examples = [run.train_examples[i] for i in picks]
        new_prompts = _render_prompts(run.prompt, run.episodes, new_examples)
        params = dataclasses.replace(
            batch.params,
            seed=derive_seed(config.seed, "filter", step, k),
            prompt_seeds=tuple(derive_seed(config.seed, "filter", step, k, positions[j], "sample") for j in todo),
        )
        extra = rollouts.generate(new_prompts, params, step)
        new_scores, _ = _score(config, step, extra, run.reward_fn, new_examples, run.prompt)
        resampled += len(todo)
        for t, (j, still_free) in enumerate(zip(todo, _signal_free(new_scores.rewards, G))):
            prompts[j], groups[j], examples[j] = new_prompts[t], extra.completions[t], new_examples[t]
            free[j] = still_free
            dropped += still_free
        generate_time += extra.timings["time/generate"]
    metrics: dict = {
        "rollout/filter_dropped": dropped,
        "rollout/filter_resampled": resampled,
        "rollout/filter_rounds": rounds,
        "rollout/filter_unfilled": sum(free),
    }
    if rounds:
        metrics["time/generate"] = generate_time
    if not resampled:
        return batch, examples, scores, metrics
    tokens = tokenize_groups(run.tokenizer, prompts, groups)
    filled = dataclasses.replace(
        batch,
        prompts=prompts,
        completions=groups,
        input_ids=tokens["input_ids"],
        labels=tokens["labels"],
        response_mask=tokens["response_mask"],
        old_log_probs=None,
    )
    scores, score_metrics = _score(config, step, filled, run.reward_fn, examples, run.prompt)
    return filled, examples, scores, metrics | score_metrics


def _engine_agreement(
    completions: Sequence[Completion],
    output_ids: list[list[int]],
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    eos_id: int | None,
) -> dict:
    """Mean |engine log-prob - trainer log-prob| over response tokens of the rollouts whose engine
    token ids equal the retokenised response, and the share of rollouts that match."""
    total_diff, n_tokens, matched, comparable = 0.0, 0, 0, 0
    for i, c in enumerate(completions):
        if c.logprobs is None:
            continue
        comparable += 1
        ids, lps = list(c.token_ids), list(c.logprobs)
        if len(ids) == len(output_ids[i]) + 1 and ids[-1] == eos_id:
            ids, lps = ids[:-1], lps[:-1]
        if ids != output_ids[i]:
            continue
        matched += 1
        if not ids:
            continue
        trainer = old_log_probs[i][response_mask[i]].float().cpu()
        total_diff += float((trainer - torch.tensor(lps, dtype=torch.float32)).abs().sum())
        n_tokens += len(ids)
    if comparable == 0:
        return {}
    out = {"train/engine_token_match_frac": matched / comparable}
    if n_tokens:
        out["train/engine_logprob_diff"] = total_diff / n_tokens
    return out


def _old_log_probs(
    config: TrainConfig,
    step: int,
    batch: RolloutBatch,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    uses_old_log_probs: bool,
) -> tuple[torch.Tensor | None, dict]:
    """The sampling weights' log-probs of the batch, when the update uses them or the engine's are checked
    against them: the rollouts' own (a worker sends them), else the trainer's, which are the sampling
    weights only when nothing ran ahead; with the metrics of the check."""
    metrics: dict = {}
    check_every = config.log.engine_logprob_check_every
    completions = batch.flat_completions
    engine_has_logprobs = any(c.logprobs is not None for c in completions)
    check = engine_has_logprobs and (config.off_policy or (check_every and step % check_every == 0))
    old_log_probs = batch.old_log_probs
    if old_log_probs is None and batch.weight_version != step - 1 and (uses_old_log_probs or check):
        raise EngineError(
            f"batch {step} was sampled by weight version {batch.weight_version} but came without old "
            "log-probs; the trainer's weights cannot stand in for them"
        )
    t0 = time.perf_counter()
    if old_log_probs is None and (uses_old_log_probs or check):
        was_training = model.training
        model.eval()
        logprob_batch_size = _resolved(config.optim.logprob_batch_size, "optim.logprob_batch_size")
        old_log_probs = compute_log_probs_batched(
            model, batch.input_ids, batch.labels, logprob_batch_size, positions=batch.response_mask
        )
        model.train(was_training)
    if check:
        assert old_log_probs is not None  # the rollouts' own, else computed above whenever check is on
        output_ids = tokenizer(batch.responses, add_special_tokens=False)["input_ids"]
        metrics.update(
            _engine_agreement(completions, output_ids, old_log_probs, batch.response_mask, tokenizer.eos_token_id)
        )
    metrics["time/logprobs"] = time.perf_counter() - t0
    return old_log_probs, metrics


def _advantages(
    config: TrainConfig, step: int, batch: RolloutBatch, scores: Scores, run: RunParts
) -> tuple[TrainBatch, dict]:
    """Phase 3: group-normalised advantages and the old log-probs: what the updates train on, and the
    metrics of the phase."""
    a = config.algorithm
    old_log_probs, metrics = _old_log_probs(
        config, step, batch, run.model, run.tokenizer, run.minibatch_spec.uses_old_log_probs
    )
    rewards = scores.rewards
    completions = batch.flat_completions
    if config.reward.overlong_buffer:
        lengths = torch.tensor([len(c.token_ids) for c in completions])
        overlong = soft_overlong_penalty(
            lengths, config.rollout.max_new_tokens, config.reward.overlong_buffer, config.reward.overlong_penalty
        )
        metrics["train/overlong_penalty"] = float(overlong.mean())
        rewards = rewards + overlong
    if a.kl_coef > 0 and a.kl_in == "reward":
        sequence_kl, kl_metrics = _sequence_kl(config, step, batch, run, old_log_probs)
        metrics.update(kl_metrics)
        rewards = rewards - a.kl_coef * sequence_kl
    t0 = time.perf_counter()
    advantages, adv_meta = compute_group_normalized_rewards(
        rewards,
        config.rollout.group_size,
        _resolved(a.baseline, "algorithm.baseline"),
        a.advantage_eps,
        _resolved(a.advantage_normalizer, "algorithm.advantage_normalizer"),
    )
    metrics["time/reward"] = time.perf_counter() - t0  # added to the grading's time
    # The grader's rewards, also when a KL penalty changed those the advantages see.
    metrics["train/reward_std"] = scores.rewards.std().item() if scores.rewards.numel() > 1 else 0.0
    metrics["train/zero_adv_frac"] = adv_meta["zero_adv_frac"]
    response_mask = batch.response_mask
    if a.mask_truncated:
        truncated = torch.tensor([c.finish_reason == "length" for c in completions])
        response_mask = truncated_masked(response_mask, truncated)
        # No loss at all: a zero advantage lets the update skip the row when nothing else needs it.
        advantages = advantages.masked_fill(truncated, 0.0)
    return TrainBatch(batch.input_ids, batch.labels, response_mask, advantages, old_log_probs), metrics


def _sequence_kl(
    config: TrainConfig,
    step: int,
    batch: RolloutBatch,
    run: RunParts,
    old_log_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, dict]:
    """``algorithm.kl_in: reward``: each rollout's KL to the reference summed over its response tokens
    (B,), under the weights that sampled it; with its mean per sequence as ``train/kl_penalty`` (times
    kl_coef) and per token as ``train/kl_ref``."""
    a, reference = config.algorithm, cast(Reference, run.reference)
    logprob_batch_size = _resolved(config.optim.logprob_batch_size, "optim.logprob_batch_size")
    t0 = time.perf_counter()
    mask = batch.response_mask
    policy = old_log_probs
    if policy is None:
        if batch.weight_version != step - 1:
            raise EngineError(
                f"batch {step} was sampled by weight version {batch.weight_version} but came without old "
                "log-probs, which algorithm.kl_in=reward needs"
            )
        was_training = run.model.training
        run.model.eval()
        policy = compute_log_probs_batched(run.model, batch.input_ids, batch.labels, logprob_batch_size, positions=mask)
        run.model.train(was_training)
    with reference.context():
        ref = compute_log_probs_batched(
            reference.model, batch.input_ids, batch.labels, logprob_batch_size, positions=mask
        )
    kl = kl_penalty(policy.float().cpu(), ref.float().cpu(), a.kl_estimator) * mask[:, : policy.shape[1]]
    per_sequence = kl.sum(dim=1)
    metrics = {
        "train/kl_ref": float(kl.sum() / mask.sum().clamp(min=1)),
        "train/kl_penalty": a.kl_coef * float(per_sequence.mean()),
        "time/kl": time.perf_counter() - t0,
    }
    return per_sequence, metrics


def _gradient_variance(config: TrainConfig, run: RunParts, batch: TrainBatch, scores: Scores) -> dict:
    """Diagnostic, before training on the batch: the per-group gradient variance of several estimators."""
    a = config.algorithm
    t0 = time.perf_counter()
    metrics: dict = variance_metrics(
        gradient_variance(
            run.model,
            batch.input_ids,
            batch.labels,
            batch.response_mask,
            scores.rewards,
            config.rollout.group_size,
            _resolved(a.loss_normalization, "algorithm.loss_normalization"),
            a.normalization_constant,
            config.train_batch_size,
            _resolved(a.baseline, "algorithm.baseline"),
            _resolved(a.advantage_normalizer, "algorithm.advantage_normalizer"),
            a.advantage_eps,
            backbone=run.backbone,
        )
    )
    metrics["time/gradient_variance"] = time.perf_counter() - t0
    return metrics


def _minibatches(n_rows: int, train_batch: int, shuffle: bool, seed: int, step: int, epoch: int) -> list[list[int]]:
    if shuffle:
        order = torch.randperm(
            n_rows, generator=torch.Generator().manual_seed(derive_seed(seed, "minibatch", step, epoch))
        ).tolist()
    else:
        order = list(range(n_rows))
    return [order[i : i + train_batch] for i in range(0, n_rows, train_batch)]


def _optimizer_step(
    run: RunParts, batch: TrainBatch, rows: list[int], global_batch: GlobalBatch | None = None
) -> tuple[torch.Tensor, dict]:
    """One ``policy_gradient_update`` on ``rows`` of the batch, as the run's ``UpdateSpec`` says; with
    ``global_batch`` (a ``rlvr.distributed.GlobalBatch``) ``rows`` are this rank's part of it."""
    spec, rows_t = run.update_spec, torch.tensor(rows, dtype=torch.long)
    old = batch.old_log_probs
    step_batch = StepBatch(
        batch.input_ids[rows_t],
        batch.labels[rows_t],
        batch.response_mask[rows_t],
        batch.advantages[rows_t],
        old_log_probs=old[rows_t] if (old is not None and run.minibatch_spec.uses_old_log_probs) else None,
    )
    return policy_gradient_update(
        run.model,
        run.optimizer,
        step_batch,
        spec,
        backbone=run.backbone,
        global_batch=global_batch,
        reference=run.reference if spec.kl_coef_in_loss else None,
    )


def _update(config: TrainConfig, step: int, run: RunParts, batch: TrainBatch, state: TrainState) -> dict:
    """Phase 4: ``epochs`` passes over the batch in minibatches, one optimizer step each; returns their
    metrics. A non-finite step is skipped and counted; ``max_consecutive_nonfinite`` of them in a row
    stop the run."""
    spec, minibatches = run.update_spec, run.minibatch_spec
    t0 = time.perf_counter()
    state.in_update = True
    run.model.train()
    losses, grad_norms, entropies, clips, kls, updates = [], [], [], [], [], []
    n_updates = backbone_tokens = 0
    lr_used = run.scheduler.get_last_lr()[0]
    n_global_rows = config.rollout_batch_size
    for epoch in range(minibatches.epochs):
        order = _minibatches(n_global_rows, minibatches.train_batch_size, minibatches.shuffle, config.seed, step, epoch)
        for rows in order:
            if run.world.backend is None:
                loss, meta = _optimizer_step(run, batch, rows)
            else:
                global_batch = GlobalBatch(len(rows), run.world.world_size)
                loss, meta = _optimizer_step(run, batch, local_rows(rows, run.rows_held), global_batch)
            with warnings.catch_warnings():
                # A step whose rollouts all had zero advantage takes no optimizer step; the schedule
                # still advances so that lr stays a function of the step count.
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                run.scheduler.step()
            n_updates += 1
            backbone_tokens += meta.get("backbone_tokens", 0)
            updates.append({"update": n_updates, **update_record(float(loss), meta)})
            if meta.get("skipped_nonfinite"):
                state.nonfinite_total += 1
                state.nonfinite_consecutive += 1
                if state.nonfinite_consecutive >= config.max_consecutive_nonfinite:
                    raise NonFiniteError(
                        f"{state.nonfinite_consecutive} optimizer steps in a row had a non-finite loss or gradient norm "
                        f"(at step {step}), so the run stops. Lower optim.lr, check the data "
                        "and rewards, or raise max_consecutive_nonfinite."
                    )
                continue
            state.nonfinite_consecutive = 0
            losses.append(float(loss))
            grad_norms.append(meta["grad_norm"])
            if meta["n_tokens"]:
                entropies.append(meta["entropy"])
            if "clip_fraction" in meta:
                clips.append(meta["clip_fraction"])
            if "kl_ref" in meta:
                kls.append(meta["kl_ref"])
    metrics: dict = {"time/train": time.perf_counter() - t0}
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    metrics.update(
        {
            "train/loss": mean(losses) if losses else 0.0,
            "train/grad_norm": mean(grad_norms) if grad_norms else 0.0,
            "train/grad_norm_max": max(grad_norms) if grad_norms else 0.0,
            "train/entropy": mean(entropies) if entropies else None,  # nothing went through the model
            "train/n_updates": n_updates,
            "train/backbone_tokens": backbone_tokens,  # tokens through the model, padding included
            "train/skipped_nonfinite": state.nonfinite_total,
            "lr": lr_used,
        }
    )
    if REWEIGHTINGS[spec.reweighting].needs_cliprange:
        metrics["train/clip_fraction"] = mean(clips) if clips else 0.0
    if spec.kl_coef_in_loss:
        metrics["train/kl_ref"] = mean(kls) if kls else 0.0
    if config.off_policy or config.engine.max_staleness:
        metrics["updates"] = updates  # one record per optimizer step of this rollout batch (not a plotted series)
    return metrics


def _dump_rollouts(
    config: TrainConfig,
    step: int,
    run_dir: Path,
    batch: RolloutBatch,
    scores: Scores,
    train_batch: TrainBatch,
    world: World | None = None,
) -> list[dict]:
    """Phase 5: the step's rollouts, with their rewards and advantages, to DIR/rollouts/step_N.jsonl
    (every rank's, in the global batch's order, written by rank 0); returns those records."""
    G = config.rollout.group_size
    world = world or World()
    first_group = _rank_prompts(config, world).start
    completions, responses = batch.flat_completions, batch.responses
    n_train_tokens = train_batch.response_mask.sum(dim=1).tolist()  # the tokens the loss saw (engine ids may add EOS)
    records = [
        {
            "step": step,
            "weight_version": batch.weight_version,
            "group": first_group + i // G,
            "prompt": batch.prompts[i // G],
            "response": responses[i],
            "ground_truth": scores.ground_truths[i],
            "reward": float(scores.rewards[i]),
            "format_reward": float(scores.meta["format_rewards"][i]),
            "advantage": float(train_batch.advantages[i]),
            "finish_reason": completions[i].finish_reason,
            "n_tokens": len(completions[i].token_ids),
            "n_train_tokens": n_train_tokens[i],
            **(
                {"turns": completions[i].meta["turns"], "messages": completions[i].meta["messages"]}
                if "pieces" in completions[i].meta
                else {}
            ),
        }
        for i in range(len(responses))
    ]
    if world.distributed:
        records = [r for rank_records in gather_objects(records) for r in rank_records]
    if world.is_main:
        write_jsonl(run_dir / "rollouts" / f"step_{step}.jsonl", records)
    return records


def _merge_phase(log: dict, metrics: dict) -> None:
    """A phase's metrics into the step's. A time that an earlier phase logged too adds to it (the
    generation and grading of the groups that filtering replaced, the advantages' share of the reward
    time); any other metric replaces the earlier value (the filled batch's grades replace the first's)."""
    for key, value in metrics.items():
        if key.startswith("time/") and key in log:
            log[key] += value
        else:
            log[key] = value


def _rollout_step(config: TrainConfig, step: int, run_dir: Path, run: RunParts, state: TrainState) -> dict:
    """Phases 1-5 of the module docstring for 1-based rollout step ``step``; returns its metrics."""
    assert run.rollouts is not None  # started with the engine, before the first step
    log: dict = {"step": step}
    t_step = time.perf_counter()
    batch, metrics = _rollout(step, run.engine_weights, run.rollouts, run.request)
    _merge_phase(log, metrics)
    examples = _step_examples(config, run.train_examples, step, run.world)
    scores, metrics = _score(config, step, batch, run.reward_fn, examples, run.prompt)
    _merge_phase(log, metrics)
    if config.rollout.filter_groups:
        batch, examples, scores, metrics = _fill_groups(config, step, batch, examples, scores, run)
        _merge_phase(log, metrics)
    train_batch, metrics = _advantages(config, step, batch, scores, run)
    _merge_phase(log, metrics)
    if config.log.gradient_variance_every and step % config.log.gradient_variance_every == 0:
        _merge_phase(log, _gradient_variance(config, run, train_batch, scores))
    _merge_phase(log, _update(config, step, run, train_batch, state))

    n_prompts = config.rollout.n_prompts_per_rollout_batch
    log["data/position"] = step * n_prompts
    log["data/epoch"] = (step * n_prompts) // len(run.train_examples)
    log["time/step"] = time.perf_counter() - t_step
    n_gen_tokens = sum(len(c.token_ids) for c in batch.flat_completions)
    log["tokens_per_s"] = n_gen_tokens / log["time/generate"] if log["time/generate"] > 0 else 0.0
    if torch.cuda.is_available():
        log["mem/peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    if config.dump_every and step % config.dump_every == 0:
        log[ROLLOUT_SAMPLES] = _dump_rollouts(config, step, run_dir, batch, scores, train_batch, run.world)
    if run.world.distributed:
        log = global_metrics(gather_objects(log), gather_objects(scores.rewards.tolist()))
    return log


_MAX_METRICS = ("time/", "mem/", "rollout/filter_rounds")
_SUM_METRICS = (
    "tokens_per_s",
    "train/reward/timeouts",
    "rollout/filter_dropped",
    "rollout/filter_resampled",
    "rollout/filter_unfilled",
)


def global_metrics(rank_logs: list[dict], rank_rewards: list[list[float]]) -> dict:
    """One step's metrics over all ranks from each rank's own (``rank_logs``, in rank order).

    Ranks hold equal shares (the same number of prompts and rows), so a per-row or per-group mean
    over the global batch is the mean of the ranks' means; times and memory take the largest rank,
    throughputs and counts the sum (equal or not), and ``train/reward_std`` is recomputed from every
    rank's rewards.
    What every rank already holds globally (the update's loss, gradient norm, entropy: reduced inside
    ``policy_gradient_update``) is the same on every rank and passes through; anything that is not a
    number (the per-update records) is rank 0's."""
    out = dict(rank_logs[0])
    for key in {k for log in rank_logs for k in log}:
        values = [log[key] for log in rank_logs if key in log]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        if key in _SUM_METRICS:  # before the pass-through: two ranks' equal counts are twice one's
            out[key] = sum(values)
        elif all(v == values[0] for v in values):
            out[key] = values[0]
        elif key.startswith(_MAX_METRICS):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    rewards = torch.tensor([r for rank in rank_rewards for r in rank], dtype=torch.float32)
    if "train/reward_std" in out:
        out["train/reward_std"] = rewards.std().item() if rewards.numel() > 1 else 0.0
    return out


def _validate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    engine: Engine,
    config: TrainConfig,
    val_sets: Sequence[tuple[str, Sequence[Example]]] | Sequence[Example],
    step: int,
    run_dir: Path,
    prompt: Prompt | None = None,
    reward: Callable[[str, str], dict] | None = None,
    set_rewards: dict[str, Reward] | None = None,
    episodes: Episodes | None = None,
) -> dict:
    """Validate on each ``(name, examples)`` of ``val_sets`` (a bare list of examples: one unnamed set),
    graded by ``reward``, or by a set's own one in ``set_rewards``. The first set is logged as
    val/reward, ...; each named one also as val/NAME/accuracy, ..."""

    if val_sets and not isinstance(val_sets[0], tuple):
        val_sets = [("", cast("Sequence[Example]", val_sets))]
    r = config.rollout
    params = SamplingParams(
        n=config.eval_n,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        seed=derive_seed(config.seed, "val"),
    )
    t0 = time.perf_counter()
    out, dump = {}, []
    for i, (name, examples) in enumerate(cast("Sequence[tuple[str, Sequence[Example]]]", val_sets)):
        try:
            metrics, samples = evaluate(
                model,
                tokenizer,
                examples,
                prompt or config.prompt,
                engine=engine,
                params=params,
                chunk_size=max(1, config.engine.max_batch_size),
                reward=(set_rewards or {}).get(name, reward),
                render=None if episodes is None else episodes.render,
            )
        except Exception as e:  # noqa: BLE001
            raise EngineError(
                f"validation{' on ' + name if name else ''} failed at step {step}: {type(e).__name__}: {e}."
            ) from e
        out.update(validation_metrics(metrics, name, first=i == 0))
        dump += [dict(s, val_set=name) if name else s for s in samples[: config.log.val_samples]]
    if config.log.val_samples:
        write_jsonl(run_dir / "rollouts" / f"val_step_{step}.jsonl", dump)
    out["time/eval"] = time.perf_counter() - t0
    return out


def _validation_due(config: TrainConfig, step: int) -> bool:
    return bool((config.eval_every and step % config.eval_every == 0) or step == config.n_steps)


def _validation(config: TrainConfig, step: int, run_dir: Path, run: RunParts, state: TrainState) -> dict:
    """Validate after step ``step`` through the run's rollouts (never racing a rollout for the engine) and
    keep the result in ``state.last_val``; returns the metrics to log (none without validation data)."""
    if not run.val_examples:
        return {}
    model = run.engine_weights.current()  # every rank: under FSDP2 the copy gathers the shards
    val: dict = {}
    if run.world.is_main:  # the other ranks wait for rank 0's result (the engine holds plain weights)
        assert run.rollouts is not None  # started with the engine, before the first validation
        engine = run.rollouts.engine_for_eval(model, step)
        val = _validate(
            model,
            run.tokenizer,
            engine,
            config,
            run.val_examples,
            step,
            run_dir,
            run.prompt,
            run.val_reward,
            run.set_rewards,
            run.episodes,
        )
    if run.world.distributed:
        val = gather_objects(val)[0]
    state.last_val = {k: v for k, v in val.items() if k.startswith("val/")}
    return val


# ---------------------------------------------------------------------------------------------
# 3. The loop
# ---------------------------------------------------------------------------------------------


def read_summary(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None  # unreadable: as if the run had never said how it ended
    return summary if isinstance(summary, dict) else None


def _prepare_run_dir(
    config: TrainConfig, run_dir: Path, resume: bool, fresh_optimizer: bool = False
) -> tuple[Path | None, bool]:
    """Check what ``run_dir`` holds against the request and write the config; returns ``(checkpoint
    to resume from or None, whether the run already finished)``. Runs under the directory's lock.
    ``fresh_optimizer`` lets a checkpoint holding weights only be resumed (with a new optimizer)."""
    summary = read_summary(run_dir)
    if resume and summary and summary.get("status") == "finished" and summary.get("step", -1) >= config.n_steps:
        if summary["step"] > config.n_steps:
            raise ConfigError(
                f"{run_dir} finished at step {summary['step']} already, past n_steps={config.n_steps}; "
                f"a run cannot be shortened: resume with --n_steps {summary['step']} or more"
            )
        return None, True
    if not resume and (checkpoint_dirs(run_dir) or damaged_checkpoints(run_dir)):
        raise ConfigError(
            f"{run_dir} already holds a run; resume it (`rlvr train --resume {run_dir}`) or choose a new --out"
        )
    ckpt = resumable_checkpoint(run_dir, fresh_optimizer=fresh_optimizer) if resume else None
    if ckpt is not None:
        at = int(ckpt.name.split("_")[1])
        if at > config.n_steps:
            raise ConfigError(
                f"{run_dir} is at step {at} already, past n_steps={config.n_steps}; a run cannot be "
                f"shortened: resume with --n_steps {at} or more"
            )
        trained = saved_run_config(ckpt)
        if trained is not None:
            # The checkpoint's own copy is the truth: config.json may have been edited by hand since.
            try:
                reference = TrainConfig.from_dict(upgrade_moved_keys(trained))
            except ValueError as e:
                raise ConfigError(
                    f"{ckpt}/run_config.json cannot be read ({e}); resume from another checkpoint"
                ) from None
            diffs = [d for d in config_differences(reference, config) if not d.startswith(RESUMABLE_CHANGES)]
            if diffs:
                raise ConfigError(
                    f"cannot resume {run_dir}: {', '.join(diffs)} differ from the config {ckpt.name} was trained with "
                    f"({ckpt.name}/run_config.json; was {run_dir}/config.json edited?); put them back (only n_steps, "
                    "cadences, logging and reward.timeout_s may change on resume)"
                )
        saved = _read_run_config(run_dir)
        if saved is not None:
            diffs = [d for d in config_differences(saved, config) if not d.startswith(RESUMABLE_CHANGES)]
            if diffs:
                raise ConfigError(
                    f"cannot resume {run_dir} with a different config: {', '.join(diffs)} changed; resume with the "
                    "saved config (only n_steps, cadences, logging and reward.timeout_s may change)"
                )
    else:
        # Nothing was checkpointed, so nothing can be continued: the run starts over (under the
        # config given now, which may fix what stopped the last attempt).
        stale = [name for name in ("metrics.jsonl", "summary.json") if (run_dir / name).exists()]
        if stale:
            print(
                f"rlvr: {run_dir} holds a run that stopped before its first checkpoint; starting it again from step 0",
                file=sys.stderr,
            )
        for name in stale:
            (run_dir / name).unlink()
    save_config(config, run_dir / "config.json")
    return ckpt, False


def _read_run_config(run_dir: Path) -> TrainConfig | None:
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"it holds a JSON {type(saved).__name__}, not the object of config keys rlvr writes")
        # Written by rlvr, maybe by a version whose engine options had not moved yet.
        return TrainConfig.from_dict(upgrade_moved_keys(saved))
    except (ValueError, OSError) as e:  # ConfigError is a ValueError too
        raise ConfigError(f"{path} cannot be read ({e}); start a new run with --config FILE --out DIR") from None


def _refresh_lr(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the lr of every parameter group from the schedule at its restored position.

    A restored scheduler keeps the lr its old schedule gave last; when the run was extended the
    schedule (over the new length) gives another value, which must apply from the next update on.
    Unchanged runs get exactly the value they had."""
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def train(
    config: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    *,
    fresh_optimizer: bool = False,
    model: torch.nn.Module | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    reward_fn: Callable[..., dict] | None = None,
    engine: Engine | None = None,
    callbacks: Sequence[TrainCallback] = (),
) -> Path:
    """Train a policy as ``config`` says, writing everything to ``out_dir``; returns ``out_dir``.

    With ``resume`` the run continues from the newest checkpoint in ``out_dir`` (or starts if there is
    none; returns at once if ``summary.json`` says it already finished all ``n_steps``). ``model`` and
    ``tokenizer`` replace loading ``config.model``; ``reward_fn(response, ground_truth) -> dict``
    replaces the configured reward for training rollouts (validation always uses the configured one:
    ``reward.fn``, else the prompt's own); ``engine`` replaces building ``config.engine`` (the caller then owns and closes it);
    ``callbacks`` are called at the start and end of every step (``TrainCallback``).

    Raises ``ConfigError`` before any model loads for impossible settings, ``RunDirBusy`` when
    another process writes to ``out_dir``, ``TrainingError`` when a fault stops the run (the last
    checkpoint stays intact), and re-raises ``KeyboardInterrupt`` (``Terminated`` for SIGTERM) after
    saving.
    """
    run_dir = Path(out_dir)
    if config.plugins:
        try:
            import_plugins(config.plugins)
        except FileNotFoundError as e:
            raise ConfigError(
                f"{e}; run from the directory the plugin path is relative to, or make it absolute"
            ) from None
    config = resolve_config(config)
    validate_config(config)
    check_machine(config)
    world, started_group = _start_world(config)
    try:
        check_world(config, world.world_size)
        # Rank 0 owns the run directory (lock, config, summary, metrics); the others follow its decisions.
        with sigterm_as_interrupt(), RunDirLock(run_dir) if world.is_main else contextlib.nullcontext():
            prepared = _prepare_run_dir(config, run_dir, resume, fresh_optimizer) if world.is_main else None
            if world.distributed:
                prepared = gather_objects(prepared)[0]
            if prepared is None:  # only a rank other than 0 lacks it, when rank 0 sent none
                raise ConfigError("rank 0 could not prepare the run directory (see its message)")
            ckpt, finished = prepared
            if finished:
                return run_dir
            return _train(
                config,
                run_dir,
                ckpt,
                world,
                model=model,
                tokenizer=tokenizer,
                reward_fn=reward_fn,
                engine=engine,
                callbacks=callbacks,
            )
    finally:
        if started_group:
            shutdown_distributed()


def _start_world(config: TrainConfig) -> tuple[World, bool]:
    """This process's place among the run's ranks, and whether this call started the process group:
    torchrun's processes join theirs; a one-process run with ddp or fsdp starts a group of one; other
    one-process runs need none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return current_world(), False
    if not launched_by_torchrun() and config.distributed.strategy in ("auto", "none"):
        return World(), False
    return start_process_group("cuda" if config.policy_device.startswith("cuda") else "cpu"), True


def _setup(
    config: TrainConfig,
    run_dir: Path,
    ckpt: Path | None,
    world: World,
    *,
    model: torch.nn.Module | None,
    tokenizer: PreTrainedTokenizerBase | None,
    reward_fn: Callable[..., dict] | None,
    own_engine: bool,
) -> tuple[RunParts, TrainState]:
    """Seeds, data, policy, optimizer and the loop state (restored from ``ckpt``); nothing is started yet."""
    if model is None and ckpt is None and config.model.fresh is None:
        check_model_source(config.model.name_or_path, flag="model.name_or_path")
    torch.manual_seed(config.seed)
    import random

    import numpy as np

    random.seed(config.seed)
    np.random.seed(config.seed % 2**32)

    # Data and reward before the model: a bad setting should fail in seconds, not after a model load.

    train_examples, val_examples = load_task_data(config)
    config.check_data(
        len(train_examples),
        len(val_examples[0][1]) if val_examples and not val_examples[0][0] else config.data.val_size,
    )
    prompt = build_prompt(config)
    check_chat_rows(prompt, [("train", train_examples), *val_examples])
    if prompt.kind == "chat" and model is None and ckpt is None:
        check_chat_tokenizer(config.model.name_or_path)
    val_reward = prepare_reward(config, train_examples, prompt)  # the configured reward; validation always uses it
    if reward_fn is None:
        reward_fn = val_reward
    own_rewards = set_rewards(config, val_sources(config), val_examples)

    device = world.device if world.backend is not None else torch.device(config.policy_device)
    strategy = config.data_parallel_strategy(world.world_size)
    dtype = resolve_dtype(config.model.dtype, device)
    # FSDP2 keeps float32 sharded parameters (and so float32 AdamW state) and computes in the model dtype;
    # with optim.master_weights off they stay in the model dtype (half the memory, low-precision updates).
    load_dtype = torch.float32 if strategy == "fsdp" and config.optim.master_weights else dtype
    lora = config.model.lora
    # The KL reference is the initial policy: a frozen copy, or under LoRA the policy with its adapters off.
    copies_reference = config.algorithm.kl_coef > 0 and not lora.rank
    initial = None
    if model is None:
        if own_engine:
            _check_engine_runs_model(config)
        model, tokenizer = _load_policy(config, train_examples, device, load_dtype, ckpt)
        if copies_reference:
            initial = copy.deepcopy(model) if ckpt is None else _initial_policy(config, tokenizer, device, dtype)
    else:
        if tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        model.to(device=device, dtype=load_dtype)
        if copies_reference:
            initial = copy.deepcopy(model)  # the caller's model holds the initial weights
        if ckpt is not None and not lora.rank:
            load_model_weights(model, ckpt / "model")
    reference_model = None
    if initial is not None:
        on_device = config.algorithm.kl_reference_device if world.backend is None else None
        reference_model = _frozen_reference(initial, torch.device(on_device) if on_device else device, dtype)
    prompt = prompt.bind(tokenizer)
    episodes = episodes_for(config, tokenizer, prompt)
    _check_prompt_lengths(config, model, tokenizer, prompt, train_examples, val_examples)
    # An engine cannot read sharded or adapted weights in place: it samples from a plain copy.
    engine_copy = None
    if strategy == "fsdp" or lora.rank:
        engine_copy = copy.deepcopy(model).to(dtype=dtype).eval()
        engine_copy.requires_grad_(False)
    # Under FSDP2 the wrapper checkpoints each layer around its all-gather (``wrap_model``).
    if config.model.gradient_checkpointing and strategy != "fsdp":
        cast(Any, model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora.rank:
        torch.manual_seed(derive_seed(config.seed, "lora"))  # the same adapters on every rank
        model = apply_lora(model, lora)
    if world.distributed:  # each rank's own stream from here on (dropout)
        torch.manual_seed(derive_seed(config.seed, "rank", world.rank))
    if strategy != "none":
        model = wrap_model(
            model,
            cast(Any, strategy),
            device,
            param_dtype=dtype if strategy == "fsdp" and dtype != torch.float32 else None,
            cpu_offload=config.distributed.cpu_offload,
            activation_checkpointing=config.model.gradient_checkpointing and strategy == "fsdp",
        )
        if strategy == "fsdp" and reference_model is not None:  # sharded like the policy, computing in its dtype
            reference_model = wrap_model(reference_model, "fsdp", device, cpu_offload=config.distributed.cpu_offload)
    reference = None
    if reference_model is not None:
        reference = Reference(reference_model)
    elif config.algorithm.kl_coef > 0:  # LoRA: the base model is the policy with its adapters off
        policy = model
        reference = Reference(policy, lambda: adapters_disabled(policy))
    backbone = compile_backbone(model) if config.model.compile else None
    optimizer, scheduler = _optimizer_and_scheduler(config, model, device)
    state = TrainState()
    if ckpt is not None:
        state = TrainState.from_checkpoint(load_trainer_state(ckpt, optimizer, scheduler, model=model))
        _refresh_lr(optimizer, scheduler)
        if world.is_main:
            truncate_metrics(run_dir / "metrics.jsonl", state.step)
    run = RunParts(
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        backbone=backbone,
        update_spec=UpdateSpec.from_config(config),
        minibatch_spec=MinibatchSpec.from_config(config),
        reward_fn=reward_fn,
        val_reward=val_reward,
        prompt=prompt,
        train_examples=train_examples,
        val_examples=val_examples,
        request=_rollout_request(config, train_examples, prompt, world, episodes),
        engine_weights=EngineWeights(model, scheduler, engine_copy),
        world=world,
        rows_held=rank_row_range(
            config.rollout.n_prompts_per_rollout_batch, config.rollout.group_size, world.rank, world.world_size
        ),
        sharded_checkpoints=strategy == "fsdp" or bool(lora.rank),
        reference=reference,
        set_rewards=own_rewards,
        episodes=episodes,
    )
    return run, state


def _check_prompt_lengths(
    config: TrainConfig,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    train_examples: Sequence[Example],
    val_examples: list[tuple[str, list[Example]]],
) -> None:
    """Refuse, before any generation, a prompt that leaves no room for rollout.max_new_tokens in the
    model's context: an engine would otherwise size its cache for it or fail midway."""
    context = context_length(model)
    if context is None:
        return

    after, setting = config.rollout.max_new_tokens, "rollout.max_new_tokens"
    if get_environment_entry(config.env.name).multi_turn and config.env.max_tokens > after:
        after, setting = config.env.max_tokens, "env.max_tokens"  # a conversation reaches that far past its prompt
    budget = context - after
    for name, examples in [("training", train_examples), *((f"validation {n}".strip(), e) for n, e in val_examples)]:
        index, tokens = longest_prompt(tokenizer, [prompt.render_example(ex) for ex in examples])
        if tokens > budget:
            raise ConfigError(
                f"{name} example {index + 1} makes a prompt of {tokens} tokens; with {setting}={after} it needs "
                f"more than the model's context of {context} positions. "
                f"Drop or shorten the long examples, or lower {setting}"
            )


def _start_rollouts(
    config: TrainConfig, run: RunParts, engine: Engine | None, resources: contextlib.ExitStack
) -> Rollouts:
    """The engine (built from the config unless given) and the rollouts over it, each closed by ``resources``."""
    if engine is None:
        try:
            engine = _make_engine(config, run.engine_weights.current(), run.tokenizer)
        except Exception as e:  # noqa: BLE001
            raise EngineError(f"could not start the {config.engine.name} engine: {type(e).__name__}: {e}") from e
        resources.callback(engine.close)
    if run.episodes is not None:  # whole conversations, for training and validation alike
        engine = run.episodes.engine(engine)
    rollouts = _make_rollouts(config, engine, run.tokenizer, run.request)
    # Closed before the engine: it waits for the request in flight.
    resources.callback(rollouts.close)
    return rollouts


class RunRecord(TrainingRun):
    """The run scaffold's record (``rlvr.training.scaffold.TrainingRun``) over the loop's state: the
    step and the newest checkpoint live in ``TrainState`` (they travel in every checkpoint), a step is
    half done from its first optimizer update until it is logged, and the summary names the final and
    best validation, the checkpoints and the health warnings."""

    def __init__(self, config: TrainConfig, run_dir: Path, run: RunParts, state: TrainState) -> None:
        self.config, self.run, self.state = config, run, state
        self.health_counts: dict[str, int] = {}
        """Health warnings of this process's part of the run, by signal."""
        w = run.world
        super().__init__(
            run_dir,
            config.n_steps,
            f"rlvr train --resume {run_dir}",
            self._save,
            start=state.step,
            resumed=state.saved_step is not None,
            is_main=w.is_main,
            rank_label=f"rank {w.rank}: " if w.distributed else "",
        )

    @property  # type: ignore[override]
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property  # type: ignore[override]
    def saved_step(self) -> int | None:
        return self.state.saved_step

    @saved_step.setter
    def saved_step(self, value: int | None) -> None:
        self.state.saved_step = value

    def half_step(self) -> bool:
        return self.state.in_update

    def summary_fields(self) -> dict[str, Any]:
        s = self.state
        return {
            "final": s.last_val,
            "final_train_reward": s.last_train_reward,
            "best": (
                {"step": s.best_step, "val/reward": s.best_val, "model": f"{CKPT_DIR}/{BEST_DIR}/{MODEL_DIR}"}
                if s.best_step is not None
                else None
            ),
            "latest": f"{CKPT_DIR}/{LATEST}" if s.saved_step is not None else None,
            "nonfinite_skipped": s.nonfinite_total,
            "last_checkpoint": s.saved_step,
            "health": self.health_counts,
        }

    def warn(self, warnings: list[HealthWarning], bar: Any) -> None:
        """Say each of a step's health warnings in one line (above the progress bar)."""
        for w in warnings:
            self.health_counts[w.signal] = self.health_counts.get(w.signal, 0) + 1
            if self.is_main:
                bar.write(w.line(), file=sys.stderr)

    def checkpoint(self) -> None:
        """Save the state after the last logged step (once per step; step 0 too, so that a run stopped
        before its first step resumes with its data order and seeds)."""
        if self.saved_step != self.step:
            self._save(self.step)

    def _save(self, at: int) -> None:
        state, run = self.state, self.run
        save_checkpoint(
            self.run_dir,
            at,
            run.model,
            run.tokenizer,
            run.optimizer,
            run.scheduler,
            state=state.checkpoint_record(at * self.config.rollout.n_prompts_per_rollout_batch),
            keep=self.config.keep_checkpoints,
            sharded=run.sharded_checkpoints,
            run_config=self.config.to_dict(),
        )
        state.saved_step = at

    def keep_best(self, step: int, val: dict) -> None:
        """Keep the model in checkpoints/best when ``val`` (step ``step``'s validation) is the best so far
        by the main validation reward (ties to the later step)."""
        value = val.get("val/reward")
        if not self.config.save_best or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        state = self.state
        if state.best_val is not None and value < state.best_val:
            return
        record = {"step": step, **{k: v for k, v in val.items() if k.startswith("val/")}}
        save_best_model(self.run_dir, self.run.model, self.run.tokenizer, record, sharded=self.run.sharded_checkpoints)
        state.best_val, state.best_step = float(value), step


def _train(
    config: TrainConfig,
    run_dir: Path,
    ckpt: Path | None,
    world: World,
    *,
    model: torch.nn.Module | None,
    tokenizer: PreTrainedTokenizerBase | None,
    reward_fn: Callable[..., dict] | None,
    engine: Engine | None,
    callbacks: Sequence[TrainCallback],
) -> Path:
    """The run itself, in a locked and prepared run directory, from ``ckpt`` (None: from step 0)."""
    run, state = _setup(
        config, run_dir, ckpt, world, model=model, tokenizer=tokenizer, reward_fn=reward_fn, own_engine=engine is None
    )
    record = RunRecord(config, run_dir, run, state)
    # The reward, engine, rollouts, logger and progress bar: closed on every way out, in reverse order.
    with contextlib.ExitStack() as resources:
        resources.callback(run.val_reward.close)
        for own in run.set_rewards.values():
            resources.callback(own.close)
        resources.enter_context(attention_without_cudnn())
        with record.guarded():
            run.rollouts = _start_rollouts(config, run, engine, resources)
            logger = (
                MetricsLogger(
                    run_dir,
                    config.to_dict(),
                    wandb=config.log.wandb,
                    wandb_project=config.log.wandb_project,
                    tensorboard=config.log.tensorboard,
                )
                if world.is_main
                else _NoLogger()
            )
            resources.callback(logger.close)
            bar = tqdm(
                total=config.n_steps,
                initial=state.step,
                desc="train",
                unit="step",
                disable=not (config.log.progress and world.is_main),
                dynamic_ncols=True,
            )
            resources.callback(bar.close)

            monitor = HealthMonitor.from_state(config.health, state.health)
            if state.step == 0 and config.eval_at_start and run.val_examples:
                _validation(config, 0, run_dir, run, state)
                record.keep_best(0, state.last_val)
                monitor.observe({"step": 0, **state.last_val})
                state.health = monitor.state_dict()
                logger.log({"step": 0, **state.last_val})
            agree = _agree_on_signal if world.distributed else None  # every rank stops after the same step
            for step in range(state.step + 1, config.n_steps + 1):
                with record.step_block(step, agree):
                    for callback in callbacks:
                        callback.on_step_begin(step, run_dir)
                    metrics = _rollout_step(config, step, run_dir, run, state)  # rollout, score, advantages, update
                    if _validation_due(config, step):
                        metrics.update(_validation(config, step, run_dir, run, state))
                        record.keep_best(step, state.last_val)
                    warnings = monitor.observe(metrics)
                    state.health = monitor.state_dict()
                    if warnings:
                        metrics["health"] = [w.as_record() for w in warnings]
                    logger.log(metrics)
                    state.step, state.in_update = step, False
                    if config.save_every and step % config.save_every == 0:
                        record.checkpoint()
                    record.warn(warnings, bar)
                    state.last_train_reward = metrics["train/reward"]
                    bar.set_postfix(progress_postfix(metrics, state.last_val))
                    bar.update(1)
                    for callback in callbacks:
                        callback.on_step_end(step, run_dir, metrics)
            if config.save_at_end:
                record.checkpoint()
            record.summary("finished")
            return run_dir


def _agree_on_signal(requested: int | None) -> int | None:
    """The signal any rank received during the step (the largest number), so that all stop or none."""
    return int(reduce_values([requested or 0], "max")[0]) or None


class _NoLogger:
    """The metrics logger of ranks other than 0: rank 0 writes the (global) metrics once."""

    def log(self, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


def progress_postfix(metrics: dict, last_val: dict) -> dict:
    """What the progress bar shows after a step: train reward, loss, gradient norm, last val reward."""
    postfix = {
        "reward": f"{metrics['train/reward']:.3f}",
        "loss": f"{metrics['train/loss']:.4g}",
        "gnorm": f"{metrics['train/grad_norm']:.3g}",
    }
    if "val/reward" in last_val:
        postfix["val"] = f"{last_val['val/reward']:.3f}"
    return postfix


# ---------------------------------------------------------------------------------------------
# 4. Command line
# ---------------------------------------------------------------------------------------------

USAGE = """rlvr train --config FILE [--section.field VALUE ...] --out DIR
       rlvr train --resume DIR [--n_steps N ...]

Train a policy with GRPO or a variant. FILE is YAML, TOML or JSON with the sections below (model,
data, algorithm, rollout, optim, engine, log) and top-level fields; flags override it. The resolved
config is written to DIR/config.json, metrics to DIR/metrics.jsonl, checkpoints to DIR/checkpoints/.
Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits with status 130 (Ctrl-C)
or 143 (SIGTERM); a second one stops at once. Errors exit with status 2 (bad input) or 1 (a fault
during the run)."""


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """The ``rlvr train`` command line: where the config comes from and goes, then every config field."""

    config: Path | None = None
    """Config file (YAML, TOML or JSON) to start from; the flags below override it."""
    out: Path | None = None
    """Run directory for config.json, metrics.jsonl, summary.json and checkpoints/ (a new run)."""
    resume: Path | None = None
    """Continue the run in this directory from its newest intact checkpoint (its config.json is the base; n_steps, cadences and logging may change)."""
    fresh_optimizer: bool = False
    """With --resume: accept a checkpoint that holds weights only (its trainer_state.pt deleted or lost) and continue from its step with a fresh optimizer."""
    # name="": the config's flags keep their names (--optim.lr, not --train.optim.lr)
    train: Annotated[TrainConfig, tyro.conf.arg(name="")] = dataclasses.field(default_factory=TrainConfig)


def parse_command(argv: list[str]) -> tuple[TrainConfig, Path, bool, bool]:
    """``(config, run directory, resume, fresh_optimizer)`` from ``rlvr train`` arguments; raises ``ConfigError`` for
    bad input and ``SystemExit`` for ``--help`` or a flag tyro rejects (it prints why)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    pre.add_argument("--out")
    pre.add_argument("--resume")
    known, _ = pre.parse_known_args(argv)
    check_moved_flags(argv)
    run_dir: Path | None
    if known.resume:
        if known.config:
            raise ConfigError("--resume DIR reads DIR/config.json; do not pass --config with it")
        run_dir = Path(known.resume)
        if known.out and Path(known.out) != run_dir:
            raise ConfigError("--resume DIR continues in DIR; drop --out or make it the same directory")
        base = _read_run_config(run_dir)
        if base is None:
            raise ConfigError(
                f"{run_dir}/config.json not found: is {run_dir} a run directory? Start a new run with "
                f"--config FILE --out {run_dir}"
            )
    else:
        base = load_config_file(known.config) if known.config else TrainConfig()
        run_dir = Path(known.out) if known.out else None
    default = TrainCommand(
        config=known.config and Path(known.config),
        out=known.out and Path(known.out),
        resume=known.resume and Path(known.resume),
        train=base,
    )
    command = tyro.cli(TrainCommand, args=argv, default=default, prog="rlvr train", description=USAGE)
    if run_dir is None:
        raise ConfigError("--out DIR is required (where metrics, checkpoints and the config go)")
    if command.fresh_optimizer and not known.resume:
        raise ConfigError("--fresh-optimizer applies to a resumed run: pass it with --resume DIR")
    return command.train, run_dir, bool(known.resume), command.fresh_optimizer


def main(argv: list[str] | None = None) -> int:

    torchrun_rank = launched_by_torchrun()
    code = _main(argv)
    if torchrun_rank:
        # End a torchrun rank without interpreter teardown: gloo's worker threads may still be alive
        # then, and destroying them aborts a process whose work is done (SIGABRT).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            config, run_dir, resume, fresh_optimizer = parse_command(argv)
        except SystemExit as e:  # --help, or a bad flag (tyro printed why)
            return int(e.code or 0)
        train(config, run_dir, resume=resume, fresh_optimizer=fresh_optimizer)
    except UserError as e:
        print(f"rlvr train: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        return exit_code(e)
    print(f"rlvr train: finished; results in {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
