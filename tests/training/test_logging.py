"""The trackers for real: W&B in offline mode (its run file and media read back) and TensorBoard (its event
files read back with TensorBoard's own EventAccumulator), from ``MetricsLogger`` and from ``rlvr train``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from rlvr.cli import main as cli
from rlvr.training.metrics_log import ROLLOUT_SAMPLES, SAMPLE_COLUMNS, MetricsLogger, markdown_table, read_metrics

# W&B's run file (``run-<id>.wandb``) is a LevelDB-style log of ``Record`` protos: a file header (":W&B",
# a magic, a version), then blocks whose chunks each have a checksum, a length, a type and data.
WANDB_FILE_HEADER, WANDB_BLOCK, CHUNK_HEADER = 7, 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of a W&B run file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos = [], b"", WANDB_FILE_HEADER
    while pos + CHUNK_HEADER <= len(data):
        room = WANDB_BLOCK - pos % WANDB_BLOCK
        if room < CHUNK_HEADER:  # the block's tail is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, FIRST):
            pending = chunk
        elif kind in (MIDDLE, LAST):
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_offline_run(run_dir: Path) -> tuple[dict, dict[int, dict], Path]:
    """What the one offline W&B run under ``run_dir`` holds: its run record's fields, its history by step
    (values JSON-decoded) and its files folder."""
    [run_folder] = (run_dir / "wandb").glob("offline-run-*")
    [run_file] = run_folder.glob("run-*.wandb")
    run: dict = {}
    history: dict[int, dict] = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            run = {"id": record.run.run_id, "name": record.run.display_name, "group": record.run.run_group}
            run["config"] = config
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
    return run, history, run_folder / "files"


@pytest.fixture()
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()


SAMPLES = [
    {"prompt": "2+2?", "response": "4", "ground_truth": "4", "reward": 1.0, "advantage": 0.5, "finish_reason": "stop"},
    {
        "prompt": "2+2?",
        "response": "5",
        "ground_truth": "4",
        "reward": 0.0,
        "advantage": -0.5,
        "finish_reason": "length",
    },
]


def test_wandb_offline_run_holds_names_config_metrics_and_the_samples_table(tmp_path, offline_wandb):
    run_dir = tmp_path / "sweep" / "dr_grpo" / "seed_3"
    run_dir.mkdir(parents=True)
    logger = MetricsLogger(run_dir, {"optim": {"lr": 0.001}}, wandb=True)
    logger.log({"step": 1, "train/reward": 0.25})
    logger.log({"step": 2, "train/reward": 0.75, ROLLOUT_SAMPLES: SAMPLES})
    logger.close()

    run, history, files = wandb_offline_run(run_dir)
    assert (run["name"], run["group"]) == ("dr_grpo/seed_3", "dr_grpo")
    assert run["id"] == (run_dir / "wandb_id").read_text()
    assert run["config"]["optim"] == {"lr": 0.001}
    assert history[1]["train/reward"] == 0.25 and history[2]["train/reward"] == 0.75
    assert "samples" not in history[1]
    [table_file] = (files / "media" / "table").glob("samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"] == [["2+2?", "4", "4", 1.0, 0.5, "stop"], ["2+2?", "5", "4", 0.0, -0.5, "length"]]
    # metrics.jsonl keeps the numbers only: the rollouts have files of their own
    assert read_metrics(run_dir / "metrics.jsonl") == [
        {"step": 1, "train/reward": 0.25},
        {"step": 2, "train/reward": 0.75},
    ]


def test_wandb_run_keeps_its_id_when_the_run_resumes(tmp_path, offline_wandb):
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    MetricsLogger(run_dir, {}, wandb=True).close()
    first = (run_dir / "wandb_id").read_text()
    assert first.isalnum() and first == first.lower()
    logger = MetricsLogger(run_dir, {}, wandb=True)
    logger.log({"step": 3, "train/reward": 1.0})
    logger.close()
    run_ids = [
        record.run.run_id
        for run_file in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
        for record in wandb_records(run_file)
        if record.WhichOneof("record_type") == "run"
    ]
    assert run_ids and set(run_ids) == {first}


def tensorboard_events(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_event_files_hold_the_scalars_and_the_samples_text(tmp_path):
    logger = MetricsLogger(tmp_path, {}, tensorboard=True)
    logger.log({"step": 1, "train/reward": 0.25, "note": "not a number"})
    logger.log({"step": 2, "train/reward": 0.75, ROLLOUT_SAMPLES: SAMPLES})
    logger.close()

    events = tensorboard_events(tmp_path)
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [(1, 0.25), (2, 0.75)]
    assert "note" not in events.Tags()["scalars"]
    [text] = events.Tensors("samples/text_summary")
    assert text.step == 2
    assert text.tensor_proto.string_val[0].decode() == markdown_table(
        SAMPLE_COLUMNS, [[r[c] for c in SAMPLE_COLUMNS] for r in SAMPLES]
    )


def test_markdown_table_keeps_each_row_on_one_line():
    table = markdown_table(["prompt", "reward"], [["a | b\nc", 0.123456], ["x", None]])
    assert table.splitlines() == [
        "| prompt | reward |",
        "|---|---|",
        "| a \\| b<br>c | 0.1235 |",
        "| x | None |",
    ]


RUN_YAML = """\
model: {fresh: tiny, tokenizer_vocab_size: 300}
data: {train_source: "arith:steps=1,max_value=9", train_size: 8, val_split: validation, val_size: 2}
prompt: r1_zero
rollout: {n_prompts_per_rollout_batch: 2, group_size: 2, max_new_tokens: 4}
optim: {lr: 1e-3, gradient_accumulation_steps: 1}
log: {progress: false, val_samples: 0, wandb: true, tensorboard: true}
n_steps: 2
eval_every: 0
dump_every: 2
save_every: 0
"""


def test_rlvr_train_logs_metrics_and_sampled_completions_to_both_trackers(tmp_path, offline_wandb):
    config = tmp_path / "run.yaml"
    config.write_text(RUN_YAML)
    out = tmp_path / "run"
    assert cli(["train", "--config", str(config), "--out", str(out)]) == 0

    rows = read_metrics(out / "metrics.jsonl", one_row_per_step=True)
    assert [r["step"] for r in rows] == [0, 1, 2]
    dumped = [json.loads(line) for line in (out / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    samples = [[r[c] for c in SAMPLE_COLUMNS] for r in dumped]
    assert len(samples) == 4  # two prompts, two completions each

    run, history, files = wandb_offline_run(out)
    assert run["config"]["n_steps"] == 2
    assert [history[s]["train/reward"] for s in (1, 2)] == [rows[1]["train/reward"], rows[2]["train/reward"]]
    tables = [json.loads(p.read_text()) for p in (files / "media" / "table").glob("samples_*.table.json")]
    assert [t["data"] for t in tables] == [samples]  # step 2 only: dump_every is 2

    events = tensorboard_events(out)
    assert [e.step for e in events.Scalars("train/reward")] == [1, 2]
    [text] = events.Tensors("samples/text_summary")
    assert text.step == 2 and text.tensor_proto.string_val[0].decode() == markdown_table(SAMPLE_COLUMNS, samples)
