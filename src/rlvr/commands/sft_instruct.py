"""`rlvr sft instruct`: instruction tuning on packed ``{prompt, response}`` data.

The defaults are the course's settings for turning a base model (there Llama-3.1-8B) into an
assistant: packed windows of 512 tokens (``rlvr.task.instruction_data``), 32 windows per optimizer step through
gradient accumulation, AdamW at lr 2e-5 with weight decay 0.1, a cosine schedule after a 3 % linear
warm-up, gradient norm clipped at 1.0, one epoch. Every token of an Alpaca ``{prompt, response}`` row
carries loss (packed documents have no prompt mask). Conversational rows, TRL's ``{messages}`` and
``{prompt, completion}`` message lists, are rendered with the model's chat template (``--chat-template
FILE`` gives one to a base model) with loss on the assistant's turns (on the completion), or on every
token with ``--no-assistant-only-loss``; the packed windows keep that mask (labels -100 elsewhere) and
the loss is the mean over the tokens that carry it. Held-out documents (``--val-data``, else ``--val-size`` documents taken out of the
training file before packing) give the validation loss curve.

Speed on a GPU comes from the pieces ``rlvr train`` uses: microbatches cut by a token budget
(``--max-tokens-per-microbatch``; windows all have ``seq_length`` tokens, so the budget fixes the
rows per forward), chunked float32 log-probs that never hold the full logits, ``--compile`` (one
compiled decoder-layer forward shared by all layers) and float32 master weights for a bfloat16
model. No ``Trainer``.

Output, in ``--out``: the model and tokenizer (``save_pretrained``: loadable by every rlvr command
and by vLLM), ``sft_config.json`` and ``metrics.jsonl`` (``train/loss``, ``lr``, ``train/grad_norm`` per
step; ``val/loss`` every ``--eval-every`` steps), mirrored to wandb / TensorBoard when asked, and
``summary.json``. Checkpoints every ``--save-every`` steps and on Ctrl-C or SIGTERM (exit 130 / 143)
go to ``checkpoints/``; ``--resume DIR`` continues the same run (``rlvr.training.scaffold``).

    rlvr sft instruct --model meta-llama/Llama-3.1-8B --data sft_train.jsonl.gz --out runs/sft
    rlvr sft instruct --model allenai/OLMo-2-0425-1B-Instruct --data chats.jsonl --out runs/chat-sft
    rlvr sft instruct --resume runs/sft
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlvr import modeling
from rlvr.errors import UserError
from rlvr.machine import resolve_device
from rlvr.modeling import (
    MODEL_SIZES,
    check_chat_template_before_load,
    read_chat_template,
    resolve_dtype,
    save_model_and_tokenizer,
)
from rlvr.ranges import AT_LEAST_ONE, BELOW_ONE, NON_NEGATIVE, POSITIVE, PROBABILITY, Range, check_flags
from rlvr.task.data_order import batch_indices
from rlvr.task.instruction_data import (
    IGNORE_INDEX,
    alpaca_fixed_parts,
    encode_sft_rows,
    is_alpaca,
    load_sft_rows,
    pack_documents,
    row_text,
)
from rlvr.training.checkpoint import load_trainer_state, refuse_edited_settings, resumable_checkpoint, save_checkpoint
from rlvr.training.logprobs import compile_backbone, get_response_log_probs
from rlvr.training.metrics_log import MetricsLogger, truncate_metrics
from rlvr.training.optim import lr_schedule, make_adamw
from rlvr.training.rundir import RunDirLock, atomic_write_json
from rlvr.training.scaffold import (
    TrainingRun,
    claimed_output_dir,
    remove_outputs,
    resumed_settings,
    saved_settings,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlvr.task.instruction_data import PackedSFTDataset

OUTPUT_FILES = ("model.safetensors", "metrics.jsonl", "sft_config.json", "summary.json", "checkpoints")
RESUMABLE = ("steps", "eval_every", "save_every", "progress", "wandb", "tensorboard")
"""Settings that ``--resume`` takes from the command line; the others come from the run's sft_config.json."""


