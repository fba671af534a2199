"""``code``: the reward of a program the model wrote, run on the example's tests in ``rlvr.sandbox``.

The ground truth is JSON text holding the tests, either or both of::

    {"tests": [{"stdin": "2 3\\n", "stdout": "5\\n"}, ...],    # the program's input and expected output
     "asserts": ["assert gcd(12, 18) == 6", ...]}            # statements run after the program

The program is the last fenced code block of the response (```python ... ```, or a bare ```); a
response without one scores 0 with ``format_reward`` 0. Each test is one sandboxed run of at most
``TEST_TIMEOUT_S`` seconds and ``TEST_MEMORY_MB`` of memory:

- a stdin test passes when the program exits with 0 and its output equals the expected output, line
  by line, up to trailing white space at the ends of lines and of the output;
- an assert test runs the program followed by the statement and then a line that prints a random
  token; it passes when the run exits with 0 and printed the token last, so a program that exits
  early (``sys.exit(0)``) does not pass the asserts it skipped.

The reward (and ``answer_reward``) is the fraction of tests passed; ``all_passed`` (0 or 1) and
``test_timeouts`` (tests cut off) are logged beside it.
"""

from __future__ import annotations

import json
import os
import re
import secrets

from rlvr import sandbox
from rlvr.errors import UserError

TEST_TIMEOUT_S = 5.0
TEST_MEMORY_MB = 512
_FENCED_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S)


class CodeTestsError(UserError, ValueError):
    """A ground truth that does not hold the tests of a code problem."""


def extract_program(response: str) -> str | None:
    """The content of the response's last fenced code block, or None when it has none."""
    blocks = _FENCED_BLOCK.findall(response)
    return blocks[-1] if blocks else None


def parse_tests(ground_truth: str) -> tuple[list[dict], list[str]]:
    """The (stdin tests, assert statements) of a ground truth; ``CodeTestsError`` when it holds none."""
    try:
        tests = json.loads(ground_truth)
    except (TypeError, json.JSONDecodeError):
        tests = None
    if isinstance(tests, dict):
        io, asserts = tests.get("tests", []), tests.get("asserts", [])
        if (
            isinstance(io, list)
            and isinstance(asserts, list)
            and (io or asserts)
            and all(isinstance(t, dict) and isinstance(t.get("stdin"), str) for t in io)
            and all(isinstance(t.get("stdout"), str) for t in io)
            and all(isinstance(a, str) for a in asserts)
        ):
            return io, asserts
    raise CodeTestsError(
        f"the code reward's ground truth {str(ground_truth)[:80]!r} is not JSON with 'tests' "
        '([{"stdin": ..., "stdout": ...}]) or \'asserts\' (["assert f(1) == 2"]); make the answer column hold it'
    )


def same_output(printed: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().split("\n")]

    return lines(printed) == lines(expected)


def code_reward_fn(response: str, ground_truth: str, *, require_isolation: bool = True) -> dict[str, float]:
    """The fraction of the ground truth's tests that the response's program passes (module docstring);
    ``require_isolation=False`` runs the programs where the kernel gives no namespaces (see
    ``rlvr.sandbox``)."""
    io, asserts = parse_tests(ground_truth)
    program = extract_program(response)
    if program is None:
        return {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0, "all_passed": 0.0, "test_timeouts": 0.0}
    passed = timeouts = 0
    for test in io:
        result = sandbox.run_python(
            program,
            stdin=test["stdin"],
            timeout_s=TEST_TIMEOUT_S,
            memory_mb=TEST_MEMORY_MB,
            require_isolation=require_isolation,
        )
        passed += result.ok and same_output(result.stdout, test["stdout"])
        timeouts += result.timed_out
    for statement in asserts:
        token = secrets.token_hex(16)
        code = f"{program}\n\n{statement}\nprint({token!r})\n"
        result = sandbox.run_python(
            code, timeout_s=TEST_TIMEOUT_S, memory_mb=TEST_MEMORY_MB, require_isolation=require_isolation
        )
        passed += result.ok and result.stdout.rstrip("\n").rpartition("\n")[2] == token
        timeouts += result.timed_out
    fraction = passed / (len(io) + len(asserts))
    return {
        "format_reward": 1.0,
        "answer_reward": fraction,
        "reward": fraction,
        "all_passed": float(fraction == 1.0),
        "test_timeouts": float(timeouts),
    }


def unavailable(require_isolation: bool = True) -> str | None:
    """Why the code reward cannot run here (None: it can), known before any model loads."""
    problem = sandbox.isolation_problem()
    if problem and not require_isolation:
        # Without namespaces the sandbox still refuses to run the code as root.
        return f"{problem}, and the trainer runs as root" if os.getuid() == 0 else None
    return problem
