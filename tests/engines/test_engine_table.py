"""Engines in one table: lookup by name, an unknown name's error, options built from the config's
engine section (the same for train, eval and the suites), and engine options that moved under their
engine's section (``engine.fast.*``, ``engine.worker.*``, ``engine.vllm.*``) naming the new key."""

from __future__ import annotations

import json

import pytest

from rlvr.checks import resolve_config, validate_config
from rlvr.commands.train import parse_command
from rlvr.config import (
    MOVED_KEYS,
    ConfigError,
    EngineConfig,
    FastEngineConfig,
    TrainConfig,
    VLLMEngineConfig,
    WorkerEngineConfig,
    load_config_file,
    upgrade_moved_keys,
)
from rlvr.engines import ENGINES, UnknownEngineError, build_engine, engine_entry, engine_names, register_engine
from rlvr.engines.base import Completion, SamplingParams, generate_in_chunks
from rlvr.errors import UserError


def test_table_names_every_engine_and_its_class():
    from rlvr.engines.fast import FastHFEngine
    from rlvr.engines.hf import HFEngine
    from rlvr.engines.worker import HFWorkerEngine

    assert set(engine_names()) == {"hf", "hf-fast", "hf-worker", "vllm", "auto"}
    assert engine_entry("hf").load() is HFEngine
    assert engine_entry("hf-fast").load() is FastHFEngine
    assert engine_entry("hf-worker").load() is HFWorkerEngine


def test_unknown_engine_names_the_choices():
    with pytest.raises(
        UnknownEngineError, match="unknown engine 'nope': choose one of hf, hf-fast, hf-worker, vllm, auto"
    ):
        engine_entry("nope")
    assert issubclass(UnknownEngineError, UserError) and issubclass(UnknownEngineError, ValueError)
    with pytest.raises(ConfigError, match="unknown engine.name 'nope'"):
        validate_config(resolve_config(TrainConfig(engine=EngineConfig(name="nope"))))


def test_options_come_from_the_engine_section():
    e = EngineConfig(
        name="hf-fast",
        device="cuda:1",
        max_batch_size=16,
        fast=FastEngineConfig(release_memory=True, attention="sdpa", fuse_projections=False, cascade_min_rows=None),
        worker=WorkerEngineConfig(dtype="bfloat16"),
        vllm=VLLMEngineConfig(base_url="http://h:1", port=9),
    )
    assert ENGINES["hf"].options(e, None) == {"max_batch_size": 16}
    assert ENGINES["hf-fast"].options(e, None) == {
        "max_batch_size": 16,
        "release_memory": True,
        "attention": "sdpa",
        "fuse_projections": False,
        "cascade_min_rows": None,
    }
    assert ENGINES["hf-worker"].options(e, None) == {"device": "cuda:1", "dtype": "bfloat16", "max_batch_size": 16}
    assert ENGINES["vllm"].options(e, "m") == {
        "served_model": "m",
        "base_url": "http://h:1",
        "port": 9,
        "gpu": "1",
        "start_server": False,
    }
    assert ENGINES["hf-worker"].options(EngineConfig(device="cpu"), None)["dtype"] is None  # auto: the engine decides


def test_build_engine_and_a_registered_engine(tiny_model, tiny_tokenizer):
    from rlvr.engines.hf import HFEngine

    engine = build_engine(EngineConfig(name="hf", max_batch_size=3), tiny_model, tiny_tokenizer)
    assert isinstance(engine, HFEngine) and engine.max_batch_size == 3
    register_engine("test-hf", "rlvr.engines.hf:HFEngine")
    try:
        assert "test-hf" in engine_names()
        validate_config(resolve_config(TrainConfig(engine=EngineConfig(name="test-hf"))))
        engine = build_engine(EngineConfig(name="test-hf", max_batch_size=3), tiny_model, tiny_tokenizer)
        assert isinstance(engine, HFEngine) and engine.max_batch_size == 64  # no options: the class's defaults
    finally:
        ENGINES.pop("test-hf")


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_old_flat_key_in_a_file_names_the_new_key(old, tmp_path):
    section, name = old.split(".")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({section: {name: None}}))
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    message = str(info.value)
    assert f"config key {old} is now {MOVED_KEYS[old]}" in message and "\n" not in message


def train_flags(args: list[str]) -> TrainConfig:
    """The config of ``rlvr train`` with these flags."""
    return parse_command([*args, "--out", "run"])[0]


def test_old_flag_names_the_new_flag():
    with pytest.raises(ConfigError, match=r"^--engine.cascade_min_rows is now --engine.fast.cascade_min_rows"):
        train_flags(["--engine.cascade_min_rows", "32"])
    with pytest.raises(ConfigError, match=r"--engine.fuse_projections is now --engine.fast.fuse_projections"):
        train_flags(["--engine.no-fuse-projections"])
    with pytest.raises(ConfigError, match=r"--engine.vllm_base_url is now --engine.vllm.base_url"):
        train_flags(["--engine.vllm-base-url=http://x"])


def test_grouped_flags_override():
    c = train_flags(
        [
            "--engine.fast.cascade_min_rows",
            "32",
            "--engine.fast.no-fuse-projections",
            "--engine.worker.dtype",
            "float32",
            "--engine.vllm.port",
            "9000",
        ]
    )
    assert c.engine.fast.cascade_min_rows == 32 and c.engine.fast.fuse_projections is False
    assert c.engine.worker.dtype == "float32" and c.engine.vllm.port == 9000


def test_a_run_directory_config_with_the_old_keys_still_reads():
    raw = TrainConfig().to_dict()
    engine = raw["engine"]
    fast, worker, vllm = engine.pop("fast"), engine.pop("worker"), engine.pop("vllm")
    engine.update(fast, dtype=worker["dtype"], vllm_base_url=vllm["base_url"], vllm_port=vllm["port"])
    engine["cascade_min_rows"] = 32
    upgraded = TrainConfig.from_dict(upgrade_moved_keys(raw))
    assert upgraded == TrainConfig(engine=EngineConfig(fast=FastEngineConfig(cascade_min_rows=32)))


class RecordingEngine:
    """An ``Engine`` that answers each prompt with its own text and records every call's seed and size."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        self.calls.append((len(prompts), params.seed))
        return [[Completion(text=p, token_ids=[], finish_reason="stop")] for p in prompts]

    def sync_weights(self, model: object) -> dict:
        return {}

    def close(self) -> None:
        pass


def test_generate_in_chunks_keeps_order_and_seeds_each_chunk_apart():
    prompts = [f"q{i}" for i in range(7)]
    engine = RecordingEngine()
    groups, seconds = generate_in_chunks(engine, prompts, SamplingParams(seed=5), 3, seed_per_chunk=True)
    assert [g[0].text for g in groups] == prompts and seconds >= 0
    assert engine.calls == [(3, 5), (3, 6), (1, 7)]
    engine = RecordingEngine()
    generate_in_chunks(engine, prompts, SamplingParams(seed=5), 3)
    assert engine.calls == [(3, 5), (3, 5), (1, 5)]
    engine = RecordingEngine()
    generate_in_chunks(engine, prompts, SamplingParams(seed=None), 4, seed_per_chunk=True)
    assert engine.calls == [(4, None), (3, None)]
