"""Where the time of one decode step and one training step goes, at OLMo-2-0425-1B's size on a GPU.

A diagnostic companion to ``bench_speed.py`` (which measures end to end): prints

1. the replay time of the fast engine's captured decode step for several batch sizes and attended
   lengths (the step's fixed cost against its per-row cost);
2. a ``torch.profiler`` table of the eager decode step (graphs hide kernels from the profiler);
3. the compile time and step time of the training step through ``compile_backbone`` and a
   ``torch.profiler`` table of one compiled step;
4. (``--only trainer``) ``rlvr train`` with the suggested configuration (``bench_speed``'s section f):
   each phase's time in a steady step, then the train phase against ``policy_gradient_update`` called
   again on that step's own batch, model, optimizer and compiled backbone, with how much of each the
   GPU was busy, the GPU time of both summed by kind of kernel (``TRAIN_KINDS``) and the
   profiler's tables of the trainer's update (kernels, then host-side ops);
5. (``--only step``) one whole ``rlvr train`` step under the profiler: its wall time against the GPU's busy
   time, and the GPU's idle stretches by the host work under way (``STEP_LABELS``).

``--family NAME`` (one of ``bench_speed.FAMILY_MODELS``) runs the decode part on that model's exact shape
(random weights) instead of OLMo-2-1B's.

Each part runs on its own (``section_runner.run_sections``): one that fails or runs out of memory is
listed with its reason in the summary printed last, under the card it ran on, and the others still
run; the exit status is 0 unless ``--strict`` is given and a part failed or ran out of memory.

Usage: ``PYTHONPATH=src python benchmarks/profile_step.py --data-dir DIR [--tiny] [--only PART] [--family NAME]
[--strict]``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict

import torch
from bench_speed import FAMILY_MODELS, TINY_FAMILY_SHAPE, Bench, parse_args
from section_runner import FAILED, OOM, Section, card_line, outcome_table, run_sections
from torch.profiler import ProfilerActivity, profile

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.training.logprobs import compile_backbone
from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update


def kernel_table(prof, rows: int = 25) -> str:
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)


@torch.inference_mode()
def decode(bench: Bench):
    prompts = bench.fixed_length_prompts()
    params = SamplingParams(temperature=1.0, max_new_tokens=bench.new_tokens, seed=0, ignore_eos=True)
    engine = FastHFEngine(bench.model, bench.tok, max_batch_size=len(prompts))
    engine.generate(prompts, params)  # allocates the state at its full size
    st = engine._state
    print(
        f"\n## decode step: graph replay time (ms) by batch rows x attended response slots (prompt "
        f"{bench.prompt_len} slots)",
        flush=True,
    )
    slots_list = [s for s in (128, 256, 384, 512) if s <= st.slots_cap]
    print("rows | " + " | ".join(str(s) for s in slots_list))
    for b in [x for x in (256, 128, 64, 32, 8, 1) if x <= st.rows_cap]:
        cells = []
        for slots in slots_list:
            reps = 20

            def reset():  # every replay advances the slot and output column: keep both in bounds
                st.slot.fill_(slots - reps - 2)
                st.step.zero_()

            # The Triton kernel's graph serves every length (the engine passes the cache's full size).
            graph_slots = st.slots_cap if engine._attention_kind() == "triton" else slots
            reset()
            engine._run_step(st, b, graph_slots, "sample")  # captures
            reset()
            graph = engine._graphs.get(engine._step_key(b, graph_slots, "sample"))  # none on the CPU: the eager step
            run = graph.replay if graph is not None else (lambda: engine._decode_step(st, b, slots, "sample"))
            _, t = bench.timed(lambda: [run() for _ in range(reps)])
            cells.append(f"{1e3 * t / reps:.2f}")
        print(f"{b} | " + " | ".join(cells), flush=True)
    b, slots = min(256, st.rows_cap), slots_list[len(slots_list) // 2]
    st.slot.fill_(slots - 10)
    st.step.zero_()
    for _ in range(2):
        engine._decode_step(st, b, slots, "sample")
    bench.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            if not engine._counter_noise():  # the engine's own draw before each step (the kernel makes its noise)
                st.noise[:b].exponential_()
            engine._decode_step(st, b, slots, "sample")
        bench.sync()
    print(f"\n## eager decode step, {b} rows, {slots} slots, 5 steps", flush=True)
    print(kernel_table(prof), flush=True)
    engine.close()
    bench.free()


@torch.inference_mode()
def attention(bench: Bench):
    """The decode step's attention alone, one layer: the engine's Triton kernel over a shared prompt cache
    (32 prompts x 8 rows) against each SDPA backend over a per-row cache of the same slots (one query
    per row, left-padding mask); the prompt is the first 160 slots."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlvr.engines.fast.kernels.decode_attention import triton_available, triton_decode_attention

    cfg = bench.model.config
    heads, dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    rows = 8 if bench.tiny else 256
    print("\n## decode attention, one layer (us): rows x slots, by backend", flush=True)
    if triton_available() and bench.device.type == "cuda":
        n, plen = 8, 160
        for slots in (384, 672):
            mk = lambda *s: torch.randn(*s, device=bench.device, dtype=bench.dtype)  # noqa: E731
            q = mk(rows, 1, heads, dim).transpose(1, 2)
            pk, pv = mk(rows // n, heads, plen, dim), mk(rows // n, heads, plen, dim)
            rk, rv = mk(rows, heads, 512, dim), mk(rows, heads, 512, dim)
            grp = torch.arange(rows, device=bench.device) // n
            start = torch.randint(0, 30, (rows // n,), device=bench.device)[grp]
            lens = torch.tensor([plen], device=bench.device), torch.tensor([slots - plen], device=bench.device)
            cells = []
            for block, warps, stages in ((16, 2, 2), (16, 2, 3), (32, 4, 2), (16, 2, 1), (32, 4, 1), (64, 4, 1)):
                fn = lambda: triton_decode_attention(
                    q,
                    pk,
                    pv,
                    rk,
                    rv,
                    grp,
                    start,
                    *lens,
                    block=block,  # noqa: E731
                    num_warps=warps,
                    num_stages=stages,
                )
                fn()
                _, t = bench.timed(lambda: [fn() for _ in range(50)])
                cells.append(f"block {block} warps {warps} stages {stages}: {1e6 * t / 50:.0f}")
            print(f"{rows} x {slots} (shared prompt of {plen}), triton: " + "; ".join(cells), flush=True)
    for slots in (32,) if bench.tiny else (384, 640):
        q = torch.randn(rows, heads, 1, dim, device=bench.device, dtype=bench.dtype)
        k, v = (torch.randn(rows, heads, slots, dim, device=bench.device, dtype=bench.dtype) for _ in range(2))
        mask = torch.arange(slots, device=bench.device)[None, :] >= torch.randint(0, 30, (rows, 1), device=bench.device)
        mask = mask[:, None, None, :]
        cells = []
        for name, backend, m in (
            ("cudnn", SDPBackend.CUDNN_ATTENTION, mask),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION, mask),
            ("flash (no mask)", SDPBackend.FLASH_ATTENTION, None),
            ("math", SDPBackend.MATH, mask),
        ):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
                    fn()
                    _, t = bench.timed(lambda: [fn() for _ in range(50)])
                cells.append(f"{name} {1e6 * t / 50:.0f}")
            except RuntimeError as e:
                cells.append(f"{name} n/a ({str(e)[:40]})")
        print(f"{rows} x {slots}: " + "; ".join(cells), flush=True)


def training(bench: Bench):
    if not hasattr(bench, "rl"):
        bench.realistic()  # the training batch reuses its prompts and drawn lengths
    batch, adv = bench.training_batch()
    model = bench.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.cuda.is_available())
    budget = 2048 if bench.tiny else 16384
    t0 = time.perf_counter()
    backbone = compile_backbone(model)

    step_batch = StepBatch(batch["input_ids"], batch["labels"], batch["response_mask"], adv)
    spec = UpdateSpec(1, 1.0, max_tokens_per_microbatch=budget)

    def step():
        return policy_gradient_update(model, opt, step_batch, spec, backbone=backbone)

    step()
    bench.sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(3):
        _, t = bench.timed(step)
        times.append(t)
    print(
        f"\n## compiled training step (layer-wise compile): first step {first:.1f} s, then "
        f"{', '.join(f'{t:.3f}' for t in times)} s",
        flush=True,
    )
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        bench.sync()
    print(kernel_table(prof, 30), flush=True)
    model.eval()
    bench.free()


# Kernel kinds of a training step, first match wins (attention first: some of its kernels are CUTLASS's).
TRAIN_KINDS = (
    ("attention (SDPA, flash varlen)", re.compile(r"flash|fmha|attention|efficient", re.I)),
    ("matmul", re.compile(r"gemm|gemv|cutlass|nvjet|sm90|sm80|xmma|cublas|^triton_tem", re.I)),
    ("fused elementwise (inductor)", re.compile(r"^triton_")),
    ("optimizer and norm (multi-tensor)", re.compile(r"multi_tensor|foreach|adam", re.I)),
    ("indexing", re.compile(r"index|gather|scatter", re.I)),
    ("copies and casts", re.compile(r"copy|memcpy|memset|cast|fill", re.I)),
    ("eager elementwise and reductions", re.compile(r"elementwise|reduce", re.I)),
)


def kernels_by_kind(prof) -> str:
    """The profiled kernels' GPU seconds and counts summed by ``TRAIN_KINDS``, as a markdown table."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = next((k for k, rx in TRAIN_KINDS if rx.search(e.name)), "other")
            sums[kind][0] += e.device_time_total / 1e6
            sums[kind][1] += 1
    lines = ["kind | GPU s | kernels", "---|---:|---:"]
    for kind, (sec, n) in sorted(sums.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{kind} | {sec:.3f} | {n}")
    return "\n".join(lines)


def kernel_spans(prof) -> list[tuple[float, float]]:
    """The profiled GPU kernels' ``(start us, end us)``, in start order."""
    return sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )


