"""Rollout and training speed at OLMo-2-0425-1B's exact size on one GPU, against plain transformers.

One run, one Markdown table printed last. Random weights (bf16), a byte-level BPE tokenizer trained
here on GSM8K text; the vocabulary of the model stays OLMo-2's 100,352 (ids the tokenizer cannot
decode are masked out of sampling, never out of the log-probs).

1. Ceilings measured first: device-to-device copy bandwidth and an 8192^3 bf16 matmul rate. Hardware
   floors below are computed from these measured numbers (and printed next to each measurement).
2. Correctness on the GPU: the fast engine's CUDA-graph replay against its own eager step (greedy
   tokens must be identical), its greedy tokens against ``HFEngine``'s (bf16: reported as the shared
   prefix, kernels differ), and its sampled log-probs against a teacher-forced pass.
3. Forced length, 256 prompts of 128 tokens x 512 new tokens (EOS ignored), temperature 1:
   (a) ``model.generate`` with a dynamic cache (the baseline); (b) ``HFEngine``; (c) ``FastHFEngine``
   cold (compile and graph capture included) and warm, in its default configuration (``--all-variants``:
   also its attention / norm / eager-step variants).
4. A realistic rollout batch: 32 GSM8K r1_zero prompts x 8 samples, stop ``</answer>``. With random
   weights nothing stops by itself, so each row is given a length drawn uniformly in [50, 512] via
   the fast engine's per-row length caps (``row_max_new_tokens``): a row retires at its drawn length
   exactly as if it had stopped there (host checks, retiring and compaction all run as usual).
5. ``multiturn``: the continuation of multi-turn rollouts. The conversations of 4's prompts (32 x 8)
   play three turns, each row's turn forced to a length drawn uniformly in [50, 170] (4's range over
   three turns); after each turn the conversation gains a short tool result, and each later round is
   one call over all 256 conversations with one sample each and a seed per conversation, as
   ``Episodes`` sends them. Timed three ways, each warm: (a) inside ``FastHFEngine.continuing()``
   (a later round prefills only past the K/V kept of the conversation so far; per round and in total,
   with the prompt tokens prefilled and reused); (b) without it (every later round prefills the whole
   conversation); (c) one single-turn call in which each row generates its three turns' tokens at once,
   against its decode floor. Ratios (a)/(c) and (a)/(b) and the prefill saved follow.
6. Training: ``policy_gradient_update`` on 256 sequences = those prompts + responses of the drawn
   lengths, a quarter of the groups with zero advantage (skipped), bf16 weights, fused AdamW,
   length-sorted microbatches under a token budget, chunked float32 log-probs. Compared with a naive
   path: microbatches of 8 rows, one float32 logits tensor per microbatch, no zero-advantage skip.
   MFU = 6 x params x real tokens / time, against 989 TFLOP/s (datasheet dense bf16) and against
   the matmul rate measured in step 1. "Real tokens" are prompt + response tokens of the sequences
   that went through the model (no padding). A stricter MFU counts matmul parameters only (no input
   embedding) plus causal attention FLOPs.
7. The training step of 6 through ``model.compile`` (one compiled decoder-layer forward shared by
   all layers, and the fused log-prob's float32 passes compiled), compile time reported as the first
   step.
8. ``rlvr.commands.train.train`` itself, whole steps of the course's suggested configuration (32 GSM8K prompts x 8,
   r1_zero, 512 new tokens, hf-fast, token-budget microbatches, ``model.compile``), a coin reward
   standing in for the grader: generate / train / sync / reward seconds and peak memory; then the
   same configured for memory (the engine's cache freed after generating, 10,240-token microbatches,
   bf16 AdamW without float32 master weights). With a KL penalty (``algorithm.kl_coef`` 0.001, k3 in the
   loss): the same whole step and peak memory with a full bf16 copy of the initial policy as the
   reference (``trainer_step_kl_copy``), and with LoRA adapters (rank 16 on every linear layer, no
   ``model.compile``) whose reference is the policy with its adapters off (``trainer_step_kl_lora``),
   next to the same LoRA run without KL (``trainer_step_lora``).
9. TRL's ``GRPOTrainer`` without vLLM on the same model, tokenizer, prompts, batch, lengths, reward and
   sampling distribution (needs ``trl`` and ``datasets`` importable; ``--no-trl`` skips it).
10. ``families``: the forced batch of 3 on random-weight models at the exact shapes of Qwen2.5-1.5B,
   Llama-3.2-1B and Qwen3-1.7B (grouped-query attention, q/k/v biases, per-head q/k norms, llama3 rope
   scaling, tied embeddings; ``--families`` picks some), each against its own decode floor (weights
   and the key/value heads' K/V read once per step), and the sampled log-probs of a few rows against
   the model's own bf16 forward, teacher-forced.

Each section runs on its own (``section_runner.run_sections``): one that fails or runs out of GPU memory
prints its error, frees its memory and is listed with a one-line reason, and the others still run; a
section that reads another's results (``SECTIONS``: ``needs``) is skipped, with the reason, when that
one did not run to its end. Before a section starts, its GPU memory is estimated from the model's shape
and checked against ``torch.cuda.mem_get_info``: token budgets that would not fit are scaled down (the
trainer sections) or left out (the training section's second budget), and a section or family that
would not fit at all is skipped with the estimate as its reason. Sections that would start after
``--deadline-s`` are skipped. The card (name, memory, the ceilings of step 1) heads the table, which is
printed last with every section's outcome under it; the exit status is 0 unless ``--strict`` is given
and a section failed or ran out of memory.

Usage: ``PYTHONPATH=src python benchmarks/bench_speed.py --data-dir DIR [--out DIR] [--tiny] [--strict]``
(``--tiny``: a small model on CPU, a smoke test of every section; ``--smoke``: the same small model on
the GPU, part of ``make gpu-check``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import random
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch
from section_runner import (
    FAILED,
    OK,
    OOM,
    Section,
    SectionSkipped,
    available_bytes,
    card_info,
    card_line,
    memory_reason,
    one_line,
    outcome_table,
    run_sections,
    with_ceilings,
)

from rlvr.engines.base import SamplingParams
from rlvr.engines.fast import FastHFEngine
from rlvr.engines.fast.prefix import shared_start
from rlvr.engines.hf import HFEngine, sequence_logprobs
from rlvr.modeling import OLMO2_1B, build_model, tokenizer_corpus, train_tokenizer
from rlvr.task.data import load_gsm8k_jsonl
from rlvr.task.prompts import render
from rlvr.training.fused_logprobs import DEFAULT_CHUNK_TOKENS
from rlvr.training.tokenize import tokenize_from_ids
from rlvr.training.train_step import StepBatch, UpdateSpec, policy_gradient_update


def coin_reward(response: str, ground_truth: str) -> dict:
    """A fair coin per response (a stable hash), standing in for the grader: with random weights every
    graded reward is 0, every advantage is 0, and the train step would skip every sequence."""
    r = float(zlib.crc32(response.encode("utf-8")) % 2)
    return {"reward": r, "answer_reward": r, "format_reward": 0.0}


# The smallest token budget a trainer section is scaled down to when its own does not fit: a few of
# the longest rows (prompt and response) still share a microbatch.
TRAINER_MIN_BUDGET = 2048
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet

# The multiturn section's conversations: model turns each, and the message each turn is answered with,
# a calculator's result as the ``plain`` tool format writes it into a base model's text.
MULTITURN_TURNS = 3
MULTITURN_TOOL_RESULT = " <tool_response>72</tool_response>"

# The exact shapes of three models the fast engine runs besides OLMo-2 (each model's config.json on the
# Hugging Face hub: Qwen/Qwen2.5-1.5B, meta-llama/Llama-3.2-1B, Qwen/Qwen3-1.7B), for speed measurements
# with random weights: (transformers model_type, config fields).
FAMILY_MODELS = {
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            hidden_act="silu",
        ),
    ),
    "llama-3.2-1b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=True,
            attention_bias=False,
            mlp_bias=False,
            hidden_act="silu",
        ),
    ),
    "qwen3-1.7b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            attention_bias=False,
            hidden_act="silu",
        ),
    ),
}
# --tiny: the same families and traits at a size a CPU decodes in seconds (grouped-query attention kept).
TINY_FAMILY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)

# FastHFEngine settings compared (``--all-variants``): attention through the Triton kernel over the
# shared prompt cache, or by gathering each row's prompt K/V for SDPA; HF's RMSNorm modules or one
# fused F.rms_norm call each; the decode step's pieces through torch.compile or eager. The first is
# the engine's default on a GPU.
VARIANTS = (
    dict(attention="triton", fused_norms=True, compile_step=True),
    dict(attention="sdpa", fused_norms=True, compile_step=True),
    dict(attention="triton", fused_norms=True, compile_step=False),
    dict(attention="sdpa", fused_norms=False, compile_step=False),
)


def variant_name(v: dict) -> str:
    return (
        f"{v['attention']}{', fused norms' if v['fused_norms'] else ''}"
        f"{', compiled step' if v.get('compile_step') else ', eager step'}"
    )


# ---------------------------------------------------------------- 1. set-up
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True, help="folder holding GSM8K train.jsonl")
    ap.add_argument("--out", default=None, help="folder for the JSON log and the table")
    ap.add_argument("--tiny", action="store_true", help="small model on CPU: a smoke test of every section")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="--tiny's small model and batches on the GPU when there is one (the real kernels, CUDA graphs "
        "and compiled pieces run): a smoke test of every section, used by make gpu-check",
    )
    ap.add_argument("--skip-baselines", action="store_true", help="skip model.generate and HFEngine (slow)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--all-variants",
        action="store_true",
        help="time every FastHFEngine attention/norm variant (default: only the defaults, triton + fused norms)",
    )
    ap.add_argument(
        "--lean-budget",
        type=int,
        default=None,
        help="token budget of the memory-lean trainer run (default: 10,240 at full size, 1,024 with --tiny)",
    )
    ap.add_argument(
        "--shared-prefix",
        action="store_true",
        help="train the trainer sections' microbatches packed, each prompt once (optim.shared_prefix true)",
    )
    ap.add_argument(
        "--keep-head-logits",
        action="store_true",
        help="the trainer sections keep the head's logits for the backward (optim.keep_head_logits true)",
    )
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL GRPOTrainer side-by-side")
    ap.add_argument(
        "--sections",
        default=None,
        help="comma-separated subset of the sections (default: all, in this order: "
        + ", ".join(SECTIONS)
        + "; ceilings always run; a section is skipped with the reason when one it needs did not run: "
        "training needs realistic, compiled needs training)",
    )
    ap.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when a section failed or ran out of memory (default: 0, the table says why)",
    )
    ap.add_argument(
        "--families",
        default=",".join(FAMILY_MODELS),
        help=f"comma-separated models of the families section (default: all of {', '.join(FAMILY_MODELS)})",
    )
    ap.add_argument("--trl-steps", type=int, default=2, help="TRL optimizer steps (the last one is timed)")
    ap.add_argument(
        "--trainer-steps",
        type=int,
        default=4,
        help="rlvr trainer steps (model.compile: steps 3+ are averaged; 1 and 2 compile)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=570.0,
        help="skip the sections that would start after this many seconds (the table is printed anyway)",
    )
    return ap.parse_args(argv)


def probe_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every probe in ``benchmarks/probes`` takes, ``--data-dir`` and ``--tiny``; a probe
    adds its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--tiny", action="store_true")
    return ap


def probe_bench(args: argparse.Namespace) -> Bench:
    """The bench, set up with its own defaults, for a probe's ``--data-dir`` and ``--tiny``."""
    bench = Bench(parse_args(["--data-dir", args.data_dir, "--skip-baselines"] + (["--tiny"] if args.tiny else [])))
    bench.setup()
    return bench


