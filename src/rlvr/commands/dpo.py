"""`rlvr dpo`: Direct Preference Optimization of an instruction-tuned model on preference pairs.

DPO (Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model") fits a policy to pairs (prompt x, chosen y_c, rejected y_r) without a reward model.
Against a frozen reference (the SFT model) the implicit reward of a response is
``r(x, y) = beta * (log pi(y|x) - log ref(y|x))`` and the loss of a pair is

    -log sigmoid(r(x, y_c) - r(x, y_r))
      = -log sigmoid(beta * ((log pi(y_c) - log pi(y_r)) - (log ref(y_c) - log ref(y_r)))).

As in the course, ``log pi(y)`` is the summed token log-probability of the whole Alpaca-formatted
sequence (prompt + response + EOS, with the tokenizer's BOS): the prompt's tokens are the same in
both sequences and cancel. The reference's two log-probs of a pair never change, so they are
computed once per pair, on the reference's own device when one is given, and kept (in checkpoints
too). *Preference accuracy* is the share of pairs whose implicit reward ranks the chosen response
above the rejected one; on held-out pairs it is the validation signal, and the best checkpoint by it
is kept in ``OUT/best``.

Data: Anthropic HH (``--format hh``: ``{chosen, rejected}`` transcripts ``"\\n\\nHuman: ...\\n\\nAssistant: ..."``;
only conversations with a single human turn are kept, split into instruction / chosen / rejected, and
each pair remembers its source file) or generic ``{prompt, chosen, rejected}`` JSONL (``--format pairs``).
In a generic row the three may be strings (the Alpaca template, as above) or TRL's conversational
preference rows: ``prompt`` a message list, ``chosen`` / ``rejected`` the assistant's messages (or
whole conversations that start with the prompt, or, with no ``prompt`` column, two conversations
whose shared first messages are the prompt). Those are rendered with the model's chat template, and
``log pi(y)`` sums the log-probs of the response's tokens only (the prompt rendered with the
generation prompt is cut off, as TRL does).
The course's settings are the defaults: beta 0.1, RMSprop at lr 1e-6, one pair per forward,
64 pairs per optimizer step, 200 held-out pairs.

``summary.json`` says how the run stands; Ctrl-C and SIGTERM finish the step, save a checkpoint and
exit with 130 / 143 (``rlvr.training.scaffold``).

    rlvr dpo --model runs/sft --data hh-rlhf/harmless-base hh-rlhf/helpful-base --out runs/dpo
    rlvr dpo --resume runs/dpo
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

import torch
import torch.nn.functional as F

from rlvr.errors import UserError
from rlvr.machine import resolve_device
from rlvr.modeling import check_chat_template_before_load, load_model_and_tokenizer, resolve_dtype
from rlvr.ranges import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Range, check_flags
from rlvr.task.chat import check_messages, is_messages, tokenize_prompt_completion
from rlvr.task.data import DataError
from rlvr.task.data_order import batch_indices
from rlvr.task.instruction_data import alpaca_format, encode_documents, read_jsonl
from rlvr.training.checkpoint import load_trainer_state, refuse_edited_settings, resumable_checkpoint, save_checkpoint
from rlvr.training.logprobs import compile_backbone, get_response_log_probs
from rlvr.training.metrics_log import MetricsLogger, truncate_metrics
from rlvr.training.optim import lr_schedule, make_adamw, make_rmsprop
from rlvr.training.rundir import RunDirLock, atomic_write_json, prepare_output_dir
from rlvr.training.scaffold import TrainingRun, remove_outputs, resumed_settings, saved_settings
from rlvr.training.tokenize import pad_token_id

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

OUTPUT_FILES = ("metrics.jsonl", "config.json", "best", "checkpoints", "summary.json")

# ---------------------------------------------------------------------------------------------
# 1. Preference pairs
# ---------------------------------------------------------------------------------------------


Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PreferencePair:
    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    source: str = ""
    """Where the pair came from (for HH: the subset's file, e.g. ``harmless-base/train.jsonl.gz``)."""

    @property
    def conversational(self) -> bool:
        """Whether the pair is rendered with the chat template (its prompt is a message list)."""
        return isinstance(self.prompt, list)


def conversational_pair(row: dict, where: str, source: str = "") -> PreferencePair:
    """The pair of a TRL conversational preference row: ``prompt`` messages (a string is one user
    message; absent, the messages that ``chosen`` and ``rejected`` share from the start) and the two
    responses (a string is one assistant message; a conversation that starts with the prompt keeps
    what follows it)."""

    def as_messages(value: Any, role: str, key: str) -> Messages:
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        return check_messages(value, f"{where}, {key}")

    chosen = as_messages(row.get("chosen"), "assistant", "chosen")
    rejected = as_messages(row.get("rejected"), "assistant", "rejected")
    if row.get("prompt") is None:
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise DataError(
                f"{where}: no prompt column and chosen and rejected share no first message; give the prompt's messages"
            )
        prompt = chosen[:shared]
    else:
        prompt = as_messages(row["prompt"], "user", "prompt")
    cut = lambda response: response[len(prompt) :] if response[: len(prompt)] == prompt else response  # noqa: E731
    chosen, rejected = cut(chosen), cut(rejected)
    if not chosen or not rejected:
        raise DataError(f"{where}: chosen or rejected holds the prompt only; give each response's messages")
    return PreferencePair(prompt, chosen, rejected, source)


_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def hh_turns(transcript: str) -> list[tuple[str, str]]:
    """``[(role, text), ...]`` of an HH transcript (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``)."""
    parts = _HH_TURN.split(transcript)
    # parts = [before the first marker, role, text, role, text, ...]
    return [(parts[i], parts[i + 1].strip()) for i in range(1, len(parts) - 1, 2)]


def hh_pair(row: dict, source: str = "") -> PreferencePair | None:
    """The pair of one HH row when both transcripts are one human turn and one assistant turn with the
    same human turn; None for multi-turn conversations."""
    chosen, rejected = hh_turns(row["chosen"]), hh_turns(row["rejected"])
    single = lambda turns: [r for r, _ in turns] == ["Human", "Assistant"]  # noqa: E731
    if not (single(chosen) and single(rejected)) or chosen[0][1] != rejected[0][1]:
        return None
    return PreferencePair(chosen[0][1], chosen[1][1], rejected[1][1], source)


def _data_files(path: Path, split: str) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name in (f"{split}.jsonl", f"{split}.jsonl.gz"))
    if not files:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
    if not files:
        raise DataError(f"{path} holds no {split}.jsonl(.gz) nor any .jsonl(.gz) file")
    return files


