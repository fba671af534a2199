"""``arith``: procedurally generated grade-school word problems with exact integer answers.

A problem is a chain of ``steps`` operations on one person's stock of one kind of object, told in
GSM8K's style ("Mia has 7 apples. She buys 5 more apples. Then she gives 3 apples to Tom. How many
apples does Mia have now?"). Every intermediate amount stays within ``0..max_value``; ``*`` and ``/``
use small factors (2-4) and ``/`` only divides evenly, so every answer is an exact integer.

The reference solution is a complete r1_zero response (the text that follows ``Assistant: <think>``)::

    " Mia starts with 7 apples. 7 + 5 = 12. 12 - 3 = 9. </think> <answer> 9 </answer>"

Knobs (``arith:steps=2,max_value=20,ops=+-``; values may arrive as strings):

- ``steps``: operations per problem (reasoning steps), >= 1.
- ``max_value``: the largest number any amount or operand may take (>= 4): the size of the numbers.
- ``ops``: which operations may appear, a subset of ``+-*/``.
- ``size``: problems per split when no ``limit`` is given.
- ``noise``: the share of reference solutions (0 to 1, default 0) that contain one slip: one
  intermediate result off by 1 or 2, carried through to a wrong final answer. The question and the
  ground truth never change. Supervised training on noisy solutions gives a model that usually knows
  the right step (greedy decoding is mostly right) but often samples a wrong one: the situation in
  which RL on the verified answer has the most to fix, as with a base model trained on imperfect
  rationales.
- ``format_noise``: the share of reference solutions (0 to 1, default 0) written with a near-miss
  format, ``</think><answer>`` without the space, which the r1_zero format rule rejects (reward 0)
  although the arithmetic is right. A model trained on them knows the answers but often writes them
  in a form the grader refuses: the first thing RL with a format-strict reward teaches.

- ``tool``: the share of reference solutions (0 to 1, default 0) that compute with the calculator tool
  (``rlvr.environments``, plain format) instead of by hand: after the opening sentence, one call
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "(7 + 5) - 3"}}</tool_call>``, its
  result ``<tool_response>9</tool_response>`` and the answer. These solutions never carry ``noise``
  (the tool does not slip): traces for a tool-use warm start.

Splits never overlap, whatever the seeds: a problem belongs to ``train``, ``validation`` or ``test``
by a hash of its question text, so no question appears under two splits. As in GSM8K, the same
small computation (say 7 + 5) can recur under different names, objects and wording; partitioning
by the arithmetic itself would withhold whole addition facts from training when numbers are small,
and the validation score would then measure memorised facts rather than reasoning. Each split is
drawn from its own seeded stream, so loading one split does not depend on loading another.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

from rlvr.task.example import DataError, Example

SPLITS = ("train", "validation", "test")
DEFAULT_SIZES = {"train": 5000, "validation": 500, "test": 500}
ALL_OPS = "+-*/"

NAMES = (
    "Mia",
    "Tom",
    "Ava",
    "Leo",
    "Emma",
    "Noah",
    "Lily",
    "Sam",
    "Zoe",
    "Ben",
    "Ella",
    "Max",
    "Nina",
    "Omar",
    "Ruth",
    "Ivan",
    "Kate",
    "Luis",
    "Jade",
    "Paul",
)
# (plural noun, whether it can be eaten): eating is one way to lose objects.
OBJECTS = (
    ("apples", True),
    ("cookies", True),
    ("oranges", True),
    ("cupcakes", True),
    ("marbles", False),
    ("stickers", False),
    ("pencils", False),
    ("books", False),
    ("coins", False),
    ("cards", False),
    ("shells", False),
    ("stamps", False),
)
PRONOUN = {
    name: ("she" if name in {"Mia", "Ava", "Emma", "Lily", "Zoe", "Ella", "Nina", "Ruth", "Kate", "Jade"} else "he")
    for name in NAMES
}

OPENINGS = ("{name} has {x} {obj}.", "{name} starts with {x} {obj}.", "{name} owns {x} {obj}.")
# Each phrasing of an operation names the operand as {k} and its object as {objk} (singular for 1);
# {friend} is another person.
PHRASES = {
    "+": (
        "{He} buys {k} more {objk}.",
        "{friend} gives {him} {k} {objk}.",
        "{He} finds {k} more {objk}.",
        "{He} gets {k} {objk} from {friend}.",
    ),
    "-": (
        "{He} gives {k} {objk} to {friend}.",
        "{He} loses {k} {objk}.",
        "{He} sells {k} {objk}.",
        "{friend} takes {k} of the {obj}.",
    ),
    "*": (
        "{He} buys more until {he} has {k} times as many {obj}.",
        "The number of {obj} {he} has becomes {k} times as large.",
    ),
    "/": (
        "{He} splits the {obj} into {k} equal piles and keeps one pile.",
        "{He} shares the {obj} equally among {k} kids, {himself} included, and keeps {his} share.",
    ),
}
EAT_PHRASE = "{He} eats {k} of the {obj}."
QUESTIONS = ("How many {obj} does {name} have now?", "How many {obj} does {name} have in the end?")


@dataclass(frozen=True)
class Problem:
    start: int
    ops: tuple[tuple[str, int], ...]
    """The chain of ``(op, operand)`` applied to ``start`` in order."""

    def values(self) -> list[int]:
        """The amounts after each step, starting with ``start``."""
        out = [self.start]
        for op, k in self.ops:
            out.append(apply_op(out[-1], op, k))
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def key(self) -> str:
        return f"{self.start}|" + "|".join(f"{op}{k}" for op, k in self.ops)


def apply_op(x: int, op: str, k: int) -> int:
    if op == "+":
        return x + k
    if op == "-":
        return x - k
    if op == "*":
        return x * k
    if op == "/":
        if x % k:
            raise ValueError(f"{x} / {k} is not an integer")
        return x // k
    raise ValueError(f"unknown op {op!r}")


def split_of(question: str) -> str:
    """``train`` (80 %), ``validation`` (10 %) or ``test`` (10 %), by a hash of the question text."""
    bucket = int(hashlib.sha256(question.encode()).hexdigest(), 16) % 10
    return "validation" if bucket == 0 else "test" if bucket == 1 else "train"


def _choose_op(x: int, ops: str, max_value: int, rng: random.Random) -> tuple[str, int] | None:
    """A random operation valid from amount ``x`` (result within 0..max_value), or None if none is."""
    candidates = []
    for op in ops:
        if op == "+" and x < max_value:
            candidates.append((op, rng.randint(1, max_value - x)))
        elif op == "-" and x > 1:
            candidates.append((op, rng.randint(1, x - 1)))
        elif op == "*" and 2 <= x and 2 * x <= max_value:
            candidates.append((op, rng.choice([k for k in (2, 3, 4) if k * x <= max_value])))
        elif op == "/":
            divisors = [k for k in (2, 3, 4) if x % k == 0 and x // k >= 1 and x >= 2 * k]
            if divisors:
                candidates.append((op, rng.choice(divisors)))
    return rng.choice(candidates) if candidates else None


def sample_problem(rng: random.Random, steps: int, max_value: int, ops: str) -> Problem:
    """A random chain of ``steps`` operations whose every amount lies within 1..max_value."""
    while True:
        start = x = rng.randint(2, max_value)
        chain = []
        for _ in range(steps):
            step = _choose_op(x, ops, max_value, rng)
            if step is None:
                break
            chain.append(step)
            x = apply_op(x, *step)
        if len(chain) == steps:
            return Problem(start, tuple(chain))


def render_problem(problem: Problem, rng: random.Random) -> tuple[str, str]:
    """``(question, solution)`` for ``problem`` with names, objects and phrasing drawn from ``rng``."""
    name, friend = rng.sample(NAMES, 2)
    obj, edible = rng.choice(OBJECTS)
    he = PRONOUN[name]
    words = dict(
        name=name,
        friend=friend,
        obj=obj,
        he=he,
        He=he.capitalize(),
        him="her" if he == "she" else "him",
        his="her" if he == "she" else "his",
        himself="herself" if he == "she" else "himself",
    )
    sentences = [rng.choice(OPENINGS).format(x=problem.start, **words)]
    for i, (op, k) in enumerate(problem.ops):
        phrases = PHRASES[op] + ((EAT_PHRASE,) if op == "-" and edible else ())
        sentence = rng.choice(phrases).format(k=k, objk=obj[:-1] if k == 1 else obj, **words)
        if i > 0:
            first, rest = sentence.split(" ", 1)
            sentence = f"Then {first.lower() if first in ('He', 'She', 'The') else first} {rest}"
        sentences.append(sentence)
    sentences.append(rng.choice(QUESTIONS).format(**words))
    question = " ".join(sentences)

    values = problem.values()
    lines = [f"{name} starts with {problem.start} {obj}."]
    for (op, k), before, after in zip(problem.ops, values, values[1:]):
        lines.append(f"{before} {op} {k} = {after}.")
    solution = " " + " ".join(lines) + f" </think> <answer> {problem.answer} </answer>"
    return question, solution


def slipped_solution(problem: Problem, solution: str, rng: random.Random) -> str:
    """``solution`` with one intermediate result off by 1 or 2, carried to the answer."""
    values = problem.values()
    i = rng.randrange(1, len(values))
    wrong = values[:i] + [max(0, values[i] + rng.choice((-2, -1, 1, 2)))]
    if wrong[i] == values[i]:
        wrong[i] = values[i] + 1
    for op, k in problem.ops[i:]:
        x = wrong[-1]
        wrong.append(x // k if op == "/" else apply_op(x, op, k))
    lines = [solution.strip().split(". ", 1)[0] + "."]  # "Mia starts with 7 apples."
    for (op, k), before, after in zip(problem.ops, wrong, wrong[1:]):
        lines.append(f"{before} {op} {k} = {after}.")
    return " " + " ".join(lines) + f" </think> <answer> {wrong[-1]} </answer>"


def tool_solution(problem: Problem, solution: str) -> str:
    """``solution`` computed by one calculator call (the ``tool`` knob), written as the plain tool-call
    format of ``rlvr.environments.formats`` reads and writes it (tests/environments/test_environments.py holds them equal)."""
    expression = str(problem.start)
    for i, (op, k) in enumerate(problem.ops):
        expression = f"{expression if i == 0 else f'({expression})'} {op} {k}"
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    opening = solution.strip().split(". ", 1)[0] + "."  # "Mia starts with 7 apples."
    result = f" <tool_response>{problem.answer}</tool_response>"
    return f" {opening} <tool_call>{call}</tool_call>{result} </think> <answer> {problem.answer} </answer>"


def _as_int(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DataError(f"arith: {name} must be an integer, got {value!r}") from None


def _as_share(name: str, value: Any) -> float:
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise DataError(f"arith: {name} must be a number in [0, 1], got {value!r}") from None
    if not 0.0 <= share <= 1.0:
        raise DataError(f"arith: {name} must be in [0, 1], got {share}")
    return share


def load_arithmetic(
    split: str = "train",
    limit: int | None = None,
    seed: int = 0,
    steps: int | str = 2,
    max_value: int | str = 20,
    ops: str = "+-",
    size: int | str | None = None,
    noise: float | str = 0.0,
    format_noise: float | str = 0.0,
    tool: float | str = 0.0,
) -> list[Example]:
    """The ``split`` of the arithmetic task: ``limit`` (or ``size``, or the split's default) problems.

    Deterministic in ``(split, seed, steps, max_value, ops)``; a smaller ``limit`` gives a prefix of
    a larger one. ``Example.meta`` keeps the structure (``start``, ``ops``, ``values``) for checks.
    """
    steps, max_value = _as_int("steps", steps), _as_int("max_value", max_value)
    ops = str(ops)
    if split not in SPLITS:
        raise DataError(f"arith: unknown split {split!r}; choose one of {SPLITS}")
    if steps < 1:
        raise DataError(f"arith: steps must be >= 1, got {steps}")
    if max_value < 4:
        raise DataError(f"arith: max_value must be >= 4 so that every operation has room, got {max_value}")
    if not ops or set(ops) - set(ALL_OPS) or not set(ops) & set("+-"):
        raise DataError(f"arith: ops must be a subset of {ALL_OPS!r} holding '+' or '-', got {ops!r}")
    noise, format_noise = _as_share("noise", noise), _as_share("format_noise", format_noise)
    tool = _as_share("tool", tool)
    n = (
        _as_int("limit", limit)
        if limit is not None
        else _as_int("size", size)
        if size is not None
        else DEFAULT_SIZES[split]
    )

    split_seed = int(hashlib.sha256(f"arith|{seed}|{split}|{steps}|{max_value}|{ops}".encode()).hexdigest()[:16], 16)
    rng = random.Random(split_seed)
    noise_rng = random.Random(split_seed ^ 0x5EED)  # its own stream: noise never changes the questions
    tool_rng = random.Random(split_seed ^ 0x7001)  # and the tool's its own: without it, nothing else changes
    examples: list[Example] = []
    seen: set[str] = set()
    attempts = 0
    while len(examples) < n:
        attempts += 1
        if attempts > 200 * n + 10_000:
            raise DataError(
                f"arith: could only make {len(examples)} distinct {split} problems of the {n} asked "
                f"(steps={steps}, max_value={max_value}); ask for fewer or raise max_value"
            )
        problem = sample_problem(rng, steps, max_value, ops)
        question, solution = render_problem(problem, rng)
        if split_of(question) != split or question in seen:
            continue
        seen.add(question)
        if tool and tool_rng.random() < tool:
            solution = tool_solution(problem, solution)
        elif noise and noise_rng.random() < noise:
            solution = slipped_solution(problem, solution, noise_rng)
        if format_noise and noise_rng.random() < format_noise:
            solution = solution.replace("</think> <answer>", "</think><answer>")
        examples.append(
            Example(
                question,
                str(problem.answer),
                solution,
                meta={"task": "arith", "start": problem.start, "ops": list(problem.ops), "values": problem.values()},
            )
        )
    return examples
