"""One policy-gradient optimizer step over a batch of rollouts, with exact gradient accumulation.

``grpo_train_step`` is the course-standard front door: rewards → advantages → tokenise →
``policy_gradient_update``. The update, as its ``UpdateSpec`` says, is four steps: ``plan_update`` splits
the batch into microbatches, ``microbatch_backward`` backpropagates each, ``reduce_totals`` sums their
statistics over data-parallel ranks, and ``clip_and_step`` clips the global gradient norm, steps the
optimizer once, and clears every ``.grad`` (to None).

Two facts make it both exact and cheap:

* The accumulated gradient equals the gradient of the aggregated loss of the whole batch. With
  ``sequence`` normalisation the batch loss is ``(1/B) Σ_i mean_t loss_it``, so a microbatch of m
  sequences contributes its own sequence-mean times ``m / B``; with ``constant`` normalisation the
  batch loss is ``Σ_it loss_it / C`` and every microbatch contributes ``Σ loss / C`` as is.
* A sequence with advantage 0 has loss 0 and gradient 0 under every reweighting method, so it is not
  passed through the model at all. Because the microbatch weights above count sequences against the
  full batch size B, the result is identical to not skipping. With ``baseline="none"`` (RFT) this
  drops every incorrect rollout.

Kept sequences are sorted by length before being cut into microbatches, and each microbatch is
trimmed to its own longest sequence, so little compute is spent on padding; the grouping does not
change the sum.

Across data-parallel ranks (``global_batch``, a ``rlvr.distributed.GlobalBatch``) each rank passes its
own rows of the step's batch. Sequence normalisation then divides by the global number of sequences,
and every rank's loss is multiplied by the world size, because DDP and FSDP2 average the ranks'
gradients: the average of W scaled numerators over the global denominator is the one-process
gradient. Every rank runs the same number of microbatches (the most any rank needs; a rank with fewer
pads with a row whose loss is multiplied by zero), since each forward and backward of a sharded model
is a collective. Loss, entropy, clip fraction, token and sequence counts and the importance
statistics come back reduced over all ranks, so every rank takes the same decision on a non-finite step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlvr.distributed.world import gather_objects, reduce_values
from rlvr.grpo.advantages import compute_group_normalized_rewards, compute_rollout_rewards
from rlvr.grpo.aggregate import aggregate_loss_across_microbatch, get_aggregation
from rlvr.grpo.diagnostics import importance_statistics
from rlvr.grpo.kl import Reference, kl_penalty
from rlvr.grpo.losses import ClipRange, compute_policy_gradient_loss, validate_reweighting
from rlvr.training.logprobs import DEFAULT_CHUNK_TOKENS, get_response_log_probs, model_device
from rlvr.training.packing import can_pack, packed_response_log_probs, shared_prefix_plan
from rlvr.training.tokenize import tokenize_prompt_and_output

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlvr.config import TrainConfig
    from rlvr.distributed.world import GlobalBatch


def _check_divisible(batch: int, gradient_accumulation_steps: int) -> None:
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    if batch % gradient_accumulation_steps:
        raise ValueError(
            f"the batch of {batch} rollouts is not divisible by gradient_accumulation_steps="
            f"{gradient_accumulation_steps}; choose a divisor of the batch size"
        )


def microbatch_plan(
    lengths: Sequence[int], keep: Sequence[bool], microbatch_size: int, max_tokens_per_microbatch: int | None = None
) -> list[list[int]]:
    """Row indices of each microbatch: kept rows sorted by length (longest first), cut into groups of
    at most ``microbatch_size`` rows and, if given, at most ``max_tokens_per_microbatch`` padded tokens."""
    order = sorted((i for i, k in enumerate(keep) if k), key=lambda i: -lengths[i])
    plan: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        too_many_rows = len(current) >= microbatch_size
        too_many_tokens = (
            max_tokens_per_microbatch is not None and current and (len(current) + 1) * width > max_tokens_per_microbatch
        )
        if current and (too_many_rows or too_many_tokens):
            plan.append(current)
            current = []
        current.append(i)
    if current:
        plan.append(current)
    return plan


@dataclass(frozen=True)
class UpdateSpec:
    """How an optimizer step is taken: the settings ``policy_gradient_update`` reads, fixed for a run
    (``from_config``) or written out by a caller of the step alone."""

    gradient_accumulation_steps: int
    max_grad_norm: float | None
    """None: no clipping (the norm is still measured)."""
    reweighting: str = "none"
    """A registered importance-reweighting method (``rlvr.grpo.REWEIGHTINGS``)."""
    cliprange: ClipRange | None = None
    """``(low, high)``: the ratio is clipped to ``[1 - low, 1 + high]``; one number clips both sides."""
    loss_normalization: str = "sequence"
    normalization_constant: float | None = None
    skip_zero_advantage: bool = True
    max_tokens_per_microbatch: int | None = None
    """Caps each microbatch at that many tokens (rows × longest row), besides its row count."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    shared_prefix: bool = False
    keep_head_logits: bool = False
    kl_coef_in_loss: float = 0.0
    """``algorithm.kl_coef`` when the KL goes into the loss (``kl_in: loss``), else 0."""
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    @classmethod
    def from_config(cls, config: TrainConfig) -> UpdateSpec:
        a, o = config.algorithm, config.optim
        if a.loss_normalization is None:
            raise ValueError("UpdateSpec.from_config takes a resolved config (rlvr.checks.resolve_config)")
        return cls(
            gradient_accumulation_steps=o.gradient_accumulation_steps,
            max_grad_norm=o.max_grad_norm,
            reweighting=a.reweighting,
            cliprange=None if a.cliprange_low is None else (a.cliprange_low, a.cliprange_high or a.cliprange_low),
            loss_normalization=a.loss_normalization,
            normalization_constant=a.normalization_constant,
            skip_zero_advantage=a.skip_zero_advantage,
            max_tokens_per_microbatch=o.max_tokens_per_microbatch,
            shared_prefix=o.shared_prefix,
            keep_head_logits=o.keep_head_logits,
            kl_coef_in_loss=a.kl_coef if a.kl_in == "loss" else 0.0,
            kl_estimator=a.kl_estimator,
            entropy_coef=a.entropy_coef,
        )