def _detect_format(row: dict, where: str) -> str:

    if all(isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")):
        return "pairs"
    if any(is_messages(row.get(k)) for k in ("prompt", "chosen", "rejected")):
        return "pairs"
    if all(isinstance(row.get(k), str) for k in ("chosen", "rejected")) and "Human:" in row["chosen"]:
        return "hh"
    raise DataError(
        f"{where}: cannot tell the format: expected {{prompt, chosen, rejected}} strings or message lists "
        "(pairs) or HH transcripts {chosen, rejected}; pass --format"
    )


def load_preference_pairs(
    sources: list[str] | tuple[str, ...], fmt: str = "auto", split: str = "train", limit: int | None = None
) -> tuple[list[PreferencePair], dict]:
    """Pairs from files, directories (their ``{split}.jsonl(.gz)`` files) or the hub id
    ``Anthropic/hh-rlhf[:subset]``; returns ``(pairs, counts)`` with how many rows were read, kept,
    dropped as multi-turn and dropped as identical (chosen == rejected: no signal)."""
    counts = {"rows": 0, "multi_turn": 0, "identical": 0}
    pairs: list[PreferencePair] = []
    for source in sources:
        if not Path(source).exists() and source.split(":")[0].count("/") == 1:
            rows_by_file = _hub_rows(source, split)
        else:
            root = Path(source)
            if not root.exists():
                raise DataError(
                    f"{root}: no such file or directory; pass HH files or directories, or "
                    "{prompt, chosen, rejected} JSONL files"
                )
            rows_by_file = [
                (str(f.relative_to(root.parent)) if root.is_dir() else f.name, read_jsonl(f))
                for f in _data_files(root, split)
            ]
        for name, rows in rows_by_file:
            for i, row in enumerate(rows):
                counts["rows"] += 1
                kind = fmt if fmt != "auto" else _detect_format(row, f"{name}:{i + 1}")
                if kind == "hh":
                    pair = hh_pair(row, name)
                    if pair is None:
                        counts["multi_turn"] += 1
                        continue
                elif any(isinstance(row.get(k), list) for k in ("prompt", "chosen", "rejected")):
                    pair = conversational_pair(row, f"{name}:{i + 1}", row.get("source", name))
                else:
                    pair = PreferencePair(row["prompt"], row["chosen"], row["rejected"], row.get("source", name))
                if pair.chosen == pair.rejected:
                    counts["identical"] += 1
                    continue
                pairs.append(pair)
                if limit is not None and len(pairs) >= limit:
                    return pairs, {**counts, "kept": len(pairs)}
    return pairs, {**counts, "kept": len(pairs)}


def _hub_rows(source: str, split: str) -> list[tuple[str, list[dict]]]:
    import datasets

    name, _, subset = source.partition(":")
    ds = datasets.load_dataset(name, data_dir=subset or None, split=split)
    return [(f"{source}/{split}", list(ds))]


# ---------------------------------------------------------------------------------------------
# 2. The loss
# ---------------------------------------------------------------------------------------------


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> dict[str, torch.Tensor]:
    """DPO on summed sequence log-probs (any matching shapes): ``loss`` = -log sigmoid(margin) where
    ``margin = chosen_reward - rejected_reward`` and ``*_reward = beta * (policy - ref)``."""
    chosen_reward = beta * (policy_chosen - ref_chosen.to(policy_chosen.device))
    rejected_reward = beta * (policy_rejected - ref_rejected.to(policy_rejected.device))
    margin = chosen_reward - rejected_reward
    return {
        "loss": -F.logsigmoid(margin),
        "margin": margin,
        "chosen_reward": chosen_reward,
        "rejected_reward": rejected_reward,
    }


def pair_token_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, responses: list[str]) -> list[list[int]]:
    """Token ids of ``prompt`` with each response in the Alpaca template, BOS per the tokenizer, EOS last."""
    return encode_documents(tokenizer, [alpaca_format(prompt, r) for r in responses])


