"""``rlvr sweep SPEC_FILE --out DIR``: a grid of named settings × seeds, resumable.

A sweep spec is YAML::

    name: onpolicy_variants              # optional; recorded in DIR/sweep.json
    base: ../train/gsm8k.yaml            # the base config: a path (relative to this file) or a mapping
    overrides: {eval_every: 10}          # optional: applied to the base for every setting
    plugins: [../../examples/my_estimator.py]   # optional: modules or .py files imported before training
    seeds: [0, 1, 2, 3]
    seed_field: seed                     # optional: the config field that takes the seed (default ``seed``)
    settings:                            # name -> overrides (dotted keys or nested mappings)
      grpo: {algorithm: grpo}
      dr_grpo: {algorithm: dr_grpo}
    grid:                                # optional: a cartesian product of values, crossed with settings
      lr: [1.0e-6, 3.0e-6, 1.0e-5]

Settings may also be a list of ``{name: ..., <overrides>}``. With a grid, each setting is crossed
with every grid point and named ``<setting>_<key>=<value>,...`` (just ``<key>=<value>,...`` when the
spec has no settings).

Each run lands in ``DIR/<setting>/seed_<k>/``; its resolved config (base + overrides + setting +
seed) is written to ``DIR/_sweep/configs/<setting>/seed_<k>.yaml`` and its output to
``DIR/_sweep/logs/``. Running the sweep again skips finished runs (``summary.json`` with status
``finished``) and resumes interrupted ones (a run directory without it). A run whose stored
``config.json`` disagrees with what the spec now asks for is a conflict: it is left alone and
reported, since resuming it would mix two experiments under one name (unless it stopped before its
first checkpoint: then nothing of it can be continued, and it starts again under the spec's config). A run directory locked by a
live process (a run of an earlier sweep that is still stopping, or any other ``rlvr train``) is
busy: it is left alone and reported, never raced.

Every planned run's full config is built and validated before anything runs, also with
``--dry-run``: a misspelt key or an impossible value stops the sweep with one line per setting.

``--max-parallel N`` runs up to N runs at once as subprocesses (``python -m rlvr train ...``), which
is how several small runs share one GPU; ``--devices 0 1`` spreads them over GPUs round-robin. With
N = 1 runs go one after another in this process. Ctrl-C (or SIGTERM, e.g. from ``timeout``) stops
the sweep and lets each running trainer save a checkpoint, so the same command later resumes where
it stopped (exit status 130 after Ctrl-C, 143 after SIGTERM). Each subprocess runs in its own
process group, is asked to stop (SIGTERM, by the kernel) when the sweep dies however it dies, and
its group is killed if it does not stop within the grace period. ``--dry-run`` prints the plan and
touches nothing.
``--set KEY=VALUE`` changes the base config of every setting (a model path, an engine), and
``--seeds`` / ``--settings`` select part of the grid.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rlvr import config as train_config
from rlvr.checks import resolve_config, validate_config
from rlvr.commands import train as train_command
from rlvr.config import flatten
from rlvr.config import load_config_file as load_train_config
from rlvr.errors import UserError
from rlvr.experiments.plugins import import_plugins, resolve_plugin
from rlvr.training.interrupts import Terminated, exit_code, sigterm_as_interrupt
from rlvr.training.rundir import (
    LOCK_FILE,
    RunDirLock,
    atomic_write_json,
    atomic_write_text,
    describe_holder,
    lock_holder,
)

if TYPE_CHECKING:
    # ``train_fn(config_path, out_dir, resume)``: one run, in this process.
    TrainFn = Callable[[Path, Path, bool], None]


SETTING_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=+,-]*$")
SWEEP_DIR = "_sweep"
PARENT_PID_ENV = "RLVR_PARENT_PID"
"""Set for a sweep's subprocesses: they stop when the process with this pid (the sweep) dies."""


class SweepError(UserError, ValueError):
    """A malformed sweep spec, or a planned run with an invalid config."""


# YAML 1.2 numbers (``1e-5`` is a float; PyYAML's YAML 1.1 reads a string): the trainer's own reader.
_Loader = train_config.YamlLoader


