"""What the in-process engines share around their decode loops: stop strings, the sampling rule, seeded
generators, and the driver that cuts a batch of prompts into chunks (``generate_in_chunks``)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch

from rlvr.engines.base import Completion, SamplingParams
from rlvr.tokens import encode_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChunkedEngine(Protocol):
    """What ``generate_in_chunks`` reads of an engine (``HFEngine`` and ``FastHFEngine`` have it)."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    max_batch_size: int
    stats: dict

    @property
    def device(self) -> torch.device: ...


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
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns ``(tokens (B,), logprobs (B,))``.

    ``logits`` (B, V) are raw model logits. ``logprobs`` are the sampled tokens' log-probabilities
    under the temperature-1 distribution over the full vocabulary, whatever the sampling settings.
    ``vocab_limit`` masks ids ``>= vocab_limit`` out of the sampling (never out of the log-probs).
    ``noise`` (B, V) of Exp(1) draws, when given, picks each row's token by the exponential race
    (argmax p_i / E_i, a draw from p) instead of ``torch.multinomial`` on ``generator``: a row's token
    then depends on its own noise only, not on the other rows of the batch.
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
        if noise is not None:
            tokens = (scores - noise.clamp_min(1e-30).log()).argmax(dim=-1)
        else:
            probs = scores.softmax(dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


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
    engine: ChunkedEngine,
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
    done = cast(list[list[Completion]], results)  # every prompt sits in one chunk
    engine.stats["tokens"] += sum(len(c.token_ids) for group in done for c in group)
    engine.stats["time"] += time.perf_counter() - t0
    return done


def stop_window_tokens(stops: Sequence[str]) -> int:
    # Every token decodes to at least one byte, so the last len(stop in bytes) tokens hold any
    # occurrence that the newest token completed; +2 leaves room for a split multi-byte character.
    return max((len(s.encode("utf-8")) for s in stops), default=0) + 2
