"""The process that runs a user's reward function, so that a call that hangs can be cut off.

Run as ``python -P reward_worker.py TARGET`` (``rlvr.task.rewards`` starts it). ``TARGET`` is
``package.module:function`` (imported with the working directory on the path) or
``path/to/file.py:function``. It prints ``ready`` once the function is loaded, or one line
``{"error": message}`` and exits. Then it answers one JSON line per line:

- ``{"bind": [field names], "context": [names]}``: whether the function accepts
  ``(response, ground_truth, **fields)`` with those fields and the context names it takes;
- ``{"batch": [{"response", "ground_truth", "fields"}, ...], "context", "threads", "timeout_s"}``:
  ``{"ok": true, "values": [...], "timed_out": [indices], "stuck": bool}`` or
  ``{"ok": false, "error": message}``. Up to ``threads`` calls run at once (threads, or tasks of
  one event loop for an ``async def`` function); a call past ``timeout_s`` is given up (value None).
  A function whose one parameter is ``rows`` is called once with the list of rows (dicts of
  response, ground_truth and the fields) and returns one result per row. ``stuck`` says that a
  given-up call may still run here, so the trainer replaces this process.

A context name (``prompt``, ``messages``) reaches the function only when it names it or has
``**kwargs``, so that functions written before the context existed keep working. Only the standard
library is imported here: the user's code brings what it needs.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import os
import sys
import threading
import time
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
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"{target} cannot be imported as a Python module (name it *.py)")
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
                reply = bind(fn, request)
            else:
                reply = score_batch(fn, request)
        except Exception as e:  # noqa: BLE001 (reported to the trainer, which stops with it)
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write((json.dumps(reply) + "\n").encode())
        out.flush()


def is_batched(fn: Callable[..., Any]) -> bool:
    """A function of one parameter ``rows`` scores a list of rows in one call."""
    return list(inspect.signature(fn).parameters) == ["rows"]


def bind(fn: Callable[..., Any], request: dict) -> dict:
    """Whether ``fn`` can be called with the data's fields (and the context names it takes)."""
    if not is_batched(fn):
        context = [k for k in request.get("context", []) if takes(fn, k)]
        inspect.signature(fn).bind("", "", **{k: None for k in [*context, *request["bind"]]})
    return {"ok": True, "value": None}


def score_batch(fn: Callable[..., Any], request: dict) -> dict:
    """Score ``request["batch"]`` (rows of response, ground_truth and fields) with at most
    ``threads`` calls at once, each cut off after ``timeout_s``: ``values`` (None where cut off),
    ``timed_out`` (their indices) and ``stuck`` (a cut-off call may still be running here)."""
    rows, threads, timeout_s = request["batch"], request["threads"], request["timeout_s"]
    unasked = {k for k in request.get("context", []) if not takes(fn, k)}
    if is_batched(fn):
        calls = [
            lambda: fn([{"response": r["response"], "ground_truth": r["ground_truth"], **r["fields"]} for r in rows])
        ]
    else:
        calls = [
            functools.partial(
                fn, r["response"], r["ground_truth"], **{k: v for k, v in r["fields"].items() if k not in unasked}
            )
            for r in rows
        ]
    if inspect.iscoroutinefunction(fn):
        results = asyncio.run(_run_async(calls, threads, timeout_s))
    else:
        results = _run_threads(calls, threads, timeout_s)
    if is_batched(fn):
        values = results[0]
        if values is _CUT_OFF:
            values = [_CUT_OFF] * len(rows)
        elif not isinstance(values, (list, tuple)) or len(values) != len(rows):
            raise ValueError(
                f"a batched function must return one result per row ({len(rows)}); it returned {values!r:.80}"
            )
        results = list(values)
    timed_out = [i for i, v in enumerate(results) if v is _CUT_OFF]
    return {
        "ok": True,
        "values": [None if v is _CUT_OFF else _jsonable(v) for v in results],
        "timed_out": timed_out,
        "stuck": bool(timed_out) and not inspect.iscoroutinefunction(fn),
    }


_CUT_OFF = object()


async def _run_async(calls: list[Callable[[], Any]], limit: int, timeout_s: float) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Any]) -> Any:
        async with gate:
            try:
                return await asyncio.wait_for(call(), timeout_s)
            except TimeoutError:
                return _CUT_OFF

    return await asyncio.gather(*(one(c) for c in calls))


def _run_threads(calls: list[Callable[[], Any]], limit: int, timeout_s: float) -> list[Any]:
    """Run ``calls`` on up to ``limit`` threads at once. A call past ``timeout_s`` is given up (its
    thread is left to end on its own; a daemon, so it cannot keep the process alive) and its place
    goes to the next call. The first exception of a call is raised here."""
    results: list[Any] = [_CUT_OFF] * len(calls)
    errors: list[BaseException] = []
    finished = threading.Condition()
    ended: set[int] = set()
    given_up: set[int] = set()

    def run(i: int) -> None:
        try:
            value = calls[i]()
        except Exception as e:  # noqa: BLE001 (raised in the main thread)
            with finished:
                errors.append(e)
                ended.add(i)
                finished.notify()
            return
        with finished:
            if i not in given_up:
                results[i] = value
            ended.add(i)
            finished.notify()

    running: dict[int, float] = {}
    next_call = 0
    with finished:
        while True:
            now = time.monotonic()
            for i, start in list(running.items()):
                if i in ended:
                    del running[i]
                elif now - start >= timeout_s:
                    given_up.add(i)
                    del running[i]
            if errors:
                raise errors[0]
            while len(running) < limit and next_call < len(calls):
                running[next_call] = now
                threading.Thread(target=run, args=(next_call,), daemon=True).start()
                next_call += 1
            if not running:
                break
            finished.wait(max(min(running.values()) + timeout_s - now, 0.001))
    return results


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # -P left the working directory off the path; user packages live there
    serve(sys.argv[1])
