"""`rlvr <command> [options]`: one entry point, one module per command.

Each command lives in its own module and exposes ``main(argv: list[str]) -> int``; modules load
lazily so that ``rlvr --help`` is instant and a command only imports what it needs.

A ``UserError`` (bad input, a missing file, a run directory in use) ends any command with one line,
``rlvr <command>: <message>``, and its exit status (2, or 1 for a fault during training); other
exceptions are bugs and keep their traceback. SIGTERM stops every command like Ctrl-C (status 143
and 130).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rlvr.errors import UserError, disk_full
from rlvr.training.interrupts import exit_code, sigterm_as_interrupt

COMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("rlvr.commands.evaluate", "evaluate prompts on a model: accuracy, format categories, samples"),
    "train": ("rlvr.commands.train", "train a policy with GRPO or a variant (on- or off-policy)"),
    "sft": ("rlvr.commands.sft", "supervised fine-tuning: warm start, or `rlvr sft instruct` for instruction tuning"),
    "dpo": ("rlvr.commands.dpo", "direct preference optimization of an instruction-tuned model on preference pairs"),
    "sweep": ("rlvr.experiments.sweep", "run a grid of settings x seeds"),
    "plot": ("rlvr.experiments.plot", "plot metrics of runs with the spread across seeds"),
    "report": ("rlvr.experiments.report", "write a Markdown report with plots and tables"),
    "export": (
        "rlvr.commands.export",
        "a run's model as a clean folder with its tokenizer and model card (--push-to-hub)",
    ),
    "demo": ("rlvr.commands.demo", "the CPU story: warm start, GRPO, accuracy before/after, a plot"),
}


def _usage() -> str:
    lines = ["usage: rlvr <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`rlvr <command> --help` shows a command's options."]
    return "\n".join(lines)


@contextlib.contextmanager
def _plain_warnings(command: str) -> Iterator[None]:
    """rlvr's own warnings as one line each (``rlvr train: warning: ...``), without the source line
    that Python prints by default; other libraries' warnings are left as they are."""
    default = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if Path(filename).parent.name == "rlvr" or "rlvr" in Path(filename).parts:
            print(f"rlvr {command}: warning: {message}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = default


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rlvr: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        # Ctrl-C or SIGTERM while torch and the command load is handled like one during the run.
        with sigterm_as_interrupt(), _plain_warnings(name):
            from rlvr.modeling import attention_without_cudnn

            with attention_without_cudnn():
                module = importlib.import_module(COMMANDS[name][0])
                return int(module.main(rest) or 0)
    except UserError as e:
        print(f"rlvr {name}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        print(f"rlvr {name}: interrupted", file=sys.stderr)
        return exit_code(e)
    except Exception as e:
        full = disk_full(e)
        if full is None:
            raise
        print(f"rlvr {name}: {full}", file=sys.stderr)
        return full.exit_code


if __name__ == "__main__":
    sys.exit(main())
