"""Realistic vs forced: the decode schedule replayed back to back (GPU only) against the real call, and
the GPU's idle gaps in a profiler trace of one real call (not committed)."""
import json, random, sys, time, collections
import torch
sys.path.insert(0, "benchmarks")
from bench_speed import Bench, parse_args
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.base import SamplingParams
from rlvr.prompts import render
from torch.profiler import ProfilerActivity, profile

args = parse_args(["--data-dir", ".gpu/gsm8k", "--skip-baselines", "--no-trl"])
bench = Bench(args); bench.setup()
rng = random.Random(args.seed + 1)
exs = rng.sample(bench.examples, 32)
prompts = [render("r1_zero", ex.question) for ex in exs]
lens = [[rng.randint(50, 512) for _ in range(8)] for _ in prompts]
params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=512, stop=("</answer>",), seed=2, ignore_eos=True)
fprompts = bench.fixed_length_prompts()
fparams = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=512, seed=0, ignore_eos=True)
fast = FastHFEngine(bench.model, bench.tok, max_batch_size=256)
gen = torch.Generator(device="cuda").manual_seed(0)

def analyse(name, call):
    call(); torch.cuda.synchronize()
    _, t_real = bench.timed(call)
    sched = []
    orig = fast._run_step
    fast._run_step = lambda st, b, slots, mode: (sched.append((b, slots, mode)), orig(st, b, slots, mode))
    call(); torch.cuda.synchronize()
    fast._run_step = orig
    st = fast._state
    with torch.inference_mode():
        st.live.fill_(1); st.slot.zero_(); st.step.fill_(1)
        def replay():
            for b, slots, mode in sched:
                st.noise[:b].exponential_(generator=gen)
                fast._run_step(st, b, slots, mode)
        replay()
        st.slot.zero_(); st.step.fill_(1)
        _, t_sched = bench.timed(replay)
    counts = collections.Counter(b for b, _, _ in sched)
    print(f"[{name}] real call {t_real:.3f} s; its {len(sched)} decode steps replayed back to back {t_sched:.3f} s "
          f"(buckets {dict(counts)})", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call(); torch.cuda.synchronize()
    path = f"/tmp/trace_{name}.json"
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    kern = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    launches = sorted(e["ts"] for e in ev if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", ""))
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e]
    t0 = min(e["ts"] for e in ev if "ts" in e and e.get("cat") in ("cpu_op", "cuda_runtime"))
    t1 = max(e["ts"] + e.get("dur", 0) for e in ev if e.get("cat") in ("kernel", "cpu_op"))
    busy, gaps, end = 0.0, [], kern[0][0]
    for a, b in kern:
        if a > end:
            gaps.append((end, a))
        busy += max(0, b - max(a, end)); end = max(end, b)
    first_l, last_l = (launches[0], launches[-1]) if launches else (t0, t1)
    phase = collections.Counter()
    big = []
    for a, b in gaps:
        d = b - a
        p = "before decode" if a < first_l else ("after decode" if a > last_l else "decode loop")
        phase[p] += d
        if d > 200:
            import bisect
            step = bisect.bisect(launches, a)
            ops = sorted({e["name"][:40] for e in cpu if e["ts"] <= a <= e["ts"] + e["dur"] and e["dur"] < 5e5})[:4]
            big.append((d, a - t0, step, ops))
    print(f"[{name}] trace: wall {1e-6*(t1-t0):.3f} s, GPU busy {1e-6*busy:.3f} s, first graph launch at "
          f"{1e-6*(first_l-t0):.3f} s, last at {1e-6*(last_l-t0):.3f} s; idle by phase (s): "
          + ", ".join(f"{k} {1e-6*v:.3f}" for k, v in phase.items()), flush=True)
    for d, at, step, ops in sorted(big, reverse=True)[:15]:
        print(f"   gap {d/1e3:.2f} ms at {at/1e6:.3f} s (after launch {step}): {ops}")

analyse("realistic", lambda: fast.generate(prompts, params, row_max_new_tokens=lens))
analyse("forced", lambda: fast.generate(fprompts, fparams))
analyse("realistic2", lambda: fast.generate(prompts, params, row_max_new_tokens=lens))