@dataclass
class InstructSFTConfig:
    """Instruction-tune a causal LM on packed {prompt, response} data (the course's settings by default)."""

    data: str = ""
    """Training data: a JSONL or JSONL.gz file (or hub dataset) of {prompt, response} strings, {messages} lists, or {prompt, completion} message lists."""
    model: str = ""
    """Base model: a local directory, a hub id (meta-llama/Llama-3.1-8B), or a named size for a fresh model (tiny, small, 20m)."""
    out: Path | None = None
    """Run directory: the fine-tuned model and tokenizer, sft_config.json, metrics.jsonl, summary.json, checkpoints/."""
    val_data: str | None = None
    """Validation data in the same format (default: --val-size documents held out of --data)."""
    val_size: int = 256
    """Documents held out of --data for validation when --val-data is not given (0: no validation)."""
    split: str = "train"
    """Split of a hub dataset for --data."""
    val_split: str = "test"
    """Split of a hub dataset for --val-data."""
    prompt_field: str = "prompt"
    """Field holding the instruction (or, in conversational rows, the prompt's messages)."""
    response_field: str = "response"
    """Field holding the response of an Alpaca row."""
    assistant_only_loss: bool = True
    """In conversational rows, loss only on the assistant's turns (on the completion of prompt/completion rows); off: on every token."""
    chat_template: Path | None = None
    """A Jinja chat template file for the tokenizer (a base model or a named size has none); saved with the model."""
    max_examples: int | None = None
    """Use only the first this-many documents of --data."""
    seq_length: int = 512
    """Tokens per packed window (context length)."""
    batch_size: int = 32
    """Packed windows per optimizer step (gradient accumulation over microbatches)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one forward/backward: rows per microbatch = this // seq_length (at least 1)."""
    epochs: float = 1.0
    """Passes over the training windows (used when --steps is unset)."""
    steps: int | None = None
    """Optimizer steps (overrides --epochs)."""
    lr: float = 2e-5
    """Peak learning rate of AdamW."""
    warmup_ratio: float = 0.03
    """Share of the steps spent in linear warm-up from 0 to --lr; then cosine decay."""
    min_lr_ratio: float = 0.0
    """The cosine decay ends at lr * this."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before every optimizer step."""
    eval_every: int = 100
    """Validation loss every this many steps (also at the start and the end; 0: only then)."""
    seed: int = 0
    """Seed of the document shuffle, the window order and fresh-model initialisation."""
    device: str = "auto"
    """Torch device (auto: cuda when available, else cpu)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Model dtype (auto: bfloat16 on CUDA, float32 on CPU)."""
    master_weights: bool = True
    """With a bfloat16 model, step float32 copies of the weights (small updates at lr 2e-5 would otherwise round away)."""
    compile: bool = False
    """Train through one torch.compile'd decoder-layer forward shared by all layers (faster steps after a compile)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (less memory, slower)."""
    vocab_size: int = 640
    """Vocabulary of the tokenizer trained for a fresh model (named sizes only)."""
    wandb: bool = False
    """Mirror metrics to Weights & Biases."""
    wandb_project: str = "rlvr"
    """W&B project."""
    tensorboard: bool = False
    """Mirror metrics to TensorBoard event files under OUT/tensorboard."""
    progress: bool = True
    """Show a progress bar."""
    save_every: int = 100
    """Checkpoint for --resume every this many steps (and on Ctrl-C or SIGTERM; 0: only then)."""
    overwrite: bool = False
    """Replace a run already in --out."""
    resume: Path | None = None
    """Continue the run in this directory from its newest intact checkpoint (with its saved config; --steps, cadences and logging may change)."""
    fresh_optimizer: bool = False
    """With --resume: accept a checkpoint that holds weights only (its trainer_state.pt deleted or lost) and continue from its step with a fresh optimizer."""

    def validate(self) -> None:
        """Reject impossible settings (``UserError``) before any work."""
        missing = [
            flag for flag, value in (("--data", self.data), ("--model", self.model), ("--out", self.out)) if not value
        ]
        if missing:
            raise UserError(f"{', '.join(missing)} required (or --resume DIR to continue a run)")
        if self.fresh_optimizer and self.resume is None:
            raise UserError("--fresh-optimizer applies to a resumed run: pass it with --resume DIR")
        check_flags(self, INSTRUCT_SFT_RANGES)
        check_model_name(self.model)


