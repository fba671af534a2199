"""The engine's device buffers: the static K/V caches, the per-row indices and counters the decode step
reads and advances, the sampling inputs and outputs, and the stacked projection weights."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlvr.engines.fast.families import LayerWeights, Layout


@dataclass
class State:
    """Device buffers every graph reads and writes (fixed addresses for the graphs' lifetime)."""

    pk: list[torch.Tensor]  # per layer (groups_cap, kv_heads, prompt_slots_cap, head_dim): prompt K
    pv: list[torch.Tensor]  # prompt V
    rk: list[torch.Tensor]  # per layer (rows_cap, kv_heads, response_slots_cap, head_dim): response K
    rv: list[torch.Tensor]  # response V
    tok: torch.Tensor  # (rows_cap,) token fed to the next step
    pos: torch.Tensor  # (rows_cap,) its position id
    grp: torch.Tensor  # (rows_cap,) prompt-cache entry of the row (its prompt)
    start: torch.Tensor  # (rows_cap,) first real prompt slot of the row (left padding before it)
    row_id: torch.Tensor  # (rows_cap,) output row the batch row writes to (scratch row for fillers)
    live: torch.Tensor  # (rows_cap,) int32: 0 for fillers and rows found finished (attention skips them)
    runs: torch.Tensor  # (2, rows_cap) int32: first attention row and row count of runs sharing a prompt
    crow: torch.Tensor  # (rows_cap,) cache row of rk/rv holding the batch row's response K/V
    plen: torch.Tensor  # (1,) prompt slots in use (the chunk's padded prompt length)
    slot: torch.Tensor  # (1,) response slot the next step writes
    step: torch.Tensor  # (1,) output column the next step writes
    noise: torch.Tensor  # (rows_cap, vocab) Exp(1) noise for the exponential race; no rows until needed
    seed: torch.Tensor  # (1,) int64: the chunk's seed of counter-based noise
    temperature: torch.Tensor  # (1,) float32
    top_p: torch.Tensor  # (1,) float32
    vocab_bias: torch.Tensor  # (vocab,) 0, or -inf on ids the tokenizer cannot decode
    out_tok: torch.Tensor  # (rows_cap + 1, steps_cap) sampled tokens; last row is scratch
    out_lp: torch.Tensor  # (rows_cap + 1, steps_cap) their log-probs
    wqkv: list  # per layer: (stacked q/k/v weight,), refreshed from the model every chunk; or []
    bqkv: list  # per layer: (stacked q/k/v bias or None,); or []
    wgate_up: list  # per layer: (stacked gate/up weight,); or []
    bgate_up: list  # per layer: (stacked gate/up bias or None,); or []

    @property
    def rows_cap(self) -> int:
        return self.tok.shape[0]

    @property
    def groups_cap(self) -> int:
        return self.pk[0].shape[0]

    @property
    def prompt_slots_cap(self) -> int:
        return self.pk[0].shape[2]

    @property
    def slots_cap(self) -> int:
        """Response slots."""
        return self.rk[0].shape[2]

    @property
    def steps_cap(self) -> int:
        return self.out_tok.shape[1]

    @property
    def caps(self) -> tuple[int, int, int, int, int]:
        return self.rows_cap, self.groups_cap, self.prompt_slots_cap, self.slots_cap, self.steps_cap


def _stack_room(ws: list[torch.Tensor]) -> torch.Tensor:
    """Room for the weights' rows one under another (``refresh_stacked`` fills it)."""
    return torch.empty((sum(w.shape[0] for w in ws), *ws[0].shape[1:]), dtype=ws[0].dtype, device=ws[0].device)


def _stacked_bias_room(ws: list[torch.Tensor], bs: list[torch.Tensor | None]) -> tuple:
    if all(b is None for b in bs):
        return (None,)
    return (
        torch.empty(sum(w.shape[0] for w in ws), dtype=next(b for b in bs if b is not None).dtype, device=ws[0].device),
    )


def allocate(
    layout: Layout,
    weights: list[LayerWeights],
    *,
    rows: int,
    groups: int,
    prompt_slots: int,
    slots: int,
    steps: int,
    vocab: int,
    tokenizer_vocab: int,
    mask_unused_vocab: bool,
    dtype: torch.dtype,
    device: torch.device,
    stacked: bool,
) -> State:
    """Zero-filled buffers for the given capacities. Zero K/V: masked slots get weight exactly 0 in
    attention, and 0 * (finite) stays 0."""
    kv, head_dim = layout.kv_heads, layout.head_dim
    zeros = lambda n, s: torch.zeros((n, kv, s, head_dim), dtype=dtype, device=device)  # noqa: E731
    bias = torch.zeros(vocab, dtype=torch.float32, device=device)
    if mask_unused_vocab and tokenizer_vocab < vocab:
        bias[tokenizer_vocab:] = float("-inf")
    long: dict[str, Any] = dict(dtype=torch.long, device=device)
    wqkv, bqkv, wgate_up, bgate_up = [], [], [], []
    if stacked:
        for w in weights:
            wqkv.append((_stack_room([w.wq, w.wk, w.wv]),))
            bqkv.append(_stacked_bias_room([w.wq, w.wk, w.wv], [w.bq, w.bk, w.bv]))
            wgate_up.append((_stack_room([w.w_gate, w.w_up]),))
            bgate_up.append(_stacked_bias_room([w.w_gate, w.w_up], [w.b_gate, w.b_up]))
    layers = layout.layers
    return State(
        pk=[zeros(groups, prompt_slots) for _ in range(layers)],
        pv=[zeros(groups, prompt_slots) for _ in range(layers)],
        rk=[zeros(rows, slots) for _ in range(layers)],
        rv=[zeros(rows, slots) for _ in range(layers)],
        tok=torch.zeros(rows, **long),
        pos=torch.zeros(rows, **long),
        grp=torch.zeros(rows, **long),
        start=torch.zeros(rows, **long),
        row_id=torch.full((rows,), rows, **long),
        live=torch.zeros(rows, dtype=torch.int32, device=device),
        runs=torch.zeros((2, rows), dtype=torch.int32, device=device),
        crow=torch.arange(rows, **long),
        plen=torch.zeros(1, **long),
        slot=torch.zeros(1, **long),
        step=torch.zeros(1, **long),
        noise=torch.ones((0, vocab), dtype=torch.float32, device=device),
        seed=torch.zeros(1, **long),
        temperature=torch.ones(1, dtype=torch.float32, device=device),
        top_p=torch.ones(1, dtype=torch.float32, device=device),
        vocab_bias=bias,
        out_tok=torch.zeros((rows + 1, steps), **long),
        out_lp=torch.zeros((rows + 1, steps), dtype=torch.float32, device=device),
        wqkv=wqkv,
        bqkv=bqkv,
        wgate_up=wgate_up,
        bgate_up=bgate_up,
    )


def ensure_noise(st: State) -> torch.Tensor:
    """The noise buffer at full size, allocated on first need: where the sampling kernel makes its own
    noise, only top-p (or the SDPA path) reads a noise tensor, and rows x vocabulary float32 is 100-155
    MB at 256 rows. Allocated once for the state's life, so graphs captured after it keep its address."""
    if st.noise.shape[0] < st.rows_cap:
        st.noise = torch.ones((st.rows_cap, st.noise.shape[1]), dtype=st.noise.dtype, device=st.noise.device)
    return st.noise


def _cat_bias(ws: Sequence[torch.Tensor], bs: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
    parts = [
        b if b is not None else torch.zeros(w.shape[0], dtype=out.dtype, device=out.device) for w, b in zip(ws, bs)
    ]
    torch.cat(parts, out=out)


@torch.no_grad()
def refresh_stacked(st: State, weights: list[LayerWeights]) -> None:
    """Copy the model's current q/k/v and gate/up weights (and biases) into the stacked buffers (in place:
    the captured graphs keep reading the same memory)."""
    for w, (qkv,), (bqkv,), (gate_up,), (bgate_up,) in zip(weights, st.wqkv, st.bqkv, st.wgate_up, st.bgate_up):
        torch.cat([w.wq, w.wk, w.wv], out=qkv)
        torch.cat([w.w_gate, w.w_up], out=gate_up)
        if bqkv is not None:
            _cat_bias([w.wq, w.wk, w.wv], [w.bq, w.bk, w.bv], bqkv)
        if bgate_up is not None:
            _cat_bias([w.w_gate, w.w_up], [w.b_gate, w.b_up], bgate_up)
