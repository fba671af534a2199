"""Two GPUs for GRPO: NCCL weight sync, and seconds per step colocated vs synchronous vs one-step-async.

One run on a machine with two GPUs, at OLMo-2-0425-1B's exact size (``rlvr.modeling.OLMO2_1B``: 16
layers, hidden 2048, 16 heads, FFN 8192, vocab 100352, untied; 1.485 B parameters) with random
weights in bf16 and a byte-level BPE tokenizer trained here (on GSM8K text with ``--data-dir``,
else on synthetic word problems). The trainer (policy + fused AdamW) lives on GPU 0.

1. **Weight sync.** An ``hf-worker`` engine on GPU 1 (its own process). The full model (about 3 GB
   in bf16) is sent over NCCL in flat buckets of ``--bucket-mb`` MB, ``--sync-repeats`` times, with
   both paths: ``sync_weights`` (the synchronous one) and ``snapshot`` + ``load_snapshot`` (the one
   async rollouts use: copy on GPU 0 first, send later). Reported: transfer time (first broadcast to
   the worker's acknowledgement, after it synchronised its device), GB/s, and the probe check's
   extra time. Goal: under 100 ms.
2. **Seconds per step**, ``--steps`` measured steps after ``--warmup`` per mode, each step being
   rollouts (``--n-prompts`` r1_zero prompts x ``--group-size`` samples, temperature 1, exactly
   ``--max-new-tokens`` new tokens: the hf-fast engine ignores EOS so every mode does the same work;
   ``hf`` cannot, but random weights rarely sample it), grading, and
   one ``policy_gradient_update`` (fused AdamW, token-budget microbatches, chunked log-probs):

   (a) ``colocated``: one GPU; the engine runs in the trainer's process on the policy's weights;
   (b) ``sync``: rollouts on GPU 1, synchronous (sync, generate, then train; on-policy, no old
       log-probs);
   (c) ``async``: rollouts on GPU 1 one step ahead (``AsyncRollouts(max_staleness=1)``): GPU 1
       generates batch t+1 and scores it (old log-probs under its sampling weights) while GPU 0
       trains on batch t with PPO-clip reweighting (eps 0.2) against those old log-probs.

   With random weights rewards are all zero, so advantages are synthetic (group-normalised normal
   draws): every sequence goes through the model, as in a step where every group has signal.
3. **GPU utilisation** of each GPU during the measured steps of each mode (NVML through
   ``torch.cuda.utilization`` when ``pynvml`` is installed, else ``nvidia-smi`` polled in a thread).

A Markdown table is printed last. ``NCCL_NVLS_ENABLE=0`` is set for this process and the worker
(NVLink multicast stays off).

GPU (2 GPUs; about 3-6 minutes at the defaults, most of it start-up and graph capture):

    PYTHONPATH=src PYTHONUNBUFFERED=1 python benchmarks/bench_two_gpu.py --data-dir DIR

CPU smoke test (tiny model, gloo, both "GPUs" on the CPU): add ``--tiny``.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before torch loads NCCL; the spawned worker inherits it

import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import tyro  # noqa: E402

MODES = ("colocated", "sync", "async")


@dataclass
class BenchConfig:
    """Seconds per GRPO step on one GPU vs two (synchronous, one-step-async), and NCCL sync time."""

    data_dir: Path | None = None
    """GSM8K directory with train.jsonl (prompts and tokenizer text); without it, synthetic word problems."""
    n_prompts: int | None = None
    """Prompts per rollout batch (default 64; 4 with --tiny)."""
    group_size: int | None = None
    """Samples per prompt (default 4; 2 with --tiny)."""
    max_new_tokens: int | None = None
    """New tokens per sample, forced (default 256; 8 with --tiny)."""
    steps: int = 3
    """Measured steps per mode."""
    warmup: int = 1
    """Unmeasured steps per mode first (graph capture, optimizer state, allocator)."""
    modes: tuple[str, ...] = MODES
    """Which of colocated, sync, async to run."""
    engine: str = "hf-fast"
    """Rollout engine in both places: hf-fast (static cache, CUDA graphs) or hf."""
    max_batch_size: int = 256
    """Rows decoded together by the engine."""
    bucket_mb: float = 256.0
    """Flat-bucket size of the weight sync."""
    sync_repeats: int = 5
    """Full-model syncs timed per sync path."""
    token_budget: int | None = None
    """Padded tokens per training microbatch (default 16384; 2048 with --tiny)."""
    lr: float = 1e-6
    """AdamW learning rate (small: random weights should stay well-behaved for a few steps)."""
    tokenizer_rows: int = 2000
    """GSM8K train rows used to train the tokenizer."""
    tokenizer_vocab: int = 16000
    """Tokenizer vocabulary (the model keeps OLMo-2's 100352 rows; unused ids are masked in sampling)."""
    util_interval_s: float = 0.2
    """GPU utilisation sampling period."""
    tiny: bool = False
    """A tiny OLMo-2 on CPU in float32, the worker on CPU over gloo: checks that the script runs."""
    seed: int = 0
    """Initialisation, data and sampling seed."""
    json_out: Path | None = None
    """Also write every measurement to this JSON file."""


# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------


def load_questions(cfg: BenchConfig) -> list[tuple[str, str]]:
    """(question, ground truth) pairs: GSM8K train rows, or synthetic ones without a data dir."""
    if cfg.data_dir is not None:
        from rlvr.task.data import load_examples

        return [(e.question, e.ground_truth) for e in load_examples(str(cfg.data_dir), split="train")]
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(2000):
        a, b, c = rng.randint(2, 90), rng.randint(2, 90), rng.randint(2, 9)
        out.append(
            (
                f"Tom has {a} apples and buys {b} more bags with {c} apples each. How many apples does he have now?",
                str(a + b * c),
            )
        )
    return out


def build(cfg: BenchConfig, questions):
    from transformers import AutoModelForCausalLM, Olmo2Config

    from rlvr.modeling import OLMO2_1B, small_olmo2_config, train_tokenizer
    from rlvr.task.prompts import render

    texts = [render("r1_zero", q) for q, _ in questions[: cfg.tokenizer_rows]]
    texts += [f" </think> <answer> {gt} </answer>" for _, gt in questions[: cfg.tokenizer_rows]]
    tokenizer = train_tokenizer(texts, vocab_size=400 if cfg.tiny else cfg.tokenizer_vocab)
    if cfg.tiny:
        config = small_olmo2_config(tokenizer, hidden_size=64, num_layers=2, num_heads=4)
        devices, dtype = (torch.device("cpu"), torch.device("cpu")), torch.float32
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit(f"this benchmark needs 2 GPUs, found {torch.cuda.device_count()}; use --tiny on CPU")
        config = Olmo2Config(
            **OLMO2_1B,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
        devices, dtype = (torch.device("cuda:0"), torch.device("cuda:1")), torch.bfloat16
        torch.cuda.set_device(devices[0])
    torch.manual_seed(cfg.seed)
    with torch.device(devices[0]):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, tokenizer, devices, dtype


def cuda_sync(*devices):
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


# ---------------------------------------------------------------------------------------------
# GPU utilisation
# ---------------------------------------------------------------------------------------------


class UtilSampler:
    """Samples each GPU's utilisation (percent of time a kernel ran) in a thread until stopped."""

    def __init__(self, devices: list[int], interval_s: float):
        self.devices, self.interval_s = devices, interval_s
        self.samples: dict[int, list[float]] = {d: [] for d in devices}
        self._stop = threading.Event()
        self._thread = None
        self.source = "none"
        if not devices:
            return
        try:
            torch.cuda.utilization(devices[0])
            self._read = lambda: {d: float(torch.cuda.utilization(d)) for d in devices}
            self.source = "nvml"
        except Exception:  # noqa: BLE001 - pynvml missing or unsupported: fall back to the CLI
            self._read = self._nvidia_smi
            self.source = "nvidia-smi"

    def _nvidia_smi(self) -> dict[int, float]:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = [visible.split(",")[d].strip() for d in self.devices] if visible else [str(d) for d in self.devices]
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--id={','.join(physical)}",
                "--query-gpu=utilization.gpu",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        values = [float(x) for x in out.split()]
        return dict(zip(self.devices, values))

    def _loop(self):
        while not self._stop.is_set():
            try:
                for d, v in self._read().items():
                    self.samples[d].append(v)
            except Exception:  # noqa: BLE001 - a failed sample is dropped, not fatal
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self):
        if self.devices:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def mean(self, d: int) -> float | None:
        s = self.samples.get(d)
        return sum(s) / len(s) if s else None


# ---------------------------------------------------------------------------------------------
# 1. Weight sync
# ---------------------------------------------------------------------------------------------


def bench_sync(worker, model, cfg: BenchConfig, devices) -> dict:
    from rlvr.engines.worker import build_plan

    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    plain, snap_make, snap_send, snap_total = [], [], [], []
    for r in range(cfg.sync_repeats + 1):
        meta = worker.sync_weights(model)
        t0 = time.perf_counter()
        snap = worker.snapshot(model, version=r)
        cuda_sync(devices[0])
        t1 = time.perf_counter()
        meta2 = worker.load_snapshot(snap)
        del snap
        if r == 0:
            continue  # the first round allocates the buckets on both sides
        plain.append(meta["time/sync"])
        snap_make.append(t1 - t0)
        snap_send.append(meta2["time/sync"])
        snap_total.append(meta2["time/sync_with_probe"])
        print(
            f"  sync {r}: sync_weights {1e3 * meta['time/sync']:.1f} ms (probe diff {meta['sync/probe_max_abs_diff']:.2g}); "
            f"snapshot {1e3 * (t1 - t0):.1f} ms + load {1e3 * meta2['time/sync']:.1f} ms "
            f"(+probe {1e3 * (meta2['time/sync_with_probe'] - meta2['time/sync']):.1f} ms)",
            flush=True,
        )
    med = statistics.median
    return {
        "bytes": nbytes,
        "n_buckets": len(build_plan(model, cfg.bucket_mb)),
        "sync_weights_ms": 1e3 * med(plain),
        "sync_weights_min_ms": 1e3 * min(plain),
        "snapshot_ms": 1e3 * med(snap_make),
        "load_snapshot_ms": 1e3 * med(snap_send),
        "load_snapshot_min_ms": 1e3 * min(snap_send),
        "load_with_probe_ms": 1e3 * med(snap_total),
        "gb_per_s": nbytes / med(snap_send) / 1e9,
    }


# ---------------------------------------------------------------------------------------------
# 2. Steps
# ---------------------------------------------------------------------------------------------


class Run:
    def __init__(self, cfg: BenchConfig, model, tokenizer, questions, devices):
        from rlvr.engines.base import SamplingParams
        from rlvr.task.prompts import stop_strings

        self.cfg, self.model, self.tok, self.questions, self.devices = cfg, model, tokenizer, questions, devices
        self.P = cfg.n_prompts or (4 if cfg.tiny else 64)
        self.G = cfg.group_size or (2 if cfg.tiny else 4)
        self.T = cfg.max_new_tokens or (8 if cfg.tiny else 256)
        self.budget = cfg.token_budget or (2048 if cfg.tiny else 16384)
        self.params = lambda step: SamplingParams(
            n=self.G,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=self.T,
            stop=tuple(stop_strings("r1_zero")),
            seed=cfg.seed * 100003 + step,
            ignore_eos=True,
        )
        fused = devices[0].type == "cuda"
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused)

    def request(self, step: int):
        from rlvr.task.prompts import render

        start = ((step - 1) * self.P) % len(self.questions)
        rows = [self.questions[(start + i) % len(self.questions)] for i in range(self.P)]
        self._truths = getattr(self, "_truths", {})
        self._truths[step] = [gt for _, gt in rows for _ in range(self.G)]
        return [render("r1_zero", q) for q, _ in rows], self.params(step)

    def advantages(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 7919 + step)
        x = torch.randn(self.P, self.G, generator=g)
        x = (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-6)
        return x.flatten()

    def grade(self, step: int, responses: list[str]) -> float:
        from rlvr.grpo import compute_rollout_rewards
        from rlvr.task.grading import r1_zero_reward_fn

        _, meta = compute_rollout_rewards(r1_zero_reward_fn, responses, self._truths.pop(step))
        return meta["reward_mean"]

    def train(self, step, input_ids, labels, mask, method="none", old=None) -> float:
        from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update

        t0 = time.perf_counter()
        self.model.train()
        policy_gradient_update(
            self.model,
            self.opt,
            StepBatch(input_ids, labels, mask, self.advantages(step), old),
            UpdateSpec(1, 1.0, method, 0.2 if method == "grpo" else None, max_tokens_per_microbatch=self.budget),
        )
        self.model.eval()
        cuda_sync(self.devices[0])
        return time.perf_counter() - t0

    # -- the three modes ------------------------------------------------------------------------
    def colocated(self, steps):
        from rlvr.engines import make_engine
        from rlvr.training.tokenize import tokenize_prompt_and_output

        engine = make_engine(self.cfg.engine, self.model, self.tok, max_batch_size=self.cfg.max_batch_size)
        try:
            for step in steps:
                t0 = time.perf_counter()
                prompts, params = self.request(step)
                groups = engine.generate(prompts, params)
                cuda_sync(self.devices[0])
                t_gen = time.perf_counter() - t0
                responses = [c.text for g in groups for c in g]
                self.grade(step, responses)
                batch = tokenize_prompt_and_output([p for p in prompts for _ in range(self.G)], responses, self.tok)
                t_train = self.train(step, batch["input_ids"], batch["labels"], batch["response_mask"])
                yield {
                    "time/step": time.perf_counter() - t0,
                    "time/generate": t_gen,
                    "time/train": t_train,
                    "time/wait": t_gen,
                    "time/sync": 0.0,
                }
        finally:
            engine.close()
            del engine

    def worker_mode(self, worker, steps, staleness: int):
        from rlvr.engines.async_rollout import AsyncRollouts

        with AsyncRollouts(worker, max_staleness=staleness, old_log_probs=bool(staleness)) as rollouts:
            for step in steps:
                t0 = time.perf_counter()
                batch = rollouts.next_batch(step, self.model, self.request)
                t_wait = time.perf_counter() - t0
                self.grade(step, batch.responses)
                if staleness:
                    t_train = self.train(
                        step, batch.input_ids, batch.labels, batch.response_mask, "grpo", batch.old_log_probs
                    )
                else:
                    t_train = self.train(step, batch.input_ids, batch.labels, batch.response_mask)
                m = batch.metrics(step - 1)
                yield {
                    "time/step": time.perf_counter() - t0,
                    "time/generate": m["time/generate"],
                    "time/old_logprobs": m["time/old_logprobs"],
                    "time/train": t_train,
                    "time/wait": t_wait,
                    "time/sync": m.get("time/sync", 0.0),
                    "staleness": m["rollout/staleness"],
                    "probe_diff": m.get("sync/probe_max_abs_diff"),
                }


