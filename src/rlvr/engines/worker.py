"""The hf engine in a worker process: its own device, its own copy of the model, weights over
torch.distributed.

``HFWorkerEngine`` spawns one process (``torch.multiprocessing``, spawn start method) that builds the
model from the trainer's config on its device and runs an ``HFEngine`` there. Requests (generate,
sync, probe, plant, shutdown) travel over a pipe; weights travel over a two-rank process group of
their own (NCCL when both sides are on CUDA, gloo otherwise, staged through CPU), created from a
TCP store so the trainer's default process group, if any, is left alone.

Weights move as **flat buckets**: consecutive tensors of one dtype are concatenated into buffers of
about ``bucket_mb`` MB, each bucket is one broadcast, and the worker splits it back into its tensors
(casting to its own dtype). The plan (names, shapes, dtypes per bucket) goes over the pipe first, so
the worker checks it against its model before any collective starts: a mismatch is an error, not a
hang.

After every sync both sides compute teacher-forced log-probs of a small fixed probe batch; when they
differ by more than ``probe_tolerance`` the sync raises ``WeightSyncError``. A silently stale engine
is the most reported bug in RL frameworks; this check makes it loud. ``plant_mismatch()`` corrupts
one tensor on the worker after the next receive, so tests can prove the check fires.

For one-step-asynchronous rollouts (``rlvr.engines.async_rollout``) the engine also offers:

* ``snapshot(model, version)`` / ``load_snapshot(snap)``: copy the trainer's weights into flat
  buckets *now* (plus the trainer-side probe log-probs), send them later, while the trainer keeps
  stepping its optimizer. A verified load tags the worker with the snapshot's **weight version**;
  any receive clears the tag first, so a failed or unchecked sync leaves the worker untagged.
* ``rollout(prompts, params, request_id)``: generate, retokenise prompt + response text exactly as
  the trainer does, and compute teacher-forced log-probs of that batch with the same weights, in one
  request; the reply carries the request id and the worker's weight version.

Every request holds a lock for its whole exchange over the pipe, so callers on different threads
cannot interleave requests and replies.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlvr.engines.base import Completion, Engine, SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.hf import HFEngine, sequence_logprobs
from rlvr.training.logprobs import compute_log_probs_batched
from rlvr.training.tokenize import pad_token_id, tokenize_from_ids

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from transformers import PretrainedConfig, PreTrainedTokenizerBase

PROBE_TEXTS = (
    "User: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\n"
    "Assistant: <think> 48 / 2 = 24 and 48 + 24 = 72 </think> <answer> 72 </answer>",
    "User: Weng earns $12 an hour. How much did she earn for 50 minutes?\nAssistant: <think> 12 / 60 * 50 = 10",
)


class WeightSyncError(RuntimeError):
    """The engine's weights do not match the trainer's after a sync."""


@dataclass
class WeightSnapshot:
    """The trainer's weights at one version, ready to send: flat buckets and the probe log-probs."""

    version: int
    plan: list[dict]
    flats: list[torch.Tensor]
    probe: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_group(
    backend: str, rank: int, port: int, timeout_s: float
) -> Any:  # torch's stubs give these backends no broadcast, which they have
    """A two-rank process group (trainer 0, worker 1) that does not touch the default group."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"unknown backend {backend!r}: use 'nccl' or 'gloo'")


def _wire(t: torch.Tensor, backend: str) -> torch.Tensor:
    # gloo has no bfloat16/float16 reductions or broadcasts everywhere; moving raw 16-bit words is exact.
    if backend == "gloo" and t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters then buffers, in a fixed order; both sides build the same architecture."""
    return list(model.named_parameters()) + list(model.named_buffers())


def build_plan(model: torch.nn.Module, bucket_mb: float) -> list[dict]:
    """Group the model's tensors into buckets of one dtype and about ``bucket_mb`` MB each."""
    limit = int(bucket_mb * 2**20)
    plan: list[dict] = []
    for name, t in _named_tensors(model):
        nbytes = t.numel() * t.element_size()
        last = plan[-1] if plan else None
        if last is None or last["dtype"] != t.dtype or (last["bytes"] + nbytes > limit and last["bytes"] > 0):
            last = {"dtype": t.dtype, "bytes": 0, "tensors": []}
            plan.append(last)
        last["tensors"].append((name, tuple(t.shape), t.numel()))
        last["bytes"] += nbytes
    return plan


