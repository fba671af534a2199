"""In-process batched sampling with transformers, sharing the policy's weights.

``HFEngine`` runs its own decode loop instead of ``model.generate`` so that it controls what RL
rollouts need:

* **Left padding.** Prompts of a chunk are right-aligned; the attention mask hides the padding and
  position ids count only real tokens, so a padded prompt sees the same positions as an unpadded one.
* **One prefill per prompt.** Each prompt is prefilled once; its KV cache rows are then repeated
  ``n`` times (``DynamicCache.batch_repeat_interleave``) and the ``n`` samples decode from there.
* **Seeded sampling.** A ``torch.Generator`` seeded from ``params.seed`` drives every draw, so the
  same seed, prompts, weights and ``max_batch_size`` give the same batch (the chunk layout decides
  which draws a row gets); the ``n`` rows of a prompt draw independently. A call of one sample per
  prompt with ``params.prompt_seeds`` (a multi-turn round: one per conversation) gives each prompt its
  own generator (seeded as a chunk of that prompt alone would be), which draws Exp(1) noise at every
  step, and the row takes the exponential race over it: its sample is then the same whatever other
  prompts, chunks or retired rows the call holds, so a round batches every conversation in one call.
  Calls of several samples per prompt (single-turn rollouts, first turns) keep ``torch.multinomial``
  on the chunk's generator, and so the draws they always had.
  Temperature 0 is greedy (argmax); top-p keeps the smallest set of tokens whose mass reaches p.
* **Per-sequence stops.** EOS ends a row. Stop strings are checked on the decoded *tail* of each row's
  new tokens (enough tokens to hold the longest stop string), so the check costs O(1) per token; on a
  hit the text is cut right after (or before, when ``include_stop_str_in_output`` is off) the first
  occurrence. Only rows whose newest token holds the last character of a stop string are decoded at
  all, which keeps the host-side work small for stops such as ``</answer>``. The token ids keep every
  token up to the one that completed the stop string.
* **Retiring finished rows.** Finished rows are dropped from the batch and the cache once they make up
  ``compact_fraction`` of the rows being computed, and the loop ends when every row has finished.
* **Log-probs for free.** Each sampled token's log-probability is the log-softmax of the
  temperature-1 logits over the full vocabulary, i.e. what the trainer's
  ``log_softmax(model(...).logits)`` computes for the same token.

Models whose embedding matrix is larger than the tokenizer (OLMo pads its vocab to a multiple of
128) never sample ids the tokenizer cannot decode: those logits are masked before sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlvr.engines.base import Completion, SamplingParams
from rlvr.engines.sampling import (
    chunk_generator,
    eos_token_ids,
    find_stop,
    generate_in_chunks,
    sample_next,
    stop_window_tokens,
    truncate_at_stop,
)
from rlvr.tokens import decode_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@torch.inference_mode()
def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log p(token_t | tokens < t) for a right-padded batch, shape (B, T-1).

    Positions whose target is padding are 0. Used for the weight-sync probe and by tests.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return lp * attention_mask[:, 1:].to(lp.dtype)


class HFEngine:
    """Batched sampling with a transformers causal LM in this process, on the model's device.

    The engine holds a reference to ``model`` (no copy), so a trainer's updates are visible at once and
    ``sync_weights`` does nothing. ``max_batch_size`` bounds the rows decoded together (prompts × n);
    a prompt's ``n`` samples always share one chunk. ``filter_stop_checks`` decodes, for stop strings,
    only the rows whose newest token can complete one (``stop_candidates``); False decodes every live
    row each step: slower, the same completions, a reference for the filter.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_size: int = 64,
        compact_fraction: float = 0.25,
        mask_unused_vocab: bool = True,
        filter_stop_checks: bool = True,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token = tokenizer.eos_token")
        # A transformers causal LM (or a PEFT model over one): its config and submodules are read by name.
        self.model: Any = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.compact_fraction = compact_fraction
        self.mask_unused_vocab = mask_unused_vocab
        self.filter_stop_checks = filter_stop_checks
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.stats = {"tokens": 0, "time": 0.0}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def stop_candidates(self, stops: tuple[str, ...]) -> set[int] | None:
        """Ids of the tokens that can complete one of ``stops``, or None to check every token.

        A stop string is completed by the token that produced its last character, so only rows whose
        newest token decodes to text holding that character need the (host-side) tail decode. This
        holds when every stop string ends in an ASCII character, which one byte-level token cannot
        split; otherwise, and with ``filter_stop_checks`` off, every row is checked.
        """
        if not self.filter_stop_checks or not stops or any(not s[-1].isascii() for s in stops):
            return None
        key = tuple(sorted(stops))
        cache = self.__dict__.setdefault("_candidate_cache", {})
        if key not in cache:
            last = {s[-1] for s in stops}
            pieces = decode_texts(self.tokenizer, [[i] for i in range(len(self.tokenizer))])
            cache[key] = {i for i, piece in enumerate(pieces) if any(c in piece for c in last)}
        return cache[key]

    def sync_weights(self, model: torch.nn.Module) -> dict:
        self.model = model
        return {"time/sync": 0.0}

    def close(self) -> None:
        pass

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        return generate_in_chunks(
            self,
            prompts,
            params,
            lambda idx, prompt_ids, generator: self._generate_chunk(
                prompt_ids, params, generator, self._prompt_generators(params, idx, generator)
            ),
        )

    def _prompt_generators(
        self, params: SamplingParams, idx: list[int], generator: torch.Generator
    ) -> list[torch.Generator] | None:
        """One generator per prompt of a chunk (``params.prompt_seeds``, one sample per prompt), else None
        (the chunk's own)."""
        if params.prompt_seeds is None or params.temperature == 0 or params.n > 1:
            return None
        return [chunk_generator(params, [i], generator, self.device) for i in idx]

    @torch.inference_mode()
    def _generate_chunk(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator,
        prompt_generators: list[torch.Generator] | None = None,
    ) -> list[list[Completion]]:
        from transformers import DynamicCache

        model, tok, device, n = self.model, self.tokenizer, self.device, params.n
        P, L = len(prompt_ids), max(len(p) for p in prompt_ids)
        input_ids = torch.full((P, L), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((P, L), dtype=torch.long)
        for r, ids in enumerate(prompt_ids):
            input_ids[r, L - len(ids) :] = torch.tensor(ids)
            mask[r, L - len(ids) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]
        next_pos = positions[:, -1] + 1
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
            next_pos = next_pos.repeat_interleave(n, dim=0)

        R, T = P * n, params.max_new_tokens
        vocab_limit = len(tok) if self.mask_unused_vocab else None
        stops = tuple(s for s in params.stop if s)
        window = stop_window_tokens(stops)
        candidates = self.stop_candidates(stops)
        lp_buf = torch.zeros((R, T), dtype=torch.float32, device=device)
        rows = torch.arange(R, device=device)  # global row id of each batch row
        live = list(range(R))  # global row ids, aligned with the batch
        alive = [True] * R  # per batch row
        generated: list[list[int]] = [[] for _ in range(R)]
        finish: list[str | None] = [None] * R
        stop_hit = [False] * R
        n_alive = R

        for step in range(T):
            noise = None
            if prompt_generators is not None:  # every row of every prompt draws, alive or not: see the docstring
                vocab = logits.shape[-1]
                draws = [torch.empty((n, vocab), device=device).exponential_(generator=g) for g in prompt_generators]
                noise = torch.cat(draws)[rows]
            tokens, lps = sample_next(logits, params.temperature, params.top_p, generator, vocab_limit, noise)
            lp_buf[rows, step] = lps
            host = tokens.tolist()
            check_rows = []
            for b, g in enumerate(live):
                if not alive[b]:
                    continue
                t = host[b]
                generated[g].append(t)
                if t in self.eos_ids:
                    finish[g] = "stop"
                elif stops and (candidates is None or t in candidates):
                    check_rows.append(b)
                    continue
                elif step + 1 == T:
                    finish[g] = "length"
            if check_rows:
                tails = decode_texts(tok, [generated[live[b]][-window:] for b in check_rows])
                for b, tail in zip(check_rows, tails):
                    g = live[b]
                    if find_stop(tail, stops) is not None:
                        finish[g], stop_hit[g] = "stop", True
                    elif step + 1 == T:
                        finish[g] = "length"
            for b, g in enumerate(live):
                if alive[b] and finish[g] is not None:
                    alive[b] = False
                    n_alive -= 1
            if n_alive == 0:
                break
            if len(live) - n_alive >= max(1, self.compact_fraction * len(live)):
                keep_b = [b for b in range(len(live)) if alive[b]]
                keep = torch.tensor(keep_b, device=device)
                cache.batch_select_indices(keep)
                tokens, mask, next_pos, rows = tokens[keep], mask[keep], next_pos[keep], rows[keep]
                live = [live[b] for b in keep_b]
                alive = [True] * len(live)
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
            next_pos = next_pos + 1

        lp_host = lp_buf.cpu()
        completions: list[list[Completion]] = [[] for _ in range(P)]
        texts = decode_texts(tok, [ids[:-1] if ids and ids[-1] in self.eos_ids else ids for ids in generated])
        for g in range(R):
            ids, text = generated[g], texts[g]
            row_logprobs = lp_host[g, : len(ids)].tolist()
            if stop_hit[g]:
                text, _ = truncate_at_stop(text, stops, params.include_stop_str_in_output)
            completions[g // n].append(
                Completion(text=text, token_ids=list(ids), finish_reason=finish[g] or "length", logprobs=row_logprobs)
            )
        return completions
