"""The training configuration: frozen dataclasses whose field docstrings are the ``--help`` text.

A run is described by one ``TrainConfig``. It is built from defaults (the suggested
hyperparameters: 200 steps, lr 1e-5, 32 prompts x 8 samples, grad accumulation 32, ...), then a
TOML, YAML or JSON file, then command-line overrides, in that order::

    rlvr train --config configs/gsm8k_olmo2_1b_grpo.yaml --algorithm.preset dr_grpo --seed 1 --out runs/x

Values are typed on the way in: ``TrainConfig.from_dict`` (used for files, sweeps and a run's
``config.json``) converts each value to its field's type and rejects what does not fit, naming the
key and the expected type (an integer where a float is expected is fine; a quoted ``"3"`` for an
integer is not). YAML files are read with YAML 1.2 numbers, so ``lr: 1e-5`` is a float (PyYAML's
YAML 1.1 rules would read it as a string).

Options of one engine sit in that engine's section (``engine.fast.*``, ``engine.worker.*``,
``engine.vllm.*``); a key or flag from before that grouping (``engine.cascade_min_rows``) is an error
that names the new key (``MOVED_KEYS``).

``validate()`` rejects impossible combinations of these fields with a message that names the fix.
This module imports no other rlvr package: what a value may be that a registry or another package
decides (estimator and engine names, model sizes, the task's prompt, data and reward, the number of
processes) is checked in ``rlvr.checks``, which also fills the defaults that follow from other fields
(``resolve_config``). Each command runs those checks before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
import types
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rlvr.errors import UserError
from rlvr.ranges import (
    ABOVE_ZERO_TO_ONE,
    AT_LEAST_ONE,
    BELOW_ONE,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    PROBABILITY,
    Range,
    range_problems,
)
from rlvr.training.rundir import atomic_write_text

SCHEDULES = ("constant", "cosine", "linear")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _failed(*checks: tuple[bool, str]) -> list[str]:
    """The message of each ``(holds, message)`` check that does not hold."""
    return [message for holds, message in checks if not holds]


class ConfigError(UserError, ValueError):
    """An impossible or inconsistent configuration."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank (0: no adapters, every weight trains). With a rank, only low-rank adapters on ``target_modules`` train (peft): checkpoints hold the adapters and a merged model, and the rollout engine samples from a merged copy."""
    alpha: float = 16.0
    """LoRA scale numerator: an adapter's update is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names (last part) of the linear layers that get adapters, or ["all-linear"] for every linear layer but the output head."""

    def __post_init__(self) -> None:
        problems = []
        if self.rank < 0:
            problems.append(f"model.lora.rank must be >= 0, got {self.rank}")
        if self.rank and self.alpha <= 0:
            problems.append(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            problems.append(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.rank and not self.target_modules:
            problems.append(
                "model.lora.target_modules is empty: name the layers that get adapters, e.g. [q_proj, v_proj]"
            )
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = "allenai/OLMo-2-0425-1B"
    """Hub id or local directory of the policy to train (ignored when ``fresh`` is set)."""
    fresh: str | None = None
    """Instead of loading, build a randomly initialised OLMo-2 of this size (tiny, small, 20m, olmo2-1b) with a tokenizer trained on the training data: for CPU runs and speed tests."""
    tokenizer_vocab_size: int = 512
    """Vocabulary size of the locally trained tokenizer (only with ``fresh``)."""
    dtype: str = "auto"
    """Policy dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (slower training step)."""
    compile: bool = False
    """Train through one ``torch.compile``d decoder-layer forward shared by every layer (dynamic shapes) and compiled float32 log-prob passes: fuses the norms, rotary embeddings and activations of the training forward and backward (rollout engines keep the eager model). The first steps pay the compile time (docs/benchmarks.md)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (peft) instead of full fine-tuning."""

    def problems(self) -> list[str]:
        """This section's impossible settings, one message each (``TrainConfig.validate`` adds those across sections)."""
        return _failed(
            (self.dtype in DTYPES, f"unknown model.dtype {self.dtype!r}: choose one of {DTYPES}"),
            (
                not (self.compile and self.lora.rank),
                "model.compile does not run LoRA models (the compiled stand-in is the plain decoder stack); "
                "set model.compile false or model.lora.rank 0",
            ),
        )


@dataclass(frozen=True)
class DataConfig:
    train_source: str = "openai/gsm8k"
    """Training data: a JSONL, JSON, Parquet or CSV file, a folder holding the split's file, a hub dataset id such as openai/gsm8k, or a task such as arith:steps=2."""
    train_split: str = "train"
    """Split of ``train_source`` to train on."""
    train_size: int | None = 6400
    """Use the first this-many training examples (None: all)."""
    val_source: str | None = None
    """Validation data (default: the same source as training)."""
    val_split: str = "test"
    """Split of the validation source."""
    val_size: int = 1024
    """Validation examples per evaluation (at least 1024 recommended: CoT evaluations are noisy)."""
    config: str | None = None
    """Config (subset) name of a hub dataset source (openai/gsm8k: main)."""
    question_field: str = "question"
    """Column that holds the question."""
    answer_field: str = "answer"
    """Column that holds the answer; every other column reaches the reward function as a keyword argument."""
    answer_format: str = "gsm8k"
    """How the ground truth comes out of the answer column: gsm8k (the text after the last ####), boxed (the last \\boxed{...}) or raw (the whole answer)."""
    val_sources: tuple[str, ...] = ()
    """Several validation sets, each 'NAME=SOURCE [split=...] [size=...] [config=...] [question_field=...] [answer_field=...] [answer_format=...] [reward=NAME]' (unset options as for val_source; reward: a built-in reward that grades this set instead of the run's), logged as val/NAME/...; the first one is also logged as val/reward. Replaces val_source."""

    def problems(self) -> list[str]:
        """This section's impossible settings, one message each (``TrainConfig.validate`` adds those across sections)."""
        return _failed((self.val_size >= 0, "data.val_size must be >= 0"))


@dataclass(frozen=True)
class PromptOptions:
    system: str | None = None
    """prompt chat: the system message (none when unset)."""
    user_template: str | None = None
    """prompt chat: the user message, a template text or file with a {question} placeholder (default: the question itself)."""
    stop: tuple[str, ...] | None = None
    """Stop strings, kept in the output (default: the prompt's own: </answer> for r1_zero and r1_zero_three_shot, none for the others)."""


@dataclass(frozen=True)
class RewardConfig:
    fn: str | None = None
    """Reward function: a built-in (r1_zero, question_only, boxed, exact, code) or a user function package.module:function or path/to/file.py:function, called as fn(response, ground_truth, **fields) and returning a float or a dict with 'reward' (default: the prompt's own: r1_zero for the r1_zero prompts, question_only for question_only, boxed otherwise)."""
    fns: tuple[str, ...] = ()
    """Several reward functions (names as for fn) whose rewards are summed with reward.weights; instead of fn."""
    weights: tuple[float, ...] = ()
    """Weight of each of reward.fns (default: 1 each)."""
    timeout_s: float = 10.0
    """Seconds one call of a user reward function may take; past it the call is cut off, scores 0 and is counted (train/reward/timeouts)."""
    workers: int = 1
    """Rows scored at once by each reward function (and by reward.url, in that many requests)."""
    worker_kind: str = "thread"
    """How a user function runs reward.workers calls at once: thread (threads of one worker process, or tasks for async def; for rewards that wait) or process (that many worker processes; for rewards that compute)."""
    url: str | None = None
    """A reward server instead of reward.fn: each step's rows are POSTed to it as JSON (docs/custom_task.md)."""
    code_isolation: bool = True
    """The code reward runs programs only in new namespaces (no network, read-only files); false lets it run them where the kernel allows none, with resource limits only (network and your files open to them; never as root)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last this many tokens before rollout.max_new_tokens add a penalty growing linearly to -reward.overlong_penalty at the limit (0: off)."""
    overlong_penalty: float = 1.0
    """The soft overlong penalty at rollout.max_new_tokens (verl's overlong_penalty_factor)."""

    def problems(self) -> list[str]:
        """This section's impossible settings, one message each (``TrainConfig.validate`` adds those across sections)."""
        return _failed(
            (self.overlong_penalty >= 0, f"reward.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        )


@dataclass(frozen=True)
class AlgorithmConfig:
    preset: str = "grpo"
    """Named algorithm (grpo, grpo_constant, dr_grpo, rft, maxrl, rloo): sets baseline, normalizer and loss normalization unless given."""
    baseline: str | None = None
    """Advantage baseline (mean, loo: leave-one-out mean of the other samples, none); default from the preset."""
    advantage_normalizer: str | None = None
    """Advantage normalizer (std, mean, none); default from the preset."""
    advantage_eps: float = 1e-6
    """Added to the normalizer to avoid division by zero."""
    loss_normalization: str | None = None
    """How token losses are aggregated: sequence (mean per sequence, then over sequences), constant (sum / normalization_constant) or token (sum / the batch's response tokens, DAPO); default from the preset."""
    normalization_constant: float | None = None
    """Divisor for constant normalization (default: train_batch_size x max_new_tokens, fixed for the whole run)."""
    reweighting: str = "none"
    """Importance reweighting: none (REINFORCE), noclip, ppo_clip (PPO token clip; also called grpo), gspo (sequence clip), cispo."""
    cliprange: float | None = None
    """Clip range epsilon of clipping methods, both sides (default per method: ppo_clip 0.2, gspo 3e-4, cispo 0.2)."""
    cliprange_low: float | None = None
    """Lower clip range: the ratio is clipped to [1 - cliprange_low, 1 + cliprange_high] (default: cliprange)."""
    cliprange_high: float | None = None
    """Upper clip range (default: cliprange_low); above it is DAPO's clip-higher (0.2 / 0.28). ppo_clip, gspo and cispo (which clips only above)."""
    skip_zero_advantage: bool = True
    """Do not run sequences with zero advantage through the model (they contribute exactly nothing)."""
    kl_coef: float = 0.0
    """Weight of the KL to a frozen reference (the initial policy; TRL's beta). 0: off, no reference is built."""
    kl_estimator: str = "k3"
    """Per-token KL estimator: k1 (kl), k2 (mse), k3 (low_var_kl, clamped to [-10, 10] as verl does); Schulman's."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL goes: loss (kl_coef x KL added to every token's loss before aggregation, as GRPO/TRL) or reward (kl_coef x the sequence's summed KL subtracted from its reward, as PPO-RLHF)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: responses cut by rollout.max_new_tokens carry no loss (their advantage is still part of their group's statistics)."""
    entropy_coef: float = 0.0
    """Entropy bonus: entropy_coef x the policy's per-token entropy is subtracted from every token's loss, aggregated like the loss (0: off)."""
    kl_reference_device: str | None = None
    """Device of the reference copy (default: the policy's); one process only. Under LoRA the reference is the policy with its adapters off (no copy)."""

    def problems(self) -> list[str]:
        """This section's impossible settings, one message each (``TrainConfig.validate`` adds those across sections)."""
        return _failed(
            (self.cliprange is None or self.cliprange > 0, f"algorithm.cliprange must be > 0, got {self.cliprange}"),
            (
                self.cliprange_high is None or self.cliprange_high > 0,
                f"algorithm.cliprange_high must be > 0, got {self.cliprange_high}",
            ),
            (self.kl_coef >= 0, f"algorithm.kl_coef must be >= 0 (0 turns the KL off), got {self.kl_coef}"),
            (
                self.entropy_coef >= 0,
                f"algorithm.entropy_coef must be >= 0 (0 turns the bonus off), got {self.entropy_coef}",
            ),
            (self.kl_in in ("loss", "reward"), f"algorithm.kl_in must be loss or reward, got {self.kl_in!r}"),
        )


@dataclass(frozen=True)
class RolloutConfig:
    n_prompts_per_rollout_batch: int = 32
    """Questions sampled per rollout step."""
    group_size: int = 8
    """Samples per question; advantages are normalised within each group."""
    rollout_batch_size: int | None = None
    """Alternative to n_prompts_per_rollout_batch: total rollouts per step (must be a multiple of group_size)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs are at temperature 1, so other values make the data off-policy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 512
    """Longest response in tokens; longer ones are cut (finish_reason 'length')."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (no signal) is replaced by a group of another prompt, sampled for its place in the batch, for up to filter_max_rounds extra rounds; logged as rollout/filter_*."""
    filter_max_rounds: int = 3
    """Extra sampling rounds of rollout.filter_groups per step; places still without signal after them train as they are (zero advantage)."""

    def problems(self) -> list[str]:
        """This section's impossible settings, one message each (``TrainConfig.validate`` adds those across sections)."""
        return _failed(
            (self.group_size >= 1, f"rollout.group_size must be >= 1, got {self.group_size}"),
            (
                self.n_prompts_per_rollout_batch >= 1,
                f"rollout.n_prompts_per_rollout_batch must be >= 1, got {self.n_prompts_per_rollout_batch}",
            ),
            (
                self.temperature > 0,
                "rollout.temperature must be > 0: greedy rollouts give identical samples per group and no signal",
            ),
            (0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}"),
            (self.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.filter_max_rounds >= 1, f"rollout.filter_max_rounds must be >= 1, got {self.filter_max_rounds}"),
        )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup, over all optimizer steps of the run."""
    warmup_steps: int = 0
    """Linear warmup, in optimizer steps."""
    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the peak for cosine and linear decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    master_weights: bool = True
    """With a bfloat16/float16 policy, step float32 copies of the weights (float32 AdamW moments) and write the rounded result back: pure bfloat16 AdamW drops every update below half a bfloat16 ulp, i.e. most updates at lr 1e-5. Costs 8 more bytes per parameter. No effect on float32 policies."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before every optimizer step."""
    train_batch_size: int | None = None
    """Rollouts per optimizer step (default: the rollout batch, i.e. on-policy: one step per rollout batch)."""
    gradient_accumulation_steps: int = 32
    """Microbatches per optimizer step (microbatch = train_batch_size / this)."""
    epochs_per_rollout_batch: int = 1
    """Passes over each rollout batch; more than one makes the later steps off-policy."""
    logprob_batch_size: int | None = None
    """Rows per forward when computing old log-probs (default: the microbatch size)."""
    max_tokens_per_microbatch: int | None = None
    """Also cap every microbatch at this many tokens (rows x longest row, rows sorted by length): with gradient_accumulation_steps 1 the token budget alone cuts the batch, so short rollouts share big microbatches and long ones get small ones. The gradient is the same either way."""
    shared_prefix: bool = False
    """Pass each prompt through the model once per microbatch for all of its responses: a microbatch is one packed sequence (each prompt once, then its responses, each seeing only its prompt and itself), max_tokens_per_microbatch counts its packed tokens. The gradient is the same; the saving grows with prompt length and group size. One process only (distributed.strategy none), without model.gradient_checkpointing; FlashAttention's variable-length kernels on CUDA in bf16/fp16 (docs/benchmarks.md)."""
    keep_head_logits: bool = False
    """Keep each microbatch's vocabulary logits from the forward for the backward instead of recomputing them: the same gradients, one of the head's four matmuls per token fewer, for response tokens x vocabulary x 2 bytes (bf16) while the microbatch runs (about 2.5 GB at 12,000 tokens and a 100,352-token vocabulary)."""

    def problems(self) -> list[str]:
        """This section's impossible settings, one message each (``TrainConfig.validate`` adds those across sections)."""
        return _failed(
            (
                self.epochs_per_rollout_batch >= 1,
                f"optim.epochs_per_rollout_batch must be >= 1, got {self.epochs_per_rollout_batch}",
            ),
            (self.lr > 0, f"optim.lr must be > 0, got {self.lr}"),
            (
                self.max_tokens_per_microbatch is None or self.max_tokens_per_microbatch >= 1,
                "optim.max_tokens_per_microbatch must be >= 1 (or null for no token cap), got "
                f"{self.max_tokens_per_microbatch}",
            ),
            (self.schedule in SCHEDULES, f"unknown optim.schedule {self.schedule!r}: choose one of {SCHEDULES}"),
            (self.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
            (0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio must be in [0, 1]"),
            (self.max_grad_norm > 0, "optim.max_grad_norm must be > 0"),
            (
                len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                f"optim.betas must be two numbers in [0, 1), got {self.betas}",
            ),
        )


@dataclass(frozen=True)
class FastEngineConfig:
    """Options of the hf-fast engine (also used by auto where it picks hf-fast)."""

    release_memory: bool = False
    """Free the static KV cache and CUDA graphs after every generation, so that the training step on the same GPU can use that memory (each generation then captures its graphs again, which costs time)."""
    attention: str = "auto"
    """Decode attention: triton (one kernel over the shared prompt and response caches; CUDA), sdpa (gathers each row's prompt K/V for torch's SDPA; any device; the CPU tests' reference) or auto (triton on CUDA when Triton is installed, else sdpa)."""
    fuse_projections: bool = True
    """On a GPU (compiled decode step): multiply by one stacked q/k/v matrix and one stacked gate/up matrix per layer instead of five (faster decoding; the stacked copies hold about half the model's weights, refreshed from the policy at every generation)."""
    cascade_min_rows: int | None = 64
    """With Triton attention and several samples per prompt: batch buckets of at least this many rows read each group's shared prompt once per step for all of its rows (cascade attention), instead of once per row; None turns it off. The default was the fastest of those timed (docs/benchmarks.md)."""


@dataclass(frozen=True)
class WorkerEngineConfig:
    """Options of the hf-worker engine (its own process and copy of the weights)."""

    dtype: str = "auto"
    """Engine model dtype (auto: bfloat16 on CUDA, float32 on CPU)."""


@dataclass(frozen=True)
class VLLMEngineConfig:
    """Options of the vllm engine (an OpenAI-compatible vLLM server)."""

    base_url: str | None = None
    """URL of a running vLLM server (None: the engine starts ``vllm serve`` itself)."""
    port: int = 8000
    """Port of the vLLM server the engine starts."""


@dataclass(frozen=True)
class EngineConfig:
    name: str = "hf"
    """Rollout engine: hf (in-process, shares the policy), hf-fast (the same with a static KV cache and CUDA
    graphs: the fastest on a GPU; OLMo-2, Llama, Qwen2 and Qwen3 models), auto (hf-fast when it runs the
    model, else hf), hf-worker (own process and device), vllm (a vLLM server; opt-in, never run against a real server)."""
    device: str = "auto"
    """Engine device for hf-worker/vllm (auto: cuda:1 when two GPUs are visible, else the policy device)."""
    max_batch_size: int = 256
    """Rows (prompts x samples) decoded together by the hf engines."""
    max_staleness: int = 0
    """0: synchronous (every batch sampled by the current weights); 1: one-step-async (hf-worker only): the engine samples batch t+1 while the trainer trains on batch t, and the configured importance reweighting corrects the one step of staleness."""
    fast: FastEngineConfig = field(default_factory=FastEngineConfig)
    worker: WorkerEngineConfig = field(default_factory=WorkerEngineConfig)
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)

    def problems(self) -> list[str]:
        """This section's impossible settings, its engines' sections included, one message each
        (``TrainConfig.validate`` adds those across sections)."""
        # auto: hf-fast where it runs the model (these settings apply there)
        fast_engines = ("hf-fast", "auto")
        fast = self.fast
        return _failed(
            (
                not fast.release_memory or self.name in fast_engines,
                f"engine.fast.release_memory applies to the hf-fast engine (its static KV cache), not to "
                f"engine.name={self.name!r}; set it to false or use engine.name=hf-fast",
            ),
            (
                fast.attention in ("auto", "triton", "sdpa"),
                f"engine.fast.attention must be auto, triton or sdpa, got {fast.attention!r}",
            ),
            (
                fast.attention == "auto" or self.name in fast_engines,
                f"engine.fast.attention applies to the hf-fast engine, not to engine.name={self.name!r}; leave it auto",
            ),
            (
                fast.fuse_projections or self.name in fast_engines,
                f"engine.fast.fuse_projections applies to the hf-fast engine, not to engine.name={self.name!r}; "
                "leave it true",
            ),
            (
                fast.cascade_min_rows == 64 or self.name in fast_engines,
                f"engine.fast.cascade_min_rows applies to the hf-fast engine, not to engine.name={self.name!r}; "
                "leave it 64",
            ),
            (
                fast.cascade_min_rows is None or fast.cascade_min_rows >= 1,
                "engine.fast.cascade_min_rows must be >= 1, or null to turn cascade attention off; got "
                f"{fast.cascade_min_rows}",
            ),
            (
                self.max_staleness in (0, 1),
                f"engine.max_staleness must be 0 (synchronous) or 1 (one-step-async), got {self.max_staleness}",
            ),
            (
                self.max_staleness != 1 or self.name == "hf-worker",
                "engine.max_staleness=1 needs an engine with its own copy of the weights that can run ahead of the "
                f"trainer; engine.name={self.name!r} cannot. Set engine.name=hf-worker (or max_staleness=0)",
            ),
            (self.worker.dtype in DTYPES, f"unknown engine.worker.dtype {self.worker.dtype!r}: choose one of {DTYPES}"),
        )


# Engine options that moved under their engine's section: old dotted key -> new one.
MOVED_KEYS = {
    "engine.release_memory": "engine.fast.release_memory",
    "engine.attention": "engine.fast.attention",
    "engine.fuse_projections": "engine.fast.fuse_projections",
    "engine.cascade_min_rows": "engine.fast.cascade_min_rows",
    "engine.dtype": "engine.worker.dtype",
    "engine.vllm_base_url": "engine.vllm.base_url",
    "engine.vllm_port": "engine.vllm.port",
}


def moved_key_error(old: str, flag: bool = False) -> ConfigError:
    """The one-line error for a key that moved (``flag``: spelled as a command-line flag)."""
    new = MOVED_KEYS[old]
    if flag:
        return ConfigError(f"--{old} is now --{new}; rename the flag")
    return ConfigError(f"config key {old} is now {new}; rename it")


def check_moved_flags(args: list[str]) -> None:
    """Raise ``moved_key_error`` for a command-line flag that names a moved key
    (``--engine.cascade_min_rows``, ``--engine.cascade-min-rows``, ``--engine.no-fuse-projections``...)."""
    for arg in args:
        if not arg.startswith("--"):
            continue
        section, _, name = arg[2:].split("=", 1)[0].replace("-", "_").rpartition(".")
        for candidate in (name, name.removeprefix("no_")):
            old = f"{section}.{candidate}"
            if old in MOVED_KEYS:
                raise moved_key_error(old, flag=True)


def upgrade_moved_keys(raw: dict) -> dict:
    """A copy of a config mapping written before the engine options moved, with each moved key in its
    new place (for reading a run directory's own ``config.json``, which the user did not write)."""
    out = json.loads(json.dumps(raw))
    for old, new in MOVED_KEYS.items():
        old_section, old_name = old.rsplit(".", 1)
        section = out.get(old_section)
        if isinstance(section, dict) and old_name in section:
            value = section.pop(old_name)
            *path, name = new.split(".")[1:]
            target = section
            for part in path:
                target = target.setdefault(part, {})
            target[name] = value
    return out


STRATEGIES = ("auto", "none", "ddp", "fsdp")


@dataclass(frozen=True)
class DistributedConfig:
    """Data-parallel training over the processes ``torchrun`` starts (one per GPU)."""

    strategy: Literal["auto", "none", "ddp", "fsdp"] = "auto"
    """auto: ddp when torchrun started several processes, else none (one process, no process group); ddp: a full replica per rank, gradients all-reduced; fsdp: FSDP2, parameters, gradients and optimizer state sharded per decoder layer over the ranks, float32 parameters computing in model.dtype (a one-process run with fsdp starts a process group of one, e.g. for cpu_offload)."""
    cpu_offload: bool = False
    """fsdp only: keep the sharded parameters, gradients and optimizer state in CPU memory (the optimizer steps there) and copy each layer to the GPU for its forward and backward: the largest models per GPU, at a cost in speed."""

    def problems(self) -> list[str]:
        """This section's impossible settings, one message each (``TrainConfig.validate`` adds those across sections)."""
        return _failed(
            (
                self.strategy in STRATEGIES,
                f"unknown distributed.strategy {self.strategy!r}: choose one of {STRATEGIES}",
            ),
            (
                not self.cpu_offload or self.strategy == "fsdp",
                f"distributed.cpu_offload needs distributed.strategy fsdp (got {self.strategy!r}); set the strategy to fsdp",
            ),
        )


@dataclass(frozen=True)
class LogConfig:
    wandb: bool = False
    """Mirror metrics to Weights & Biases (needs ``pip install wandb``)."""
    wandb_project: str = "rlvr"
    """W&B project."""
    tensorboard: bool = False
    """Mirror metrics to TensorBoard event files under DIR/tensorboard."""
    progress: bool = True
    """Show a progress bar with the current train and val reward."""
    val_samples: int = 64
    """Validation rollouts written to DIR/rollouts/val_step_N.jsonl at each evaluation."""
    engine_logprob_check_every: int = 10
    """On-policy runs: every this many steps compare the engine's log-probs with the trainer's (one extra forward; 0: never). Off-policy runs compare every step for free."""
    gradient_variance_every: int = 0
    """Every this many steps, before training on the batch, re-score its rollouts under several advantage estimators (no baseline, mean baseline, leave-one-out, the run's own) and log the per-group gradient variance of each as variance/... (two passes of one forward and two backwards per group; 0: never)."""

    def problems(self) -> list[str]:
        """This section's impossible settings, one message each (``TrainConfig.validate`` adds those across sections)."""
        return _failed((self.gradient_variance_every >= 0, "log.gradient_variance_every must be >= 0 (0 disables it)"))


TRAIN_RANGES: dict[str, Range] = {
    "model.tokenizer_vocab_size": AT_LEAST_ONE,
    "model.lora.rank": NON_NEGATIVE,
    "model.lora.alpha": POSITIVE,
    "model.lora.dropout": BELOW_ONE,
    "data.train_size": AT_LEAST_ONE,
    "data.val_size": NON_NEGATIVE,
    "reward.weights": NON_NEGATIVE,
    "reward.timeout_s": POSITIVE,
    "reward.workers": AT_LEAST_ONE,
    "reward.overlong_buffer": NON_NEGATIVE,
    "reward.overlong_penalty": NON_NEGATIVE,
    "algorithm.advantage_eps": POSITIVE,
    "algorithm.normalization_constant": POSITIVE,
    "algorithm.cliprange": POSITIVE,
    "algorithm.cliprange_low": POSITIVE,
    "algorithm.cliprange_high": POSITIVE,
    "algorithm.kl_coef": NON_NEGATIVE,
    "algorithm.entropy_coef": NON_NEGATIVE,
    "rollout.n_prompts_per_rollout_batch": AT_LEAST_ONE,
    "rollout.group_size": AT_LEAST_ONE,
    "rollout.rollout_batch_size": AT_LEAST_ONE,
    "rollout.temperature": POSITIVE,
    "rollout.top_p": ABOVE_ZERO_TO_ONE,
    "rollout.max_new_tokens": AT_LEAST_ONE,
    "rollout.filter_max_rounds": NON_NEGATIVE,
    "env.max_turns": AT_LEAST_ONE,
    "env.max_tokens": AT_LEAST_ONE,
    "optim.lr": POSITIVE,
    "optim.warmup_steps": NON_NEGATIVE,
    "optim.min_lr_ratio": PROBABILITY,
    "optim.betas": BELOW_ONE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.max_grad_norm": POSITIVE,
    "optim.train_batch_size": AT_LEAST_ONE,
    "optim.gradient_accumulation_steps": AT_LEAST_ONE,
    "optim.epochs_per_rollout_batch": AT_LEAST_ONE,
    "optim.logprob_batch_size": AT_LEAST_ONE,
    "optim.max_tokens_per_microbatch": AT_LEAST_ONE,
    "engine.max_batch_size": AT_LEAST_ONE,
    "engine.max_staleness": Range(0, 1),
    "engine.fast.cascade_min_rows": AT_LEAST_ONE,
    "engine.vllm.port": PORT,
    "log.val_samples": NON_NEGATIVE,
    "log.engine_logprob_check_every": NON_NEGATIVE,
    "log.gradient_variance_every": NON_NEGATIVE,
    "health.val_drop": NON_NEGATIVE,
    "health.entropy_min": NON_NEGATIVE,
    "health.length_collapse": PROBABILITY,
    "health.truncated_max": PROBABILITY,
    "health.no_signal_max": PROBABILITY,
    "health.patience": AT_LEAST_ONE,
    "health.clip_fraction_max": PROBABILITY,
    "health.ratio_kl_max": NON_NEGATIVE,
    "health.grad_spike": Range(1),
    "n_steps": AT_LEAST_ONE,
    "eval_every": NON_NEGATIVE,
    "eval_n": AT_LEAST_ONE,
    "dump_every": NON_NEGATIVE,
    "save_every": NON_NEGATIVE,
    "keep_checkpoints": AT_LEAST_ONE,
    "seed": NON_NEGATIVE,
    "max_consecutive_nonfinite": AT_LEAST_ONE,
}
"""The allowed range of every numeric field of ``TrainConfig`` (``rlvr.ranges``), checked first by ``validate``."""


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of the health signals (rlvr.training.health): a one-line warning when a run goes wrong."""

    enabled: bool = True
    """Watch the run and warn (progress bar / log, metrics.jsonl's "health" records, rlvr report)."""
    val_drop: float = 0.1
    """Warn when the main validation reward falls this far (absolute) below its best so far."""
    entropy_min: float = 0.001
    """Warn when the policy's mean token entropy (nats, averaged over `patience` steps) falls below this. Warm-started runs that learn can sit at a few thousandths: the GPU study's healthy runs ended at 0.003-0.03."""
    length_collapse: float = 0.3
    """Warn when the mean response length falls below this fraction of the first step's."""
    truncated_max: float = 0.5
    """Warn when more than this share of responses hit rollout.max_new_tokens (1: never)."""
    no_signal_max: float = 0.95
    """Warn when this share of groups or more has all-equal rewards (no gradient) for `patience` steps in a row."""
    patience: int = 5
    """Steps in a row the no-signal share must stay high before it warns; also the steps the entropy is averaged over."""
    clip_fraction_max: float = 0.2
    """Off-policy: warn when this share of tokens in an update has an importance ratio outside [0.8, 1.2]."""
    ratio_kl_max: float = 0.1
    """Off-policy: warn when the KL (k3) between the sampling and the current policy, averaged over a step's updates, reaches this."""
    grad_spike: float = 10.0
    """Warn when a step's largest gradient norm reaches this multiple of the median of recent steps' largest."""


@dataclass(frozen=True)
class EnvConfig:
    """What answers the model between its turns (rlvr.environments, docs/environments.md)."""

    name: str = "single_turn"
    """single_turn (one answer per prompt: the usual GRPO rollout) or tool (the model may call the tools of env.tools; each result comes back as a tool message and the model goes on), or a name added with rlvr.environments.register_environment (a plugin)."""
    max_turns: int = 4
    """Model turns per conversation at most; a conversation still going at this point ends as cut off (finish_reason length)."""
    max_tokens: int = 1024
    """Tokens after the prompt per conversation at most (the model's turns and the environment's messages together); each model turn is also capped at rollout.max_new_tokens."""
    tools: tuple[str, ...] = ("calculator",)
    """env.name tool: the tools offered, by name (rlvr.environments.tools.TOOLS: calculator, python; more with register_tool)."""
    tool_format: str = "auto"
    """How the model writes tool calls: hermes (Qwen2.5/Qwen3: <tool_call>{json}</tool_call>), llama3 (a JSON object as the message), plain (base models: the hermes call, stopped at </tool_call>, the result appended as <tool_response>...</tool_response>), or auto (from the chat template; plain without one)."""


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prompt: str = "r1_zero"
    """Prompt: a built-in template (r1_zero, question_only, r1_zero_three_shot), a template file with a {question} placeholder, or chat (the model tokenizer's chat template; see prompt_options). Also picks the default reward."""
    prompt_options: PromptOptions = field(default_factory=PromptOptions)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    n_steps: int = 200
    """Rollout steps (each: sample, grade, one or more optimizer steps)."""
    eval_every: int = 10
    """Evaluate on the validation set every this many steps (0: only at the start and the end)."""
    eval_at_start: bool = True
    """Evaluate the initial policy (logged as step 0)."""
    eval_n: int = 1
    """Samples per validation question (at rollout.temperature); above 1 each validation set also logs avg@k (the mean share of a question's k samples that are correct) and pass@j for j = 1, 2, 4, ..., k."""
    dump_every: int = 40
    """Write the step's rollouts to DIR/rollouts/step_N.jsonl every this many steps (0: never)."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end unless save_at_end is false; 0: only at the end)."""
    save_at_end: bool = True
    """Checkpoint after the last step. False for throwaway runs (benchmarks, quick sweeps): a run that ends leaves its metrics, summary, best model and periodic checkpoints only; Ctrl-C and SIGTERM still save."""
    keep_checkpoints: int = 1
    """How many of the newest checkpoints to keep on disk."""
    save_best: bool = True
    """Keep the model of the best validation so far (main validation reward, ties to the later step) in DIR/checkpoints/best/model, apart from the rolling checkpoints."""
    seed: int = 0
    """Seed of everything: data order, sampling, initialisation of fresh models."""
    policy_device: str = "auto"
    """Device of the policy and optimizer (auto: cuda:0 when available, else cpu)."""
    max_consecutive_nonfinite: int = 3
    """Stop the run after this many optimizer steps in a row with a non-finite loss or gradient norm."""
    plugins: tuple[str, ...] = ()
    """Modules or .py files imported before the config is resolved (they register custom estimators)."""

    # -- derived quantities -------------------------------------------------------------------
    @property
    def rollout_batch_size(self) -> int:
        return self.rollout.n_prompts_per_rollout_batch * self.rollout.group_size

    @property
    def train_batch_size(self) -> int:
        return self.optim.train_batch_size or self.rollout_batch_size

    @property
    def updates_per_rollout_batch(self) -> int:
        return self.optim.epochs_per_rollout_batch * (self.rollout_batch_size // self.train_batch_size)

    @property
    def off_policy(self) -> bool:
        """More than one optimizer step per rollout batch: every step after the first is off-policy."""
        return self.updates_per_rollout_batch > 1

    @property
    def microbatch_size(self) -> int:
        return self.train_batch_size // self.optim.gradient_accumulation_steps

    # -- resolution and validation ------------------------------------------------------------
    def validate(self, problems: Sequence[str] = ()) -> list[str]:
        """Raise ``ConfigError`` for impossible settings; return (and emit) warnings for dubious ones.

        ``problems`` are those found outside this module (``rlvr.checks``: names that registries and other
        packages decide), reported together with the ones found here. Call on a resolved config.
        """
        errors: list[str] = list(problems)
        warns: list[str] = []
        a, r, o = self.algorithm, self.rollout, self.optim

        def need(cond: bool, msg: str) -> None:
            if not cond:
                errors.append(msg)

        sections = (a, r, self.reward, o, self.engine, self.model, self.distributed, self.log, self.data)
        for section_problems in (section.problems for section in sections):
            errors += section_problems()
        # The rest involve more than one section, or the run itself.
        need(
            a.kl_reference_device is None or self.distributed.strategy in ("auto", "none"),
            "algorithm.kl_reference_device places the reference in one process; under distributed.strategy "
            f"{self.distributed.strategy} it sits on each rank's device: drop the setting",
        )
        need(
            a.kl_reference_device is None or not self.model.lora.rank,
            "algorithm.kl_reference_device: under LoRA the reference is the policy with its adapters off (no copy "
            "to place); drop the setting",
        )

        if a.advantage_normalizer == "std":
            need(
                r.group_size >= 2,
                "advantage_normalizer=std needs rollout.group_size >= 2 (the std of one sample is undefined)",
            )
        elif a.baseline == "loo":
            need(
                r.group_size >= 2,
                "algorithm.baseline=loo (rloo) needs rollout.group_size >= 2: the baseline is the mean of the other samples",
            )
        elif a.baseline == "mean":
            need(
                r.group_size >= 2,
                "rollout.group_size=1 with algorithm.baseline=mean makes every advantage 0 (each sample "
                "is its own group's mean), so nothing would train; use rollout.group_size >= 2 or algorithm.baseline=none",
            )
        need(
            not r.filter_groups or (self.engine.max_staleness == 0 and self.engine.name != "hf-worker"),
            "rollout.filter_groups samples more prompts at the step with the current weights; it needs a synchronous "
            f"engine (engine.max_staleness 0, not hf-worker; got {self.engine.name}, max_staleness "
            f"{self.engine.max_staleness})",
        )
        rw = self.reward
        need(
            0 <= rw.overlong_buffer <= r.max_new_tokens,
            f"reward.overlong_buffer must be in [0, rollout.max_new_tokens={r.max_new_tokens}], got {rw.overlong_buffer}",
        )

        rb, tb, ga = self.rollout_batch_size, self.train_batch_size, o.gradient_accumulation_steps
        need(
            tb >= 1 and rb % tb == 0,
            f"the rollout batch ({rb} = {r.n_prompts_per_rollout_batch} prompts x {r.group_size}) is not divisible by "
            f"optim.train_batch_size={tb}; pick a divisor of {rb}",
        )
        need(
            ga >= 1 and tb % ga == 0,
            f"optim.train_batch_size={tb} is not divisible by optim.gradient_accumulation_steps={ga}; pick a divisor of {tb}",
        )
        need(tb <= rb, f"optim.train_batch_size={tb} exceeds the rollout batch ({rb}); lower it")
        d = self.distributed
        need(
            not (self.optim.shared_prefix and d.strategy in ("ddp", "fsdp")),
            f"optim.shared_prefix packs microbatches in one process; with distributed.strategy {d.strategy} "
            "set optim.shared_prefix false",
        )
        need(
            not (self.optim.shared_prefix and self.model.gradient_checkpointing),
            "optim.shared_prefix cannot recompute a packed forward under model.gradient_checkpointing; "
            "set one of them false",
        )
        need(self.n_steps >= 1, f"n_steps must be >= 1, got {self.n_steps}")
        for name in ("eval_every", "dump_every", "save_every"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0 (0 disables it)")
        need(self.eval_n >= 1, f"eval_n must be >= 1 (samples per validation question), got {self.eval_n}")
        if self.log.gradient_variance_every:
            need(
                r.group_size >= 2 and r.n_prompts_per_rollout_batch >= 2,
                "log.gradient_variance_every needs at least two prompts of at least two samples per rollout batch "
                "(a variance across groups); raise rollout.group_size / n_prompts_per_rollout_batch or set it to 0",
            )
        need(self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1")
        need(self.max_consecutive_nonfinite >= 1, "max_consecutive_nonfinite must be >= 1")
        if self.data.train_size is not None:
            need(
                self.data.train_size >= r.n_prompts_per_rollout_batch,
                f"data.train_size={self.data.train_size} is smaller than one rollout batch of "
                f"{r.n_prompts_per_rollout_batch} prompts; raise it or lower rollout.n_prompts_per_rollout_batch",
            )
        errors += range_problems(self, TRAIN_RANGES, known=errors)
        if errors:
            # One problem: one line. Several: one line each, so that each names its own fix.
            raise ConfigError(
                f"invalid configuration: {errors[0]}"
                if len(errors) == 1
                else "invalid configuration:\n  - " + "\n  - ".join(errors)
            )

        if self.off_policy and a.reweighting == "none":
            warns.append(
                f"{self.updates_per_rollout_batch} optimizer steps per rollout batch with algorithm.reweighting=none: every step "
                "after the first uses stale samples without importance weights (biased). Use noclip, ppo_clip, gspo or cispo "
                "unless this is the 'none' arm of a comparison."
            )
        if r.temperature != 1.0 and a.reweighting != "none":
            warns.append(
                "rollout.temperature != 1 with importance reweighting: the old log-probs are at temperature 1, "
                "not the sampling distribution"
            )
        e = self.engine
        if e.max_staleness and e.device == self.policy_device and e.device.startswith("cuda"):
            warns.append(
                f"engine.max_staleness=1 with the engine on the policy's device ({e.device}): generation and "
                "training share one GPU, so they barely overlap; put the engine on another GPU (engine.device)"
            )
        if self.data.val_size < 1024 and self.data.val_size > 0 and self.model.fresh is None:
            warns.append(
                f"data.val_size={self.data.val_size} < 1024: CoT evaluations are noisy; use >= 1024 for results you compare"
            )
        for w in warns:
            warnings.warn(w, stacklevel=2)
        return warns

    def check_data(self, n_train: int, n_val: int) -> None:
        """Checks that need the loaded data (still before any model loads)."""
        if n_train < self.rollout.n_prompts_per_rollout_batch:
            raise ConfigError(
                f"the training data has {n_train} examples, fewer than one rollout batch of "
                f"{self.rollout.n_prompts_per_rollout_batch} prompts; lower rollout.n_prompts_per_rollout_batch or use more data"
            )
        if self.data.val_size > n_val:
            raise ConfigError(
                f"data.val_size={self.data.val_size} but the validation data has only {n_val} examples; "
                f"set data.val_size <= {n_val} or point data.val_source/val_split at a larger set"
            )

    def data_parallel_strategy(self, world_size: int) -> str:
        """The strategy a run over ``world_size`` processes uses: ``none``, ``ddp`` or ``fsdp``."""
        s = self.distributed.strategy
        if s == "auto":
            return "ddp" if world_size > 1 else "none"
        return s

    # -- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        return _from_dict(cls, d, "")


_PLURAL = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in members) + " (or null)"
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_PLURAL.get(args[0], 'values')}"
        return f"a list of {len(args)} " + (_PLURAL.get(args[0], "values") if len(set(args)) == 1 else "values")
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _show(value: object) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}
    return f"{kind.get(type(value), type(value).__name__)} {value!r}"


_NUMBER = re.compile(r"^\s*[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")


def convert_value(value: Any, tp: Any, key: str) -> Any:
    """``value`` as field type ``tp`` (from a YAML, TOML or JSON file); raises ``ConfigError`` naming ``key``
    and the expected type. Also read by the commands whose run directories save a flat config
    (``rlvr.training.scaffold.settings_from_saved``)."""
    origin = typing.get_origin(tp)

    def wrong(extra: str = "") -> ConfigError:
        hint = extra or (
            " (write the number without quotes)"
            if isinstance(value, str) and _NUMBER.match(value) and tp in (int, float)
            else ""
        )
        return ConfigError(f"config key {key} must be {_type_name(tp)}, got {_show(value)}{hint}")

    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            try:
                return convert_value(value, inner[0], key)
            except ConfigError:
                raise wrong() from None
        raise wrong()
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is not bool:
            return value
        raise wrong()
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise wrong()
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert_value(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise wrong()
        return tuple(convert_value(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise wrong()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise wrong()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise wrong()
    if tp is str:
        if isinstance(value, str):
            return value
        raise wrong()
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise wrong(" (a path)")
    if tp is Any:
        return value
    raise ConfigError(f"config key {key} has a type ({tp}) that files cannot set; set it in Python")


def _from_dict(cls: Any, d: dict, where: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(
            f"{'config key ' + where.rstrip('.') if where else 'the config'} must be a mapping of "
            f"keys to values, got {_show(d)}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(d) - set(fields))
    for key in unknown:
        if where + str(key) in MOVED_KEYS:
            raise moved_key_error(where + str(key))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(where + str(k) for k in unknown)}; valid keys here: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    errors: list[str] = []
    for name, value in d.items():
        tp = hints[name]
        try:
            if dataclasses.is_dataclass(tp):
                kwargs[name] = _from_dict(tp, value, f"{where}{name}.")
            else:
                kwargs[name] = convert_value(value, tp, where + name)
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("; ".join(errors))
    return cls(**kwargs)


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats: ``1e-5`` (no dot) is a number, as YAML 1.2 and
    TOML read it; YAML 1.1 reads it as a string."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*\.?\d*|\.\d+)[eE][-+]?\d+$|^[-+]?(?:\d[\d_]*)?\.\d+$|^[-+]?\d[\d_]*\.\d*$"),
    list("-+0123456789."),
)


def load_yaml(path: str | Path) -> Any:
    """A YAML file with YAML 1.2 numbers: ``1e-5`` is a float (YAML 1.1, PyYAML's default, reads a
    string). Raises ``ConfigError`` for a file that does not parse."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            return yaml.load(f, Loader=YamlLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem}); fix the file") from None


def read_config_file(path: str | Path) -> dict:
    """The raw mapping of a YAML (.yaml/.yml), TOML (.toml) or JSON (.json) config file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix in (".yaml", ".yml"):
        data = load_yaml(path)
        data = {} if data is None else data
    elif path.suffix == ".toml":
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e}); fix the file") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e}); fix the file") from None
    else:
        raise ConfigError(f"config file {path} must end in .yaml, .yml, .toml or .json")
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of config keys (sections model, data, ...), "
            f"not a {type(data).__name__}"
        )
    return data


def load_config_file(path: str | Path) -> TrainConfig:
    """A ``TrainConfig`` from a YAML, TOML or JSON file (sections are nested tables), values typed."""
    path = Path(path)
    try:
        return TrainConfig.from_dict(read_config_file(path))
    except ConfigError as e:
        if str(e).startswith(str(path)):
            raise
        raise ConfigError(f"{path}: {e}") from None


def save_config(config: TrainConfig, path: str | Path) -> None:
    """Write ``config`` as JSON, atomically (a kill mid-write leaves the previous file whole)."""
    atomic_write_text(path, json.dumps(config.to_dict(), indent=2) + "\n")


# Fields that may change when a run is resumed without changing what it computes up to now.
RESUMABLE_CHANGES = (
    "n_steps",
    "eval_every",
    "eval_at_start",
    "eval_n",
    "dump_every",
    "save_every",
    "save_at_end",
    "keep_checkpoints",
    "save_best",
    "health.",
    "log.",
    "distributed.cpu_offload",
    "reward.timeout_s",  # the reward-timeout error suggests raising it and resuming
)


def config_differences(a: TrainConfig, b: TrainConfig) -> list[str]:
    """Dotted names of fields that differ between two configs."""
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


def flatten(d: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty mapping stays a value)."""
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
