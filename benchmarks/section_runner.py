"""Run a benchmark's sections one after another so that no section can stop or break another.

A section is a function of the benchmark object (``Section.run``), with the sections whose results it
reads (``needs``) and, optionally, an estimate of the GPU memory it adds to what is already resident
(``memory``). ``run_sections`` runs the chosen ones in table order and returns one ``Outcome`` each:

- ``ok``: it ran to its end;
- ``skipped``: it did not start: a section it needs did not end ``ok``, the deadline had passed, its
  memory estimate is above the memory free on the card, or its body raised ``SectionSkipped``;
- ``out of memory``: it raised ``torch.OutOfMemoryError``; its memory is freed before the next starts;
- ``failed``: it raised anything else (the traceback is printed, the outcome keeps one line).

``card_info`` and ``card_line`` say which card a run measured on, for every table the benchmarks write.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

OK, SKIPPED, OOM, FAILED = "ok", "skipped", "out of memory", "failed"
GIB = 2**30


class SectionSkipped(Exception):
    """Raised by a section body that cannot run here (an optional package missing, a flag that turns it
    off); the message is the one-line reason."""


@dataclass(frozen=True)
class Section:
    run: Callable[[Any], None]
    needs: tuple[str, ...] = ()
    memory: Callable[[Any], int | None] | None = None  # GPU bytes it adds to what is resident; None: unknown


@dataclass
class Outcome:
    name: str
    status: str
    reason: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def one_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, cut at ``limit`` characters."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def free_memory() -> None:
    """Drop unreachable objects and hand the allocator's cached blocks back to the card."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def available_bytes(device: torch.device) -> int | None:
    """Bytes a section can still allocate on ``device``: the card's free memory plus what the allocator
    holds cached but unused; None off a GPU (no estimate is checked there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def memory_reason(need: int | None, available: int | None) -> str | None:
    """The one-line reason a piece of work estimated at ``need`` bytes should not start, or None."""
    if need is None or available is None or need <= available:
        return None
    return f"needs about {need / GIB:.1f} GiB by its estimate, {available / GIB:.1f} GiB free"


def run_sections(
    table: Mapping[str, Section],
    names: Sequence[str],
    context: Any,
    *,
    available: Callable[[], int | None] = lambda: None,
    free: Callable[[], None] = free_memory,
    deadline_s: float = float("inf"),
    started: float | None = None,
    report: Callable[[Outcome], None] = lambda o: None,
) -> list[Outcome]:
    """Run ``table[name].run(context)`` for each of ``names`` in order, each isolated (module docstring).
    ``report`` is called with each outcome as soon as it is known."""
    started = time.perf_counter() if started is None else started
    outcomes: dict[str, Outcome] = {}
    for name in names:
        section = table[name]
        t0 = time.perf_counter()
        reason = _reason_not_to_start(name, section, context, outcomes, available, deadline_s, started)
        if reason is not None:
            outcome = Outcome(name, SKIPPED, reason)
        else:
            outcome = _run_one(name, section, context)
            # Outside the except clauses: the exception's traceback, and the tensors its frames hold,
            # are gone by now, so this frees them.
            free()
        outcome.seconds = time.perf_counter() - t0
        outcomes[name] = outcome
        report(outcome)
    return list(outcomes.values())


def _reason_not_to_start(name, section, context, outcomes, available, deadline_s, started) -> str | None:
    for need in section.needs:
        done = outcomes.get(need)
        if done is None:
            return f"needs {need}, which did not run (not among the sections chosen)"
        if done.status != OK:
            return f"needs {need}, which {_past(done.status)}"
    if time.perf_counter() - started > deadline_s:
        return f"past the {deadline_s:.0f} s deadline"
    free = available() if section.memory is not None else None
    if free is None:
        return None
    try:
        need = section.memory(context)
    except Exception as e:  # an estimate that cannot be made is no reason to skip the measurement
        print(f"[section] {name}: no memory estimate ({one_line(e)})", flush=True)
        return None
    return memory_reason(need, free)


def _past(status: str) -> str:
    return {SKIPPED: "was skipped", OOM: "ran out of memory", FAILED: "failed"}[status]


def _run_one(name: str, section: Section, context: Any) -> Outcome:
    try:
        section.run(context)
    except SectionSkipped as e:
        return Outcome(name, SKIPPED, str(e))
    except torch.OutOfMemoryError as e:
        return Outcome(name, OOM, one_line(e))
    except Exception as e:
        traceback.print_exc()
        return Outcome(name, FAILED, one_line(e))
    return Outcome(name, OK)


def outcome_table(outcomes: Sequence[Outcome]) -> str:
    """The outcomes as a markdown table: section, outcome, seconds, reason."""
    lines = ["| section | outcome | s | reason |", "|---|---|---:|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.1f} | {o.reason} |")
    return "\n".join(lines)


def card_info(device: torch.device) -> dict:
    """Which card a run measures on: its name, its memory and how much of it is free now. A run that
    measures the card's ceilings adds them (``with_ceilings``)."""
    if device.type != "cuda":
        return dict(name="CPU (no GPU)")
    free, total = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_properties(device).name
    return dict(name=name, memory_gib=round(total / GIB, 1), free_gib_at_start=round(free / GIB, 1))


def with_ceilings(info: dict, copy_bytes_s: float, matmul_flops: float) -> dict:
    """``info`` with the copy bandwidth and bf16 matmul rate measured on the card."""
    return dict(info, copy_tb_s=round(copy_bytes_s / 1e12, 2), bf16_matmul_tflop_s=round(matmul_flops / 1e12))


def card_line(info: dict) -> str:
    """``card_info`` as one line, for the head of every table a benchmark prints or writes."""
    parts = [f"{info['memory_gib']} GiB"] if "memory_gib" in info else []
    if "copy_tb_s" in info:
        parts.append(f"copy {info['copy_tb_s']:.2f} TB/s measured")
    if "bf16_matmul_tflop_s" in info:
        parts.append(f"bf16 matmul {info['bf16_matmul_tflop_s']} TFLOP/s measured")
    return f"card: {info['name']}" + (f" ({', '.join(parts)})" if parts else "")
