"""One decode step's attention over a shared prompt cache and a per-row response cache.

``FastHFEngine`` keeps a group's prompt K/V once, however many samples the group has, and each row's
response K/V on its own:

* ``pk``, ``pv``: (groups, heads, prompt_slots, head_dim); group g's prompt fills slots
  ``[start, plen)`` (left-padded to the chunk's longest prompt, ``plen``);
* ``rk``, ``rv``: (rows, heads, response_slots, head_dim); every row of a chunk starts generating at
  the same step, so response slot j holds every row's j-th new token and slots ``[0, rlen)`` are
  filled. Batch row r's response sits in cache row ``cache_rows[r]`` (default r): when finished rows
  retire, the live ones move to the front of the batch and only this index changes, never the cache.

Row r attends to its group's prompt slots ``[start[r], plen)`` and its response slots ``[0, rlen)``.
Sharing the prompt cuts the cache by (n - 1) x prompt length per group. The samples of a group,
decoded side by side, can also share the reads: with ``runs`` (cascade attention) one program per
run of rows with one prompt loads each prompt block once for all of them, then every row reads only
its own response and merges the two partial softmaxes; without, each row reads its prompt itself
(mostly from the GPU's L2 cache).

With grouped-query attention the caches hold the key/value heads only, and query head h reads key/value
head h // (heads / kv_heads); the Triton path then runs one program per (row, key/value head) that
takes all of that head's query heads together (q.k and p.v as small matrix products), so each block
of the cache is read once per step for all of them.

Two implementations compute the same thing:

* ``reference_decode_attention``: gathers each row's prompt K/V, concatenates them with its response
  K/V and calls ``scaled_dot_product_attention`` under a mask. Any device; the CPU tests' ground truth.
* ``triton_decode_attention``: one Triton program per (row, head) streams the prompt blocks and then
  the response blocks with an online softmax in float32, kept per lane of the block so that the loop
  has no reduction across the block (merged once at the end). The lengths are read on the device, so
  a CUDA graph captured once serves every step. It also takes over the step's other attention work:
  it writes the current token's K/V into the response cache (no separate copy kernels), skips rows
  the engine marks finished, and for few rows splits each row's slots across several programs
  (flash-decoding style), since a lone program per (row, head) is a long chain of dependent loads.

Both take the lengths as device tensors (``plen``, ``rlen``: shape (1,)), so neither syncs the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of PyTorch; the engine falls back to the reference without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def reference_decode_attention(
    q: torch.Tensor,
    pk: torch.Tensor,
    pv: torch.Tensor,
    rk: torch.Tensor,
    rv: torch.Tensor,
    grp: torch.Tensor,
    start: torch.Tensor,
    plen: torch.Tensor,
    rlen: torch.Tensor,
    prompt_slots: int,
    response_slots: int,
    live: torch.Tensor | None = None,
    cache_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per row, q (b, heads, 1, head_dim), over the row's prompt and response slots.
    With grouped-query attention the caches hold fewer (key/value) heads: query head h reads key/value
    head h // (heads / kv_heads).

    ``prompt_slots`` / ``response_slots`` are how many leading slots of each cache to read (at least
    ``plen`` / ``rlen``; masked beyond them). ``live`` (optional, (b,)): rows where it is 0 are finished;
    their output is 0 (the engine skips their work). ``cache_rows`` (optional, (b,)): the row of
    ``rk``/``rv`` that holds batch row i's response is ``cache_rows[i]`` (default: i). Returns
    (b, heads, 1, head_dim) in q's dtype.
    """
    b, heads = q.shape[:2]
    kv_heads = pk.shape[1]
    if heads != kv_heads:  # grouped-query attention: each key/value head's query heads as its queries
        if heads % kv_heads or q.shape[2] != 1:
            raise ValueError(f"{heads} query heads over {kv_heads} key/value heads need one query per row")
        grouped = q.reshape(b, kv_heads, heads // kv_heads, q.shape[-1])
        out = reference_decode_attention(
            grouped, pk, pv, rk, rv, grp, start, plen, rlen, prompt_slots, response_slots, live, cache_rows
        )
        return out.reshape(q.shape)
    crow = cache_rows[:b] if cache_rows is not None else slice(0, b)
    keys = torch.cat([pk[grp[:b], :, :prompt_slots], rk[crow, :, :response_slots]], dim=2)
    values = torch.cat([pv[grp[:b], :, :prompt_slots], rv[crow, :, :response_slots]], dim=2)
    pcols = torch.arange(prompt_slots, device=q.device)
    rcols = torch.arange(response_slots, device=q.device)
    mask = torch.cat(
        [(pcols[None, :] >= start[:b, None]) & (pcols[None, :] < plen), (rcols < rlen).expand(b, -1)], dim=1
    )
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :])
    if live is not None:
        out = out * (live[:b] != 0).to(out.dtype)[:, None, None, None]
    return out


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _accumulate(  # type: ignore[no-untyped-def]  # Triton reads a kernel's annotations; only constexpr ones here
        kbase, vbase, lo, hi, stride_s, q, d, dok, m, l, acc, BLOCK: tl.constexpr, STAGES: tl.constexpr
    ):
        """Online softmax over slots [lo, hi) of one (row, head), kept per lane: lane j of the block sees
        slots j, j + BLOCK, ... (from ``lo`` rounded down to a block) and holds its own running max ``m``,
        sum ``l`` and weighted values ``acc`` (BLOCK, DP). Every step is elementwise but the q.k dot; the
        lanes are merged once, at the end. ``dok``: the head_dim lanes that exist (``d < D``). ``STAGES``:
        loads of the next blocks issued while this one is reduced."""
        for s in tl.range((lo // BLOCK) * BLOCK, hi, BLOCK, num_stages=STAGES):
            offs = s + tl.arange(0, BLOCK)
            ok = (offs >= lo) & (offs < hi)
            k = tl.load(kbase + offs[:, None] * stride_s + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0).to(
                tl.float32
            )
            x = tl.where(ok, tl.sum(k * q[None, :], axis=1), -float("inf"))
            m_new = tl.maximum(m, x)
            alpha = tl.exp(m - m_new)
            p = tl.exp(x - m_new)
            v = tl.load(vbase + offs[:, None] * stride_s + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0).to(
                tl.float32
            )
            acc = acc * alpha[:, None] + p[:, None] * v
            l = l * alpha + p
            m = m_new
        return m, l, acc

    @triton.jit
    def _row_span(  # type: ignore[no-untyped-def]  # Triton reads a kernel's annotations; only constexpr ones here
        GRP,
        START,
        PLEN,
        RLEN,
        LIVE,
        CROW,
        row,
        z,
        BLOCK: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_NEW: tl.constexpr,
        HAS_LIVE: tl.constexpr,
        CASCADE: tl.constexpr,
        HAS_CROW: tl.constexpr,
    ):
        """What both decode kernels know of a row before reading its cache: its prompt-cache entry, first
        prompt slot, whether it is live (a finished row reads nothing), its cache row, its response slots
        already in the cache (less the current token's when HAS_NEW), the prompt slots it reads (none
        under CASCADE: the group's program read them), and program z's run [lo, hi) of its slots."""
        grp = tl.load(GRP + row).to(tl.int64)
        first = tl.load(START + row).to(tl.int32)
        plen = tl.load(PLEN).to(tl.int32)
        rlen = tl.load(RLEN).to(tl.int32)
        live = rlen >= 0  # every row, unless LIVE says otherwise
        if HAS_LIVE:
            live = tl.load(LIVE + row) != 0
        crow = row
        if HAS_CROW:
            crow = tl.load(CROW + row).to(tl.int64)
        cached = rlen
        if HAS_NEW:
            cached = rlen - 1
        n_p = tl.where(live, plen - first, 0)
        if CASCADE:
            n_p = 0
        n = n_p + tl.where(live, cached, 0)
        per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK) * BLOCK
        lo = tl.minimum(z * per, n)
        hi = tl.minimum(lo + per, n)
        return grp, first, live, crow, cached, n_p, lo, hi

    @triton.jit
    def _decode_attention_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: annotations are Triton's
        Q,
        KN,
        VN,
        PK,
        PV,
        RK,
        RV,
        GRP,
        START,
        PLEN,
        RLEN,
        LIVE,
        CROW,
        OUT,
        PART,
        PPART,
        sq_b,
        sq_h,
        skn_b,
        skn_h,
        svn_b,
        svn_h,
        sp_g,
        sp_h,
        sp_s,
        sr_b,
        sr_h,
        sr_s,
        so_b,
        so_h,
        scale,
        D: tl.constexpr,
        DP: tl.constexpr,
        BLOCK: tl.constexpr,
        STAGES: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_NEW: tl.constexpr,
        HAS_LIVE: tl.constexpr,
        CASCADE: tl.constexpr,
        HAS_CROW: tl.constexpr,
    ):
        """Program (row, head, z). The row's slots, read in order (its prompt's slots [start, plen), then
        its response slots [0, rlen), less the last one when HAS_NEW), are cut into SPLITS equal runs and
        program z reduces run z. HAS_NEW: the current token's K/V (KN, VN) go to response slot rlen - 1
        (program 0 writes them) and enter the softmax from registers (the last program adds them), so no
        program reads a slot another one writes. One split writes the output; several write partial
        results (max, sum, weighted values) that ``_combine_kernel`` merges. CASCADE: the prompt slots
        were reduced by ``_prompt_attention_kernel`` into PPART; the row reads only its response slots
        and the last program merges PPART's partial in. HAS_CROW: the row's response K/V live in cache row
        CROW[row] (else in row ``row``), so retiring rows never moves a cache."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        z = tl.program_id(2)
        d = tl.arange(0, DP)
        dok = d < D  # DP: head_dim rounded up to a power of two (Triton's block shapes); lanes past D are masked
        q = tl.load(Q + row * sq_b + head * sq_h + d, mask=dok, other=0.0).to(tl.float32) * scale
        grp, first, live, crow, cached, n_p, lo, hi = _row_span(
            GRP, START, PLEN, RLEN, LIVE, CROW, row, z, BLOCK, SPLITS, HAS_NEW, HAS_LIVE, CASCADE, HAS_CROW
        )
        roff = crow * sr_b + head * sr_h
        if HAS_NEW:
            kn = tl.load(KN + row * skn_b + head * skn_h + d, mask=dok, other=0.0)
            vn = tl.load(VN + row * svn_b + head * svn_h + d, mask=dok, other=0.0)
            if z == 0:
                tl.store(RK + roff + cached * sr_s + d, kn, mask=dok)
                tl.store(RV + roff + cached * sr_s + d, vn, mask=dok)
        # A finite floor for the running max: a lane that has seen no slot yet rescales by exp(0) = 1
        # and contributes exp(-1e30 - max) = 0 at the merge.
        m = tl.full([BLOCK], -1e30, tl.float32)
        l = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, DP], tl.float32)
        poff = grp * sp_g + head * sp_h
        m, l, acc = _accumulate(
            PK + poff,
            PV + poff,
            first + tl.minimum(lo, n_p),
            first + tl.minimum(hi, n_p),
            sp_s,
            q,
            d,
            dok,
            m,
            l,
            acc,
            BLOCK,
            STAGES,
        )
        m, l, acc = _accumulate(
            RK + roff,
            RV + roff,
            tl.maximum(lo - n_p, 0),
            tl.maximum(hi - n_p, 0),
            sr_s,
            q,
            d,
            dok,
            m,
            l,
            acc,
            BLOCK,
            STAGES,
        )
        top = tl.max(m, axis=0)
        w = tl.exp(m - top)
        o = tl.sum(acc * w[:, None], axis=0)
        total = tl.sum(l * w, axis=0)
        if HAS_NEW:
            x = tl.sum(kn.to(tl.float32) * q, axis=0)
            x = tl.where(live & (z == SPLITS - 1), x, -float("inf"))
            new_top = tl.maximum(top, x)
            alpha = tl.exp(top - new_top)
            p = tl.exp(x - new_top)
            o = o * alpha + p * vn.to(tl.float32)
            total = total * alpha + p
            top = new_top
        if CASCADE:
            last = live & (z == SPLITS - 1)
            pbase = PPART + (row * tl.num_programs(1) + head) * (D + 2)
            po = tl.load(pbase + d, mask=last & dok, other=0.0)
            ptop = tl.load(pbase + D, mask=last, other=-1e30)
            ptotal = tl.load(pbase + D + 1, mask=last, other=0.0)
            new_top = tl.maximum(top, ptop)
            alpha, beta = tl.exp(top - new_top), tl.exp(ptop - new_top)
            o = o * alpha + po * beta
            total = total * alpha + ptotal * beta
            top = new_top
        if SPLITS == 1:
            out = o / tl.where(total > 0, total, 1.0)  # a finished row: 0
            tl.store(OUT + row * so_b + head * so_h + d, out.to(OUT.dtype.element_ty), mask=dok)
        else:
            base = PART + ((row * tl.num_programs(1) + head) * SPLITS + z) * (D + 2)
            tl.store(base + d, o, mask=dok)
            tl.store(base + D, top)
            tl.store(base + D + 1, total)

    @triton.jit
    def _grouped_accumulate(  # type: ignore[no-untyped-def]  # Triton reads a kernel's annotations; only constexpr ones here
        kbase,
        vbase,
        lo,
        hi,
        stride_s,
        q,
        d,
        dok,
        m,
        l,
        acc,
        scale,
        BLOCK: tl.constexpr,
        STAGES: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Online softmax over slots [lo, hi) of one key/value head for the query heads it serves (the rows
        of q, GP x DP): each block of keys and values is loaded once for all of them, and q.k and p.v are
        small matrix products."""
        for s in tl.range((lo // BLOCK) * BLOCK, hi, BLOCK, num_stages=STAGES):
            offs = s + tl.arange(0, BLOCK)
            ok = (offs >= lo) & (offs < hi)
            k = tl.load(kbase + offs[:, None] * stride_s + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0)
            if IEEE:
                x = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                x = tl.dot(q, tl.trans(k))
            x = tl.where(ok[None, :], x * scale, -float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(x - m_new[:, None])
            v = tl.load(vbase + offs[:, None] * stride_s + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        return m, l, acc

    @triton.jit
    def _grouped_decode_attention_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: annotations are Triton's
        Q,
        KN,
        VN,
        PK,
        PV,
        RK,
        RV,
        GRP,
        START,
        PLEN,
        RLEN,
        LIVE,
        CROW,
        OUT,
        PART,
        PPART,
        sq_b,
        sq_h,
        skn_b,
        skn_h,
        svn_b,
        svn_h,
        sp_g,
        sp_h,
        sp_s,
        sr_b,
        sr_h,
        sr_s,
        so_b,
        so_h,
        scale,
        D: tl.constexpr,
        DP: tl.constexpr,
        GROUP: tl.constexpr,
        GP: tl.constexpr,
        BLOCK: tl.constexpr,
        STAGES: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_NEW: tl.constexpr,
        HAS_LIVE: tl.constexpr,
        CASCADE: tl.constexpr,
        HAS_CROW: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """``_decode_attention_kernel`` for grouped-query attention: program (row, key/value head, z) reduces
        the GROUP query heads that share the key/value head together (GP: GROUP rounded up to the matrix
        units' 16 rows), so the row's cache is read once per key/value head, not once per query head.
        The slots, splits, new token, finished rows, cascade and cache rows work as there; partial
        results and outputs are per (row, query head)."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        z = tl.program_id(2)
        heads_q = tl.num_programs(1) * GROUP
        d = tl.arange(0, DP)
        dok = d < D
        g = tl.arange(0, GP)
        gok = g < GROUP
        qh = head * GROUP + g  # the query heads this key/value head serves
        q = tl.load(Q + row * sq_b + qh[:, None] * sq_h + d[None, :], mask=gok[:, None] & dok[None, :], other=0.0)
        grp, first, live, crow, cached, n_p, lo, hi = _row_span(
            GRP, START, PLEN, RLEN, LIVE, CROW, row, z, BLOCK, SPLITS, HAS_NEW, HAS_LIVE, CASCADE, HAS_CROW
        )
        roff = crow * sr_b + head * sr_h
        if HAS_NEW:
            kn = tl.load(KN + row * skn_b + head * skn_h + d, mask=dok, other=0.0)
            vn = tl.load(VN + row * svn_b + head * svn_h + d, mask=dok, other=0.0)
            if z == 0:
                tl.store(RK + roff + cached * sr_s + d, kn, mask=dok)
                tl.store(RV + roff + cached * sr_s + d, vn, mask=dok)
        top = tl.full([GP], -1e30, tl.float32)
        total = tl.zeros([GP], tl.float32)
        o = tl.zeros([GP, DP], tl.float32)
        poff = grp * sp_g + head * sp_h
        top, total, o = _grouped_accumulate(
            PK + poff,
            PV + poff,
            first + tl.minimum(lo, n_p),
            first + tl.minimum(hi, n_p),
            sp_s,
            q,
            d,
            dok,
            top,
            total,
            o,
            scale,
            BLOCK,
            STAGES,
            IEEE,
        )
        top, total, o = _grouped_accumulate(
            RK + roff,
            RV + roff,
            tl.maximum(lo - n_p, 0),
            tl.maximum(hi - n_p, 0),
            sr_s,
            q,
            d,
            dok,
            top,
            total,
            o,
            scale,
            BLOCK,
            STAGES,
            IEEE,
        )
        if HAS_NEW:
            x = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1) * scale
            x = tl.where(live & (z == SPLITS - 1), x, -float("inf"))
            new_top = tl.maximum(top, x)
            alpha = tl.exp(top - new_top)
            p = tl.exp(x - new_top)
            o = o * alpha[:, None] + p[:, None] * vn.to(tl.float32)[None, :]
            total = total * alpha + p
            top = new_top
        if CASCADE:
            last = live & (z == SPLITS - 1)
            pbase = PPART + (row * heads_q + qh) * (D + 2)
            po = tl.load(pbase[:, None] + d[None, :], mask=last & gok[:, None] & dok[None, :], other=0.0)
            ptop = tl.load(pbase + D, mask=last & gok, other=-1e30)
            ptotal = tl.load(pbase + D + 1, mask=last & gok, other=0.0)
            new_top = tl.maximum(top, ptop)
            alpha, beta = tl.exp(top - new_top), tl.exp(ptop - new_top)
            o = o * alpha[:, None] + po * beta[:, None]
            total = total * alpha + ptotal * beta
            top = new_top
        if SPLITS == 1:
            out = o / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(
                OUT + row * so_b + qh[:, None] * so_h + d[None, :],
                out.to(OUT.dtype.element_ty),
                mask=gok[:, None] & dok[None, :],
            )
        else:
            base = PART + ((row * heads_q + qh) * SPLITS + z) * (D + 2)
            tl.store(base[:, None] + d[None, :], o, mask=gok[:, None] & dok[None, :])
            tl.store(base + D, top, mask=gok)
            tl.store(base + D + 1, total, mask=gok)

    @triton.jit
    def _prompt_attention_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: annotations are Triton's
        Q,
        PK,
        PV,
        GRP,
        START,
        PLEN,
        LIVE,
        FIRST,
        COUNT,
        PPART,
        sq_b,
        sq_h,
        sp_g,
        sp_h,
        sp_s,
        scale,
        D: tl.constexpr,
        DP: tl.constexpr,
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        STAGES: tl.constexpr,
        HAS_LIVE: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Program (run, key/value head): the rows [FIRST[run], FIRST[run] + COUNT[run]) share one prompt;
        their queries (the GROUP query heads of each row that this key/value head serves; ROWS at most)
        go through its slots together, so each prompt block is loaded once for all of them, and q.k and
        p.v are small matrix products. Writes each live query's partial softmax (weighted values, max,
        sum) to PPART, per (row, query head), for the decode kernel to merge."""
        run = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        count = tl.load(COUNT + run)
        if count > 0:
            first = tl.load(FIRST + run).to(tl.int64)
            i = tl.arange(0, ROWS)
            rows = first + i // GROUP
            qh = head * GROUP + i % GROUP
            live = i < count * GROUP
            if HAS_LIVE:
                live = live & (tl.load(LIVE + rows, mask=live, other=0) != 0)
            d = tl.arange(0, DP)
            dok = d < D
            q = tl.load(
                Q + rows[:, None] * sq_b + qh[:, None] * sq_h + d[None, :], mask=live[:, None] & dok[None, :], other=0.0
            )
            grp = tl.load(GRP + first).to(tl.int64)
            lo = tl.load(START + first).to(tl.int32)
            plen = tl.load(PLEN).to(tl.int32)
            base = grp * sp_g + head * sp_h
            m = tl.full([ROWS], -1e30, tl.float32)
            l = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, DP], tl.float32)
            m, l, acc = _grouped_accumulate(
                PK + base, PV + base, lo, plen, sp_s, q, d, dok, m, l, acc, scale, BLOCK, STAGES, IEEE
            )
            out = PPART + (rows * (tl.num_programs(1) * GROUP) + qh) * (D + 2)
            tl.store(out[:, None] + d[None, :], acc, mask=live[:, None] & dok[None, :])
            tl.store(out + D, m, mask=live)
            tl.store(out + D + 1, l, mask=live)

    @triton.jit
    def _combine_kernel(  # type: ignore[no-untyped-def]  # Triton kernel: annotations are Triton's
        PART, OUT, so_b, so_h, D: tl.constexpr, DP: tl.constexpr, SPLITS: tl.constexpr
    ):
        """Merge the SPLITS partial softmaxes of one (row, head): rescale each to the common max."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, DP)
        dok = d < D
        z = tl.arange(0, SPLITS)
        base = PART + (row * tl.num_programs(1) + head) * SPLITS * (D + 2)
        tops = tl.load(base + z * (D + 2) + D)
        totals = tl.load(base + z * (D + 2) + D + 1)
        w = tl.exp(tops - tl.max(tops, axis=0))
        o = tl.sum(tl.load(base + z[:, None] * (D + 2) + d[None, :], mask=dok[None, :], other=0.0) * w[:, None], axis=0)
        total = tl.sum(totals * w, axis=0)
        out = o / tl.where(total > 0, total, 1.0)
        tl.store(OUT + row * so_b + head * so_h + d, out.to(OUT.dtype.element_ty), mask=dok)


def prompt_runs(groups: list[int], live: list[bool], most: int) -> tuple[list[int], list[int]]:
    """The ``runs`` of ``triton_decode_attention`` for batch rows whose prompts are ``groups`` (one entry
    per row) and live flags ``live``: maximal stretches of consecutive rows with one prompt, at most
    ``most`` rows long, starting and ending at live rows (finished rows inside a stretch are masked by
    the kernel). Returns (first rows, row counts)."""
    firsts: list[int] = []
    counts: list[int] = []
    for r, (g, ok) in enumerate(zip(groups, live)):
        if not ok:
            continue
        if firsts and groups[firsts[-1]] == g and r - firsts[-1] < most:
            counts[-1] = r - firsts[-1] + 1
        else:
            firsts.append(r)
            counts.append(1)
    return firsts, counts


def default_splits(rows: int, heads: int, programs: int = 1024, most: int = 16) -> int:
    """Splits per (row, head) for ``triton_decode_attention``: a power of two that brings the programs to
    about ``programs``. Few rows leave most of the GPU idle and each program a long chain of dependent
    block loads; splitting the slots shortens the chain (the value was chosen on an H200,
    docs/benchmarks.md)."""
    splits = 1
    while rows * heads * splits * 2 <= programs and splits < most:
        splits *= 2
    return splits


def triton_decode_attention(
    q: torch.Tensor,
    pk: torch.Tensor,
    pv: torch.Tensor,
    rk: torch.Tensor,
    rv: torch.Tensor,
    grp: torch.Tensor,
    start: torch.Tensor,
    plen: torch.Tensor,
    rlen: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
    splits: int = 1,
    block: int = 16,
    num_warps: int = 2,
    num_stages: int = 3,
    runs: tuple[torch.Tensor, torch.Tensor] | None = None,
    run_rows: int = 16,
    run_block: int = 32,
    run_warps: int = 4,
    cache_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference_decode_attention`` as one Triton kernel (CUDA, or the Triton interpreter on CPU).

    Grouped-query attention: q has ``heads`` query heads, the caches ``kv_heads`` (a divisor), and query
    head h reads key/value head h // (heads / kv_heads). Then one program per (row, key/value head)
    takes all of that head's query heads, so each cache block is read once for them (``run_block``
    slots per iteration, ``run_warps`` warps); with one query head per key/value head, one program per
    (row, head) keeps a softmax per lane of its blocks (``block``, ``num_warps``).

    ``k_new``, ``v_new`` (b, kv_heads, 1, head_dim), optional: the current token's K/V; the kernel writes
    them to response slot ``rlen - 1`` of ``rk``/``rv`` itself, which equals ``index_copy_`` there
    followed by the attention. ``live`` (b,), optional: rows where it is 0 read nothing and return 0.
    ``splits`` > 1 cuts each row's slots into that many runs reduced by separate programs and merged by
    a second kernel (for few rows; see ``default_splits``). The other defaults were the fastest of those
    timed on an H200 at the suggested config's shapes (docs/benchmarks_history.md, "decode attention").

    ``runs`` = (first, count), optional int tensors of one entry per run: batch rows
    [first, first + count) share a prompt (the same ``grp`` and ``start``) and have their prompt slots
    reduced together by one program per (run, head), which loads each prompt block once for the whole
    run instead of once per row (cascade attention: a group's samples share their prompt). Then every
    row whose ``live`` flag is set must lie in exactly one run; runs with count 0 do nothing; a run
    takes at most ``run_rows`` queries (rows x query heads per key/value head; a power of two, at least
    16 on a GPU). ``run_block`` slots are loaded per iteration by ``run_warps`` warps. ``cache_rows`` (b,), optional: batch row i's response K/V
    are row ``cache_rows[i]`` of ``rk``/``rv`` (read and written there; default: row i)."""
    if triton is None:
        raise RuntimeError("triton is not installed; use reference_decode_attention")
    b, heads, one, head_dim = q.shape
    if one != 1:
        raise ValueError(f"decode attention takes one query per row, got {one}")
    kv_heads = pk.shape[1]
    if rk.shape[1] != kv_heads or heads % kv_heads:
        raise ValueError(
            f"{heads} query heads need key/value caches of a divisor of that many heads, got "
            f"{kv_heads} (prompt) and {rk.shape[1]} (response)"
        )
    group = heads // kv_heads  # query heads per key/value head
    padded = triton.next_power_of_2(max(head_dim, 16))  # the kernels' lane count; lanes past head_dim are masked
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two >= 1, got {splits}")
    for t in (pk, pv, rk, rv):
        if t.stride(-1) != 1:
            raise ValueError("the K/V caches must be contiguous in head_dim")
    if pk.stride() != pv.stride() or rk.stride() != rv.stride():
        raise ValueError("K and V caches must share their layout")
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    if q.stride(-1) != 1:
        q = q.contiguous()
    has_new = k_new is not None and v_new is not None
    if k_new is not None and v_new is not None:
        kv_shape = (b, kv_heads, 1, head_dim)
        if tuple(k_new.shape) != kv_shape or tuple(v_new.shape) != kv_shape:
            raise ValueError(f"k_new and v_new must have the shape (rows, key/value heads, 1, head_dim) = {kv_shape}")
        kn = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
        vn = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
    else:
        kn, vn = q, q  # unread placeholders without HAS_NEW
    out = torch.empty((b, heads, 1, head_dim), dtype=q.dtype, device=q.device)
    part = out if splits == 1 else torch.empty((b, heads, splits, head_dim + 2), dtype=torch.float32, device=q.device)
    ppart = out
    if runs is not None:
        first, count = runs
        if first.shape != count.shape or first.dim() != 1:
            raise ValueError("runs must be two 1-d tensors (first row, row count) of equal length")
        if run_rows < 1 or run_rows & (run_rows - 1) or run_block < 1 or run_block & (run_block - 1):
            raise ValueError(f"run_rows and run_block must be powers of two, got {run_rows} and {run_block}")
        if run_rows < group:
            raise ValueError(f"run_rows ({run_rows}) must hold at least one row's {group} query heads")
        ppart = torch.empty((b, heads, head_dim + 2), dtype=torch.float32, device=q.device)
        _prompt_attention_kernel[(first.shape[0], kv_heads)](
            q,
            pk,
            pv,
            grp,
            start,
            plen,
            live if live is not None else grp,
            first,
            count,
            ppart,
            q.stride(0),
            q.stride(1),
            pk.stride(0),
            pk.stride(1),
            pk.stride(2),
            head_dim**-0.5,
            D=head_dim,
            DP=padded,
            GROUP=group,
            ROWS=run_rows,
            BLOCK=run_block,
            STAGES=num_stages,
            HAS_LIVE=live is not None,
            IEEE=q.dtype == torch.float32,
            num_warps=run_warps,
        )
    grouped = group > 1
    kernel = _grouped_decode_attention_kernel if grouped else _decode_attention_kernel
    # The grouped kernel multiplies matrices, as the cascade's prompt kernel does, and shares its tiling.
    tiling = (
        dict(GROUP=group, GP=max(16, triton.next_power_of_2(group)), IEEE=q.dtype == torch.float32, num_warps=run_warps)
        if grouped
        else dict(num_warps=num_warps)
    )
    kernel[(b, kv_heads, splits)](
        q,
        kn,
        vn,
        pk,
        pv,
        rk,
        rv,
        grp,
        start,
        plen,
        rlen,
        live if live is not None else grp,
        cache_rows if cache_rows is not None else grp,
        out,
        part,
        ppart,
        q.stride(0),
        q.stride(1),
        kn.stride(0),
        kn.stride(1),
        vn.stride(0),
        vn.stride(1),
        pk.stride(0),
        pk.stride(1),
        pk.stride(2),
        rk.stride(0),
        rk.stride(1),
        rk.stride(2),
        out.stride(0),
        out.stride(1),
        head_dim**-0.5,
        D=head_dim,
        DP=padded,
        BLOCK=run_block if grouped else block,
        STAGES=num_stages,
        SPLITS=splits,
        HAS_NEW=has_new,
        HAS_LIVE=live is not None,
        CASCADE=runs is not None,
        HAS_CROW=cache_rows is not None,
        **tiling,
    )
    if splits > 1:
        _combine_kernel[(b, heads)](
            part, out, out.stride(0), out.stride(1), D=head_dim, DP=padded, SPLITS=splits, num_warps=1
        )
    return out
