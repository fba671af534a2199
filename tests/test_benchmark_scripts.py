"""The GPU diagnostics in ``benchmarks/`` run on the CPU at a tiny size (``--tiny``), so that a change
that breaks them shows here and not first on a lent GPU. Their numbers mean nothing on the CPU; the
tests check that each part runs to its table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def _run(script: str, *args: str, gsm8k: str | None, env: dict | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "benchmarks")]), **(env or {}))
    data = ["--data-dir", gsm8k] if gsm8k is not None else []
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *data, "--tiny", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_profile_step_trainer_part_runs(gsm8k_real_path):
    """The trainer against the same update alone: phases of a steady step, then the comparison table."""
    out = _run("profile_step.py", "--only", "trainer", gsm8k=str(gsm8k_real_path))
    assert "seconds per phase" in out and "time/train" in out
    assert "policy_gradient_update alone, 3 calls" in out
    assert "kernels by kind: the trainer's train phase" in out and "kernels by kind: the same update alone" in out


def test_profile_step_whole_step_part_runs(gsm8k_real_path):
    """One whole trainer step under the profiler, its host regions labelled."""
    out = _run("profile_step.py", "--only", "step", gsm8k=str(gsm8k_real_path))
    assert "under the profiler: wall" in out and "GPU busy" in out
    regions = out.split("host region | wall s")[1].split("##")[0]
    for label in ("rollout", "generate", "encode texts", "pad batch", "update", "policy_gradient_update"):
        assert f"\n{label} |" in regions


def test_idle_gaps_names_the_innermost_region_under_way(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from profile_step import idle_gaps

    spans = [(0, 100), (150, 400), (1000, 1100), (1150, 1500)]  # kernels, us
    regions = [("step", 0, 2000), ("encode", 500, 900)]
    # 400 -> 1000 (600 us, middle 700: inside encode); 100 -> 150 and 1100 -> 1150 are under 200 us
    assert idle_gaps(spans, regions) == [(400, 600, "encode")]
    assert idle_gaps(spans, regions, least_us=40) == [(100, 50, "step"), (400, 600, "encode"), (1100, 50, "step")]


def test_bench_trainer_step_runs_packed_and_padded(gsm8k_real_path):
    """The whole-step rows with and without ``--shared-prefix``: the packed run puts fewer tokens
    through the model for the same rollouts (same seed, same prompts). Beside the realistic call (which
    runs after it), the trainer's generate phase is compared with it per generated token."""
    tokens = {}
    for flag in ((), ("--shared-prefix",)):
        out = _run(
            "bench_speed.py",
            "--sections",
            "trainer_step,realistic" if flag else "trainer_step",
            "--no-trl",
            *flag,
            "--trainer-steps",
            "2",
            gsm8k=str(gsm8k_real_path),
        )
        row = next(line for line in out.splitlines() if line.startswith("| (f) rlvr trainer"))
        assert ("packed, shared prompts" in row) == bool(flag), row
        tokens[bool(flag)] = int(row.split(" tokens through the model")[0].rsplit(" ", 1)[1].replace(",", ""))
        per_token = [line for line in out.splitlines() if line.startswith("| (f'') the trainer's generate phase")]
        assert len(per_token) == (1 if flag else 0), per_token
        if flag:
            assert float(per_token[0].split("|")[2].strip().rstrip("x")) > 0 and " us in (d) (mean " in per_token[0]
        # The step against the sum of its decode and training floors: the ratio is the step over that sum.
        floors = next(line for line in out.splitlines() if line.startswith("| (f*) the whole step"))
        cells = [c.strip() for c in floors.split("|")]
        ratio, step = cells[2].split("x (")
        assert float(ratio) == pytest.approx(float(step.rstrip(" s)")) / float(cells[3].rstrip(" s")), rel=0.05)
        assert "of the measured matmul rate (goal >= 60%" in floors, floors
    assert 0 < tokens[True] < tokens[False], tokens


