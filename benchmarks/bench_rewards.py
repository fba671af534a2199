"""Reward time of a step with ``reward.workers``: an I/O-bound reward (50 ms of waiting a call, as a
web service or a model server) on threads and as ``async def``, and a CPU-bound reward (about 50 ms
of Python arithmetic a call) on worker processes.

    PYTHONPATH=src python benchmarks/bench_rewards.py [--rows 64] [--tiny]

Each figure is the best of ``--repeats`` calls of ``Reward.score_batch`` on ``--rows`` rows, timed
after the workers have started (a run starts them once). The functions below are the rewards timed;
the workers load them from this file.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

WAIT_S = 0.05
CPU_ITERATIONS = 400_000


def wait_50ms(response: str, ground_truth: str, **fields) -> float:
    time.sleep(WAIT_S)
    return 1.0


async def wait_50ms_async(response: str, ground_truth: str, **fields) -> float:
    await asyncio.sleep(WAIT_S)
    return 1.0


def compute(response: str, ground_truth: str, **fields) -> float:
    total = 0
    for i in range(CPU_ITERATIONS):
        total += i * i % 7
    return float(total > 0)


def time_reward(spec: str, rows: int, repeats: int, workers: int, kind: str) -> float:
    from rlvr.task.rewards import Reward

    reward = Reward([spec], timeout_s=60, workers=workers, worker_kind=kind)
    reward.start()
    try:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            scores = reward.score_batch(["r"] * rows, ["g"] * rows, [{}] * rows)
            best = min(best, time.perf_counter() - start)
            assert all(s["reward"] == 1.0 for s in scores), scores[:2]
        return best
    finally:
        reward.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="8 rows, one repeat: checks that each part runs")
    args = parser.parse_args()
    rows, repeats = (8, 1) if args.tiny else (args.rows, args.repeats)
    here = os.path.abspath(__file__)
    cores = len(os.sched_getaffinity(0))
    print(
        f"machine: {platform.processor() or platform.machine()}, {cores} cores available, {platform.python_version()}"
    )
    print(f"\nI/O-bound reward, {WAIT_S * 1000:.0f} ms a call, {rows} rows: seconds a step")
    print(f"{'workers':>8} {'threads':>9} {'async':>9}")
    for workers in (1, 4, 16):
        threads = time_reward(f"{here}:wait_50ms", rows, repeats, workers, "thread")
        tasks = time_reward(f"{here}:wait_50ms_async", rows, repeats, workers, "thread")
        print(f"{workers:>8} {threads:>9.3f} {tasks:>9.3f}")
    baseline = time_reward(f"{here}:compute", rows, repeats, 1, "process")
    print(f"\nCPU-bound reward, {baseline / rows * 1000:.0f} ms a call, {rows} rows, worker processes: seconds a step")
    print(f"{'workers':>8} {'seconds':>9} {'speed-up':>9}")
    print(f"{1:>8} {baseline:>9.3f} {1:>9.2f}")
    for workers in sorted({2, 4, cores} - {1}):
        seconds = time_reward(f"{here}:compute", rows, repeats, workers, "process")
        print(f"{workers:>8} {seconds:>9.3f} {baseline / seconds:>9.2f}")


if __name__ == "__main__":
    main()
