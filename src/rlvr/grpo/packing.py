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
from the same rule (``visible``). FlexAttention runs compiled, outside a compiled backbone's graphs
(``torch.compiler.disable``). Compiled for a symbolic length its kernels were markedly slower than
with the length a constant, but a constant length compiles again for every new length, slowly
(docs/benchmarks.md). So a pack that nearly fills the token budget is padded to exactly the budget
and runs the constant-length kernel (one compile for the run); the rest (a step's last pack, runs
without a budget) run the symbolic-length kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlvr.grpo.logprobs import _lm_head, _without_peft, head_log_probs, model_device

PACKED_ATTENTION = "rlvr_packed"
"""The attention implementation a packed forward runs under (registered with transformers)."""

_full_pack: contextvars.ContextVar[bool] = contextvars.ContextVar("rlvr_full_pack", default=False)
"""Whether the pack running now is exactly the token budget long (FlexAttention compiled for that
length). Read outside the compiled layers, so that they need not compile once per kind of pack."""

FLEX_BLOCK = 128
"""FlexAttention's block size: packs run through it are padded to a multiple, so every block is whole."""

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


def pack_length(n_tokens: int, align: int = 1, full_length: int | None = None) -> int:
    """The padded length of a pack of ``n_tokens``: ``full_length`` when the pack nearly fills it (within
    a sixteenth), else the next multiple of ``align`` (at least one token)."""
    if full_length is not None and full_length - full_length // 16 < n_tokens <= full_length:
        return full_length
    return max(align, -(-n_tokens // align) * align)


def pack_rows(
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    rows: Sequence[int],
    width: int,
    align: int = 1,
    full_length: int | None = None,
) -> Pack:
    """Pack ``rows`` of a tokenised batch (host tensors): each distinct prompt once, then the inputs of
    each of its responses (all response tokens but the last, which no label is predicted from), then
    padding to ``pack_length``. Labels keep the padded layout, ``(len(rows), width)``, through ``keep``."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    layouts = row_layouts(response_mask[index, :width])
    if layouts is None:
        raise ValueError("pack_rows needs each row's response positions to be one contiguous run")
    prompt_width = max((layout.prompt_len for layout in layouts if layout is not None), default=0)
    heads = input_ids[index, :prompt_width].tolist()  # one conversion for every row's prompt
    # Pieces in packed order, each a run of one row's input tokens: (row, start, length, segment, the
    # segment of its group's prompt). A prompt is one piece the first time it is seen.
    pieces: list[tuple[int, int, int, int, int]] = []
    responses = []  # per kept row: (its place j in rows, its layout, its prompt's last packed index, its packed start)
    prompt_ends: dict[tuple[int, ...], tuple[int, int]] = {}  # prompt -> (its last packed index, its segment)
    n_tokens = 0
    for j, (row, layout) in enumerate(zip(rows, layouts, strict=True)):
        if layout is None:
            continue
        p, n = layout.prompt_len, layout.n_response
        key = tuple(heads[j][:p])
        if key not in prompt_ends:
            prompt_ends[key] = (n_tokens + p - 1, len(pieces))
            pieces.append((row, 0, p, len(pieces), len(pieces)))
            n_tokens += p
        prompt_end, prompt_segment = prompt_ends[key]
        responses.append((j, layout, prompt_end, n_tokens))
        pieces.append((row, p, n - 1, len(pieces), prompt_segment))
        n_tokens += n - 1
    length = pack_length(n_tokens, align, full_length)
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
    return Pack(
        input_ids=ids.unsqueeze(0),
        position_ids=(starts + offset).unsqueeze(0),
        segment=long(piece_segment)[of_token],
        prompt=long(piece_prompt)[of_token],
        hidden_index=hidden_index,
        keep=column + step,
        n_tokens=n_tokens,
    )


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without waiting: a host tensor bound for a GPU is copied from pinned
    memory, which the host only queues."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _pack_to(pack: Pack, labels: torch.Tensor, device: torch.device) -> tuple[Pack, torch.Tensor]:
    """The pack's tensors and ``labels`` on ``device`` in one copy, from pinned memory on CUDA (so the
    host queues the copy and goes on building the next microbatch)."""
    parts = [pack.input_ids, pack.position_ids, pack.segment, pack.prompt, pack.hidden_index, pack.keep, labels]
    flat = _copy_to(torch.cat([part.reshape(-1) for part in parts]), device)
    ids, positions, segment, prompt, hidden_index, keep, flat_labels = flat.split([part.numel() for part in parts])
    on_device = Pack(ids.view(1, -1), positions.view(1, -1), segment, prompt, hidden_index, keep, pack.n_tokens)
    return on_device, flat_labels.view_as(labels)


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
    prompt, segment = _copy_to(pack.prompt, device), _copy_to(pack.segment, device)
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


def _flex_full(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, scale: float | None
) -> torch.Tensor:
    """FlexAttention, to be compiled with the pack length a constant (its own code object, so its
    compiled entries are not shared with ``_flex_any``'s)."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = query.shape[1] != key.shape[1]
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)  # type: ignore[return-value]


def _flex_any(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, scale: float | None
) -> torch.Tensor:
    """FlexAttention, to be compiled with the pack length symbolic."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = query.shape[1] != key.shape[1]
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)  # type: ignore[return-value]


_compiled_flex: dict[bool, Callable[..., torch.Tensor]] = {}


@torch.compiler.disable
def _flex_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, scale: float | None
) -> torch.Tensor:
    """FlexAttention compiled (uncompiled it would materialise the scores), called from outside any
    compiled graph: for a full pack with its length a constant, else with the length symbolic."""
    full = _full_pack.get()
    if full not in _compiled_flex:
        _compiled_flex[full] = (
            torch.compile(_flex_full, dynamic=False) if full else torch.compile(_flex_any, dynamic=True)
        )
    with _flex_lengths():
        return _compiled_flex[full](query, key, value, block_mask, scale)


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
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """``get_response_log_probs`` of ``rows`` (each cut to ``width``), with the response mask as
    ``positions``, computed over one packed sequence: the same (len(rows), width) outputs, 0 outside
    the response mask, and ``backbone_tokens``, the packed length. ``model`` must pass ``can_pack``;
    ``backbone`` as in ``get_response_log_probs``; ``max_tokens``, the planner's token budget (a pack
    that nearly fills it is padded to it, see the module docstring)."""
    plain = _without_peft(model)
    head = _lm_head(plain)
    if head is None or not can_pack(model):
        raise ValueError(f"{type(model).__name__} cannot be trained packed (see can_pack)")
    device = model_device(plain)
    align = FLEX_BLOCK if device.type == "cuda" else 1
    full_length = None if max_tokens is None else -(-max_tokens // align) * align
    host = pack_rows(input_ids, response_mask, rows, width, align, full_length)
    pack, mb_labels = _pack_to(host, labels[torch.as_tensor(list(rows)), :width], device)
    mask = attention_mask(pack, device)
    token = _full_pack.set(pack.input_ids.shape[1] == full_length)
    try:
        with _attention_implementation(plain, PACKED_ATTENTION):
            hidden = (plain.base_model if backbone is None else backbone)(  # type: ignore[operator]
                input_ids=pack.input_ids, position_ids=pack.position_ids, attention_mask=mask, use_cache=False
            ).last_hidden_state[0]
    finally:
        _full_pack.reset(token)
    hidden = hidden.index_select(0, pack.hidden_index)
    keep = pack.keep
    out: dict[str, Any] = head_log_probs(
        head, hidden, mb_labels, keep, chunk_tokens, return_token_entropy, backbone is not None
    )
    out["backbone_tokens"] = pack.input_ids.shape[1]
    return out