INSTRUCT_SFT_RANGES: dict[str, Range] = {
    "val_size": NON_NEGATIVE,
    "max_examples": AT_LEAST_ONE,
    "seq_length": Range(2),
    "batch_size": AT_LEAST_ONE,
    "max_tokens_per_microbatch": AT_LEAST_ONE,
    "epochs": POSITIVE,
    "steps": AT_LEAST_ONE,
    "lr": POSITIVE,
    "warmup_ratio": BELOW_ONE,
    "min_lr_ratio": PROBABILITY,
    "weight_decay": NON_NEGATIVE,
    "betas": BELOW_ONE,
    "max_grad_norm": POSITIVE,
    "eval_every": NON_NEGATIVE,
    "seed": NON_NEGATIVE,
    "vocab_size": AT_LEAST_ONE,
    "save_every": NON_NEGATIVE,
}
"""The allowed range of every numeric field of ``InstructSFTConfig`` (``rlvr.ranges``)."""


def check_model_name(name: str) -> None:
    """A named size, an existing directory, or something shaped like a hub id (owner/name)."""

    if name not in MODEL_SIZES and not Path(name).exists() and name.count("/") != 1:
        raise UserError(
            f"--model {name!r} is neither a named size ({', '.join(MODEL_SIZES)}), "
            "a local directory, nor a hub id (owner/name)"
        )


def load_or_build_model(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer_texts: Callable[[], Iterable[str]],
    vocab_size: int,
    seed: int,
    max_position_embeddings: int = 2048,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)``: a checkpoint (local directory or hub id), or a fresh OLMo-2 of a named
    size with a byte-level BPE tokenizer trained on ``tokenizer_texts()``.

    A fresh tokenizer also holds the Alpaca template's two fixed pieces as one token each: byte-level
    BPE never merges across words, so the template would otherwise cost 30 tokens of every document,
    most of a small model's compute on short synthetic tasks."""

    if name in modeling.MODEL_SIZES:
        tokenizer = modeling.train_tokenizer(tokenizer_texts(), vocab_size)
        tokenizer.add_tokens(list(alpaca_fixed_parts()))
        model = modeling.fresh_model(
            name, tokenizer, seed=seed, dtype=dtype, max_position_embeddings=max_position_embeddings
        )
        return model.to(device), tokenizer  # type: ignore[arg-type]  # transformers' stub of .to takes the model
    check_model_name(name)
    return modeling.load_model_and_tokenizer(name, device=device, dtype=dtype)


def token_nll(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, backbone: Callable[..., Any] | None = None
) -> torch.Tensor:
    """Mean negative log-likelihood of every label of a (rows, seq_length) block."""

    return -get_response_log_probs(model, input_ids, labels, backbone=backbone)["log_probs"].mean()


def masked_nll_sum(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, backbone: Callable[..., Any] | None = None
) -> torch.Tensor:
    """Summed negative log-likelihood of the labels that are not ``IGNORE_INDEX`` (only their positions
    reach the vocabulary projection)."""

    keep = labels != IGNORE_INDEX
    log_probs = get_response_log_probs(model, input_ids, labels.clamp(min=0), backbone=backbone, positions=keep)[
        "log_probs"
    ]
    return -(log_probs * keep.to(log_probs.device)).sum()


