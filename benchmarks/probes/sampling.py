"""A decode step's sampling alone: ``sample_math`` compiled (as the SDPA path and top-p run it, over a
float32 noise tensor) against the one-pass Triton kernel (``triton_sample``, the Triton path's greedy and
temperature sampling, which makes its counter-based noise as it reads the logits), at the supported
families' vocabulary sizes and 256, 32 and 1 rows, each replayed inside a CUDA graph (no launch cost
from the host); beside them the two ways of writing the noise out (an eager ``exponential_`` from a
generator, as off Triton; ``exponential_noise``, as the SDPA path and top-p on a GPU), and reading the
bf16 logits once at the measured copy rate.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/probes/sampling.py [--tiny]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_speed import measure_ceilings
from decode_gemms import timed

from rlvr.engines.fast import step as S
from rlvr.engines.fast.kernels.decode_attention import triton_available
from rlvr.engines.fast.kernels.sampling import CounterNoise, exponential_noise, triton_sample

VOCABS = {"olmo2": 100_352, "llama-3.2": 128_256, "qwen2.5/qwen3": 151_936}


def graphed_us(fn: Callable[[], object], device: torch.device, reps: int = 200) -> float:
    """Microseconds per call of ``fn`` replayed in a CUDA graph (0 off a GPU, where it runs once)."""
    fn()
    if device.type != "cuda":
        return 0.0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return eager_us(graph.replay, device, reps)


def eager_us(fn: Callable[[], object], device: torch.device, reps: int = 200) -> float:
    fn()
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small vocabularies on the CPU (the kernel is skipped)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    vocabs = {name: 512 + 7 * i for i, name in enumerate(VOCABS)} if args.tiny else VOCABS
    kernel = device.type == "cuda" and triton_available()
    copy = measure_ceilings(timed)[0] if device.type == "cuda" else 0.0  # bytes/s
    compiled = S.compiled(S.sample_math, key="probe")
    rows_out = []
    for name, vocab in vocabs.items():
        for rows in (256, 32, 1):
            g = torch.Generator(device=device).manual_seed(rows)
            logits = torch.randn(rows, vocab, generator=g, device=device).to(torch.bfloat16)
            bias = torch.zeros(vocab, device=device)
            temperature, top_p = torch.ones(1, device=device), torch.ones(1, device=device)
            noise = torch.empty(rows, vocab, device=device)
            counter = CounterNoise(
                torch.tensor([rows], device=device), torch.zeros(1, dtype=torch.long, device=device),
                torch.arange(rows, device=device),
            )  # fmt: skip
            draw = eager_us(lambda: noise.exponential_(generator=g), device)
            written = (
                graphed_us(lambda: exponential_noise(counter, vocab, out=noise), device) if kernel else float("nan")
            )
            t = {
                mode: graphed_us(lambda mode=mode: compiled(logits, bias, temperature, top_p, noise, mode), device)
                for mode in ("greedy", "sample")
            }
            k = {
                mode: graphed_us(
                    lambda mode=mode: triton_sample(logits, bias, temperature, None if mode == "greedy" else counter),
                    device,
                )
                if kernel
                else float("nan")
                for mode in ("greedy", "sample")
            }
            floor = 1e6 * rows * vocab * 2 / copy if copy else float("nan")
            rows_out.append(
                f"| {name} ({vocab:,}) | {rows} | {draw:.1f} | {written:.1f} | {t['greedy']:.1f} / {k['greedy']:.1f} | "
                f"{t['sample']:.1f} / {k['sample']:.1f} | {floor:.1f} |"
            )
            print(rows_out[-1], flush=True)
    print(f"\ncopy {copy / 1e12:.2f} TB/s; microseconds per call, sample_math compiled / triton_sample")
    print(
        "| vocabulary | rows | Exp(1) draw, eager | counter noise written out | greedy | sampled "
        "(the kernel: noise made inside) | logits read once |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
