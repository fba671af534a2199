"""Multi-turn rollouts: the engine samples, the environment answers, the engine continues.

``Episodes.generate`` samples ``params.n`` first turns per row (one engine call, as a single-turn rollout
does), then, round after round, asks the environment about every unfinished conversation (their steps,
tool calls included, run in a thread pool) and sends every conversation that goes on back to the
engine in one call: the conversation's text so far (prompt, the model's turns and the environment's
messages, as rendered), one sample each, each with its own seed (``prompt_seeds``). In such a call
(one sample per prompt) the in-process ``hf`` engine draws each prompt's sample from its seed alone,
so one call per round gives the tokens that one call per row gave (``one_call_per_round=False``),
greedy or sampled; ``hf-fast`` does so greedy, while its sampled draws depend on the chunk a
conversation is decoded in. Engines with
a ``continuing()`` context (``hf-fast``) keep, for the conversations' duration, the K/V of each
context they prefilled and prefill a later turn's context only past the part they hold. A
conversation ends when the environment says so, when the model's turn is cut at
``max_new_tokens``, at ``max_turns`` model turns or at ``max_tokens`` tokens after the prompt (the
last three end it with ``finish_reason`` ``"length"``).

Each conversation comes back as one ``Completion``: ``text`` everything after the prompt (every
turn, so rollout dumps show them all), ``meta["pieces"]`` the same text as ``(text, by the model)``
pieces, ``meta["messages"]`` the conversation, ``meta["turns"]`` and ``meta["reward_fields"]``.
``tokenize_episodes`` tokenises a batch of them piece by piece: the loss mask holds only the
model's own pieces (the single-turn tokenisation when a conversation is one model turn).

Rendering: with a chat prompt the conversation is the chat template's (the tools' schemas passed
as ``tools``), and the text between two model turns is what the template adds after the model's
turn; with a text prompt (base models) the tool format writes the results into the text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from rlvr.engines.base import Completion, Engine, SamplingParams
from rlvr.environments.base import EnvStep
from rlvr.tokens import decode_texts, encode_texts
from rlvr.training.tokenize import pad_token_id, tokenize_from_pieces

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlvr.environments.base import Environment
    from rlvr.environments.formats import ToolFormat
    from rlvr.task.example import Example
    from rlvr.task.prompts import Prompt


class RenderError(ValueError):
    """A chat template that rewrites earlier turns, so a conversation cannot be continued as text."""


class TextRenderer:
    """Conversations of a text prompt: the prompt's text, then the turns as written; a tool message
    appears as the tool format writes its result, any other message as its content."""

    def __init__(self, fmt: ToolFormat | None = None) -> None:
        self.fmt = fmt

    def prompt(self, messages: list[dict]) -> str:
        return "".join(m["content"] for m in messages)

    def after(self, conversation: list[dict], new: list[dict]) -> str:
        render = self.fmt.render_result if self.fmt is not None else None
        return "".join(
            render(m["content"]) if m["role"] == "tool" and render is not None else m["content"] for m in new
        )


class ChatRenderer:
    """Conversations of a chat prompt, rendered by the tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools: list[dict | Callable] | None = list(tools) if tools else None

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return cast(str, text)

    def prompt(self, messages: list[dict]) -> str:
        return self._render(messages, True)

    def after(self, conversation: list[dict], new: list[dict]) -> str:
        """The text between the model's last turn (``conversation[-1]``) and its next one: the template's
        end of that turn, ``new`` and the next turn's header."""
        head = self._render(conversation[:-1], True) + conversation[-1]["content"]
        closed = self._render(conversation, False)
        full = self._render(conversation + new, True)
        if not closed.startswith(head) or not full.startswith(closed):
            raise RenderError(
                "the chat template renders earlier turns differently once a conversation goes on, so rlvr "
                "cannot continue it as text; use a template that appends turns (e.g. without reasoning "
                "stripping) or env.name single_turn"
            )
        return full[len(head) :]


def _seed(base: int, *parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr((base, *parts)).encode()).digest()[:8], "little") >> 2


