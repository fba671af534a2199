"""The K/V of contexts the engine prefilled, kept while a multi-turn rollout goes on.

Inside ``FastHFEngine.continuing()`` every prompt the engine prefills is kept here with its token ids
and its prompt-cache K/V (after the rotary embedding, so a copy placed at other cache slots is valid
as long as it keeps its positions, which count from the prompt's first token). A later prompt that
starts with the same tokens (a conversation's next turn: its earlier context, the model's turn and
the environment's message) takes the K/V of the longest shared start and is prefilled only past it.
The store lives on the engine's device and is dropped when the rollout ends or new weights arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Prefix:
    """One prefilled prompt: its tokens and, per layer, their K and V (kv_heads, tokens, head_dim)."""

    ids: torch.Tensor  # (tokens,) int64, on the host
    k: list[torch.Tensor]
    v: list[torch.Tensor]


class PrefixStore:
    """Prefilled prompts, looked up by their leading tokens. An entry another prompt continued is
    dropped at the end of that call (its continuation is kept instead, and holds it)."""

    def __init__(self) -> None:
        self.entries: list[Prefix] = []
        self.continued: list[Prefix] = []

    def find(self, ids: list[int]) -> tuple[Prefix | None, int]:
        """The kept prompt sharing the most leading tokens with ``ids``, and how many it shares, at most
        ``len(ids) - 1``: a prompt's last token is always prefilled, for the logits of its first sample."""
        t = torch.tensor(ids, dtype=torch.long)
        best, shared = None, 0
        for e in self.entries:
            m = min(len(e.ids), len(t) - 1)
            if m <= shared:
                continue
            differ = (e.ids[:m] != t[:m]).nonzero()
            n = int(differ[0, 0]) if len(differ) else m
            if n > shared:
                best, shared = e, n
        if best is not None:
            self.continued.append(best)
        return best, shared

    def add(self, ids: list[int], k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.entries.append(Prefix(torch.tensor(ids, dtype=torch.long), k, v))

    def end_call(self) -> None:
        """Drop the entries that this call's prompts continued."""
        gone = {id(e) for e in self.continued}
        self.entries = [e for e in self.entries if id(e) not in gone]
        self.continued = []

    @property
    def tokens(self) -> int:
        """Tokens whose K/V the store holds."""
        return sum(len(e.ids) for e in self.entries)
