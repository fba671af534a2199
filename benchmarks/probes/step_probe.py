"""Where the realistic batch's time goes: per-step GPU time by batch bucket, replay F(b, slots), attention by rows,
and an eager kernel table (not committed)."""
import random, sys, time, collections
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/probes")
from bench_speed import Bench, parse_args
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.base import SamplingParams
from rlvr.engines.decode_attention import triton_decode_attention
from rlvr.prompts import render
from torch.profiler import ProfilerActivity, profile

args = parse_args(["--data-dir", ".gpu/gsm8k", "--skip-baselines", "--no-trl"])
bench = Bench(args); bench.setup(); bench.ceilings()
rng = random.Random(args.seed + 1)
exs = rng.sample(bench.examples, 32)
prompts = [render("r1_zero", ex.question) for ex in exs]
lens = [[rng.randint(50, 512) for _ in range(8)] for _ in prompts]
flat = [x for r in lens for x in r]
params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=512, stop=("</answer>",), seed=2, ignore_eos=True)
fast = FastHFEngine(bench.model, bench.tok, max_batch_size=256)
t0 = time.perf_counter(); fast.generate(prompts, params, row_max_new_tokens=lens); torch.cuda.synchronize()
print(f"cold realistic {time.perf_counter() - t0:.2f} s", flush=True)
for _ in range(1):
    _, t = bench.timed(lambda: fast.generate(prompts, params, row_max_new_tokens=lens))
    print(f"warm realistic {t:.3f} s", flush=True)
orig = fast._run_step
log = []
def run_step(st, b, slots, mode):
    orig(st, b, slots, mode)
    e = torch.cuda.Event(enable_timing=True); e.record(); log.append((b, e))
fast._run_step = run_step
_, t = bench.timed(lambda: fast.generate(prompts, params, row_max_new_tokens=lens))
print(f"instrumented realistic {t:.3f} s, {len(log)} steps", flush=True)
by = collections.defaultdict(list)
alive_by = collections.defaultdict(list)
for i in range(1, len(log)):
    b = log[i][0]
    by[b].append(log[i - 1][1].elapsed_time(log[i][1]))
    alive_by[b].append(sum(1 for x in flat if x > i + 1))
print("bucket | steps | mean ms/step | total s | mean alive rows")
tot = 0
for b in sorted(by, reverse=True):
    v = by[b]; tot += sum(v) / 1e3
    print(f"{b} | {len(v)} | {sum(v)/len(v):.3f} | {sum(v)/1e3:.3f} | {sum(alive_by[b])/len(v):.1f}")
print(f"sum of steps {tot:.3f} s", flush=True)
fast._run_step = orig
st = fast._state
_IM = torch.inference_mode(); _IM.__enter__()
print("\nreplay ms per step: bucket x response slots (realistic layout)")
for b in sorted({k[0] for k in fast._graphs}, reverse=True):
    cells = []
    for s in (50, 250, 450):
        g = fast._graphs[(b, st.slots_cap, "sample")]
        st.slot.fill_(s); st.step.fill_(0)
        g.replay(); torch.cuda.synchronize()
        st.slot.fill_(s); st.step.fill_(0)
        def rep():
            for _ in range(20):
                g.replay()
        _, tt = bench.timed(rep)
        cells.append(f"{1e3*tt/20:.3f}")
    print(f"{b} | " + " | ".join(cells), flush=True)
print("\nattention alone, layer 0, realistic layout (us): rows x rlen")
H, D = 16, 128
for b in (256, 128, 64, 32, 16, 8, 1):
    cells = []
    for s in (50, 250, 450):
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        rlen = torch.tensor([s], device="cuda")
        f = lambda: triton_decode_attention(q, st.pk[0], st.pv[0], st.rk[0], st.rv[0], st.grp, st.start, st.plen, rlen)
        f()
        _, tt = bench.timed(lambda: [f() for _ in range(50)])
        cells.append(f"{1e6*tt/50:.1f}")
    print(f"{b} | " + " | ".join(cells), flush=True)
try:
    from attn_variants import split_attention
    print("\nsplit-K (rows x rlen 450): engine vs splits")
    for b in (64, 32, 8):
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        rlen = torch.tensor([450], device="cuda")
        cells = []
        for sp in (2, 4, 8):
            f = lambda: split_attention(q, st.pk[0], st.pv[0], st.rk[0], st.rv[0], st.grp, st.start, st.plen, rlen, 16, 2, 2, sp)
            f(); _, tt = bench.timed(lambda: [f() for _ in range(50)])
            cells.append(f"splits {sp}: {1e6*tt/50:.1f}")
        print(f"{b} | " + "; ".join(cells), flush=True)
except Exception as e:
    print("split failed", e)
for b in (256, 32):
    st.slot.fill_(250); st.step.fill_(0)
    with torch.inference_mode():
        fast._decode_step(st, b, st.slots_cap, "sample"); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                st.slot.fill_(250); st.step.fill_(0)
                fast._decode_step(st, b, st.slots_cap, "sample")
            torch.cuda.synchronize()
    print(f"\n## eager compiled-pieces step, {b} rows, 5 steps")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60), flush=True)