def load_yaml(path: str | Path) -> dict:
    data = train_config.load_yaml(path)
    return data if data is not None else {}


def load_config_file(path: str | Path) -> dict:
    """A config file (YAML, TOML or JSON by extension) as a dict, read as ``rlvr train --config`` reads it."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"base config {path} not found; give a path relative to the sweep spec or an inline mapping")
    return train_config.read_config_file(path)


def expand_dotted(overrides: dict) -> dict:
    """``{"optim.lr": 1e-5}`` -> ``{"optim": {"lr": 1e-5}}`` (nested mappings pass through)."""
    out: dict = {}
    for key, value in overrides.items():
        if isinstance(value, dict):
            value = expand_dotted(value)
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SweepError(f"override {key!r} goes through {part!r}, which is set to a non-mapping value")
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = deep_merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = value
    return out


def deep_merge(base: dict, overrides: dict) -> dict:
    """A new dict: ``base`` with ``overrides`` merged in recursively (override values win)."""
    out = dict(base)
    for key, value in expand_dotted(overrides).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass
class SweepSpec:
    """A parsed sweep spec (see the module docstring)."""

    base: dict
    settings: dict[str, dict]
    """Setting name -> its overrides (as written, dotted keys allowed)."""
    seeds: list[int]
    plugins: list[str] = field(default_factory=list)
    """Absolute file paths or module names."""
    seed_field: str = "seed"
    name: str = ""
    path: Path | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> SweepSpec:
        path = Path(path)
        if not path.is_file():
            raise SweepError(f"sweep spec {path} not found")
        return cls.from_dict(load_yaml(path), base_dir=path.parent, path=path)

    @classmethod
    def from_dict(cls, raw: dict, base_dir: str | Path | None = None, path: Path | None = None) -> SweepSpec:
        if not isinstance(raw, dict):
            raise SweepError("a sweep spec is a mapping with keys base, settings and/or grid, seeds")
        known = {
            "name",
            "base",
            "overrides",
            "plugins",
            "seeds",
            "seed_field",
            "settings",
            "grid",
            "notes",
            "description",
        }
        unknown = set(raw) - known
        if unknown:
            raise SweepError(f"unknown sweep spec keys {sorted(unknown)}; allowed: {sorted(known)}")
        base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
        base = raw.get("base", {})
        if isinstance(base, str):
            base_path = Path(base) if Path(base).is_absolute() else base_dir / base
            base = load_config_file(base_path)
        elif not isinstance(base, dict):
            raise SweepError("base must be a config file path or a mapping of config fields")
        base = deep_merge(base, raw.get("overrides") or {})

        settings = _parse_settings(raw.get("settings"))
        grid = raw.get("grid") or {}
        if not isinstance(grid, dict) or any(not isinstance(v, list) or not v for v in grid.values()):
            raise SweepError("grid must map config keys to non-empty lists of values")
        if grid:
            points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
            crossed = {}
            for name, over in (settings or {"": {}}).items():
                for point in points:
                    tag = ",".join(f"{k.rsplit('.', 1)[-1]}={_fmt(v)}" for k, v in point.items())
                    crossed[f"{name}_{tag}" if name else tag] = {**over, **point}
            settings = crossed
        if not settings:
            raise SweepError("the spec defines no settings: give `settings` and/or `grid`")
        for name in settings:
            if not SETTING_NAME.match(name):
                raise SweepError(f"setting name {name!r} must be usable as a directory name (letters, digits, _.=+,-)")

        seeds = raw.get("seeds", [0])
        if isinstance(seeds, int):
            seeds = list(range(seeds))
        if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
            raise SweepError("seeds must be a non-empty list of integers (or a count)")
        plugins = raw.get("plugins") or []
        if isinstance(plugins, str):
            plugins = [plugins]
        plugins = [resolve_plugin(p, base_dir) for p in plugins]
        return cls(
            base=base,
            settings=settings,
            seeds=list(seeds),
            plugins=plugins,
            seed_field=str(raw.get("seed_field", "seed")),
            name=str(raw.get("name", "")),
            path=path,
        )

    def config_for(self, setting: str, seed: int) -> dict:
        """The resolved config dict of one run."""
        return deep_merge(deep_merge(self.base, self.settings[setting]), {self.seed_field: seed})


def _parse_settings(raw: Any) -> dict[str, dict]:
    if raw is None:
        return {}
    if isinstance(raw, dict):
        out = {}
        for name, over in raw.items():
            if over is None:
                over = {}
            if not isinstance(over, dict):
                raise SweepError(f"setting {name!r} must map config keys to values, got {over!r}")
            out[str(name)] = over
        return out
    if isinstance(raw, list):
        out = {}
        for item in raw:
            if not isinstance(item, dict) or "name" not in item:
                raise SweepError("each setting in a list needs a `name`, e.g. - {name: grpo, algorithm: grpo}")
            item = dict(item)
            name = str(item.pop("name"))
            if name in out:
                raise SweepError(f"setting {name!r} appears twice")
            out[name] = item.pop("overrides", None) or item
        return out
    raise SweepError("settings must be a mapping name -> overrides or a list of {name: ..., ...}")


# ---------------------------------------------------------------------------------------------------
# Planning: what each run needs
# ---------------------------------------------------------------------------------------------------

RUN, RESUME, SKIP, CONFLICT, BUSY = "run", "resume", "skip", "conflict", "busy"


@dataclass
class PlannedRun:
    setting: str
    seed: int
    out_dir: Path
    config_path: Path
    config: dict
    action: str
    """``run`` (new), ``resume`` (interrupted), ``skip`` (finished), ``conflict`` or ``busy`` (locked)."""
    reason: str = ""

    @property
    def label(self) -> str:
        return f"{self.setting}/seed_{self.seed}"


def run_state(out_dir: Path, n_steps: int | None = None) -> tuple[str, str]:
    """``(action, reason)`` for a run directory from what it holds; a run finished short of
    ``n_steps`` (when given) is resumed."""
    summary_path = out_dir / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
            status, step = summary.get("status"), summary.get("step")
        except (OSError, json.JSONDecodeError, AttributeError):
            status = step = None
        if status == "finished":
            if n_steps is not None and isinstance(step, int) and step < n_steps:
                return RESUME, f"finished at step {step}, extended to n_steps={n_steps}"
            return SKIP, "finished"
        return RESUME, f"summary.json says status={status!r}"
    if out_dir.is_dir() and any(p.name != LOCK_FILE for p in out_dir.iterdir()):
        n = _count_lines(out_dir / "metrics.jsonl")
        return RESUME, f"interrupted after {n} logged steps" if n else "interrupted before its first step"
    return RUN, "new"


def _has_checkpoint(out_dir: Path) -> bool:
    """Whether the run saved a checkpoint (intact or set aside as damaged)."""
    root = out_dir / "checkpoints"
    return root.is_dir() and any(root.glob("step_*")) or any(root.glob("damaged-step_*"))


def _count_lines(path: Path) -> int:
    try:
        with path.open() as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _same(a: Any, b: Any) -> bool:
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)), abs(float(b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def config_conflicts(requested: dict, stored: dict) -> list[str]:
    """Dotted keys of ``requested`` whose value differs in a run's stored (resolved) ``config.json``.

    Values the trainer fills in while resolving are not compared: a key the stored config lacks or
    holds as None, and a requested None or ``auto``.
    """
    flat_stored = flatten(stored)
    out = []
    for key, value in flatten(requested).items():
        theirs = flat_stored.get(key)
        if value is None or value == "auto" or theirs is None:
            continue
        if not _same(value, theirs):
            out.append(f"{key}: spec {value!r} != run {theirs!r}")
    return out


def plan(
    spec: SweepSpec, out: str | Path, seeds: Sequence[int] | None = None, settings: Sequence[str] | None = None
) -> list[PlannedRun]:
    """Every (setting, seed) run of the sweep with what to do about it, in spec order."""
    out = Path(out)
    seeds = list(seeds) if seeds else spec.seeds
    names = list(spec.settings)
    if settings:
        missing = [s for s in settings if s not in spec.settings]
        if missing:
            raise SweepError(f"unknown settings {missing}; the spec has {names}")
        names = [n for n in names if n in settings]
    planned = []
    for name in names:
        for seed in seeds:
            out_dir = out / name / f"seed_{seed}"
            config = spec.config_for(name, seed)
            n_steps = config.get("n_steps", train_config.TrainConfig.n_steps)
            action, reason = run_state(out_dir, n_steps if isinstance(n_steps, int) else None)
            stored_path = out_dir / "config.json"
            holder = lock_holder(out_dir)
            if holder is not None:
                action, reason = BUSY, f"in use by {describe_holder(holder)}; run the sweep again once it has ended"
            elif action != RUN and stored_path.is_file():
                try:
                    stored = json.loads(stored_path.read_text())
                except (OSError, json.JSONDecodeError):
                    stored = {}
                diffs = config_conflicts(config, stored)
                if diffs and not _has_checkpoint(out_dir):
                    # Nothing of it can be continued anyway: it starts again under the spec's config.
                    action, reason = RUN, "stopped before its first checkpoint under another config; starts again"
                elif diffs:
                    action, reason = CONFLICT, "stored config.json differs from the spec: " + "; ".join(diffs)
            planned.append(
                PlannedRun(
                    setting=name,
                    seed=seed,
                    out_dir=out_dir,
                    config_path=out / SWEEP_DIR / "configs" / name / f"seed_{seed}.yaml",
                    config=config,
                    action=action,
                    reason=reason,
                )
            )
    return planned


def format_plan(planned: Sequence[PlannedRun]) -> str:
    width = max([len(p.label) for p in planned] + [10])
    lines = [f"{p.action:<8} {p.label:<{width}}  {p.reason}" for p in planned]
    n = {a: sum(p.action == a for p in planned) for a in (RUN, RESUME, SKIP, CONFLICT, BUSY)}
    line = f"{n[RUN]} to run, {n[RESUME]} to resume, {n[SKIP]} finished (skipped), {n[CONFLICT]} conflicts"
    lines.append(line + (f", {n[BUSY]} busy" if n[BUSY] else ""))
    return "\n".join(lines)


def check_configs(planned: Sequence[PlannedRun]) -> list[str]:
    """Build and validate every planned run's config as ``rlvr train`` will (import the spec's
    plugins first). Raises ``SweepError`` with one line per setting whose config is invalid;
    returns the warnings, once each, with the settings they concern."""
    import warnings

    errors: dict[tuple[str, str], list[int]] = {}
    notes: dict[str, list[str]] = {}
    for p in planned:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # returned below, once per message instead of once per run
                warns = validate_config(resolve_config(train_config.TrainConfig.from_dict(p.config)))
        except train_config.ConfigError as e:
            message = " ".join(line.strip() for line in str(e).splitlines())
            errors.setdefault((p.setting, message), []).append(p.seed)
            continue
        for w in warns:
            if p.setting not in notes.setdefault(w, []):
                notes[w].append(p.setting)
    if errors:
        lines = [
            f"{setting} (seed {', '.join(map(str, seeds))}): {message}" for (setting, message), seeds in errors.items()
        ]
        raise SweepError(f"{len(lines)} setting(s) have an invalid config; fix the spec:\n  " + "\n  ".join(lines))
    return [f"{w} (settings: {', '.join(settings)})" for w, settings in notes.items()]


# ---------------------------------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------------------------------


def train_argv(config_path: Path, out_dir: Path, resume: bool) -> list[str]:
    """The ``rlvr train`` arguments that start or resume one run.

    ``rlvr train --resume DIR`` continues from ``DIR/config.json``; a run interrupted before it wrote
    that file has nothing to continue and starts afresh from the sweep's config.
    """
    if resume and (out_dir / "config.json").is_file():
        return ["train", "--resume", str(out_dir)]
    return ["train", "--config", str(config_path), "--out", str(out_dir)]


def train_in_process(config_path: Path, out_dir: Path, resume: bool) -> None:
    """Train one run in this process with ``rlvr.commands.train.train`` (which refuses to resume a run whose
    saved config differs in anything but its length, cadences and logging)."""

    train_command.train(load_train_config(config_path), out_dir, resume=resume)


def subprocess_command(p: PlannedRun, plugins: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command line of one run in its own process: plugins first, then ``rlvr train``."""
    cmd = [python, "-m", "rlvr.experiments.plugins"]
    for plugin in plugins:
        cmd += ["--plugin", plugin]
    return cmd + ["--"] + train_argv(p.config_path, p.out_dir, p.action == RESUME)


