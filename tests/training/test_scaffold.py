"""The run scaffold: every command that writes a run directory takes its lock before it reads,
deletes or writes anything there (two real processes on one directory)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlvr.cli import main as cli
from rlvr.commands.dpo import DPOConfig
from rlvr.training.rundir import RunDirBusy
from rlvr.training.scaffold import claimed_output_dir, saved_settings

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that takes the run directory's lock, as a live run does, and keeps it until killed."""
    code = textwrap.dedent(f"""
        import time
        from rlvr.training.rundir import RunDirLock
        RunDirLock({str(run_dir)!r}, command="rlvr dpo (the live run)").acquire()
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under ``run_dir`` (but the lock) with its bytes."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".rlvr.lock"
    }


def live_run(run_dir: Path, files: dict[str, str]) -> dict[str, bytes]:
    for rel, text in files.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    return snapshot(run_dir)


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and f"rlvr {command}: warning: " not in line]
    assert len(lines) == 1 and lines[0].startswith(f"rlvr {command}: "), err
    return lines[0]


@pytest.fixture()
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def signal_at_step(monkeypatch, module, step_fn: str, out, n: int, sig: int) -> list[str]:
    """Wrap ``module.step_fn`` so that each call records the run's summary status and the ``n``-th
    sends ``sig`` to this process before stepping; returns the recorded statuses."""
    statuses: list[str] = []
    original = getattr(module, step_fn)

    def step_then_signal(*args, **kwargs):
        statuses.append(json.loads((out / "summary.json").read_text())["status"])
        if len(statuses) == n:
            os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, step_fn, step_then_signal)
    return statuses


def test_dpo_resume_and_overwrite_on_a_live_run_are_refused_and_touch_nothing(tmp_path, pairs_file, capsys):
    run_dir = tmp_path / "dpo"
    run_dir.mkdir()
    config = saved_settings(DPOConfig(model=str(tmp_path / "sft"), data=(str(pairs_file),), out=run_dir))
    before = live_run(
        run_dir,
        {
            "config.json": json.dumps(config),
            "metrics.jsonl": '{"step": 0}\n{"step": 1}\n',
            "summary.json": '{"status": "running"}\n',
            "best/model.safetensors": "weights",
            "checkpoints/.tmp-step_000002/model/model.safetensors": "being written",
        },
    )
    holder = hold_lock(run_dir)
    try:
        assert cli(["dpo", "--resume", str(run_dir)]) == 2
        assert f"pid {holder.pid}" in one_line_error(capsys, "dpo")
        assert snapshot(run_dir) == before
        argv = ["dpo", "--model", str(tmp_path / "sft"), "--data", str(pairs_file), "--out", str(run_dir)]
        assert cli([*argv, "--overwrite"]) == 2
        assert f"pid {holder.pid}" in one_line_error(capsys, "dpo")
        assert snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()


def test_sft_instruct_overwrite_on_a_live_run_is_refused_and_touches_nothing(tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "a"}) + "\n" for i in range(4)))
    run_dir = tmp_path / "sft"
    run_dir.mkdir()
    before = live_run(run_dir, {"metrics.jsonl": '{"step": 1}\n', "sft_config.json": "{}\n"})
    holder = hold_lock(run_dir)
    try:
        argv = ["sft", "instruct", "--data", str(data), "--model", "tiny", "--out", str(run_dir), "--overwrite"]
        assert cli(argv) == 2
        assert f"pid {holder.pid}" in one_line_error(capsys, "sft")
        assert snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()


def test_claimed_output_dir_locks_before_it_checks_or_replaces(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    (out / "samples.jsonl").write_text("old\n")
    holder = hold_lock(out)
    try:
        with (
            pytest.raises(RunDirBusy),
            claimed_output_dir(out, ("results.json",), overwrite=True, replaces=("samples.jsonl",)),
        ):
            pass
        assert (out / "samples.jsonl").read_text() == "old\n"
    finally:
        holder.kill()
        holder.wait()
    # Free: an earlier result is refused without overwrite, and replaced with it.
    with pytest.raises(Exception, match="already holds results"), claimed_output_dir(out, ("results.json",)):
        pass
    with claimed_output_dir(out, ("results.json",), overwrite=True, replaces=("samples.jsonl",)) as claimed:
        assert claimed == out and not (out / "samples.jsonl").exists()
        with pytest.raises(RunDirBusy):  # held for the whole block, against this process too
            with claimed_output_dir(out, ("results.json",), overwrite=True):
                pass


# -------------------------------------------------------------------------------------------------
# rlvr dpo and rlvr sft instruct: summary.json, SIGTERM and Ctrl-C save, --resume continues the same run
# -------------------------------------------------------------------------------------------------


def metric_rows(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "tokens_per_s"))}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_dpo_sigterm_saves_exits_143_and_resumes_to_the_same_run(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch, capsys
):
    import rlvr.commands.dpo as dpo
    from rlvr.modeling import save_model_and_tokenizer

    model_dir = save_model_and_tokenizer(tiny_model, tiny_tokenizer, tmp_path / "sft")
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"Name colour {i}.", "chosen": f"It is {w}.", "rejected": f"No {i}."}
        for i, w in enumerate("abcdefghij")
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = dict(val_size=4, batch_size=2, lr=1e-3, eval_every=2, save_every=0, steps=4, eval_batch_pairs=3)
    straight = dpo.run_dpo(
        DPOConfig(
            model=str(model_dir),
            data=(str(pairs),),
            out=tmp_path / "straight",
            progress=False,
            device="cpu",
            **settings,
        )
    )
    out = tmp_path / "stopped"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    argv = [
        "dpo",
        "--model",
        str(model_dir),
        "--data",
        str(pairs),
        "--out",
        str(out),
        "--no-progress",
        "--device",
        "cpu",
    ]
    statuses = signal_at_step(monkeypatch, dpo, "dpo_step", out, 2, signal.SIGTERM)
    assert cli([*argv, *flags]) == 143
    monkeypatch.undo()
    assert statuses == ["running", "running"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 2 and summary["last_checkpoint"] == 2
    assert "stopped by SIGTERM; saved a checkpoint at step 2" in capsys.readouterr().err
    assert [r["step"] for r in metric_rows(out)] == [0, 1, 2]
    assert cli(["dpo", "--resume", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert metric_rows(out) == metric_rows(straight)
    final = Path("checkpoints") / "step_000004" / "model" / "model.safetensors"
    assert same_weights(straight / final, out / final)
    # config.json edited by hand: refused, naming what differs from the checkpoint's own copy.
    edited = {**json.loads((out / "config.json").read_text()), "beta": 0.5, "seed": 3}
    (out / "config.json").write_text(json.dumps(edited))
    capsys.readouterr()
    assert cli(["dpo", "--resume", str(out), "--steps", "6"]) == 2
    assert "beta, seed in " in one_line_error(capsys, "dpo")


def test_sft_instruct_ctrl_c_saves_exits_130_and_resumes_to_the_same_run(tmp_path, monkeypatch, capsys):
    import rlvr.commands.sft_instruct as instruct_sft
    from rlvr.commands.sft_instruct import InstructSFTConfig, run_instruct_sft

    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i % 7} plus 2?", "response": f"{i % 7 + 2}."}) + "\n" for i in range(60)
        )
    )
    settings = dict(seq_length=32, batch_size=4, lr=1e-2, steps=5, val_size=8, eval_every=2, vocab_size=300)
    settings.update(max_tokens_per_microbatch=64, save_every=0)
    straight = run_instruct_sft(
        InstructSFTConfig(
            data=str(data), model="tiny", out=tmp_path / "straight", progress=False, device="cpu", **settings
        )
    )
    assert json.loads((straight / "summary.json").read_text())["status"] == "finished"
    out = tmp_path / "stopped"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    argv = [
        "sft",
        "instruct",
        "--data",
        str(data),
        "--model",
        "tiny",
        "--out",
        str(out),
        "--no-progress",
        "--device",
        "cpu",
    ]
    statuses = signal_at_step(monkeypatch, instruct_sft, "accumulate_step", out, 3, signal.SIGINT)
    assert cli([*argv, *flags]) == 130
    monkeypatch.undo()
    assert statuses == ["running"] * 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 3 and summary["last_checkpoint"] == 3
    assert "interrupted; saved a checkpoint at step 3" in capsys.readouterr().err
    # Run again without --resume: refused, nothing replaced; with it: the same run to its end.
    assert cli([*argv, *flags]) == 2
    assert "already holds results" in one_line_error(capsys, "sft")
    assert cli(["sft", "instruct", "--resume", str(out), "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    assert metric_rows(out) == metric_rows(straight)
    assert same_weights(straight / "model.safetensors", out / "model.safetensors")
    edited = {**json.loads((out / "sft_config.json").read_text()), "lr": 0.5}
    (out / "sft_config.json").write_text(json.dumps(edited))
    capsys.readouterr()
    assert cli(["sft", "instruct", "--resume", str(out), "--steps", "8"]) == 2
    line = one_line_error(capsys, "sft")
    assert "cannot resume: lr in " in line and "differ from the config step_000003 was trained with" in line


def test_dpo_weights_only_checkpoint_resumes_only_with_fresh_optimizer(tiny_model, tiny_tokenizer, tmp_path, capsys):
    from rlvr.modeling import save_model_and_tokenizer

    model_dir = save_model_and_tokenizer(tiny_model, tiny_tokenizer, tmp_path / "sft")
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"Colour {i}?", "chosen": f"It is {w}.", "rejected": f"No {i}."} for i, w in enumerate("abcdefgh")
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["dpo", "--model", str(model_dir), "--data", str(pairs), "--out", str(out), "--val-size", "2"]
    flags = ["--batch-size", "2", "--steps", "2", "--save-every", "1", "--eval-every", "1", "--no-progress"]
    assert cli([*argv, *flags, "--device", "cpu"]) == 0
    (out / "checkpoints" / "step_000002" / "trainer_state.pt").unlink()
    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert cli(["dpo", "--resume", str(out), "--steps", "3"]) == 2
    line = one_line_error(capsys, "dpo")
    assert "step_000002 holds weights only (trainer_state.pt is missing)" in line and "--fresh-optimizer" in line
    assert (out / "metrics.jsonl").read_text() == metrics
    assert cli(["dpo", "--resume", str(out), "--steps", "3", "--fresh-optimizer"]) == 0
    assert "resuming from the weights of step_000002 with a fresh optimizer" in capsys.readouterr().err
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["step"] == 3 and summary["best_step"] is not None


def test_training_run_saves_whole_steps_only_and_says_how_the_run_ended(tmp_path, capsys):
    from rlvr.errors import DiskFullError
    from rlvr.training.interrupts import Terminated, sigterm_as_interrupt
    from rlvr.training.scaffold import TrainingRun

    saved: list[int] = []

    def summary() -> dict:
        return json.loads((tmp_path / "summary.json").read_text())

    # A first SIGTERM during a step: the step ends, is saved, and the run stops (Terminated).
    run = TrainingRun(tmp_path, 5, "rlvr x --resume DIR", saved.append)
    with pytest.raises(Terminated), sigterm_as_interrupt(), run.guarded():
        for step in (1, 2, 3):
            with run.step_block(step):
                assert summary()["status"] == "running"
                if step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
    assert saved == [2] and summary()["status"] == "interrupted" and summary()["last_checkpoint"] == 2
    assert "stopped by SIGTERM; saved a checkpoint at step 2" in summary()["message"]
    # A second Ctrl-C in the middle of step 4 stops at once: half a step is never saved.
    run = TrainingRun(tmp_path, 5, "rlvr x --resume DIR", saved.append, start=2, resumed=True)
    with pytest.raises(KeyboardInterrupt), run.guarded():
        for step in (3, 4):
            with run.step_block(step):
                if step == 4:
                    os.kill(os.getpid(), signal.SIGINT)
                    os.kill(os.getpid(), signal.SIGINT)
    assert saved == [2] and summary()["step"] == 3 and summary()["last_checkpoint"] == 2
    assert "in the middle of step 4, which was not saved; the checkpoint of step 2 is the last" in summary()["message"]
    # Any other error: failed, with its message; a full disk becomes one line (DiskFullError).
    run = TrainingRun(tmp_path, 5, "rlvr x --resume DIR", saved.append)
    with pytest.raises(DiskFullError), run.guarded():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert summary()["status"] == "failed" and "out of disk space" in summary()["message"]
    capsys.readouterr()


def test_saved_settings_round_trip_through_json_and_drop_the_invocation_flags(tmp_path):
    from rlvr.commands.sft_instruct import InstructSFTConfig
    from rlvr.training.scaffold import settings_from_saved

    dpo = DPOConfig(
        model="m", data=("a.jsonl", "b.jsonl"), out=tmp_path / "run", resume=tmp_path / "run", overwrite=True
    )
    saved = saved_settings(dpo)
    assert saved["data"] == ["a.jsonl", "b.jsonl"] and saved["out"] == str(tmp_path / "run")
    assert (saved["resume"], saved["overwrite"], saved["fresh_optimizer"]) == (None, False, False)
    back = settings_from_saved(DPOConfig, json.loads(json.dumps(saved)))
    assert back == DPOConfig(model="m", data=("a.jsonl", "b.jsonl"), out=tmp_path / "run")
    instruct = InstructSFTConfig(betas=(0.9, 0.95), out=tmp_path / "sft")
    loaded = json.loads(json.dumps({**saved_settings(instruct), "betas": [1, 0.95], "command": "sft instruct"}))
    assert settings_from_saved(InstructSFTConfig, loaded) == InstructSFTConfig(betas=(1.0, 0.95), out=tmp_path / "sft")


def test_resumed_settings_keep_the_run_and_take_only_the_resumable_flags(tmp_path):
    from rlvr.errors import UserError
    from rlvr.training.scaffold import resumed_settings

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = DPOConfig(model="m", data=("a.jsonl",), out=run_dir, beta=0.2, steps=10)
    (run_dir / "config.json").write_text(json.dumps(saved_settings(first)))
    given = DPOConfig(model="other", beta=0.5, steps=20, resume=run_dir, fresh_optimizer=True)
    resumed = resumed_settings(given, run_dir, "config.json", ("steps",), "rlvr dpo")
    # The run's own model and beta; the new length, and this invocation's flags.
    assert (resumed.model, resumed.beta, resumed.steps) == ("m", 0.2, 20)
    assert (resumed.out, resumed.resume, resumed.fresh_optimizer, resumed.overwrite) == (run_dir, run_dir, True, False)
    with pytest.raises(UserError, match=r"sft_config.json is missing: is .* an `rlvr sft` run directory"):
        resumed_settings(given, run_dir, "sft_config.json", ("steps",), "rlvr sft")
    with pytest.raises(UserError, match="written by another command: is .* an `rlvr dpo` run directory"):
        resumed_settings(given, run_dir, "config.json", ("steps",), "rlvr dpo", accepts=lambda saved: False)
    (run_dir / "config.json").write_text("{")
    with pytest.raises(UserError, match=r"config.json is unreadable \(JSONDecodeError"):
        resumed_settings(given, run_dir, "config.json", ("steps",), "rlvr dpo")
    (run_dir / "config.json").write_text('{"no_such_setting": 1, "beta": 0.3}')  # a key of another version: ignored
    assert resumed_settings(given, run_dir, "config.json", ("steps",), "rlvr dpo").beta == 0.3
