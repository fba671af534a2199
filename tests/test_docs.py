"""The README and the docs name what is there: every repository path they quote exists, and the
README's architecture table has a row for every package of ``src/rlvr``."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUOTED_PATH = re.compile(r"`((?:src|tests|benchmarks|scripts|configs|examples|docs)/[A-Za-z0-9_./-]*)`")
# The log of past runs quotes paths as they were then.
HISTORY = {"docs/benchmarks_history.md"}


def documents() -> list[Path]:
    return [
        REPO / "README.md",
        *(p for p in sorted((REPO / "docs").glob("*.md")) if str(p.relative_to(REPO)) not in HISTORY),
    ]


def test_every_quoted_path_exists():
    missing = [
        f"{doc.relative_to(REPO)}: {path}"
        for doc in documents()
        for path in sorted(set(QUOTED_PATH.findall(doc.read_text())))
        if not (REPO / path).exists()
    ]
    assert not missing, missing


def test_the_architecture_table_has_a_row_for_every_package():
    text = (REPO / "README.md").read_text()
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(src/rlvr/[a-z_/]*)` \|", section, flags=re.M))
    packages = {
        f"src/rlvr/{p.parent.relative_to(REPO / 'src' / 'rlvr')}/"
        for p in (REPO / "src" / "rlvr").glob("*/__init__.py")
    }
    assert packages <= rows, sorted(packages - rows)
    assert all((REPO / row).is_dir() for row in rows), sorted(r for r in rows if not (REPO / r).is_dir())