def gpu_busy_s(prof) -> float:
    """Seconds in which at least one kernel ran (the union of the kernels' intervals)."""
    spans = kernel_spans(prof)
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy / 1e6


def trainer(bench: Bench, steps: int = 4):
    """The train phase inside ``rlvr train`` against the same update called on its own (module docstring)."""
    import rlvr.commands.train as trainer_module

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    update, original_update = {}, trainer_module.policy_gradient_update
    phase = {}

    def capture(*args, **kwargs):  # keeps the last call's inputs: the profiled (last) step's batch
        update["args"], update["kwargs"] = args, kwargs
        return original_update(*args, **kwargs)

    original_phase = trainer_module._update

    def profiled(config, step, run, batch, state):
        if step != config.n_steps:
            return original_phase(config, step, run, batch, state)
        bench.sync()
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            metrics = original_phase(config, step, run, batch, state)
            bench.sync()
        phase.update(prof=prof, wall=time.perf_counter() - t0)
        return metrics

    trainer_module.policy_gradient_update, trainer_module._update = capture, profiled
    bench.args.trainer_steps = steps
    try:
        bench.trainer_step()
    finally:
        trainer_module.policy_gradient_update, trainer_module._update = original_update, original_phase
    rows = bench.log["trainer_rows"]
    steady = rows[-2]  # the last step before the profiled one
    print(f"\n## rlvr train, step {steady['step']} of {steps} (steady, not profiled): seconds per phase", flush=True)
    timed = {k: v for k, v in steady.items() if k.startswith("time/") and isinstance(v, float)}
    for key, value in sorted(timed.items(), key=lambda kv: -kv[1]):
        print(f"{key}: {value:.3f}")
    parts = sum(v for k, v in timed.items() if k != "time/step")
    print(f"step less its timed parts: {timed['time/step'] - parts:.3f}", flush=True)
    model = update["args"][0]
    model.train()
    times = []
    for _ in range(3):
        _, t = bench.timed(lambda: original_update(*update["args"], **update["kwargs"]))
        times.append(t)
    with profile(activities=acts) as alone:
        original_update(*update["args"], **update["kwargs"])
        bench.sync()
    model.eval()
    step_batch = update["args"][2]
    ids = step_batch.input_ids
    print(
        f"\n## train phase of step {steps} against the same update alone ({ids.shape[0]} rows, "
        f"{int(step_batch.response_mask.sum())} response tokens, width {ids.shape[1]})",
        flush=True,
    )
    print("what | wall s | GPU busy s")
    print(f"trainer's train phase (profiled) | {phase['wall']:.3f} | {gpu_busy_s(phase['prof']):.3f}")
    print(f"trainer's train phase (step {steady['step']}, not profiled) | {steady['time/train']:.3f} | -")
    print(f"policy_gradient_update alone, 3 calls | {', '.join(f'{t:.3f}' for t in times)} | {gpu_busy_s(alone):.3f}")
    print(f"\n## kernels by kind: the trainer's train phase (step {steps})", flush=True)
    print(kernels_by_kind(phase["prof"]))
    print("\n## kernels by kind: the same update alone", flush=True)
    print(kernels_by_kind(alone))
    print(f"\n## kernels of the trainer's train phase (step {steps})", flush=True)
    print(kernel_table(phase["prof"], 30), flush=True)
    print(f"\n## host-side ops of the trainer's train phase (step {steps})", flush=True)
    print(phase["prof"].key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    bench.free()


# What the whole-step profile labels, as (module, attribute, label): each is wrapped in a
# ``record_function`` of that label, so the GPU's idle stretches can be pinned to the host work under way.
STEP_LABELS = (
    ("rlvr.commands.train", "_rollout", "rollout"),
    ("rlvr.commands.train", "_score", "score"),
    ("rlvr.commands.train", "_advantages", "advantages"),
    ("rlvr.commands.train", "_update", "update"),
    ("rlvr.commands.train", "_dump_rollouts", "dump rollouts"),
    ("rlvr.engines.fast.engine.FastHFEngine", "generate", "generate"),
    ("rlvr.engines.hf.HFEngine", "generate", "generate"),
    ("rlvr.engines.fast.engine.FastHFEngine", "_prefill", "prefill"),
    ("rlvr.engines.fast.stops.RowChecks", "examine", "host checks"),
    ("rlvr.engines.fast.stops.RowChecks", "completions", "results"),
    # helpers imported by name are wrapped where they are called, not where they are defined
    ("rlvr.engines.rollouts", "encode_texts", "encode texts"),
    ("rlvr.engines.sampling", "encode_texts", "encode texts"),
    ("rlvr.environments.rollout", "encode_texts", "encode texts"),
    ("rlvr.engines.rollouts", "tokenize_from_ids", "pad batch"),
    ("rlvr.commands.train", "policy_gradient_update", "policy_gradient_update"),
)


def _resolve(path: str):
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def idle_gaps(
    spans: list[tuple[float, float]], regions: list[tuple[str, float, float]], least_us: float = 200.0
) -> list[tuple[float, float, str]]:
    """The GPU's idle stretches between kernel ``spans`` (``kernel_spans``) of at least ``least_us`` (start us
    from the first kernel, length us, the innermost labelled host region under way at the stretch's middle)."""
    gaps, end = [], spans[0][1] if spans else 0.0
    first = spans[0][0] if spans else 0.0
    for lo, hi in spans[1:]:
        if lo - end >= least_us:
            mid = (lo + end) / 2
            inside = [r for r in regions if r[1] <= mid <= r[2]]
            label = min(inside, key=lambda r: r[2] - r[1])[0] if inside else "(no label)"
            gaps.append((end - first, lo - end, label))
        end = max(end, hi)
    return gaps


def whole_step(bench: Bench, steps: int = 4):
    """One whole ``rlvr train`` step (the last of ``steps``) under the profiler: wall against GPU busy, and
    where the GPU idles, by the host work under way (``STEP_LABELS``)."""
    import rlvr.commands.train as trainer_module

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    originals = []
    for owner_path, attr, label in STEP_LABELS:
        owner = _resolve(owner_path)
        fn = getattr(owner, attr)

        def wrapped(*args, _fn=fn, _label=label, **kwargs):
            with torch.profiler.record_function(f"step: {_label}"):
                return _fn(*args, **kwargs)

        originals.append((owner, attr, fn))
        setattr(owner, attr, wrapped)
    result = {}
    original_step = trainer_module._rollout_step

    def profiled(config, step, run_dir, run, state):
        if step != config.n_steps:
            return original_step(config, step, run_dir, run, state)
        bench.sync()
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            log = original_step(config, step, run_dir, run, state)
            bench.sync()
        result.update(prof=prof, wall=time.perf_counter() - t0)
        return log

    trainer_module._rollout_step = profiled
    bench.args.trainer_steps = steps
    try:
        bench.trainer_step()
    finally:
        trainer_module._rollout_step = original_step
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    for row in bench.log["trainer_rows"]:
        times = ", ".join(
            f"{k[5:]} {row[k]:.3f}" for k in ("time/step", "time/generate", "time/train", "time/tokenize")
        )
        print(f"step {row['step']}: {times} s", flush=True)
    prof = result["prof"]
    regions, seconds = [], defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("step: "):
            regions.append((e.name[6:], e.time_range.start, e.time_range.end))
            seconds[e.name[6:]] += (e.time_range.end - e.time_range.start) / 1e6
    gaps = idle_gaps(kernel_spans(prof), regions)
    busy = gpu_busy_s(prof)
    print(
        f"\n## rlvr train, step {steps} of {steps} under the profiler: wall {result['wall']:.3f} s, GPU busy "
        f"{busy:.3f} s, idle {result['wall'] - busy:.3f} s",
        flush=True,
    )
    print("host region | wall s (summed over calls)")
    print("---|---:")
    for label, sec in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"{label} | {sec:.3f}")
    by_label = defaultdict(lambda: [0.0, 0])
    for _, length, label in gaps:
        by_label[label][0] += length / 1e6
        by_label[label][1] += 1
    print("\n## the GPU's idle stretches of 0.2 ms or more, by the host region under way")
    print("host region | idle s | stretches")
    print("---|---:|---:")
    for label, (sec, n) in sorted(by_label.items(), key=lambda kv: -kv[1][0]):
        print(f"{label} | {sec:.3f} | {n}")
    print("\n## the longest idle stretches: at ms (from the first kernel) | ms | host region")
    for at, length, label in sorted(gaps, key=lambda g: -g[1])[:15]:
        print(f"{at / 1e3:.1f} | {length / 1e3:.2f} | {label}")
    bench.free()


