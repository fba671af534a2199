"""Rollouts that run ahead of the trainer: one-step-asynchronous generation on a worker engine.

With ``max_staleness=1`` the worker engine (its own process and GPU) generates the batch of step
t+1 while the trainer trains on batch t, so the two GPUs overlap instead of taking turns. The price
is that batch t+1 is sampled by the weights of one step earlier than on-policy training would use;
the trainer corrects this with importance reweighting (``noclip``, ``grpo``, ``gspo``, ``cispo``)
against the **old log-probs** that come with the batch: teacher-forced log-probs of the retokenised
prompt + response under the very weights that sampled it, computed on the worker in the same request
as the generation. ``max_staleness=0`` is ordinary synchronous training through the same API.

Versions. Weight version v is the policy after v optimizer (rollout) steps; version 0 is the initial
policy. At 1-based trainer step t the trainer holds version t-1, and

* synchronous (``max_staleness=0``): batch t is sampled by version t-1 (on-policy);
* one-step-async (``max_staleness=1``): batch t is sampled by version max(t-2, 0): batches 1 and 2
  both come from version 0, and from then on every batch is exactly one step stale.

Ordering. Every request to the worker (weight loads, rollouts, plain generations) runs on one
background thread, first in first out. ``sync(model, v)`` copies the weights *now* (a snapshot, so the
trainer may step its optimizer at once) and queues the load behind whatever is already queued or in
flight: a generation for version v-1 that is running when the trainer asks for version v finishes
with version v-1 weights, and only then is version v sent. A rollout is dispatched with the version
that its place in the queue implies; the worker reports the version it really holds (tagged only
after a load passed the probe check), and the batch is rejected unless the request id and the
version both match. Old log-probs travel in the same reply as the completions they score, so they
cannot be attached to another batch.

The engine must be a ``WorkerEngine`` (``snapshot``/``load_snapshot``/``rollout``; ``HFWorkerEngine``
is one). The in-process engines share the trainer's weights, so they cannot run ahead of it; they
get their batches through ``rlvr.engines.rollouts.SyncRollouts``, behind the same ``next_batch``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rlvr.engines.base import Completion, SamplingParams, WorkerEngine
from rlvr.engines.rollouts import RolloutBatch, RolloutRequest

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncRollouts", "QueuedEngine", "RolloutBatch", "RolloutOrderError"]


class RolloutOrderError(RuntimeError):
    """A rollout came back with a request id or weight version other than the one it was queued with."""


class AsyncRollouts:
    """Queue weight loads and rollouts on a worker engine, in order, on one background thread.

    ``max_staleness`` is how many steps rollouts may run ahead of the trainer (0: synchronous, 1:
    one-step-async). ``logprob_batch_size`` bounds the rows per forward pass of the worker's old
    log-prob computation; ``old_log_probs=False`` skips it (synchronous on-policy training without
    reweighting; batches then carry None). The caller keeps ownership of ``engine`` unless
    ``close_engine`` is set. ``request`` and ``last_step`` are the defaults of ``next_batch``'s.
    """

    def __init__(
        self,
        engine: WorkerEngine,
        max_staleness: int = 0,
        logprob_batch_size: int = 16,
        old_log_probs: bool = True,
        close_engine: bool = False,
        request: RolloutRequest | None = None,
        last_step: int | None = None,
    ):
        if not isinstance(engine, WorkerEngine):
            raise TypeError(
                f"{type(engine).__name__} cannot run rollouts ahead of the trainer (it is not a WorkerEngine: no "
                "snapshot, load_snapshot and rollout); use the hf-worker engine, which holds its own copy of the "
                "weights in its own process"
            )
        if max_staleness not in (0, 1):
            raise ValueError(f"max_staleness must be 0 (synchronous) or 1 (one-step-async), got {max_staleness}")
        self.engine = engine
        self.max_staleness = max_staleness
        self.logprob_batch_size = logprob_batch_size
        self.old_log_probs = old_log_probs
        if max_staleness and not old_log_probs:
            raise ValueError("asynchronous rollouts need old log-probs: the trainer must reweight stale samples")
        self.close_engine = close_engine
        self.request = request
        self.last_step = last_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlvr-rollouts")
        self._lock = threading.Lock()
        self._queued_version: int | None = None  # the version the next queued rollout will see
        self._sync_meta: dict[int, Future] = {}  # version -> future of its load metrics
        self._pending: dict[int, Future] = {}  # step -> future of its RolloutBatch
        self._submitted = 0  # highest step submitted by next_batch
        self._next_request = 0
        self._closed = False
        self.events: list[tuple] = []
        """What happened, in order: ``("sync_requested", version)`` from the caller, then from the
        background thread ``("sync_start"|"sync_end", version)`` and ``("rollout_start"|"rollout_end",
        step, version)``; for tests and debugging."""

    # -- the trainer's calls --------------------------------------------------------------------
    def sync(self, model: torch.nn.Module, version: int) -> Future:
        """Snapshot ``model`` as weight version ``version`` now; load it on the worker after every
        request already queued. Returns a future of the load's metrics (it raises ``WeightSyncError``
        when the probe check fails). A version already queued is not sent again; an older one is an error.
        """
        self._check_open()
        self._log("sync_requested", version)
        with self._lock:
            if self._queued_version is not None and version < self._queued_version:
                raise ValueError(
                    f"weight version {version} is older than version {self._queued_version}, already "
                    "queued; versions must not go backwards"
                )
            fut = self._sync_meta.get(version)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                return fut
            snap = self.engine.snapshot(model, version)
            fut = self._pool.submit(self._load, snap, time.perf_counter())
            self._sync_meta[version] = fut
            self._queued_version = version
            for old in [v for v in self._sync_meta if v < version]:
                if self._sync_meta[old].done():
                    del self._sync_meta[old]
        return fut

    def submit(self, step: int, prompts: list[str], params: SamplingParams) -> Future:
        """Queue step ``step``'s rollouts with the latest queued weight version."""
        self._check_open()
        with self._lock:
            if self._queued_version is None:
                raise RuntimeError("no weights queued yet: call sync(model, version) before submit")
            if step in self._pending:
                raise ValueError(f"step {step} was already submitted; collect it first")
            self._next_request += 1
            version = self._queued_version
            fut = self._pool.submit(
                self._rollout,
                step,
                self._next_request,
                version,
                list(prompts),
                params,
                self._sync_meta[version],
                time.perf_counter(),
            )
            self._pending[step] = fut
        return fut

    def collect(self, step: int, timeout: float | None = None) -> RolloutBatch:
        """Wait for step ``step``'s batch and hand it over (once). Raises whatever the worker raised."""
        with self._lock:
            fut = self._pending.pop(step, None)
        if fut is None:
            raise KeyError(f"no rollouts were submitted for step {step}")
        return fut.result(timeout)

    def next_batch(
        self, step: int, model: torch.nn.Module, request: RolloutRequest | None = None, last_step: int | None = None
    ) -> RolloutBatch:
        """The whole schedule for 1-based trainer step ``step``, whose weights are version ``step - 1``.

        Queues the load of version ``step - 1``, submits every step up to ``step + max_staleness`` not
        yet submitted (``request(s)`` gives step s's prompts and sampling parameters), and returns
        batch ``step``. Call it once per step, before training on the batch. Steps after
        ``last_step`` (the run's final step) are never submitted, so no generation is wasted at the end.
        Its ``time/rollout_wait`` is how long the caller waited here (the rest overlapped).
        """
        t0 = time.perf_counter()
        request = request or self.request
        last_step = self.last_step if last_step is None else last_step
        if request is None:
            raise TypeError("next_batch needs request(step) -> (prompts, params), here or when the rollouts were built")
        self.sync(model, step - 1)
        ahead = step + self.max_staleness
        if last_step is not None:
            ahead = min(ahead, max(last_step, step))
        for s in range(max(self._submitted + 1, step), ahead + 1):
            prompts, params = request(s)
            self.submit(s, prompts, params)
            self._submitted = s
        batch = self.collect(step)
        batch.timings["time/rollout_wait"] = time.perf_counter() - t0
        return batch

    def generate(
        self, prompts: list[str], params: SamplingParams, timeout: float | None = None
    ) -> list[list[Completion]]:
        """A plain generation (validation) queued behind the pending work, with the weights then loaded;
        ``sync`` first to evaluate the newest weights."""
        self._check_open()
        return self._pool.submit(self.engine.generate, list(prompts), params).result(timeout)

    def engine_for_eval(self, model: torch.nn.Module, version: int) -> QueuedEngine:
        """Queue the load of ``model`` as ``version`` and return an ``Engine`` whose ``generate`` runs
        through this queue (after that load): validation sees the newest weights and never races
        the rollouts for the worker."""
        return QueuedEngine(self, self.sync(model, version))

    def close(self) -> None:
        """Drop queued work, wait for the request in flight, stop the thread (and the engine if owned)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        if self.close_engine:
            self.engine.close()

    def __enter__(self) -> AsyncRollouts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the background thread ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("these rollouts are closed; build a new AsyncRollouts")

    def _log(self, *event: Any) -> None:
        self.events.append(event)

    def _load(self, snap: Any, queued_at: float) -> dict:
        start = time.perf_counter()
        self._log("sync_start", snap.version)
        try:
            meta = self.engine.load_snapshot(snap)
        finally:
            self._log("sync_end", snap.version)
        meta["time/sync_queue"] = start - queued_at
        return meta

    def _rollout(
        self,
        step: int,
        request_id: int,
        version: int,
        prompts: list[str],
        params: SamplingParams,
        load: Future,
        queued_at: float,
    ) -> RolloutBatch:
        start = time.perf_counter()
        # The load ran earlier on this same thread; if it failed, the worker holds unverified weights.
        load_meta = load.result()
        self._log("rollout_start", step, version)
        try:
            out = self.engine.rollout(prompts, params, request_id, self.logprob_batch_size, self.old_log_probs)
        finally:
            self._log("rollout_end", step, version)
        if out["request_id"] != request_id or out["version"] != version:
            raise RolloutOrderError(
                f"rollouts for step {step} were queued as request {request_id} with weight version {version}, but the "
                f"worker answered request {out['request_id']} with version {out['version']}. Something else loaded "
                "weights into the engine (e.g. engine.sync_weights) or used its pipe; while AsyncRollouts drives "
                "an engine, sync and generate only through it."
            )
        n_rows = len(prompts) * params.n
        if len(out["completions"]) != len(prompts) or out["input_ids"].shape[0] != n_rows:
            raise RolloutOrderError(
                f"the worker returned {len(out['completions'])} groups and "
                f"{out['input_ids'].shape[0]} rows for {len(prompts)} prompts x {params.n}"
            )
        return RolloutBatch(
            step=step,
            weight_version=version,
            request_id=request_id,
            prompts=prompts,
            params=params,
            completions=out["completions"],
            input_ids=out["input_ids"],
            labels=out["labels"],
            response_mask=out["response_mask"],
            old_log_probs=out["old_log_probs"],
            sync=dict(load_meta),
            timings={
                "time/generate": out["time/generate"],
                "time/old_logprobs": out["time/old_logprobs"],
                "time/queue": start - queued_at,
            },
        )


class QueuedEngine:
    """The ``Engine`` interface over an ``AsyncRollouts`` queue (for validation during async training).

    ``sync_weights`` does nothing: weights reach the worker through ``AsyncRollouts.sync``.
    ``close`` does nothing: the ``AsyncRollouts`` owns the engine's lifetime. With ``load`` (the
    future of the load this engine should see), ``generate`` first waits for it and raises its
    ``WeightSyncError``: a failed probe check must not let validation run on unverified weights.
    """

    def __init__(self, rollouts: AsyncRollouts, load: Future | None = None):
        self.rollouts = rollouts
        self.load = load

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        if self.load is not None:
            self.load.result()
        return self.rollouts.generate(prompts, params)

    def sync_weights(self, model: torch.nn.Module) -> dict:
        return {}

    def close(self) -> None:
        pass
