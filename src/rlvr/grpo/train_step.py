"""One policy-gradient optimizer step over a batch of rollouts, with exact gradient accumulation.

``grpo_train_step`` is the course-standard front door: rewards → advantages → tokenise →
``policy_gradient_update``. The update splits the batch into microbatches, backpropagates each, clips
the global gradient norm, steps the optimizer once, and clears every ``.grad`` (to None).

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
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from rlvr.grpo.advantages import compute_group_normalized_rewards, compute_rollout_rewards
from rlvr.grpo.aggregate import aggregate_loss_across_microbatch, get_aggregation
from rlvr.grpo.diagnostics import importance_statistics
from rlvr.grpo.logprobs import DEFAULT_CHUNK_TOKENS, get_response_log_probs
from rlvr.grpo.losses import compute_policy_gradient_loss, validate_reweighting
from rlvr.grpo.tokenize import tokenize_prompt_and_output


def _check_divisible(batch: int, gradient_accumulation_steps: int):
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    if batch % gradient_accumulation_steps:
        raise ValueError(
            f"the batch of {batch} rollouts is not divisible by gradient_accumulation_steps="
            f"{gradient_accumulation_steps}; choose a divisor of the batch size"
        )


def microbatch_plan(lengths: Sequence[int], keep: Sequence[bool], microbatch_size: int,
                    max_tokens_per_microbatch: int | None = None) -> list[list[int]]:
    """Row indices of each microbatch: kept rows sorted by length (longest first), cut into groups of
    at most ``microbatch_size`` rows and, if given, at most ``max_tokens_per_microbatch`` padded tokens."""
    order = sorted((i for i, k in enumerate(keep) if k), key=lambda i: -lengths[i])
    plan: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        too_many_rows = len(current) >= microbatch_size
        too_many_tokens = max_tokens_per_microbatch is not None and current and (len(current) + 1) * width > max_tokens_per_microbatch
        if current and (too_many_rows or too_many_tokens):
            plan.append(current)
            current = []
        current.append(i)
    if current:
        plan.append(current)
    return plan


def policy_gradient_update(model, optimizer, input_ids: torch.Tensor, labels: torch.Tensor, response_mask: torch.Tensor,
                           advantages: torch.Tensor, gradient_accumulation_steps: int, max_grad_norm: float | None,
                           importance_reweighting_method: str = "none", old_log_probs: torch.Tensor | None = None,
                           cliprange: float | None = None, loss_normalization: str = "sequence",
                           normalization_constant: float | None = None, skip_zero_advantage: bool = True,
                           max_tokens_per_microbatch: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                           step: bool = True, backbone=None):
    """Accumulate the policy-gradient of a tokenised batch, clip, step once, clear grads.

    Returns ``(loss, metadata)``: ``loss`` is the aggregated loss of the whole batch (detached);
    metadata has ``grad_norm`` (before clipping), ``entropy`` (mean over response tokens of the
    sequences that went through the model), ``clip_fraction`` (clipping methods; over those same
    tokens), ``n_sequences``/``n_tokens`` trained, and ``skipped_nonfinite`` when a non-finite loss or
    gradient norm made it skip the optimizer step. Whenever ``old_log_probs`` are given (also to a
    method that ignores them, such as ``none``), ``importance`` holds the statistics of the importance
    ratios over those tokens (``rlvr.grpo.diagnostics.importance_statistics``).

    ``max_tokens_per_microbatch`` additionally caps each microbatch at that many tokens (rows ×
    longest row); ``backbone`` is a compiled stand-in for ``model.base_model`` (``compile_backbone``).
    """
    batch = input_ids.shape[0]
    _check_divisible(batch, gradient_accumulation_steps)
    method = validate_reweighting(importance_reweighting_method, old_log_probs, cliprange, check_mask=False)
    aggregation = get_aggregation(loss_normalization, normalization_constant)
    advantages = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    if advantages.numel() != batch:
        raise ValueError(f"got {advantages.numel()} advantages for a batch of {batch} sequences")
    if old_log_probs is not None:
        old_log_probs = old_log_probs[:, : labels.shape[1]]
    device = next(model.parameters()).device
    lengths = (response_mask.long().cumsum(1).argmax(1) + 1).tolist()  # last response position + 1
    lengths = [max(1, n) for n in lengths]
    keep = (advantages != 0).tolist() if skip_zero_advantage else [True] * batch
    plan = microbatch_plan(lengths, keep, batch // gradient_accumulation_steps, max_tokens_per_microbatch)

    total_loss = torch.zeros((), device=device)
    ent_sum = torch.zeros((), device=device)
    clip_count = torch.zeros((), device=device)
    clip_total = torch.zeros((), device=device)
    log_ratios = []  # (log-ratio, mask, advantages) per microbatch, read once after the loop (no syncs inside it)
    n_tokens = 0
    for rows in plan:
        idx = torch.tensor(rows)
        width = max(lengths[i] for i in rows)
        host_mask = response_mask[idx, :width]
        n_tokens += int(host_mask.sum())  # counted on the host: no device sync between microbatches
        mb_mask = host_mask.to(device)
        out = get_response_log_probs(model, input_ids[idx, :width], labels[idx, :width], return_token_entropy=True,
                                     chunk_tokens=chunk_tokens, backbone=backbone)
        old = old_log_probs[idx, :width].to(device) if old_log_probs is not None else None
        mb_adv = advantages[idx].to(device)
        per_token, meta = compute_policy_gradient_loss(mb_adv, out["log_probs"], importance_reweighting_method,
                                                       old if method.needs_old_log_probs else None, cliprange, mb_mask)
        if old is not None:
            log_ratios.append(((out["log_probs"].detach() - old.to(out["log_probs"].dtype)), mb_mask, mb_adv))
        loss = aggregate_loss_across_microbatch(per_token, mb_mask, loss_normalization, normalization_constant)
        if aggregation.per_sequence:
            loss = loss * (len(rows) / batch)
        loss.backward()
        total_loss += loss.detach()
        ent_sum += (out["token_entropy"] * mb_mask.float()).sum()
        if "clip_count" in meta:
            clip_count += meta["clip_count"]
            clip_total += meta["clip_total"]

    params = [p for p in model.parameters() if p.requires_grad]
    have_grads = any(p.grad is not None for p in params)
    if max_grad_norm is not None and have_grads:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
        norm = torch.stack(grads).norm() if grads else torch.zeros(())
    grad_norm = float(norm)
    loss_value = float(total_loss)
    nonfinite = not (math.isfinite(grad_norm) and math.isfinite(loss_value))
    if step and not nonfinite:
        # With no gradients (every advantage zero) this changes no parameter, but it keeps the
        # optimizer's step count in line with the learning-rate scheduler's.
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for p in params:  # optimizers may be given only a subset of the parameters
        p.grad = None

    metadata: dict[str, Any] = {
        "grad_norm": grad_norm,
        "entropy": float(ent_sum / max(n_tokens, 1)),
        "n_sequences": sum(len(r) for r in plan),
        "n_tokens": n_tokens,
        "n_microbatches": len(plan),
        "skipped_nonfinite": nonfinite,
    }
    if method.needs_cliprange and importance_reweighting_method != "none":
        metadata["clip_fraction"] = float(clip_count / clip_total.clamp(min=1))
    if log_ratios:
        metadata["importance"] = _importance(log_ratios)
    return total_loss.detach(), metadata


def _importance(log_ratios: list) -> dict:
    tok, tok_adv, seq, seq_adv = [], [], [], []
    for lr, mask, adv in log_ratios:
        m = mask.to(lr.dtype)
        tok.append(lr[mask])
        tok_adv.append(adv.unsqueeze(1).expand_as(lr)[mask])
        has = mask.any(dim=1)
        seq.append(((lr * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))[has])
        seq_adv.append(adv[has])
    return importance_statistics(torch.cat(tok), torch.cat(tok_adv), torch.cat(seq), torch.cat(seq_adv))


def grpo_train_step(model, tokenizer, optimizer, gradient_accumulation_steps: int, max_grad_norm: float | None,
                    reward_fn, repeated_prompts: Sequence[str], rollout_responses: Sequence[str],
                    repeated_ground_truths: Sequence[str], group_size: int, baseline: str = "mean",
                    advantage_eps: float = 1e-6, advantage_normalizer: str = "std",
                    importance_reweighting_method: str = "none", old_log_probs: torch.Tensor | None = None,
                    cliprange: float | None = None, loss_normalization: str = "sequence",
                    normalization_constant: float | None = None):
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
        raise ValueError(f"the batch of {batch} rollouts is not divisible by group_size={group_size}; pass whole groups")
    _check_divisible(batch, gradient_accumulation_steps)
    validate_reweighting(importance_reweighting_method, old_log_probs, cliprange, check_mask=False)
    get_aggregation(loss_normalization, normalization_constant)
    raw_rewards, reward_meta = compute_rollout_rewards(reward_fn, rollout_responses, repeated_ground_truths)
    advantages, adv_meta = compute_group_normalized_rewards(raw_rewards, group_size, baseline, advantage_eps, advantage_normalizer)
    tok = tokenize_prompt_and_output(list(repeated_prompts), list(rollout_responses), tokenizer)
    loss, meta = policy_gradient_update(
        model, optimizer, tok["input_ids"], tok["labels"], tok["response_mask"], advantages, gradient_accumulation_steps,
        max_grad_norm, importance_reweighting_method, old_log_probs, cliprange, loss_normalization, normalization_constant,
    )
    meta.update({
        "train_reward": reward_meta["reward_mean"],
        "format_reward": reward_meta["format_reward_mean"],
        "zero_adv_frac": adv_meta["zero_adv_frac"],
        "advantages": advantages,
        "raw_rewards": raw_rewards,
    })
    return loss, meta
