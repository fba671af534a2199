"""The reward of the word-sorting task: 1 when the answer line lists the given words in alphabetical order.

rlvr calls ``sort_reward(response, ground_truth, **fields)``; ``fields`` holds the row's other columns,
here ``words`` (the words as given). The extra numbers in the returned dict are logged next to the
reward (``train/reward/same_words``, ``train/reward/pairs_in_order``), so a run shows whether the
model keeps the right words before it gets their order right.
"""

import re


def answer_words(response: str) -> list[str] | None:
    """The words after the last 'Answer:' (to the end of that line), or None when there is none."""
    found = re.findall(r"Answer:\s*([^\n]*)", response)
    if not found:
        return None
    return re.findall(r"[A-Za-z]+", found[-1].lower())


def sort_reward(response: str, ground_truth: str, words: list[str], **fields) -> dict:
    answer = answer_words(response)
    if answer is None:
        return {"reward": 0.0, "format_reward": 0.0, "same_words": 0.0, "pairs_in_order": 0.0}
    pairs = list(zip(answer, answer[1:]))
    return {
        "reward": float(answer == ground_truth.split()),
        "format_reward": 1.0,
        "same_words": float(sorted(answer) == sorted(words)),
        "pairs_in_order": sum(a <= b for a, b in pairs) / len(pairs) if pairs else 0.0,
    }
