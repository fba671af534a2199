"""Shared-prompt packing for the policy-gradient update: each prompt of a microbatch passes through the
model once, however many of its responses the microbatch holds.

GRPO samples a group of responses per prompt, and padded rows repeat the prompt in every row of its
group. A packed microbatch is one sequence instead: every distinct prompt once, then the responses,
group by group; a response's positions continue from its prompt's end, and a token sees only its own
prompt and the earlier tokens of its own response. The hidden state at a prompt's last token predicts
the first token of every one of its responses.

Why the result is the padded one: attention is causal, so a prompt's activations do not depend on
what follows it and are the same as in each padded row; the gradient that reaches them is the sum of
what each row's copy received, which is what the weights' gradient sums anyway. Log-probs, entropies
and gradients equal the padded computation's up to rounding, from fewer tokens and without padding.

Attention over a pack is three variable-length attentions with no mask to build: each prompt over
itself (causal), each response over itself (causal), and each group's responses over their prompt
(every prompt token visible). The last two share their queries and are merged by their log-sum-exps
into one softmax over prompt and response keys; the backward of each part, given the merged output
and log-sum-exp, is that part's share of the whole softmax's gradient (the identity ring and
split-key attention rest on). The parts run as FlashAttention's variable-length kernels where the
device takes them (CUDA, 16-bit, head sizes up to 256), else as the same arithmetic written out in
PyTorch (``_math_attention``), which is also what the GPU tests hold the flash kernels to.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlvr.training.logprobs import _lm_head, _without_peft, head_log_probs, model_device

PACKED_ATTENTION = "rlvr_packed"
"""The attention implementation a packed forward runs under (registered with transformers)."""

FLASH_DTYPES = (torch.bfloat16, torch.float16)
FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class RowLayout:
    """Where a tokenised row's response sits: labels ``first .. first + n_response - 1`` are the
    response, so input positions ``0 .. first`` are its prompt."""

    first: int
    n_response: int

    @property
    def prompt_len(self) -> int:
        return self.first + 1


def row_layouts(response_mask: torch.Tensor, spans: bool = False) -> list[RowLayout | None] | None:
    """Each row's layout (None for a row without response tokens), or None when some row's response
    positions are not one contiguous run (such a batch is not packed). With ``spans`` a row's layout runs
    from its first response position to its last whatever lies between (a multi-turn conversation, whose
    environment messages sit between the model's turns)."""
    mask = response_mask.bool()
    counts = mask.sum(1).tolist()
    firsts = mask.int().argmax(1).tolist()
    lasts = (mask.shape[1] - 1 - mask.flip(1).int().argmax(1)).tolist()
    layouts: list[RowLayout | None] = []
    for n, first, last in zip(counts, firsts, lasts, strict=True):
        if n == 0:
            layouts.append(None)
        elif last - first + 1 != n and not spans:
            return None
        else:
            layouts.append(RowLayout(first, last - first + 1))
    return layouts


def _prompt_key(input_ids: torch.Tensor, row: int, layout: RowLayout | None) -> tuple[int, ...]:
    return () if layout is None else tuple(input_ids[row, : layout.prompt_len].tolist())


def shared_prefix_plan(
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    keep: Sequence[bool],
    microbatch_size: int,
    max_tokens_per_microbatch: int | None = None,
    spans: bool = False,
) -> list[list[int]] | None:
    """Row indices of each packed microbatch: kept rows grouped by identical prompt tokens, whole groups
    together where they fit, cut at ``microbatch_size`` rows and, if given, at
    ``max_tokens_per_microbatch`` packed tokens (each prompt counted once). None when the batch cannot
    be packed (``row_layouts``; ``spans`` as there)."""
    layouts = row_layouts(response_mask, spans)
    if layouts is None:
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, k in enumerate(keep):
        if k:
            groups.setdefault(_prompt_key(input_ids, i, layouts[i]), []).append(i)
    plan: list[list[int]] = []
    current: list[int] = []
    prompts: set[tuple[int, ...]] = set()
    tokens = 0
    for key, rows in groups.items():
        for i in rows:
            layout = layouts[i]
            own = 0 if layout is None else layout.n_response - 1
            cost = own + (0 if key in prompts or layout is None else layout.prompt_len)
            full = len(current) >= microbatch_size or (
                max_tokens_per_microbatch is not None and tokens + cost > max_tokens_per_microbatch
            )
            if current and full:
                plan.append(current)
                current, prompts, tokens = [], set(), 0
                cost = own + (0 if layout is None else layout.prompt_len)
            current.append(i)
            prompts.add(key)
            tokens += cost
    if current:
        plan.append(current)
    return plan


@dataclass(frozen=True)
class Pack:
    """One packed microbatch, on the host: the prompts (one per group), then the responses' inputs
    group by group, then padding (only when nothing else is packed)."""

    input_ids: torch.Tensor
    """(1, L) the packed tokens, then the padding."""
    position_ids: torch.Tensor
    """(1, L) each token's position in its own (prompt + response) sequence."""
    segment: torch.Tensor
    """(L,) the prompt or response each token belongs to (the padding is one more)."""
    prompt: torch.Tensor
    """(L,) the segment of the prompt of each token's group (a prompt's is its own)."""
    hidden_index: torch.Tensor
    """(kept,) the packed position whose hidden state predicts each response label."""
    keep: torch.Tensor
    """(kept,) each response label's index in the microbatch's flattened (rows, width) layout."""
    n_tokens: int
    """Packed tokens before padding."""
    prompt_lengths: tuple[int, ...]
    """Each group's prompt length, in packed order (the prompts fill positions 0 .. sum - 1)."""
    response_lengths: tuple[int, ...]
    """Each response's packed input length, in packed order (after the prompts)."""
    group_lengths: tuple[int, ...]
    """Each group's responses' packed length together, in the prompts' order."""


def pack_rows(
    input_ids: torch.Tensor, response_mask: torch.Tensor, rows: Sequence[int], width: int, spans: bool = False
) -> Pack:
    """Pack ``rows`` of a tokenised batch (host tensors): each distinct prompt once, then the inputs of
    each of its responses (all response tokens but the last, which no label is predicted from). Labels
    keep the padded layout, ``(len(rows), width)``, through ``keep``."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    layouts = row_layouts(response_mask[index, :width], spans)
    if layouts is None:
        raise ValueError("pack_rows needs each row's response positions to be one contiguous run")
    prompt_width = max((layout.prompt_len for layout in layouts if layout is not None), default=0)
    heads = input_ids[index, :prompt_width].tolist()  # one conversion for every row's prompt
    groups: dict[tuple[int, ...], list[tuple[int, int, RowLayout]]] = {}  # prompt -> its (j, row, layout)
    for j, (row, layout) in enumerate(zip(rows, layouts, strict=True)):
        if layout is not None:
            groups.setdefault(tuple(heads[j][: layout.prompt_len]), []).append((j, row, layout))
    # Pieces in packed order, each a run of one row's input tokens: (row, start, length, segment, the
    # segment of its group's prompt). The prompts first, then the responses in the prompts' order.
    pieces: list[tuple[int, int, int, int, int]] = []
    prompt_ends = []  # each group's prompt's last packed index
    for members in groups.values():
        _, row, layout = members[0]
        pieces.append((row, 0, layout.prompt_len, len(pieces), len(pieces)))
        prompt_ends.append(sum(piece[2] for piece in pieces) - 1)
    n_tokens = prompt_ends[-1] + 1 if prompt_ends else 0
    responses = []  # per kept row: (its place j in rows, its layout, its prompt's last packed index, its packed start)
    group_lengths = []
    for g, members in enumerate(groups.values()):
        start = n_tokens
        for j, row, layout in members:
            responses.append((j, layout, prompt_ends[g], n_tokens))
            pieces.append((row, layout.prompt_len, layout.n_response - 1, len(pieces), g))
            n_tokens += layout.n_response - 1
        group_lengths.append(n_tokens - start)
    length = max(1, n_tokens)
    # The padding is one more piece: its own segment and group, positions from 0, token id 0.
    pieces.append((0, 0, length - n_tokens, len(pieces), len(pieces)))
    piece_row, piece_start, piece_len, piece_segment, piece_prompt = map(list, zip(*pieces, strict=True))
    long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    lengths = long(piece_len)
    of_token = torch.repeat_interleave(torch.arange(len(piece_len)), lengths)
    offset = torch.arange(length) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    real = of_token < len(pieces) - 1
    starts = long(piece_start)[of_token]
    ids = torch.zeros(length, dtype=torch.long)
    ids[real] = input_ids[long(piece_row)[of_token[real]], (starts + offset)[real]]
    # Response labels: the first is predicted from its prompt's last token, the others from the packed
    # response input before them; ``keep`` places them in the (rows, width) layout.
    n_labels = long([layout.n_response for _, layout, _, _ in responses])
    label_of = torch.repeat_interleave(torch.arange(len(responses)), n_labels)
    step = torch.arange(int(n_labels.sum())) - torch.repeat_interleave(n_labels.cumsum(0) - n_labels, n_labels)
    response_start = long([start for *_, start in responses])[label_of]
    hidden_index = torch.where(
        step == 0, long([end for _, _, end, _ in responses])[label_of], response_start + step - 1
    )
    column = long([j * width + layout.first for j, layout, _, _ in responses])[label_of]
    n_groups = len(groups)
    return Pack(
        input_ids=ids.unsqueeze(0),
        position_ids=(starts + offset).unsqueeze(0),
        segment=long(piece_segment)[of_token],
        prompt=long(piece_prompt)[of_token],
        hidden_index=hidden_index,
        keep=column + step,
        n_tokens=n_tokens,
        prompt_lengths=tuple(piece_len[:n_groups]),
        response_lengths=tuple(piece_len[n_groups:-1]),
        group_lengths=tuple(group_lengths),
    )


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without waiting: a host tensor bound for a GPU is copied from pinned
    memory, which the host only queues."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _bounds(lengths: Sequence[int]) -> list[int]:
    """Cumulative boundaries ``[0, l0, l0 + l1, ...]`` of consecutive runs of ``lengths``."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass(frozen=True)
class PackedLayout:
    """Where a pack's prompts, responses and groups lie, for the three attentions over it: boundaries
    on the host (Python lists, for the arithmetic path and the kernels' sizes) and on the device (int32,
    for the flash kernels). Response and group boundaries count from the first response token."""

    prompts: list[int]
    responses: list[int]
    groups: list[int]
    prompts_on_device: torch.Tensor
    responses_on_device: torch.Tensor
    groups_on_device: torch.Tensor

    @functools.cached_property
    def longest(self) -> dict[str, int]:
        """The longest run of each boundary list (the flash kernels' sizes), found once per pack."""
        return {name: _longest(getattr(self, name)) for name in ("prompts", "responses", "groups")}

    @property
    def n_prompt(self) -> int:
        return self.prompts[-1]

    @property
    def n_response(self) -> int:
        return self.responses[-1]


def _longest(bounds: Sequence[int]) -> int:
    return max((b - a for a, b in zip(bounds, bounds[1:], strict=False)), default=0)


def _pack_to(pack: Pack, labels: torch.Tensor, device: torch.device) -> tuple[Pack, PackedLayout, torch.Tensor]:
    """The pack's tensors, its layout's boundaries and ``labels`` on ``device`` in one copy, from pinned
    memory on CUDA (so the host queues the copy and goes on building the next microbatch)."""
    prompts, responses, groups = (
        _bounds(pack.prompt_lengths),
        _bounds(pack.response_lengths),
        _bounds(pack.group_lengths),
    )
    parts = [pack.input_ids, pack.position_ids, pack.hidden_index, pack.keep, labels]
    parts += [torch.tensor(b, dtype=torch.long) for b in (prompts, responses, groups)]
    flat = _copy_to(torch.cat([part.reshape(-1) for part in parts]), device)
    ids, positions, hidden_index, keep, flat_labels, *bounds = flat.split([part.numel() for part in parts])
    on_device = Pack(
        ids.view(1, -1),
        positions.view(1, -1),
        pack.segment,
        pack.prompt,
        hidden_index,
        keep,
        pack.n_tokens,
        pack.prompt_lengths,
        pack.response_lengths,
        pack.group_lengths,
    )
    layout = PackedLayout(prompts, responses, groups, *(b.to(torch.int32) for b in bounds))
    return on_device, layout, flat_labels.view_as(labels)


def attention_mask(pack: Pack) -> torch.Tensor:
    """The packed attention written out as a dense (L, L) boolean mask (the reference the three-part
    attention is tested against): query ``q`` sees key ``k`` when ``k`` is not later, in the same group,
    and either the group's prompt or in ``q``'s own segment."""
    prompt, segment = pack.prompt, pack.segment
    q, k = torch.arange(prompt.numel())[:, None], torch.arange(prompt.numel())[None, :]
    same_group = prompt[q] == prompt[k]
    own_or_prompt = (segment[k] == segment[q]) | (segment[k] == prompt[k])
    return (k <= q) & same_group & own_or_prompt


# --- the three attentions and their merge ---------------------------------------------------------


def _flash_takes(query: torch.Tensor) -> bool:
    head_dim = query.shape[-1]
    return query.is_cuda and query.dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM


def _accumulation_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 for 16-bit and float32 inputs, float64 for float64 ones."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _segment_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_bounds: Sequence[int],
    k_bounds: Sequence[int],
    causal: bool,
    scale: float,
) -> Iterator[tuple[slice, slice, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each non-empty sequence of a variable-length attention: its query and key slices, its
    queries, keys and values as (H, t, D) at the accumulation precision (keys and values repeated for
    grouped-query heads) and its scaled scores (H, t_q, t_k), causally masked if asked."""
    groups = q.shape[1] // k.shape[1]
    acc = _accumulation_dtype(q)
    for (q0, q1), (k0, k1) in zip(zip(q_bounds, q_bounds[1:]), zip(k_bounds, k_bounds[1:]), strict=True):
        if q1 == q0 or k1 == k0:
            continue
        qi = q[q0:q1].transpose(0, 1).to(acc)
        ki = k[k0:k1].transpose(0, 1).to(acc).repeat_interleave(groups, 0)
        vi = v[k0:k1].transpose(0, 1).to(acc).repeat_interleave(groups, 0)
        scores = qi @ ki.transpose(1, 2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
        yield slice(q0, q1), slice(k0, k1), qi, ki, vi, scores


def _math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_bounds: Sequence[int],
    k_bounds: Sequence[int],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length attention written out: sequence ``i``'s queries ``q[q_bounds[i]:q_bounds[i+1]]``
    over its keys ``k[k_bounds[i]:k_bounds[i+1]]`` ((T, H, D) and (S, H_kv, D)); returns the output (T, H,
    D) and the log-sum-exp of the scaled scores (H, T), at least float32 (-inf for a query with no key)."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_accumulation_dtype(q), device=q.device)
    for rows, _, _, _, vi, scores in _segment_scores(q, k, v, q_bounds, k_bounds, causal, scale):
        lse_i = torch.logsumexp(scores, -1)
        out[rows] = (torch.exp(scores - lse_i[..., None]) @ vi).transpose(0, 1).to(q.dtype)
        lse[:, rows] = lse_i
    return out, lse


def _math_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_bounds: Sequence[int],
    k_bounds: Sequence[int],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``_math_attention``'s inputs, given ``out`` and ``lse`` of the softmax the
    scores belong to (perhaps one over more keys than these: then these are this part's share)."""
    kv_heads, groups = k.shape[1], q.shape[1] // k.shape[1]
    acc = _accumulation_dtype(q)
    dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
    for rows, keys, qi, ki, vi, scores in _segment_scores(q, k, v, q_bounds, k_bounds, causal, scale):
        gi, oi = grad[rows].transpose(0, 1).to(acc), out[rows].transpose(0, 1).to(acc)
        p = torch.exp(scores - lse[:, rows, None].to(acc))
        ds = p * (gi @ vi.transpose(1, 2) - (gi * oi).sum(-1, keepdim=True)) * scale
        dq[rows] = (ds @ ki).transpose(0, 1)
        per_kv_head = (kv_heads, groups, keys.stop - keys.start, -1)  # query heads summed onto their key/value head
        dk[keys] = (ds.transpose(1, 2) @ qi).view(per_kv_head).sum(1).transpose(0, 1)
        dv[keys] = (p.transpose(1, 2) @ gi).view(per_kv_head).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_bounds: torch.Tensor,
    k_bounds: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's variable-length forward: output (T, H, D) and log-sum-exp (H, T)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, q_bounds, k_bounds, max_q, max_k, 0.0, causal, False, scale=scale
    )
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"unexpected flash log-sum-exp shape {tuple(lse.shape)} for queries {tuple(q.shape)}")
    return out, lse