@dataclass(frozen=True)
class StepBatch:
    """The tokenised rollouts of one optimizer step (this rank's rows of it under data parallelism)."""

    input_ids: torch.Tensor
    """(B, T) prompt and response tokens."""
    labels: torch.Tensor
    """(B, T) the next token at each position."""
    response_mask: torch.Tensor
    """(B, T) True on response tokens."""
    advantages: torch.Tensor
    """(B,) one advantage per sequence."""
    old_log_probs: torch.Tensor | None = None
    """(B, T') the sampling policy's log-probs, for reweighting and the importance statistics."""


@dataclass(frozen=True)
class UpdatePlan:
    """What ``plan_update`` settles before any forward: the microbatches and how their losses add up."""

    microbatches: list[list[int]]
    """Row indices of each microbatch this rank runs."""
    n_runs: int
    """Microbatches to run: ``len(microbatches)``, or the most any rank has (the rest are padding)."""
    lengths: list[int]
    """Per row, the last response position + 1: each microbatch is trimmed to its longest."""
    packed: bool
    """Shared-prefix packing: each microbatch is one packed sequence."""
    denominator: int
    """Sequences of the whole (all-rank) batch, for ``sequence`` normalisation."""
    grad_scale: int
    """The world size the data-parallel wrapper divides the summed gradients by."""
    normalization_constant: float | None
    per_sequence: bool
    """The aggregation weights each microbatch by its share of the batch's sequences."""
    needs_old_log_probs: bool
    reports_clip_fraction: bool
    reference: Reference | None
    """The reference when the KL is in the loss, else None."""


@dataclass
class _Totals:
    """Sums over the microbatches of a step, kept on the device (no sync between microbatches)."""

    loss: torch.Tensor
    entropy: torch.Tensor
    clip_count: torch.Tensor
    clip_total: torch.Tensor
    kl: torch.Tensor
    n_tokens: int = 0
    n_sequences: int = 0
    backbone_tokens: int = 0
    log_ratios: list = field(default_factory=list)
    """(log-ratio, mask, advantages) per microbatch, read once after the loop."""

    @classmethod
    def zeros(cls, device: torch.device) -> _Totals:
        zero = lambda: torch.zeros((), device=device)  # noqa: E731
        return cls(loss=zero(), entropy=zero(), clip_count=zero(), clip_total=zero(), kl=zero())


