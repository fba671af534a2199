"""The process that runs a user's reward function, so that a call that hangs can be cut off.

Run as ``python -P reward_worker.py TARGET`` (``rlvr.reward_functions`` starts it). ``TARGET`` is
``package.module:function`` (imported with the working directory on the path) or
``path/to/file.py:function``. It prints ``ready`` once the function is loaded, or one line
``{"error": message}`` and exits. Then, per stdin line ``{"response", "ground_truth", "fields", "context"}``, it
prints ``{"ok": true, "value": result}`` or ``{"ok": false, "error": message}``; a line
``{"bind": [field names], "context": [names]}`` asks whether the function accepts
``(response, ground_truth, **fields)`` with those fields and the context names it takes. A context
name (``prompt``, ``messages``) reaches the function only when it names it or has ``**kwargs``, so
that functions written before the context existed keep working. Only the standard library is imported here: the user's code brings what it needs.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def is_file_spec(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def load_function(spec: str) -> Callable[..., Any]:
    """The callable that ``spec`` names; ``ValueError`` with a one-line explanation when it cannot."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{spec!r} is not module:function or path/to/file.py:function")
    if is_file_spec(target):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"no such file {target} (relative to {os.getcwd()})")
        module_name = f"rlvr_user_reward_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        where = target
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 (any failure of the user's module is reported)
            raise ValueError(f"importing {target} failed: {type(e).__name__}: {e}") from None
    else:
        where = f"module {target}"
        try:
            module = importlib.import_module(target)
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                f"importing module {target} failed: {type(e).__name__}: {e} "
                "(is it on the path? run from the folder that holds it, or name its .py file)"
            ) from None
    fn = getattr(module, name, None)
    if fn is None:
        functions = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"{where} has no function {name!r} (functions there: {', '.join(functions) or 'none'})")
    if not callable(fn):
        raise ValueError(f"{where}: {name} is a {type(fn).__name__}, not a function")
    return fn


def _jsonable(value: Any) -> Any:
    """Numbers (numpy's too) as floats, containers walked, anything else as text."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # numpy and torch scalars
        try:
            return _jsonable(value.item())
        except (TypeError, ValueError):
            pass
    return str(value)


def takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name``: a parameter of that name or ``**kwargs``."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def serve(spec: str) -> None:
    out = sys.stdout.buffer
    # The user's prints would corrupt the protocol: their stdout goes to stderr.
    sys.stdout = sys.stderr
    try:
        fn = load_function(spec)
    except ValueError as e:
        out.write((json.dumps({"error": str(e)}) + "\n").encode())
        out.flush()
        return
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            if "bind" in request:
                context = [k for k in request.get("context", []) if takes(fn, k)]
                inspect.signature(fn).bind("", "", **{k: None for k in [*context, *request["bind"]]})
                reply: dict[str, object] = {"ok": True, "value": None}
            else:
                unasked = {k for k in request.get("context", []) if not takes(fn, k)}
                fields = {k: v for k, v in request.get("fields", {}).items() if k not in unasked}
                value = fn(request["response"], request["ground_truth"], **fields)
                reply = {"ok": True, "value": _jsonable(value)}
        except Exception as e:  # noqa: BLE001 (reported to the trainer, which stops with it)
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write((json.dumps(reply) + "\n").encode())
        out.flush()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # -P left the working directory off the path; user packages live there
    serve(sys.argv[1])
