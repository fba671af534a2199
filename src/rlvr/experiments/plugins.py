"""Import user modules (custom estimators) before training, in this process or in a child one.

A user's estimator is a function registered under a name (``rlvr.grpo.register_reweighting``,
``register_baseline``, ``register_normalizer``, ``register_aggregation``); the registration runs when its module is imported,
so that module must be imported before the config names it. A plugin is either an importable module
name (``my_pkg.my_estimator``) or a path to a ``.py`` file.

``python -m rlvr.experiments.plugins --plugin FILE_OR_MODULE ... -- train --config ...`` imports the
plugins and then runs the ``rlvr`` command after ``--``: this is how the sweep runner launches runs
in subprocesses, so that custom names work there without the trainer knowing about plugins. When
the sweep sets ``RLVR_PARENT_PID``, the command stops (SIGTERM: a checkpoint, then exit) when the
sweep dies, even if the sweep is killed outright.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from rlvr.cli import main as rlvr_main
from rlvr.errors import UserError
from rlvr.training.interrupts import stop_with_parent


def is_path(plugin: str) -> bool:
    return plugin.endswith(".py") or "/" in plugin or "\\" in plugin


def resolve_plugin(plugin: str, base_dir: str | Path | None = None) -> str:
    """A module name unchanged; a file path made absolute (relative paths are tried against
    ``base_dir`` first, then the working directory). Raises ``FileNotFoundError`` for a missing file."""
    if not is_path(plugin):
        return plugin
    p = Path(plugin).expanduser()
    candidates = [p] if p.is_absolute() else ([Path(base_dir) / p] if base_dir else []) + [Path.cwd() / p]
    for c in candidates:
        if c.is_file():
            return str(c.resolve())
    raise FileNotFoundError(f"plugin file {plugin!r} not found (looked at {', '.join(map(str, candidates))})")


def import_plugin(plugin: str, base_dir: str | Path | None = None) -> ModuleType:
    """Import one plugin (module name or ``.py`` path) and return the module; importing twice is a no-op."""
    target = resolve_plugin(plugin, base_dir)
    if not is_path(target):
        return importlib.import_module(target)
    # A stable name per file, so a second import returns the module instead of registering again.
    name = f"rlvr_plugin_{Path(target).stem}_{hashlib.sha1(target.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, target)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import plugin file {target}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_plugins(plugins: Iterable[str], base_dir: str | Path | None = None) -> list[ModuleType]:
    """Import every plugin; one that cannot be found or raises while importing is a ``UserError`` naming it."""
    modules = []
    for plugin in plugins:
        try:
            modules.append(import_plugin(plugin, base_dir))
        except FileNotFoundError as e:
            raise UserError(f"plugins: {e}; give a module name or the path of a .py file") from None
        except ModuleNotFoundError as e:
            if e.name is not None and plugin.startswith(e.name):  # the plugin itself, not one of its imports
                raise UserError(
                    f"plugins: no module named {plugin!r} can be imported; give an importable module name (on "
                    "PYTHONPATH) or the path of a .py file"
                ) from None
            raise UserError(f"plugins: {plugin} imports {e.name!r}, which is not installed; install it") from None
        except Exception as e:  # noqa: BLE001 (the plugin's own code may raise anything while importing)
            raise UserError(
                f"plugins: {plugin} raised {type(e).__name__} while importing: {e}; fix the plugin"
            ) from None
    return modules


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, command = argv[:i], argv[i + 1 :]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m rlvr.experiments.plugins",
        description="import plugin modules, then run an rlvr command given after --",
    )
    parser.add_argument("--plugin", action="append", default=[], help="module name or .py file (repeatable)")
    args = parser.parse_args(own)
    if not command:
        parser.error("give the rlvr command to run after --, e.g. -- train --config cfg.yaml --out runs/x")
    parent = os.environ.pop("RLVR_PARENT_PID", None)  # for this process only, not for what it starts
    if parent and parent.isdigit():
        stop_with_parent(int(parent))
    try:
        import_plugins(args.plugin)
    except UserError as e:
        print(f"rlvr {command[0]}: {e}", file=sys.stderr)
        return e.exit_code

    return int(rlvr_main(command) or 0)


if __name__ == "__main__":
    sys.exit(main())
