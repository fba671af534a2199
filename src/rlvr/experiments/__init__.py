"""Experiments over seeds and settings: sweeps, plots with the spread across seeds, reports.

- ``rlvr sweep SWEEP.yaml --out DIR`` (:mod:`rlvr.experiments.sweep`): a grid of named settings × seeds,
  ``DIR/<setting>/seed_<k>/``; finished runs are skipped, interrupted ones resumed.
- ``rlvr plot RUNS --out DIR`` (:mod:`rlvr.experiments.plot`): every metric over steps, the mean across
  seeds with a min/max or 95 % band and each run faint; final validation reward against lr.
- ``rlvr report SWEEP_DIR --out report.md`` (:mod:`rlvr.experiments.report`): plots, the final
  validation table (mean ± spread, best and worst seed) and sample rollouts before/after.

The library functions for your own analysis are :func:`load_runs` and :func:`aggregate`.
"""

from rlvr.experiments.runs import Aggregate, FinalSummary, Run, aggregate, final_values, group_runs, load_run, load_runs

__all__ = ["Aggregate", "FinalSummary", "Run", "aggregate", "final_values", "group_runs", "load_run", "load_runs"]
