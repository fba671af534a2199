"""Write train.jsonl and test.jsonl of the word-sorting task (run from anywhere; seeded, so the files
are the same every time).

Each row: ``task`` (what the model reads), ``sorted`` (the answer: the words in alphabetical order,
one space apart) and ``words`` (the words as given, a column that the reward function also receives).
"""

import json
import random
from pathlib import Path

WORDS = """apple river candle forest mirror garden pencil rocket window cloud tiger violin
harbor lemon meadow piano basket dragon engine falcon glacier helmet island jacket kettle ladder
magnet needle orange parrot quartz saddle tunnel umbrella valley walnut yogurt zebra anchor bridge
castle desert feather goblet hammer igloo jungle koala lantern marble nectar oyster pepper quiver
raven silver thunder urchin velvet wizard""".split()


def rows(n: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(3, 6))
        out.append(
            {
                "task": "Sort these words alphabetically: " + ", ".join(words) + ".",
                "sorted": " ".join(sorted(words)),
                "words": words,
            }
        )
    return out


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    rng = random.Random(0)
    for split, n in (("train", 512), ("test", 128)):
        with (here / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows(n, rng):
                f.write(json.dumps(row) + "\n")
