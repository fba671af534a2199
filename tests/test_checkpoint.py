"""Checkpoints: exact round trip of weights, optimizer, scheduler and RNG; a crash mid-write leaves the
previous checkpoint usable; metrics are truncated to the checkpoint on resume."""

from __future__ import annotations

import random

import pytest
import torch

import rlvr.checkpoint as ck
from rlvr.logging_utils import MetricsLogger, read_metrics, truncate_metrics


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
