"""Answer extraction and grading for verifiable rewards: pure Python, bounded in time.

Reward functions, each ``(response, ground_truth) -> {"format_reward", "answer_reward", "reward"}``
with floats in {0.0, 1.0} and ``reward == answer_reward`` (no partial credit; the format reward is
only logged):

- ``r1_zero_reward_fn``: the response is *formatted* exactly when it contains the literal
  ``</think> <answer>`` (one space) and the literal ``</answer>``; otherwise everything is 0. The
  model's answer is the text after the last ``<answer>`` with ``</answer>`` removed; when it holds a
  ``\\boxed{...}`` the content of the last one is the answer, and a ``\\boxed`` with nothing
  parseable scores format 1, answer 0.
- ``question_only_reward_fn``: the answer is the content of the last ``\\boxed{...}`` (nested braces
  allowed, e.g. ``\\boxed{\\frac{1}{2}}``); no box scores all zeros.
- ``boxed_reward_fn``: the same answer, graded by ``grade_math`` (MATH-style ground truths too).
- ``exact_reward_fn``: the answer (tagged, boxed or the whole response) must equal the ground truth as text.

``grade(answer, ground_truth)`` decides whether the answer equals the ground truth *as a value*.

Accepted (for a ground truth of 18): ``18``, ``18.0``, ``18.00``, ``$18``, ``\\$18``, ``18%``,
``18 dollars``, ``18 apples``, ``18\\text{ dollars}``, ``x = 18``, ``The answer is 18.``,
``**18**``, ``\\boxed{18}``, ``\\frac{36}{2}``, ``\\dfrac{36}{2}``, ``36/2``, ``2 \\times 9``,
``36/2 = 18``, and symbolic forms such as ``\\sqrt{324}`` through ``math-verify``; thousands commas
(``2,125`` = 2125) and equal fractions and decimals (``0.5`` = ``1/2``) are the same value.

Rejected: empty answers; hedges and lists (``18 or 19``, ``18 and 19``, ``18, 19``, ``18 19``, two
different numbers in prose); qualifiers that change or blur the value (``about 18``, ``at least 18``,
``not 18``, ``18 thousand``, ``18k``, ``18 \\pm 1``, ``\\approx 18``); wrong signs; near misses
(``18.5``, ``180``); equation chains whose sides disagree (``36/2 = 19``); anything that does not
reduce to exactly one value. The grader is conservative: it must never accept a wrong answer, so an
answer that it cannot read with certainty scores 0.

The reference point is the grader of Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training:
A Critical Perspective", github.com/sail-sg/understand-r1-zero), the field's standard for these
prompts: the format rule above is theirs, and this grader accepts the answers theirs accepts on GSM8K
plus obvious ones it misses (``18 dollars``, ``\\frac{36}{2}``, ``The answer is 18.``).

How it stays cheap and bounded: a numeric path (regular expressions and exact ``fractions.Fraction``
arithmetic, no sympy) decides every answer made only of numbers, words and arithmetic. Only answers
that still hold LaTeX it cannot evaluate (``\\sqrt``, ``\\pi``, ...) go to ``math-verify``, which
runs in a separate worker process: symbolic parsing can hang (``9^{9^{9^9}}``), signal-based
timeouts do not work outside the main thread, and a thread cannot be interrupted, so a call that
exceeds ``SYMBOLIC_TIMEOUT_S`` kills the worker and scores 0. Answers longer than
``MAX_ANSWER_CHARS`` score 0 without being read. ``symbolic_checks()`` counts the answers that went
to the symbolic path.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from types import ModuleType
from typing import Any

MAX_ANSWER_CHARS = 1000
"""Longer answers score 0 unread: no GSM8K answer is that long, and it bounds the regex work."""
MAX_SYMBOLIC_CHARS = 200
"""Longer expressions are not handed to the symbolic grader (score 0)."""
SYMBOLIC_TIMEOUT_S = 0.75
"""Seconds one symbolic check may take once the worker is up; past it the answer scores 0."""
SYMBOLIC_STARTUP_TIMEOUT_S = 60.0
"""Seconds allowed for the symbolic worker to start (importing sympy and math-verify)."""

_MAX_EXPONENT = 64
_MAX_BITS = 4096
_MAX_DEPTH = 32

# ---------------------------------------------------------------------------------------------
# 1. Reward functions (the protocol)
# ---------------------------------------------------------------------------------------------


def _rewards(formatted: bool, correct: bool) -> dict[str, float]:
    answer = 1.0 if formatted and correct else 0.0
    return {"format_reward": 1.0 if formatted else 0.0, "answer_reward": answer, "reward": answer}


def extract_r1_zero_answer(response: str) -> str | None:
    """The model's answer under the r1_zero format rule, or ``None`` when the response is unformatted.

    A ``\\boxed`` inside the answer that cannot be read gives ``""`` (formatted, nothing to grade).
    """
    if "</think> <answer>" not in response or "</answer>" not in response:
        return None
    answer = response.split("<answer>")[-1].replace("</answer>", "")
    if "\\boxed" in answer:
        return last_boxed(answer) or ""
    return answer


def r1_zero_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Reward for the r1_zero prompt: format as the protocol defines it, answer graded by ``grade``."""
    answer = extract_r1_zero_answer(response)
    if answer is None:
        return _rewards(False, False)
    return _rewards(True, grade(answer, ground_truth))


