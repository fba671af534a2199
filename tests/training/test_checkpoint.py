"""Checkpoints: exact round trip of weights, optimizer, scheduler and RNG; a crash mid-write leaves the
previous checkpoint usable; metrics are truncated to the checkpoint on resume."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import rlvr.training.checkpoint as ck
from rlvr.training.metrics_log import MetricsLogger, read_metrics, truncate_metrics


def _setup(tiny_model):
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0 / (u + 1))
    return opt, sched


def _train_a_bit(model, opt, sched):
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_round_trip_is_exact(tiny_model, tiny_tokenizer, tmp_path):
    opt, sched = _setup(tiny_model)
    _train_a_bit(tiny_model, opt, sched)
    random.seed(5)
    torch.manual_seed(5)
    path = ck.save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, opt, sched, state={"data_position": 32})
    expected = (random.random(), torch.rand(3))

    from rlvr.modeling import build_model

    other = build_model(tiny_model.config, seed=99)
    opt2, sched2 = _setup(other)
    ck.load_model_weights(other, path / "model")
    state = ck.load_trainer_state(path, opt2, sched2)
    assert state == {"step": 1, "data_position": 32}
    assert (random.random(), torch.rand(3))[0] == expected[0]
    for a, b in zip(tiny_model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert sched2.state_dict() == sched.state_dict()
    # The restored optimizer takes the same next step.
    torch.manual_seed(0)
    _train_a_bit(tiny_model, opt, sched)
    torch.manual_seed(0)
    _train_a_bit(other, opt2, sched2)
    for a, b in zip(tiny_model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_crash_mid_write_keeps_previous_checkpoint(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    opt, sched = _setup(tiny_model)
    ck.save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, opt, sched, state={})
    before = [p.detach().clone() for p in tiny_model.parameters()]
    _train_a_bit(tiny_model, opt, sched)

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", crash)
    with pytest.raises(OSError):
        ck.save_checkpoint(tmp_path, 2, tiny_model, tiny_tokenizer, opt, sched, state={})
    monkeypatch.undo()
    latest = ck.latest_checkpoint(tmp_path)
    assert latest.name == "step_000001"
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000001"]
    from rlvr.modeling import build_model

    other = build_model(tiny_model.config, seed=7)
    ck.load_model_weights(other, latest / "model")
    for a, b in zip(before, other.parameters()):
        assert torch.equal(a, b)
    # The next save cleans the leftover and keeps only the newest.
    ck.save_checkpoint(tmp_path, 3, tiny_model, tiny_tokenizer, opt, sched, state={})
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000003"]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_truncate_metrics_drops_later_steps_and_partial_lines(tmp_path):
    log = MetricsLogger(tmp_path)
    for s in range(5):
        log.log({"step": s, "train/loss": float(s)})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')  # a line cut by a crash
    truncate_metrics(tmp_path / "metrics.jsonl", 2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_manifest_catches_truncation_random_bytes_and_missing_files(tiny_model, tiny_tokenizer, tmp_path):
    import json

    opt, sched = _setup(tiny_model)
    path = ck.save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, opt, sched, state={})
    manifest = json.loads((path / ck.MANIFEST).read_text())["files"]
    assert {"trainer_state.pt", "model/model.safetensors", "model/config.json"} <= set(manifest)
    assert manifest["trainer_state.pt"]["sha256"] == ck.file_sha256(path / "trainer_state.pt")
    assert ck.verify_checkpoint(path) == []

    weights = path / "model" / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:100])
    assert ck.verify_checkpoint(path) == [f"model/model.safetensors has 100 bytes, expected {len(good)}"]
    weights.write_bytes(good[:50] + bytes(255 - b for b in good[50:60]) + good[60:])
    assert ck.verify_checkpoint(path) == ["model/model.safetensors does not match its checksum"]
    weights.unlink()
    assert ck.verify_checkpoint(path) == ["model/model.safetensors is missing"]
    # A checkpoint from before manifests is checked file by file (see the next test).
    weights.write_bytes(good)
    (path / ck.MANIFEST).unlink()
    assert ck.verify_checkpoint(path) == []


def test_resumable_checkpoint_sets_the_damaged_aside_and_falls_back(tiny_model, tiny_tokenizer, tmp_path):
    opt, sched = _setup(tiny_model)
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, tiny_model, tiny_tokenizer, opt, sched, state={}, keep=2)
    state = tmp_path / "checkpoints" / "step_000002" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    said = []
    assert ck.resumable_checkpoint(tmp_path, echo=said.append).name == "step_000001"
    assert "step_000002 failed verification (trainer_state.pt has" in said[0] and "step_000001" in said[1]
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000001"]
    assert (tmp_path / "checkpoints" / "damaged-step_000002").is_dir()
    assert (tmp_path / "checkpoints" / "latest").resolve().name == "step_000001"
    # The next save after the fallback never prunes the checkpoint it just wrote.
    ck.save_checkpoint(tmp_path, 2, tiny_model, tiny_tokenizer, opt, sched, state={}, keep=1)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000002"]


def test_no_intact_checkpoint_is_an_error(tiny_model, tiny_tokenizer, tmp_path):
    opt, sched = _setup(tiny_model)
    path = ck.save_checkpoint(tmp_path, 3, tiny_model, tiny_tokenizer, opt, sched, state={})
    (path / "model" / "model.safetensors").write_bytes(b"garbage")
    for _ in range(2):  # and it stays an error once the damaged one was set aside
        with pytest.raises(ck.CheckpointError, match="has no intact checkpoint to resume from"):
            ck.resumable_checkpoint(tmp_path, echo=lambda s: None)
    assert ck.resumable_checkpoint(tmp_path / "never_ran") is None


def test_without_a_manifest_each_file_is_checked_to_load(tiny_model, tiny_tokenizer, tmp_path):
    opt, sched = _setup(tiny_model)
    path = ck.save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, opt, sched, state={})
    (path / ck.MANIFEST).unlink()
    assert ck.verify_checkpoint(path) == [] and not ck.verified_by_manifest(path)
    weights, state, config = path / "model" / "model.safetensors", path / ck.STATE_FILE, path / "model" / "config.json"
    good_weights, good_state, good_config = weights.read_bytes(), state.read_bytes(), config.read_text()
    weights.write_bytes(good_weights[:-7])
    assert ck.verify_checkpoint(path) == [
        f"model/model.safetensors has {len(good_weights) - 7} bytes, its header describes {len(good_weights)}"
    ]
    weights.write_bytes(b"\xff" * 64)
    assert ck.verify_checkpoint(path) == ["model/model.safetensors is not a safetensors file (no valid header)"]
    weights.write_bytes(good_weights)
    state.write_bytes(good_state[: len(good_state) // 2])
    config.write_text(good_config[:-5])
    problems = ck.verify_checkpoint(path)
    assert problems[0] == "model/config.json is not valid JSON"
    assert problems[1].startswith("trainer_state.pt does not load (") and len(problems) == 2
    weights.unlink()
    assert "model/ holds no *.safetensors weights" in ck.verify_checkpoint(path)


def test_a_weights_only_checkpoint_is_passed_over_and_resumed_only_when_asked(tiny_model, tiny_tokenizer, tmp_path):
    opt, sched = _setup(tiny_model)
    for step in (1, 2):
        _train_a_bit(tiny_model, opt, sched)
        ck.save_checkpoint(tmp_path, step, tiny_model, tiny_tokenizer, opt, sched, state={}, keep=2)
    (tmp_path / "checkpoints" / "step_000002" / ck.STATE_FILE).unlink()
    assert ck.verify_checkpoint(tmp_path / "checkpoints" / "step_000002") == [ck.WEIGHTS_ONLY]
    said: list[str] = []
    # The older complete checkpoint is taken, and the fall-back is said; the weights-only one stays in place.
    assert ck.resumable_checkpoint(tmp_path, echo=said.append).name == "step_000001"
    assert "step_000002 holds weights only (trainer_state.pt is missing)" in said[0] and "--fresh-optimizer" in said[0]
    assert said[1] == "rlvr: resuming from step_000001, the newest intact checkpoint"
    assert [p.name for p in ck.checkpoint_dirs(tmp_path)] == ["step_000001", "step_000002"]
    said.clear()
    newest = ck.resumable_checkpoint(tmp_path, echo=said.append, fresh_optimizer=True)
    assert newest.name == "step_000002" and "with a fresh optimizer" in said[0]
    # Its state: the step from its name, the optimizer as created, the schedule moved to that step
    # (lr 1e-3 x 1 / (2 + 1)).
    opt2, sched2 = _setup(tiny_model)
    assert ck.load_trainer_state(newest, opt2, sched2) == {"step": 2, "fresh_optimizer": True}
    assert opt2.state_dict()["state"] == {} and sched2.last_epoch == 2
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 / 3) and sched2.get_last_lr() == [pytest.approx(1e-3 / 3)]
    # With no complete checkpoint left, resuming stops and names the checkpoint and the flag.
    (tmp_path / "checkpoints" / "step_000001" / ck.STATE_FILE).unlink()
    with pytest.raises(ck.CheckpointError, match="step_000002 holds weights only .*resume with --fresh-optimizer"):
        ck.resumable_checkpoint(tmp_path, echo=lambda s: None)
    assert [p.name for p in ck.checkpoint_dirs(tmp_path)] == ["step_000001", "step_000002"]


def test_a_kill_while_pruning_leaves_no_half_checkpoint(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    opt, sched = _setup(tiny_model)
    ck.save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, opt, sched, state={})
    root = tmp_path / "checkpoints"
    real_rmtree = ck.shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # deletes one file of the pruned checkpoint, then the process dies
        next(p for p in sorted(Path(path).rglob("*")) if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ck.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 2, tiny_model, tiny_tokenizer, opt, sched, state={})
    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    # The half-deleted step 1 is under its trash name only: every step_N left is whole.
    assert [p.name for p in ck.checkpoint_dirs(tmp_path)] == ["step_000002"]
    assert (root / ".trash-step_000001").is_dir()
    assert ck.resumable_checkpoint(tmp_path, echo=lambda s: None).name == "step_000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]  # cleaned at the start


def test_a_kill_while_a_step_is_saved_again_puts_the_old_copy_back(tiny_model, tiny_tokenizer, tmp_path):
    opt, sched = _setup(tiny_model)
    ck.save_checkpoint(tmp_path, 1, tiny_model, tiny_tokenizer, opt, sched, state={})
    root = tmp_path / "checkpoints"
    # A kill between moving step 1 aside and renaming its new copy into place.
    (root / "step_000001").rename(root / ".old-step_000001")
    ck.clean_leftovers(tmp_path)
    assert [p.name for p in ck.checkpoint_dirs(tmp_path)] == ["step_000001"]
    assert ck.verify_checkpoint(root / "step_000001") == []


def test_damaged_middle_metrics_line_is_skipped_and_the_rest_kept(tmp_path):
    log = MetricsLogger(tmp_path)
    for s in range(5):
        log.log({"step": s, "train/loss": float(s)})
    log.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:7] + "\x00\x00garbage"
    path.write_text("\n".join(lines) + "\n" + '{"step": 5, "tr')  # and a last line cut by a crash
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: skipped a line"):
        truncate_metrics(path, 4)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 3, 4]
