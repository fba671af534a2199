"""Bad input and faults, each reproduced: typed config files, a run that fails before its first
checkpoint, two processes on one run directory, SIGTERM, damaged checkpoints, a kill while
config.json is rewritten, a shortened or extended run, a damaged metrics line, outputs that must not
be overwritten, and one-line errors from every command."""

from __future__ import annotations

import dataclasses
import errno
import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlvr.cli import main as cli
from rlvr.commands.train import GraderError, read_summary, train
from rlvr.config import ConfigError, DataConfig, LogConfig, OptimConfig, RolloutConfig, TrainConfig
from rlvr.training.checkpoint import list_checkpoints
from rlvr.training.interrupts import Terminated
from rlvr.training.metrics_log import read_metrics
from rlvr.training.rundir import RunDirBusy

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}


def parity_reward(response: str, ground_truth: str) -> dict:
    r = float(len(response) % 2 == 0)
    return {"reward": r, "answer_reward": r, "format_reward": float(" " in response)}


def tiny_config(gsm8k_path, n_steps=2, **overrides) -> TrainConfig:
    sections = {
        "data": DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=2),
        "rollout": RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=6),
        "optim": OptimConfig(lr=1e-3, gradient_accumulation_steps=2),
        "log": LogConfig(progress=False, engine_logprob_check_every=0, val_samples=0),
    }
    for key in list(overrides):
        if key in sections:
            sections[key] = overrides.pop(key)
    base = dict(prompt="question_only", n_steps=n_steps, eval_every=0, dump_every=0, save_every=0, **sections)
    base.update(overrides)
    return TrainConfig(**base)


def run(cfg, out, model, tokenizer, resume=False, reward_fn=parity_reward):
    return train(cfg, out, resume=resume, model=model, tokenizer=tokenizer, reward_fn=reward_fn)


def sigterm_at_rollout(n: int):
    """The parity reward, sending this process SIGTERM when it grades its ``n``-th rollout."""
    calls = {"n": 0}

    def reward(response, gt):
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return parity_reward(response, gt)

    return reward


def fresh_model(tokenizer):
    from rlvr.modeling import build_model, small_olmo2_config

    return build_model(small_olmo2_config(tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)


def strip_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s", "mem/"))} for r in rows]


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and f"rlvr {command}: warning: " not in line]
    assert len(lines) == 1 and lines[0].startswith(f"rlvr {command}: "), err
    return lines[0]


# -------------------------------------------------------------------------------------------------
# Config values are typed on the way in
# -------------------------------------------------------------------------------------------------

TINY_YAML = """\
model: {fresh: tiny, tokenizer_vocab_size: 300}
data: {train_source: "arith:steps=1,max_value=9", train_size: 8, val_split: validation, val_size: 2}
prompt: r1_zero
algorithm: {advantage_eps: 1e-6}
rollout: {n_prompts_per_rollout_batch: 2, group_size: 2, max_new_tokens: 4}
optim: {lr: 1e-3, gradient_accumulation_steps: 1}
log: {progress: false, val_samples: 0}
n_steps: 1
eval_every: 0
"""