def question_only_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Reward for the question_only prompt: the last ``\\boxed{...}`` is the answer; none scores 0."""
    answer = last_boxed(response)
    if answer is None:
        return _rewards(False, False)
    return _rewards(True, grade(answer, ground_truth))


def boxed_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Reward for MATH-style answers: the last ``\\boxed{...}`` graded by ``grade_math`` (``grade``, then
    math-verify's equivalence for ground truths that are not one number); no box scores 0."""
    answer = last_boxed(response)
    if answer is None:
        return _rewards(False, False)
    return _rewards(True, grade_math(answer, ground_truth))


def exact_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Reward for answers that must match the ground truth as text: the answer is the content of the
    last ``<answer>...</answer>``, else of the last ``\\boxed{...}``, else the whole response; it is
    correct when it equals the ground truth up to surrounding space and runs of white space."""
    answer = final_answer_text(response)
    if not answer.strip():
        return _rewards(False, False)
    return _rewards(True, " ".join(answer.split()) == " ".join(str(ground_truth).split()))


def final_answer_text(response: str) -> str:
    """The content of the last ``<answer>...</answer>`` (to the end when unclosed), else of the last
    ``\\boxed{...}``, else the whole response."""
    if "<answer>" in response:
        return response.rsplit("<answer>", 1)[1].split("</answer>", 1)[0]
    boxed = last_boxed(response)
    return response if boxed is None else boxed


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces matched, so nesting is fine), or ``None``.

    ``\\boxed 18`` (no braces) gives ``"18"``; an unclosed last box gives ``None``.
    """
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        if i == start + len("\\boxed"):  # \boxedfoo is another command, not a box
            return None
        match = re.match(r"[^\s$]+", text[i:])
        return match.group(0) if match else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


# ---------------------------------------------------------------------------------------------
# 2. Grading
# ---------------------------------------------------------------------------------------------


def grade(answer: str, ground_truth: str) -> bool:
    """True when ``answer`` equals ``ground_truth`` as a value (see the module docstring)."""
    if not isinstance(answer, str) or not isinstance(ground_truth, str):
        return False
    if not answer.strip() or len(answer) > MAX_ANSWER_CHARS:
        return False
    try:
        truth: Fraction | _Symbolic | None = _analyse(ground_truth)
    except _Reject:
        truth = None
    try:
        value = _analyse(answer)
    except _Reject:
        return False
    if isinstance(truth, Fraction):
        if isinstance(value, Fraction):
            return value == truth
        return _symbolic_equal(value.latex, _fraction_latex(truth))
    if truth is None:  # a ground truth that is no single value: nothing can equal it
        return False
    # A symbolic ground truth (another task): the same text, else the symbolic grader.
    pred = _fraction_latex(value) if isinstance(value, Fraction) else value.latex
    return _squash(pred) == _squash(truth.latex) or _symbolic_equal(pred, truth.latex)