def sequence_log_probs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    pad_id: int = 0,
    backbone: Callable[..., Any] | None = None,
    scored_from: list[int] | None = None,
) -> torch.Tensor:
    """Summed log-probability of each token sequence, in one right-padded forward; shape
    (len(sequences),), float32, on the model's device. Tokens from index ``scored_from[i]`` of sequence
    ``i`` count (default 1: every token after the first)."""

    width = max(len(s) for s in sequences)
    if width < 2:
        raise ValueError("every sequence is shorter than 2 tokens: there is nothing to score")
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    padded = bool((mask == 0).any())
    scored = mask[:, 1:]
    if scored_from is not None:
        scored = scored * (torch.arange(1, width) >= torch.tensor(scored_from).unsqueeze(1))
    lp = get_response_log_probs(
        model, ids[:, :-1], ids[:, 1:], attention_mask=mask[:, :-1] if padded else None, backbone=backbone
    )["log_probs"]
    return (lp * scored.to(lp.device)).sum(-1)


class TokenPair(NamedTuple):
    """A tokenized pair: the two whole sequences and where their scored tokens start."""

    chosen: list[int]
    rejected: list[int]
    scored_from: int = 1
    """Index of the first token whose log-prob counts: 1 (every token after the first) for Alpaca
    pairs, the rendered prompt's length for conversational ones."""


def pair_sequences(token_pairs: Sequence[tuple], indices: list[int]) -> tuple[list[list[int]], list[int]]:
    """The sequences of pairs ``indices`` (chosen, rejected, chosen, ...) and where each one's scored tokens start."""
    pairs = [TokenPair(*token_pairs[i]) for i in indices]
    return [s for p in pairs for s in (p.chosen, p.rejected)], [p.scored_from for p in pairs for _ in range(2)]


def compute_per_instance_dpo_loss(
    lm: torch.nn.Module,
    lm_ref: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    beta: float,
    prompt: str,
    response_chosen: str,
    response_rejected: str,
) -> torch.Tensor:
    """The DPO loss of one pair, a scalar on ``lm``'s device, differentiable in ``lm``; ``lm_ref``
    may sit on another device and gets no gradient."""

    seqs = pair_token_ids(tokenizer, prompt, [response_chosen, response_rejected])
    pad = pad_token_id(tokenizer)
    policy = sequence_log_probs(lm, seqs, pad)
    with torch.no_grad():
        ref = sequence_log_probs(lm_ref, seqs, pad)
    return dpo_loss(policy[0], policy[1], ref[0], ref[1], beta)["loss"]