def _flash_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_bounds: torch.Tensor,
    k_bounds: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the philox state dropout 0 ignores
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, q_bounds, k_bounds, max_q, max_k, 0.0, causal, no_dropout,
        torch.empty(0, device=q.device), scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _on(layout: PackedLayout, name: str, flash: bool) -> tuple[Any, int]:
    """A boundary list of ``layout`` as the kernel takes it (device tensor for flash, host list else) and
    its longest run."""
    return getattr(layout, f"{name}_on_device" if flash else name), layout.longest[name]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, q_name: str, k_name: str,
    causal: bool, scale: float, flash: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    (q_bounds, max_q), (k_bounds, max_k) = _on(layout, q_name, flash), _on(layout, k_name, flash)
    if flash:
        return _flash_attention(q, k, v, q_bounds, k_bounds, max_q, max_k, causal, scale)
    return _math_attention(q, k, v, q_bounds, k_bounds, causal, scale)


def _attend_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    layout: PackedLayout, q_name: str, k_name: str, causal: bool, scale: float, flash: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    (q_bounds, max_q), (k_bounds, max_k) = _on(layout, q_name, flash), _on(layout, k_name, flash)
    if flash:
        return _flash_attention_backward(grad, q, k, v, out, lse, q_bounds, k_bounds, max_q, max_k, causal, scale)
    return _math_attention_backward(grad, q, k, v, out, lse, q_bounds, k_bounds, causal, scale)


