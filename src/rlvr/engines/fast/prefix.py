"""The K/V of contexts the engine prefilled, kept while a multi-turn rollout goes on.

Inside ``FastHFEngine.continuing()`` every context the engine read (a prompt and the completion's
tokens that were fed) is kept here with its token ids and its K/V (after the rotary embedding, so a
copy placed at other cache slots is valid as long as it keeps its positions, which count from the
prompt's first token). A later prompt that starts with the same tokens (a conversation's next turn: its
earlier context, the model's turn and the environment's message) takes the K/V of the longest shared
start and is prefilled only past it.

The K/V live in packed blocks, one per chunk's prompts and one per batch of finished rows, each a few
tensors a layer, so keeping or placing a batch's contexts costs a few gathers a layer rather than a
copy per row and layer; a context is a list of spans of blocks. Lookups bisect the contexts sorted by
their token ids (the kept context sharing the longest start with a prompt sorts next to it), a few
comparisons each rather than one per kept context. The store lives on the engine's device and is
dropped when the rollout ends or new weights arrive.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class KVBlock:
    """K and V of many tokens packed along the first dimension, per layer: (tokens, kv_heads, head_dim)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def gather(self, index: torch.Tensor) -> KVBlock:
        return KVBlock([k.index_select(0, index) for k in self.k], [v.index_select(0, index) for v in self.v])


Span = tuple[KVBlock, int, int]  # a block, the index of the first token in it, and how many tokens


@dataclass(eq=False)
class Prefix:
    """One kept context: its token ids and where their K/V are, in order."""

    key: tuple[int, ...]
    spans: list[Span]


def shared_start(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens two sequences share (bisected over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixStore:
    """Kept contexts, looked up by their leading tokens. An entry another prompt continued is dropped at
    the end of that call (its continuation is kept instead, and holds it)."""

    def __init__(self) -> None:
        self.entries: list[Prefix] = []
        self.continued: list[Prefix] = []
        self._sorted: list[Prefix] | None = None
        self._keys: list[tuple[int, ...]] = []

    def find(self, ids: list[int]) -> tuple[Prefix | None, int]:
        """The kept context sharing the most leading tokens with ``ids``, and how many it shares, at most
        ``len(ids) - 1``: a prompt's last token is always prefilled, for the logits of its first sample.
        Of the kept contexts, the one sharing the longest start with ``ids`` sorts next to it."""
        if self._sorted is None:
            self._sorted = sorted(self.entries, key=lambda e: e.key)
            self._keys = [e.key for e in self._sorted]
        query = tuple(ids)
        at = bisect.bisect_left(self._keys, query)
        best, shared = None, 0
        for e in self._sorted[max(0, at - 1) : at + 1]:
            n = min(shared_start(e.key, query), len(query) - 1)
            if n > shared:
                best, shared = e, n
        if best is not None:
            self.continued.append(best)
        return best, shared

    def add(self, ids: list[int], spans: list[Span]) -> None:
        self.entries.append(Prefix(tuple(ids), spans))
        self._sorted = None

    def end_call(self) -> None:
        """Drop the entries that this call's prompts continued, and repack what the others still use."""
        gone = {id(e) for e in self.continued}
        self.entries = [e for e in self.entries if id(e) not in gone]
        self.continued = []
        self._sorted = None
        self._repack()

    def _repack(self) -> None:
        """Copy the spans the kept entries use out of every block that holds more than they use, so a
        block's memory goes with the last entry that needs it rather than with the last entry of its batch."""
        used: dict[int, tuple[KVBlock, dict[tuple[int, int], None]]] = {}
        for e in self.entries:
            for block, first, count in e.spans:
                used.setdefault(id(block), (block, {}))[1][first, count] = None
        moved: dict[int, tuple[KVBlock, dict[tuple[int, int], int]]] = {}
        for block, spans in used.values():
            if sum(count for _, count in spans) >= block.tokens:
                continue
            index: list[int] = []
            at: dict[tuple[int, int], int] = {}
            for first, count in spans:
                at[first, count] = len(index)
                index.extend(range(first, first + count))
            moved[id(block)] = (block.gather(torch.tensor(index, dtype=torch.long, device=block.k[0].device)), at)
        if moved:
            for e in self.entries:
                e.spans = [
                    (moved[id(b)][0], moved[id(b)][1][f, c], c) if id(b) in moved else (b, f, c) for b, f, c in e.spans
                ]

    @property
    def tokens(self) -> int:
        """Tokens of the kept contexts (a prompt's K/V, shared by its samples, is held once)."""
        return sum(len(e.key) for e in self.entries)