@dataclass
class Outcome:
    run: PlannedRun
    ok: bool
    seconds: float
    message: str = ""


def _write_config(p: PlannedRun) -> None:
    p.config_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p.config_path, yaml.safe_dump(p.config, sort_keys=False))


def _log_path(out: Path, p: PlannedRun) -> Path:
    path = out / SWEEP_DIR / "logs" / p.setting / f"seed_{p.seed}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory")
_LOG_TAIL_BYTES = 64 * 1024


def _ran_out_of_gpu_memory(log_path: Path) -> bool:
    """Whether a failed run's log ends in a GPU out-of-memory error (its last traceback)."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    return any(marker in tail for marker in _OOM_MARKERS)


def oom_hint(max_parallel: int, devices: Sequence[str] | None) -> str:
    """What to change when parallel runs that share a GPU run it out of memory."""
    sharing = -(-max_parallel // len(devices)) if devices else max_parallel
    return (
        f"it ran out of GPU memory with up to {sharing} runs sharing a GPU: run the same command again with a "
        "lower --max-parallel (or more --devices); finished runs are skipped and failed ones run again"
    )


def _release_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def execute(
    planned: Sequence[PlannedRun],
    out: str | Path,
    plugins: Sequence[str] = (),
    max_parallel: int = 1,
    devices: Sequence[str] | None = None,
    train_fn: Callable[[Path, Path, bool], None] | None = None,
    python: str = sys.executable,
    echo: Callable[[str], None] = print,
) -> list[Outcome]:
    """Run every planned ``run``/``resume`` (skips and conflicts are left alone).

    ``max_parallel`` = 1 trains in this process with ``train_fn`` (default: the ``rlvr train`` entry
    point); more launches that many subprocesses at a time, each with ``CUDA_VISIBLE_DEVICES`` set
    round-robin from ``devices`` when given. A failing run is reported and the others go on.
    """
    out = Path(out)
    todo = [p for p in planned if p.action in (RUN, RESUME)]
    for p in todo:
        _write_config(p)
    if max_parallel <= 1:
        import_plugins(plugins)
        with sigterm_as_interrupt():  # the run in progress saves a checkpoint, as for Ctrl-C
            return _execute_in_process(todo, out, train_fn or train_in_process, echo)
    return _execute_parallel(todo, out, plugins, max_parallel, devices, python, echo)


def _execute_in_process(
    todo: list[PlannedRun], out: Path, train_fn: TrainFn, echo: Callable[[str], None]
) -> list[Outcome]:
    outcomes = []
    for i, p in enumerate(todo, 1):
        echo(f"[{i}/{len(todo)}] {p.action} {p.label}")
        start = time.time()
        try:
            train_fn(p.config_path, p.out_dir, p.action == RESUME)
            outcomes.append(Outcome(p, True, time.time() - start))
        except SystemExit as e:  # a CLI entry point may exit instead of returning
            ok = e.code in (None, 0)
            outcomes.append(Outcome(p, ok, time.time() - start, "" if ok else f"exited with status {e.code}"))
        except Exception as e:
            echo(f"  {p.label} failed: {e}")
            _log_path(out, p).write_text(traceback.format_exc())
            outcomes.append(Outcome(p, False, time.time() - start, f"{type(e).__name__}: {e}"))
        finally:
            _release_memory()
    return outcomes


def _execute_parallel(
    todo: list[PlannedRun],
    out: Path,
    plugins: Sequence[str],
    max_parallel: int,
    devices: Sequence[str] | None,
    python: str,
    echo: Callable[[str], None],
) -> list[Outcome]:
    pending = list(todo)
    running: dict[int, tuple[subprocess.Popen, PlannedRun, float, Any]] = {}
    free_slots = list(range(max_parallel))
    outcomes: list[Outcome] = []
    env_base = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
    stop: list[int] = []  # the signal that asked us to stop
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C, or SIGTERM from a `timeout` or job scheduler: children run in their own sessions and
        # would outlive us, so both stop them cleanly. The handler only records the signal, which the
        # loop checks between polls: an exception raised at an arbitrary point could leave a Popen's
        # internal lock taken (inside poll) and make the wait for that child hang.
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.append(signum))
    try:
        while pending or running:
            if stop:
                raise Terminated() if stop[0] == signal.SIGTERM else KeyboardInterrupt()
            while pending and free_slots:
                slot, p = free_slots.pop(0), pending.pop(0)
                env = dict(env_base)
                if devices:
                    env["CUDA_VISIBLE_DEVICES"] = str(devices[slot % len(devices)])
                cmd = subprocess_command(p, plugins, python)
                log = _log_path(out, p).open("w")
                log.write("$ " + shlex.join(cmd) + "\n")
                log.flush()
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                running[slot] = (proc, p, time.time(), log)
                where = f" on device {env['CUDA_VISIBLE_DEVICES']}" if devices else ""
                echo(f"started {p.action} {p.label}{where} (pid {proc.pid})")
            time.sleep(0.2)
            for slot in list(running):
                proc, p, start, log = running[slot]
                rc = proc.poll()
                if rc is None:
                    continue
                log.close()
                del running[slot]
                free_slots.append(slot)
                ok = rc == 0
                msg = ""
                if not ok:
                    log_path = _log_path(out, p)
                    msg = f"exit status {rc}; see {log_path}"
                    if _ran_out_of_gpu_memory(log_path):
                        msg += f": {oom_hint(max_parallel, devices)}"
                echo(f"{'finished' if ok else 'FAILED'} {p.label} in {time.time() - start:.0f}s {msg}".rstrip())
                outcomes.append(Outcome(p, ok, time.time() - start, msg))
    except KeyboardInterrupt:
        _stop_children(running.values(), echo)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return outcomes


def _stop_children(
    running: Iterable[tuple[subprocess.Popen, PlannedRun, float, Any]],
    echo: Callable[[str], None],
    grace_s: float = 120.0,
) -> None:
    """Ctrl-C each child (the trainer then finishes its step and saves a checkpoint, so the next
    sweep resumes it), wait up to ``grace_s``, then kill what is left of its process group (the
    child and anything it started, such as an engine worker)."""
    running = list(running)
    for proc, p, _, _ in running:
        if proc.poll() is None:
            echo(f"interrupting {p.label} (pid {proc.pid}); it saves a checkpoint and is resumed next time")
            proc.send_signal(signal.SIGINT)
    deadline = time.time() + grace_s
    for proc, p, _, log in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            echo(f"{p.label} (pid {proc.pid}) did not stop within {grace_s:.0f}s; killing its process group")
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is the child's pid
            except ProcessLookupError:
                pass
            proc.wait()
        log.close()


def record_sweep(spec: SweepSpec, out: Path, planned: Sequence[PlannedRun], argv: Sequence[str]) -> None:
    """Write ``DIR/sweep.json``: the spec as resolved, each setting's overrides and the commands run."""
    path = out / "sweep.json"
    previous = {}
    if path.is_file():
        try:
            previous = json.loads(path.read_text())
        except json.JSONDecodeError:
            previous = {}
    invocations = previous.get("invocations", [])
    invocations.append(
        {
            "time": _dt.datetime.now().isoformat(timespec="seconds"),
            "command": shlex.join(["rlvr", "sweep", *argv]),
            "actions": {p.label: p.action for p in planned},
        }
    )
    record = {
        "name": spec.name,
        "spec_path": str(spec.path) if spec.path else None,
        "seeds": spec.seeds,
        "seed_field": spec.seed_field,
        "plugins": spec.plugins,
        "settings": spec.settings,
        "base": spec.base,
        "invocations": invocations,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record, default=str)