def _weighted_sum(
    own: torch.Tensor, seen: torch.Tensor, weight_own: torch.Tensor, weight_seen: torch.Tensor
) -> torch.Tensor:
    """``own * weight_own + seen * weight_seen`` at the weights' precision, in the outputs' dtype."""
    return (own.to(weight_own.dtype) * weight_own + seen.to(weight_seen.dtype) * weight_seen).to(own.dtype)


_compiled_weighted_sum: Callable[..., torch.Tensor] | None = None


def _merge(
    own: torch.Tensor, seen: torch.Tensor, lse_own: torch.Tensor, lse_seen: torch.Tensor, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same queries over disjoint keys ((T, H, D) outputs, (H, T) log-sum-exps)
    as one softmax over both: each output weighted by its share of the total, and the total's
    log-sum-exp. The shares are per (query, head), so they are found first and only their weighted sum
    runs over the head dimension; ``fused`` runs that sum as one compiled kernel (sizes symbolic)."""
    global _compiled_weighted_sum
    acc = _accumulation_dtype(own)
    lse = torch.logaddexp(lse_own.to(acc), lse_seen.to(acc))
    weight_own = torch.exp(lse_own - lse).t().unsqueeze(-1).contiguous()
    weight_seen = torch.exp(lse_seen - lse).t().unsqueeze(-1).contiguous()
    if fused and _compiled_weighted_sum is None:
        _compiled_weighted_sum = torch.compile(_weighted_sum, dynamic=True)
    weighted_sum = _compiled_weighted_sum if fused and _compiled_weighted_sum is not None else _weighted_sum
    return weighted_sum(own, seen, weight_own, weight_seen), lse


def packed_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float, flash: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention over a pack ((L, H, D) queries, (L, H_kv, D) keys and values): the output (L, H, D),
    zero past the responses, and the log-sum-exps (H, n) of the prompt and response queries."""
    n_p, n_r = layout.n_prompt, layout.n_response
    parts, lse_prompt, lse_response = [], None, None
    if n_p:
        out_prompt, lse_prompt = _attend(q[:n_p], k[:n_p], v[:n_p], layout, "prompts", "prompts", True, scale, flash)
        parts.append(out_prompt)
    if n_r:
        response = slice(n_p, n_p + n_r)
        own, lse_own = _attend(
            q[response], k[response], v[response], layout, "responses", "responses", True, scale, flash
        )
        seen, lse_seen = _attend(q[response], k[:n_p], v[:n_p], layout, "groups", "prompts", False, scale, flash)
        out_response, lse_response = _merge(own, seen, lse_own, lse_seen, fused=flash)
        parts.append(out_response)
    if n_p + n_r < q.shape[0]:
        parts.append(q.new_zeros((q.shape[0] - n_p - n_r, *q.shape[1:])))
    return torch.cat(parts), lse_prompt, lse_response


def packed_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse_prompt: torch.Tensor | None,
    lse_response: torch.Tensor | None,
    layout: PackedLayout,
    scale: float,
    flash: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``packed_attention_forward``'s q, k and v: each part's backward with the merged
    output and log-sum-exp, the parts' shares summed (a sum of 16-bit tensors is taken in float32 and
    rounded once)."""
    n_p, n_r = layout.n_prompt, layout.n_response
    if not n_p:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    assert lse_prompt is not None
    prompt, response = slice(0, n_p), slice(n_p, n_p + n_r)
    dq_p, dk_p, dv_p = _attend_backward(
        grad[prompt], q[prompt], k[prompt], v[prompt], out[prompt], lse_prompt, layout, "prompts", "prompts",
        True, scale, flash,
    )  # fmt: skip
    dq, dk, dv = [dq_p], [dk_p], [dv_p]
    if n_r:
        assert lse_response is not None
        g, o = grad[response], out[response]
        dq_own, dk_own, dv_own = _attend_backward(
            g, q[response], k[response], v[response], o, lse_response, layout, "responses", "responses", True,
            scale, flash,
        )  # fmt: skip
        dq_seen, dk_seen, dv_seen = _attend_backward(
            g, q[response], k[prompt], v[prompt], o, lse_response, layout, "groups", "prompts", False, scale, flash
        )
        dq, dk, dv = [dq_p, dq_own + dq_seen], [dk_p + dk_seen, dk_own], [dv_p + dv_seen, dv_own]
    rest = q.shape[0] - n_p - n_r
    if rest:
        dq.append(q.new_zeros((rest, *q.shape[1:])))
        dk.append(k.new_zeros((rest, *k.shape[1:])))
        dv.append(v.new_zeros((rest, *v.shape[1:])))
    return torch.cat(dq), torch.cat(dk), torch.cat(dv)


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float, flash: bool
    ) -> torch.Tensor:
        out, lse_prompt, lse_response = packed_attention_forward(q, k, v, layout, scale, flash)
        ctx.save_for_backward(q, k, v, out, lse_prompt, lse_response)
        ctx.layout, ctx.scale, ctx.flash = layout, scale, flash
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse_prompt, lse_response = ctx.saved_tensors
        grad = grad if ctx.flash and grad.stride(-1) == 1 else grad.contiguous()
        grads = packed_attention_backward(
            grad, q, k, v, out, lse_prompt, lse_response, ctx.layout, ctx.scale, ctx.flash
        )
        return (*grads, None, None, None)


def attend_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, scale: float, flash: bool | None = None
) -> torch.Tensor:
    """Differentiable attention over a pack ((L, H, D) queries, (L, H_kv, D) keys and values, as
    ``packed_attention_forward``); ``flash`` None picks the flash kernels where they run (``_flash_takes``)."""
    flash = _flash_takes(q) if flash is None else flash
    q, k, v = (t if flash and t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # flash takes any row stride
    return _PackedAttention.apply(q, k, v, layout, scale, flash)  # type: ignore[no-any-return]


_layout: contextvars.ContextVar[PackedLayout | None] = contextvars.ContextVar("rlvr_packed_layout", default=None)
"""The layout of the pack whose forward runs now (the attention layers read it; transformers passes no
mask to an attention implementation it has no mask function for)."""


@torch.compiler.disable
def _attend_current_pack(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """``attend_packed`` over the running pack, outside any compiled graph (its kernels are not
    traceable, and its layout's lists change with every pack)."""
    layout = _layout.get()
    if layout is None:
        raise RuntimeError(
            "packed attention ran outside a packed forward (a recomputed forward under gradient checkpointing?); "
            "set optim.shared_prefix false or model.gradient_checkpointing false"
        )
    return attend_packed(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), layout, scale)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over a packed sequence: (1, H, L, D) inputs, the
    pack's layout from ``packed_response_log_probs``, (1, L, H, D) output."""
    if dropout:
        raise ValueError("packed training does not support attention dropout; set optim.shared_prefix false")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _attend_current_pack(query, key, value, scale).unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


