"""In-process batched sampling with transformers, sharing the policy's weights.

``HFEngine`` runs its own decode loop instead of ``model.generate`` so that it controls what RL
rollouts need:

* **Left padding.** Prompts of a chunk are right-aligned; the attention mask hides the padding and
  position ids count only real tokens, so a padded prompt sees the same positions as an unpadded one.
* **One prefill per prompt.** Each prompt is prefilled once; its KV cache rows are then repeated
  ``n`` times (``DynamicCache.batch_repeat_interleave``) and the ``n`` samples decode from there.
* **Seeded sampling.** A ``torch.Generator`` seeded from ``params.seed`` drives every draw, so the
  same seed, prompts, weights and ``max_batch_size`` give the same batch (the chunk layout decides
  which draws a row gets); the ``n`` rows of a prompt draw independently.
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

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rlvr.engines.base import Completion, SamplingParams
from rlvr.tokens import decode_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlvr.engines.fast.engine import FastHFEngine


def find_stop(text: str, stops: tuple[str, ...] | list[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any stop string in ``text`` as ``(index, stop)``, or None."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def truncate_at_stop(text: str, stops: tuple[str, ...] | list[str], include_stop: bool) -> tuple[str, bool]:
    """Cut ``text`` at its first stop string; returns ``(text, stopped)``.

    With ``include_stop`` the stop string is kept (the text ends right after it), otherwise the text
    ends right before it.
    """
    hit = find_stop(text, stops)
    if hit is None:
        return text, False
    i, s = hit
    return (text[: i + len(s)] if include_stop else text[:i]), True


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    vocab_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns ``(tokens (B,), logprobs (B,))``.

    ``logits`` (B, V) are raw model logits. ``logprobs`` are the sampled tokens' log-probabilities
    under the temperature-1 distribution over the full vocabulary, whatever the sampling settings.
    ``vocab_limit`` masks ids ``>= vocab_limit`` out of the sampling (never out of the log-probs).
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    scores = logits
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        scores = logits.clone()
        scores[:, vocab_limit:] = float("-inf")
    if temperature == 0:
        tokens = scores.argmax(dim=-1)
    else:
        scores = scores / temperature
        if top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            # Drop a token when the mass before it already reaches top_p; the top token always stays.
            drop = (cum - sorted_scores.softmax(dim=-1)) >= top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
        probs = scores.softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@torch.inference_mode()
def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log p(token_t | tokens < t) for a right-padded batch, shape (B, T-1).

    Positions whose target is padding are 0. Used for the weight-sync probe and by tests.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return lp * attention_mask[:, 1:].to(lp.dtype)


def seeded_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (a fresh random seed when None)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def chunk_generator(
    params: SamplingParams, prompt_indices: list[int], shared: torch.Generator, device: torch.device
) -> torch.Generator:
    """The generator of one chunk: ``shared`` (seeded once per call from ``params.seed``), or, with
    ``params.prompt_seeds``, a fresh one seeded from the seeds of the chunk's prompts."""
    if params.prompt_seeds is None:
        return shared
    seeds = tuple(params.prompt_seeds[i] for i in prompt_indices)
    digest = hashlib.sha256(repr(seeds).encode()).digest()
    return seeded_generator(int.from_bytes(digest[:8], "little") >> 2, device)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt (no special tokens); an empty prompt is an error."""
    from rlvr.tokens import encode_texts

    encoded = encode_texts(tokenizer, prompts)
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} tokenizes to nothing; every prompt needs at least one token")
    return encoded


def eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end a sequence: the model's generation config, else the tokenizer's EOS."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = tokenizer.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


def longest_first(encoded: list[list[int]]) -> list[int]:
    """Prompt indices, longest first, so that chunks hold prompts of similar length (less padding)."""
    return sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))


def generate_in_chunks(
    engine: HFEngine | FastHFEngine,
    prompts: list[str],
    params: SamplingParams,
    run_chunk: Callable[[list[int], list[list[int]], torch.Generator], list[list[Completion]]],
) -> list[list[Completion]]:
    """The driver both in-process engines share: encode the prompts, cut them longest first into
    chunks of at most ``engine.max_batch_size`` rows (prompts x samples), call
    ``run_chunk(prompt_indices, prompt_ids, generator)`` for each in eval mode, restore the model's
    mode, and count tokens and time in ``engine.stats``. Results come back in the prompts' order."""
    if not prompts:
        return []
    t0 = time.perf_counter()
    params.for_prompts(prompts)
    generator = seeded_generator(params.seed, engine.device)
    encoded = encode_prompts(engine.tokenizer, prompts)
    order = longest_first(encoded)
    per_chunk = max(1, engine.max_batch_size // params.n)
    results: list[list[Completion] | None] = [None] * len(prompts)
    was_training = engine.model.training
    engine.model.eval()
    try:
        for start in range(0, len(order), per_chunk):
            idx = order[start : start + per_chunk]
            chunk_gen = chunk_generator(params, idx, generator, engine.device)
            for i, comps in zip(idx, run_chunk(idx, [encoded[i] for i in idx], chunk_gen)):
                results[i] = comps
    finally:
        engine.model.train(was_training)
    engine.stats["tokens"] += sum(len(c.token_ids) for group in results for c in group)
    engine.stats["time"] += time.perf_counter() - t0
    return results


def _stop_window_tokens(stops: Sequence[str]) -> int:
    # Every token decodes to at least one byte, so the last len(stop in bytes) tokens hold any
    # occurrence that the newest token completed; +2 leaves room for a split multi-byte character.
    return max((len(s.encode("utf-8")) for s in stops), default=0) + 2


class HFEngine:
    """Batched sampling with a transformers causal LM in this process, on the model's device.

    The engine holds a reference to ``model`` (no copy), so a trainer's updates are visible at once and
    ``sync_weights`` does nothing. ``max_batch_size`` bounds the rows decoded together (prompts × n);
    a prompt's ``n`` samples always share one chunk.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_size: int = 64,
        compact_fraction: float = 0.25,
        mask_unused_vocab: bool = True,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token = tokenizer.eos_token")
        # A transformers causal LM (or a PEFT model over one): its config and submodules are read by name.
        self.model: Any = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.compact_fraction = compact_fraction
        self.mask_unused_vocab = mask_unused_vocab
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.stats = {"tokens": 0, "time": 0.0}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _stop_candidates(self, stops: tuple[str, ...]) -> set[int] | None:
        """Ids of the tokens that can complete one of ``stops``, or None to check every token.

        A stop string is completed by the token that produced its last character, so only rows whose
        newest token decodes to text holding that character need the (host-side) tail decode. This
        holds when every stop string ends in an ASCII character, which one byte-level token cannot
        split; otherwise every row is checked.
        """
        if not stops or any(not s[-1].isascii() for s in stops):
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
            lambda idx, prompt_ids, generator: self._generate_chunk(prompt_ids, params, generator),
        )

    @torch.inference_mode()
    def _generate_chunk(
        self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator
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
        window = _stop_window_tokens(stops)
        candidates = self._stop_candidates(stops)
        lp_buf = torch.zeros((R, T), dtype=torch.float32, device=device)
        rows = torch.arange(R, device=device)  # global row id of each batch row
        live = list(range(R))  # global row ids, aligned with the batch
        alive = [True] * R  # per batch row
        generated: list[list[int]] = [[] for _ in range(R)]
        finish: list[str | None] = [None] * R
        stop_hit = [False] * R
        n_alive = R

        for step in range(T):
            tokens, lps = sample_next(logits, params.temperature, params.top_p, generator, vocab_limit)
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
