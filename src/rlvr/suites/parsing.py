"""Answer parsers of the multiple-choice and math suites, and the numeric comparison of GSM8K answers.

``parse_mmlu_response`` reads the letter of the sentence the MMLU prompt asks for, "The correct
answer is X": the first such sentence, an upper-case letter A-D that stands alone (``B``, ``B.``,
``(B)``, ``**B**``), and nothing when the sentence names something else ("The correct answer is 10000
polyomaviruses" parses to None). Matching the phrase ignores case; the letter does not, so the
article in "the correct answer is a virus" is not read as option A.

``parse_gsm8k_response`` takes the last number in the text, as the zero-shot GSM8K protocol does:
thousands commas are removed (``1,234`` -> ``1234``), a decimal part is kept, a minus sign counts
only when it does not follow a word or digit (``48-24`` is a subtraction, its last number is 24).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_MMLU_ANSWER = re.compile(r"(?i:the\s+correct\s+answer\s+is)\s*:?\s*[\(\[\*]*([A-D])(?![A-Za-z0-9])")
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def parse_mmlu_response(mmlu_example: dict, model_output: str) -> str | None:
    """The option letter ``"A"``..``"D"`` that ``model_output`` names in "The correct answer is X", or
    None. ``mmlu_example`` (``subject, question, options, answer``) is not needed to read the letter;
    it is part of the course's signature."""
    match = _MMLU_ANSWER.search(model_output or "")
    return match.group(1) if match else None


def parse_gsm8k_response(model_output: str) -> str | None:
    """The last number in ``model_output`` as a string without thousands commas, or None."""
    numbers = _NUMBER.findall(model_output or "")
    return numbers[-1].replace(",", "") if numbers else None


def same_number(predicted: str | None, truth: str) -> bool:
    """Whether two numeric strings name the same number (``"72.0"`` equals ``"72"``; commas ignored)."""
    if predicted is None:
        return False
    try:
        return Decimal(predicted.replace(",", "")) == Decimal(str(truth).replace(",", "").strip())
    except InvalidOperation:
        return False
