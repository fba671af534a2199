"""The engine interface: sample completions for prompts, and take new weights from the trainer.

Every engine (in-process hf, worker-process hf, vLLM server) returns, for each prompt, ``n``
``Completion`` objects. Stop strings are honoured per sequence and kept in the text when
``include_stop_str_in_output`` is set; ``finish_reason`` is ``"stop"`` (stop string or EOS) or
``"length"`` (hit ``max_new_tokens``). ``logprobs`` are the sampled tokens' log-probabilities under
the sampling distribution at temperature 1 (None where the engine cannot give them).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt; the ``n`` samples of one prompt are drawn independently."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = True
    seed: int | None = None
    """The same seed, prompts and weights reproduce the same batch."""
    prompt_seeds: tuple[int, ...] | None = None
    """One seed per prompt, instead of ``seed`` for in-process engines: each batch of prompts decoded together
    is sampled from the seeds of its prompts, so a prompt alone in its batch (engine ``max_batch_size`` =
    ``n``) gets the same samples whatever other prompts the call holds (a data-parallel rank's share of a
    rollout batch samples as in one process)."""
    ignore_eos: bool = False
    """Keep sampling past EOS (forced length, for speed benchmarks); engines that cannot, ignore it."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def for_prompts(self, prompts: list[str]) -> None:
        """Check ``prompt_seeds`` against the prompts of a call."""
        if self.prompt_seeds is not None and len(self.prompt_seeds) != len(prompts):
            raise ValueError(
                f"SamplingParams.prompt_seeds has {len(self.prompt_seeds)} seeds for {len(prompts)} prompts"
            )


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    """``"stop"`` (a stop string or EOS ended it) or ``"length"`` (``max_new_tokens`` reached)."""
    logprobs: list[float] | None = None
    """Log-probability of each sampled token in ``token_ids``, when the engine provides it."""
    meta: dict = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, ``params.n`` completions (outer list aligned with ``prompts``)."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> dict:
        """Load the trainer's current weights; returns timing/check metadata (e.g. ``{"time/sync": s}``)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WorkerEngine(Engine, Protocol):
    """An engine with its own copy of the weights (``hf-worker``), which can therefore run ahead of the
    trainer: weights are copied at a version and loaded later, and a rollout is generated and scored
    (old log-probs) by the same weights in one request. ``rlvr.engines.async_rollout`` drives it."""

    def snapshot(self, model: torch.nn.Module, version: int) -> Any:
        """Copy ``model``'s weights as weight version ``version`` now (the model may change afterwards)."""
        ...

    def load_snapshot(self, snap: Any) -> dict:
        """Load a snapshot, check it arrived intact, and tag the engine with its version; returns metrics."""
        ...

    def rollout(
        self,
        prompts: list[str],
        params: SamplingParams,
        request_id: int,
        logprob_batch_size: int = 16,
        score: bool = True,
    ) -> dict:
        """Generate and score in one request: ``request_id``, ``version``, ``completions``, ``input_ids``,
        ``labels``, ``response_mask``, ``old_log_probs`` (None without ``score``), ``time/generate`` and
        ``time/old_logprobs``."""
        ...


def generate_in_chunks(
    engine: Engine,
    prompts: list[str],
    params: SamplingParams,
    chunk_size: int,
    *,
    progress: str | None = None,
    seed_per_chunk: bool = False,
) -> tuple[list[list[Completion]], float]:
    """``engine.generate`` over ``prompts`` in chunks of ``chunk_size``; returns the groups and the seconds.

    ``progress`` names a progress bar counted in prompts (none when None). With ``seed_per_chunk`` the
    ``i``-th chunk samples with seed ``params.seed + i``, so that no two chunks draw the same noise."""
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc=progress, unit="prompt")
    outputs: list[list[Completion]] = []
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, len(prompts), chunk_size)):
        chunk_params = params
        if seed_per_chunk and params.seed is not None:
            chunk_params = dataclasses.replace(params, seed=params.seed + i)
        outputs += engine.generate(prompts[start : start + chunk_size], chunk_params)
        if bar is not None:
            bar.update(min(chunk_size, len(prompts) - start))
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return outputs, elapsed
