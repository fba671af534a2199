"""CUDA graphs of the decode step: one per key (batch bucket, sampling mode, ...), captured on first use
into one shared memory pool and replayed after; all dropped when the model's parameter tensors change."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class StepGraphs:
    def __init__(self, stats: dict):
        self.stats = stats
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self._signature: Any = None

    def __len__(self) -> int:
        return len(self._graphs)

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._graphs)

    def __getitem__(self, key: tuple) -> torch.cuda.CUDAGraph:
        return self._graphs[key]

    def get(self, key: tuple) -> torch.cuda.CUDAGraph | None:
        """The captured graph of ``key``, or None."""
        return self._graphs.get(key)

    def drop(self) -> None:
        # A memory pool must not outlive the graphs it served: capturing new graphs into the pool of
        # destroyed ones trips the caching allocator, so every drop starts a fresh pool.
        self._graphs.clear()
        self._pool = None
        self._signature = None

    def stale(self, signature: tuple) -> bool:
        """Whether graphs were captured over other parameter tensors than ``signature`` names."""
        return signature != self._signature

    def replay(
        self, key: tuple, signature: Callable[[], tuple], step: Callable[[], None], counters: tuple[torch.Tensor, ...]
    ) -> None:
        """Replay the graph of ``key``, capturing ``step`` first if there is none. ``signature()``: the
        model's parameter tensors now (asked only before a capture); ``counters``: the buffers ``step``
        advances, restored after the warm-up and the capture (which both run it)."""
        graph = self._graphs.get(key)
        if graph is None:
            now = signature()
            if self.stale(now):
                self.drop()
            graph = self._capture(step, counters)
            self._graphs[key] = graph
            self._signature = now
        graph.replay()

    def _capture(self, step: Callable[[], None], counters: tuple[torch.Tensor, ...]) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        saved = [t.clone() for t in counters]
        # The warm-up runs the step for real (it writes K/V at the current slot and one output
        # column); the counters are restored after, and the real replay rewrites the same places.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(counters, saved):
            t.copy_(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Graphs share one pool: each writes its results into the state's buffers, so nothing a graph
        # allocates is alive after its replay.
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        for t, s in zip(counters, saved):
            t.copy_(s)
        torch.cuda.synchronize()
        self.stats["graphs_captured"] += 1
        self.stats["capture_time"] += time.perf_counter() - t0
        return graph