def test_yaml_config_with_exponent_numbers_trains(tmp_path):
    """``lr: 1e-3`` and ``advantage_eps: 1e-6`` (strings to PyYAML's YAML 1.1) are numbers, and train."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(TINY_YAML)
    out = tmp_path / "run"
    assert cli(["train", "--config", str(cfg_file), "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["optim"]["lr"] == 1e-3 and saved["algorithm"]["advantage_eps"] == 1e-6
    assert read_summary(out)["status"] == "finished"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]


def test_wrong_types_name_the_key_before_anything_is_written(tmp_path, capsys):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text(TINY_YAML.replace("\nn_steps: 1\n", '\nn_steps: "3"\n'))
    assert cli(["train", "--config", str(cfg_file), "--out", str(tmp_path / "run")]) == 2
    line = one_line_error(capsys, "train")
    assert "n_steps must be an integer" in line and "'3'" in line and "without quotes" in line
    assert not (tmp_path / "run").exists()


# -------------------------------------------------------------------------------------------------
# A run that fails before its first checkpoint
# -------------------------------------------------------------------------------------------------


def test_run_that_failed_before_its_first_checkpoint_can_be_redone(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    def broken(response, gt):
        raise ValueError("grader bug")

    cfg = tiny_config(gsm8k_path, n_steps=2)  # save_every=0: the only checkpoint comes at the end
    with pytest.raises(GraderError) as failure:
        run(cfg, tmp_path, tiny_model, tiny_tokenizer, reward_fn=broken)
    assert "No checkpoint was saved yet" in str(failure.value)  # and not "the last checkpoint is intact"
    assert read_summary(tmp_path)["status"] == "failed" and not list_checkpoints(tmp_path)

    # --resume with a changed config (not allowed once something was checkpointed): nothing to keep.
    fixed = dataclasses.replace(cfg, optim=OptimConfig(lr=2e-3, gradient_accumulation_steps=2))
    run(fixed, tmp_path, tiny_model, tiny_tokenizer, resume=True)
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 2e-3
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert read_summary(tmp_path)["status"] == "finished"

    # ... or a new run in the same directory, without deleting anything by hand.
    other = tmp_path / "other"
    with pytest.raises(GraderError):
        run(cfg, other, tiny_model, tiny_tokenizer, reward_fn=broken)
    run(fixed, other, tiny_model, tiny_tokenizer)
    assert read_summary(other)["status"] == "finished"


# -------------------------------------------------------------------------------------------------
# Two processes on one run directory
# -------------------------------------------------------------------------------------------------


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that takes the run directory's lock and keeps it until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from rlvr.training.rundir import RunDirLock
        RunDirLock({str(run_dir)!r}, command="rlvr train --resume").acquire()
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_writer_is_refused_and_a_dead_holders_lock_is_taken_over(
    gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, capsys
):
    cfg = tiny_config(gsm8k_path, n_steps=1)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    before = (tmp_path / "metrics.jsonl").read_text()
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=f"in use by another process \\(pid {holder.pid}"):
            run(dataclasses.replace(cfg, n_steps=2), tmp_path, tiny_model, tiny_tokenizer, resume=True)
        capsys.readouterr()
        assert cli(["train", "--resume", str(tmp_path), "--n_steps", "2"]) == 2
        line = one_line_error(capsys, "train")
        assert f"pid {holder.pid}" in line and f"kill {holder.pid}" in line
        assert (tmp_path / "metrics.jsonl").read_text() == before and read_summary(tmp_path)["step"] == 1
    finally:
        holder.kill()
        holder.wait()
    # The holder died holding the lock: the next run takes it over and says so.
    run(dataclasses.replace(cfg, n_steps=2), tmp_path, tiny_model, tiny_tokenizer, resume=True)
    assert f"left by pid {holder.pid}" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert read_summary(tmp_path)["status"] == "finished"


# -------------------------------------------------------------------------------------------------
# SIGTERM is a graceful stop
# -------------------------------------------------------------------------------------------------


def test_sigterm_finishes_the_step_saves_and_resumes_to_the_same_run(gsm8k_path, tiny_tokenizer, tmp_path, capsys):
    cfg = tiny_config(gsm8k_path, n_steps=3)
    straight = tmp_path / "straight"
    model_a = fresh_model(tiny_tokenizer)
    run(cfg, straight, model_a, tiny_tokenizer)

    sigterm_in_step_2 = sigterm_at_rollout(9)  # 8 rollouts per step: the first of step 2
    stopped = tmp_path / "stopped"
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        run(cfg, stopped, fresh_model(tiny_tokenizer), tiny_tokenizer, reward_fn=sigterm_in_step_2)
    assert "SIGTERM: finishing this step" in capsys.readouterr().err
    summary = read_summary(stopped)
    assert summary["status"] == "interrupted" and summary["step"] == 2 and "SIGTERM" in summary["message"]
    assert [p.name for p in list_checkpoints(stopped)] == ["step_000002"]  # step 2 finished, then saved
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler is gone with it

    with pytest.raises(ConfigError, match="is at step 2 already, past n_steps=1; a run cannot be shortened"):
        run(dataclasses.replace(cfg, n_steps=1), stopped, fresh_model(tiny_tokenizer), tiny_tokenizer, resume=True)
    assert (stopped / "checkpoints" / "latest").resolve().name == "step_000002"

    model_b = fresh_model(tiny_tokenizer)
    run(cfg, stopped, model_b, tiny_tokenizer, resume=True)
    assert strip_timings(read_metrics(stopped / "metrics.jsonl")) == strip_timings(
        read_metrics(straight / "metrics.jsonl")
    )
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)


def test_save_at_end_false_leaves_no_final_checkpoint_but_a_signal_still_saves(
    gsm8k_path, tiny_tokenizer, tmp_path, capsys
):
    """A throwaway run (``save_at_end: false``, as the speed benchmark's trainer sections) ends with its
    metrics and summary and no checkpoint; periodic checkpoints stay, and SIGTERM still saves the step."""
    done = tmp_path / "done"
    run(tiny_config(gsm8k_path, n_steps=2, save_at_end=False), done, fresh_model(tiny_tokenizer), tiny_tokenizer)
    summary = read_summary(done)
    assert summary["status"] == "finished" and summary["step"] == 2
    assert summary["last_checkpoint"] is None and summary["latest"] is None
    assert list_checkpoints(done) == []
    assert [r["step"] for r in read_metrics(done / "metrics.jsonl") if r["step"] > 0] == [1, 2]

    periodic = tmp_path / "periodic"
    cfg = tiny_config(gsm8k_path, n_steps=3, save_every=2, save_at_end=False)
    run(cfg, periodic, fresh_model(tiny_tokenizer), tiny_tokenizer)
    assert [p.name for p in list_checkpoints(periodic)] == ["step_000002"]
    assert read_summary(periodic)["last_checkpoint"] == 2

    sigterm_in_step_2 = sigterm_at_rollout(9)  # 8 rollouts per step: the first of step 2
    stopped = tmp_path / "stopped"
    cfg = tiny_config(gsm8k_path, n_steps=3, save_at_end=False)
    with pytest.raises(Terminated):
        run(cfg, stopped, fresh_model(tiny_tokenizer), tiny_tokenizer, reward_fn=sigterm_in_step_2)
    assert [p.name for p in list_checkpoints(stopped)] == ["step_000002"]
    assert read_summary(stopped)["status"] == "interrupted"


def test_rlvr_train_exits_143_on_sigterm_with_a_checkpoint(tmp_path):
    cfg_file = tmp_path / "long.yaml"
    cfg_file.write_text(TINY_YAML.replace("\nn_steps: 1\n", "\nn_steps: 100000\neval_at_start: false\n"))
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlvr", "train", "--config", str(cfg_file), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
    )
    deadline = time.time() + 120
    while not read_metrics(out / "metrics.jsonl") and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output
    summary = read_summary(out)
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["message"], output
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert summary["step"] == last >= 1 and [p.name for p in list_checkpoints(out)] == [f"step_{last:06d}"]


# -------------------------------------------------------------------------------------------------
# Damaged checkpoints
# -------------------------------------------------------------------------------------------------


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def scramble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = os.urandom(64)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,file",
    [(truncate, "model/model.safetensors"), (scramble, "trainer_state.pt")],
    ids=["truncated_weights", "random_bytes_in_state"],
)
def test_damaged_checkpoint_falls_back_to_the_newest_intact_one(
    damage, file, gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, capsys
):
    cfg = tiny_config(gsm8k_path, n_steps=2, save_every=1, keep_checkpoints=2)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    original = read_metrics(tmp_path / "metrics.jsonl")
    damage(tmp_path / "checkpoints" / "step_000002" / file)

    run(dataclasses.replace(cfg, n_steps=3), tmp_path, fresh_model(tiny_tokenizer), tiny_tokenizer, resume=True)
    err = capsys.readouterr().err
    assert "checkpoint step_000002 failed verification" in err and file in err
    assert "resuming from step_000001" in err
    assert (tmp_path / "checkpoints" / "damaged-step_000002").is_dir()  # kept for inspection, never loaded
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # step 2 was redone from step 1, identically (now without the final validation of a 2-step run)
    no_val = [{k: v for k, v in r.items() if not k.startswith("val/")} for r in rows[:3]]
    assert strip_timings(no_val) == strip_timings(
        [{k: v for k, v in r.items() if not k.startswith("val/")} for r in original]
    )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]


def test_only_checkpoint_damaged_is_a_clear_error_not_a_restart(
    gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, capsys
):
    cfg = tiny_config(gsm8k_path, n_steps=1)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    scramble(tmp_path / "checkpoints" / "step_000001" / "model" / "model.safetensors")
    capsys.readouterr()
    assert cli(["train", "--resume", str(tmp_path), "--n_steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "does not match its checksum" in err and "no intact checkpoint" in err and "Traceback" not in err
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # nothing thrown away
    assert cli(["train", "--resume", str(tmp_path), "--n_steps", "2"]) == 2  # and it stays refused
    assert "no intact checkpoint" in capsys.readouterr().err


def test_checkpoint_without_trainer_state_never_restarts_the_run(
    gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, capsys
):
    """The optimizer state deleted to save disk: named, nothing thrown away, resumed only when asked."""
    cfg = tiny_config(gsm8k_path, n_steps=2, save_every=1)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    ckpt = tmp_path / "checkpoints" / "step_000002"
    (ckpt / "trainer_state.pt").unlink()
    kept = {name: (tmp_path / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}
    weights = (ckpt / "model" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert cli(["train", "--resume", str(tmp_path), "--n_steps", "3"]) == 2
    line = one_line_error(capsys, "train")
    assert "step_000002 holds weights only (trainer_state.pt is missing)" in line and "--fresh-optimizer" in line
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    assert (ckpt / "model" / "model.safetensors").read_bytes() == weights
    # Asked for: the run goes on from step 2's weights with a fresh optimizer.
    train(
        dataclasses.replace(cfg, n_steps=3),
        tmp_path,
        resume=True,
        fresh_optimizer=True,
        model=fresh_model(tiny_tokenizer),
        tokenizer=tiny_tokenizer,
        reward_fn=parity_reward,
    )
    assert "resuming from the weights of step_000002 with a fresh optimizer" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert read_summary(tmp_path)["status"] == "finished"
    assert cli(["train", "--out", str(tmp_path / "new"), "--fresh-optimizer"]) == 2
    assert "--fresh-optimizer applies to a resumed run" in one_line_error(capsys, "train")


def test_a_checkpoint_without_checksums_is_never_called_intact(
    gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, capsys
):
    cfg = tiny_config(gsm8k_path, n_steps=1)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    ckpt = tmp_path / "checkpoints" / "step_000001"
    (ckpt / "manifest.json").unlink()
    weights = ckpt / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # sixteen weights overwritten with zeros: it still loads
    weights.write_bytes(bytes(data))

    def broken(response, gt):
        raise ValueError("grader bug")

    with pytest.raises(GraderError) as failure:
        run(dataclasses.replace(cfg, n_steps=2), tmp_path, fresh_model(tiny_tokenizer), tiny_tokenizer, True, broken)
    assert "step_000001 has no manifest.json: its files load, but changed bytes cannot be detected" in (
        capsys.readouterr().err
    )
    assert "is intact" not in str(failure.value) and "has no checksums (not known to be intact)" in str(failure.value)


def test_a_hand_edited_config_json_is_refused_naming_the_keys(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, capsys):
    cfg = tiny_config(gsm8k_path, n_steps=1)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    path = tmp_path / "config.json"
    original = path.read_text()
    edited = json.loads(original)
    edited["seed"], edited["optim"]["lr"] = 7, 0.5
    path.write_text(json.dumps(edited))
    capsys.readouterr()
    assert cli(["train", "--resume", str(tmp_path), "--n_steps", "2"]) == 2
    line = one_line_error(capsys, "train")
    assert "optim.lr, seed differ from the config step_000001 was trained with" in line and "put them back" in line
    assert path.read_text() == json.dumps(edited)  # nothing rewritten
    # Put back, the change that the reward-timeout error suggests is a resumable one.
    path.write_text(original)
    longer = dataclasses.replace(cfg, n_steps=2, reward=dataclasses.replace(cfg.reward, timeout_s=30.0))
    run(longer, tmp_path, fresh_model(tiny_tokenizer), tiny_tokenizer, resume=True)
    assert read_summary(tmp_path)["status"] == "finished"
    assert json.loads(path.read_text())["reward"]["timeout_s"] == 30.0


# -------------------------------------------------------------------------------------------------
# Restarting a run: a kill while config.json is rewritten, a shorter run, a longer one
# -------------------------------------------------------------------------------------------------


def test_kill_while_config_json_is_rewritten_leaves_a_resumable_run(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path):
    cfg = tiny_config(gsm8k_path, n_steps=2)
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    config_before = (tmp_path / "config.json").read_text()
    # A restart killed (SIGKILL) at the moment config.json is replaced by the new one.
    code = textwrap.dedent(f"""
        import os, signal
        real_replace = os.replace
        def replace(src, dst, *a, **k):
            if str(dst).endswith("config.json"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst, *a, **k)
        os.replace = replace
        from rlvr.cli import main
        main(["train", "--resume", {str(tmp_path)!r}, "--n_steps", "3"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "config.json").read_text() == config_before

    # Shortening a run is refused, and leaves its checkpoint and `latest` alone.
    with pytest.raises(ConfigError, match="at step 2 already, past n_steps=1; a run cannot be shortened"):
        run(dataclasses.replace(cfg, n_steps=1), tmp_path, tiny_model, tiny_tokenizer, resume=True)
    assert (tmp_path / "checkpoints" / "latest").resolve().name == "step_000002"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]

    run(dataclasses.replace(cfg, n_steps=3), tmp_path, tiny_model, tiny_tokenizer, resume=True)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert read_summary(tmp_path)["status"] == "finished"


def test_extending_a_finished_cosine_run_continues_the_longer_schedule(
    gsm8k_path, tiny_model, tiny_tokenizer, tmp_path
):
    lr = 1e-3
    cfg = tiny_config(gsm8k_path, n_steps=2, optim=OptimConfig(lr=lr, gradient_accumulation_steps=2, schedule="cosine"))
    run(cfg, tmp_path, tiny_model, tiny_tokenizer)
    # cosine over 2 updates: update u has factor 0.5 * (1 + cos(pi * u / 2)): 1, 0.5
    assert [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl")[1:]] == pytest.approx([lr, 0.5 * lr])
    with open(tmp_path / "metrics.jsonl", "r+") as f:  # damage the line of step 1 (a middle line)
        lines = f.read().splitlines()
        lines[1] = lines[1][:20] + "#garbage"
        f.seek(0)
        f.truncate()
        f.write("\n".join(lines) + "\n")
    before = [p.detach().clone() for p in tiny_model.parameters()]

    with pytest.warns(UserWarning, match="metrics.jsonl:2: skipped a line"):
        run(dataclasses.replace(cfg, n_steps=4), tmp_path, tiny_model, tiny_tokenizer, resume=True)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 3, 4]  # every valid line kept, the damaged one dropped
    # the schedule is recomputed over 4 updates: factors 0.5 * (1 + cos(pi * u / 4)) for u = 2, 3
    assert [r["lr"] for r in rows[2:]] == pytest.approx([0.5 * lr, 0.5 * (1 - math.sqrt(0.5)) * lr])
    assert any(not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))  # the new steps trained