_register()


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run the model's attention layers under ``name`` for the duration (they read it at every call)."""
    config: Any = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def can_pack(model: torch.nn.Module) -> bool:
    """Whether ``model``'s log-probs can be computed packed: an unwrapped model (peft adapters allowed)
    whose logits are a plain ``Linear`` of its backbone's output."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, (FSDPModule, DistributedDataParallel)):
        return False
    return _lm_head(_without_peft(model)) is not None


def packed_response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    response_mask: torch.Tensor,
    rows: Sequence[int],
    width: int,
    chunk_tokens: int,
    return_token_entropy: bool = False,
    backbone: Callable[..., Any] | None = None,
    keep_logits: bool = False,
) -> dict[str, Any]:
    """``get_response_log_probs`` of ``rows`` (each cut to ``width``), with the response mask as
    ``positions``, computed over one packed sequence: the same (len(rows), width) outputs, 0 outside
    the response mask, and ``backbone_tokens``, the packed length. ``model`` must pass ``can_pack``;
    ``backbone`` and ``keep_logits`` as in ``get_response_log_probs``."""
    plain = _without_peft(model)
    head = _lm_head(plain)
    if head is None or not can_pack(model):
        raise ValueError(f"{type(model).__name__} cannot be trained packed (see can_pack)")
    device = model_device(plain)
    host = pack_rows(input_ids, response_mask, rows, width, spans=True)
    pack, layout, mb_labels = _pack_to(host, labels[torch.as_tensor(list(rows)), :width], device)
    token = _layout.set(layout)
    try:
        with _attention_implementation(plain, PACKED_ATTENTION):
            hidden = (plain.base_model if backbone is None else backbone)(  # type: ignore[operator]
                input_ids=pack.input_ids, position_ids=pack.position_ids, use_cache=False
            ).last_hidden_state[0]
    finally:
        _layout.reset(token)
    hidden = hidden.index_select(0, pack.hidden_index)
    out: dict[str, Any] = head_log_probs(
        head, hidden, mb_labels, pack.keep, chunk_tokens, return_token_entropy, backbone is not None, keep_logits
    )
    # A conversation's span holds the environment's messages too: outside the mask, 0 as in the padded path.
    mask = response_mask[torch.as_tensor(list(rows)), :width].to(device, non_blocking=True)
    for key in ("log_probs", "token_entropy"):
        if key in out:
            out[key] = out[key].masked_fill(~mask.bool(), 0.0)
    out["backbone_tokens"] = pack.input_ids.shape[1]
    return out
