"""Where a decode step's time goes, per model family, against the floors of its parts.

For OLMo-2-1B's shape and each of ``bench_speed.FAMILY_MODELS`` (random bf16 weights): the forced batch
(256 prompts of 128 tokens, 512 new tokens, EOS ignored) end to end, and the captured step's replay time
at 256 / 32 / 1 rows with 256 response slots, for two ways of cutting a step into compiled pieces:

- ``one piece per gap`` (the engine): a layer's MLP and the next layer's projections run as one
  compiled piece, so a step has one piece per attention call;
- ``two pieces per layer`` (the engine before it): ``pre_attention`` and ``post_attention`` apart.

Then the profiler's kernels of five un-captured steps at 256 rows x 256 response slots, summed by kind
(matmuls, the Triton attention kernels, inductor's fused elementwise kernels, the rest), set against
each part's own floor: the matmuls' FLOPs at the measured matmul rate, the attention's K/V bytes at the
measured copy rate. ``bench_speed``'s decode floor is the larger of the two; the step runs them one
after the other, so their sum is what a step without overlap can reach.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/probes/decode_breakdown.py --data-dir DIR [--tiny]``.
"""

from __future__ import annotations

import argparse
import re
import time
import types
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from bench_speed import FAMILY_MODELS, Bench, param_counts, parse_args
from profile_step import use_family_model
from torch.profiler import ProfilerActivity, profile

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.fast import step as S

KINDS = (
    ("attention", re.compile(r"decode_attention|prompt_attention|_combine")),
    ("matmul", re.compile(r"gemm|gemv|cutlass|nvjet|sm90|sm80|xmma|cublas", re.I)),
    ("fused elementwise (inductor)", re.compile(r"^triton_")),
)


def two_pieces_per_layer(self: FastHFEngine, x, cos, sin, attend):
    """The engine's ``_layers`` as it was before one piece per gap: ``pre_attention`` and
    ``post_attention`` compiled apart, the final norm on its own."""
    layout, family = self.layout, self.layout.family
    compiled = self._step_compiled()
    pre = S.compiled(S.pre_attention, family.name) if compiled else S.pre_attention
    post = S.compiled(S.post_attention, family.name) if compiled else S.post_attention
    common: dict[str, Any] = dict(
        eps=layout.eps, pre_norm=family.norms == "pre", float32_scale=family.float32_scale, fused=True
    )
    st = self._state
    for i, w in enumerate(self._weights):
        qkv = (st.wqkv[i], st.bqkv[i]) if st.wqkv else ((w.wq, w.wk, w.wv), (w.bq, w.bk, w.bv))
        gate_up = (st.wgate_up[i], st.bgate_up[i]) if st.wgate_up else ((w.w_gate, w.w_up), (w.b_gate, w.b_up))
        q, k, v = pre(
            x,
            w.norm1,
            *qkv,
            w.q_norm,
            w.k_norm,
            cos,
            sin,
            heads=layout.heads,
            kv_heads=layout.kv_heads,
            head_dim=layout.head_dim,
            qk_norm=family.qk_norm,
            **common,
        )
        o = attend(i, q, k, v)
        x = post(x, o, w.wo, w.bo, w.norm1, w.norm2, *gate_up, w.w_down, w.b_down, F.silu, **common)
    return S.rms(x, self.model.model.norm.weight, layout.eps, family.float32_scale)


def replay_ms(bench: Bench, engine: FastHFEngine, b: int, slots: int, reps: int = 20) -> float:
    st = engine._state

    def reset():  # every replay advances the slot and output column: keep both in bounds
        st.slot.fill_(slots - reps - 2)
        st.step.zero_()

    reset()
    engine._run_step(st, b, st.slots_cap, "sample")  # captures
    reset()
    graph = engine._graphs.get(engine._step_key(b, st.slots_cap, "sample"))
    run = graph.replay if graph is not None else (lambda: engine._decode_step(st, b, slots, "sample"))
    _, t = bench.timed(lambda: [run() for _ in range(reps)])
    return 1e3 * t / reps