def _block(dataset: PackedSFTDataset, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = [dataset[i] for i in rows]
    return torch.stack([b["input_ids"] for b in batch]), torch.stack([b["labels"] for b in batch])


def accumulate_step(
    model: torch.nn.Module,
    dataset: PackedSFTDataset,
    indices: list[int],
    rows_per_microbatch: int,
    backbone: Callable[..., Any] | None = None,
) -> tuple[float, int]:
    """Backpropagate the mean token NLL of the windows ``indices`` in microbatches of at most
    ``rows_per_microbatch`` rows; the accumulated gradient is that of the whole batch. Unmasked
    windows all have the same length, so a microbatch weighs rows / batch; in masked ones a
    microbatch's summed NLL is divided by the batch's count of labels with loss. Returns ``(loss, tokens)``."""
    total = 0.0
    counted = sum(int((dataset[i]["labels"] != IGNORE_INDEX).sum()) for i in indices) if dataset.masked else 0
    for start in range(0, len(indices), rows_per_microbatch):
        rows = indices[start : start + rows_per_microbatch]
        input_ids, labels = _block(dataset, rows)
        if dataset.masked:
            loss = masked_nll_sum(model, input_ids, labels, backbone) / max(counted, 1)
        else:
            loss = token_nll(model, input_ids, labels, backbone) * (len(rows) / len(indices))
        loss.backward()
        total += float(loss.detach())
    return total, len(indices) * dataset.seq_length


@torch.no_grad()
def validation_loss(model: torch.nn.Module, dataset: PackedSFTDataset, rows_per_microbatch: int) -> float:
    """Mean token NLL over every window of ``dataset`` (over the labels with loss, when masked)."""
    if len(dataset) == 0:
        return float("nan")
    was_training = model.training
    model.eval()
    total, counted = 0.0, 0
    for start in range(0, len(dataset), rows_per_microbatch):
        input_ids, labels = _block(dataset, list(range(start, min(len(dataset), start + rows_per_microbatch))))
        if dataset.masked:
            total += float(masked_nll_sum(model, input_ids, labels))
            counted += int((labels != IGNORE_INDEX).sum())
        else:
            total += float(token_nll(model, input_ids, labels)) * len(labels)
    model.train(was_training)
    if dataset.masked:
        return total / counted if counted else float("nan")
    return total / len(dataset)


def split_documents(pairs: list[dict], val_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, validation)``: ``val_size`` documents drawn with ``seed`` out of ``pairs``."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = set(order[:val_size])
    return [p for i, p in enumerate(pairs) if i not in held], [pairs[i] for i in sorted(held)]


def run_instruct_sft(cfg: InstructSFTConfig) -> Path:
    """Instruction-tune per ``cfg`` (or resume ``cfg.resume``) and save the model; returns the output
    directory. The directory is locked before anything in it is read or replaced."""
    if cfg.resume is None:
        cfg.validate()
        replaced = ("metrics.jsonl", "summary.json", "checkpoints")
        with claimed_output_dir(
            cfg.out or "", OUTPUT_FILES, cfg.overwrite, replaces=replaced, command="rlvr sft instruct"
        ):
            return _run(cfg, None)
    run_dir = Path(cfg.resume)
    if not run_dir.is_dir():
        raise UserError(
            f"--resume {run_dir}: no such directory; give the directory of an earlier `rlvr sft instruct` run"
        )
    with RunDirLock(run_dir, command="rlvr sft instruct"):
        cfg = resumed_settings(
            cfg,
            run_dir,
            "sft_config.json",
            RESUMABLE,
            "rlvr sft instruct",
            accepts=lambda saved: saved.get("command") == "sft instruct",
        )
        cfg.validate()
        ckpt = resumable_checkpoint(run_dir, fresh_optimizer=cfg.fresh_optimizer)
        if ckpt is not None:
            refuse_edited_settings(ckpt, saved_settings(cfg), (*RESUMABLE, "out"), run_dir / "sft_config.json")
        if ckpt is None:
            print(f"rlvr: {run_dir} holds no checkpoint; starting the run again from step 0", file=sys.stderr)
            remove_outputs(run_dir, ("metrics.jsonl", "summary.json"))
        return _run(cfg, ckpt)


def _run(cfg: InstructSFTConfig, ckpt: Path | None) -> Path:
    """The work of ``run_instruct_sft`` in its claimed output directory, from ``ckpt`` (None: step 0)."""
    from tqdm.auto import tqdm

    # Data first: a bad path fails in seconds, not after a model load.
    pairs = load_sft_rows(cfg.data, cfg.split, cfg.max_examples, cfg.prompt_field, cfg.response_field)
    if cfg.val_data:
        train_pairs = pairs
        val_pairs = load_sft_rows(cfg.val_data, cfg.val_split, None, cfg.prompt_field, cfg.response_field)
    else:
        if cfg.val_size >= len(pairs):
            raise UserError(f"--val-size {cfg.val_size} leaves no training documents out of {len(pairs)}; lower it")
        train_pairs, val_pairs = split_documents(pairs, cfg.val_size, cfg.seed)
    if not train_pairs:
        raise UserError(f"no training documents in {cfg.data!r}")
    chat_template = read_chat_template(cfg.chat_template)
    if chat_template is None and not all(is_alpaca(r) for r in (*train_pairs, *val_pairs)):
        check_chat_template_before_load(str(ckpt / "model") if ckpt is not None else cfg.model)

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_or_build_model(
        str(ckpt / "model") if ckpt is not None else cfg.model,
        device,
        dtype,
        lambda: [row_text(p) for p in train_pairs[:20000]],
        cfg.vocab_size,
        cfg.seed,
        max_position_embeddings=max(2048, cfg.seq_length),
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    documents, masks = encode_sft_rows(tokenizer, train_pairs, cfg.assistant_only_loss)
    order = list(range(len(documents)))
    random.Random(cfg.seed).shuffle(order)
    train_ds = pack_documents(
        [documents[i] for i in order], cfg.seq_length, None if masks is None else [masks[i] for i in order]
    )
    val_documents, val_masks = encode_sft_rows(tokenizer, val_pairs, cfg.assistant_only_loss)
    val_ds = pack_documents(val_documents, cfg.seq_length, val_masks)
    if len(train_ds) == 0:
        raise UserError(
            f"the training data holds fewer than {cfg.seq_length + 1} tokens: nothing to pack into "
            "one window; lower --seq-length or add data"
        )

    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    backbone = compile_backbone(model) if cfg.compile else None
    model.train()
    optimizer = make_adamw(
        model.parameters(),
        master_weights=cfg.master_weights,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        fused=device.type == "cuda",
    )
    total = cfg.steps or max(1, math.ceil(cfg.epochs * len(train_ds) / cfg.batch_size))
    warmup = math.ceil(cfg.warmup_ratio * total)
    scheduler = lr_schedule(optimizer, total, "cosine", warmup, cfg.min_lr_ratio)
    rows_per_micro = max(1, cfg.max_tokens_per_microbatch // cfg.seq_length)
    batch = min(cfg.batch_size, len(train_ds))
    out = Path(cfg.out or "")
    start = 0
    if ckpt is not None:
        start = load_trainer_state(ckpt, optimizer, scheduler)["step"]
        truncate_metrics(out / "metrics.jsonl", start)

    config = saved_settings(cfg)
    config.update(
        command="sft instruct",
        train_windows=len(train_ds),
        val_windows=len(val_ds),
        total_steps=total,
        warmup_steps=warmup,
        train_documents=len(train_pairs),
        val_documents=len(val_pairs),
    )
    atomic_write_json(out / "sft_config.json", config)

    def save(step: int) -> None:
        save_checkpoint(out, step, model, tokenizer, optimizer, scheduler, state={}, run_config=config)

    run = TrainingRun(out, total, f"rlvr sft instruct --resume {out}", save, start=start, resumed=ckpt is not None)
    logger = MetricsLogger(out, config, wandb=cfg.wandb, wandb_project=cfg.wandb_project, tensorboard=cfg.tensorboard)
    try:
        with run.guarded():
            if len(val_ds) and start == 0:
                logger.log({"step": 0, "val/loss": validation_loss(model, val_ds, rows_per_micro)})
            bar = tqdm(total=total, initial=start, desc="sft instruct", disable=not cfg.progress, dynamic_ncols=True)
            with bar:
                for step in range(start + 1, total + 1):
                    with run.step_block(step):
                        row = _training_step(
                            model,
                            optimizer,
                            scheduler,
                            train_ds,
                            batch_indices(len(train_ds), batch, step - 1, cfg.seed),
                            rows_per_micro,
                            backbone,
                            cfg.max_grad_norm,
                        )
                        row["step"] = step
                        if len(val_ds) and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total):
                            row["val/loss"] = validation_loss(model, val_ds, rows_per_micro)
                        if device.type == "cuda":
                            row["mem/peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
                        logger.log(row)
                    if cfg.save_every and step % cfg.save_every == 0 and step < total:
                        run.checkpoint()
                    bar.set_postfix(loss=f"{row['train/loss']:.3f}")
                    bar.update(1)
            model.eval()
            save_model_and_tokenizer(model, tokenizer, out)
    finally:
        logger.close()
    run.summary("finished")
    return out


def _training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    train_ds: PackedSFTDataset,
    indices: list[int],
    rows_per_micro: int,
    backbone: Callable[..., Any] | None,
    max_grad_norm: float,
) -> dict[str, Any]:
    """One optimizer step over the windows ``indices`` and its metrics row (without the step number)."""
    t0 = time.perf_counter()
    lr_used = scheduler.get_last_lr()[0]
    loss, tokens = accumulate_step(model, train_ds, indices, rows_per_micro, backbone)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    elapsed = time.perf_counter() - t0
    return {
        "train/loss": loss,
        "lr": lr_used,
        "train/grad_norm": grad_norm,
        "train/tokens": tokens,
        "time/step": elapsed,
        "tokens_per_s": tokens / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    import tyro

    cfg = tyro.cli(InstructSFTConfig, args=argv, prog="rlvr sft instruct", description=__doc__.split("\n\n")[0])
    out = run_instruct_sft(cfg)
    print(f"rlvr sft instruct: saved the model and tokenizer to {out}")
    return 0