def probe_batch(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str] = PROBE_TEXTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe texts as a right-padded ``(input_ids, attention_mask)`` batch."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    L = max(map(len, ids))
    input_ids = torch.full((len(ids), L), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), L), dtype=torch.long)
    for r, row in enumerate(ids):
        input_ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    return input_ids, mask


def _probe(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return sequence_logprobs(model, input_ids.to(device), mask.to(device)).float().cpu()
    finally:
        model.train(was_training)


def _rollout(
    engine: Engine,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    version: int | None,
    request_id: int,
    prompts: list[str],
    params: SamplingParams,
    logprob_batch_size: int,
    score: bool = True,
) -> dict:
    """Generate, retokenise like the trainer, and score the batch with the weights that sampled it."""

    t0 = time.perf_counter()
    groups = engine.generate(prompts, params)
    t1 = time.perf_counter()
    n = params.n
    responses = [c.text for g in groups for c in g]
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    batch = tokenize_from_ids([prompt_ids[i // n] for i in range(len(responses))], output_ids, pad_token_id(tokenizer))
    old = None
    if score:
        was_training = model.training
        model.eval()
        try:
            old = (
                compute_log_probs_batched(
                    model, batch["input_ids"], batch["labels"], logprob_batch_size, positions=batch["response_mask"]
                )
                .float()
                .cpu()
            )
        finally:
            model.train(was_training)
    return {
        "request_id": request_id,
        "version": version,
        "completions": groups,
        **batch,
        "old_log_probs": old,
        "time/generate": t1 - t0,
        "time/old_logprobs": time.perf_counter() - t1,
    }


# ----------------------------------------------------------------------------------------------
# The worker process
# ----------------------------------------------------------------------------------------------


def _worker_main(
    conn: Connection,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    device: str,
    dtype: torch.dtype,
    backend: str,
    port: int,
    timeout_s: float,
    engine_options: dict,
) -> None:
    from transformers import AutoModelForCausalLM

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        engine_options = dict(engine_options)
        engine_name = engine_options.pop("engine", "hf")
        engine: Engine
        if engine_name == "hf-fast":
            engine = FastHFEngine(model, tokenizer, **engine_options)
        elif engine_name == "hf":
            engine = HFEngine(model, tokenizer, **engine_options)
        else:
            raise ValueError(f"unknown worker engine {engine_name!r}: use 'hf' or 'hf-fast'")
        group = _make_group(backend, 1, port, timeout_s)
        tensors = dict(_named_tensors(model))
        comm_device = dev if backend == "nccl" else torch.device("cpu")
        planted: str | None = None
        version: int | None = None  # the weight version of a verified load; None after any other receive
        conn.send(("ok", "ready"))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return

    while True:
        cmd, payload = conn.recv()
        try:
            if cmd == "shutdown":
                conn.send(("ok", None))
                break
            if cmd == "generate":
                prompts, params = payload
                conn.send(("ok", engine.generate(prompts, params)))
            elif cmd == "sync":
                missing = [name for b in payload for name, _, _ in b["tensors"] if name not in tensors]
                bad = [
                    (name, shape, tuple(tensors[name].shape))
                    for b in payload
                    for name, shape, _ in b["tensors"]
                    if name in tensors and tuple(tensors[name].shape) != tuple(shape)
                ]
                if missing or bad:
                    conn.send(
                        (
                            "error",
                            f"the trainer's model does not match the worker's: missing {missing[:5]}, "
                            f"shape mismatches {bad[:5]}",
                        )
                    )
                    continue
                version = None
                conn.send(("ok", "ready"))
                t0 = time.perf_counter()
                with torch.no_grad():
                    for bucket in payload:
                        total = sum(numel for _, _, numel in bucket["tensors"])
                        flat = torch.empty(total, dtype=bucket["dtype"], device=comm_device)
                        group.broadcast(_wire(flat, backend), 0).wait()
                        offset = 0
                        for name, shape, numel in bucket["tensors"]:
                            tensors[name].copy_(flat[offset : offset + numel].view(shape))
                            offset += numel
                    if planted is not None:
                        tensors[planted].mul_(2.0).add_(0.5)
                        planted = None
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                conn.send(("ok", time.perf_counter() - t0))
            elif cmd == "probe":
                input_ids, mask = payload
                conn.send(("ok", _probe(model, input_ids, mask)))
            elif cmd == "set_version":
                version = payload
                conn.send(("ok", None))
            elif cmd == "rollout":
                conn.send(("ok", _rollout(engine, model, tokenizer, version, **payload)))
            elif cmd == "plant":
                if payload not in tensors:
                    raise KeyError(f"no tensor {payload!r} in the worker's model")
                planted = payload
                conn.send(("ok", None))
            else:
                raise ValueError(f"unknown request {cmd!r}")
        except Exception:
            conn.send(("error", traceback.format_exc()))


# ----------------------------------------------------------------------------------------------
# The trainer side
# ----------------------------------------------------------------------------------------------


def _default_tolerance(trainer_dtype: torch.dtype, worker_dtype: torch.dtype | str) -> float:
    if trainer_dtype == worker_dtype == torch.float32:
        return 1e-3
    if trainer_dtype == worker_dtype:
        return 5e-2
    return 0.25


class HFWorkerEngine:
    """The hf engine in a separate process, fed the trainer's weights over torch.distributed.

    ``device`` is the worker's device (``"cpu"`` or ``"cuda:1"``); ``dtype`` its model dtype (default:
    bfloat16 on CUDA, float32 on CPU). The constructor starts the process and performs the first sync
    (with its probe check), so the engine never samples from random weights. ``engine="hf-fast"`` in
    the engine options runs ``FastHFEngine`` in the worker instead of ``HFEngine`` (syncs copy into
    the parameters in place, so its CUDA graphs stay valid).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
        bucket_mb: float = 256.0,
        probe_tolerance: float | None = None,
        backend: str | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        **engine_options: Any,
    ) -> None:
        import torch.multiprocessing as mp

        dev = torch.device(device)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        trainer_device = next(model.parameters()).device
        self.backend = backend or ("nccl" if dev.type == "cuda" and trainer_device.type == "cuda" else "gloo")
        self.comm_device = trainer_device if self.backend == "nccl" else torch.device("cpu")
        self.bucket_mb = bucket_mb
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        trainer_dtype = next(model.parameters()).dtype
        self.probe_tolerance = (
            probe_tolerance if probe_tolerance is not None else _default_tolerance(trainer_dtype, self.dtype)
        )
        self._probe_ids, self._probe_mask = probe_batch(tokenizer)
        port = _free_port()
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_worker_main,
            daemon=True,
            args=(
                child_conn,
                model.config,
                tokenizer,
                str(dev),
                self.dtype,
                self.backend,
                port,
                timeout_s,
                engine_options,
            ),
        )
        self._proc.start()
        child_conn.close()
        self._closed = False
        self._lock = threading.RLock()  # one request's exchange over the pipe at a time
        self.weight_version: int | None = None
        # The store and group handshakes happen concurrently with the worker's model build.
        self.group = _make_group(self.backend, 0, port, start_timeout_s)
        self._wait(start_timeout_s)
        self.sync_weights(model)

    # -- plumbing ------------------------------------------------------------------------------
    def _wait(self, timeout_s: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while not self._conn.poll(0.05):
            if not self._proc.is_alive():
                raise RuntimeError(
                    f"the engine worker process died (exit code {self._proc.exitcode}); see its traceback above"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine worker did not answer within {timeout_s or self.timeout_s:.0f} s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"the engine worker failed:\n{value}")
        return value

    def _call(self, cmd: str, payload: Any = None) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("this engine is closed; build a new one")
            self._conn.send((cmd, payload))
            return self._wait()

    # -- Engine ---------------------------------------------------------------------------------
    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        return self._call("generate", (list(prompts), params))

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> dict:
        """Broadcast ``model``'s weights in flat buckets, then check the probe log-probs.

        Raises ``WeightSyncError`` when the worker's probe log-probs differ from the trainer's by more
        than ``probe_tolerance``.
        """
        with self._lock:
            t0 = time.perf_counter()
            plan = build_plan(model, self.bucket_mb)
            tensors = dict(_named_tensors(model))
            self._names = list(tensors)
            self.weight_version = None
            self._call("sync", plan)  # the worker validated the plan and is waiting on the broadcasts
            for bucket in plan:
                flat = torch.cat([tensors[name].detach().reshape(-1) for name, _, _ in bucket["tensors"]])
                self.group.broadcast(_wire(flat.to(self.comm_device), self.backend), 0).wait()
            self._wait()
            elapsed = time.perf_counter() - t0
            diff = self.probe_diff(model)
        self._check_probe(diff)
        return {"time/sync": elapsed, "sync/probe_max_abs_diff": diff}

    def _check_probe(self, diff: float) -> None:
        if not diff <= self.probe_tolerance:
            raise WeightSyncError(
                f"the engine's weights do not match the trainer's after a sync: probe log-probs differ by up "
                f"to {diff:.4g} (tolerance {self.probe_tolerance:.3g}). The engine would sample from stale or "
                f"corrupt weights; check that the trainer and engine build the same architecture and dtype, "
                f"or raise probe_tolerance if the dtypes differ on purpose."
            )

    # -- deferred, versioned syncs and scored rollouts (for async_rollout) ----------------------
    @torch.no_grad()
    def snapshot(self, model: torch.nn.Module, version: int) -> WeightSnapshot:
        """Copy ``model``'s weights into flat buckets on the communication device, and its probe
        log-probs, as they are now: the model may change afterwards without affecting the snapshot.

        Costs one extra copy of the weights in memory until the snapshot is loaded and dropped.
        """
        plan = build_plan(model, self.bucket_mb)
        tensors = dict(_named_tensors(model))
        self._names = list(tensors)
        flats = [
            torch.cat([tensors[name].detach().reshape(-1) for name, _, _ in bucket["tensors"]]).to(self.comm_device)
            for bucket in plan
        ]
        probe = _probe(model, self._probe_ids, self._probe_mask)
        return WeightSnapshot(version=version, plan=plan, flats=flats, probe=probe)

    def load_snapshot(self, snap: WeightSnapshot) -> dict:
        """Send a snapshot to the worker, check its probe log-probs against the snapshot's, and on
        success tag the worker with ``snap.version``. Raises ``WeightSyncError`` on a mismatch (the
        worker then stays untagged)."""
        # May run on a background thread, whose current CUDA device is not the caller's.
        device_ctx = (
            torch.cuda.device(self.comm_device) if self.comm_device.type == "cuda" else contextlib.nullcontext()
        )
        with self._lock, device_ctx:
            t0 = time.perf_counter()
            self.weight_version = None
            self._call("sync", snap.plan)
            for flat in snap.flats:
                self.group.broadcast(_wire(flat, self.backend), 0).wait()
            self._wait()  # the worker has every byte (it synchronised its device before answering)
            elapsed = time.perf_counter() - t0
            theirs = self._call("probe", (self._probe_ids, self._probe_mask))
            diff = float((snap.probe - theirs).abs().max())
            self._check_probe(diff)
            self._call("set_version", snap.version)
            self.weight_version = snap.version
        return {
            "time/sync": elapsed,
            "sync/probe_max_abs_diff": diff,
            "time/sync_with_probe": time.perf_counter() - t0,
            "sync/bytes": snap.nbytes,
        }

    def rollout(
        self,
        prompts: list[str],
        params: SamplingParams,
        request_id: int,
        logprob_batch_size: int = 16,
        score: bool = True,
    ) -> dict:
        """Generate for ``prompts`` and score the result with the same weights, in one request.

        Returns ``request_id`` and ``version`` (the worker's weight version, None when untagged),
        ``completions`` (per prompt, ``params.n`` each), the trainer's tokenisation of the flattened
        prompt/response pairs (``input_ids``, ``labels``, ``response_mask``, as
        ``rlvr.grpo.tokenize_prompt_and_output``), ``old_log_probs`` (B, T) float32 on CPU (0 outside
        the response mask), and the worker's ``time/generate`` and ``time/old_logprobs``.
        ``score=False`` skips the log-probs (``old_log_probs`` is None): on-policy training without
        reweighting does not need them.
        """
        return self._call(
            "rollout",
            {
                "request_id": request_id,
                "prompts": list(prompts),
                "params": params,
                "logprob_batch_size": logprob_batch_size,
                "score": score,
            },
        )

    def probe_diff(self, model: torch.nn.Module) -> float:
        """Max absolute difference of the probe batch's log-probs between trainer and worker."""
        mine = _probe(model, self._probe_ids, self._probe_mask)
        theirs = self._call("probe", (self._probe_ids, self._probe_mask))
        return float((mine - theirs).abs().max())

    def plant_mismatch(self, name: str | None = None) -> str:
        """Test hook: corrupt tensor ``name`` (default: the output head) on the worker right after the
        next sync's receive, once. Returns the tensor's name."""
        if name is None:
            names = self._names
            name = next((n for n in names if n.startswith("lm_head")), names[-1])
        self._call("plant", name)
        return name

    def close(self) -> None:
        if self._closed:
            return
        # A request in flight on another thread holds the lock; after a bounded wait, stop the process.
        got = self._lock.acquire(timeout=30)
        try:
            if got and self._proc.is_alive():
                self._conn.send(("shutdown", None))
                self._wait(30)
        except Exception:
            pass
        finally:
            if got:
                self._lock.release()
            self._closed = True
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=10)
            self._conn.close()

    def __enter__(self) -> HFWorkerEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