def kernel_kinds(bench: Bench, engine: FastHFEngine, b: int, slots: int, steps: int = 5) -> dict[str, list[float]]:
    """GPU ms and kernel count per step by kind, from the profiler over ``steps`` un-captured steps (none
    off a GPU)."""
    if bench.device.type != "cuda":
        return {}
    st = engine._state
    st.slot.fill_(slots - steps - 2)
    st.step.zero_()
    engine._decode_step(st, b, slots, "sample")
    bench.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine._decode_step(st, b, slots, "sample")
        bench.sync()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = next((k for k, rx in KINDS if rx.search(e.name)), "other")
        out[kind][0] += e.device_time_total / 1e3 / steps
        out[kind][1] += 1 / steps
    return dict(out)


def grouped_kernel_sweep(bench: Bench, model, rows: int, prompt: int, slots: int) -> str:
    """One layer's grouped-query attention (us per call, 50 calls) over ``rows`` rows with their own prompt
    and ``slots`` response slots, for (slots per iteration, warps, pipeline stages, splits) settings; the
    first is the engine's default at this size."""
    from rlvr.engines.decode_attention import default_splits, triton_available, triton_decode_attention

    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if kv == heads or not triton_available() or bench.device.type != "cuda":
        return ""
    mk = lambda *s: torch.randn(*s, device=bench.device, dtype=bench.dtype)  # noqa: E731
    q = mk(rows, heads, 1, dim)
    pk, pv = mk(rows, kv, prompt, dim), mk(rows, kv, prompt, dim)
    rk, rv = mk(rows, kv, slots + 8, dim), mk(rows, kv, slots + 8, dim)
    grp = torch.arange(rows, device=bench.device)
    start = torch.zeros(rows, dtype=torch.long, device=bench.device)
    plen = torch.tensor([prompt], device=bench.device)
    rlen = torch.tensor([slots], device=bench.device)
    split0 = default_splits(rows, kv)
    cells = []
    for block, warps, stages, splits in (
        (32, 4, 3, split0),
        (64, 4, 3, split0),
        (64, 8, 3, split0),
        (32, 4, 4, split0),
        (16, 4, 3, split0),
        (32, 4, 3, max(1, split0 // 2)),
        (32, 4, 3, split0 * 2),
    ):
        fn = lambda: triton_decode_attention(  # noqa: E731
            q,
            pk,
            pv,
            rk,
            rv,
            grp,
            start,
            plen,
            rlen,
            splits=splits,
            run_block=block,
            run_warps=warps,
            num_stages=stages,
        )
        fn()
        _, t = bench.timed(lambda: [fn() for _ in range(50)])
        cells.append(f"{block}/{warps}/{stages}/{splits}: {1e6 * t / 50:.1f}")
    kv_us = 1e6 * 2 * rows * kv * dim * 2 * (prompt + slots) / bench.bw
    return f"{rows} rows x ({prompt} + {slots}) slots, K/V floor {kv_us:.1f} us: " + "; ".join(cells)


def part_floors_ms(bench: Bench, model, b: int, prompt: int, slots: int) -> dict[str, float]:
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_width = (getattr(cfg, "num_key_value_heads", None) or heads) * (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    )
    n_params, n_matmul = param_counts(model)
    kv_bytes = 2 * cfg.num_hidden_layers * kv_width * 2 * b * (prompt + slots)
    return dict(
        weights=1e3 * n_params * 2 / bench.bw,
        kv=1e3 * kv_bytes / bench.bw,
        matmul=1e3 * 2 * n_matmul * b / bench.mm,
    )


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--models", default="olmo2-1b," + ",".join(FAMILY_MODELS))
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="start no model past this many seconds")
    args = ap.parse_args()
    bench = Bench(parse_args(["--data-dir", args.data_dir, "--skip-baselines"] + (["--tiny"] if args.tiny else [])))
    bench.setup()
    bench.ceilings()
    prompts = bench.fixed_length_prompts()
    P, T = len(prompts), bench.new_tokens
    params = SamplingParams(temperature=1.0, max_new_tokens=T, seed=0, ignore_eos=True)
    mid = 32 if bench.tiny else 256  # response slots of the replay and profile: the forced batch's mean
    table, kinds_table, sweeps = [], [], []
    row_labels: list[int] = []
    t0 = time.perf_counter()
    for name in args.models.split(","):
        if time.perf_counter() - t0 > args.deadline_s:
            print(f"# {name}: skipped, past the {args.deadline_s:.0f} s deadline", flush=True)
            continue
        if name != "olmo2-1b":
            use_family_model(bench, name)
        times = {}
        for variant in ("one piece per gap", "two pieces per layer"):
            engine = FastHFEngine(bench.model, bench.tok, max_batch_size=P)
            if variant == "two pieces per layer":
                engine._layers = types.MethodType(two_pieces_per_layer, engine)  # type: ignore[method-assign]
            engine.generate(prompts, params)  # compiles, captures, allocates the state
            _, forced = bench.timed(lambda: engine.generate(prompts, params))
            rows = [b for b in (256, 32, 1) if b <= engine._state.rows_cap]
            reps = {b: replay_ms(bench, engine, b, mid) for b in rows}
            times[variant] = (forced, reps)
            row_labels = rows
            if variant == "one piece per gap":
                b = rows[0]
                kinds = kernel_kinds(bench, engine, b, mid)
                fl = part_floors_ms(bench, bench.model, b, bench.prompt_len, mid)
                total = sum(v[0] for v in kinds.values())
                kinds_table.append(
                    f"| {name} | {reps[b]:.2f} | {total:.2f} | "
                    + " | ".join(
                        f"{kinds.get(k, [0, 0])[0]:.2f} ({kinds.get(k, [0, 0])[1]:.0f})"
                        for k in ("matmul", "attention", "fused elementwise (inductor)", "other")
                    )
                    + f" | {fl['matmul']:.2f} | {fl['kv']:.2f} | {fl['weights']:.2f} | "
                    f"{max(fl['matmul'], fl['kv'] + fl['weights']):.2f} | {fl['matmul'] + fl['kv']:.2f} |"
                )
            engine.close()
            del engine
            bench.free()
        sweep = grouped_kernel_sweep(bench, bench.model, 256, bench.prompt_len, mid)
        if sweep:
            sweeps.append(f"- {name}: {sweep}")
            print(sweeps[-1], flush=True)
        new, old = times["one piece per gap"], times["two pieces per layer"]
        table.append(
            f"| {name} | {new[0]:.2f} / {old[0]:.2f} | "
            + " | ".join(f"{new[1][b]:.2f} / {old[1][b]:.2f}" for b in new[1])
            + " |"
        )
        print(table[-1], flush=True)
        print(kinds_table[-1], flush=True)
    print(f"\n## ceilings: copy {bench.bw / 1e12:.2f} TB/s, bf16 matmul {bench.mm / 1e12:.0f} TFLOP/s")
    print(
        f"\n## forced {P}x{bench.prompt_len}+{T} (s, one warm call) and replay of one step at {mid} response "
        "slots (ms), by rows: one piece per gap / two pieces per layer"
    )
    print("| model | forced | " + " | ".join(f"{b} rows" for b in row_labels) + " |")
    print("|---|---:|" + "---:|" * len(row_labels))
    print("\n".join(table))
    print(
        f"\n## one un-captured step at 256 rows x {mid} response slots: GPU ms (kernels) by kind, against each part's floor"
    )
    print(
        "| model | replay ms | kernels ms | matmul | attention | fused elementwise | other | matmul FLOPs floor | "
        "K/V bytes floor | weight bytes | bench floor (larger) | matmul + K/V floors |"
    )
    print("|---|" + "---:|" * 11)
    print("\n".join(kinds_table))
    print("\n## grouped-query attention kernel, one layer, us per call: slots per iteration / warps / stages / splits")
    print("\n".join(sweeps))


if __name__ == "__main__":
    main()
