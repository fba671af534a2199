"""CPU tests for ``rlvr sweep``: spec parsing, planning (run / skip / resume / conflict), in-process and
parallel subprocess execution with plugins, and an end-to-end sweep of 2 settings x 2 seeds with the
real trainer on a tiny model (runs, is skipped on the second call, resumes an interrupted run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from rlvr.checks import resolve_config, validate_config
from rlvr.experiments import load_runs
from rlvr.experiments import sweep as sweep_module
from rlvr.experiments.sweep import (
    CONFLICT,
    RESUME,
    RUN,
    SKIP,
    SweepError,
    SweepSpec,
    deep_merge,
    plan,
    run_sweep,
    train_argv,
)
from rlvr.experiments.sweep import (
    main as sweep_main,
)
from rlvr.training.scaffold import TrainCallback

# A stand-in trainer with the real one's run-directory contract. Used in-process (exec'd) and as a
# plugin file in subprocesses, where it replaces the `train` command of `rlvr`.
FAKE_TRAINER = """
import argparse, builtins, json, os, sys, time
from pathlib import Path

import yaml


def fake_train(config_path, out_dir, resume, stop_at=None):
    out = Path(out_dir)
    if config_path is not None:
        cfg = yaml.safe_load(Path(config_path).read_text())
    else:
        cfg = json.loads((out / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    metrics = out / "metrics.jsonl"
    rows = []
    if resume and metrics.is_file():
        rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    start = rows[-1]["step"] + 1 if rows else 0
    with metrics.open("a" if rows else "w") as f:
        for step in range(start, cfg["n_steps"]):
            if stop_at is not None and step == stop_at:
                raise KeyboardInterrupt
            f.write(json.dumps({"step": step, "train/reward": cfg["seed"] + step * cfg["optim"]["lr"],
                                "val/reward": 0.1 * cfg["seed"]}) + "\\n")
            f.flush()
            (out / "checkpoints" / f"step_{step:06d}").mkdir(parents=True, exist_ok=True)
            time.sleep(float(os.environ.get("FAKE_TRAINER_SLEEP", 0)))
    (out / "summary.json").write_text(json.dumps({"status": "finished", "marker": getattr(builtins, "_sweep_marker", None),
                                                  "resumed_from": start}))


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--out")
    p.add_argument("--resume")
    a = p.parse_args(argv)
    out = Path(a.resume or a.out)
    try:
        fake_train(a.config, out, bool(a.resume))
    except KeyboardInterrupt:  # as the real trainer: record the interruption, exit 130
        (out / "summary.json").write_text(json.dumps({"status": "interrupted"}))
        return 130
    return 0


import rlvr.cli
rlvr.cli.COMMANDS["train"] = (__name__, "fake trainer for tests")
"""


@pytest.fixture()
def fake(monkeypatch):
    import rlvr.cli

    # The fake module re-points `rlvr train` (for subprocesses that import it as a plugin); in this
    # process the real command must come back after the test.
    monkeypatch.setitem(rlvr.cli.COMMANDS, "train", rlvr.cli.COMMANDS["train"])
    namespace: dict = {"__name__": "fake_trainer_inline"}
    exec(FAKE_TRAINER, namespace)
    return namespace["fake_train"]


def write_spec(path: Path, **extra) -> Path:
    spec = {
        "name": "toy",
        "base": {"n_steps": 3, "optim": {"lr": 1.0, "betas": [0.9, 0.95]}},
        "seeds": [0, 1],
        "settings": {"a": {"optim.lr": 2.0}, "b": {"optim": {"lr": 3.0}}},
    }
    spec.update(extra)
    path.write_text(yaml.safe_dump(spec))
    return path


# -------------------------------------------------------------------------------------------------
# Spec parsing
# -------------------------------------------------------------------------------------------------


def test_spec_settings_grid_and_dotted_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("optim:\n  lr: 1.0e-5\n  betas: [0.9, 0.95]\nn_steps: 10\n")
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(
        "base: base.yaml\n"
        "overrides: {eval_every: 5}\n"
        "seeds: 2\n"
        "settings:\n  - {name: grpo, algorithm.preset: grpo}\n  - {name: dr, overrides: {algorithm: {preset: dr_grpo}}}\n"
        "grid:\n  optim.lr: [1e-6, 3e-6]\n"
    )
    spec = SweepSpec.from_file(spec_path)
    assert list(spec.settings) == ["grpo_lr=1e-06", "grpo_lr=3e-06", "dr_lr=1e-06", "dr_lr=3e-06"]
    assert spec.seeds == [0, 1]
    cfg = spec.config_for("dr_lr=3e-06", 1)
    assert cfg == {
        "optim": {"lr": 3e-6, "betas": [0.9, 0.95]},
        "n_steps": 10,
        "eval_every": 5,
        "algorithm": {"preset": "dr_grpo"},
        "seed": 1,
    }
    assert isinstance(cfg["optim"]["lr"], float)  # YAML 1.1 would read 1e-6 as a string


def test_spec_errors_name_the_problem(tmp_path):
    with pytest.raises(SweepError, match="unknown sweep spec keys"):
        SweepSpec.from_dict({"settings": {"a": {}}, "setings": {}})
    with pytest.raises(SweepError, match="directory name"):
        SweepSpec.from_dict({"settings": {"a/b": {}}})
    with pytest.raises(SweepError, match="no settings"):
        SweepSpec.from_dict({"base": {}})
    with pytest.raises(SweepError, match="not found"):
        SweepSpec.from_dict({"base": "missing.yaml", "settings": {"a": {}}}, base_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="plugin"):
        SweepSpec.from_dict({"settings": {"a": {}}, "plugins": ["nope.py"]}, base_dir=tmp_path)


def test_deep_merge_keeps_siblings():
    assert deep_merge({"a": {"x": 1, "y": 2}, "b": 0}, {"a.x": 5, "c": {"d.e": 1}}) == {
        "a": {"x": 5, "y": 2},
        "b": 0,
        "c": {"d": {"e": 1}},
    }


# -------------------------------------------------------------------------------------------------
# Planning and in-process execution with a fake trainer
# -------------------------------------------------------------------------------------------------


def test_dry_run_lists_and_touches_nothing(tmp_path, capsys):
    spec = write_spec(tmp_path / "s.yaml")
    out = tmp_path / "sweep"
    assert sweep_main([str(spec), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "run      a/seed_0" in text and "run      b/seed_1" in text
    assert "4 to run, 0 to resume, 0 finished (skipped), 0 conflicts" in text
    assert not out.exists()


def test_run_skip_resume_and_conflict(tmp_path, fake):
    spec = write_spec(tmp_path / "s.yaml")
    out = tmp_path / "sweep"
    calls = []

    def train_fn(config_path, out_dir, resume):
        calls.append((out_dir.relative_to(out).as_posix(), resume))
        stop = 1 if out_dir.relative_to(out).as_posix() == "b/seed_1" and len(calls) == 4 else None
        fake(config_path, out_dir, resume, stop_at=stop)

    with pytest.raises(KeyboardInterrupt):  # the last run is interrupted after logging step 0
        run_sweep(spec, out, train_fn=train_fn, echo=lambda s: None)
    assert calls == [("a/seed_0", False), ("a/seed_1", False), ("b/seed_0", False), ("b/seed_1", False)]
    assert not (out / "b" / "seed_1" / "summary.json").exists()

    planned = {p.label: p for p in plan(SweepSpec.from_file(spec), out)}
    assert {k: p.action for k, p in planned.items()} == {
        "a/seed_0": SKIP,
        "a/seed_1": SKIP,
        "b/seed_0": SKIP,
        "b/seed_1": RESUME,
    }
    assert "after 1 logged steps" in planned["b/seed_1"].reason

    calls.clear()
    _, outcomes = run_sweep(spec, out, train_fn=train_fn, echo=lambda s: None)
    assert calls == [("b/seed_1", True)] and all(o.ok for o in outcomes)
    summary = json.loads((out / "b" / "seed_1" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["resumed_from"] == 1
    steps = [json.loads(l)["step"] for l in (out / "b" / "seed_1" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]

    calls.clear()
    run_sweep(spec, out, train_fn=train_fn, echo=lambda s: None)
    assert calls == []  # everything finished: nothing runs

    # The resolved per-run config is base + setting + seed; sweep.json records the commands.
    cfg = yaml.safe_load((out / "_sweep" / "configs" / "b" / "seed_1.yaml").read_text())
    assert cfg == {"n_steps": 3, "optim": {"lr": 3.0, "betas": [0.9, 0.95]}, "seed": 1}
    record = json.loads((out / "sweep.json").read_text())
    assert record["name"] == "toy" and len(record["invocations"]) == 3
    assert [r.setting for r in load_runs(out)] == ["a", "a", "b", "b"]  # _sweep/ is not a run

    # Changing a setting's value under the same name is a conflict, not a silent resume.
    (out / "a" / "seed_0" / "summary.json").unlink()
    write_spec(spec, settings={"a": {"optim.lr": 5.0}, "b": {"optim": {"lr": 3.0}}})
    planned = {p.label: p for p in plan(SweepSpec.from_file(spec), out)}
    assert planned["a/seed_0"].action == CONFLICT and "optim.lr" in planned["a/seed_0"].reason
    calls.clear()
    run_sweep(spec, out, train_fn=train_fn, echo=lambda s: None)
    assert calls == []


def test_failed_run_is_reported_and_others_continue(tmp_path, fake):
    spec = write_spec(tmp_path / "s.yaml", seeds=[0])

    def train_fn(config_path, out_dir, resume):
        if out_dir.parent.name == "a":
            raise RuntimeError("boom")
        fake(config_path, out_dir, resume)

    _, outcomes = run_sweep(spec, tmp_path / "out", train_fn=train_fn, echo=lambda s: None)
    assert [(o.run.label, o.ok) for o in outcomes] == [("a/seed_0", False), ("b/seed_0", True)]
    assert "boom" in (tmp_path / "out" / "_sweep" / "logs" / "a" / "seed_0.log").read_text()


def test_train_argv_resume_reads_saved_config(tmp_path):
    run = tmp_path / "r"
    assert train_argv(Path("c.yaml"), run, resume=True) == ["train", "--config", "c.yaml", "--out", str(run)]
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert train_argv(Path("c.yaml"), run, resume=True) == ["train", "--resume", str(run)]


def test_parallel_subprocesses_import_plugins(tmp_path, fake):
    """--max-parallel 2: runs go to subprocesses, which import every plugin before `rlvr train`.
    (The sweep imports them too, to validate the configs: ``fake`` restores `rlvr train` afterwards.)"""
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    (tmp_path / "marker.py").write_text("import builtins\nbuiltins._sweep_marker = 'imported'\n")
    spec = write_spec(tmp_path / "s.yaml", plugins=["fake_trainer.py", "marker.py"])
    out = tmp_path / "out"
    assert sweep_main([str(spec), "--out", str(out), "--max-parallel", "2", "--seeds", "3", "--settings", "b"]) == 0
    summary = json.loads((out / "b" / "seed_3" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["marker"] == "imported"
    assert not (out / "a").exists()
    log = (out / "_sweep" / "logs" / "b" / "seed_3.log").read_text()
    assert "rlvr.experiments.plugins --plugin" in log and sys.executable in log


OOM_TRAINER = """
import torch

import rlvr.cli


def main(argv):
    if "/b/" in " ".join(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return 0


rlvr.cli.COMMANDS["train"] = (__name__, "a trainer that runs out of GPU memory in setting b")
"""


def test_parallel_run_out_of_gpu_memory_names_max_parallel(tmp_path, fake):
    """A subprocess run that dies of a GPU out-of-memory error is reported with what to change
    (runs sharing one GPU: --max-parallel); a run that fails otherwise gets no such hint."""
    (tmp_path / "oom_trainer.py").write_text(OOM_TRAINER)
    spec = write_spec(tmp_path / "s.yaml", plugins=["oom_trainer.py"])
    out, lines = tmp_path / "out", []
    _, outcomes = run_sweep(spec, out, max_parallel=3, seeds=[0], echo=lines.append)
    by_label = {o.run.label: o for o in outcomes}
    assert by_label["a/seed_0"].ok and not by_label["b/seed_0"].ok
    message = by_label["b/seed_0"].message
    assert "ran out of GPU memory with up to 3 runs sharing a GPU" in message and "--max-parallel" in message
    assert any(line.startswith("FAILED b/seed_0") and "--max-parallel" in line for line in lines)

    # Spread over two devices, at most two of the three runs share one.
    assert "up to 2 runs sharing" in sweep_module.oom_hint(3, ["0", "1"])
    # Another failure: no memory hint.
    log = tmp_path / "other.log"
    log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    assert not sweep_module._ran_out_of_gpu_memory(log)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_sigterm_interrupts_children_cleanly(tmp_path, signame):
    """A sweep stopped by SIGTERM (a `timeout`) or SIGINT (Ctrl-C) Ctrl-Cs its subprocess runs, which
    record the interruption, and none outlives it; the next call resumes them."""
    import os
    import signal
    import subprocess
    import time

    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    spec = write_spec(tmp_path / "s.yaml", plugins=["fake_trainer.py"], base={"n_steps": 10_000, "optim": {"lr": 1.0}})
    out = tmp_path / "out"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "rlvr", "sweep", str(spec), "--out", str(out), "--max-parallel", "2", "--seeds", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "FAKE_TRAINER_SLEEP": "0.05"},
    )
    metrics = [out / s / "seed_0" / "metrics.jsonl" for s in ("a", "b")]
    deadline = time.time() + 60
    while not all(m.is_file() and m.stat().st_size for m in metrics) and time.time() < deadline:
        time.sleep(0.1)
    sweep.send_signal(getattr(signal, signame))
    output, _ = sweep.communicate(timeout=60)
    assert sweep.returncode != 0
    assert "interrupting a/seed_0" in output and "interrupting b/seed_0" in output, output
    for s in ("a", "b"):
        assert json.loads((out / s / "seed_0" / "summary.json").read_text())["status"] == "interrupted"
    pids = [int(line.rsplit("pid ", 1)[1].rstrip(")")) for line in output.splitlines() if line.startswith("started")]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    planned = plan(SweepSpec.from_file(spec), out, seeds=[0])
    assert [p.action for p in planned] == [RESUME, RESUME]


# -------------------------------------------------------------------------------------------------
# End to end with the real trainer on a tiny model
# -------------------------------------------------------------------------------------------------

TINY_BASE = {
    "model": {"fresh": "tiny", "tokenizer_vocab_size": 300},
    "data": {"train_source": "arith:steps=1,max_value=9", "train_size": 32, "val_split": "validation", "val_size": 2},
    "rollout": {"n_prompts_per_rollout_batch": 2, "group_size": 2, "max_new_tokens": 6},
    "optim": {"gradient_accumulation_steps": 1, "lr": 1.0e-3},
    "engine": {"max_batch_size": 8},
    "log": {"progress": False, "val_samples": 2, "engine_logprob_check_every": 0},
    "n_steps": 4,
    "eval_every": 2,
    "dump_every": 2,
    "save_every": 2,
}


def train_with(*callbacks):
    """A sweep's in-process ``train_fn`` that runs the real trainer with ``callbacks``."""
    from rlvr.commands.train import train
    from rlvr.config import load_config_file

    def train_fn(config_path, out_dir, resume):
        train(load_config_file(config_path), out_dir, resume=resume, callbacks=callbacks)

    return train_fn


def test_end_to_end_real_trainer(tmp_path, monkeypatch):
    trainer = pytest.importorskip("rlvr.commands.train")
    spec = tmp_path / "tiny.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "tiny e2e",
                "base": TINY_BASE,
                "seeds": [0, 1],
                "settings": {"grpo": {"algorithm.preset": "grpo"}, "dr_grpo": {"algorithm.preset": "dr_grpo"}},
            },
            sort_keys=False,
        )
    )
    out = tmp_path / "sweep"
    victim = out / "dr_grpo" / "seed_1"

    class InterruptVictim(TrainCallback):
        def on_step_begin(self, step, run_dir):
            if run_dir == victim and step == 3:
                raise KeyboardInterrupt  # as Ctrl-C between steps: the trainer saves step 2 and re-raises

    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, out, train_fn=train_with(InterruptVictim()), echo=lambda s: None)
    for setting in ("grpo", "dr_grpo"):
        for seed in (0, 1):
            summary = json.loads((out / setting / f"seed_{seed}" / "summary.json").read_text())
            assert summary["status"] == ("interrupted" if (setting, seed) == ("dr_grpo", 1) else "finished")
    before = (victim / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["step"] for l in before] == [0, 1, 2]

    planned, _ = run_sweep(spec, out, dry_run=True, echo=lambda s: None)
    assert [(p.label, p.action) for p in planned] == [
        ("grpo/seed_0", SKIP),
        ("grpo/seed_1", SKIP),
        ("dr_grpo/seed_0", SKIP),
        ("dr_grpo/seed_1", RESUME),
    ]

    planned, outcomes = run_sweep(spec, out, echo=lambda s: None)
    assert [(o.run.label, o.ok) for o in outcomes] == [("dr_grpo/seed_1", True)]
    after = (victim / "metrics.jsonl").read_text().splitlines()
    assert after[:3] == before  # continued from the step-2 checkpoint, not restarted
    assert [json.loads(l)["step"] for l in after] == [0, 1, 2, 3, 4]
    assert json.loads((victim / "summary.json").read_text())["status"] == "finished"

    def must_not_train(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(trainer, "train", must_not_train)
    planned, outcomes = run_sweep(spec, out, echo=lambda s: None)
    assert outcomes == [] and all(p.action == SKIP for p in planned)

    runs = load_runs(out)
    assert sorted({r.setting for r in runs}) == ["dr_grpo", "grpo"]
    assert all(r.finished and r.final("val/reward")[0] == 4 for r in runs)
    assert {r.config["algorithm"]["preset"] for r in runs if r.setting == "dr_grpo"} == {"dr_grpo"}
    assert {r.config["seed"] for r in runs} == {0, 1}

    from rlvr.experiments.report import write_report

    report = write_report([out], tmp_path / "report.md")
    text = report.read_text()
    assert "| grpo |" in text and "| dr_grpo |" in text and "tiny e2e" in text
    assert (tmp_path / "report_figures" / "overview.png").stat().st_size > 10_000


# -------------------------------------------------------------------------------------------------
# The shipped sweep specs
# -------------------------------------------------------------------------------------------------

SWEEPS = Path(__file__).resolve().parents[2] / "configs" / "sweeps"
SHIPPED = sorted(p for p in SWEEPS.glob("*.yaml") if not p.name.startswith("base_"))


def test_shipped_suites_exist():
    names = {p.stem for p in SHIPPED}
    for suite in ("main", "lr", "prompts", "onpolicy", "offpolicy"):
        assert {f"{suite}_gsm8k", f"{suite}_arith"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_specs_give_valid_train_configs(path, recwarn):
    """Every run of every shipped spec is a valid TrainConfig (unknown keys, bad presets or batch sizes fail here)."""
    config_mod = pytest.importorskip("rlvr.config")
    from rlvr.experiments.plugins import import_plugins

    spec = SweepSpec.from_file(path)
    import_plugins(spec.plugins)
    gpu_suite = not path.stem.endswith("_cpu")  # the *_cpu specs are one-seed CPU estimator studies
    assert spec.name and (len(spec.seeds) == 4 or not gpu_suite)
    for setting in spec.settings:
        cfg = resolve_config(config_mod.TrainConfig.from_dict(spec.config_for(setting, spec.seeds[-1])))
        validate_config(cfg)
        assert cfg.seed == spec.seeds[-1]
        if path.stem.startswith("offpolicy") and gpu_suite:
            assert cfg.updates_per_rollout_batch == 32 and cfg.rollout_batch_size == 256 and cfg.microbatch_size == 8


def test_shipped_onpolicy_and_offpolicy_settings():
    onp = SweepSpec.from_file(SWEEPS / "onpolicy_arith.yaml")
    assert [s["algorithm.preset"] for s in onp.settings.values()] == [
        "grpo",
        "grpo_constant",
        "dr_grpo",
        "rft",
        "maxrl",
    ]
    off = SweepSpec.from_file(SWEEPS / "offpolicy_arith.yaml")
    assert {k: v["algorithm.reweighting"] for k, v in off.settings.items()} == {
        "none": "none",
        "noclip": "noclip",
        "grpo_clip": "grpo",
        "gspo": "gspo",
        "cispo": "cispo",
        "clip_higher": "ppo_clip",
    }
    clip_higher = off.settings["clip_higher"]
    assert (clip_higher["algorithm.cliprange_low"], clip_higher["algorithm.cliprange_high"]) == (0.2, 0.28)
    assert not off.plugins  # clip-higher is a config now: nothing to import
    assert off.settings["gspo"]["algorithm.cliprange"] == pytest.approx(3e-4)
    lr = SweepSpec.from_file(SWEEPS / "lr_gsm8k.yaml")
    assert [s["optim.lr"] for s in lr.settings.values()] == pytest.approx([3e-6, 1e-5, 3e-5, 1e-4])


def test_set_overrides_the_base_of_every_setting(tmp_path, capsys):
    out = tmp_path / "o"
    assert (
        sweep_main(
            [
                str(SWEEPS / "main_arith.yaml"),
                "--out",
                str(out),
                "--dry-run",
                "--seeds",
                "7",
                "--set",
                "model.name_or_path=/models/warm",
                "optim.lr=2e-4",
            ]
        )
        == 0
    )
    assert "run      grpo/seed_7" in capsys.readouterr().out
    spec = SweepSpec.from_file(SWEEPS / "main_arith.yaml")
    planned, _ = run_sweep(
        spec, out, dry_run=True, base_overrides={"model.name_or_path": "/m", "optim.lr": 2e-4}, echo=lambda s: None
    )
    assert planned[0].config["model"]["name_or_path"] == "/m" and planned[0].config["optim"]["lr"] == 2e-4
    assert planned[0].config["optim"]["gradient_accumulation_steps"] == 4  # siblings kept
    assert sweep_main([str(SWEEPS / "main_arith.yaml"), "--out", str(out), "--dry-run", "--set", "oops"]) == 2


def test_end_to_end_custom_estimator_in_subprocesses(tmp_path):
    """The user's estimator as one more setting of an off-policy sweep, run by the real trainer in two
    parallel subprocesses that import the plugin; the clip fraction is logged and reported."""
    pytest.importorskip("rlvr.commands.train")
    example = Path(__file__).resolve().parents[2] / "examples" / "my_estimator.py"
    base = deep_merge(
        TINY_BASE, {"n_steps": 2, "eval_every": 0, "save_every": 0, "dump_every": 0, "optim.train_batch_size": 2}
    )  # 2 updates per rollout batch of 4: off-policy
    spec = tmp_path / "off.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "tiny off-policy",
                "base": base,
                "plugins": [str(example)],
                "seeds": [0],
                "settings": {
                    "grpo_clip": {"algorithm.reweighting": "grpo"},
                    "dual_clip": {"algorithm.reweighting": "dual_clip", "algorithm.cliprange": 0.2},
                },
            },
            sort_keys=False,
        )
    )
    out = tmp_path / "sweep"
    rc = sweep_main([str(spec), "--out", str(out), "--max-parallel", "2"])
    logs = {p.name: p.read_text() for p in (out / "_sweep" / "logs").rglob("*.log")}
    assert rc == 0, logs
    runs = {r.setting: r for r in load_runs(out)}
    assert runs["dual_clip"].finished and runs["dual_clip"].config["algorithm"]["reweighting"] == "dual_clip"
    assert runs["dual_clip"].config["algorithm"]["cliprange"] == 0.2
    for run in runs.values():
        steps, clip = run.series("train/clip_fraction")
        assert steps.tolist() == [1, 2] and ((clip >= 0) & (clip <= 1)).all()


