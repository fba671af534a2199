"""Shared-prompt packing for the policy-gradient update: each prompt of a microbatch passes through the
model once, however many of its responses the microbatch holds.

GRPO samples a group of responses per prompt, and padded rows repeat the prompt in every row of its
group. A packed microbatch is one sequence instead: each prompt once, followed by each of its
responses; a response's positions continue from its prompt's end, and the attention mask lets a token
see only its own prompt and the earlier tokens of its own response. The hidden state at a prompt's
last token predicts the first token of every one of its responses.

Why the result is the padded one: attention is causal, so a prompt's activations do not depend on
what follows it and are the same as in each padded row; the gradient that reaches them is the sum of
what each row's copy received, which is what the weights' gradient sums anyway. Log-probs, entropies
and gradients equal the padded computation's up to rounding, from fewer tokens and without padding.

On CUDA the mask is a FlexAttention ``BlockMask`` (blocks that no query of a block can see are
skipped); elsewhere, where FlexAttention has no backward, it is a dense boolean mask for SDPA, built
from the same rule (``visible``). FlexAttention runs compiled for each pack length, with the length a
constant: compiled for symbolic lengths its kernels were markedly slower (docs/benchmarks.md).
Packs are therefore padded to a multiple of ``FLEX_ALIGN`` tokens, so that a run compiles a handful of
lengths, and the call sits outside a compiled backbone's graphs (``torch.compiler.disable``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlvr.grpo.logprobs import _lm_head, _without_peft, head_log_probs, model_device

PACKED_ATTENTION = "rlvr_packed"
"""The attention implementation a packed forward runs under (registered with transformers)."""

FLEX_ALIGN = 1024
"""Packs run through FlexAttention are padded to a multiple of this many tokens (a multiple of its
block size, so every block is whole): each length compiles once."""

FLEX_LENGTHS = 64
"""How many pack lengths FlexAttention may compile for (beyond the compiler's default limit)."""

FLEX_MIN_HEAD_DIM = 16
"""FlexAttention's smallest head size; smaller heads (test models) take the dense mask instead."""


@dataclass(frozen=True)
class RowLayout:
    """Where a tokenised row's response sits: labels ``first .. first + n_response - 1`` are the
    response, so input positions ``0 .. first`` are its prompt."""

    first: int
    n_response: int

    @property
    def prompt_len(self) -> int:
        return self.first + 1


def row_layouts(response_mask: torch.Tensor) -> list[RowLayout | None] | None:
    """Each row's layout (None for a row without response tokens), or None when some row's response
    positions are not one contiguous run (such a batch is not packed)."""
    mask = response_mask.bool()
    counts = mask.sum(1).tolist()
    firsts = mask.int().argmax(1).tolist()
    lasts = (mask.shape[1] - 1 - mask.flip(1).int().argmax(1)).tolist()
    layouts: list[RowLayout | None] = []
    for n, first, last in zip(counts, firsts, lasts, strict=True):
        if n == 0:
            layouts.append(None)
        elif last - first + 1 != n:
            return None
        else:
            layouts.append(RowLayout(first, n))
    return layouts


def _prompt_key(input_ids: torch.Tensor, row: int, layout: RowLayout | None) -> tuple[int, ...]:
    return () if layout is None else tuple(input_ids[row, : layout.prompt_len].tolist())


def shared_prefix_plan(
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    keep: Sequence[bool],
    microbatch_size: int,
    max_tokens_per_microbatch: int | None = None,
) -> list[list[int]] | None:
    """Row indices of each packed microbatch: kept rows grouped by identical prompt tokens, whole groups
    together where they fit, cut at ``microbatch_size`` rows and, if given, at
    ``max_tokens_per_microbatch`` packed tokens (each prompt counted once). None when the batch cannot
    be packed (``row_layouts``)."""
    layouts = row_layouts(response_mask)
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
    """One packed microbatch, on the host."""

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


def pack_rows(
    input_ids: torch.Tensor, response_mask: torch.Tensor, rows: Sequence[int], width: int, align: int = 1
) -> Pack:
    """Pack ``rows`` of a tokenised batch (host tensors): each distinct prompt once, then the inputs of
    each of its responses (all response tokens but the last, which no label is predicted from), then
    padding to a multiple of ``align`` (at least one token). Labels keep the padded layout,
    ``(len(rows), width)``, through ``keep``."""
    layouts = row_layouts(response_mask[list(rows), :width])
    if layouts is None:
        raise ValueError("pack_rows needs each row's response positions to be one contiguous run")
    ids: list[int] = []
    positions: list[int] = []
    segment: list[int] = []
    prompt: list[int] = []
    hidden_index: list[int] = []
    keep: list[int] = []
    prompt_ends: dict[tuple[int, ...], tuple[int, int]] = {}  # prompt -> (its last packed index, its segment)
    n_segments = 0
    for j, (row, layout) in enumerate(zip(rows, layouts, strict=True)):
        if layout is None:
            continue
        key = _prompt_key(input_ids, row, layout)
        if key not in prompt_ends:
            start, p = len(ids), layout.prompt_len
            ids.extend(key)
            positions.extend(range(p))
            segment.extend([n_segments] * p)
            prompt.extend([n_segments] * p)
            prompt_ends[key] = (start + p - 1, n_segments)
            n_segments += 1
        prompt_end, prompt_segment = prompt_ends[key]
        start, p, n = len(ids), layout.prompt_len, layout.n_response
        ids.extend(input_ids[row, p : layout.first + n].tolist())
        positions.extend(range(p, p + n - 1))
        segment.extend([n_segments] * (n - 1))
        prompt.extend([prompt_segment] * (n - 1))
        n_segments += 1
        hidden_index.append(prompt_end)
        hidden_index.extend(range(start, start + n - 1))
        keep.extend(range(j * width + layout.first, j * width + layout.first + n))
    n_tokens = len(ids)
    pad = -n_tokens % align or (align if n_tokens == 0 else 0)
    ids.extend([0] * pad)
    positions.extend(range(pad))
    segment.extend([n_segments] * pad)
    prompt.extend([n_segments] * pad)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return Pack(
        input_ids=as_long(ids).unsqueeze(0),
        position_ids=as_long(positions).unsqueeze(0),
        segment=as_long(segment),
        prompt=as_long(prompt),
        hidden_index=as_long(hidden_index),
        keep=as_long(keep),
        n_tokens=n_tokens,
    )


def visible(prompt: torch.Tensor, segment: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The packed mask as a FlexAttention ``mask_mod``: query ``q`` sees key ``k`` when ``k`` is not
    later, in the same group, and either the group's prompt or in ``q``'s own segment."""

    def mask_mod(batch: Any, head: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        same_group = prompt[q] == prompt[k]
        own_or_prompt = (segment[k] == segment[q]) | (segment[k] == prompt[k])
        return (k <= q) & same_group & own_or_prompt

    return mask_mod


_compiled_block_mask: Callable[..., Any] | None = None


def attention_mask(pack: Pack, device: torch.device) -> Any:
    """A FlexAttention ``BlockMask`` for the pack on CUDA, else a dense (1, 1, L, L) boolean mask."""
    prompt = pack.prompt.to(device, non_blocking=True)
    segment = pack.segment.to(device, non_blocking=True)
    rule = visible(prompt, segment)
    n = prompt.numel()
    if device.type == "cuda":
        global _compiled_block_mask
        if _compiled_block_mask is None:  # eager, it evaluates the rule for every (query, key) pair at once
            from torch.nn.attention.flex_attention import create_block_mask

            _compiled_block_mask = torch.compile(create_block_mask)
        with _flex_lengths():
            return _compiled_block_mask(rule, None, None, n, n, device=device)
    index = torch.arange(n, device=device)
    return rule(None, None, index[:, None], index[None, :])[None, None]


def _flex_lengths() -> Any:
    """Room for ``FLEX_LENGTHS`` compiled pack lengths, for the duration."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(FLEX_LENGTHS, getattr(config, name))})


_static_flex: Callable[..., torch.Tensor] | None = None


@torch.compiler.disable
def _flex_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, scale: float | None
) -> torch.Tensor:
    """FlexAttention compiled for this pack length as a constant, called from outside any compiled
    graph (uncompiled it would materialise the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _static_flex
    if _static_flex is None:
        _static_flex = torch.compile(flex_attention, dynamic=False)
    with _flex_lengths():
        return _static_flex(
            query, key, value, block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
        )


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
    """transformers' attention-function signature over a packed sequence: (B, H, L, D) inputs, the
    mask from ``attention_mask`` (a ``BlockMask`` for FlexAttention or a dense boolean mask for SDPA),
    (B, L, H, D) output."""
    if dropout:
        raise ValueError("packed training does not support attention dropout; set optim.shared_prefix false")
    if not isinstance(attention_mask, torch.Tensor) and query.shape[-1] < FLEX_MIN_HEAD_DIM:
        index = torch.arange(query.shape[2], device=query.device)
        attention_mask = attention_mask.mask_mod(None, None, index[:, None], index[None, :])[None, None]
    if isinstance(attention_mask, torch.Tensor):
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    else:
        out = _flex_attention(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


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
) -> dict[str, Any]:
    """``get_response_log_probs`` of ``rows`` (each cut to ``width``), with the response mask as
    ``positions``, computed over one packed sequence: the same (len(rows), width) outputs, 0 outside
    the response mask, and ``backbone_tokens``, the packed length. ``model`` must pass ``can_pack``;
    ``backbone`` as in ``get_response_log_probs``."""
    plain = _without_peft(model)
    head = _lm_head(plain)
    if head is None or not can_pack(model):
        raise ValueError(f"{type(model).__name__} cannot be trained packed (see can_pack)")
    device = model_device(plain)
    pack = pack_rows(input_ids, response_mask, rows, width, FLEX_ALIGN if device.type == "cuda" else 1)
    ids = pack.input_ids.to(device, non_blocking=True)
    positions = pack.position_ids.to(device, non_blocking=True)
    mask = attention_mask(pack, device)
    with _attention_implementation(plain, PACKED_ATTENTION):
        hidden = (plain.base_model if backbone is None else backbone)(  # type: ignore[operator]
            input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False
        ).last_hidden_state[0]
    hidden = hidden.index_select(0, pack.hidden_index.to(device, non_blocking=True))
    mb_labels = labels[torch.as_tensor(list(rows)), :width].to(device, non_blocking=True)
    keep = pack.keep.to(device, non_blocking=True)
    out: dict[str, Any] = head_log_probs(
        head, hidden, mb_labels, keep, chunk_tokens, return_token_entropy, backbone is not None
    )
    out["backbone_tokens"] = pack.input_ids.shape[1]
    return out
