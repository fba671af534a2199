"""The memory-lean trainer run ((f') of bench_speed.py) at several token budgets: step time, its
generate / train split, and peak memory, to set beside TRL's peak (32.1-32.6 GiB in today's runs)."""

import sys

sys.path.insert(0, "benchmarks")
from bench_speed import Bench, parse_args

args = parse_args(["--data-dir", ".gpu/gsm8k", "--skip-baselines", "--no-trl"])
bench = Bench(args)
bench.setup()
bench.ceilings()
res = {}
for budget in (8192, 10240, 12288):
    args.lean_budget = budget
    bench.trainer_step(lean=True)
    r = bench.trainer_lean
    res[budget] = r
    print(
        f"[budget {budget}] step {r['step']:.2f} s, generate {r['generate']:.2f}, train {r['train']:.2f}, "
        f"peak {r['peak_gb']:.1f} GiB; steps {[round(x['time/step'], 2) for x in bench.log['trainer_lean_rows']]}",
        flush=True,
    )
print("\nbudget | step s | generate s | train s | peak GiB")
for k, r in res.items():
    print(f"{k} | {r['step']:.2f} | {r['generate']:.2f} | {r['train']:.2f} | {r['peak_gb']:.1f}")