@dataclass
class _Episode:
    row: int
    sample: int
    messages: list[dict]
    pieces: list[tuple[str, bool]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    turns: int = 0
    n_tokens: int = 0
    finish_reason: str | None = None
    reward_fields: dict = field(default_factory=dict)

    def completion(self) -> Completion:
        return Completion(
            text="".join(text for text, _ in self.pieces),
            token_ids=self.token_ids,
            finish_reason=self.finish_reason or "stop",
            meta={
                "pieces": self.pieces,
                "messages": self.messages,
                "turns": self.turns,
                "reward_fields": self.reward_fields,
            },
        )


class Episodes:
    """A run's multi-turn sampling: ``open`` renders the opening of rows, ``generate`` plays them out.

    The prompt texts ``open`` returns stand for their conversations: ``generate`` takes them back (from
    the trainer's rollouts, ``_fill_groups`` or validation) and finds each one's opening messages."""

    def __init__(
        self,
        env: Environment,
        tokenizer: PreTrainedTokenizerBase,
        renderer: TextRenderer | ChatRenderer,
        max_turns: int,
        max_tokens: int,
        one_call_per_round: bool = True,
        tool_threads: int = 16,
    ) -> None:
        self.env, self.tokenizer, self.renderer = env, tokenizer, renderer
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.one_call_per_round = one_call_per_round
        """Send a round's later turns to the engine in one call (off: one call per row, as before; the
        in-process engines give the same tokens either way, see the module docstring)."""
        self.tool_threads = tool_threads
        """Conversations whose environment step (tool calls) runs at once, at most."""
        self.openings: dict[str, list[dict]] = {}

    def open(self, rows: Sequence[Example], messages: Sequence[list[dict]]) -> list[str]:
        """The prompt text of each row (``messages``: what the run's prompt makes of it)."""
        prompts = []
        for row, m in zip(rows, messages, strict=True):
            opening = self.env.reset(row, [dict(x) for x in m])
            text = self.renderer.prompt(opening)
            self.openings[text] = opening
            prompts.append(text)
        return prompts

    def render(self, rows: Sequence[Example], prompt: Prompt) -> list[str]:
        """The opening of each row's conversation under ``prompt`` (a bound prompt): what the engine is given."""
        return self.open(rows, [prompt.example_messages(row) for row in rows])

    def engine(self, engine: Engine) -> EpisodeEngine:
        """``engine`` playing whole conversations for every prompt it is given."""
        return EpisodeEngine(engine, self)

    def generate(self, engine: Engine, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        """Per prompt (an ``open`` text), ``params.n`` conversations sampled by ``engine`` (module docstring)."""

        env = self.env
        opening = [self.openings.get(p) or [{"role": "user", "content": p}] for p in prompts]
        params = dataclasses.replace(params, stop=tuple(dict.fromkeys((*params.stop, *env.stop))))
        episodes = [
            [_Episode(i, j, [dict(m) for m in opening[i]]) for j in range(params.n)] for i in range(len(prompts))
        ]
        live = [e for group in episodes for e in group]
        continuing = getattr(engine, "continuing", None)  # hf-fast: later turns reuse the K/V of earlier ones
        with continuing() if continuing is not None else contextlib.nullcontext():
            self._play(engine, prompts, params, live)
        return [[e.completion() for e in group] for group in episodes]

    def _play(self, engine: Engine, prompts: list[str], params: SamplingParams, live: list[_Episode]) -> None:
        tokenizer = self.tokenizer
        turn_completions = [c for group in engine.generate(prompts, params) for c in group]
        base = params.seed if params.seed is not None else 0
        while live:
            going: list[_Episode] = []
            for e, c in zip(live, turn_completions, strict=True):
                e.turns += 1
                e.pieces.append((c.text, True))
                e.token_ids.extend(c.token_ids)
                e.n_tokens += len(c.token_ids)
                e.messages.append({"role": "assistant", "content": c.text})
                if c.finish_reason == "length":
                    e.finish_reason = "length"
            asked = [e for e in live if e.finish_reason is None]
            for e, step in zip(asked, self._steps(asked)):
                e.reward_fields.update(step.reward_fields)
                if step.done:
                    e.finish_reason = "stop"
                    continue
                text = self.renderer.after(e.messages, step.messages)
                e.messages.extend(step.messages)
                ids = encode_texts(tokenizer, [text])[0]
                e.pieces.append((text, False))
                e.token_ids.extend(ids)
                e.n_tokens += len(ids)
                if e.turns >= self.max_turns or e.n_tokens >= self.max_tokens:
                    e.finish_reason = "length"
                    continue
                going.append(e)
            if not going:
                break
            contexts = [prompts[e.row] + "".join(text for text, _ in e.pieces) for e in going]
            row_seeds = params.prompt_seeds
            seeds = tuple(_seed(row_seeds[e.row] if row_seeds is not None else base, e.sample, e.turns) for e in going)
            budget = max(1, min(params.max_new_tokens, self.max_tokens - min(e.n_tokens for e in going)))
            turn = dataclasses.replace(
                params, n=1, max_new_tokens=budget, seed=_seed(base, "turn", going[0].turns), prompt_seeds=seeds
            )
            answers = self._round(engine, going, contexts, turn)
            # One budget serves the whole call: no turn may run past its own conversation's.
            turn_completions = [_cap(c, self.max_tokens - e.n_tokens, tokenizer) for e, c in zip(going, answers)]
            live = going

    def _steps(self, asked: list[_Episode]) -> list[EnvStep]:
        """The environment's answer to each conversation's newest turn, the conversations' steps run
        concurrently: a slow tool call (a sandboxed program) then holds up one round by its own time,
        not by the sum over the conversations."""
        if len(asked) <= 1:
            return [self.env.step(e.messages) for e in asked]
        with ThreadPoolExecutor(max_workers=min(len(asked), self.tool_threads)) as pool:
            return list(pool.map(lambda e: self.env.step(e.messages), asked))

    def _round(
        self, engine: Engine, going: list[_Episode], contexts: list[str], turn: SamplingParams
    ) -> list[Completion]:
        """One later turn of every conversation in ``going``: one engine call over them all, or with
        ``one_call_per_round`` off one call per row (the rows' conversations in each)."""
        if self.one_call_per_round:
            return [group[0] for group in engine.generate(contexts, turn)]
        seeds = cast(tuple[int, ...], turn.prompt_seeds)
        answers: list[Completion] = []
        for row in dict.fromkeys(e.row for e in going):
            mine = [k for k, e in enumerate(going) if e.row == row]
            own = dataclasses.replace(turn, prompt_seeds=tuple(seeds[k] for k in mine))
            answers += [group[0] for group in engine.generate([contexts[k] for k in mine], own)]
        return answers  # ``going`` holds each row's conversations together, so this is its order


class EpisodeEngine:
    """An engine whose completions are whole conversations (``Episodes.generate``); weights go to the
    engine it wraps."""

    def __init__(self, inner: Engine, episodes: Episodes) -> None:
        self.inner, self.episodes = inner, episodes

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        return self.episodes.generate(self.inner, prompts, params)

    def sync_weights(self, model: torch.nn.Module) -> dict:
        return self.inner.sync_weights(model)

    def close(self) -> None:
        self.inner.close()


def _cap(c: Completion, budget: int, tokenizer: PreTrainedTokenizerBase) -> Completion:
    if len(c.token_ids) <= budget:
        return c

    ids = c.token_ids[:budget]
    return Completion(decode_texts(tokenizer, [ids])[0], ids, "length", None, c.meta)


def tokenize_episodes(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], groups: list[list[Completion]]
) -> dict[str, torch.Tensor]:
    """``rlvr.engines.rollouts.tokenize_groups`` for conversations: every piece tokenised on its own,
    the loss mask on the model's pieces only."""

    flat = [c for g in groups for c in g]
    pieces: list[list[tuple[str, bool]]] = [c.meta.get("pieces") or [(c.text, True)] for c in flat]
    texts = [text for p in pieces for text, _ in p]
    encoded = iter(encode_texts(tokenizer, texts)) if texts else iter([])
    piece_ids = [[(next(encoded), trained) for _, trained in p] for p in pieces]
    prompt_ids = encode_texts(tokenizer, prompts)
    owner = [i for i, g in enumerate(groups) for _ in g]
    return tokenize_from_pieces([prompt_ids[i] for i in owner], piece_ids, pad_token_id(tokenizer))


def episode_metrics(completions: list[Completion]) -> dict[str, Any]:
    """``train/turns`` (model turns per conversation), ``train/tool_calls`` and ``train/tool_errors``
    (per conversation, where the environment reports them)."""
    n = max(1, len(completions))
    out: dict[str, Any] = {"train/turns": sum(c.meta.get("turns", 1) for c in completions) / n}
    for key in ("tool_calls", "tool_errors"):
        values = [c.meta.get("reward_fields", {}).get(key) for c in completions]
        if any(v is not None for v in values):
            out[f"train/{key}"] = sum(v or 0 for v in values) / n
    return out


def episode_fields(fields: dict, completion: Completion) -> dict:
    """A reward function's keyword arguments for a conversation: the row's, plus ``conversation`` (every
    message) and ``env`` (the environment's reward fields)."""
    return {**fields, "conversation": completion.meta["messages"], "env": completion.meta["reward_fields"]}
