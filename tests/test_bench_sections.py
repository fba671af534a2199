"""The speed benchmark's section runner (``benchmarks/section_runner.py``): every section runs on its own,
one that runs out of memory or fails is listed with its reason and the others still run, a section that
needs a failed one is skipped with the reason; and the GPU scripts' steps (``scripts/steps.sh``) the same.
On the CPU, with real tiny sections (a forward of the bench's model, a real indexing error)."""

from __future__ import annotations

import json
import subprocess
import weakref

import pytest
import torch
from conftest import REPO


@pytest.fixture()
def runner(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import section_runner

    return section_runner


@pytest.fixture()
def bench_speed(monkeypatch, runner):
    import bench_speed

    return bench_speed


def test_run_sections_isolates_failures_and_skips_what_needs_them(runner):
    S = runner.Section
    held = {}

    def product(ctx):
        ctx["product"] = (torch.ones(8, 8) @ torch.ones(8, 8)).sum().item()

    def out_of_memory(ctx):
        block = torch.empty(1 << 20)  # what a section holds when the allocator gives up
        held["block"] = weakref.ref(block)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def mismatched(ctx):
        torch.ones(2, 3) @ torch.ones(2, 3)

    def optional(ctx):
        raise runner.SectionSkipped("optional package missing")

    frees = []
    table = {
        "product": S(product),
        "oom": S(out_of_memory),
        "after_oom": S(lambda ctx: ctx.setdefault("after_oom", True), needs=("oom",)),
        "error": S(mismatched),
        "after_error": S(lambda ctx: None, needs=("product", "error")),
        "too_big": S(lambda ctx: ctx.setdefault("too_big", True), memory=lambda ctx: 3 * runner.GIB),
        "fits": S(lambda ctx: ctx.setdefault("fits", True), memory=lambda ctx: runner.GIB),
        "optional": S(optional),
        "needs_unchosen": S(lambda ctx: None, needs=("not_chosen",)),
        "last": S(lambda ctx: ctx.setdefault("last", ctx["product"]), needs=("product",)),
    }
    ctx: dict = {}
    seen = []
    outcomes = runner.run_sections(
        table,
        list(table),
        ctx,
        available=lambda: 2 * runner.GIB,
        free=lambda: frees.append(held["block"]() if "block" in held else None),
        report=seen.append,
    )
    got = {o.name: (o.status, o.reason) for o in outcomes}
    assert [o.name for o in outcomes] == list(table) and seen == outcomes
    assert got["product"] == ("ok", "") and ctx["product"] == 512.0
    assert got["oom"] == ("out of memory", "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")
    # The section's tensors are unreachable when memory is freed after it (its traceback is gone).
    assert frees[1] is None
    assert got["after_oom"] == ("skipped", "needs oom, which ran out of memory") and "after_oom" not in ctx
    assert got["error"][0] == "failed" and got["error"][1].startswith("RuntimeError: mat1 and mat2 shapes")
    assert got["after_error"] == ("skipped", "needs error, which failed")
    assert got["too_big"] == ("skipped", "needs about 3.0 GiB by its estimate, 2.0 GiB free")
    assert "too_big" not in ctx and ctx["fits"] is True
    assert got["optional"] == ("skipped", "optional package missing")
    assert got["needs_unchosen"] == ("skipped", "needs not_chosen, which did not run (not among the sections chosen)")
    assert got["last"] == ("ok", "") and ctx["last"] == 512.0
    assert len(frees) == 6  # after each section that started, and only those
    table_md = runner.outcome_table(outcomes)
    assert "| oom | out of memory |" in table_md and "| after_oom | skipped |" in table_md


def test_run_sections_skips_past_the_deadline(runner):
    outcomes = runner.run_sections({"a": runner.Section(lambda ctx: None)}, ["a"], None, deadline_s=1.0, started=0.0)
    assert (outcomes[0].status, outcomes[0].reason) == ("skipped", "past the 1 s deadline")


def _main(bench_speed, gsm8k_path, tmp_path, sections: str, *flags: str) -> tuple[int, str, dict]:
    out = tmp_path / "out"
    rc = bench_speed.main(
        ["--data-dir", str(gsm8k_path), "--tiny", "--no-trl", "--sections", sections, "--out", str(out), *flags]
    )
    return rc, (out / "bench_speed.md").read_text(), json.loads((out / "bench_speed.json").read_text())


def test_bench_speed_runs_every_section_and_says_why_some_did_not(
    bench_speed, runner, gsm8k_path, tmp_path, monkeypatch
):
    """Test-only sections registered in ``SECTIONS`` beside the real ``compiled``, whose ``training`` (the
    section it reads) runs out of memory here, as it did on an 80 GB card."""
    S = runner.Section

    def forward(bench):
        ids = torch.tensor([bench.tok("12 + 30 =", add_special_tokens=False)["input_ids"]])
        logits = bench.model(ids).logits
        bench.row("test: forward", f"{logits.shape[-1]} logits")

    def training_out_of_memory(bench):
        bench.train_batch = None  # what it set before failing must not lead the next section astray
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 88.00 GiB")

    def token_past_the_vocabulary(bench):
        bench.model(torch.tensor([[bench.model.config.vocab_size + 5]]))

    monkeypatch.setitem(bench_speed.SECTIONS, "test_forward", S(forward))
    monkeypatch.setitem(bench_speed.SECTIONS, "training", S(training_out_of_memory))
    monkeypatch.setitem(bench_speed.SECTIONS, "test_bad_token", S(token_past_the_vocabulary))
    monkeypatch.setitem(bench_speed.SECTIONS, "test_after", S(forward, needs=("test_bad_token",)))
    chosen = "test_forward,training,compiled,test_bad_token,test_after,trl"
    rc, md, log = _main(bench_speed, gsm8k_path, tmp_path, chosen)
    assert rc == 0
    status = {s["name"]: (s["status"], s["reason"]) for s in log["sections"]}
    assert list(status) == ["ceilings", "training", "compiled", "trl", "test_forward", "test_bad_token", "test_after"]
    assert status["ceilings"] == status["test_forward"] == ("ok", "")
    assert status["training"] == ("out of memory", "OutOfMemoryError: CUDA out of memory. Tried to allocate 88.00 GiB")
    assert status["compiled"] == ("skipped", "needs training, which ran out of memory")
    assert status["test_bad_token"][0] == "failed" and status["test_bad_token"][1].startswith("IndexError")
    assert status["test_after"] == ("skipped", "needs test_bad_token, which failed")
    assert status["trl"] == ("skipped", "--no-trl")
    # The card heads the table; each section that did not finish is a row of it with its reason.
    assert md.startswith("card: CPU (no GPU)\n") and log["card"] == {"name": "CPU (no GPU)"}
    assert "| test: forward |" in md
    assert "| compiled SKIPPED | needs training, which ran out of memory |" in md
    assert "| training OUT OF MEMORY | OutOfMemoryError: CUDA out of memory." in md
    assert "| test_bad_token | failed |" in md  # the outcome table under it
    rc, _, _ = _main(bench_speed, gsm8k_path, tmp_path, "test_forward,test_bad_token", "--strict")
    assert rc == 1
    rc, _, _ = _main(bench_speed, gsm8k_path, tmp_path, "test_forward,compiled", "--strict")
    assert rc == 0  # a skip is no failure


def test_bench_speed_section_choice(bench_speed):
    args = bench_speed.parse_args(["--data-dir", ".", "--sections", "compiled,checks"])
    assert bench_speed.chosen_sections(args) == ["ceilings", "checks", "compiled"]
    assert bench_speed.SECTIONS["compiled"].needs == ("ceilings", "training")
    assert "realistic" in bench_speed.SECTIONS["training"].needs
    assert list(bench_speed.SECTIONS).index("multiturn") == list(bench_speed.SECTIONS).index("realistic") + 1
    assert bench_speed.SECTIONS["multiturn"].needs == ("ceilings",)
    with pytest.raises(SystemExit, match="unknown --sections complied"):
        bench_speed.chosen_sections(bench_speed.parse_args(["--data-dir", ".", "--sections", "complied"]))


def test_floors_worked_by_hand(bench_speed):
    """The decode floor (the larger of the bytes a step reads and its matmul FLOPs) and the training
    floor, on a two-layer Llama with grouped-query attention whose sizes are counted here by hand."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    # A layer: q 64x64, k and v 64x32 each, o 64x64, gate/up/down 64x128 each, two norms of 64.
    layer = 4096 + 2 * 2048 + 4096 + 3 * 8192 + 2 * 64
    assert bench_speed.param_counts(model) == (2 * layer + 6400 + 6400 + 64, 2 * layer + 6400 + 64)
    # K and V of 2 heads of 16 in 2 layers, 2 bytes a value.
    assert bench_speed.kv_bytes_per_token(cfg, 2) == 256
    bench = SimpleNamespace(model=model, dtype=torch.bfloat16, bw=1e6, mm=1e7)
    # Rows of 3, 3, 5, 5 new tokens in groups of two sharing prompts of 10: 5 steps read the bf16
    # weights; responses 256 x (6 + 6 + 15 + 15) bytes; prompts 256 x 10 x (3 + 5), a group's read while
    # any of its rows is live.
    weights = 2 * (2 * layer + 12864)
    assert weights == 173_696
    floor = bench_speed.Bench.decode_floor(bench, [10] * 4, [3, 3, 5, 5], group=2)
    assert floor == pytest.approx((5 * 173_696 + 256 * 42 + 256 * 80) / 1e6)
    # A slower matmul makes the 2 x 80,448 matmul params x 16 tokens the larger.
    bench.mm = 1e6
    assert bench_speed.Bench.decode_floor(bench, [10] * 4, [3, 3, 5, 5], group=2) == pytest.approx(
        2 * 80_448 * 16 / 1e6
    )
    # Training: 6 x 1.5 B params x 100,000 tokens at 900 TFLOP/s is one second.
    assert bench_speed.train_floor_s(1_500_000_000, 100_000, 9e14) == pytest.approx(1.0)


def test_memory_estimates_match_the_recorded_peaks_and_fit_an_80gb_card(bench_speed):
    """The training estimates against the peaks recorded on an H200 for the OLMo-2-1B shape
    (docs/benchmarks.md, the run of c0d7192; peaks include the resident bf16 weights), and what they
    choose on an 80 GB card: the training section's larger eager budget left out, the rest run."""
    from transformers import Olmo2Config

    from rlvr.modeling import OLMO2_1B

    cfg = Olmo2Config(**OLMO2_1B)
    n = 1_485_000_000
    weights = 2 * n
    gib = 2**30
    eager_16k = (weights + bench_speed.training_bytes(cfg, n, 16384)) / gib
    eager_32k = (weights + bench_speed.training_bytes(cfg, n, 32768)) / gib
    compiled_16k = (weights + bench_speed.training_bytes(cfg, n, 16384, compiled=True)) / gib
    assert eager_16k == pytest.approx(53.0, rel=0.1)
    assert eager_32k == pytest.approx(91.5, rel=0.1)
    assert compiled_16k == pytest.approx(36.7, rel=0.1)
    # The trainer's whole step (f): the engine of the suggested rollout batch beside the compiled step
    # with float32 master weights and kept head logits; the lean run (f') frees the engine's buffers
    # before training and steps bf16 AdamW.
    engine = bench_speed.engine_bytes(cfg, 256, 32, 256, 512)
    step = bench_speed.training_bytes(cfg, n, 16384, compiled=True, master_weights=True, keep_head_logits=True)
    lean = bench_speed.training_bytes(cfg, n, 10240, compiled=True, keep_head_logits=True)
    assert (weights + engine + step) / gib == pytest.approx(68.2, rel=0.1)
    assert (weights + max(engine, lean)) / gib == pytest.approx(29.4, rel=0.1)
    # What a section may add on an H100 with the model resident.
    room = 76 * gib
    assert bench_speed.memory_reason(bench_speed.training_bytes(cfg, n, 32768), room) is not None
    for need in (bench_speed.training_bytes(cfg, n, 16384), engine + step, max(engine, lean)):
        assert bench_speed.memory_reason(need, room) is None


def test_steps_run_after_a_failure_and_the_summary_says_why(tmp_path):
    script = (
        f"set -euo pipefail; source {REPO / 'scripts' / 'steps.sh'}; "
        "step first -- true; step broken -- sh -c 'exit 3'; step needs_broken broken -- touch never; "
        "step needs_skipped needs_broken -- true; step last first -- touch ran; steps_summary"
    )
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert (tmp_path / "ran").exists() and not (tmp_path / "never").exists()
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == [
        "| first | ok | 0 |  |",
        "| broken | failed | 0 | exit status 3 |",
        "| needs_broken | skipped | 0 | needs broken, which failed (exit status 3) |",
        "| needs_skipped | skipped | 0 | needs needs_broken, which was skipped |",
        "| last | ok | 0 |  |",
    ]
    assert "card: " in proc.stdout


def test_gpu_check_runs_both_halves_when_the_first_fails(tmp_path):
    """``make gpu-check`` with a Python that fails at once: both halves run, both are in the summary."""
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", "GPU_PYTHON=false"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "| gpu-test | failed |" in proc.stdout and "| gpu-smoke | failed |" in proc.stdout


@pytest.mark.slow
def test_multiturn_section_times_three_ways_and_counts_the_prefill_it_saves(bench_speed, gsm8k_path, tmp_path):
    """The multiturn section at ``--tiny``: continuing, without and single turn each a row, every later
    round reusing kept K/V inside ``continuing()`` and none outside it."""
    rc, md, log = _main(bench_speed, gsm8k_path, tmp_path, "multiturn", "--strict")
    assert rc == 0
    assert {s["name"]: s["status"] for s in log["sections"]}["multiturn"] == "ok"
    rows = [r["what"] for r in log["rows"]]
    for start in ("(mt-a) multi-turn in continuing()", "(mt-a) round 1", "(mt-a) round 2", "(mt-a) round 3"):
        assert sum(w.startswith(start) for w in rows) == 1, (start, rows)
    for start in ("(mt-b) multi-turn without", "(mt-c) single turn", "(mt) continuing against single", "(mt) prefill"):
        assert sum(w.startswith(start) for w in rows) == 1, (start, rows)
    ways = log["multiturn"]["ways"]
    turns = log["multiturn"]["turn_lengths"]
    new_tokens = sum(x for turn in turns for row in turn for x in row)
    for way in ("continuing", "without"):
        assert sum(r["tokens"] for r in ways[way]["best"]) <= new_tokens
    assert all(r["reused"] > 0 for r in ways["continuing"]["best"][1:])
    assert all(r["reused"] == 0 for r in ways["without"]["best"])
    # on the CPU in float32 the kept K/V equal those read again, so the same seeds sample the same tokens
    rows_in_batch = len(turns[0]) * len(turns[0][0])
    agreement = log["multiturn"]["agreement"]
    assert agreement["same_through_round"] == [rows_in_batch] * len(turns)
    assert agreement["compared_tokens"] == sum(r["tokens"] for r in ways["continuing"]["best"][1:])
    assert agreement["max_abs_logprob_diff"] < 1e-4
    same = " / ".join([f"{rows_in_batch}/{rows_in_batch}"] * len(turns))
    assert f"| (mt) continuing against without: the same tokens, same seeds | {same} |" in md
    assert "| (mt) prefill saved by continuing(), rounds 2-3 |" in md


def test_multiturn_agreement_counts_conversations_alike_and_compares_log_probs_before_they_part(bench_speed):
    """Two conversations over two rounds: the first alike throughout (its round-2 log-probs differ by 0.1
    and 0.2), the second parts at round 2's second token (only its first token's log-prob compares)."""
    a = [
        dict(ids=[(1, 2), (3, 4)], logprobs=[[-1.0, -1.0], [-1.0, -1.0]]),
        dict(ids=[(5, 6), (7, 8)], logprobs=[[-0.5, -0.5], [-2.0, -3.0]]),
    ]
    b = [
        dict(ids=[(1, 2), (3, 4)], logprobs=[[-1.0, -1.0], [-1.0, -1.0]]),
        dict(ids=[(5, 6), (7, 9)], logprobs=[[-0.4, -0.7], [-2.5, -9.0]]),
    ]
    got = bench_speed.multiturn_agreement(a, b)
    assert got["conversations"] == 2 and got["same_through_round"] == [2, 1]
    assert got["compared_tokens"] == 3
    assert got["mean_abs_logprob_diff"] == pytest.approx((0.1 + 0.2 + 0.5) / 3)
    assert got["max_abs_logprob_diff"] == pytest.approx(0.5)


@pytest.mark.slow
def test_training_leaves_out_a_budget_that_does_not_fit_and_the_trainer_scales_down(
    bench_speed, runner, gsm8k_path, monkeypatch
):
    """The real training section on a card that (by ``Bench.memory_skip``, here given a limit) holds only
    the smaller budget: that one runs, the larger is a row with the reason, the section ends ok. The
    trainer's budget halves until its estimate fits, or the section is skipped."""
    limit = {}

    def memory_skip(bench, need):
        return runner.memory_reason(need, limit.get("bytes"))

    monkeypatch.setattr(bench_speed.Bench, "memory_skip", memory_skip)
    bench = bench_speed.Bench(bench_speed.parse_args(["--data-dir", str(gsm8k_path), "--tiny"]))
    bench.setup()
    cfg, n = bench.model.config, bench.n_params
    limit["bytes"] = bench_speed.training_bytes(cfg, n, 1024, size=bench.weight_size())  # the smaller budget
    bench.ceilings()
    bench.realistic()
    bench.training()
    rows = {r["what"]: r["measured"] for r in bench.rows}
    assert any(w.startswith("(e) train step: rlvr: ") and "token budget 1,024" in w for w in rows)
    skipped = [w for w in rows if "token budget 2,048" in w]
    assert skipped == [skipped[0]] and skipped[0].endswith(" SKIPPED") and rows[skipped[0]].startswith("needs about")
    assert bench.best_budget == 1024 and "(e') train speed-up over naive" in rows
    limit["bytes"] = bench.trainer_bytes(4096) + 1
    assert bench.trainer_budget(16384) == (
        4096,
        f"; token budget scaled down from 16,384 (16,384 {memory_skip(bench, bench.trainer_bytes(16384))})",
    )
    limit["bytes"] = bench.trainer_bytes(16) - 1
    with pytest.raises(runner.SectionSkipped, match="token budget 16,384 down to 2,048: needs about"):
        bench.trainer_budget(16384)
