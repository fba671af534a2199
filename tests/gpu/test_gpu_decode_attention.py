"""The compiled Triton decode attention on a GPU against the SDPA reference (computed in float32 from
the same bf16 inputs), over the head_dims the supported model families use and batch sizes from 1 to
256: the new token written by the kernel, finished rows, split slots, cascade runs over shared
prompts, and responses read through a cache-row index."""

from __future__ import annotations

import pytest
import torch

from rlvr.engines.fast.kernels.decode_attention import (
    default_splits,
    prompt_runs,
    reference_decode_attention,
    triton_available,
    triton_decode_attention,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton"),
]


def case(
    head_dim: int,
    rows: int,
    seed: int,
    heads: int = 4,
    group: int = 8,
    prompt_slots: int = 150,
    response_slots: int = 260,
    kv_heads: int | None = None,
):
    kv = kv_heads or heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    groups = max(1, -(-rows // group))
    pk, pv = r(groups, kv, prompt_slots, head_dim), r(groups, kv, prompt_slots, head_dim)
    spare = rows + 5  # the cache holds more rows than the batch; batch row i reads cache row where[i]
    rk, rv = r(spare, kv, response_slots, head_dim), r(spare, kv, response_slots, head_dim)
    where = torch.randperm(spare, generator=g, device="cuda")[:rows]
    grp = torch.arange(rows, device="cuda") // group
    plen = torch.tensor([prompt_slots - 7], device="cuda")
    starts = torch.randint(0, int(plen) - 1, (groups,), generator=g, device="cuda")
    q = r(rows, 1, heads, head_dim).transpose(1, 2)
    live = (torch.rand(rows, generator=g, device="cuda") > 0.2).to(torch.int32)
    live[0] = 1
    return dict(q=q, pk=pk, pv=pv, rk=rk, rv=rv, grp=grp, start=starts[grp], plen=plen), live, where


@pytest.mark.parametrize("head_dim", [48, 64, 80, 96, 128])
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_kernel_equals_reference(head_dim, rows):
    check_kernel(head_dim, rows, heads=4, kv_heads=4)


@pytest.mark.parametrize(
    "head_dim,heads,kv_heads",
    [(64, 32, 8), (128, 12, 2), (128, 16, 8), (80, 8, 2)],
    ids=["llama-3.2-1b", "qwen2.5-1.5b", "qwen3-1.7b", "odd-head-dim"],
)
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_grouped_query_kernel_equals_reference(head_dim, heads, kv_heads, rows):
    """Grouped-query attention at the supported families' head layouts: one program per (row, key/value
    head) for all of its query heads."""
    check_kernel(head_dim, rows, heads=heads, kv_heads=kv_heads)


def check_kernel(head_dim: int, rows: int, heads: int, kv_heads: int) -> None:
    group = heads // kv_heads
    for seed, rlen in enumerate((1, 37, 200)):
        c, live, where = case(head_dim, rows, seed, heads=heads, kv_heads=kv_heads)
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        kv_shape = (rows, kv_heads, 1, head_dim)
        k_new = torch.randn(kv_shape, generator=g, device="cuda").to(torch.bfloat16)
        v_new = torch.randn(kv_shape, generator=g, device="cuda").to(torch.bfloat16)
        slot = rlen - 1
        rk, rv = c["rk"].clone(), c["rv"].clone()
        rk[where, :, slot], rv[where, :, slot] = k_new[:, :, 0], v_new[:, :, 0]
        up = {k: (v.float() if v.is_floating_point() else v) for k, v in c.items()}
        up.update(rk=rk.float(), rv=rv.float())
        ref = reference_decode_attention(
            **up,
            rlen=torch.tensor([rlen], device="cuda"),
            live=live,
            cache_rows=where,
            prompt_slots=c["pk"].shape[2],
            response_slots=c["rk"].shape[2],
        )
        runs = None
        if rows >= 16:
            first, count = prompt_runs(c["grp"].tolist(), [bool(x) for x in live.tolist()], max(1, 16 // group))
            runs = (
                torch.tensor(first, dtype=torch.int32, device="cuda"),
                torch.tensor(count, dtype=torch.int32, device="cuda"),
            )
        for splits in sorted({1, default_splits(rows, kv_heads)}):
            for use_runs in {None, runs} if runs is not None else {None}:
                kase = dict(c, rk=c["rk"].clone(), rv=c["rv"].clone())
                out = triton_decode_attention(
                    **kase,
                    rlen=torch.tensor([rlen], device="cuda"),
                    k_new=k_new,
                    v_new=v_new,
                    live=live,
                    splits=splits,
                    runs=use_runs,
                    cache_rows=where,
                )
                torch.cuda.synchronize()
                assert torch.isfinite(out).all()
                err = (out.float() - ref).norm() / ref.norm()
                assert err < 1e-2, (head_dim, rows, rlen, splits, use_runs is not None, float(err))
                assert torch.equal(out[live == 0], torch.zeros_like(out[live == 0]))
                assert torch.equal(kase["rk"], rk) and torch.equal(kase["rv"], rv)