def parse_assignments(items: Sequence[str]) -> dict:
    """``["model.name_or_path=runs/warm", "optim.lr=1e-4"]`` -> overrides (values read as YAML)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SweepError(f"--set expects KEY=VALUE (e.g. model.name_or_path=runs/warm_start), got {item!r}")
        out[key.strip()] = yaml.load(value, Loader=_Loader) if value.strip() else ""
    return out


def run_sweep(
    spec: SweepSpec | str | Path,
    out: str | Path,
    dry_run: bool = False,
    max_parallel: int = 1,
    seeds: Sequence[int] | None = None,
    settings: Sequence[str] | None = None,
    devices: Sequence[str] | None = None,
    base_overrides: dict | None = None,
    train_fn: TrainFn | None = None,
    argv: Sequence[str] = (),
    echo: Callable[[str], None] = print,
) -> tuple[list[PlannedRun], list[Outcome]]:
    """Plan the sweep, print the plan, and (unless ``dry_run``) run what is not finished.

    ``base_overrides`` (``--set``) change the base config of every setting, before the settings'
    own overrides (a setting's value wins). Every planned run's config is validated first
    (``check_configs``), dry run or not."""
    if not isinstance(spec, SweepSpec):
        spec = SweepSpec.from_file(spec)
    if base_overrides:
        spec = dataclasses.replace(spec, base=deep_merge(spec.base, base_overrides))
    out = Path(out)
    planned = plan(spec, out, seeds=seeds, settings=settings)
    import_plugins(spec.plugins)  # they may register the names that the configs use
    notes = check_configs(planned)
    echo(format_plan(planned))
    for note in notes:
        echo(f"warning: {note}")
    if dry_run:
        return planned, []
    # One sweep at a time writes OUT/_sweep (its record and its runs' configs and logs); each run
    # locks its own directory.
    with RunDirLock(out / SWEEP_DIR, command=shlex.join(["rlvr", "sweep", *argv])[:200]):
        record_sweep(spec, out, planned, argv)
        outcomes = execute(
            planned, out, plugins=spec.plugins, max_parallel=max_parallel, devices=devices, train_fn=train_fn, echo=echo
        )
    for p in planned:
        if p.action == CONFLICT:
            echo(f"conflict, left alone: {p.label}: {p.reason}; use another --out or delete the run to redo it")
        if p.action == BUSY:
            echo(f"busy, left alone: {p.label}: {p.reason}")
    return planned, outcomes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlvr sweep", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("spec", type=Path, help="sweep spec YAML (see configs/sweeps/)")
    parser.add_argument("--out", type=Path, required=True, help="sweep directory: runs land in OUT/<setting>/seed_<k>/")
    parser.add_argument("--dry-run", action="store_true", help="list what would run, resume or be skipped; run nothing")
    parser.add_argument(
        "--max-parallel",
        type=int,
        default=1,
        help="runs at once; >1 launches subprocesses (several small runs can share one GPU; a run that runs it out of memory says so)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="override the spec's seeds")
    parser.add_argument("--settings", nargs="+", help="run only these settings")
    parser.add_argument("--devices", nargs="+", help="CUDA devices to spread parallel runs over, round-robin")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override the base config of every setting, e.g. --set model.name_or_path=runs/warm",
    )
    return parser


def main(argv: list[str] | None = None, *, train_fn: TrainFn | None = None) -> int:
    """``rlvr sweep``; ``train_fn`` replaces the in-process run (``run_sweep``). Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        planned, outcomes = run_sweep(
            args.spec,
            args.out,
            dry_run=args.dry_run,
            max_parallel=args.max_parallel,
            seeds=args.seeds,
            settings=args.settings,
            devices=args.devices,
            base_overrides=parse_assignments(args.set),
            train_fn=train_fn,
            argv=argv,
        )
    except (UserError, FileNotFoundError) as e:
        print(f"rlvr sweep: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt as e:
        print(
            f"rlvr sweep: {'stopped by SIGTERM' if isinstance(e, Terminated) else 'interrupted'}; the runs in "
            "progress saved a checkpoint: run the same command again to resume",
            file=sys.stderr,
        )
        return exit_code(e)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        print(f"{len(failed)} run(s) failed: " + ", ".join(o.run.label for o in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