def test_triton_gemms_probe_runs():
    """The decode matmuls against the small-tile Triton GEMM, through Triton's interpreter (float32)."""
    out = _run(
        "probes/triton_gemms.py", "--rows", "5", "--models", "olmo2-1b", gsm8k=None, env={"TRITON_INTERPRET": "1"}
    )
    assert "relative error" not in out  # every tiling tried matched F.linear
    assert sum(line.startswith("| olmo2-1b | 5 |") for line in out.splitlines()) == 2 * 6  # five matmuls and the step


def test_decode_gemms_probe_runs():
    """The decode matmuls per family, BLAS library and row count (no data needed)."""
    out = _run("probes/decode_gemms.py", gsm8k=None)
    for model in ("olmo2-1b", "qwen2.5-1.5b", "llama-3.2-1b", "qwen3-1.7b"):
        assert sum(line.startswith(f"| {model} |") for line in out.splitlines()) == 2 * 3  # as printed and in the table
    assert "FLOP floor" in out


@pytest.mark.parametrize("family", ["qwen2.5-1.5b", "llama-3.2-1b"])
def test_profile_step_family_decode_part_runs(gsm8k_real_path, family):
    """The decode profile on a grouped-query family's layout (at a tiny size)."""
    out = _run("profile_step.py", "--only", "decode", "--family", family, gsm8k=str(gsm8k_real_path))
    assert f"# model: {family}" in out and "graph replay time" in out and "eager decode step" in out


def test_sampling_probe_runs():
    """Sampling alone per vocabulary size and row count (the kernel's column is empty off a GPU)."""
    out = _run("probes/sampling.py", gsm8k=None)
    for name in ("olmo2", "llama-3.2", "qwen2.5/qwen3"):
        assert sum(line.startswith(f"| {name} (") for line in out.splitlines()) == 2 * 3  # as printed and in the table
    assert "counter noise written out" in out and "logits read once" in out


def test_generate_overhead_probe_runs(gsm8k_real_path):
    """The forced and realistic calls against their fixed part, replays and GPU busy time."""
    out = _run("probes/generate_overhead.py", gsm8k=str(gsm8k_real_path))
    assert "forced: one new token" in out and "replays of the captured step" in out
    assert "realistic: one call profiled: wall / GPU busy" in out
    assert "trainer's rollout 4x4, up to 24 tokens" in out and "trainer's rollout: one call profiled" in out


def test_bench_rewards_runs():
    """Both tables of the reward benchmark (threads and async, then processes) on a few rows."""
    out = _run("bench_rewards.py", gsm8k=None)
    assert "I/O-bound reward" in out and "CPU-bound reward" in out and "speed-up" in out


def test_bench_trainer_step_with_a_kl_reference(gsm8k_real_path):
    """The whole-step rows with a KL penalty: a full-copy reference, LoRA without and with KL (the
    adapters-off reference), each a row with its step time, peak memory and (with KL) the logged KL."""
    out = _run(
        "bench_speed.py",
        "--sections",
        "trainer_step_kl_copy,trainer_step_lora,trainer_step_kl_lora",
        "--no-trl",
        "--trainer-steps",
        "2",
        gsm8k=str(gsm8k_real_path),
    )
    assert "FAILED" not in out, out[-3000:]
    labels = ("| (fk) rlvr trainer", "| (fl) rlvr trainer", "| (flk) rlvr trainer")
    rows = [line for line in out.splitlines() if line.startswith(labels)]
    assert [row[: len(label)] for row, label in zip(rows, labels)] == list(labels), out[-3000:]
    assert "a full bf16 copy as reference" in rows[0] and "train/kl_ref" in rows[0]
    assert "LoRA rank 16" in rows[1] and "train/kl_ref" not in rows[1]
    assert "the adapters-off policy as reference" in rows[2] and "train/kl_ref" in rows[2]
    assert "model.compile; mean" in rows[0] and "model.compile; mean" not in rows[1] + rows[2]  # LoRA runs eager