# ---------------------------------------------------------------------------------------------
# 3. Training
# ---------------------------------------------------------------------------------------------


@dataclass
class DPOConfig:
    """DPO of an instruction-tuned model on preference pairs (the course's settings by default)."""

    model: str = ""
    """The SFT checkpoint (local directory or hub id): the starting policy and the frozen reference."""
    data: tuple[str, ...] = ()
    """Preference data: HH files or directories (their train.jsonl.gz), {prompt, chosen, rejected} JSONL files (strings, or message lists rendered with the chat template), or Anthropic/hh-rlhf[:subset] from the hub."""
    out: Path | None = None
    """Run directory: metrics.jsonl, checkpoints/, best/ (the best model by validation preference accuracy)."""
    format: Literal["auto", "hh", "pairs"] = "auto"
    """Data format (auto: from the first row of each file)."""
    split: str = "train"
    """Which split file to read from directories and the hub."""
    val_data: tuple[str, ...] = ()
    """Validation pairs (default: --val-size pairs held out of --data)."""
    val_size: int = 200
    """Pairs held out of --data for validation when --val-data is not given."""
    max_pairs: int | None = None
    """Read at most this many pairs of --data."""
    max_tokens: int = 1024
    """Drop pairs whose chosen or rejected sequence is longer than this many tokens."""
    beta: float = 0.1
    """DPO temperature: the implicit reward is beta x the policy/reference log-ratio."""
    lr: float = 1e-6
    """Peak learning rate."""
    optimizer: Literal["rmsprop", "adamw"] = "rmsprop"
    """Optimizer (the course uses RMSprop: one state tensor per parameter instead of AdamW's two)."""
    batch_size: int = 64
    """Pairs per optimizer step; gradients accumulate over the forwards."""
    pairs_per_forward: int = 1
    """Pairs per forward (chosen and rejected sequences together); the course uses one. More is faster for short sequences."""
    epochs: float = 1.0
    """Passes over the training pairs (used when --steps is unset)."""
    steps: int | None = None
    """Optimizer steps (overrides --epochs; may be raised when resuming)."""
    warmup_steps: int = 0
    """Linear warm-up steps; the learning rate is constant afterwards."""
    weight_decay: float = 0.0
    """Weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before every optimizer step."""
    eval_every: int = 10
    """Validate (and keep the best model) every this many optimizer steps, and at the end."""
    eval_batch_pairs: int = 8
    """Pairs per forward when scoring validation pairs (no gradient)."""
    save_every: int = 50
    """Checkpoint for --resume every this many steps (always at the end; 0: only then)."""
    seed: int = 0
    """Seed of the held-out split and the order of pairs."""
    device: str = "auto"
    """Device of the policy and optimizer (auto: cuda:0 when available, else cpu)."""
    ref_device: str | None = None
    """Device of the reference model (default: the policy's), e.g. cuda:1."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Model dtype (auto: bfloat16 on CUDA, float32 on CPU)."""
    master_weights: bool = True
    """With a bfloat16 policy, step float32 copies of the weights (lr 1e-6 updates would otherwise round away)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (less memory, slower)."""
    compile: bool = False
    """Run the policy through one torch.compile'd decoder-layer forward shared by all layers."""
    wandb: bool = False
    """Mirror metrics to Weights & Biases."""
    wandb_project: str = "rlvr"
    """W&B project."""
    tensorboard: bool = False
    """Mirror metrics to TensorBoard event files under OUT/tensorboard."""
    progress: bool = True
    """Show a progress bar."""
    overwrite: bool = False
    """Replace a run already in --out."""
    resume: Path | None = None
    """Continue the run in this directory from its latest checkpoint (with its saved config; --steps may change)."""
    fresh_optimizer: bool = False
    """With --resume: accept a checkpoint that holds weights only (its trainer_state.pt deleted or lost) and continue from its step with a fresh optimizer."""

    def validate(self) -> None:
        """Reject impossible settings (``UserError``) before any work."""
        if not self.model:
            raise UserError("--model is required: the SFT checkpoint to start from (and the reference)")
        if not self.data:
            raise UserError("--data is required: HH files or directories, or {prompt, chosen, rejected} JSONL")
        if self.out is None:
            raise UserError("--out DIR is required")
        if self.fresh_optimizer and self.resume is None:
            raise UserError("--fresh-optimizer applies to a resumed run: pass it with --resume DIR")
        check_flags(self, DPO_RANGES)