def use_family_model(bench: Bench, name: str) -> None:
    """Swap the bench's model for one of ``FAMILY_MODELS`` at its exact shape (random weights)."""
    from transformers import AutoConfig

    from rlvr.modeling import build_model

    model_type, shape = FAMILY_MODELS[name]
    shape = dict(shape, **(TINY_FAMILY_SHAPE if bench.tiny else {}))
    if bench.tiny:
        shape["vocab_size"] = len(bench.tok) + 64
    config = AutoConfig.for_model(
        model_type,
        **shape,
        pad_token_id=bench.tok.pad_token_id,
        eos_token_id=bench.tok.eos_token_id,
        bos_token_id=bench.tok.bos_token_id,
    )
    del bench.model
    bench.free()
    with torch.device(bench.device):
        bench.model = build_model(config, seed=0, dtype=bench.dtype).eval()
    print(f"\n# model: {name} ({sum(p.numel() for p in bench.model.parameters()) / 1e9:.2f} B parameters)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--only", choices=tuple(PARTS), default=None)
    ap.add_argument(
        "--family",
        choices=tuple(FAMILY_MODELS),
        default=None,
        help="profile the decode step on this model's shape instead of OLMo-2-1B's",
    )
    ap.add_argument(
        "--shared-prefix",
        action="store_true",
        help="profile the trainer with its microbatches packed, each prompt once (optim.shared_prefix true)",
    )
    ap.add_argument(
        "--keep-head-logits",
        action="store_true",
        help="profile the trainer with the head's logits kept for the backward (optim.keep_head_logits true)",
    )
    ap.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when a part failed or ran out of memory (default: 0, the summary says why)",
    )
    args = ap.parse_args(argv)
    # The bench's own settings (its defaults), so that the two scripts cannot drift apart.
    flags = ["--tiny"] if args.tiny else []
    flags += [f"--{name.replace('_', '-')}" for name in ("shared_prefix", "keep_head_logits") if getattr(args, name)]
    bench_args = parse_args(["--data-dir", args.data_dir, "--skip-baselines", *flags])
    bench = Bench(bench_args)
    bench.setup()
    if args.family:
        use_family_model(bench, args.family)
    names = ["ceilings"] + [name for name in PARTS if args.only in (None, name)]
    table = dict(PARTS, ceilings=Section(Bench.ceilings))

    def report(outcome):
        print(f"[part] {outcome.name}: {outcome.status} in {outcome.seconds:.1f} s {outcome.reason}", flush=True)

    # Each part on its own: one that fails or runs out of memory leaves the others to run.
    outcomes = run_sections(table, names, bench, free=bench.after_section, report=report)
    print(f"\n## parts run\n\n{card_line(bench.card)}\n\n{outcome_table(outcomes)}", flush=True)
    return 1 if args.strict and any(o.status in (FAILED, OOM) for o in outcomes) else 0


def with_card(part):
    """``part``, first printing which card its tables are measured on."""

    def run(bench: Bench) -> None:
        print(f"\n# {part.__name__}: {card_line(bench.card)}", flush=True)
        part(bench)

    return run


# The parts in the order they run; the training part's realistic batch computes its decode floor.
PARTS = {
    "decode": Section(with_card(decode)),
    "attention": Section(with_card(attention)),
    "training": Section(with_card(training), needs=("ceilings",)),
    "trainer": Section(with_card(trainer)),
    "step": Section(with_card(whole_step)),
}


if __name__ == "__main__":
    sys.exit(main())