def grade_math(answer: str, ground_truth: str) -> bool:
    """``grade``, and for a ground truth that is not one number (an interval, a set, an expression)
    also math-verify's equivalence, bounded like every symbolic check. A numeric ground truth is
    decided by ``grade`` alone, so that this never accepts what ``grade`` rejects there."""
    if grade(answer, ground_truth):
        return True
    if not isinstance(answer, str) or not isinstance(ground_truth, str) or not answer.strip():
        return False
    try:
        if isinstance(_analyse(ground_truth), Fraction):
            return False
    except _Reject:
        pass
    _count_symbolic_check()
    if len(answer) > MAX_SYMBOLIC_CHARS or len(ground_truth) > MAX_SYMBOLIC_CHARS:
        return False
    return _WORKER.check(answer.strip(), ground_truth.strip(), SYMBOLIC_TIMEOUT_S, mode="verify")


class _Reject(Exception):
    """The text is not one readable value: it scores 0."""


class _Symbolic:
    """A single expression the numeric path cannot evaluate; ``latex`` goes to math-verify."""

    def __init__(self, latex: str):
        self.latex = latex


def _analyse(text: str) -> Fraction | _Symbolic:
    """The value of ``text``: a ``Fraction``, a ``_Symbolic`` expression, or raises ``_Reject``."""
    if len(text) > MAX_ANSWER_CHARS:
        raise _Reject
    s = text.strip()
    if "\\boxed" in s:
        boxed = last_boxed(s)
        if boxed is None:
            raise _Reject
        s = boxed
    s = _normalize(s)
    segments = s.split("=")
    value = _segment_value(segments[-1])
    for left in segments[:-1]:
        if not re.search(r"\d", left):
            continue  # a label: "x =", "The total ="
        other = _segment_value(left)
        if not (isinstance(other, Fraction) and isinstance(value, Fraction) and other == value):
            raise _Reject  # a chain whose sides cannot be shown to agree
    return value