def run_mode(run: Run, mode: str, worker, cfg: BenchConfig) -> dict:
    n = cfg.warmup + cfg.steps
    steps = range(1, n + 1)
    if mode == "colocated":
        gen = run.colocated(steps)
    else:
        gen = run.worker_mode(worker, steps, 0 if mode == "sync" else 1)
    gpus = [d.index for d in run.devices if d.type == "cuda"]
    records = []
    sampler = UtilSampler(sorted(set(gpus)), cfg.util_interval_s)
    for i in range(n):
        if i == cfg.warmup:
            sampler.__enter__()
        rec = next(gen)
        records.append(rec)
        print(
            f"  {mode} step {i + 1}{' (warmup)' if i < cfg.warmup else ''}: "
            + ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in rec.items() if isinstance(v, float)),
            flush=True,
        )
    sampler.__exit__()
    gen.close()
    measured = records[cfg.warmup :]
    mean = lambda k: statistics.mean(r[k] for r in measured) if measured and k in measured[0] else None  # noqa: E731
    out = {k: mean(k) for k in measured[0]} if measured else {}
    out["util"] = {f"gpu{d}": sampler.mean(d) for d in sampler.devices}
    out["util_source"] = sampler.source
    out["records"] = records
    if run.devices[0].type == "cuda":
        out["peak_gb_gpu0"] = torch.cuda.max_memory_allocated(run.devices[0]) / 2**30
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def fmt(x, spec=".2f", none="n/a"):
    return none if x is None else format(x, spec)


