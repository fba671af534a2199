"""Decode-shaped matmuls: cuBLAS against a plain Triton GEMM with small tiles and split-K.

``decode_gemms.py`` found cuBLAS and cuBLASLt at 1.44-1.76x their floors at a decode step's shapes: at
256 rows the narrow output and down projections give few output tiles for the GPU's multiprocessors,
and at a few rows the per-layer matmuls read their weights at well under the copy rate. This probe
times, at each family's exact shapes and several row counts, ``F.linear`` (cuBLAS) against a Triton
kernel swept over tile sizes and split-K factors (split-K adds its partial sums in float32 with
atomics into a zeroed buffer, then casts; both extra kernels are inside the time), each in a CUDA
graph cycling through weight copies that do not fit in L2, and checks every kernel's output against
``F.linear``'s. It prints, per matmul and row count, cuBLAS's time, the best Triton time and its
configuration, and one step's matmul total for each.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/probes/triton_gemms.py`` (``TRITON_INTERPRET=1
... --tiny`` runs it on a CPU at a small size, to check it runs).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_speed import FAMILY_MODELS, TINY_FAMILY_SHAPE
from decode_gemms import step_matmuls

from rlvr.modeling import OLMO2_1B


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    iters,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * iters
    for i in range(first, first + iters):
        kk = i * BLOCK_K + rk
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
        )
        b = tl.load(
            w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0
        )
        acc = tl.dot(a, tl.trans(b), acc)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.atomic_add(out_ptr + offs, acc, mask=mask, sem="relaxed")


def triton_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: tuple) -> torch.Tensor:
    bm, bn, bk, split, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    out = (
        torch.empty(m, n, device=x.device, dtype=x.dtype)
        if split == 1
        else torch.zeros(m, n, device=x.device, dtype=torch.float32)
    )
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _linear_kernel[grid](
        x,
        w,
        b if b is not None else w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        triton.cdiv(triton.cdiv(k, bk), split),
        HAS_BIAS=b is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        num_warps=warps,
        num_stages=stages,
    )
    return out if split == 1 else out.to(x.dtype)


def configs(rows: int, tiny: bool) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) worth trying at this many rows."""
    if tiny:
        return [(16, 32, 32, 1, 4, 2), (16, 32, 32, 2, 4, 2)]
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    out = []
    if bm <= 32:  # a few rows: many programs streaming the weight, split along K when N is narrow
        for bn, bk, split, stages in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (4, 6)):
            out.append((bm, bn, bk, split, 4, stages))
        return out
    for bm_, bn, bk, split, stages in itertools.product((64, bm), (64, 128, 256), (64, 128), (1, 2, 4), (3, 4)):
        if bm_ * bn > 128 * 128 or (bm_ == bm and bm == 64 and bm_ != 64):
            continue
        out.append((bm_, bn, bk, split, 8 if bm_ * bn >= 128 * 128 else 4, stages))
    return sorted(set(out))


def graph_us(fn, copies: int, reps: int = 5) -> float:
    """Microseconds per call of ``fn(i)`` over ``copies`` weight copies, captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", default="256,128,64,16,1")
    ap.add_argument("--models", default="")
    ap.add_argument("--deadline-s", type=float, default=480.0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    if os.environ.get("TRITON_INTERPRET") == "1":  # numpy 2's int() of a rank-1 scalar (see tests/interpreted)
        from triton.runtime import interpreter

        original = interpreter._patch_lang_tensor

        def patch(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = {"olmo2-1b": dict(OLMO2_1B, model_type="olmo2")}
    models.update({name: dict(shape, model_type=kind) for name, (kind, shape) in FAMILY_MODELS.items()})
    if args.models:
        models = {k: v for k, v in models.items() if k in args.models.split(",")}
    if args.tiny:
        models = {name: dict(shape, **TINY_FAMILY_SHAPE, vocab_size=512) for name, shape in models.items()}
    dtype = torch.float32 if args.tiny else torch.bfloat16  # the interpreter has no bfloat16 dot
    rows_list = [int(r) for r in args.rows.split(",")]
    summary, detail = [], []
    for name, shape in models.items():
        for rows in rows_list:
            if time.perf_counter() - t_start > args.deadline_s:
                print(f"deadline: skipping {name} at {rows} rows", flush=True)
                continue
            step_cublas = step_triton = 0.0
            for mat, out_f, in_f, calls, bias in step_matmuls(shape):
                copies = max(2, -(-(256 << 20) // (out_f * in_f * 2))) if device.type == "cuda" else 1
                ws = [torch.randn(out_f, in_f, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
                b = torch.randn(out_f, device=device, dtype=dtype) if bias else None
                x = torch.randn(rows, in_f, device=device, dtype=dtype)
                ref = F.linear(x, ws[0], b).float()
                scale = ref.abs().max().item() + 1e-6
                best = (float("inf"), None)
                for cfg in configs(rows, args.tiny):
                    try:
                        err = (triton_linear(x, ws[0], b, cfg).float() - ref).abs().max().item() / scale
                    except triton.runtime.errors.OutOfResources:
                        continue
                    if err > 2e-2:
                        print(f"{name} {mat} {rows} {cfg}: relative error {err:.3g}", flush=True)
                        continue
                    if device.type == "cuda":
                        us = graph_us(lambda i, cfg=cfg: triton_linear(x, ws[i], b, cfg), copies)
                        best = min(best, (us, cfg), key=lambda t: t[0])
                    else:
                        best = (0.0, cfg)
                cublas = graph_us(lambda i: F.linear(x, ws[i], b), copies) if device.type == "cuda" else 0.0
                step_cublas += cublas * calls
                step_triton += min(cublas, best[0]) * calls
                detail.append(
                    f"| {name} | {rows} | {mat} ({out_f} x {in_f}) | {cublas:.1f} | {best[0]:.1f} | {best[1]} |"
                )
                print(detail[-1], flush=True)
                del ws
            summary.append(f"| {name} | {rows} | {step_cublas / 1e3:.3f} | {step_triton / 1e3:.3f} |")
            print(summary[-1], flush=True)
    print("\n## per matmul, us: cuBLAS, best Triton (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)")
    print("| model | rows | matmul | cuBLAS | Triton | config |")
    print("|---|---:|---|---:|---:|---|")
    print("\n".join(detail))
    print("\n## one step's matmuls, ms: cuBLAS, the faster of the two per matmul")
    print("| model | rows | cuBLAS | best of both |")
    print("|---|---:|---:|---:|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