_UNICODE = {
    "\u2212": "-",
    "\u2013": "-",
    "\u00d7": "*",
    "\u00b7": "*",
    "\u22c5": "*",
    "\u00f7": "/",
    "\u00a0": " ",
    "\u2019": "'",
    "\u2009": " ",
    "\u202f": " ",
    "\uff04": "$",
    "\u00b0": "",
}
_TEXT_CMD = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mathsf|mbox|operatorname)\s*\{([^{}]*)\}"
)
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_DIGITS = re.compile(r"\\frac\s*(\d)\s*(\d)")
# Anything that makes the answer a hedge, a range, an inequality or an approximation.
_REJECT_MARKS = re.compile(
    r"\\(?:pm|mp|approx|sim|simeq|le|ge|leq|geq|lt|gt|neq|ne|not|neg|in|cup|cap|vee|wedge|lor|land|infty"
    r"|dots|ldots|cdots|vdots)(?![A-Za-z])"
    r"|[<>\u00b1\u2248\u2260\u2264\u2265;|?]|~\s*[\d$]"
)
_HEDGE_WORDS = frozenset(
    """or and nor not no none either neither between versus vs but if else otherwise unless maybe
    perhaps possibly probably likely about around approximately approx roughly nearly almost circa
    ca estimated estimate over under above below least most more less fewer greater than upto
    except excluding without instead wrong incorrect false unknown undefined cannot impossible
    hundred hundreds thousand thousands million millions billion billions trillion dozen dozens
    half halves quarter quarters third thirds twice double triple squared cubed square root sqrt
    power times plus minus negative neg divided multiplied mod modulo ratio
    two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen
    seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety
    k m b bn mn mil mln e""".split()
)
_SINGLE_LETTER_WORDS = frozenset("a i s h g l".split())
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]+(?:'[A-Za-z]+)?")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def _normalize(s: str) -> str:
    """LaTeX and typography reduced to plain text; raises ``_Reject`` on hedges and approximations."""
    for bad, good in _UNICODE.items():
        s = s.replace(bad, good)
    s = re.sub(r"\*\*([^*]+)\*\*", r"\1", s)  # markdown bold
    for _ in range(4):
        s, n = _TEXT_CMD.subn(r" \1 ", s)
        if not n:
            break
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.replace("{,}", ",")
    s = re.sub(r"(?<=\d)\\,(?=\d{3}(?!\d))", "", s)  # 2\,125
    s = re.sub(r"\\(?:left|right|displaystyle|bigl?|bigr?|Bigl?|Bigr?)(?![A-Za-z])", "", s)
    s = re.sub(r"\\(?:[,;:! ]|quad|qquad)|\\\\|\\[()\[\]]", " ", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    for _ in range(s.count("\\frac")):
        s, n = _FRAC.subn(r"((\1)/(\2))", s)
        if not n:
            break
    s = _FRAC_DIGITS.sub(r"((\1)/(\2))", s)
    s = re.sub(r"\\(?:times|cdot|ast)(?![A-Za-z])", "*", s)
    s = re.sub(r"\\div(?![A-Za-z])", "/", s)
    if _REJECT_MARKS.search(s):
        raise _Reject
    s = s.replace("~", " ")
    words = [w.lower() for w in _WORD.findall(s)]
    if any(w.split("'")[0] in _HEDGE_WORDS for w in words):
        raise _Reject
    s = re.sub(r"(?<=[A-Za-z])\s*[.:](?!\d)", " ", s)  # "Answer: 18", "Mr. Smith"
    s = s.strip().strip("*_\"'` ")
    s = re.sub(r"\.+$", "", s).strip()  # a sentence's full stop; "18!" stays (it may be a factorial)
    s = s.replace("**", "^")
    # thousands commas: 2,125 and 1,234,567.89, but not 18,19
    s = re.sub(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])", lambda m: m.group(0).replace(",", ""), s)
    return s


def _segment_value(seg: str) -> Fraction | _Symbolic:
    """Value of one side of an equation: words dropped, then one number or one expression."""
    had_words = False

    def drop_word(m: re.Match) -> str:
        nonlocal had_words
        word = m.group(0).lower()
        if len(word) == 1 and word not in _SINGLE_LETTER_WORDS:
            raise _Reject  # a variable or a multiplier: 2x, 18k, 1e5
        had_words = True
        return " "

    core = _WORD.sub(drop_word, seg)
    for _ in range(8):
        core, n = re.subn(r"\(\s*\)", " ", core)
        if not n:
            break
    core = re.sub(r"[\"'`]", "", core).strip(",:*_ ").rstrip(". ")
    if not core or not re.search(r"\d", core):
        raise _Reject
    if "," in core:
        raise _Reject  # a list: "18, 19"
    if re.search(r"\\[A-Za-z]", core):
        if len(core) > MAX_SYMBOLIC_CHARS or re.search(r"[\d}]\s+\d", core):
            raise _Reject  # too long, or juxtaposed numbers that math-verify would multiply
        return _Symbolic(core)
    core = core.replace("{", "(").replace("}", ")")
    pieces = core.split()
    if len(pieces) > 1 and all(_NUMBER.fullmatch(p.rstrip(".")) for p in pieces):
        values = {Fraction(p.rstrip(".")) for p in pieces}
        if len(values) != 1:
            raise _Reject  # several distinct numbers
        return values.pop()
    if had_words and re.search(r"[\d)]\s*-\s*[\d(.]", core):
        raise _Reject  # "18-19 apples" reads as a range
    return _Arithmetic(core).value()


def _fraction_latex(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}"


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


class _Arithmetic:
    """Exact evaluator for ``+ - * / ^`` and parentheses over decimals, bounded in size and depth.

    Juxtaposed numbers (``18 19``) are an error, not a product.
    """

    _TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|([-+*/^()]))")

    def __init__(self, text: str):
        self.tokens: list[str] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = self._TOKEN.match(text, pos)
            if not m:
                raise _Reject
            self.tokens.append(m.group(1) or m.group(2))
            pos = m.end()
        self.i = 0
        self.depth = 0

    def value(self) -> Fraction:
        result = self._sum()
        if self.i != len(self.tokens):
            raise _Reject
        return result

    def _peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _take(self) -> str:
        if self.i >= len(self.tokens):
            raise _Reject
        self.i += 1
        return self.tokens[self.i - 1]

    def _sum(self) -> Fraction:
        total = self._product()
        while self._peek() in ("+", "-"):
            op = self._take()
            rhs = self._product()
            total = total + rhs if op == "+" else total - rhs
        return total

    def _product(self) -> Fraction:
        total = self._unary()
        while self._peek() in ("*", "/"):
            op = self._take()
            rhs = self._unary()
            if op == "/" and rhs == 0:
                raise _Reject
            total = total * rhs if op == "*" else total / rhs
        return total

    def _unary(self) -> Fraction:
        if self._peek() in ("+", "-"):
            op = self._take()
            if self._peek() in ("+", "-"):
                raise _Reject  # "--18", "+-18": a typo, not a value to trust
            self._enter()
            inner = self._unary()
            self.depth -= 1
            return -inner if op == "-" else inner
        return self._power()

    def _power(self) -> Fraction:
        base = self._atom()
        if self._peek() != "^":
            return base
        self._take()
        self._enter()
        exponent = self._unary()
        self.depth -= 1
        if exponent.denominator != 1 or abs(exponent) > _MAX_EXPONENT:
            raise _Reject
        size = max(base.numerator.bit_length(), base.denominator.bit_length())
        if size * abs(int(exponent)) > _MAX_BITS or (base == 0 and exponent < 0):
            raise _Reject
        return base ** int(exponent)

    def _atom(self) -> Fraction:
        token = self._take()
        if token == "(":
            self._enter()
            inner = self._sum()
            self.depth -= 1
            if self._take() != ")":
                raise _Reject
            return inner
        if token[0].isdigit() or token[0] == ".":
            return Fraction(token)
        raise _Reject

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Reject


