"""Where a decode step's time goes, per model family, against the floors of its parts.

For OLMo-2-1B's shape and each of ``bench_speed.FAMILY_MODELS`` (random bf16 weights): the forced batch
(256 prompts of 128 tokens, 512 new tokens, EOS ignored) end to end, and the captured step's replay time
at 256 / 32 / 1 rows with 256 response slots, for two ways of compiling the step's pieces (``--against``):

- ``engine``: sizes start as constants and those that change (batch, query length) turn symbolic, so the
  head count, head_dim and widths stay constants in inductor's kernels (``step.compiled``);
- ``max-autotune`` (default): the same, with inductor's ``max_autotune`` (each matmul timed as cuBLAS and
  as inductor's Triton GEMM templates, whose epilogues can take the bias, residual and activation; the
  fastest kept) and ``coordinate_descent_tuning`` (the fused kernels' block sizes tuned);
- ``all symbolic``: ``torch.compile(dynamic=True)``, every size and integer argument symbolic (the engine
  before ``4b31e8d``).

(At commit ``d2b2b64`` the same probe set one compiled piece per attention gap against two pieces per
layer; docs/benchmarks_history.md has that run.)

Then the profiler's kernels of five un-captured steps at 256 rows x 256 response slots, summed by kind
(matmuls, the Triton attention kernels, inductor's fused elementwise kernels, the rest), set against
each part's own floor: the matmuls' FLOPs at the measured matmul rate, the attention's K/V bytes at the
measured copy rate. ``bench_speed``'s decode floor is the larger of the two; the step runs them one
after the other, so their sum is what a step without overlap can reach.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/probes/decode_breakdown.py --data-dir DIR [--tiny]``.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch
from bench_speed import FAMILY_MODELS, Bench, kv_bytes_per_token, param_counts, probe_bench, probe_parser
from profile_step import use_family_model
from torch.profiler import ProfilerActivity, profile

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.fast import step as S

engine_compiled = S.compiled

KINDS = (
    ("attention", re.compile(r"decode_attention|prompt_attention|_combine")),
    ("matmul", re.compile(r"gemm|gemv|cutlass|nvjet|sm90|sm80|xmma|cublas|^triton_tem", re.I)),
    ("fused elementwise (inductor)", re.compile(r"^triton_")),
)


def all_symbolic(fn, key=None):
    """``step.compiled`` as it was: ``torch.compile(dynamic=True)``, in a cache of its own."""
    return engine_compiled(fn, f"{key}_symbolic", dynamic=True)


def max_autotune(fn, key=None):
    """``step.compiled`` with inductor's autotuned GEMMs and block sizes, in a cache of its own."""
    return engine_compiled(fn, f"{key}_autotune", options=(("max_autotune", True), ("coordinate_descent_tuning", True)))


AGAINST = {"max-autotune": max_autotune, "all symbolic": all_symbolic}


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


def part_floors_ms(bench: Bench, model, b: int, prompt: int, slots: int) -> dict[str, float]:
    n_params, n_matmul = param_counts(model)
    kv_bytes = kv_bytes_per_token(model.config, 2) * b * (prompt + slots)
    return dict(
        weights=1e3 * n_params * 2 / bench.bw,
        kv=1e3 * kv_bytes / bench.bw,
        matmul=1e3 * 2 * n_matmul * b / bench.mm,
    )


@torch.inference_mode()
def main():
    ap = probe_parser(__doc__.splitlines()[0])
    ap.add_argument("--models", default="olmo2-1b," + ",".join(FAMILY_MODELS))
    ap.add_argument(
        "--against", choices=sorted(AGAINST), default="max-autotune", help="the variant set against the engine"
    )
    ap.add_argument("--deadline-s", type=float, default=float("inf"), help="start no model past this many seconds")
    args = ap.parse_args()
    bench = probe_bench(args)
    bench.ceilings()
    prompts = bench.fixed_length_prompts()
    P, T = len(prompts), bench.new_tokens
    params = SamplingParams(temperature=1.0, max_new_tokens=T, seed=0, ignore_eos=True)
    mid = 32 if bench.tiny else 256  # response slots of the replay and profile: the forced batch's mean
    table, kinds_table = [], []
    row_labels: list[int] = []
    variants = ("engine", args.against)
    t0 = time.perf_counter()
    for name in args.models.split(","):
        if time.perf_counter() - t0 > args.deadline_s:
            print(f"# {name}: skipped, past the {args.deadline_s:.0f} s deadline", flush=True)
            continue
        if name != "olmo2-1b":
            use_family_model(bench, name)
        times = {}
        for variant in variants:
            S.compiled = AGAINST.get(variant, engine_compiled)
            engine = FastHFEngine(bench.model, bench.tok, max_batch_size=P)
            c0 = time.perf_counter()
            engine.generate(prompts, params)  # compiles, captures, allocates the state
            print(f"# {name} {variant}: first call {time.perf_counter() - c0:.1f} s", flush=True)
            _, forced = bench.timed(lambda: engine.generate(prompts, params))
            rows = [b for b in (256, 32, 1) if b <= engine._state.rows_cap]
            reps = {b: replay_ms(bench, engine, b, mid) for b in rows}
            times[variant] = (forced, reps)
            row_labels = rows
            b = rows[0]
            kinds = kernel_kinds(bench, engine, b, mid)
            fl = part_floors_ms(bench, bench.model, b, bench.prompt_len, mid)
            total = sum(v[0] for v in kinds.values())
            kinds_table.append(
                f"| {name} | {variant} | {reps[b]:.2f} | {total:.2f} | "
                + " | ".join(
                    f"{kinds.get(k, [0, 0])[0]:.2f} ({kinds.get(k, [0, 0])[1]:.0f})"
                    for k in ("matmul", "attention", "fused elementwise (inductor)", "other")
                )
                + f" | {fl['matmul']:.2f} | {fl['kv']:.2f} | {fl['weights']:.2f} | "
                f"{max(fl['matmul'], fl['kv'] + fl['weights']):.2f} | {fl['matmul'] + fl['kv']:.2f} |"
            )
            print(kinds_table[-1], flush=True)
            engine.close()
            del engine
            bench.free()
        S.compiled = engine_compiled
        new, old = (times[v] for v in variants)
        table.append(
            f"| {name} | {new[0]:.2f} / {old[0]:.2f} | "
            + " | ".join(f"{new[1][b]:.2f} / {old[1][b]:.2f}" for b in new[1])
            + " |"
        )
        print(table[-1], flush=True)
    print(f"\n## ceilings: copy {bench.bw / 1e12:.2f} TB/s, bf16 matmul {bench.mm / 1e12:.0f} TFLOP/s")
    print(
        f"\n## forced {P}x{bench.prompt_len}+{T} (s, one warm call) and replay of one step at {mid} response "
        f"slots (ms), by rows: engine / {args.against}"
    )
    print("| model | forced | " + " | ".join(f"{b} rows" for b in row_labels) + " |")
    print("|---|---:|" + "---:|" * len(row_labels))
    print("\n".join(table))
    print(
        f"\n## one un-captured step at {row_labels[0] if row_labels else 0} rows x {mid} response slots: GPU ms "
        "(kernels) by kind, against each part's floor"
    )
    print(
        "| model | compiled | replay ms | kernels ms | matmul | attention | fused elementwise | other | matmul FLOPs "
        "floor | K/V bytes floor | weight bytes | bench floor (larger) | matmul + K/V floors |"
    )
    print("|---|---|" + "---:|" * 11)
    print("\n".join(kinds_table))


if __name__ == "__main__":
    main()
