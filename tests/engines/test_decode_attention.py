"""Decode attention over a shared prompt cache and per-row response caches
(``rlvr.engines.fast.kernels.decode_attention``).

The SDPA reference is checked against values worked out by hand and against a per-row softmax written
out in float64. The Triton kernel is checked against the reference by running ``tests/interpreted``
under Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set before the kernel is defined, so
those tests run in a child pytest); on a GPU ``benchmarks/bench_speed.py`` compares the compiled
kernel with the reference again.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlvr.engines.fast.kernels.decode_attention import default_splits, prompt_runs, reference_decode_attention

TESTS = Path(__file__).resolve().parents[1]


def random_case(
    seed: int,
    groups=3,
    n=4,
    heads=2,
    head_dim=8,
    prompt_slots=21,
    response_slots=19,
    dtype=torch.float32,
    kv_heads=None,
):
    """A chunk of ``groups`` prompts x ``n`` samples, some rows retired (compacted away), ragged prompts.
    ``kv_heads`` (default ``heads``): key/value heads of the caches (grouped-query attention)."""
    kv_heads = kv_heads or heads
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    pk, pv = r(groups, kv_heads, prompt_slots, head_dim), r(groups, kv_heads, prompt_slots, head_dim)
    rk, rv = r(groups * n, kv_heads, response_slots, head_dim), r(groups * n, kv_heads, response_slots, head_dim)
    alive = torch.tensor([i for i in range(groups * n) if i % 5 != 3])  # rows 3, 8, ... finished
    grp = alive // n
    plen = torch.tensor([prompt_slots - 3])
    starts = torch.randint(0, int(plen) - 1, (groups,), generator=g)
    starts[0] = 0
    q = r(len(alive), 1, heads, head_dim).transpose(1, 2)  # the layout the engine's projections give
    rk, rv = rk[alive], rv[alive]  # compaction moved the live rows' responses to the front
    return dict(q=q, pk=pk, pv=pv, rk=rk, rv=rv, grp=grp, start=starts[grp], plen=plen)


def per_row_softmax(q, pk, pv, rk, rv, grp, start, plen, rlen):
    """Row by row, head by head: softmax(q . k / sqrt(d)) over the listed slots, in float64; query head h
    reads key/value head h // (heads / kv_heads)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // pk.shape[1]
    for b in range(q.shape[0]):
        g, s0 = int(grp[b]), int(start[b])
        keys = torch.cat([pk[g, :, s0 : int(plen)], rk[b, :, : int(rlen)]], dim=1).double()
        vals = torch.cat([pv[g, :, s0 : int(plen)], rv[b, :, : int(rlen)]], dim=1).double()
        for h in range(q.shape[1]):
            w = torch.softmax(keys[h // group] @ q[b, h, 0].double() / math.sqrt(q.shape[-1]), dim=0)
            out[b, h, 0] = w @ vals[h // group]
    return out


def test_reference_by_hand():
    """One head of width 2, q = (sqrt 2, 0), so a key's score is its first entry. Row 0 (prompt 0,
    which starts at slot 1) sees prompt slots 1, 2 (scores ln 2, 0) and response slot 0 (ln 3):
    weights 2/6, 1/6, 3/6 on values (6, 0), (0, 6), (2, 2) give (3, 2). Slot 0 of the prompt (padding)
    and response slot 1 (not yet written) hold huge scores that must be masked out."""
    big = 100.0
    pk = torch.tensor(
        [
            [[[big, 0.0], [math.log(2), 5.0], [0.0, 7.0], [big, 0.0]]],
            [[[0.0, 0.0], [0.0, 0.0], [math.log(5), 0.0], [big, 0.0]]],
        ]
    )  # (2 groups, 1, 4, 2)
    pv = torch.tensor(
        [[[[9.0, 9.0], [6.0, 0.0], [0.0, 6.0], [9.0, 9.0]]], [[[9.0, 9.0], [9.0, 9.0], [4.0, 0.0], [9.0, 9.0]]]]
    )
    rk = torch.tensor([[[[math.log(3), -1.0], [big, 0.0]]], [[[0.0, 0.0], [big, 0.0]]]])  # (2 rows, 1, 2, 2)
    rv = torch.tensor([[[[2.0, 2.0], [9.0, 9.0]]], [[[0.0, 1.0], [9.0, 9.0]]]])
    q = torch.tensor([[[[math.sqrt(2), 0.0]]], [[[math.sqrt(2), 0.0]]]])
    grp, start = torch.tensor([0, 1]), torch.tensor([1, 2])
    out = reference_decode_attention(q, pk, pv, rk, rv, grp, start, torch.tensor([3]), torch.tensor([1]), 4, 2)
    # Row 1 (prompt 1 starts at slot 2): prompt slot 2 (score ln 5) and response slot 0 (score 0):
    # weights 5/6, 1/6 on (4, 0), (0, 1).
    expected = torch.tensor([[[[3.0, 2.0]]], [[[20 / 6, 1 / 6]]]])
    assert torch.allclose(out, expected, atol=1e-5), out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rlen", [1, 7, 19])
def test_reference_equals_per_row_softmax(seed, rlen):
    c = random_case(seed)
    out = reference_decode_attention(
        **c, rlen=torch.tensor([rlen]), prompt_slots=c["pk"].shape[2], response_slots=c["rk"].shape[2]
    )
    expected = per_row_softmax(**c, rlen=rlen)
    assert torch.allclose(out.double(), expected, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 3])
def test_reference_with_grouped_query_heads_equals_per_row_softmax(kv_heads):
    """Six query heads over 1, 2 or 3 key/value heads: query head h reads key/value head h // (6 / kv)."""
    c = random_case(4, heads=6, kv_heads=kv_heads)
    out = reference_decode_attention(
        **c, rlen=torch.tensor([7]), prompt_slots=c["pk"].shape[2], response_slots=c["rk"].shape[2]
    )
    assert out.shape == c["q"].shape
    assert torch.allclose(out.double(), per_row_softmax(**c, rlen=7), atol=1e-5)
    # The mapping matters: pairing query heads with the wrong key/value heads changes the result.
    if kv_heads > 1:
        swapped = dict(c, pk=c["pk"].flip(1), pv=c["pv"].flip(1), rk=c["rk"].flip(1), rv=c["rv"].flip(1))
        wrong = reference_decode_attention(
            **swapped, rlen=torch.tensor([7]), prompt_slots=c["pk"].shape[2], response_slots=c["rk"].shape[2]
        )
        assert not torch.allclose(wrong, out, atol=1e-3)


def test_reading_fewer_slots_changes_nothing():
    """The engine reads only the filled response slots rounded up to its length bucket."""
    c = random_case(3)
    full = reference_decode_attention(**c, rlen=torch.tensor([5]), prompt_slots=21, response_slots=19)
    few = reference_decode_attention(**c, rlen=torch.tensor([5]), prompt_slots=21, response_slots=5)
    assert torch.allclose(full, few, atol=1e-6)


def test_reference_zeroes_finished_rows():
    c = random_case(8)
    live = torch.tensor([1, 0] * (c["q"].shape[0] // 2) + [1] * (c["q"].shape[0] % 2))
    args = dict(c, rlen=torch.tensor([4]), prompt_slots=21, response_slots=19)
    full, flagged = reference_decode_attention(**args), reference_decode_attention(**args, live=live)
    assert torch.equal(flagged[live == 0], torch.zeros_like(flagged[live == 0]))
    assert torch.equal(flagged[live == 1], full[live == 1])


def test_reference_reads_responses_through_cache_rows():
    """``cache_rows`` names the cache row of each batch row: the responses scattered over a larger cache
    in a shuffled order give what the rows in order give."""
    c = random_case(8)
    rows = c["q"].shape[0]
    where = torch.randperm(rows + 3, generator=torch.Generator().manual_seed(1))[:rows]
    rk = torch.full((rows + 3,) + c["rk"].shape[1:], 1e4)  # rows no batch row names: never read
    rv = torch.full_like(rk, 1e4)
    rk[where], rv[where] = c["rk"], c["rv"]
    kw = dict(rlen=torch.tensor([7]), prompt_slots=c["pk"].shape[2], response_slots=c["rk"].shape[2])
    ref = reference_decode_attention(**c, **kw)
    out = reference_decode_attention(**dict(c, rk=rk, rv=rv), **kw, cache_rows=where)
    assert torch.allclose(out, ref, atol=1e-6)


def test_default_splits_by_hand():
    """Powers of two bringing rows x heads x splits to at most 1,024 programs, at most 16 splits."""
    assert default_splits(256, 16) == 1  # 4,096 programs already
    assert default_splits(64, 16) == 1  # 1,024
    assert default_splits(32, 16) == 2  # 512 -> 1,024
    assert default_splits(16, 16) == 4
    assert default_splits(8, 16) == 8
    assert default_splits(1, 16) == 16  # capped (64 would reach 1,024)
    assert default_splits(3, 16, programs=100) == 2  # 48 -> 96


def test_prompt_runs_by_hand():
    """Rows 0-2 share prompt 0, rows 3-7 prompt 1, row 8 prompt 2; row 1 and row 3 are finished, as is
    row 8. A run starts and ends at live rows (row 1 inside run 0 stays, masked by the kernel; row 3
    at the start of prompt 1's rows is left out), never mixes prompts, and is cut at ``most`` rows."""
    groups = [0, 0, 0, 1, 1, 1, 1, 1, 2]
    live = [True, False, True, False, True, True, True, True, False]
    assert prompt_runs(groups, live, 16) == ([0, 4], [3, 4])
    assert prompt_runs(groups, live, 2) == ([0, 2, 4, 6], [1, 1, 2, 2])
    assert prompt_runs(groups, [True] * 9, 4) == ([0, 3, 7, 8], [3, 4, 1, 1])
    assert prompt_runs([], [], 16) == ([], [])


def test_triton_kernel_and_engine_under_the_interpreter():
    """Runs tests/interpreted (the Triton kernel against the reference, and the engine with
    ``attention="triton"`` against the SDPA path) in a child pytest with ``TRITON_INTERPRET=1``."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "interpreted")],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        # The interpreter runs every kernel launch in Python, so this child is slow on a small CI machine:
        # the limit is there to catch a hang, not to time the run.
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