# ---------------------------------------------------------------------------------------------
# 3. The symbolic fallback: math-verify in a worker process that a timeout can kill
# ---------------------------------------------------------------------------------------------


_symbolic_lock = threading.Lock()
_symbolic_count = 0


def symbolic_checks() -> int:
    """How many answers this process has handed to the symbolic path (math-verify's worker) so far,
    those it then refused as too long included: the numeric path decides the rest, so a count that
    rises with every answer means the answers need the slower worker."""
    with _symbolic_lock:
        return _symbolic_count


def _count_symbolic_check() -> None:
    global _symbolic_count
    with _symbolic_lock:
        _symbolic_count += 1


def _symbolic_equal(pred_latex: str, gold_latex: str) -> bool:
    """math-verify's verdict on two LaTeX expressions, with an exact numeric check; 0 on timeout."""
    _count_symbolic_check()
    if len(pred_latex) > MAX_SYMBOLIC_CHARS or len(gold_latex) > MAX_SYMBOLIC_CHARS:
        return False
    return _WORKER.check(pred_latex, gold_latex, SYMBOLIC_TIMEOUT_S)


class LineWorker:
    """One long-lived child process that answers one JSON line per JSON line; killed and restarted
    after a timeout.

    Calls are serialised by a lock, so any thread may use it. The child prints ``ready`` once it can
    serve, or one JSON line ``{"error": message}`` and exits when it cannot (``WorkerStartError``).
    """

    def __init__(self, command: list[str], startup_timeout: float, quiet: bool = True) -> None:
        self.command = command
        self.startup_timeout = startup_timeout
        self.quiet = quiet
        """Discard the child's stderr (else it shares ours, so that a user's prints and warnings show)."""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = -1

    def request(self, payload: dict, timeout: float) -> dict:
        """The child's answer to ``payload``. Raises ``TimeoutError`` after ``timeout`` seconds (the
        child is killed), ``WorkerStartError`` when it cannot start and ``OSError``/``ValueError``
        when it dies or answers garbage (the child is stopped)."""
        with self._lock:
            try:
                proc = self._ensure_started()
                assert proc.stdin is not None  # started with stdin=PIPE
                proc.stdin.write((json.dumps(payload, default=str) + "\n").encode())
                proc.stdin.flush()
                line = self._read_line(proc, timeout)
                return json.loads(line)
            except (OSError, ValueError, TimeoutError):
                self._stop()
                raise

    def start(self) -> None:
        """Start the child now (``WorkerStartError`` with its message when it cannot serve)."""
        with self._lock:
            try:
                self._ensure_started()
            except (OSError, TimeoutError) as e:
                self._stop()
                if isinstance(e, WorkerStartError):
                    raise
                raise WorkerStartError(f"the worker did not start ({type(e).__name__}: {e})") from None

    def _ensure_started(self) -> subprocess.Popen:
        if self._proc is not None and (self._owner_pid != os.getpid() or self._proc.poll() is not None):
            self._stop()
        if self._proc is None:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL if self.quiet else None,
                bufsize=0,
            )
            self._owner_pid = os.getpid()
            try:
                first = self._read_line(self._proc, self.startup_timeout)
            except OSError as e:
                raise WorkerStartError(f"the worker exited before it was ready ({e})") from None
            if first != b"ready\n":
                try:
                    message = json.loads(first).get("error") or first.decode(errors="replace").strip()
                except (ValueError, AttributeError):
                    message = first.decode(errors="replace").strip()
                raise WorkerStartError(message)
        return self._proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout: float) -> bytes:
        # A raw unbuffered pipe, so poll sees every byte (poll, unlike select, takes any fd number).
        assert proc.stdout is not None  # started with stdout=PIPE
        fd = proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise OSError("the worker exited")
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or self._owner_pid != os.getpid():
            return
        try:
            proc.kill()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def close(self) -> None:
        with self._lock:
            self._stop()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's worker and lock are not ours; start afresh on demand."""
        self._lock = threading.Lock()
        self._proc = None


