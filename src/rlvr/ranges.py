"""Allowed ranges of numeric settings, one table per command, checked before any model loads.

Each command's config keeps a table ``{dotted key: Range}`` with an entry for every numeric field
(``numeric_fields`` lists them; a test holds every table complete). ``range_problems`` returns one
line per value outside its range, naming the key (or flag) and the range: ``optim.weight_decay must
be >= 0, got -0.1``. A number that is not finite (nan, inf) is outside every range.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlvr.errors import UserError


@dataclass(frozen=True)
class Range:
    """The finite numbers between ``low`` and ``high``; an open end excludes its bound."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def contains(self, x: float) -> bool:
        if not math.isfinite(x):
            return False
        above = x > self.low if self.low_open else x >= self.low
        below = x < self.high if self.high_open else x <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low == -math.inf:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
PROBABILITY = Range(0, 1)
"""Probabilities and ratios, both ends allowed."""
BELOW_ONE = Range(0, 1, high_open=True)
"""Dropout, warm-up shares, Adam betas: 1 would never decay or never train."""
ABOVE_ZERO_TO_ONE = Range(0, 1, low_open=True)
"""Nucleus sampling's top_p: 0 keeps no token."""
PORT = Range(1, 65535)


def _value_at(obj: object, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def range_problems(
    obj: object, ranges: Mapping[str, Range], name: Callable[[str], str] = str, known: Iterable[str] = ()
) -> list[str]:
    """One line per value of ``obj`` (a config) outside its range in ``ranges``; None (unset) and
    booleans pass. ``name`` turns a dotted key into what the user typed (a flag); a key whose name
    appears in one of the ``known`` problems (found by a command's own checks) is not reported twice."""
    known = list(known)
    problems = []
    for key, allowed in ranges.items():
        value = _value_at(obj, key)
        values = value if isinstance(value, (tuple, list)) else (value,)
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not any(not allowed.contains(v) for v in numbers) or any(name(key) in line for line in known):
            continue
        if isinstance(value, (tuple, list)):
            problems.append(f"each of {name(key)} must be {allowed}, got {list(value)}")
        else:
            problems.append(f"{name(key)} must be {allowed}, got {value}")
    return problems


def check_flags(obj: object, ranges: Mapping[str, Range], checks: Iterable[tuple[bool, str]] = ()) -> None:
    """Raise one ``UserError`` naming every failed check (``checks``: a command's own ``(failed, message)``
    pairs) and every value of ``obj`` outside its range in ``ranges``, by flag; a flag that a failed
    check already names is not reported twice. Every command checks its flags this way before any work."""
    problems = [message for failed, message in checks if failed]
    problems += range_problems(obj, ranges, flag_name, known=problems)
    if problems:
        raise UserError("; ".join(problems))


def flag_name(key: str) -> str:
    """The command-line flag of a field (``weight_decay`` -> ``--weight-decay``), as tyro names it."""
    return "--" + key.replace("_", "-")


def _is_numeric(tp: Any) -> bool:
    if tp in (int, float):
        return True
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_is_numeric(a) for a in args if a is not type(None))
    if origin is tuple:
        return bool(args) and all(_is_numeric(a) for a in args if a is not Ellipsis)
    return False


def numeric_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every int or float field of the dataclass ``cls`` (optional ones and tuples
    of numbers included), through nested dataclasses."""
    hints = typing.get_type_hints(cls)
    names = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            names += numeric_fields(tp, f"{prefix}{f.name}.")
        elif _is_numeric(tp):
            names.append(prefix + f.name)
    return names