def multiturn_agreement(a: list[dict], b: list[dict]) -> dict:
    """How far two ways of playing the same conversations agree: per round, the conversations whose tokens
    are equal through it; and over the later rounds' tokens sampled from the same context (the round's
    context equal, and the tokens before them), the differences of their log-probs, which are the
    differences of what the model computed from kept and from re-read K/V."""
    rows = len(a[0]["ids"])
    alike = [True] * rows
    same, diffs = [], []
    for t, (ra, rb) in enumerate(zip(a, b)):
        for i in range(rows):
            if not alike[i]:
                continue
            ia, ib, la, lb = ra["ids"][i], rb["ids"][i], ra["logprobs"][i], rb["logprobs"][i]
            if t > 0:
                n = shared_start(ia, ib)
                diffs += [abs(x - y) for x, y in zip(la[:n], lb[:n])]  # the tokens before they part
            alike[i] = ia == ib
        same.append(sum(alike))
    return dict(
        conversations=rows,
        same_through_round=same,
        compared_tokens=len(diffs),
        mean_abs_logprob_diff=sum(diffs) / len(diffs) if diffs else 0.0,
        max_abs_logprob_diff=max(diffs, default=0.0),
    )


class Bench:
    def __init__(self, args):
        self.args = args
        self.t_start = time.perf_counter()
        self.tiny = args.tiny or args.smoke
        self.device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.engine_name = "hf-fast" if self.device.type == "cuda" else "hf"
        self.variants = VARIANTS if args.all_variants else VARIANTS[:1]
        if self.device.type != "cuda":  # the Triton kernel needs CUDA: the CPU smoke test takes the SDPA path
            self.variants = [dict(v, attention="sdpa") for v in self.variants]
        self.rows: list[dict] = []  # the table
        self.forced_rate: dict = {}  # variant name -> (best warm time, tokens) of the forced batch
        self.log: dict = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        if self.tiny:
            self.n_prompts, self.prompt_len, self.new_tokens = 8, 16, 24
            self.rl_prompts, self.group, self.len_lo, self.len_hi = 4, 4, 4, 24
        else:
            self.n_prompts, self.prompt_len, self.new_tokens = 256, 128, 512
            self.rl_prompts, self.group, self.len_lo, self.len_hi = 32, 8, 50, 512

    def row(self, what, measured, floor="", ratio="", note=""):
        self.rows.append(dict(what=what, measured=measured, floor=floor, ratio=ratio, note=note))
        print(f"[row] {what}: {measured} | floor {floor} | {ratio} | {note}", flush=True)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def best_of(self, fn, calls: int = 3):
        """The last output and the shortest time of ``calls`` timed calls (warm calls of one engine differ by a
        few percent from process to process; the forced and realistic batches are both timed this way)."""
        times = []
        for _ in range(calls):
            out, t = self.timed(fn)
            times.append(t)
        return out, min(times), times

    def setup(self):
        examples = load_gsm8k_jsonl(Path(self.args.data_dir) / "train.jsonl")
        t0 = time.perf_counter()
        vocab = 1024 if self.tiny else 8192
        self.tok = train_tokenizer(tokenizer_corpus(examples[:2000] if self.tiny else examples), vocab_size=vocab)
        self.log["tokenizer_s"] = time.perf_counter() - t0
        self.examples = examples
        from transformers import Olmo2Config

        shape = dict(OLMO2_1B)
        if self.tiny:
            shape.update(
                hidden_size=64,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                vocab_size=len(self.tok) + 64,
            )
        config = Olmo2Config(
            **shape,
            pad_token_id=self.tok.pad_token_id,
            eos_token_id=self.tok.eos_token_id,
            bos_token_id=self.tok.bos_token_id,
        )
        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = build_model(config, seed=self.args.seed, dtype=self.dtype)
        self.model.eval()
        self.n_params, self.n_matmul = param_counts(self.model)
        self.log.update(
            model_build_s=time.perf_counter() - t0,
            n_params=self.n_params,
            vocab_tokenizer=len(self.tok),
            device=torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
            torch=torch.__version__,
        )
        import transformers

        self.log["transformers"] = transformers.__version__
        self.card = self.log["card"] = card_info(self.device)
        print(
            f"model: {self.n_params / 1e9:.3f} B params on {self.log['device']}, tokenizer {len(self.tok)} tokens",
            flush=True,
        )
        print(card_line(self.card), flush=True)

    # ------------------------------------------------------------ ceilings
    def ceilings(self):
        if self.device.type != "cuda":
            self.bw, self.mm = 50e9, 1e12  # nominal CPU figures, only so that the smoke test prints floors
            return
        self.bw, self.mm = measure_ceilings(self.timed)
        self.card = self.log["card"] = with_ceilings(self.card, self.bw, self.mm)
        self.row("copy bandwidth (D2D, read+write)", f"{self.bw / 1e12:.2f} TB/s", "", "", "measured ceiling")
        self.row("bf16 matmul 8192^3", f"{self.mm / 1e12:.0f} TFLOP/s", "", "", "measured ceiling")

    def decode_floor(self, prompt_lens: list[int], new_lens: list[int], group: int = 1, model=None) -> float:
        """Seconds to read the weights once per step and the K/V of every live row once per step (a
        group's shared prompt once while any of its ``group`` rows is live; the key/value heads' K/V under
        grouped-query attention), or to do 2 x matmul params FLOPs per token, whichever is larger (prefill
        ignored: it is compute at full rate). ``model``: default the OLMo-2 model of the other sections."""
        model = model or self.model
        size = 2 if self.dtype == torch.bfloat16 else 4
        kv_per_token = kv_bytes_per_token(model.config, size)
        n_params, n_matmul = param_counts(model)
        weight_bytes = n_params * size
        steps = max(new_lens)
        kv = sum(kv_per_token * n * (n + 1) / 2 for n in new_lens)
        kv += sum(kv_per_token * prompt_lens[i] * max(new_lens[i : i + group]) for i in range(0, len(new_lens), group))
        bytes_ = steps * weight_bytes + kv
        flops = 2 * n_matmul * sum(new_lens)
        return max(bytes_ / self.bw, flops / self.mm)

    # ------------------------------------------------------------ memory
    def memory_skip(self, need: int | None) -> str | None:
        """Why work estimated at ``need`` GPU bytes (beyond what is resident) should not start here, or
        None (always None off a GPU)."""
        return memory_reason(need, available_bytes(self.device))

    def weight_size(self) -> int:
        return 2 if self.dtype == torch.bfloat16 else 4

    @functools.cached_property
    def prompt_lengths(self) -> list[int]:
        """The r1_zero prompts of the first examples, in tokens (tokenized once, for the estimates and floors)."""
        texts = [render("r1_zero", ex.question) for ex in self.examples[:512]]
        return [len(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def prompt_slots(self) -> int:
        """The longest r1_zero prompt of the first examples, in tokens: the prompt cache the trainer's
        engine holds."""
        return max(self.prompt_lengths)

    def forced_bytes(self) -> int:
        """Section 3's estimate: the larger of the fast engine's buffers and ``model.generate``'s dynamic
        cache (its K/V, once more while ``torch.cat`` grows it)."""
        cfg, size = self.model.config, self.weight_size()
        fast = engine_bytes(cfg, self.n_prompts, self.n_prompts, self.prompt_len, self.new_tokens, size)
        dynamic = 2 * kv_bytes_per_token(cfg, size) * self.n_prompts * (self.prompt_len + self.new_tokens)
        return max(fast, 0 if self.args.skip_baselines else dynamic)

    def realistic_bytes(self) -> int:
        """Section 4's estimate: the fast engine's buffers for its rows, groups and longest prompt."""
        return engine_bytes(
            self.model.config,
            self.rl_prompts * self.group,
            self.rl_prompts,
            self.prompt_slots(),
            self.len_hi,
            self.weight_size(),
        )

    def multiturn_bytes(self) -> int:
        """Section 5's estimate: the fast engine's buffers grown to the last round (every conversation its
        own prompt: the r1_zero prompt, the earlier turns and tool results), beside the K/V that
        ``continuing`` keeps of each conversation's context."""
        cfg, size = self.model.config, self.weight_size()
        rows, turn = self.rl_prompts * self.group, self.len_hi // MULTITURN_TURNS
        tool = len(self.tok(MULTITURN_TOOL_RESULT, add_special_tokens=False)["input_ids"])
        context = self.prompt_slots() + (MULTITURN_TURNS - 1) * (turn + tool)
        kept = kv_bytes_per_token(cfg, size) * rows * (context + turn)
        return engine_bytes(cfg, rows, rows, context, self.len_hi, size) + kept

    def trainer_bytes(self, budget: int, lean: bool = False, kl: str | None = None, lora: bool = False) -> int:
        """Section 8's estimate for one configuration: the engine's buffers beside the training step's
        (the lean run frees the engine's before training, so the larger of the two), and the copy of the
        weights that a KL copy reference or LoRA (on a copy of the model) keeps."""
        cfg, size = self.model.config, self.weight_size()
        n_prompts, group, new = (2, 4, 8) if self.tiny else (32, 8, 512)
        engine = engine_bytes(cfg, n_prompts * group, n_prompts, self.prompt_slots(), new, size)
        train = training_bytes(
            cfg,
            self.n_params,
            budget,
            size=size,
            compiled=not lora,
            master_weights=not lean,
            keep_head_logits=self.args.keep_head_logits,
            trainable=0 if lora else None,
        )
        copy = self.n_params * size if (kl == "copy" or lora) else 0
        return copy + (max(engine, train) if lean and self.engine_name == "hf-fast" else engine + train)

    # ------------------------------------------------------------ prompts
    def fixed_length_prompts(self) -> list[str]:
        """Strings that tokenize to exactly ``prompt_len`` tokens: rendered r1_zero prompts, topped up with
        further questions and cut at a token boundary (kept only when they re-tokenize to that length)."""
        out, i = [], 0
        rng = random.Random(self.args.seed)
        qs = [ex.question for ex in self.examples]
        while len(out) < self.n_prompts:
            text = render("r1_zero", qs[i % len(qs)])
            while len(self.tok(text, add_special_tokens=False)["input_ids"]) < self.prompt_len:
                text += " " + rng.choice(qs)
            ids = self.tok(text, add_special_tokens=False)["input_ids"][: self.prompt_len]
            s = self.tok.decode(ids)
            if len(self.tok(s, add_special_tokens=False)["input_ids"]) == self.prompt_len:
                out.append(s)
            i += 1
        return out

    # ------------------------------------------------------------ 2. correctness on the device
    def checks(self):
        if self.device.type == "cuda":
            self.check_kernel()
        prompts = [render("r1_zero", ex.question) for ex in self.examples[:8]]
        T = 16 if self.tiny else 64
        greedy = SamplingParams(temperature=0.0, max_new_tokens=T, ignore_eos=True)
        # The same step (compiled pieces where the default uses them) without graphs: isolates the replay.
        fast = FastHFEngine(self.model, self.tok, max_batch_size=64)
        eager = FastHFEngine(
            self.model, self.tok, max_batch_size=64, use_cuda_graphs=False, compile_step=fast._step_compiled()
        ).generate(prompts, greedy)
        graphed = fast.generate(prompts, greedy)
        same = sum(a[0].token_ids == b[0].token_ids for a, b in zip(eager, graphed))
        self.row(
            "check: graph replay = eager step (greedy tokens)",
            f"{same}/{len(prompts)} rows identical",
            "",
            "",
            f"{T} tokens",
        )
        hf = HFEngine(self.model, self.tok, max_batch_size=64)
        hf.eos_ids = set()
        ref = hf.generate(prompts, greedy)

        def prefix(a, b):
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            return k

        shared = [prefix(a[0].token_ids, b[0].token_ids) for a, b in zip(graphed, ref)]
        self.row(
            "check: greedy fast vs HFEngine",
            f"shared prefix {statistics.mean(shared):.1f}/{T} tokens (min {min(shared)})",
            "",
            "",
            "bf16: different attention kernels may flip near-ties",
        )
        out = fast.generate(
            prompts[:4], SamplingParams(n=2, temperature=1.0, max_new_tokens=T, seed=1, ignore_eos=True)
        )
        worst = 0.0
        for p, group in zip(prompts, out):
            p_ids = self.tok(p, add_special_tokens=False)["input_ids"]
            for c in group:
                ids = torch.tensor([p_ids + c.token_ids], device=self.device)
                lp = sequence_logprobs(self.model, ids, torch.ones_like(ids))[0, len(p_ids) - 1 :].float().cpu()
                worst = max(worst, (lp - torch.tensor(c.logprobs)).abs().max().item())
        self.row(
            "check: sampled log-probs vs teacher-forced",
            f"max abs diff {worst:.3g}",
            "",
            "",
            "same model, different batch shapes (bf16)",
        )
        if self.device.type == "cuda":  # the SDPA (gather) path under CUDA graphs, against the kernel's tokens
            sdpa = FastHFEngine(self.model, self.tok, max_batch_size=64, attention="sdpa")
            other = sdpa.generate(prompts, greedy)
            shared = [prefix(a[0].token_ids, b[0].token_ids) for a, b in zip(graphed, other)]
            self.row(
                "check: greedy fast [sdpa gather] vs fast [triton]",
                f"shared prefix {statistics.mean(shared):.1f}/{T} tokens (min {min(shared)})",
                "",
                "",
                "bf16: the two attention kernels round differently",
            )
            sdpa.close()
        fast.close()
        self.free()

    def check_kernel(self):
        """The Triton decode attention as the engine calls it (writing the step's K/V, skipping rows flagged
        finished) against index_copy_ + the SDPA reference, on the suggested config's shapes (32 prompts of
        up to 256 slots x 8 rows, some rows retired, 300 response slots filled), bf16; once with one
        program per (row, head) and once on 16 rows with the slots split as the engine splits them."""
        from rlvr.engines.fast.kernels.decode_attention import (
            default_splits,
            reference_decode_attention,
            triton_decode_attention,
        )

        cfg = self.model.config
        H, D, G, n = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, 32, 8
        g = torch.Generator(device="cuda").manual_seed(0)
        r = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(self.dtype)  # noqa: E731
        pk, pv, rk, rv = r(G, H, 256, D), r(G, H, 256, D), r(G * n, H, 512, D), r(G * n, H, 512, D)
        alive = torch.tensor([i for i in range(G * n) if i % 7], device="cuda")
        rk, rv = rk[alive], rv[alive]
        b = len(alive)
        grp = alive // n
        start = torch.randint(0, 100, (G,), device="cuda", generator=g)[grp]
        plen, rlen = torch.tensor([230], device="cuda"), torch.tensor([300], device="cuda")
        q, kn, vn = (r(b, 1, H, D).transpose(1, 2) for _ in range(3))
        live = (torch.arange(b, device="cuda") % 5 != 2).to(torch.int32)
        ref_k, ref_v = rk.clone(), rv.clone()
        ref_k.index_copy_(2, rlen - 1, kn)
        ref_v.index_copy_(2, rlen - 1, vn)
        ref = reference_decode_attention(q, pk, pv, ref_k, ref_v, grp, start, plen, rlen, 256, 512, live=live).float()
        errs, cache_ok = [], True
        for rows in (b, 16):
            k2, v2 = rk.clone(), rv.clone()
            out = triton_decode_attention(
                q[:rows],
                pk,
                pv,
                k2,
                v2,
                grp,
                start,
                plen,
                rlen,
                k_new=kn[:rows],
                v_new=vn[:rows],
                live=live,
                splits=default_splits(rows, H),
            )
            errs.append((out.float() - ref[:rows]).abs().max().item())
            cache_ok &= torch.equal(k2[:rows], ref_k[:rows]) and torch.equal(v2[:rows], ref_v[:rows])
        self.row(
            "check: Triton decode attention vs index_copy_ + SDPA reference",
            f"max abs diff {errs[0]:.3g} ({b} rows), {errs[1]:.3g} (16 rows, {default_splits(16, H)} splits); "
            f"cache {'identical' if cache_ok else 'DIFFERS'}",
            "",
            "",
            "every 5th row flagged finished (0); bf16 outputs (one bf16 ulp at 1 is 0.0078)",
        )

    # ------------------------------------------------------------ 3. forced length
    def forced_length(self):
        prompts = self.fixed_length_prompts()
        P, T = len(prompts), self.new_tokens
        floor = self.decode_floor([self.prompt_len] * P, [T] * P)
        tokens = P * T
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=T, seed=0, ignore_eos=True)
        base_t = None
        if not self.args.skip_baselines:
            enc = self.tok(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
            ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

            def plain():
                with torch.inference_mode():
                    return self.model.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        do_sample=True,
                        temperature=1.0,
                        top_p=1.0,
                        top_k=0,
                        max_new_tokens=T,
                        min_new_tokens=T,
                        pad_token_id=self.tok.pad_token_id,
                    )

            out, base_t = self.timed(plain)
            assert out.shape[1] - ids.shape[1] == T
            del out
            self.row(
                f"(a) model.generate {P}x{self.prompt_len}+{T} forced, dynamic cache",
                f"{base_t:.2f} s ({tokens / base_t:,.0f} tok/s)",
                f"{floor:.2f} s",
                "1.0x",
                "baseline",
            )
            self.free()
            hf = HFEngine(self.model, self.tok, max_batch_size=P)
            hf.eos_ids = set()  # forced length: HFEngine has no ignore_eos, so it gets no EOS to stop at
            _, t = self.timed(lambda: hf.generate(prompts, params))
            self.row(
                "(b) HFEngine, same batch",
                f"{t:.2f} s ({tokens / t:,.0f} tok/s)",
                f"{floor:.2f} s",
                f"{base_t / t:.1f}x",
                "own decode loop, dynamic cache",
            )
            del hf
            self.free()
        self.forced_prompts = prompts
        for variant in self.variants:
            fast = FastHFEngine(self.model, self.tok, max_batch_size=P, **variant)
            _, cold = self.timed(lambda: fast.generate(prompts, params))
            cap = fast.stats["capture_time"]
            out, warm, warm_all = self.best_of(lambda: fast.generate(prompts, params))
            assert all(len(c.token_ids) == T for g in out for c in g)
            ratio = f"{base_t / warm:.1f}x" if base_t else ""
            name = variant_name(variant)
            self.row(
                f"(c) FastHFEngine [{name}], same batch, warm",
                f"{warm:.2f} s ({tokens / warm:,.0f} tok/s)",
                f"{floor:.2f} s",
                ratio,
                f"goal <= 6 s; {warm / floor:.1f}x the floor; best of 3 warm calls "
                f"({', '.join(f'{x:.2f}' for x in warm_all)} s); cold (first call) {cold:.2f} s, "
                f"{fast.stats['graphs_captured']} graphs captured in {cap:.1f} s",
            )
            self.log[f"fast_stats_forced[{name}]"] = dict(fast.stats)
            self.forced_rate[name] = (warm, tokens)
            fast.close()
            del fast, out
            self.free()

    # ------------------------------------------------------------ 4. realistic batch
    def realistic(self):
        prompts, params, lens = self.realistic_batch()
        for variant in self.variants:
            self.realistic_one(prompts, params, lens, variant)
        self.generate_against_realistic()

    def realistic_batch(self) -> tuple[list[str], SamplingParams, list[list[int]]]:
        """Section (d)'s prompts, sampling settings and per-row response lengths."""
        rng = random.Random(self.args.seed + 1)
        exs = rng.sample(self.examples, self.rl_prompts)
        prompts = [render("r1_zero", ex.question) for ex in exs]
        lens = [[rng.randint(self.len_lo, self.len_hi) for _ in range(self.group)] for _ in prompts]
        params = SamplingParams(
            n=self.group,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=self.len_hi,
            stop=("</answer>",),
            seed=2,
            ignore_eos=True,
        )
        return prompts, params, lens

    def realistic_one(self, prompts, params, lens, variant):
        fast = FastHFEngine(self.model, self.tok, max_batch_size=self.rl_prompts * self.group, **variant)
        before = dict(fast.stats)
        fast.generate(prompts, params, row_max_new_tokens=lens)  # captures the graphs of smaller buckets
        cold_graphs = fast.stats["graphs_captured"] - before["graphs_captured"]
        syncs0, comp0, casc0 = fast.stats["host_syncs"], fast.stats["compactions"], fast.stats["cascade_steps"]
        out, t, t_all = self.best_of(lambda: fast.generate(prompts, params, row_max_new_tokens=lens))
        calls = len(t_all)
        real = sum(len(c.token_ids) for g in out for c in g)
        p_lens = [len(self.tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        floor = self.decode_floor(
            [p for p in p_lens for _ in range(self.group)], [x for row in lens for x in row], self.group
        )
        stopped = sum(c.finish_reason == "stop" for g in out for c in g)
        self.row(
            f"(d) realistic [{variant_name(variant)}]: {self.rl_prompts} r1_zero prompts x {self.group}, "
            f"lengths U[{self.len_lo},{self.len_hi}]",
            f"{t:.2f} s ({real / t:,.0f} real tok/s)",
            f"{floor:.2f} s",
            "",
            f"best of {calls} warm calls ({', '.join(f'{x:.2f}' for x in t_all)} s); "
            f"{real} tokens, mean prompt {statistics.mean(p_lens):.0f} tok; per call "
            f"{(fast.stats['compactions'] - comp0) // calls} compactions, {(fast.stats['host_syncs'] - syncs0) // calls} "
            f"host checks, {(fast.stats['cascade_steps'] - casc0) // calls} steps with cascade attention; "
            f"{cold_graphs} extra graphs on first call; {stopped} rows hit </answer> by chance",
        )
        self.log[f"fast_stats_realistic[{variant_name(variant)}]"] = dict(fast.stats)
        forced = self.forced_rate.get(variant_name(variant))
        if forced:
            f_time, f_tokens = forced
            target = f_time * real / f_tokens
            self.row(
                f"(d') realistic [{variant_name(variant)}] against the forced batch in proportion to real tokens",
                f"{t / target:.3f}x the proportional time",
                "",
                "",
                f"goal <= 1: {t:.3f} s against {f_time:.3f} s x {real:,} / {f_tokens:,} = {target:.3f} s "
                f"({'met' if t <= target else 'not met'})",
            )
        if t < getattr(self, "rollout_time", float("inf")):
            rows = sum(len(g) for g in out)
            self.rollout_time, self.rollout_rate, self.rollout_mean_length = t, t / real, real / rows
        self.rl = dict(
            prompts=prompts,
            p_ids=[self.tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
            out=out,
            lens=lens,
        )
        fast.close()
        del fast, out
        self.free()

    # ------------------------------------------------------------ 5. multi-turn continuation
    def multiturn(self):
        prompts, params, lens, seeds = self.multiturn_batch()
        fast = FastHFEngine(self.model, self.tok, max_batch_size=self.rl_prompts * self.group, **self.variants[0])

        def conversations(continuing: bool) -> list[dict]:
            with fast.continuing() if continuing else contextlib.nullcontext() as store:
                return self.multiturn_rounds(fast, prompts, params, lens, seeds, store)

        # Each way: a cold call (graphs of new buckets, buffers grown), then the best of warm calls by
        # their total; ``continuing`` is entered afresh for each call, so each starts with nothing kept.
        warm_calls = 1 if self.tiny else 3  # the smoke test checks that each way runs, not its speed
        ways = {}
        for name, continuing in (("continuing", True), ("without", False)):
            conversations(continuing)
            calls = [conversations(continuing) for _ in range(warm_calls)]
            best = min(calls, key=lambda rounds: sum(r["seconds"] for r in rounds))
            ways[name] = dict(best=best, calls=calls)
        agreement = multiturn_agreement(ways["continuing"]["best"], ways["without"]["best"])
        for way in ways.values():
            for rounds in way["calls"]:
                for r in rounds:
                    del r["ids"], r["logprobs"]
        # The same new tokens in one turn: each row generates its turns' lengths at once.
        sums = [[sum(turn[i][j] for turn in lens) for j in range(self.group)] for i in range(len(prompts))]
        single = functools.partial(fast.generate, prompts, params, row_max_new_tokens=sums)
        single()
        out, single_s, single_all = self.best_of(single, warm_calls)
        single_tokens = sum(len(c.token_ids) for g in out for c in g)
        p_lens = [len(ids) for ids in self.tok(prompts, add_special_tokens=False)["input_ids"]]
        floor = self.decode_floor(
            [p for p in p_lens for _ in range(self.group)], [x for row in sums for x in row], self.group
        )
        self.log["multiturn"] = dict(
            turn_lengths=lens,
            tool_result=MULTITURN_TOOL_RESULT,
            ways=ways,
            single_turn=dict(seconds=single_all, tokens=single_tokens, floor_s=floor),
            agreement=agreement,
            fast_stats=dict(fast.stats),
        )
        fast.close()
        del fast, out
        self.free()
        self.multiturn_rows(ways, single_s, single_all, single_tokens, floor, agreement)

    def multiturn_batch(self) -> tuple[list[str], SamplingParams, list[list[list[int]]], list[tuple[int, ...]]]:
        """The realistic batch's prompts and sampling settings; each turn's lengths (``lens[t][i][j]``:
        turn t of sample j of prompt i, uniform in the realistic range split over the turns); and each
        later round's seeds, one per conversation (prompt-major, as ``Episodes`` orders them)."""
        prompts, params, _ = self.realistic_batch()
        rng = random.Random(self.args.seed + 3)
        turn_hi = self.len_hi // MULTITURN_TURNS
        lens = [
            [[rng.randint(self.len_lo, turn_hi) for _ in range(self.group)] for _ in prompts]
            for _ in range(MULTITURN_TURNS)
        ]
        rows = len(prompts) * self.group
        seeds = [tuple(rng.getrandbits(62) for _ in range(rows)) for _ in range(MULTITURN_TURNS - 1)]
        return prompts, params, lens, seeds

    def multiturn_rounds(self, fast, prompts, params, lens, seeds, store=None) -> list[dict]:
        """Every conversation's turns, one engine call per round as ``Episodes._play`` makes them: a later
        round's context is the prompt and every earlier piece's text. Per round: seconds, new tokens, the
        prompt tokens the engine prefilled and reused, the tokens ``store`` (``continuing``'s) keeps after it, and
        (``ids`` and ``logprobs``, left out of the log) every conversation's sampled tokens and their log-probs."""
        pieces = [[p] for p in prompts for _ in range(params.n)]
        rounds = []
        for t, turn_lens in enumerate(lens):
            before = dict(fast.stats)
            if t == 0:
                call = functools.partial(fast.generate, prompts, params, row_max_new_tokens=turn_lens)
            else:
                turn = dataclasses.replace(params, n=1, seed=params.seed + t, prompt_seeds=seeds[t - 1])
                caps = [[x] for row in turn_lens for x in row]
                call = functools.partial(fast.generate, ["".join(p) for p in pieces], turn, row_max_new_tokens=caps)
            out, seconds = self.timed(call)
            completions = [c for group in out for c in group]
            for p, c in zip(pieces, completions, strict=True):
                p += [c.text, MULTITURN_TOOL_RESULT]
            rounds.append(
                dict(
                    seconds=seconds,
                    tokens=sum(len(c.token_ids) for c in completions),
                    prefilled=fast.stats["prefilled_tokens"] - before["prefilled_tokens"],
                    reused=fast.stats["reused_tokens"] - before["reused_tokens"],
                    kept=store.tokens if store is not None else 0,
                    ids=[tuple(c.token_ids) for c in completions],
                    logprobs=[c.logprobs for c in completions],
                )
            )
        return rounds

    def multiturn_rows(self, ways, single_s, single_all, single_tokens, floor, agreement):
        turn_lo, turn_hi = self.len_lo, self.len_hi // MULTITURN_TURNS
        what = f"{self.rl_prompts} r1_zero prompts x {self.group}, {MULTITURN_TURNS} turns U[{turn_lo},{turn_hi}] each"
        later = f"rounds 2-{MULTITURN_TURNS}"

        def total(rounds):
            return sum(r["seconds"] for r in rounds)

        def of_later(rounds, key):
            return sum(r[key] for r in rounds[1:])

        def per_round(rounds):
            return " + ".join(f"{r['seconds']:.3f}" for r in rounds)

        def calls(name):
            times = ", ".join(f"{total(c):.2f}" for c in ways[name]["calls"])
            return f"best of {len(ways[name]['calls'])} warm calls ({times} s)"

        a, b = ways["continuing"]["best"], ways["without"]["best"]
        a_tokens, b_tokens = sum(r["tokens"] for r in a), sum(r["tokens"] for r in b)
        self.row(
            f"(mt-a) multi-turn in continuing(): {what}, a tool result after each",
            f"{total(a):.2f} s ({a_tokens / total(a):,.0f} new tok/s)",
            "",
            "",
            f"{calls('continuing')}; {a_tokens} new tokens; {later}: {of_later(a, 'prefilled'):,} prompt tokens "
            f"prefilled, {of_later(a, 'reused'):,} reused; {a[-1]['kept']:,} tokens of K/V kept at the end",
        )
        for t, r in enumerate(a, 1):
            self.row(
                f"(mt-a) round {t}" + (f" ({self.rl_prompts} prompts x {self.group})" if t == 1 else ", 1 sample each"),
                f"{r['seconds']:.3f} s",
                "",
                "",
                f"{r['tokens']} new tokens; {r['prefilled']:,} prompt tokens prefilled, {r['reused']:,} reused",
            )
        self.row(
            f"(mt-b) multi-turn without continuing(): the same {MULTITURN_TURNS} rounds",
            f"{total(b):.2f} s ({b_tokens / total(b):,.0f} new tok/s)",
            "",
            "",
            f"{calls('without')}; rounds {per_round(b)} s; {b_tokens} new tokens; "
            f"{later}: {of_later(b, 'prefilled'):,} prompt tokens prefilled",
        )
        rows, same = agreement["conversations"], agreement["same_through_round"]
        self.row(
            "(mt) continuing against without: the same tokens, same seeds",
            " / ".join(f"{x}/{rows}" for x in same),
            "",
            "",
            f"conversations whose tokens in (a) equal (b)'s through round 1, 2, ... (a tie the prefill's rounding "
            f"tips sends a conversation apart for good); over {agreement['compared_tokens']:,} tokens sampled from "
            f"the same context in rounds 2-{MULTITURN_TURNS} before the two ways part, their log-probs differ by "
            f"{agreement['mean_abs_logprob_diff']:.2g} on average, {agreement['max_abs_logprob_diff']:.2g} at most",
        )
        self.row(
            f"(mt-c) single turn: the same rows, each its {MULTITURN_TURNS} turns' lengths in one call",
            f"{single_s:.2f} s ({single_tokens / single_s:,.0f} new tok/s)",
            f"{floor:.2f} s",
            "",
            f"best of {len(single_all)} warm calls ({', '.join(f'{x:.2f}' for x in single_all)} s); "
            f"{single_tokens} new tokens, no tool results",
        )
        saved = of_later(b, "prefilled") - of_later(a, "prefilled")
        self.row(
            "(mt) continuing against single turn, (a) / (c)",
            f"{total(a) / single_s:.2f}x",
            "",
            "",
            f"{total(a):.2f} s against {single_s:.2f} s",
        )
        self.row(
            "(mt) continuing against without, (a) / (b)",
            f"{total(a) / total(b):.2f}x",
            "",
            "",
            f"{total(a):.2f} s against {total(b):.2f} s",
        )
        self.row(
            f"(mt) prefill saved by continuing(), {later}",
            f"{saved:,} prompt tokens ({saved / max(1, of_later(b, 'prefilled')):.0%})",
            "",
            "",
            f"prefilled {of_later(a, 'prefilled'):,} in (a) against {of_later(b, 'prefilled'):,} in (b)",
        )

    # ------------------------------------------------------------ 6. training
    def training_batch(self):
        rng = random.Random(self.args.seed + 2)
        p_ids, lens = self.rl["p_ids"], self.rl["lens"]
        vocab = len(self.tok)
        prompt_rows, resp_rows, adv = [], [], []
        for i, ids in enumerate(p_ids):
            zero = i % 4 == 0  # a quarter of the groups all-correct or all-wrong: advantage 0
            for j in range(self.group):
                prompt_rows.append(ids)
                resp_rows.append([rng.randrange(3, vocab) for _ in range(lens[i][j])])
                adv.append(0.0 if zero else rng.gauss(0, 1))
        batch = tokenize_from_ids(prompt_rows, resp_rows, self.tok.pad_token_id)
        return batch, torch.tensor(adv)

    def train_case(self, name, batch, adv, steps=None, **kw):
        """Median seconds of ``policy_gradient_update`` over the steps after the first (which allocates
        the optimizer state, warms the kernels and, compiled, compiles); one table row."""
        model = self.model
        model.train()
        fused = self.device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=fused)
        times, meta = [], None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        steps = steps or (2 if self.tiny else 4)
        backbone = kw.pop("backbone", None)
        spec = UpdateSpec(max_grad_norm=1.0, **kw)
        step_batch = StepBatch(batch["input_ids"], batch["labels"], batch["response_mask"], adv)
        first = None
        try:
            for k in range(steps):
                (loss, meta), t = self.timed(
                    lambda: policy_gradient_update(model, opt, step_batch, spec, backbone=backbone)
                )
                if k == 0:
                    first = t
                else:
                    times.append(t)
        finally:  # a step that raised (out of memory) leaves the model as the next case expects it
            del opt
            model.zero_grad(set_to_none=True)
            model.eval()
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else float("nan")
        t = statistics.median(times)
        mask = batch["response_mask"]
        keep = (adv != 0) if kw.get("skip_zero_advantage", True) else torch.ones_like(adv, dtype=torch.bool)
        last = mask.long().cumsum(1).argmax(1) + 1  # prompt + response tokens of each row (labels side)
        real = int(last[keep].sum())  # positions that go through the model
        flops = 6 * self.n_params * real
        # Stricter count: matmul parameters only (no input-embedding lookup) plus causal attention
        # (QK^T and PV: 2 x 2 x T^2/2 x hidden per layer forward, x3 with backward) on each row's length.
        cfg = self.model.config
        attn = 6 * cfg.num_hidden_layers * cfg.hidden_size * int((last[keep].double() ** 2).sum())
        strict = 6 * self.n_matmul * real + attn
        mfu, mfu_meas, mfu_strict = flops / t / PEAK_BF16, flops / t / self.mm, strict / t / PEAK_BF16
        self.row(
            f"(e) train step: {name}",
            f"{t:.2f} s/step, peak {peak:.1f} GiB",
            f"{flops / self.mm:.2f} s",
            "",
            f"MFU {100 * mfu_meas:.0f}% of the measured matmul rate (the speed goals' convention: 790 TF), "
            f"{100 * mfu:.0f}% of 989 TF datasheet, stricter count {100 * mfu_strict:.0f}% of 989; "
            f"{real:,} real tokens, {meta['n_microbatches']} microbatches; "
            f"first step {first:.1f} s",
        )
        self.log.setdefault("train_cases", {})[name] = dict(
            t=t,
            first=first,
            peak_gb=peak,
            real_tokens=real,
            mfu=mfu,
            mfu_strict=mfu_strict,
            n_microbatches=meta["n_microbatches"],
        )
        self.free()
        return t

    def train_case_within_memory(self, name, need, batch, adv, **kw) -> float | str:
        """``train_case``'s seconds, or the reason it did not run (its estimate ``need`` above the free
        memory) or did not finish (out of memory: its memory is freed, the section goes on), also a row."""
        why = self.memory_skip(need)
        if why is None:
            try:
                return self.train_case(name, batch, adv, **kw)
            except torch.OutOfMemoryError as e:
                why = f"out of memory: {one_line(e)}"
        self.free()  # outside the except clause, where the failed step's tensors are no longer referenced
        self.row(f"(e) train step: {name} SKIPPED", why)
        return why

    def training(self):
        batch, adv = self.training_batch()
        self.train_batch = (batch, adv)
        B = batch["input_ids"].shape[0]
        budgets = (1024, 2048) if self.tiny else (16384, 32768)
        best, reasons = None, []
        for budget in budgets:
            need = training_bytes(self.model.config, self.n_params, budget, size=self.weight_size())
            t = self.train_case_within_memory(
                f"rlvr: {B} seqs, token budget {budget:,}, chunked log-probs, zero-adv skip, eager",
                need,
                batch,
                adv,
                gradient_accumulation_steps=1,
                max_tokens_per_microbatch=budget,
            )
            if isinstance(t, str):
                reasons.append(f"{budget:,}: {t}")
            elif best is None or t < best[0]:
                best = (t, budget)
        if best is None:
            why = f"no token budget fit ({'; '.join(reasons)})"
            if any("out of memory" in r for r in reasons):
                raise torch.OutOfMemoryError(why)
            raise SectionSkipped(why)
        self.train_time, self.best_budget = best
        t_naive = self.train_case_within_memory(
            "naive: microbatch 8, full float32 logits, no skip",
            None,
            batch,
            adv,
            gradient_accumulation_steps=B // 8,
            chunk_tokens=10**9,
            skip_zero_advantage=False,
        )
        if not isinstance(t_naive, str):
            self.row(
                "(e') train speed-up over naive",
                f"{t_naive / self.train_time:.2f}x",
                "",
                "",
                f"best eager budget ({self.best_budget:,} tokens)",
            )
        step = self.rollout_time + self.train_time
        self.row(
            "GRPO step (realistic rollout + train, in-process, sync 0 s)",
            f"{step:.2f} s",
            "",
            "",
            "goal <= 10 s; rewards/tokenisation not included",
        )

    def compiled_bytes(self) -> int:
        """Section 7's estimate: the training step through ``model.compile`` at the best eager budget."""
        return training_bytes(
            self.model.config, self.n_params, self.best_budget, size=self.weight_size(), compiled=True
        )

    def compiled(self):
        """The training step through ``torch.compile(model.base_model, dynamic=True)`` (``model.compile``)."""
        from rlvr.training.logprobs import compile_backbone

        batch, adv = self.train_batch
        B = batch["input_ids"].shape[0]
        backbone = compile_backbone(self.model)
        t = self.train_case(
            f"rlvr: {B} seqs, token budget {self.best_budget:,}, torch.compile (model.compile)",
            batch,
            adv,
            steps=3 if self.tiny else 4,
            gradient_accumulation_steps=1,
            max_tokens_per_microbatch=self.best_budget,
            backbone=backbone,
        )
        self.row("(e'') compiled vs eager, same budget", f"{self.train_time / t:.2f}x", "", "", "")
        del backbone
        self.free()

    # ------------------------------------------------------------ 8. the trainer, whole steps
    def trainer_step(self, lean: bool = False, kl: str | None = None, lora: bool = False):
        """``rlvr.commands.train.train`` with the course's suggested configuration: 32 GSM8K prompts x 8 (r1_zero),
        512 new tokens, lr 1e-5, the hf-fast engine on the policy's GPU; microbatches under a token budget
        (gradient accumulation 1). A coin stands in for the grader (random weights earn 0 everywhere,
        and the zero-advantage skip would then make training free).

        ``lean``: the same run configured for memory, to set beside TRL's peak: the engine frees its cache
        after every generation (``engine.fast.release_memory``), microbatches of 10,240 tokens (the largest
        budget whose training peak stayed below the generation's, docs/benchmarks_history.md), and AdamW steps
        the bfloat16 weights without float32 master copies (``optim.master_weights: false``, as TRL's bf16
        runs step).

        ``kl``: with ``algorithm.kl_coef`` 0.001 (k3, in the loss) and its reference, ``copy`` (a frozen bf16
        copy of the initial policy) or ``lora`` (the policy with its adapters off); ``lora`` (implied by
        ``kl="lora"``): LoRA adapters of rank 16 on every linear layer, on a copy of the model, without
        ``model.compile`` (which does not run LoRA models)."""
        import copy
        import tempfile

        from rlvr.commands.train import train
        from rlvr.config import (
            AlgorithmConfig,
            DataConfig,
            EngineConfig,
            FastEngineConfig,
            LogConfig,
            LoraConfig,
            ModelConfig,
            OptimConfig,
            RolloutConfig,
            TrainConfig,
        )
        from rlvr.training.metrics_log import read_metrics

        n_prompts, group, new = (2, 4, 8) if self.tiny else (32, 8, 512)
        budget = 2048 if self.tiny else 16384  # leaves room for the engine's static KV cache beside training
        engine_rows = n_prompts * group
        if lean:
            budget = self.args.lean_budget or (1024 if self.tiny else 10240)
        budget, scaled = self.trainer_budget(budget, lean=lean, kl=kl, lora=lora)
        config = TrainConfig(
            data=DataConfig(train_source=str(Path(self.args.data_dir)), train_size=6400, val_size=0),
            prompt="r1_zero",
            rollout=RolloutConfig(n_prompts_per_rollout_batch=n_prompts, group_size=group, max_new_tokens=new),
            optim=OptimConfig(
                lr=1e-5,
                gradient_accumulation_steps=1,
                max_tokens_per_microbatch=budget,
                master_weights=not lean,
                shared_prefix=self.args.shared_prefix,
                keep_head_logits=self.args.keep_head_logits,
            ),
            algorithm=AlgorithmConfig(kl_coef=0.001 if kl else 0.0),
            model=ModelConfig(
                compile=not lora,
                lora=LoraConfig(rank=16, alpha=32, target_modules=("all-linear",)) if lora else LoraConfig(),
            ),
            engine=EngineConfig(
                name=self.engine_name,
                max_batch_size=engine_rows,
                fast=FastEngineConfig(release_memory=lean and self.engine_name == "hf-fast"),
            ),
            log=LogConfig(progress=False, engine_logprob_check_every=0, val_samples=0),
            n_steps=self.args.trainer_steps,
            eval_every=0,
            eval_at_start=False,
            dump_every=0,
            save_every=0,
            save_at_end=False,  # a final checkpoint (float32 master weights and AdamW moments) is deleted unread
            policy_device=str(self.device),
            seed=self.args.seed,
        )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # peft adds its adapters to the model it is given: a copy keeps the other sections' model plain.
        model = copy.deepcopy(self.model) if lora else self.model
        # The run's folder holds its metrics and summary: gone once the metrics are read.
        with tempfile.TemporaryDirectory(prefix="bench_trainer_") as out:
            train(config, Path(out), model=model, tokenizer=self.tok, reward_fn=coin_reward)
            rows = [r for r in read_metrics(Path(out) / "metrics.jsonl") if r.get("step", 0) > 0]
        del model
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else float("nan")
        # Step 1 compiles the training graphs; a microbatch under inductor's size threshold recompiles
        # once more (usually in step 2). Steps 3+ are the steady state.
        first_steady = 2 if len(rows) >= 3 else (1 if len(rows) == 2 else 0)
        later = rows[first_steady:]
        mean = lambda k: statistics.mean(r.get(k, 0.0) or 0.0 for r in later)  # noqa: E731
        result = dict(
            step=mean("time/step"),
            generate=mean("time/generate"),
            train=mean("time/train"),
            tokenize=mean("time/tokenize"),
            sync=mean("time/sync"),
            reward=mean("time/reward"),
            peak_gb=peak,
            response_length=mean("train/response_length"),
            backbone_tokens=mean("train/backbone_tokens"),
        )
        variant = "trainer" + ("_lean" if lean else "") + ("_lora" if lora else "") + (f"_kl_{kl}" if kl else "")
        if kl:
            result["kl_ref"] = mean("train/kl_ref")
        setattr(self, variant, result)
        self.log[f"{variant}_rows"] = rows
        steps_s = ", ".join(f"{r['time/step']:.2f}" for r in rows)
        what = (
            f"(f') rlvr trainer, memory-lean: (f) with the engine's cache freed after generating, token "
            f"budget {budget:,}, bf16 AdamW (no float32 master weights)"
            if lean
            else f"(f) rlvr trainer, whole step: {n_prompts} GSM8K r1_zero prompts x {group}, {new} new tokens, "
            f"{self.engine_name}, token budget {budget:,}"
        )
        if lora or kl:
            reference = {"copy": "a full bf16 copy as reference", "lora": "the adapters-off policy as reference"}
            what = (
                f"(f{'l' if lora else ''}{'k' if kl else ''}) rlvr trainer, (f) with "
                + ("LoRA rank 16 (all linear layers, no model.compile)" if lora else "")
                + (" and " if lora and kl else "")
                + (f"KL 0.001 (k3, in the loss), {reference[kl]}" if kl else "")
            )
        self.row(
            what,
            f"{result['step']:.2f} s/step, peak {peak:.1f} GiB"
            + (f", train/kl_ref {result['kl_ref']:.3g}" if kl else ""),
            "",
            "",
            f"goal <= 10 s; generate {result['generate']:.2f} s, train {result['train']:.2f} s, tokenize "
            f"{result['tokenize']:.2f} s, sync "
            f"{result['sync']:.2f} s, reward {result['reward']:.2f} s; mean response "
            f"{result['response_length']:.0f} tokens; {result['backbone_tokens']:,.0f} tokens through the model a "
            f"step ({'packed, shared prompts' if self.args.shared_prefix else 'padded'}"
            f"{', head logits kept' if self.args.keep_head_logits else ''}); {'' if lora else 'model.compile; '}mean of steps {first_steady + 1}-{len(rows)}"
            f" (all steps: {steps_s} s){scaled}",
        )
        if not (lean or lora or kl) and result["response_length"] > 0:
            self.trainer_generate = (result["generate"], result["response_length"], n_prompts * group)
            self.generate_against_realistic()
            self.step_against_floors(result, n_prompts, group)
        self.model.eval()
        self.free()

    def generate_against_realistic(self):
        """Row (f''), once both (f) and (d) ran, in either order: the trainer samples to its own lengths (to
        the cap, with random weights), so the two are compared per generated token."""
        if getattr(self, "trainer_generate", None) is None or not hasattr(self, "rollout_rate"):
            return
        seconds, length, rows = self.trainer_generate
        self.trainer_generate = None
        per_token = seconds / (length * rows)
        self.row(
            "(f'') the trainer's generate phase against (d) realistic, per generated token",
            f"{per_token / self.rollout_rate:.2f}x",
            "",
            "",
            f"goal <= 1: {per_token * 1e6:.1f} us a row-token in (f) ({length:.0f} tokens a row) against "
            f"{self.rollout_rate * 1e6:.1f} us in (d) (mean {self.rollout_mean_length:.0f}); rows that all run to "
            "the cap keep the batch full to the end, so a token costs less there: this favours (f)",
        )

    def step_against_floors(self, result: dict, n_prompts: int, group: int):
        """Row (f*): the whole step (f) against the sum of its two floors at the step's own lengths: the
        decode floor of its rollout (``decode_floor``: every row at the step's mean response length, each
        group's prompt at the data's mean r1_zero prompt length) and ``train_floor_s`` of the tokens it put
        through the model; the train phase's share of the measured matmul rate beside it."""
        rows, length = n_prompts * group, round(result["response_length"])
        prompt = round(statistics.fmean(self.prompt_lengths))
        generate_floor = self.decode_floor([prompt] * rows, [length] * rows, group=group)
        train_floor = train_floor_s(self.n_params, result["backbone_tokens"], self.mm)
        floors = generate_floor + train_floor
        self.log["trainer_floors"] = dict(generate=generate_floor, train=train_floor, prompt_len=prompt)
        self.row(
            "(f*) the whole step (f) against its floors at its own lengths",
            f"{result['step'] / floors:.2f}x ({result['step']:.3g} s)",
            f"{floors:.3g} s",
            "",
            f"goal <= 1.6x; generate {result['generate']:.2f} s = {result['generate'] / generate_floor:.2f}x its "
            f"decode floor {generate_floor:.2f} s ({rows} rows x {length} tokens, {n_prompts} prompts of "
            f"{prompt} tokens); train {result['train']:.2f} s at {100 * train_floor / result['train']:.0f}% of "
            f"the measured matmul rate (goal >= 60%; floor {train_floor:.2f} s = 6 x {self.n_params / 1e9:.3f} B "
            f"params x {result['backbone_tokens']:,.0f} tokens)",
        )

    def trainer_budget(self, budget: int, **kind) -> tuple[int, str]:
        """The largest of ``budget`` and its halves (down to ``TRAINER_MIN_BUDGET``) whose run fits the free
        memory by its estimate (``trainer_bytes``), and a note for the row when that is not ``budget``;
        ``SectionSkipped`` when none fits."""
        first_reason = reason = self.memory_skip(self.trainer_bytes(budget, **kind))
        wanted = budget
        while reason is not None and budget // 2 >= TRAINER_MIN_BUDGET:
            budget //= 2
            reason = self.memory_skip(self.trainer_bytes(budget, **kind))
        if reason is not None:
            raise SectionSkipped(f"token budget {wanted:,} down to {budget:,}: {reason}")
        if budget == wanted:
            return budget, ""
        return budget, f"; token budget scaled down from {wanted:,} ({wanted:,} {first_reason})"

    def trainer_step_lean(self):
        self.trainer_step(lean=True)

    def trainer_step_kl_copy(self):
        self.trainer_step(kl="copy")

    def trainer_step_lora(self):
        self.trainer_step(lora=True)

    def trainer_step_kl_lora(self):
        self.trainer_step(kl="lora", lora=True)

    # ------------------------------------------------------------ 9. TRL side by side
    def trl(self):
        """TRL's ``GRPOTrainer`` (no vLLM) on the same model, tokenizer, prompts, batch and lengths: 32
        prompts x 8 generations, 512 new tokens, per-device batch 8 x gradient accumulation 32 = 256
        completions per optimizer step, bf16, AdamW lr 1e-5, beta 0 (no reference model), the same coin
        reward, and the same sampling distribution (ids the tokenizer cannot decode suppressed, as rlvr's
        engines mask them). Gradient checkpointing off, as in rlvr (TRL's GRPO default is on)."""
        if self.args.no_trl:
            raise SectionSkipped("--no-trl")
        import tempfile

        try:
            import datasets
            import trl
        except ImportError as e:
            raise SectionSkipped(f"TRL not importable ({one_line(e)})") from e
        from datasets.table import InMemoryTable
        from transformers import TrainerCallback

        n_prompts, group, new = (2, 4, 8) if self.tiny else (32, 8, 512)
        per_device = 4 if self.tiny else 8
        steps = self.args.trl_steps
        rng = random.Random(self.args.seed + 3)
        exs = rng.sample(self.examples, n_prompts * steps)
        # Built with a fixed fingerprint: ``Dataset.from_dict`` hashes its Arrow table, which breaks on some
        # pyarrow / dill pairs, and that hashing is not what is being timed.
        ds = datasets.Dataset(
            InMemoryTable.from_pydict({"prompt": [render("r1_zero", ex.question) for ex in exs]}),
            fingerprint="rlvr-bench-prompts",
        )

        def coin(completions, **kw):
            return [coin_reward(c, "")["reward"] for c in completions]

        stamps, gen_times = [], []
        bench = self

        class Clock(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                bench.sync()
                stamps.append(time.perf_counter())

        model = self.model
        plain_generate = model.generate  # bound class method; the instance attribute below shadows it

        def timed_generate(*a, **k):
            self.sync()
            t0 = time.perf_counter()
            out = plain_generate(*a, **k)
            self.sync()
            gen_times.append(time.perf_counter() - t0)
            return out

        vocab = model.config.vocab_size
        cfg = trl.GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="bench_trl_"),
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=n_prompts * group // per_device,
            num_generations=group,
            max_completion_length=new,
            temperature=1.0,
            top_p=1.0,
            learning_rate=1e-5,
            adam_beta1=0.9,
            adam_beta2=0.95,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=self.device.type == "cuda",
            use_cpu=self.device.type == "cpu",
            gradient_checkpointing=False,
            use_vllm=False,
            seed=self.args.seed,
            dataloader_num_workers=0,
            generation_kwargs={"suppress_tokens": list(range(len(self.tok), vocab))} if vocab > len(self.tok) else None,
        )
        tok = self.tok
        tok.padding_side = "left"
        model.generate = timed_generate
        try:
            trainer = trl.GRPOTrainer(
                model=model, reward_funcs=coin, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Clock()]
            )
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            self.sync()
            t0 = time.perf_counter()
            trainer.train()
        finally:  # back to the class method, also for the sections after a run that raised
            del model.generate
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else float("nan")
        step_times = [b - a for a, b in zip([t0] + stamps[:-1], stamps)]
        t_trl = step_times[-1]
        self.log["trl"] = dict(version=trl.__version__, step_times=step_times, gen_times=gen_times, peak_gb=peak)
        self.row(
            f"(g) TRL {trl.__version__} GRPOTrainer (no vLLM), same model / prompts / {n_prompts * group} x {new} / coin reward",
            f"{t_trl:.2f} s/step, peak {peak:.1f} GiB",
            "",
            "",
            f"step {len(step_times)} of {len(step_times)} (step 1: {step_times[0]:.1f} s); generate "
            f"{gen_times[-1] if gen_times else float('nan'):.2f} s of it; microbatch {per_device}, no checkpointing",
        )
        for name, r in (("(f)", getattr(self, "trainer", None)), ("(f')", getattr(self, "trainer_lean", None))):
            if r:
                self.row(
                    f"(g') rlvr whole step {name} vs TRL (g)",
                    f"{t_trl / r['step']:.2f}x faster",
                    "",
                    "",
                    f"goal >= 3x with equal or lower peak memory: rlvr {r['peak_gb']:.1f} GiB vs TRL {peak:.1f} GiB",
                )
        del trainer
        model.eval()
        self.free()

    # ------------------------------------------------------------ 10. other families
    def families(self):
        """The forced batch of section 3 on each of ``--families`` (random weights at the model's exact
        shape, bf16), against its own decode floor; then a few sampled rows' log-probs against the
        model's bf16 forward on prompt + completion (teacher-forced)."""
        from transformers import AutoConfig

        prompts = self.forced_prompts if hasattr(self, "forced_prompts") else self.fixed_length_prompts()
        T = self.new_tokens
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=T, seed=0, ignore_eos=True)
        ids = dict(
            pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id, bos_token_id=self.tok.bos_token_id
        )
        names = self.args.families.split(",")
        for name in names:
            if name not in FAMILY_MODELS:
                raise ValueError(f"unknown --families entry {name!r}: choose from {', '.join(FAMILY_MODELS)}")
        failures = []
        for name in names:
            if time.perf_counter() - self.t_start > self.args.deadline_s:
                self.row(f"(h) {name} SKIPPED", f"past the {self.args.deadline_s:.0f} s deadline")
                continue
            model_type, shape = FAMILY_MODELS[name]
            shape = dict(shape, **(TINY_FAMILY_SHAPE if self.tiny else {}))
            if self.tiny:
                shape["vocab_size"] = len(self.tok) + 64
            config = AutoConfig.for_model(model_type, **shape, **ids)
            why = self.family_memory_skip(config, len(prompts), T)
            if why is not None:
                self.row(f"(h) {name} SKIPPED", why)
                continue
            # One family out of memory or broken leaves the others to run; the section fails at the end.
            failed = None
            try:
                with torch.device(self.device):
                    model = build_model(config, seed=self.args.seed, dtype=self.dtype)
                model.eval()
                self.family_case(name, model, prompts, params)
            except Exception as e:
                if not isinstance(e, torch.OutOfMemoryError):
                    traceback.print_exc()
                failed = one_line(e, 120)
            model = None
            self.free()  # outside the except clause, where the failed call's tensors are no longer referenced
            if failed is not None:
                failures.append(f"{name}: {failed}")
                self.row(f"(h) {name} FAILED", failed)
        if failures:
            raise RuntimeError(f"{len(failures)} of {len(names)} families did not finish: " + "; ".join(failures))

    def family_memory_skip(self, config, rows: int, new_tokens: int) -> str | None:
        """Why a family's model and engine should not be built here (its weights and the engine's
        buffers, estimated from its shape, above the free memory), or None."""
        if self.device.type != "cuda":
            return None
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        h, f, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        layer = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * f
        embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
        weights = (n * layer + embeddings) * self.weight_size()
        need = weights + engine_bytes(config, rows, rows, self.prompt_len, new_tokens, self.weight_size())
        return self.memory_skip(need)

    def family_case(self, name, model, prompts, params):
        P, T = len(prompts), params.max_new_tokens
        cfg = model.config
        n_params, _ = param_counts(model)
        fast = FastHFEngine(model, self.tok, max_batch_size=P, **self.variants[0])
        floor = self.decode_floor([self.prompt_len] * P, [T] * P, model=model)
        _, cold = self.timed(lambda: fast.generate(prompts, params))
        out, warm, warm_all = self.best_of(lambda: fast.generate(prompts, params))
        assert all(len(c.token_ids) == T for g in out for c in g)
        lay = fast.layout
        shape = (
            f"{n_params / 1e9:.2f} B params, {lay.layers} layers, {lay.heads} heads / {lay.kv_heads} kv heads of "
            f"{lay.head_dim}, {'tied' if cfg.tie_word_embeddings else 'untied'} embeddings"
        )
        self.row(
            f"(h) {name} (random weights): FastHFEngine [{variant_name(self.variants[0])}], {P}x{self.prompt_len}"
            f"+{T} forced, warm",
            f"{warm:.2f} s ({P * T / warm:,.0f} tok/s)",
            f"{floor:.2f} s",
            f"{warm / floor:.2f}x the floor",
            f"goal <= 1.6x the floor; {shape}; best of 3 warm calls ({', '.join(f'{x:.2f}' for x in warm_all)} s); "
            f"cold (first call) {cold:.2f} s, {fast.stats['graphs_captured']} graphs captured in "
            f"{fast.stats['capture_time']:.1f} s",
        )
        self.log[f"fast_stats_family[{name}]"] = dict(fast.stats, warm=warm, warm_all=warm_all, cold=cold, floor=floor)
        # The same engine, fewer rows: sampled log-probs against the model's own forward on the sequence.
        check = prompts[:4]
        short = SamplingParams(n=2, temperature=1.0, max_new_tokens=16 if self.tiny else 64, seed=1, ignore_eos=True)
        diffs = []
        for p, group in zip(check, fast.generate(check, short)):
            p_ids = self.tok(p, add_special_tokens=False)["input_ids"]
            for c in group:
                seq = torch.tensor([p_ids + c.token_ids], device=self.device)
                lp = sequence_logprobs(model, seq, torch.ones_like(seq))[0, len(p_ids) - 1 :].float().cpu()
                diffs.append((lp - torch.tensor(c.logprobs)).abs())
        diffs = torch.cat(diffs)
        self.row(
            f"(h') {name}: sampled log-probs vs the HF forward, teacher-forced",
            f"max abs diff {diffs.max():.3g}, mean {diffs.mean():.3g}",
            "",
            "",
            f"{len(check)} prompts x 2 samples x {short.max_new_tokens} tokens; "
            f"{str(self.dtype).replace('torch.', '')}, different kernels and batch shapes",
        )
        fast.close()
        del fast, out

    def free(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def after_section(self):
        """Run after every section however it ended: one that raised mid-step leaves gradients on the
        model and the model in training mode, which the next sections must not inherit."""
        self.model.zero_grad(set_to_none=True)
        self.model.eval()
        self.free()

    def table(self) -> str:
        """The rows as a markdown table, under the line naming the card they were measured on."""
        lines = [
            card_line(self.card),
            "",
            "| measure | measured | hardware floor | vs (a) | note |",
            "|---|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(f"| {r['what']} | {r['measured']} | {r['floor']} | {r['ratio']} | {r['note']} |")
        return "\n".join(lines)


def measure_ceilings(timed) -> tuple[float, float]:
    """(copy bytes/s, read and write counted; bf16 matmul FLOP/s) on the GPU. ``timed(fn)`` returns
    ``(fn(), seconds)`` with the device synchronised around the call (``Bench.timed``)."""
    x = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _, t = timed(lambda: [y.copy_(x) for _ in range(20)])
    bw = 2 * x.numel() * 2 * 20 / t
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    _, t = timed(lambda: [a @ b for _ in range(10)])
    mm = 2 * 8192**3 * 10 / t
    del x, y, a, b
    torch.cuda.empty_cache()
    return bw, mm


def train_floor_s(n_params: int, tokens: float, matmul_rate: float) -> float:
    """Seconds of a training step's forward and backward at ``matmul_rate``: 6 FLOPs per parameter per
    token through the model (MFU's convention)."""
    return 6 * n_params * tokens / matmul_rate


def kv_bytes_per_token(cfg, size: int) -> int:
    """Bytes of K and V one token leaves in the cache over all layers (the key/value heads' under
    grouped-query attention), at ``size`` bytes a value."""
    kv_width = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv_width *= getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_width * size


# Values a token leaves saved for the backward in each decoder layer, as multiples of (hidden size, FFN
# width), eager and through model.compile (inductor fuses elementwise chains and saves fewer results):
# fitted to the training peaks of the OLMo-2-1B shape recorded in docs/benchmarks.md.
SAVED_PER_TOKEN = {False: (16, 6), True: (8, 4)}


def training_bytes(
    cfg,
    n_params: int,
    tokens: int,
    *,
    size: int = 2,
    compiled: bool = False,
    master_weights: bool = False,
    keep_head_logits: bool = False,
    trainable: int | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> int:
    """GPU bytes a training step adds to the resident model, from the model's shape: gradients and AdamW
    moments of the ``trainable`` parameters (default all; moments in the weights' dtype, or float32
    moments and a float32 master copy with ``master_weights``), the activations a microbatch of
    ``tokens`` saves for the backward (``SAVED_PER_TOKEN``), two float32 logit chunks of the fused
    log-prob and, with ``keep_head_logits``, the microbatch's logits in the weights' dtype."""
    trainable = n_params if trainable is None else trainable
    states = trainable * (size + (12 if master_weights else 2 * size))
    per_hidden, per_ffn = SAVED_PER_TOKEN[compiled]
    saved = tokens * cfg.num_hidden_layers * (per_hidden * cfg.hidden_size + per_ffn * cfg.intermediate_size) * size
    head = 2 * chunk_tokens * cfg.vocab_size * 4 + (tokens * cfg.vocab_size * size if keep_head_logits else 0)
    return states + saved + head


def engine_bytes(cfg, rows: int, groups: int, prompt_slots: int, new_tokens: int, size: int = 2) -> int:
    """GPU bytes of the fast engine's buffers, from the model's shape: the prompt K/V of ``groups``
    prompts and the response K/V of ``rows`` rows, the stacked copies of the q/k/v and gate/up weights,
    and float32 logits of every row twice (the head's output and the sampling pass)."""
    kv = kv_bytes_per_token(cfg, size) * (rows * new_tokens + groups * prompt_slots)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    stacked = cfg.num_hidden_layers * cfg.hidden_size * ((heads + 2 * kv_heads) * head_dim + 2 * cfg.intermediate_size)
    return kv + stacked * size + 2 * rows * cfg.vocab_size * 4


def param_counts(model) -> tuple[int, int]:
    """Parameters (a tied embedding once) and the matmul parameters of a decode step (all but the input
    embedding lookup; with tied embeddings the LM head's matrix is the embedding and counts)."""
    n = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return n, n - embed.numel() + (embed.numel() if tied else 0)


# The sections in the order they run, each with the sections whose results it reads and, where its
# size is fixed before it starts, its memory estimate (the trainer, training and families sections
# scale down or skip their parts themselves). The trainer first: it then runs as ``rlvr train`` does,
# in a process that has compiled and allocated nothing else (the families last: they swap the model).
SECTIONS: dict[str, Section] = {
    "ceilings": Section(Bench.ceilings),
    "trainer_step": Section(Bench.trainer_step),
    "trainer_step_lean": Section(Bench.trainer_step_lean),
    "trainer_step_kl_copy": Section(Bench.trainer_step_kl_copy),
    "trainer_step_lora": Section(Bench.trainer_step_lora),
    "trainer_step_kl_lora": Section(Bench.trainer_step_kl_lora),
    "checks": Section(Bench.checks),
    "forced_length": Section(Bench.forced_length, needs=("ceilings",), memory=Bench.forced_bytes),
    "realistic": Section(Bench.realistic, needs=("ceilings",), memory=Bench.realistic_bytes),
    "multiturn": Section(Bench.multiturn, needs=("ceilings",), memory=Bench.multiturn_bytes),
    "training": Section(Bench.training, needs=("ceilings", "realistic")),
    "compiled": Section(Bench.compiled, needs=("ceilings", "training"), memory=Bench.compiled_bytes),
    "trl": Section(Bench.trl),
    "families": Section(Bench.families, needs=("ceilings",)),
}


def chosen_sections(args) -> list[str]:
    """The names of ``SECTIONS`` that ``--sections`` picks, in table order (ceilings always)."""
    if not args.sections:
        return list(SECTIONS)
    wanted = [name for name in args.sections.split(",") if name]
    unknown = [name for name in wanted if name not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown --sections {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    return [name for name in SECTIONS if name == "ceilings" or name in wanted]


def main(argv=None) -> int:
    """Run the chosen sections and print (and with ``--out`` write) the table; the exit status (module
    docstring)."""
    args = parse_args(argv)
    names = chosen_sections(args)
    bench = Bench(args)
    t_start = bench.t_start
    bench.setup()

    def report(outcome):
        if outcome.status != OK:
            bench.row(f"{outcome.name} {outcome.status.upper()}", outcome.reason)
        bench.log[f"section_{outcome.name}_s"] = outcome.seconds
        print(f"[time] {outcome.name}: {outcome.seconds:.1f} s ({outcome.status})", flush=True)

    outcomes = run_sections(
        SECTIONS,
        names,
        bench,
        available=lambda: available_bytes(bench.device),
        free=bench.after_section,
        deadline_s=args.deadline_s,
        started=t_start,
        report=report,
    )
    bench.log["total_s"] = time.perf_counter() - t_start
    bench.log["rows"] = bench.rows
    bench.log["sections"] = [o.as_dict() for o in outcomes]
    text = bench.table() + "\n\n" + outcome_table(outcomes)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_speed.json").write_text(json.dumps(bench.log, indent=1, default=str))
        (out / "bench_speed.md").write_text(text + "\n")
    print(
        f"\n{bench.log['date']} | {card_line(bench.card)} | torch {bench.log['torch']} | transformers "
        f"{bench.log['transformers']} | total {bench.log['total_s']:.0f} s\n"
    )
    print(text)
    broken = [o.name for o in outcomes if o.status in (FAILED, OOM)]
    if broken:
        print(f"\n{len(broken)} section(s) did not finish: {', '.join(broken)}", flush=True)
    return 1 if args.strict and broken else 0


if __name__ == "__main__":
    sys.exit(main())