def policy_gradient_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: StepBatch,
    spec: UpdateSpec,
    *,
    step: bool = True,
    backbone: Callable[..., Any] | None = None,
    global_batch: GlobalBatch | None = None,
    reference: Reference | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Accumulate the policy-gradient of a tokenised batch, clip, step once, clear grads: planning
    (``plan_update``), one ``microbatch_backward`` per microbatch, the reduction over ranks
    (``reduce_totals``) and the optimizer step (``clip_and_step``).

    Returns ``(loss, metadata)``: ``loss`` is the aggregated loss of the whole batch (detached);
    metadata has ``grad_norm`` (before clipping), ``entropy`` (mean over response tokens of the
    sequences that went through the model), ``clip_fraction`` (clipping methods; over those same
    tokens), ``n_sequences``/``n_tokens`` trained, and ``skipped_nonfinite`` when a non-finite loss or
    gradient norm made it skip the optimizer step. Whenever ``batch.old_log_probs`` are given (also to a
    method that ignores them, such as ``none``), ``importance`` holds the statistics of the importance
    ratios over those tokens (``rlvr.grpo.diagnostics.importance_statistics``).

    ``step=False`` accumulates and measures without stepping the optimizer; ``backbone`` is a compiled
    stand-in for ``model.base_model`` (``compile_backbone``).

    ``global_batch`` (a ``rlvr.distributed.GlobalBatch``): this rank holds part of a batch spread over
    data-parallel ranks, and ``model`` is wrapped by DDP or FSDP2 (see the module docstring). Its
    microbatches hold at most ``global sequences / gradient_accumulation_steps`` rows, as in one
    process, so each rank runs about ``gradient_accumulation_steps / world size`` of them.

    ``spec.shared_prefix``: rows with the same prompt tokens share one pass of the prompt
    (``rlvr.training.packing``): each microbatch is one packed sequence of at most
    ``max_tokens_per_microbatch`` tokens, whole groups kept together where they fit. The gradient is
    the same. One process only; a model whose logits are not a plain ``Linear`` of its backbone, or a
    batch whose response positions are not one run per row, is trained padded instead.
    ``metadata["backbone_tokens"]`` counts the tokens the backbone ran on (padding included).

    ``spec.keep_head_logits``: the fused head keeps each microbatch's logits from its forward for its
    backward instead of recomputing them (``linear_log_probs``): the same gradients, one of the head's
    matmuls fewer, for response tokens x vocabulary x 2 bytes (bf16) while the microbatch runs.

    ``reference`` with ``spec.kl_coef_in_loss > 0``: every microbatch also runs through the reference
    (no gradient, packed or padded as the policy) and each token's loss gains ``kl_coef_in_loss *
    kl_penalty(logp, ref_logp, kl_estimator)`` before aggregation (``rlvr.grpo.kl``);
    ``metadata["kl_ref"]`` is the mean estimate per response token. A zero-advantage sequence then
    still has a gradient (towards the reference), so none is skipped.

    ``spec.entropy_coef``: an entropy bonus; each token's loss loses ``entropy_coef * H_t``, the entropy
    of the policy's next-token distribution there (differentiated through the whole vocabulary),
    aggregated like the loss. As with the KL, no sequence is skipped for a zero advantage.
    """
    batch, plan = plan_update(model, batch, spec, global_batch, reference)
    device = model_device(model)  # the parameters' device, or the GPU that CPU-offloaded shards run on
    totals = _Totals.zeros(device)
    for run in range(plan.n_runs):
        # DDP decides at the forward whether the backward reduces, so the whole microbatch sits inside.
        last = run == plan.n_runs - 1
        with _gradient_sync(model, last) if global_batch is not None else contextlib.nullcontext():
            if run >= len(plan.microbatches):
                _padding_backward(model, batch, plan, device, spec.chunk_tokens, backbone)
            else:
                microbatch_backward(model, batch, spec, plan, plan.microbatches[run], device, backbone, totals)
    totals.n_sequences = sum(len(r) for r in plan.microbatches)
    if global_batch is not None:
        reduce_totals(totals, global_batch, device, batch.old_log_probs is not None)
    grad_norm, nonfinite = clip_and_step(model, optimizer, spec.max_grad_norm, float(totals.loss), global_batch, step)

    n_tokens = totals.n_tokens
    metadata: dict[str, Any] = {
        "grad_norm": grad_norm,
        "entropy": float(totals.entropy / max(n_tokens, 1)),
        "n_sequences": totals.n_sequences,
        "n_tokens": n_tokens,
        "n_microbatches": len(plan.microbatches),
        "backbone_tokens": totals.backbone_tokens,
        "skipped_nonfinite": nonfinite,
    }
    if plan.reference is not None:
        metadata["kl_ref"] = float(totals.kl / max(n_tokens, 1))
    if plan.reports_clip_fraction:
        metadata["clip_fraction"] = float(totals.clip_count / totals.clip_total.clamp(min=1))
    if totals.log_ratios:
        parts = totals.log_ratios if global_batch is not None else [_importance_parts(totals.log_ratios)]
        tok, tok_adv, seq, seq_adv = (torch.cat([p[k] for p in parts]) for k in range(4))
        metadata["importance"] = importance_statistics(tok, tok_adv, seq, seq_adv)
    return totals.loss.detach(), metadata


def plan_update(
    model: torch.nn.Module,
    batch: StepBatch,
    spec: UpdateSpec,
    global_batch: GlobalBatch | None = None,
    reference: Reference | None = None,
) -> tuple[StepBatch, UpdatePlan]:
    """Check the batch against ``spec`` and settle the step before any forward: which rows go through
    the model, cut into which microbatches, packed or padded, and the loss's denominators. Returns the
    batch with its advantages as a flat float tensor and its old log-probs trimmed to the labels."""
    n_rows = batch.input_ids.shape[0]
    if global_batch is None:
        _check_divisible(n_rows, spec.gradient_accumulation_steps)
        denominator, grad_scale = n_rows, 1
        rows_per_microbatch = n_rows // spec.gradient_accumulation_steps
    else:
        _check_divisible(global_batch.n_sequences, spec.gradient_accumulation_steps)
        denominator, grad_scale = global_batch.n_sequences, global_batch.world_size
        # The microbatch keeps its one-process size (a memory setting), so more ranks mean fewer
        # microbatches per rank, not smaller ones.
        rows_per_microbatch = max(1, global_batch.n_sequences // spec.gradient_accumulation_steps)
    method = validate_reweighting(spec.reweighting, batch.old_log_probs, spec.cliprange, check_mask=False)
    aggregation = get_aggregation(spec.loss_normalization, spec.normalization_constant)
    advantages = torch.as_tensor(batch.advantages, dtype=torch.float32).flatten()
    if advantages.numel() != n_rows:
        raise ValueError(f"got {advantages.numel()} advantages for a batch of {n_rows} sequences")
    old_log_probs = batch.old_log_probs
    if old_log_probs is not None:
        old_log_probs = old_log_probs[:, : batch.labels.shape[1]]
    batch = dataclasses.replace(batch, advantages=advantages, old_log_probs=old_log_probs)
    response_mask = batch.response_mask
    lengths = (response_mask.long().cumsum(1).argmax(1) + 1).tolist()  # last response position + 1
    lengths = [max(1, n) for n in lengths]
    kl_on = reference is not None and spec.kl_coef_in_loss > 0
    # A KL or entropy term gives a zero-advantage sequence a gradient of its own: none may be skipped.
    skip = spec.skip_zero_advantage and not kl_on and not spec.entropy_coef
    keep = (advantages != 0).tolist() if skip else [True] * n_rows
    microbatches = None
    if spec.shared_prefix:
        if global_batch is not None:
            raise ValueError("shared-prefix packing runs in one process; set optim.shared_prefix false for ddp or fsdp")
        if can_pack(model):
            microbatches = shared_prefix_plan(
                batch.input_ids, response_mask, keep, rows_per_microbatch, spec.max_tokens_per_microbatch, spans=True
            )
    packed = microbatches is not None
    if microbatches is None:
        microbatches = microbatch_plan(lengths, keep, rows_per_microbatch, spec.max_tokens_per_microbatch)
    n_runs = len(microbatches)
    normalization_constant = spec.normalization_constant
    batch_tokens = float(response_mask.sum())  # DAPO's token-level loss: every response token of the batch
    if global_batch is not None:
        n_runs = int(reduce_values([len(microbatches)], "max", global_batch.group)[0])
        if aggregation.batch_tokens:
            batch_tokens = float(reduce_values([batch_tokens], "sum", global_batch.group)[0])
    if aggregation.batch_tokens:
        normalization_constant = max(batch_tokens, 1.0)
    return batch, UpdatePlan(
        microbatches=microbatches,
        n_runs=n_runs,
        lengths=lengths,
        packed=packed,
        denominator=denominator,
        grad_scale=grad_scale,
        normalization_constant=normalization_constant,
        per_sequence=aggregation.per_sequence,
        needs_old_log_probs=method.needs_old_log_probs,
        reports_clip_fraction=method.needs_cliprange and spec.reweighting != "none",
        reference=reference if kl_on else None,
    )


def microbatch_backward(
    model: torch.nn.Module,
    batch: StepBatch,
    spec: UpdateSpec,
    plan: UpdatePlan,
    rows: list[int],
    device: torch.device,
    backbone: Callable[..., Any] | None,
    totals: _Totals,
) -> None:
    """Forward, loss and backward of the microbatch ``rows``, its sums added to ``totals``."""
    idx = torch.tensor(rows)
    width = max(plan.lengths[i] for i in rows)
    host_mask = batch.response_mask[idx, :width]
    totals.n_tokens += int(host_mask.sum())  # counted on the host: no device sync between microbatches
    mb_mask = host_mask.to(device, non_blocking=True)
    ref_log_probs = None
    if plan.reference is not None:
        # Before the policy's forward: a LoRA reference toggles the adapters, which must be on
        # again while the policy's graph is built.
        ref_log_probs = _reference_log_probs(plan.reference, plan.packed, batch, rows, width, spec.chunk_tokens).to(
            device, non_blocking=True
        )
    if plan.packed:
        out = packed_response_log_probs(
            model,
            batch.input_ids,
            batch.labels,
            batch.response_mask,
            rows,
            width,
            spec.chunk_tokens,
            True,
            backbone,
            spec.keep_head_logits,
        )
        totals.backbone_tokens += int(out.pop("backbone_tokens"))
    else:
        out = get_response_log_probs(
            model,
            batch.input_ids[idx, :width],
            batch.labels[idx, :width],
            return_token_entropy=True,
            chunk_tokens=spec.chunk_tokens,
            backbone=backbone,
            positions=host_mask,
            keep_logits=spec.keep_head_logits,
        )
        totals.backbone_tokens += len(rows) * width
    old = None
    if batch.old_log_probs is not None:
        # Outside the mask the new log-probs are 0 (not computed): so are the old ones here, or
        # a ratio exp(0 - old) could overflow there and turn the masked sums into NaN.
        old = batch.old_log_probs[idx, :width].to(device, non_blocking=True).masked_fill(~mb_mask.bool(), 0.0)
    mb_adv = batch.advantages[idx].to(device, non_blocking=True)
    per_token, meta = compute_policy_gradient_loss(
        mb_adv,
        out["log_probs"],
        spec.reweighting,
        old if plan.needs_old_log_probs else None,
        spec.cliprange,
        mb_mask,
    )
    if ref_log_probs is not None:
        kl_tokens = kl_penalty(out["log_probs"], ref_log_probs, spec.kl_estimator)
        per_token = per_token + spec.kl_coef_in_loss * kl_tokens
        totals.kl += (kl_tokens.detach() * mb_mask.to(kl_tokens.dtype)).sum()
    if spec.entropy_coef:
        per_token = per_token - spec.entropy_coef * out["token_entropy"]
    if old is not None:
        totals.log_ratios.append(((out["log_probs"].detach() - old.to(out["log_probs"].dtype)), mb_mask, mb_adv))
    loss = aggregate_loss_across_microbatch(per_token, mb_mask, spec.loss_normalization, plan.normalization_constant)
    if plan.per_sequence:
        loss = loss * (len(rows) / plan.denominator)
    (loss * plan.grad_scale if plan.grad_scale != 1 else loss).backward()
    totals.loss += loss.detach()
    totals.entropy += (out["token_entropy"].detach() * mb_mask.float()).sum()
    if "clip_count" in meta:
        totals.clip_count += meta["clip_count"]
        totals.clip_total += meta["clip_total"]


def reduce_totals(totals: _Totals, global_batch: GlobalBatch, device: torch.device, importance: bool) -> None:
    """Replace this rank's sums by the sums over all ranks (and, with ``importance``, its log-ratios
    by every rank's), so every rank reports and decides the same."""
    sums = reduce_values(
        [
            float(totals.loss),
            float(totals.entropy),
            float(totals.clip_count),
            float(totals.clip_total),
            totals.n_tokens,
            totals.n_sequences,
            float(totals.kl),
        ],
        "sum",
        global_batch.group,
    )
    totals.loss = torch.tensor(sums[0], device=device)
    totals.entropy, totals.clip_count, totals.clip_total = (torch.tensor(v) for v in sums[1:4])
    totals.n_tokens, totals.n_sequences = int(sums[4]), int(sums[5])
    totals.kl = torch.tensor(sums[6])
    if importance:
        ranks_parts = gather_objects(_importance_parts(totals.log_ratios, cpu=True) if totals.log_ratios else None)
        totals.log_ratios = [p for p in ranks_parts if p is not None]