def main(argv=None) -> int:
    cfg = tyro.cli(BenchConfig, args=argv)
    unknown = [m for m in cfg.modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    t_start = time.perf_counter()
    questions = load_questions(cfg)
    model, tok, devices, dtype = build(cfg, questions)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.1f} M parameters, {dtype}, trainer on {devices[0]}, worker on {devices[1]}; "
        f"tokenizer {len(tok)} tokens; NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}; "
        f"setup {time.perf_counter() - t_start:.1f} s",
        flush=True,
    )
    run = Run(cfg, model, tok, questions, devices)
    results: dict = {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "params": n_params,
        "host": platform.node(),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"],
    }

    worker = None
    if any(m in cfg.modes for m in ("sync", "async")):
        from rlvr.engines.worker import HFWorkerEngine

        t0 = time.perf_counter()
        worker = HFWorkerEngine(
            model,
            tok,
            device=str(devices[1]),
            dtype=dtype,
            bucket_mb=cfg.bucket_mb,
            engine=cfg.engine,
            max_batch_size=cfg.max_batch_size,
        )
        print(
            f"worker engine ({cfg.engine}, backend {worker.backend}) started in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    try:
        if worker is not None:
            print("== weight sync", flush=True)
            results["sync"] = bench_sync(worker, model, cfg, devices)
        results["modes"] = {}
        for mode in cfg.modes:
            print(f"== {mode}", flush=True)
            results["modes"][mode] = run_mode(run, mode, worker, cfg)
    finally:
        if worker is not None:
            worker.close()
    results["total_s"] = time.perf_counter() - t_start
    if cfg.json_out:
        cfg.json_out.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_out.write_text(json.dumps(results, indent=2, default=str))

    # -- the table, last -------------------------------------------------------------------------
    modes = results["modes"]
    base = modes.get("colocated", {}).get("time/step")
    size = "a tiny OLMo-2 on CPU (--tiny)" if cfg.tiny else "OLMo-2-0425-1B size, random bf16 weights"
    print(f"\n## Two GPUs: {size} ({n_params / 1e6:.1f} M params)\n")
    print(
        f"{run.P} prompts x {run.G} samples, {run.T} new tokens (forced), engine {cfg.engine}, "
        f"{cfg.steps} measured steps after {cfg.warmup} warmup; total run {results['total_s']:.0f} s; "
        f"GPUs: {', '.join(results['gpus']) or 'CPU'}; utilisation via {next(iter(modes.values()), {}).get('util_source', 'n/a')}\n"
    )
    if "sync" in results:
        s = results["sync"]
        print("| weight sync (full model) | value |\n|---|---|")
        print(f"| size | {s['bytes'] / 1e9:.2f} GB in {s['n_buckets']} buckets of <= {cfg.bucket_mb:.0f} MB |")
        print(
            f"| sync_weights (sync path), median / min | {s['sync_weights_ms']:.1f} / {s['sync_weights_min_ms']:.1f} ms |"
        )
        print(f"| snapshot on GPU 0 (async path) | {s['snapshot_ms']:.1f} ms |")
        print(
            f"| load_snapshot transfer, median / min | {s['load_snapshot_ms']:.1f} / {s['load_snapshot_min_ms']:.1f} ms "
            f"({s['gb_per_s']:.0f} GB/s) |"
        )
        print(f"| load_snapshot incl. probe check | {s['load_with_probe_ms']:.1f} ms |")
        print(f"| goal < 100 ms | {'met' if s['load_snapshot_ms'] < 100 else 'NOT met'} |\n")
    print(
        "| mode | s/step | vs colocated | generate s | train s | trainer waits s | sync ms (in step) | GPU0 util % | GPU1 util % |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, m in modes.items():
        speed = f"{base / m['time/step']:.2f}x" if base and m.get("time/step") else "n/a"
        u = m["util"]
        print(
            f"| {mode} | {fmt(m.get('time/step'))} | {speed} | {fmt(m.get('time/generate'))} | {fmt(m.get('time/train'))} | "
            f"{fmt(m.get('time/wait'))} | {fmt(1e3 * m['time/sync'] if m.get('time/sync') is not None else None, '.1f')} | "
            f"{fmt(u.get('gpu0'), '.0f')} | {fmt(u.get('gpu1'), '.0f')} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