DPO_RANGES: dict[str, Range] = {
    "val_size": NON_NEGATIVE,
    "max_pairs": AT_LEAST_ONE,
    "max_tokens": Range(2),
    "beta": POSITIVE,
    "lr": POSITIVE,
    "batch_size": AT_LEAST_ONE,
    "pairs_per_forward": AT_LEAST_ONE,
    "epochs": POSITIVE,
    "steps": AT_LEAST_ONE,
    "warmup_steps": NON_NEGATIVE,
    "weight_decay": NON_NEGATIVE,
    "max_grad_norm": POSITIVE,
    "eval_every": NON_NEGATIVE,
    "eval_batch_pairs": AT_LEAST_ONE,
    "save_every": NON_NEGATIVE,
    "seed": NON_NEGATIVE,
}
"""The allowed range of every numeric field of ``DPOConfig`` (``rlvr.ranges``)."""


RESUMABLE = ("steps", "eval_every", "save_every", "progress", "wandb", "tensorboard")
"""Settings that ``--resume`` takes from the command line; the others come from the run's config.json."""


def tokenize_pairs(
    tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair], max_tokens: int
) -> tuple[list[TokenPair], list[PreferencePair], int]:
    """``(token pairs, kept pairs, dropped)``: each kept pair as its two sequences (``TokenPair``);
    a pair whose longer sequence has more than ``max_tokens`` tokens is dropped."""

    plain = [p for p in pairs if not p.conversational]
    texts = [alpaca_format(str(p.prompt), str(r)) for p in plain for r in (p.chosen, p.rejected)]
    ids = iter(encode_documents(tokenizer, texts))
    tokens, kept = [], []
    for p in pairs:
        if p.conversational:
            prompt = cast(Messages, p.prompt)
            head, chosen = tokenize_prompt_completion(tokenizer, prompt, cast(Messages, p.chosen))
            _, rejected = tokenize_prompt_completion(tokenizer, prompt, cast(Messages, p.rejected))
            pair = TokenPair(head + chosen, head + rejected, max(len(head), 1))
        else:
            pair = TokenPair(next(ids), next(ids))
        if max(len(pair.chosen), len(pair.rejected)) <= max_tokens:
            tokens.append(pair)
            kept.append(p)
    return tokens, kept, len(pairs) - len(kept)


class ReferenceCache:
    """The reference's summed log-probs of every pair, (n, 2) float32 (NaN until computed).

    ``pairs_per_forward`` should match how the policy's log-probs are computed (``--pairs-per-forward``
    in training, ``--eval-batch-pairs`` in validation): with equal shapes the policy and the reference
    give bit-identical log-probs while their weights are equal, so every margin starts at exactly 0."""

    def __init__(self, ref_model: torch.nn.Module, pad_id: int, n: int) -> None:
        self.model, self.pad_id = ref_model, pad_id
        self.values = torch.full((n, 2), float("nan"))
        self.computed = 0
        """Pairs scored so far (each exactly once)."""

    @torch.no_grad()
    def get(self, indices: list[int], token_pairs: list, pairs_per_forward: int = 1) -> torch.Tensor:
        todo = [i for i in dict.fromkeys(indices) if torch.isnan(self.values[i]).any()]
        for start in range(0, len(todo), pairs_per_forward):
            chunk = todo[start : start + pairs_per_forward]
            seqs, starts = pair_sequences(token_pairs, chunk)
            self.values[chunk] = (
                sequence_log_probs(self.model, seqs, self.pad_id, scored_from=starts).float().cpu().view(-1, 2)
            )
            self.computed += len(chunk)
        return self.values[indices]


def _metrics_of(out: dict[str, torch.Tensor], policy: torch.Tensor, prefix: str) -> dict[str, float]:
    return {
        f"{prefix}/loss": float(out["loss"].mean()),
        f"{prefix}/reward_margin": float(out["margin"].mean()),
        f"{prefix}/preference_accuracy": float((out["margin"] > 0).float().mean()),
        f"{prefix}/chosen_reward": float(out["chosen_reward"].mean()),
        f"{prefix}/rejected_reward": float(out["rejected_reward"].mean()),
        f"{prefix}/chosen_logp": float(policy[:, 0].mean()),
        f"{prefix}/rejected_logp": float(policy[:, 1].mean()),
    }


