"""The decode step's matmuls alone, at each family's exact shapes, against their floors and per BLAS library.

A decode step of the fast engine does five kinds of matmul: the stacked q/k/v projection (with Qwen2's
bias), the output projection, the stacked gate/up projection, the down projection (once per layer) and
the vocabulary head (once). This probe times each as ``F.linear`` of a ``rows x in`` bf16 activation by
the engine's ``out x in`` weight, through a CUDA graph (so the host's launch cost is not in the time)
that cycles through enough copies of the weight that none is still in the L2 cache, as in a real step,
and sums them into one step's matmul time for 256, 32 and 1 rows. Each is run with PyTorch's cuBLAS
path and with its cuBLASLt path (``torch.backends.cuda.preferred_blas_library``), and set against the
step's FLOP floor (at the measured bf16 matmul rate) and its weight-byte floor (at the measured copy
rate). ``decode_breakdown.py`` has the same step's matmul kernels as the profiler saw them inside the
engine.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/probes/decode_gemms.py [--tiny]``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_speed import FAMILY_MODELS, TINY_FAMILY_SHAPE, measure_ceilings

from rlvr.modeling import OLMO2_1B

LIBRARIES = ("cublas", "cublaslt")


def step_matmuls(shape: dict) -> list[tuple[str, int, int, int, bool]]:
    """(name, out features, in features, calls per step, bias) of one decode step's matmuls."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    kv_heads = shape.get("num_key_value_heads") or heads
    bias = bool(shape.get("attention_bias", False)) or shape.get("model_type") == "qwen2"
    q, kv = heads * head_dim, kv_heads * head_dim
    return [
        ("qkv", q + 2 * kv, hidden, layers, bias),
        ("o", hidden, q, layers, False),
        ("gate_up", 2 * shape["intermediate_size"], hidden, layers, False),
        ("down", hidden, shape["intermediate_size"], layers, False),
        ("head", shape["vocab_size"], hidden, 1, False),
    ]


def linear_us(rows: int, out_f: int, in_f: int, bias: bool, device: torch.device, reps: int = 5) -> float:
    """Microseconds per ``F.linear`` at this shape, weights cold in L2 (see the module docstring)."""
    copies = max(2, -(-(256 << 20) // (out_f * in_f * 2))) if device.type == "cuda" else 2
    weights = [torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    b = torch.randn(out_f, device=device, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, in_f, device=device, dtype=torch.bfloat16)
    if device.type != "cuda":
        for w in weights:
            F.linear(x, w, b)
        return 0.0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # warm-up: cuBLAS picks and caches its kernel outside the capture
            F.linear(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            F.linear(x, w, b)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * copies)


def timed(fn):
    """``(fn(), seconds)`` with the GPU synchronised around the call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", default="256,32,1")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bw, mm = measure_ceilings(timed) if device.type == "cuda" else (50e9, 1e12)
    models = {"olmo2-1b": dict(OLMO2_1B, model_type="olmo2")}
    models.update({name: dict(shape, model_type=kind) for name, (kind, shape) in FAMILY_MODELS.items()})
    if args.tiny:
        models = {name: dict(shape, **TINY_FAMILY_SHAPE, vocab_size=512) for name, shape in models.items()}
    rows_list = [int(r) for r in args.rows.split(",")]
    before = torch.backends.cuda.preferred_blas_library()
    lines = []
    try:
        for name, shape in models.items():
            mats = step_matmuls(shape)
            flops_per_row = sum(2 * o * i * n for _, o, i, n, _ in mats)
            weight_bytes = sum(2 * o * i * n for _, o, i, n, _ in mats)
            for rows in rows_list:
                per_lib = {}
                for lib in LIBRARIES:
                    if device.type == "cuda":
                        torch.backends.cuda.preferred_blas_library(lib)
                    per_lib[lib] = {m[0]: linear_us(rows, m[1], m[2], m[4], device) for m in mats}
                floor_flops = 1e3 * flops_per_row * rows / mm
                floor_bytes = 1e3 * weight_bytes / bw
                total = {lib: sum(per_lib[lib][m[0]] * m[3] for m in mats) / 1e3 for lib in LIBRARIES}
                parts = " | ".join(
                    f"{m[0]} {per_lib['cublas'][m[0]]:.1f} / {per_lib['cublaslt'][m[0]]:.1f}" for m in mats
                )
                lines.append(
                    f"| {name} | {rows} | {total['cublas']:.3f} | {total['cublaslt']:.3f} | {floor_flops:.3f} | "
                    f"{floor_bytes:.3f} | {parts} |"
                )
                print(lines[-1], flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    print(f"\n## ceilings: copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    print("\n## one decode step's matmuls (ms): cuBLAS, cuBLASLt, FLOP floor, weight-byte floor; per matmul us")
    print("| model | rows | cuBLAS | cuBLASLt | FLOP floor | weight bytes | per call: cuBLAS / cuBLASLt (us) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
