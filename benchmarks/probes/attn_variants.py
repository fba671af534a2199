"""Experimental decode-attention variants, timed against the engine's kernel and cuDNN (not committed)."""
import time
import torch
import triton
import triton.language as tl
from rlvr.engines.decode_attention import triton_decode_attention, reference_decode_attention


@triton.jit
def _acc_staged(kbase, vbase, lo, hi, first, stride_s, q, d, m, l, acc, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    for s in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = s + tl.arange(0, BLOCK)
        ok = (offs >= first) & (offs < hi)
        k = tl.load(kbase + offs[:, None] * stride_s + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        x = tl.where(ok, tl.sum(k * q[None, :], axis=1), -float("inf"))
        m_new = tl.maximum(m, x)
        alpha = tl.exp(m - m_new)
        p = tl.exp(x - m_new)
        v = tl.load(vbase + offs[:, None] * stride_s + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + p[:, None] * v
        l = l * alpha + p
        m = m_new
    return m, l, acc


@triton.jit
def _split_kernel(Q, PK, PV, RK, RV, GRP, START, PLEN, RLEN, PART,
                  sq_b, sq_h, sp_g, sp_h, sp_s, sr_b, sr_h, sr_s, scale, H,
                  D: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, SPLITS: tl.constexpr):
    """Program (row, head, z): z = 0 the prompt, z >= 1 a 1/(SPLITS-1) share of the response."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2)
    d = tl.arange(0, D)
    q = tl.load(Q + row * sq_b + head * sq_h + d).to(tl.float32) * scale
    m = tl.full([BLOCK], -1e30, tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    if z == 0:
        grp = tl.load(GRP + row).to(tl.int64)
        first = tl.load(START + row).to(tl.int32)
        plen = tl.load(PLEN).to(tl.int32)
        poff = grp * sp_g + head * sp_h
        m, l, acc = _acc_staged(PK + poff, PV + poff, (first // BLOCK) * BLOCK, plen, first, sp_s, q, d, m, l, acc, BLOCK, STAGES)
    else:
        rlen = tl.load(RLEN).to(tl.int32)
        per = tl.cdiv(tl.cdiv(rlen, SPLITS - 1), BLOCK) * BLOCK
        lo = (z - 1) * per
        hi = tl.minimum(lo + per, rlen)
        roff = row * sr_b + head * sr_h
        m, l, acc = _acc_staged(RK + roff, RV + roff, lo, hi, 0, sr_s, q, d, m, l, acc, BLOCK, STAGES)
    top = tl.max(m, axis=0)
    w = tl.exp(m - top)
    o = tl.sum(acc * w[:, None], axis=0)
    base = PART + ((row * H + head) * SPLITS + z) * (D + 2)
    tl.store(base + d, o)
    tl.store(base + D, top)
    tl.store(base + D + 1, tl.sum(l * w, axis=0))


@triton.jit
def _combine_kernel(PART, OUT, so_b, so_h, H, D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D)
    z = tl.arange(0, SPLITS)
    base = PART + (row * H + head) * SPLITS * (D + 2)
    ms = tl.load(base + z * (D + 2) + D)
    ls = tl.load(base + z * (D + 2) + D + 1)
    top = tl.max(ms, axis=0)
    w = tl.where(ls > 0, tl.exp(ms - top), 0.0)
    o = tl.load(base + z[:, None] * (D + 2) + d[None, :])
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(ls * w, axis=0)
    tl.store(OUT + row * so_b + head * so_h + d, out.to(OUT.dtype.element_ty))


def split_attention(q, pk, pv, rk, rv, grp, start, plen, rlen, block=32, warps=4, stages=1, splits=2):
    b, H, _, D = q.shape
    part = torch.empty((b, H, splits, D + 2), dtype=torch.float32, device=q.device)
    out = torch.empty((b, H, 1, D), dtype=q.dtype, device=q.device)
    _split_kernel[(b, H, splits)](q, pk, pv, rk, rv, grp, start, plen, rlen, part,
                                  q.stride(0), q.stride(1), pk.stride(0), pk.stride(1), pk.stride(2),
                                  rk.stride(0), rk.stride(1), rk.stride(2), D ** -0.5, H,
                                  D=D, BLOCK=block, STAGES=stages, SPLITS=splits, num_warps=warps)
    _combine_kernel[(b, H)](part, out, out.stride(0), out.stride(1), H, D=D, SPLITS=splits, num_warps=1)
    return out


def timed(fn, reps=50):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / reps


dev, dt = "cuda", torch.bfloat16
H, D, n, plen_ = 16, 128, 8, 160
for rows in (256, 32):
    for slots in (384, 672):
        mk = lambda *s: torch.randn(*s, device=dev, dtype=dt)
        q = mk(rows, 1, H, D).transpose(1, 2)
        G = max(1, rows // n)
        pk, pv = mk(G, H, plen_, D), mk(G, H, plen_, D)
        rk, rv = mk(rows, H, 512, D), mk(rows, H, 512, D)
        grp = torch.arange(rows, device=dev) // n
        start = torch.randint(0, 30, (G,), device=dev)[grp]
        lens = torch.tensor([plen_], device=dev), torch.tensor([slots - plen_], device=dev)
        ref = reference_decode_attention(q, pk, pv, rk, rv, grp, start, *lens, plen_, 512).float()
        cells = [f"engine {timed(lambda: triton_decode_attention(q, pk, pv, rk, rv, grp, start, *lens)):.0f}"]
        for splits in (2, 4):
            for stages in (1, 2, 3):
                for block, warps in ((32, 4), (16, 2)):
                    try:
                        f = lambda: split_attention(q, pk, pv, rk, rv, grp, start, *lens, block, warps, stages, splits)
                        err = (f().float() - ref).abs().max().item()
                        cells.append(f"s{splits} st{stages} b{block}w{warps} {timed(f):.0f} (err {err:.2g})")
                    except Exception as e:
                        cells.append(f"s{splits} st{stages} b{block}w{warps} failed {str(e)[:60]}")
        ku = torch.randn(rows, H, slots, D, device=dev, dtype=dt)
        mask = (torch.arange(slots, device=dev)[None, :] >= torch.randint(0, 30, (rows, 1), device=dev))[:, None, None, :]
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cells.append(f"cudnn per-row {timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, ku, ku, attn_mask=mask)):.0f}")
        print(f"{rows} rows x {slots} slots (prompt {plen_} shared by {n}), us/layer: " + "; ".join(cells), flush=True)