@torch.no_grad()
def evaluate_pairs(
    model: torch.nn.Module,
    ref_cache: ReferenceCache,
    token_pairs: list[TokenPair],
    beta: float,
    pad_id: int,
    pairs_per_forward: int = 8,
) -> dict[str, float]:
    """Validation metrics of ``token_pairs`` (``val/loss``, ``val/preference_accuracy``, margins, log-probs)."""
    was_training = model.training
    model.eval()
    policy = []
    for start in range(0, len(token_pairs), pairs_per_forward):
        seqs, starts = pair_sequences(token_pairs, list(range(start, min(len(token_pairs), start + pairs_per_forward))))
        policy.append(sequence_log_probs(model, seqs, pad_id, scored_from=starts).float().cpu().view(-1, 2))
    model.train(was_training)
    policy_t = torch.cat(policy)
    ref = ref_cache.get(list(range(len(token_pairs))), token_pairs, pairs_per_forward)
    out = dpo_loss(policy_t[:, 0], policy_t[:, 1], ref[:, 0], ref[:, 1], beta)
    return _metrics_of(out, policy_t, "val")


def dpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    token_pairs: list[TokenPair],
    indices: list[int],
    ref_cache: ReferenceCache,
    beta: float,
    pad_id: int,
    max_grad_norm: float | None,
    backbone: Callable[..., Any] | None = None,
    pairs_per_forward: int = 1,
) -> dict[str, float]:
    """One optimizer step over the pairs ``indices``: a forward and backward per ``pairs_per_forward``
    pairs (each pair's two sequences together; the course runs one pair per forward), the loss scaled
    by 1/len(indices) so that the accumulated gradient is that of the mean loss. Returns the step's
    training metrics."""
    ref = ref_cache.get(indices, token_pairs, pairs_per_forward)
    policy_rows, outs = [], []
    for start in range(0, len(indices), pairs_per_forward):
        chunk = indices[start : start + pairs_per_forward]
        seqs, starts = pair_sequences(token_pairs, chunk)
        policy = sequence_log_probs(model, seqs, pad_id, backbone=backbone, scored_from=starts).view(-1, 2)
        out = dpo_loss(
            policy[:, 0], policy[:, 1], ref[start : start + len(chunk), 0], ref[start : start + len(chunk), 1], beta
        )
        (out["loss"].sum() / len(indices)).backward()
        policy_rows.append(policy.detach().float().cpu())
        outs.append({k: v.detach().float().cpu() for k, v in out.items()})
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf")))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stacked = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
    return {**_metrics_of(stacked, torch.cat(policy_rows), "train"), "train/grad_norm": grad_norm}


def _save_best(out: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int, metrics: dict) -> None:
    """Replace ``OUT/best`` with the current model, atomically (a crash leaves the previous best)."""

    tmp = out / ".best-tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    best = out / "best"
    old = out / ".best-old"
    if best.exists():
        if old.exists():
            shutil.rmtree(old)
        best.rename(old)
    tmp.rename(best)
    if old.exists():
        shutil.rmtree(old)
    atomic_write_json(out / "best.json", {"step": step, **metrics})


def _better(metrics: dict, best: dict | None) -> bool:
    """A strictly higher validation preference accuracy: of equally good checkpoints the first, the
    one closest to the reference, is kept."""
    return best is None or metrics["val/preference_accuracy"] > best["val/preference_accuracy"]