class WorkerStartError(OSError):
    """A worker process that could not start; the message says why."""


class _SymbolicWorker(LineWorker):
    """math-verify in a child that runs this file as a script (``python -P rewards.py --serve``), so
    that it imports only math-verify, never the training stack."""

    def __init__(self) -> None:
        super().__init__([sys.executable, "-P", os.path.abspath(__file__), "--serve"], SYMBOLIC_STARTUP_TIMEOUT_S)

    def check(self, pred: str, gold: str, timeout: float, mode: str = "exact") -> bool:
        try:
            return bool(self.request({"pred": pred, "gold": gold, "mode": mode}, timeout).get("ok"))
        except (OSError, ValueError, TimeoutError, AttributeError):
            return False


_WORKER = _SymbolicWorker()
atexit.register(_WORKER.close)
os.register_at_fork(after_in_child=_WORKER.forget_after_fork)


def _serve() -> None:
    """The worker loop: one JSON request per stdin line, one ``{"ok": bool}`` per stdout line."""
    import logging

    logging.disable(logging.CRITICAL)  # math-verify warns that we disabled its signal timeouts
    import sympy
    from math_verify import parse, verify

    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        ok = False
        try:
            request = json.loads(line)
            gold = parse(f"${request['gold']}$", parsing_timeout=None)
            pred = parse(f"${request['pred']}$", parsing_timeout=None)
            # math-verify may read a part of the text; we grade only an expression read whole
            whole = len(pred) > 1 and _squash(str(pred[1])) == _squash(request["pred"])
            if whole and gold and verify(gold, pred, timeout_seconds=None):
                # "exact": one number, exactly; "verify": math-verify's equivalence (sets, intervals, ...)
                ok = request.get("mode") == "verify" or _exactly_equal(sympy, pred[0], gold[0])
        except Exception:  # any failure to parse or compare scores 0
            ok = False
        out.write(b'{"ok": true}\n' if ok else b'{"ok": false}\n')
        out.flush()


def _exactly_equal(sympy: ModuleType, pred: Any, gold: Any) -> bool:
    """math-verify compares numbers after rounding; we demand one exact number, not a set or equation."""
    if not isinstance(pred, sympy.Expr) or not isinstance(gold, sympy.Expr):
        return False
    if not pred.is_number or not gold.is_number:
        return False
    diff = sympy.N(pred - gold, 60)
    return bool(diff == 0 or abs(diff) < sympy.Float("1e-40"))


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
