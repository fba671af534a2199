"""Host-side checks of a chunk's rows: EOS, stop strings and length limits, applied to tokens read from the
device a sync period late, with the same results as checking after every token.

The device samples ahead; every ``sync_every`` steps the engine starts an asynchronous copy of the new
tokens (``fetch``) and examines the copy started at the previous sync point (``examine``) while the
device runs on. A row found finished is cut exactly where it ended (the tokens it sampled after its
end are dropped), so text, token ids, log-probs and finish reasons equal per-token checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlvr.engines.base import Completion
from rlvr.engines.sampling import find_stop, stop_window_tokens, truncate_at_stop
from rlvr.tokens import decode_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    # A fetched span: (first token index, the tokens on the host, the event that marks the copy done or None).
    Pending = tuple[int, torch.Tensor, torch.cuda.Event | None]


class RowChecks:
    """What the host knows of rows [0, R): tokens examined so far, finish reasons and where each ends."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        rows: int,
        max_new_tokens: int,
        stops: tuple[str, ...],
        eos_ids: set[int],
        limits: list[int] | None,
        stats: dict,
    ) -> None:
        self.tok = tokenizer
        self.stops = stops
        self.window = stop_window_tokens(stops)
        self.eos_ids = eos_ids
        self.stats = stats
        self.generated: list[list[int]] = [[] for _ in range(rows)]
        self.n_done = [0] * rows  # tokens of the row already examined
        self.finish: list[str | None] = [None] * rows
        self.stop_hit = [False] * rows
        self.end = [max_new_tokens] * rows  # tokens kept
        self.limit = list(limits) if limits is not None else [max_new_tokens] * rows
        if len(self.limit) != rows or min(self.limit) < 1:
            raise ValueError("row_max_new_tokens needs n limits >= 1 for every prompt")

    def unfinished(self) -> list[int]:
        return [g for g, f in enumerate(self.finish) if f is None]

    def all_finished(self) -> bool:
        return all(f is not None for f in self.finish)

    def fetch(self, out_tok: torch.Tensor, upto: int) -> Pending | None:
        """Start copying the sampled tokens [lo, upto) of ``out_tok`` (rows, steps) to the host, lo being the
        first token some unfinished row has not examined; returns the pending read (None when every row
        is done)."""
        live = self.unfinished()
        if not live:
            return None
        lo = min(self.n_done[g] for g in live)
        cols = out_tok[: len(self.finish), lo:upto]
        if cols.device.type != "cuda":
            return lo, cols.clone(), None
        host = torch.empty(cols.shape, dtype=cols.dtype, pin_memory=True)
        host.copy_(cols, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return lo, host, done

    def examine(self, pending: Pending | None) -> None:
        """Read a fetched span of new tokens of the unfinished rows; apply EOS, stop strings and the length
        limit exactly as checking after every token would."""
        if pending is None:
            return
        lo, host, done = pending
        if done is not None:
            done.synchronize()
        self.stats["host_syncs"] += 1
        live = self.unfinished()
        if not live:
            return
        upto = lo + host.shape[1]
        host = host.tolist()  # type: ignore[assignment]  # the span's rows as lists of ids from here on
        spans = []  # (row, first new token, end of the tokens to stop-check)
        for g in live:
            a = self.n_done[g]
            new = host[g][a - lo : min(self.limit[g], upto) - lo]
            cut = next((a + j for j, t in enumerate(new) if t in self.eos_ids), None)
            self.generated[g].extend(new if cut is None else new[: cut - a + 1])
            self.n_done[g] = a + len(new)
            if cut is not None:
                self.finish[g], self.end[g] = "stop", cut + 1
            elif self.n_done[g] >= self.limit[g]:
                self.finish[g], self.end[g] = "length", self.limit[g]
            body_end = self.n_done[g] if cut is None else cut
            if self.stops and body_end > a:
                spans.append((g, a, body_end))
        if not spans:
            return
        # One batched decode of each row's new span (with the window before it) finds the rows that may
        # hold a stop; only those are scanned token by token to find where it completed.
        window = self.window
        texts = decode_texts(self.tok, [self.generated[g][max(0, a - window + 1) : e] for g, a, e in spans])
        for (g, a, e), text in zip(spans, texts):
            if find_stop(text, self.stops) is None:
                continue
            seq = self.generated[g]
            tails = decode_texts(self.tok, [seq[max(0, s + 1 - window) : s + 1] for s in range(a, e)])
            for s, tail in zip(range(a, e), tails):
                if find_stop(tail, self.stops) is not None:
                    self.finish[g], self.stop_hit[g], self.end[g] = "stop", True, s + 1
                    break

    def completions(self, logprobs: torch.Tensor, n: int, include_stop: bool) -> list[list[Completion]]:
        """The chunk's results, ``n`` per prompt; ``logprobs`` (rows, steps) on the host."""
        rows = len(self.finish)
        kept = [self.generated[g][: self.end[g]] for g in range(rows)]
        eos = self.eos_ids
        texts = decode_texts(self.tok, [ids[:-1] if ids and ids[-1] in eos else ids for ids in kept])
        out: list[list[Completion]] = [[] for _ in range(rows // n)]
        for g, (ids, text) in enumerate(zip(kept, texts)):
            if self.stop_hit[g]:
                text, _ = truncate_at_stop(text, self.stops, include_stop)
            out[g // n].append(
                Completion(
                    text=text,
                    token_ids=ids,
                    finish_reason=self.finish[g] or "length",
                    logprobs=logprobs[g, : len(ids)].tolist(),
                )
            )
        return out