# -------------------------------------------------------------------------------------------------
# Validation before anything runs, locked runs, and stopping
# -------------------------------------------------------------------------------------------------


def test_dry_run_rejects_a_misspelt_key_and_a_wrong_type(tmp_path, capsys):
    spec = write_spec(
        tmp_path / "s.yaml",
        settings={"a": {"algorithm.presett": "grpo"}, "b": {"optim.lr": "fast"}, "c": {"optim.lr": 1e-4}},
    )
    out = tmp_path / "sweep"
    assert sweep_main([str(spec), "--out", str(out), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "2 setting(s) have an invalid config" in err
    assert "a (seed 0, 1): unknown config key(s) algorithm.presett" in err
    assert "b (seed 0, 1): config key optim.lr must be a number, got string 'fast'" in err
    assert "c (" not in err and not out.exists()


def test_run_finished_short_of_the_requested_steps_is_resumed(tmp_path):
    from rlvr.experiments.sweep import run_state

    (tmp_path / "summary.json").write_text(json.dumps({"status": "finished", "step": 4}))
    assert run_state(tmp_path, n_steps=4) == (SKIP, "finished")
    assert run_state(tmp_path, n_steps=8)[0] == RESUME


def test_locked_run_is_busy_and_left_alone(tmp_path, fake):
    import os

    from rlvr.experiments.sweep import BUSY
    from rlvr.training.rundir import RunDirLock

    spec = write_spec(tmp_path / "s.yaml", seeds=[0])
    out = tmp_path / "sweep"
    calls, said = [], []

    def train_fn(config_path, out_dir, resume):
        calls.append(out_dir.relative_to(out).as_posix())
        fake(config_path, out_dir, resume)

    with RunDirLock(out / "a" / "seed_0", command="rlvr train (an earlier sweep's run)"):
        planned = {p.label: p for p in plan(SweepSpec.from_file(spec), out)}
        assert planned["a/seed_0"].action == BUSY and f"pid {os.getpid()}" in planned["a/seed_0"].reason
        run_sweep(spec, out, train_fn=train_fn, echo=said.append)
    assert calls == ["b/seed_0"]
    assert any(s.startswith("busy, left alone: a/seed_0") for s in said)
    assert [p.action for p in plan(SweepSpec.from_file(spec), out)] == [RUN, SKIP]  # free again


def test_a_second_sweep_on_the_same_directory_is_refused_and_touches_nothing(tmp_path, fake):
    from rlvr.training.rundir import RunDirBusy, RunDirLock

    spec = write_spec(tmp_path / "s.yaml", seeds=[0])
    out = tmp_path / "sweep"
    calls: list[Path] = []
    with RunDirLock(out / "_sweep", command="rlvr sweep (the first one)"):
        with pytest.raises(RunDirBusy, match="in use by another process"):
            run_sweep(spec, out, train_fn=lambda c, o, r: calls.append(o), echo=lambda s: None)
    assert calls == [] and sorted(p.name for p in (out / "_sweep").iterdir()) == [".rlvr.lock"]


def test_killed_sweep_takes_its_runs_down(tmp_path):
    """SIGKILL leaves the sweep no chance to stop its runs: the kernel tells each run (SIGTERM) and it
    stops as for Ctrl-C; a second sweep then resumes them instead of racing them."""
    import os
    import subprocess
    import time

    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    spec = write_spec(tmp_path / "s.yaml", plugins=["fake_trainer.py"], base={"n_steps": 10_000, "optim": {"lr": 1.0}})
    out = tmp_path / "out"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "rlvr", "sweep", str(spec), "--out", str(out), "--max-parallel", "2", "--seeds", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "FAKE_TRAINER_SLEEP": "0.05"},
    )
    metrics = [out / s / "seed_0" / "metrics.jsonl" for s in ("a", "b")]
    deadline = time.time() + 60
    while not all(m.is_file() and m.stat().st_size for m in metrics) and time.time() < deadline:
        time.sleep(0.1)
    sweep.kill()
    output, _ = sweep.communicate(timeout=60)
    pids = [int(line.rsplit("pid ", 1)[1].rstrip(")")) for line in output.splitlines() if line.startswith("started")]
    assert len(pids) == 2, output
    deadline = time.time() + 60
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)
    for s in ("a", "b"):
        assert json.loads((out / s / "seed_0" / "summary.json").read_text())["status"] == "interrupted"
    assert [p.action for p in plan(SweepSpec.from_file(spec), out, seeds=[0])] == [RESUME, RESUME]


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def test_child_that_ignores_the_stop_is_killed_with_its_process_group(tmp_path):
    import subprocess
    import types

    from rlvr.experiments.sweep import _stop_children

    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(child.stdout.readline())
    said = []
    log = (tmp_path / "log").open("w")
    _stop_children([(child, types.SimpleNamespace(label="x/seed_0"), 0.0, log)], said.append, grace_s=1.0)
    assert child.returncode == -9 and any("killing its process group" in s for s in said)
    import time

    deadline = time.time() + 10
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_sigterm_stops_an_in_process_sweep_with_a_checkpoint(tmp_path, capsys):
    import os
    import signal

    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"base": TINY_BASE, "seeds": [0], "settings": {"grpo": {}}}, sort_keys=False))
    out = tmp_path / "sweep"

    class SigtermInStep3(TrainCallback):
        def on_step_begin(self, step, run_dir):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` would: the step finishes, then the run saves

    assert sweep_main([str(spec), "--out", str(out)], train_fn=train_with(SigtermInStep3())) == 143
    assert "stopped by SIGTERM" in capsys.readouterr().err
    run_dir = out / "grpo" / "seed_0"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 3 and summary["last_checkpoint"] == 3
    assert [p.action for p in plan(SweepSpec.from_file(spec), out)] == [RESUME]


def test_run_that_stopped_before_its_first_checkpoint_starts_again_under_a_fixed_spec(tmp_path, fake):
    spec = write_spec(tmp_path / "s.yaml", seeds=[0])
    out = tmp_path / "sweep"
    run_dir = out / "a" / "seed_0"
    run_dir.mkdir(parents=True)  # an earlier attempt under another lr that failed at its first step
    (run_dir / "config.json").write_text(json.dumps({"n_steps": 3, "optim": {"lr": 9.0}, "seed": 0}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    planned = {p.label: p for p in plan(SweepSpec.from_file(spec), out)}
    assert planned["a/seed_0"].action == RUN and "before its first checkpoint" in planned["a/seed_0"].reason
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)  # with a checkpoint it would be a conflict
    assert plan(SweepSpec.from_file(spec), out)[0].action == CONFLICT