def _make_optimizer(cfg: DPOConfig, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:

    if cfg.optimizer == "adamw":
        return make_adamw(
            model.parameters(),
            master_weights=cfg.master_weights,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            fused=device.type == "cuda",
        )
    return make_rmsprop(model.parameters(), master_weights=cfg.master_weights, lr=cfg.lr, weight_decay=cfg.weight_decay)


def run_dpo(cfg: DPOConfig) -> Path:
    """Train per ``cfg`` (or resume ``cfg.resume``); returns the run directory.

    The run directory's lock is taken before anything in it is read, deleted or written, and held
    for the run (one writer): a second ``--resume`` or ``--overwrite`` on a live run is refused and
    touches nothing. A new run refuses a directory holding an earlier one unless ``overwrite``; a
    resumed run continues from its newest intact checkpoint."""

    if cfg.resume is None:
        cfg.validate()  # before the lock creates --out; it refuses a missing --out
    run_dir = Path(cfg.resume or cfg.out or "")
    if cfg.resume is not None:
        if not run_dir.is_dir():
            raise UserError(f"--resume {run_dir}: no such directory; give the directory of an earlier `rlvr dpo` run")
    with RunDirLock(run_dir, command="rlvr dpo"):
        ckpt = None
        if cfg.resume is not None:
            cfg = resumed_settings(cfg, run_dir, "config.json", RESUMABLE, "rlvr dpo")
            ckpt = resumable_checkpoint(run_dir, fresh_optimizer=cfg.fresh_optimizer)
            if ckpt is not None:
                refuse_edited_settings(ckpt, saved_settings(cfg), (*RESUMABLE, "out"), run_dir / "config.json")
        cfg.validate()
        if ckpt is None:  # a new run (or a resumed one that never reached its first checkpoint)
            prepare_output_dir(run_dir, OUTPUT_FILES, overwrite=cfg.overwrite or cfg.resume is not None)
            remove_outputs(run_dir, ("metrics.jsonl", "best.json", "summary.json", "best", "checkpoints"))

        # Data before models: a bad path fails in seconds.
        pairs, counts = load_preference_pairs(cfg.data, cfg.format, cfg.split, cfg.max_pairs)
        if cfg.val_data:
            val_pairs, _ = load_preference_pairs(cfg.val_data, cfg.format, cfg.split)
            train_pairs = pairs
        else:
            if cfg.val_size >= len(pairs):
                raise UserError(f"--val-size {cfg.val_size} leaves no training pairs out of {len(pairs)}; lower it")
            order = list(range(len(pairs)))
            random.Random(cfg.seed).shuffle(order)
            held = set(order[: cfg.val_size])
            val_pairs = [pairs[i] for i in sorted(held)]
            train_pairs = [p for i, p in enumerate(pairs) if i not in held]
        if any(p.conversational for p in (*train_pairs, *val_pairs)):
            check_chat_template_before_load(
                cfg.model,
                "conversational preference rows (message lists)",
                "start from a model trained on chat rows (rlvr sft instruct saves its template)",
            )
        return _train(cfg, run_dir, ckpt, train_pairs, val_pairs, counts)


def _train(
    cfg: DPOConfig,
    out: Path,
    ckpt: Path | None,
    train_pairs: list[PreferencePair],
    val_pairs: list[PreferencePair],
    counts: dict,
) -> Path:
    from tqdm.auto import tqdm

    device = resolve_device(cfg.device)
    ref_device = resolve_device(cfg.ref_device, "--ref-device") if cfg.ref_device else device
    dtype = resolve_dtype(cfg.dtype, device)
    policy_source = ckpt / "model" if ckpt is not None else cfg.model
    model, tokenizer = load_model_and_tokenizer(policy_source, device=device, dtype=dtype)
    ref_model, _ = load_model_and_tokenizer(cfg.model, device=ref_device, dtype=resolve_dtype(cfg.dtype, ref_device))
    ref_model.eval().requires_grad_(False)
    pad = pad_token_id(tokenizer)
    train_tokens, train_pairs, dropped_train = tokenize_pairs(tokenizer, train_pairs, cfg.max_tokens)
    val_tokens, val_pairs, dropped_val = tokenize_pairs(tokenizer, val_pairs, cfg.max_tokens)
    if not train_tokens:
        raise UserError(f"no training pair fits in --max-tokens {cfg.max_tokens}; raise it")
    data_counts = {
        **counts,
        "train_pairs": len(train_tokens),
        "val_pairs": len(val_tokens),
        "dropped_too_long": dropped_train + dropped_val,
        "train_pairs_by_source": dict(Counter(p.source for p in train_pairs)),
    }

    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    backbone = compile_backbone(model) if cfg.compile else None
    model.train()
    optimizer = _make_optimizer(cfg, model, device)
    batch = min(cfg.batch_size, len(train_tokens))
    total = cfg.steps or max(1, math.ceil(cfg.epochs * len(train_tokens) / batch))
    scheduler = lr_schedule(optimizer, total, "constant", cfg.warmup_steps, 0.0)  # linear warmup, then constant
    train_ref = ReferenceCache(ref_model, pad, len(train_tokens))
    val_ref = ReferenceCache(ref_model, pad, len(val_tokens))
    loop: dict[str, Any] = {"best": None, "best_step": None}
    start = 0
    if ckpt is not None:
        state = load_trainer_state(ckpt, optimizer, scheduler)
        start = state["step"]
        if "train_ref" in state:  # else a weights-only checkpoint: the reference log-probs are computed again
            train_ref.values, val_ref.values = state["train_ref"], state["val_ref"]
        loop.update(best=state.get("best"), best_step=state.get("best_step"))
        if state.get("fresh_optimizer") and (out / "best.json").is_file():
            best = json.loads((out / "best.json").read_text())
            loop.update(best_step=best.pop("step", None), best=best)
        truncate_metrics(out / "metrics.jsonl", start)
    settings = saved_settings(cfg)
    atomic_write_json(out / "config.json", settings)

    def checkpoint(step: int) -> None:
        save_checkpoint(
            out,
            step,
            model,
            tokenizer,
            optimizer,
            scheduler,
            state={"train_ref": train_ref.values, "val_ref": val_ref.values, **loop},
            run_config=settings,
        )

    def validate(step: int) -> dict:
        metrics = evaluate_pairs(model, val_ref, val_tokens, cfg.beta, pad, cfg.eval_batch_pairs) if val_tokens else {}
        if metrics and step > 0 and _better(metrics, loop["best"]):
            _save_best(out, model, tokenizer, step, metrics)
            loop.update(best=metrics, best_step=step)
        return metrics

    run = TrainingRun(out, total, f"rlvr dpo --resume {out}", checkpoint, start=start, resumed=ckpt is not None)
    run.fields.update(best_step=loop["best_step"], best=loop["best"], **data_counts)
    logger = MetricsLogger(out, settings, wandb=cfg.wandb, wandb_project=cfg.wandb_project, tensorboard=cfg.tensorboard)
    try:
        with run.guarded():
            if start == 0:
                logger.log({"step": 0, **validate(0)})
            with tqdm(total=total, initial=start, desc="dpo", disable=not cfg.progress, dynamic_ncols=True) as bar:
                for step in range(start + 1, total + 1):
                    with run.step_block(step):
                        row = _training_step(
                            cfg, step, total, batch, model, optimizer, scheduler, train_tokens, train_ref, pad, backbone
                        )
                        if (cfg.eval_every and step % cfg.eval_every == 0) or step == total:
                            row.update(validate(step))
                            run.fields.update(best_step=loop["best_step"], best=loop["best"])
                        if device.type == "cuda":
                            row["mem/peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
                        logger.log(row)
                    if (cfg.save_every and step % cfg.save_every == 0) or step == total:
                        run.checkpoint()
                    postfix = {"loss": f"{row['train/loss']:.3f}"}
                    if "val/preference_accuracy" in row:
                        postfix["val_acc"] = f"{row['val/preference_accuracy']:.3f}"
                    bar.set_postfix(postfix)
                    bar.update(1)
            run.checkpoint()
    finally:
        logger.close()
    run.summary("finished")
    return out


def _training_step(
    cfg: DPOConfig,
    step: int,
    total: int,
    batch: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    train_tokens: list[TokenPair],
    train_ref: ReferenceCache,
    pad: int,
    backbone: Callable[..., Any] | None,
) -> dict[str, Any]:
    """One optimizer step of the loop and its metrics row."""

    t0 = time.perf_counter()
    lr_used = scheduler.get_last_lr()[0]
    indices = batch_indices(len(train_tokens), batch, step - 1, cfg.seed)
    row: dict[str, Any] = {
        "step": step,
        **dpo_step(
            model,
            optimizer,
            train_tokens,
            indices,
            train_ref,
            cfg.beta,
            pad,
            cfg.max_grad_norm,
            backbone,
            cfg.pairs_per_forward,
        ),
    }
    scheduler.step()
    row.update(
        {"lr": lr_used, "time/step": time.perf_counter() - t0, "data/epoch": (step * batch) // len(train_tokens)}
    )
    return row


def main(argv: list[str] | None = None) -> int:
    import tyro

    cfg = tyro.cli(DPOConfig, args=argv, prog="rlvr dpo", description=__doc__.split("\n\n")[0])
    out = run_dpo(cfg)
    print(f"rlvr dpo: finished; the best model (by validation preference accuracy) is in {out / 'best'}")
    return 0