def clip_and_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    loss_value: float,
    global_batch: GlobalBatch | None = None,
    step: bool = True,
) -> tuple[float, bool]:
    """Measure (and with ``max_grad_norm`` clip) the gradient norm, step the optimizer unless the loss
    or the norm is not finite, and clear every ``.grad``. Returns ``(grad_norm, skipped_nonfinite)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    have_grads = any(p.grad is not None for p in params)
    if max_grad_norm is not None and have_grads:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    elif global_batch is not None:
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    else:
        grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
        norm = torch.stack(grads).norm() if grads else torch.zeros(())
    if hasattr(norm, "full_tensor"):  # a sharded model's norm is a DTensor whose full value needs the ranks
        norm = norm.full_tensor()
    grad_norm = float(norm)
    nonfinite = not (math.isfinite(grad_norm) and math.isfinite(loss_value))
    if step and not nonfinite:
        # With no gradients (every advantage zero) this changes no parameter, but it keeps the
        # optimizer's step count in line with the learning-rate scheduler's.
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for p in params:  # optimizers may be given only a subset of the parameters
        p.grad = None
    return grad_norm, nonfinite


def _gradient_sync(model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """DDP reduces gradients only on the last microbatch (``no_sync`` before it); FSDP2 reduce-scatters
    after every microbatch, which keeps only sharded gradients between them."""
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()  # type: ignore[operator]  # DDP's (checked above)


def _padding_backward(
    model: torch.nn.Module,
    batch: StepBatch,
    plan: UpdatePlan,
    device: torch.device,
    chunk_tokens: int,
    backbone: Callable[..., Any] | None,
) -> None:
    """A forward and backward with zero loss, so this rank joins the collectives of a microbatch it
    does not have: the shortest of its rows, or one placeholder token pair when it holds none (and a
    reference forward, which is a collective too when the reference is sharded)."""
    input_ids, labels, lengths = batch.input_ids, batch.labels, plan.lengths
    if input_ids.shape[0]:
        row = min(range(input_ids.shape[0]), key=lambda i: lengths[i])
        ids, lab = input_ids[row : row + 1, : lengths[row]], labels[row : row + 1, : lengths[row]]
    else:
        ids = lab = torch.zeros((1, 2), dtype=torch.long)
    if plan.reference is not None:
        with torch.no_grad(), plan.reference.context():
            get_response_log_probs(plan.reference.model, ids, lab, chunk_tokens=chunk_tokens)
    out = get_response_log_probs(model, ids, lab, chunk_tokens=chunk_tokens, backbone=backbone)
    (out["log_probs"].sum() * 0.0).backward()


def _reference_log_probs(
    reference: Reference, packed: bool, batch: StepBatch, rows: list[int], width: int, chunk_tokens: int
) -> torch.Tensor:
    """The reference's log-probs (len(rows), width) of one microbatch, laid out as the policy's."""
    with torch.no_grad(), reference.context():
        if packed:
            return packed_response_log_probs(
                reference.model, batch.input_ids, batch.labels, batch.response_mask, rows, width, chunk_tokens
            )["log_probs"]
        idx = torch.tensor(rows)
        return get_response_log_probs(
            reference.model,
            batch.input_ids[idx, :width],
            batch.labels[idx, :width],
            chunk_tokens=chunk_tokens,
            positions=batch.response_mask[idx, :width],
        )["log_probs"]


def _importance_parts(log_ratios: list, cpu: bool = False) -> tuple:
    """Token and sequence log-ratios with their advantages, concatenated over microbatches (moved to
    the CPU to be sent to the other ranks)."""
    tok, tok_adv, seq, seq_adv = [], [], [], []
    for lr, mask, adv in log_ratios:
        m = mask.to(lr.dtype)
        tok.append(lr[mask])
        tok_adv.append(adv.unsqueeze(1).expand_as(lr)[mask])
        has = mask.any(dim=1)
        seq.append(((lr * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))[has])
        seq_adv.append(adv[has])
    return tuple(torch.cat(x).cpu() if cpu else torch.cat(x) for x in (tok, tok_adv, seq, seq_adv))


def grpo_train_step(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    gradient_accumulation_steps: int,
    max_grad_norm: float | None,
    reward_fn: Callable[[str, str], dict[str, float]],
    repeated_prompts: Sequence[str],
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[str],
    group_size: int,
    baseline: str = "mean",
    advantage_eps: float = 1e-6,
    advantage_normalizer: str = "std",
    importance_reweighting_method: str = "none",
    old_log_probs: torch.Tensor | None = None,
    cliprange: ClipRange | None = None,
    loss_normalization: str = "sequence",
    normalization_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One GRPO optimizer step from raw rollouts (the course-standard interface).

    Returns ``(loss, metadata)``: the aggregated loss of the whole batch, and metadata with at least
    ``grad_norm`` (before clipping), ``entropy``, ``train_reward``, ``format_reward``,
    ``zero_adv_frac``, and ``clip_fraction`` for clipping methods.
    """
    batch = len(rollout_responses)
    if not (len(repeated_prompts) == batch == len(repeated_ground_truths)):
        raise ValueError(
            f"repeated_prompts ({len(repeated_prompts)}), rollout_responses ({batch}) and repeated_ground_truths "
            f"({len(repeated_ground_truths)}) must have the same length"
        )
    if group_size < 1 or batch % group_size:
        raise ValueError(
            f"the batch of {batch} rollouts is not divisible by group_size={group_size}; pass whole groups"
        )
    _check_divisible(batch, gradient_accumulation_steps)
    validate_reweighting(importance_reweighting_method, old_log_probs, cliprange, check_mask=False)
    get_aggregation(loss_normalization, normalization_constant)
    raw_rewards, reward_meta = compute_rollout_rewards(reward_fn, rollout_responses, repeated_ground_truths)
    advantages, adv_meta = compute_group_normalized_rewards(
        raw_rewards, group_size, baseline, advantage_eps, advantage_normalizer
    )
    tok = tokenize_prompt_and_output(list(repeated_prompts), list(rollout_responses), tokenizer)
    spec = UpdateSpec(
        gradient_accumulation_steps,
        max_grad_norm,
        reweighting=importance_reweighting_method,
        cliprange=cliprange,
        loss_normalization=loss_normalization,
        normalization_constant=normalization_constant,
    )
    tokenised = StepBatch(tok["input_ids"], tok["labels"], tok["response_mask"], advantages, old_log_probs)
    loss, meta = policy_gradient_update(model, optimizer, tokenised, spec)
    meta.update(
        {
            "train_reward": reward_meta["reward_mean"],
            "format_reward": reward_meta["format_reward_mean"],
            "zero_adv_frac": adv_meta["zero_adv_frac"],
            "advantages": advantages,
            "raw_rewards": raw_rewards,
        }
    )
    return loss, meta
