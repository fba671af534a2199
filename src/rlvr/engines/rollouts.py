"""Where a training step's rollouts come from: one interface, two implementations.

``Rollouts.next_batch(step, model)`` returns the ``RolloutBatch`` of 1-based trainer step ``step``
(whose weights are version ``step - 1``): the completions, their tokenisation, and the weight version
that sampled them. The trainer calls only that, whatever the engine:

* ``SyncRollouts`` (in-process and server engines, ``hf``, ``hf-fast``, ``vllm``): loads the
  trainer's weights into the engine, generates and tokenises, all at the call. Old log-probs are left
  to the trainer (its weights are the sampling weights).
* ``AsyncRollouts`` (``rlvr.engines.async_rollout``; engines with their own copy of the weights,
  ``hf-worker``): a queue that may run ahead of the trainer and brings the old log-probs of the
  weights that sampled each batch.

``engine_for_eval(model, version)`` is the engine validation should use at that point, and
``close()`` stops what the rollouts started (never the engine they were given).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from rlvr.engines.base import Completion, Engine, SamplingParams
from rlvr.environments.rollout import tokenize_episodes
from rlvr.errors import EngineError
from rlvr.tokens import encode_texts
from rlvr.training.tokenize import pad_token_id, tokenize_from_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RolloutRequest = Callable[[int], "tuple[list[str], SamplingParams]"]
"""``request(step)``: the prompts and sampling parameters of 1-based step ``step``."""


@dataclass
class RolloutBatch:
    """One step's rollouts, tagged with the weights that sampled them.

    Rows are prompt-major: row ``i`` is sample ``i % n`` of prompt ``i // n``. The token tensors are
    the prompt + response tokenisation the trainer trains on, and ``old_log_probs``, when the rollouts
    bring them, are aligned with ``labels``: log p(labels[i, t]) under ``weight_version`` (0 where the
    label is padding).
    """

    step: int
    weight_version: int
    request_id: int
    prompts: list[str]
    params: SamplingParams
    completions: list[list[Completion]]
    input_ids: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    old_log_probs: torch.Tensor | None
    sync: dict = field(default_factory=dict)
    """Metrics of the load that put ``weight_version`` on the engine (time/sync, sync/probe_max_abs_diff, ...)."""
    timings: dict = field(default_factory=dict)
    """How long the parts of getting this batch took (time/generate, ...)."""

    @property
    def responses(self) -> list[str]:
        return [c.text for group in self.completions for c in group]

    @property
    def flat_completions(self) -> list[Completion]:
        return [c for group in self.completions for c in group]

    def metrics(self, current_version: int | None = None) -> dict:
        """Numbers to log for this batch; ``current_version`` (the trainer's) adds the staleness."""
        out = {"rollout/weight_version": self.weight_version, **self.timings}
        out.update({k: v for k, v in self.sync.items() if isinstance(v, (int, float))})
        if current_version is not None:
            out["rollout/staleness"] = current_version - self.weight_version
        return out


@runtime_checkable
class Rollouts(Protocol):
    def next_batch(self, step: int, model: torch.nn.Module) -> RolloutBatch:
        """The batch of 1-based trainer step ``step``, whose weights (``model``) are version ``step - 1``."""
        ...

    def engine_for_eval(self, model: torch.nn.Module, version: int) -> Engine:
        """The engine that validates ``model`` as weight version ``version`` now."""
        ...

    def close(self) -> None: ...


def check_group_shape(groups: list[list[Completion]], n_prompts: int, group_size: int, step: int) -> None:
    """``EngineError`` unless the engine answered ``group_size`` completions for each of ``n_prompts`` prompts."""
    if len(groups) != n_prompts or any(len(g) != group_size for g in groups):
        raise EngineError(
            f"the engine returned {[len(g) for g in groups]} completions for {n_prompts} prompts x "
            f"{group_size} samples at step {step}"
        )


def tokenize_groups(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], groups: list[list[Completion]]
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels`` and ``response_mask`` of the prompt-major rows of ``groups`` (one group of
    completions per prompt), tokenised from text (what every engine returns) so that training sees the
    same ids whatever the engine."""

    if any("pieces" in c.meta for g in groups for c in g):
        return tokenize_episodes(tokenizer, prompts, groups)
    responses = [c.text for g in groups for c in g]
    output_ids = encode_texts(tokenizer, responses)
    prompt_ids = encode_texts(tokenizer, prompts)
    owner = [i for i, g in enumerate(groups) for _ in g]
    return tokenize_from_ids([prompt_ids[i] for i in owner], output_ids, pad_token_id(tokenizer))


class SyncRollouts:
    """Rollouts generated at the call by an engine that takes the trainer's weights in place (or over
    the wire) before every batch: every batch is on-policy (weight version ``step - 1``)."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, request: RolloutRequest) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.request = request

    def next_batch(self, step: int, model: torch.nn.Module) -> RolloutBatch:
        t0 = time.perf_counter()
        try:
            sync_meta = self.engine.sync_weights(model) or {}
        except Exception as e:  # noqa: BLE001 - whatever the engine raised, the run stops with its cause
            raise EngineError(
                f"the engine failed to take new weights at step {step}: {type(e).__name__}: {e}. "
                "Check the engine (its log, memory, the server)."
            ) from e
        sync = {"time/sync": time.perf_counter() - t0}
        sync.update({k: v for k, v in sync_meta.items() if k != "time/sync"})
        prompts, params = self.request(step)
        batch = self.generate(prompts, params, step)
        batch.sync = sync
        return batch

    def generate(self, prompts: list[str], params: SamplingParams, step: int) -> RolloutBatch:
        """``prompts`` sampled as ``params`` say by the engine's current weights (version ``step - 1``)
        and tokenised: the batch of step ``step``, or more rollouts for it (``rollout.filter_groups``)."""
        t0 = time.perf_counter()
        try:
            groups = self.engine.generate(prompts, params)
        except Exception as e:  # noqa: BLE001
            raise EngineError(
                f"the engine failed to generate at step {step}: {type(e).__name__}: {e}. "
                "Check the engine (its log, memory, the server)."
            ) from e
        generate_time = time.perf_counter() - t0
        check_group_shape(groups, len(prompts), params.n, step)
        t0 = time.perf_counter()
        tokens = tokenize_groups(self.tokenizer, prompts, groups)
        return RolloutBatch(
            step=step,
            weight_version=step - 1,
            request_id=step,
            prompts=prompts,
            params=params,
            completions=groups,
            input_ids=tokens["input_ids"],
            labels=tokens["labels"],
            response_mask=tokens["response_mask"],
            old_log_probs=None,
            timings={"time/generate": generate_time, "time/tokenize": time.perf_counter() - t0},
        )

    def engine_for_eval(self, model: torch.nn.Module, version: int) -> Engine:
        return self.engine

    def close(self) -> None:
        pass  # the engine belongs to whoever built it
