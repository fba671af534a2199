"""Cascade attention (a group's shared prompt reduced once per step for all of its rows): one layer's
attention per batch size inside CUDA graphs, with and without it, and the engine end to end on the
realistic, forced and trainer-shaped batches per ``cascade_min_rows``."""

import random
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_speed import Bench, parse_args

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.fast.kernels.decode_attention import (
    default_splits,
    prompt_runs,
    reference_decode_attention,
    triton_decode_attention,
)
from rlvr.task.prompts import render

args = parse_args(["--data-dir", ".gpu/gsm8k", "--skip-baselines", "--no-trl"])
bench = Bench(args)
bench.setup()
bench.ceilings()
rng = random.Random(args.seed + 1)
exs = rng.sample(bench.examples, 32)
prompts = [render("r1_zero", ex.question) for ex in exs]
lens = [[rng.randint(50, 512) for _ in range(8)] for _ in prompts]
params = SamplingParams(
    n=8, temperature=1.0, top_p=1.0, max_new_tokens=512, stop=("</answer>",), seed=2, ignore_eos=True
)
tparams = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=512, seed=3, ignore_eos=True)
fprompts = bench.fixed_length_prompts()
fparams = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=512, seed=0, ignore_eos=True)

# ---------------------------------------------------------------- A. one layer, inside CUDA graphs
fast = FastHFEngine(bench.model, bench.tok, max_batch_size=256, cascade_min_rows=None)
fast.generate(prompts, params, row_max_new_tokens=lens)
st = fast._state
H, D = 16, 128
p_ids = [bench.tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
L = int(st.plen)
starts = torch.tensor([L - len(x) for x in p_ids], device="cuda")
_IM = torch.inference_mode()
_IM.__enter__()


def graph_time(f):
    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            f()
    g.replay()
    torch.cuda.synchronize()
    _, tt = bench.timed(lambda: [g.replay() for _ in range(5)])
    return 1e6 * tt / 100


VARIANTS = [(16, 4), (32, 4), (64, 4), (32, 8)]
print(
    f"\nattention per layer in a graph of 20 calls (us), prompt slots {L}: rows | groups | rlen | per row | "
    + " | ".join(f"cascade b{b}w{w}" for b, w in VARIANTS),
    flush=True,
)
gen = random.Random(5)
for b in (256, 192, 128, 96, 64, 48, 32, 16):
    rows = sorted(gen.sample(range(256), b))
    grp = torch.tensor([r // 8 for r in rows], device="cuda")
    first, count = prompt_runs(grp.tolist(), [True] * b, 16)
    runs = (
        torch.tensor(first, dtype=torch.int32, device="cuda"),
        torch.tensor(count, dtype=torch.int32, device="cuda"),
    )
    start = starts[grp]
    live = torch.ones(b, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kn, vn = torch.randn_like(q), torch.randn_like(q)
    sp = default_splits(b, H)
    for s_ in (100, 300, 500):
        rlen = torch.tensor([s_], device="cuda")
        cells = [
            graph_time(
                lambda: triton_decode_attention(
                    q,
                    st.pk[0],
                    st.pv[0],
                    st.rk[0],
                    st.rv[0],
                    grp,
                    start,
                    st.plen,
                    rlen,
                    k_new=kn,
                    v_new=vn,
                    live=live,
                    splits=sp,
                )
            )
        ]
        for blk, w in VARIANTS:
            cells.append(
                graph_time(
                    lambda: triton_decode_attention(
                        q,
                        st.pk[0],
                        st.pv[0],
                        st.rk[0],
                        st.rv[0],
                        grp,
                        start,
                        st.plen,
                        rlen,
                        k_new=kn,
                        v_new=vn,
                        live=live,
                        splits=sp,
                        runs=runs,
                        run_block=blk,
                        run_warps=w,
                    )
                )
            )
        print(f"{b} | {len(first)} | {s_} | " + " | ".join(f"{c:.1f}" for c in cells), flush=True)
    # correctness, bf16, a third of the rows flagged finished
    lv = (torch.arange(b, device="cuda") % 3 != 1).int()
    first, count = prompt_runs(grp.tolist(), (lv != 0).tolist(), 16)
    runs = (
        torch.tensor(first, dtype=torch.int32, device="cuda"),
        torch.tensor(count, dtype=torch.int32, device="cuda"),
    )
    rlen = torch.tensor([300], device="cuda")
    rk, rv = st.rk[0].clone(), st.rv[0].clone()
    rk[:b].index_copy_(2, rlen - 1, kn)
    rv[:b].index_copy_(2, rlen - 1, vn)
    ref = reference_decode_attention(
        q, st.pk[0], st.pv[0], rk, rv, grp, start, st.plen, rlen, st.prompt_slots_cap, 512, live=lv
    ).float()
    rk2, rv2 = st.rk[0].clone(), st.rv[0].clone()
    plain = triton_decode_attention(
        q, st.pk[0], st.pv[0], rk2, rv2, grp, start, st.plen, rlen, k_new=kn, v_new=vn, live=lv, splits=sp
    ).float()
    rk2, rv2 = st.rk[0].clone(), st.rv[0].clone()
    casc = triton_decode_attention(
        q, st.pk[0], st.pv[0], rk2, rv2, grp, start, st.plen, rlen, k_new=kn, v_new=vn, live=lv, splits=sp, runs=runs
    ).float()
    print(
        f"   check {b} rows: per-row kernel {(plain - ref).abs().max().item():.4g}, cascade {(casc - ref).abs().max().item():.4g}"
        f" vs reference; cache equal {torch.equal(rk2[:b], rk[:b]) and torch.equal(rv2[:b], rv[:b])}",
        flush=True,
    )
_IM.__exit__(None, None, None)
fast.close()
del fast, st
bench.free()

# ---------------------------------------------------------------- B. end to end
res = {}
for mr in (None, 256, 128, 64, 32):
    fast = FastHFEngine(bench.model, bench.tok, max_batch_size=256, cascade_min_rows=mr)
    fast.generate(prompts, params, row_max_new_tokens=lens)
    ts = [bench.timed(lambda: fast.generate(prompts, params, row_max_new_tokens=lens))[1] for _ in range(3)]
    c0 = fast.stats["cascade_steps"]
    fast.generate(prompts, tparams)
    tt = [bench.timed(lambda: fast.generate(prompts, tparams))[1] for _ in range(2)]
    fs = [float("nan")]
    if mr in (None, 64):
        fast.generate(fprompts, fparams)
        fs = [bench.timed(lambda: fast.generate(fprompts, fparams))[1] for _ in range(2)]
    res[mr] = (min(ts), min(tt), min(fs))
    print(
        f"[cascade_min_rows={mr}] realistic {', '.join(f'{t:.3f}' for t in ts)}; 32x8x512 {', '.join(f'{t:.3f}' for t in tt)}; "
        f"forced {', '.join(f'{t:.3f}' for t in fs)}; cascade steps {fast.stats['cascade_steps']}",
        flush=True,
    )
    fast.close()
    del fast
    bench.free()
print("\ncascade_min_rows | realistic s | 32x8x512 s | forced 256x512 s | realistic / forced (goal <= 0.561)")
f0 = res[None][2]
for k, (r, t, f) in res.items():
    print(f"{k} | {r:.3f} | {t:.3f} | {f:.3f} | {r / f0:.3f}")
