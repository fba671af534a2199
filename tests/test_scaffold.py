"""The run scaffold: every command that writes a run directory takes its lock before it reads,
deletes or writes anything there (two real processes on one directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlvr.cli import main as cli
from rlvr.dpo import DPOConfig, _as_dict
from rlvr.rundir import RunDirBusy
from rlvr.scaffold import claimed_output_dir

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that takes the run directory's lock, as a live run does, and keeps it until killed."""
    code = textwrap.dedent(f"""
        import time
        from rlvr.rundir import RunDirLock
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


def test_dpo_resume_and_overwrite_on_a_live_run_are_refused_and_touch_nothing(tmp_path, pairs_file, capsys):
    run_dir = tmp_path / "dpo"
    run_dir.mkdir()
    config = _as_dict(DPOConfig(model=str(tmp_path / "sft"), data=(str(pairs_file),), out=run_dir))
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
