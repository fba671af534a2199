"""Where a generate call's time goes besides its captured decode steps, at OLMo-2-1B's shape.

``bench_speed``'s forced batch (section c: 256 prompts of 128 tokens, 512 new tokens) and realistic batch
(section d: 32 GSM8K prompts x 8, response lengths drawn from its range) through one ``FastHFEngine``:

- each call's wall time (best of 3 warm calls) and, from one more call under the profiler, the time the
  GPU was busy (the union of its kernels): wall minus busy is time the host left the GPU idle;
- for the forced batch, the same call with one new token (prefill, the first sample, results: the
  call's fixed part), and 511 replays of the captured step at the batch's mean attended length (the
  step's cost is linear in that length): what the decode loop would take with nothing between steps;
- the trainer's rollout (section f's generate phase: the realistic prompts x 8, every row allowed 512
  tokens, which random weights nearly always use): the call, its floor, the GPU's idle time and its
  kernels summed by kind (``decode_breakdown.KINDS``, the sampling kernels apart) against each
  kind's own floor.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/probes/generate_overhead.py --data-dir DIR [--tiny]``.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from bench_speed import Bench, probe_bench, probe_parser
from decode_breakdown import KINDS, replay_ms
from profile_step import gpu_busy_s
from torch.profiler import ProfilerActivity, profile

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine

SAMPLING = re.compile(r"_sample_slices|_merge_slices|_exponential")


def busy_and_wall(bench: Bench, fn, kinds: dict | None = None) -> tuple[float, float]:
    """(GPU busy seconds, wall seconds) of one call of ``fn`` under the profiler (busy 0 off a GPU); with
    ``kinds``, each kind's kernel seconds and count are added to it."""
    if bench.device.type != "cuda":
        return 0.0, bench.timed(fn)[1]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, wall = bench.timed(fn)
    if kinds is not None:
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            kind = "sampling" if SAMPLING.search(e.name) else next((k for k, rx in KINDS if rx.search(e.name)), "other")
            seconds, count = kinds.get(kind, (0.0, 0))
            kinds[kind] = (seconds + e.device_time_total / 1e6, count + 1)
    return gpu_busy_s(prof), wall


@torch.inference_mode()
def main() -> None:
    ap = probe_parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    bench = probe_bench(args)
    bench.ceilings()
    rows = []

    prompts = bench.fixed_length_prompts()
    P, T = len(prompts), bench.new_tokens
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=T, seed=0, ignore_eos=True)
    one = dataclasses.replace(params, max_new_tokens=1)
    floor = bench.decode_floor([bench.prompt_len] * P, [T] * P)
    engine = FastHFEngine(bench.model, bench.tok, max_batch_size=P)
    engine.generate(prompts, params)  # compiles, captures, allocates
    _, forced, _ = bench.best_of(lambda: engine.generate(prompts, params))
    _, fixed, _ = bench.best_of(lambda: engine.generate(prompts, one))
    busy, wall = busy_and_wall(bench, lambda: engine.generate(prompts, params))
    mid = T // 2
    step_ms = replay_ms(bench, engine, engine._bucket(P), mid)
    loop = forced - fixed
    rows += [
        f"| forced {P}x{bench.prompt_len}+{T}: whole call (best of 3) | {forced:.3f} | floor {floor:.3f} s: "
        f"{forced / floor:.2f}x |",
        f"| forced: one new token (prefill, first sample, results) | {fixed:.3f} | |",
        f"| forced: the rest, {T - 1} decode steps | {loop:.3f} | {1e3 * loop / (T - 1):.2f} ms a step |",
        f"| forced: {T - 1} replays of the captured step at {mid} response slots | {(T - 1) * step_ms / 1e3:.3f} | "
        f"{step_ms:.2f} ms a step |",
        f"| forced: one call profiled: wall / GPU busy | {wall:.3f} / {busy:.3f} | idle {wall - busy:.3f} s |",
    ]
    print("\n".join(rows[-5:]), flush=True)
    stats = dict(engine.stats)
    engine.close()
    del engine
    bench.free()

    prompts, params, lens = bench.realistic_batch()
    p_lens = [len(bench.tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    floor = bench.decode_floor(
        [p for p in p_lens for _ in range(bench.group)], [x for r in lens for x in r], bench.group
    )
    engine = FastHFEngine(bench.model, bench.tok, max_batch_size=len(prompts) * bench.group)
    engine.generate(prompts, params, row_max_new_tokens=lens)
    before = dict(engine.stats)
    _, real, _ = bench.best_of(lambda: engine.generate(prompts, params, row_max_new_tokens=lens))
    per_call = {k: (engine.stats[k] - before[k]) / 3 for k in ("host_syncs", "compactions", "cascade_steps")}
    busy, wall = busy_and_wall(bench, lambda: engine.generate(prompts, params, row_max_new_tokens=lens))
    rows += [
        f"| realistic {len(prompts)}x{bench.group}: whole call (best of 3) | {real:.3f} | floor {floor:.3f} s: "
        f"{real / floor:.2f}x |",
        f"| realistic: one call profiled: wall / GPU busy | {wall:.3f} / {busy:.3f} | idle {wall - busy:.3f} s; per "
        f"call {per_call['host_syncs']:.0f} host checks, {per_call['compactions']:.0f} compactions |",
    ]
    print("\n".join(rows[-2:]), flush=True)

    full = [[T] * bench.group for _ in prompts]
    floor = bench.decode_floor([p for p in p_lens for _ in range(bench.group)], [T] * sum(map(len, full)), bench.group)
    engine.generate(prompts, params, row_max_new_tokens=full)
    outs, rollout, _ = bench.best_of(lambda: engine.generate(prompts, params, row_max_new_tokens=full))
    mean_len = sum(len(c.token_ids) for g in outs for c in g) / sum(len(g) for g in outs)
    kinds: dict[str, tuple[float, int]] = {}
    busy, wall = busy_and_wall(bench, lambda: engine.generate(prompts, params, row_max_new_tokens=full), kinds)
    rows += [
        f"| trainer's rollout {len(prompts)}x{bench.group}, up to {T} tokens (mean {mean_len:.0f}): whole call (best "
        f"of 3) | {rollout:.3f} | floor {floor:.3f} s: {rollout / floor:.2f}x |",
        f"| trainer's rollout: one call profiled: wall / GPU busy | {wall:.3f} / {busy:.3f} | idle {wall - busy:.3f} s |",
    ]
    rows += [f"| trainer's rollout: {k} kernels | {v[0]:.3f} | {v[1]} kernels |" for k, v in sorted(kinds.items())]
    print("\n".join(rows[-2 - len(kinds) :]), flush=True)
    engine.close()
    print(f"\n## forced engine stats: {stats}")
    print("\n## generate calls at OLMo-2-1B's shape: seconds")
    print("| what | s | |\n|---|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