# -------------------------------------------------------------------------------------------------
# rlvr eval and rlvr sft: --out checked first, never overwritten silently
# -------------------------------------------------------------------------------------------------


@pytest.fixture()
def tiny_model_dir(tmp_path, tiny_model, tiny_tokenizer):
    path = tmp_path / "tiny-model"
    tiny_model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_eval_checks_out_first_and_refuses_to_overwrite(tmp_path, tiny_model_dir, gsm8k_path, capsys, monkeypatch):
    out = tmp_path / "eval"
    args = [
        "eval",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(gsm8k_path),
        "--limit",
        "2",
        "--max-tokens",
        "4",
        "--device",
        "cpu",
        "--examples",
        "0",
    ]
    assert cli(args + ["--out", str(out)]) == 0
    results = (out / "results.json").read_text()
    capsys.readouterr()

    import rlvr.modeling

    def must_not_load(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(rlvr.modeling, "load_model_and_tokenizer", must_not_load)
    assert cli(args + ["--out", str(out)]) == 2
    assert "--overwrite" in one_line_error(capsys, "eval")
    assert (out / "results.json").read_text() == results
    (tmp_path / "a_file").write_text("x")
    assert cli(args + ["--out", str(tmp_path / "a_file")]) == 2
    assert "is a file" in one_line_error(capsys, "eval")
    for limit in ("0", "-1"):
        assert cli(args[:5] + ["--limit", limit] + args[7:] + ["--out", str(tmp_path / "e2")]) == 2
        assert "--limit must be >= 1" in one_line_error(capsys, "eval")
    monkeypatch.undo()
    assert cli(args + ["--out", str(out), "--overwrite", "--seed", "3"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == 3


def test_sft_checks_out_first_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "sft"
    args = [
        "sft",
        "--data",
        "arith:steps=1,max_value=10",
        "--model",
        "tiny",
        "--vocab-size",
        "300",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--max-examples",
        "4",
        "--no-progress",
    ]
    assert cli(args + ["--out", str(out)]) == 0
    weights = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert cli(args + ["--out", str(out)]) == 2
    assert "--overwrite" in one_line_error(capsys, "sft")
    assert (out / "model.safetensors").read_bytes() == weights
    assert cli(args + ["--out", str(out), "--overwrite", "--seed", "1"]) == 0
    assert (out / "model.safetensors").read_bytes() != weights
    capsys.readouterr()
    assert cli(args[:-7] + ["--steps", "0"] + args[-5:] + ["--out", str(tmp_path / "s0")]) == 2
    assert "--steps must be >= 1" in one_line_error(capsys, "sft")
    assert not (tmp_path / "s0").exists()


# -------------------------------------------------------------------------------------------------
# One-line errors from every command
# -------------------------------------------------------------------------------------------------

ONE_LINE_CASES = [
    ("train", ["--config", "{tmp}/missing.yaml", "--out", "{tmp}/r"], "does not exist"),
    ("train", ["--config", "{tiny}", "--out", "{tmp}/file"], "is a file"),
    (
        "train",
        ["--config", "{tiny}", "--out", "{tmp}/r", "--model.fresh", "None", "--model.name_or_path", "./no/such/model"],
        "no such directory",
    ),
    ("train", ["--config", "{tiny}", "--out", "{tmp}/r", "--data.train_source", "{tmp}/missing.jsonl"], "no such file"),
    (
        "train",
        ["--config", "{tiny}", "--out", "{tmp}/r", "--data.train_source", "arith:stepz=2"],
        "has no option stepz",
    ),
    (
        "train",
        [
            "--config",
            "{tiny}",
            "--out",
            "{tmp}/r",
            "--rollout.group_size",
            "1",
            "--algorithm.advantage_normalizer",
            "none",
        ],
        "makes every advantage 0",
    ),
    ("train", ["--resume", "{tmp}"], "config.json not found"),
    (
        "train",
        ["--config", "{tiny}", "--out", "{tmp}/r", "--engine.cascade_min_rows", "32"],
        "--engine.cascade_min_rows is now --engine.fast.cascade_min_rows",
    ),
    (
        "train",
        ["--config", "{tmp}/old_keys.yaml", "--out", "{tmp}/r"],
        "config key engine.release_memory is now engine.fast.release_memory",
    ),
    ("eval", ["--model", "./no/such/model", "--out", "{tmp}/e"], "no such directory"),
    ("eval", ["--model", "{tmp}", "--out", "{tmp}/e"], "without config.json"),
    ("sft", ["--model", "tiny", "--data", "{tmp}/missing.jsonl", "--out", "{tmp}/s"], "no such file"),
    ("sft", ["--model", "./no/such/model", "--out", "{tmp}/s"], "no such directory"),
    ("demo", ["--sft-steps", "0", "--out", "{tmp}/d"], "--sft-steps must be >= 1"),
    ("sweep", ["{tmp}/missing.yaml", "--out", "{tmp}/w"], "not found"),
    ("sft", ["instruct", "--data", "{tmp}/latin1.jsonl", "--model", "tiny", "--out", "{tmp}/i"], "not UTF-8 text"),
    ("sft", ["instruct", "--data", "{tmp}/missing.jsonl", "--model", "tiny", "--out", "{tmp}/i"], "no such file"),
    ("sft", ["instruct", "--data", "{tmp}/cut.jsonl.gz", "--model", "tiny", "--out", "{tmp}/i"], "not a whole gzip"),
    ("dpo", ["--model", "m", "--data", "{tmp}/cut.jsonl.gz", "--out", "{tmp}/d"], "not a whole gzip file"),
    ("dpo", ["--model", "m", "--data", "{tmp}/latin1.jsonl", "--out", "{tmp}/d"], "latin1.jsonl: not UTF-8 text"),
    ("dpo", ["--model", "m", "--data", "{tmp}/missing.jsonl", "--out", "{tmp}/d"], "no such file or directory"),
    ("dpo", ["--resume", "{tmp}/list_run"], "holds a JSON list, not the object of settings"),
    ("train", ["--resume", "{tmp}/list_run"], "holds a JSON list, not the object of config keys"),
    ("train", ["--config", "{tiny}", "--out", "{tmp}/r", "--data.train_source", "{tmp}/latin1.jsonl"], "not UTF-8"),
    ("train", ["--config", "{tiny}", "--out", "{tmp}/r", "--optim.weight_decay", "-0.1"], "weight_decay must be >= 0"),
    ("train", ["--config", "{tiny}", "--out", "{tmp}/r", "--plugins", "no_such_plugin"], "no module named 'no_such"),
    (
        "train",
        ["--config", "{tiny}", "--out", "{tmp}/r", "--plugins", "{tmp}/bad_plugin.py"],
        "raised ZeroDivisionError",
    ),
]


@pytest.mark.parametrize(
    "command,args,expect", ONE_LINE_CASES, ids=[f"{c}-{e.split()[0]}-{i}" for i, (c, _, e) in enumerate(ONE_LINE_CASES)]
)
def test_user_errors_are_one_line(command, args, expect, tmp_path, capsys):
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(TINY_YAML)
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "old_keys.yaml").write_text(TINY_YAML + "engine: {name: hf-fast, release_memory: true}\n")
    (tmp_path / "latin1.jsonl").write_bytes(
        '{"prompt": "café", "response": "oui", "question": "café"}\n'.encode("latin-1")
    )
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "a", "response": "b"}\n' * 50)[:40])
    (tmp_path / "list_run").mkdir()
    (tmp_path / "list_run" / "config.json").write_text("[1, 2]\n")
    (tmp_path / "bad_plugin.py").write_text("RATE = 1 / 0\n")
    argv = [a.format(tmp=tmp_path, tiny=tiny) for a in args]
    assert cli([command, *argv]) == 2
    assert expect in one_line_error(capsys, command)


def test_a_truncated_model_file_is_one_line_naming_it(tiny_model_dir, tmp_path, capsys):
    weights = tiny_model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    argv = ["eval", "--model", str(tiny_model_dir), "--data", "arith", "--limit", "2", "--device", "cpu"]
    assert cli([*argv, "--out", str(tmp_path / "e")]) == 2
    assert "does not load: model.safetensors has 1000 bytes, fewer than its header alone" in one_line_error(
        capsys, "eval"
    )


def test_ctrl_c_while_the_command_loads_is_one_line(monkeypatch, capsys):
    import rlvr.cli

    def ctrl_c(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(rlvr.cli.importlib, "import_module", ctrl_c)
    assert cli(["train", "--help"]) == 130
    monkeypatch.undo()
    assert one_line_error(capsys, "train") == "rlvr train: interrupted"
    # What loads before that handling is light: the command line imports no torch.
    code = "import sys, rlvr.cli; print('torch' in sys.modules)"
    started = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True)
    assert started.stdout.strip() == "False"


def test_disk_full_is_recognised_however_the_writer_reports_it():
    from safetensors import SafetensorError

    from rlvr.errors import disk_full

    assert "(No space left on device)" in str(disk_full(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert "(File too large)" in str(
        disk_full(SafetensorError("Error while serializing: I/O error: File too large (os error 27)"))
    )
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert "(file write failed)" in str(disk_full(wrapped))
    assert disk_full(OSError(errno.EACCES, "Permission denied")) is None and disk_full(ValueError("x")) is None


def test_disk_full_is_one_line_and_leaves_a_true_summary(tmp_path):
    """A real file-size limit (RLIMIT_FSIZE) on ``rlvr train``: its first large write fails."""
    import resource

    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(TINY_YAML.replace("\nn_steps: 1\n", "\nn_steps: 3\nsave_every: 1\n"))
    out = tmp_path / "run"
    limit = 256 * 1024  # more than config.json and metrics.jsonl, less than the model's weights

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-m", "rlvr", "train", "--config", str(cfg_file), "--out", str(out)],
        preexec_fn=limited,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("rlvr train: ")]
    assert len(lines) == 1 and "out of disk space while writing (File too large)" in lines[0]
    summary = read_summary(out)
    assert summary["status"] == "failed" and "out of disk space" in summary["message"]


def test_a_prompt_longer_than_the_context_is_refused_before_any_generation(tmp_path, capsys, monkeypatch):
    import rlvr.engines.hf as hf_engine

    data = tmp_path / "long.jsonl"
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(8)]
    rows[6]["question"] = "Count the words. " + "word " * 3000  # more tokens than the model's positions
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(
        TINY_YAML.replace('"arith:steps=1,max_value=9"', f'"{data}"').replace("val_split: validation, ", "")
    )
    generated: list[int] = []
    original = hf_engine.HFEngine.generate
    monkeypatch.setattr(
        hf_engine.HFEngine, "generate", lambda self, *a, **k: generated.append(1) or original(self, *a, **k)
    )
    assert cli(["train", "--config", str(cfg_file), "--out", str(tmp_path / "run"), "--data.val_size", "0"]) == 2
    line = one_line_error(capsys, "train")
    assert re.search(r"training example \d+ makes a prompt of \d+ tokens; with rollout.max_new_tokens=4", line), line
    assert "the model's context of 2048 positions" in line and generated == []


def test_eval_refuses_a_question_longer_than_the_context(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2"}, {"question": "word " * 3000, "answer": "#### 1"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["eval", "--model", str(tiny_model_dir), "--data", str(data), "--device", "cpu", "--max-tokens", "8"]
    assert cli([*argv, "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlvr eval: ")]
    assert "Traceback" not in err and len(lines) == 1  # beside transformers' weight-loading bar
    assert re.search(r"question 2 of .*long.jsonl makes a r1_zero prompt of \d+ tokens; with --max-tokens 8", lines[0])


# -------------------------------------------------------------------------------------------------
# Small things: --help, the progress line
# -------------------------------------------------------------------------------------------------


def test_train_help_lists_config_out_and_resume(capsys):
    assert cli(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--config", "--out", "--resume", "--optim.lr", "--n-steps"):
        assert flag in text, flag


def test_progress_line_shows_loss_and_grad_norm():
    from rlvr.commands.train import progress_postfix

    postfix = progress_postfix(
        {"train/reward": 0.25, "train/loss": -0.0123456, "train/grad_norm": 1.5}, {"val/reward": 0.5}
    )
    assert postfix == {"reward": "0.250", "loss": "-0.01235", "gnorm": "1.5", "val": "0.500"}
