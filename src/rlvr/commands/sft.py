"""`rlvr sft`: supervised fine-tuning on prompt/response pairs, the warm start before RL.

Each example becomes the pair (rendered prompt, reference response). The loss is the mean negative
log-likelihood of the response tokens only: prompt and padding tokens carry no loss. Tokenisation is
GRPO's own (``tokenize_prompt_and_output``, ``get_response_log_probs``), so what SFT teaches is
exactly what the policy gradient later scores.

Responses in the r1_zero format:

- a synthetic task (``--data arith:steps=2``) ships complete responses
  (``" ... </think> <answer> N </answer>"``);
- GSM8K (a directory or JSONL path, or ``openai/gsm8k``) ships rationales; the response is the
  rationale (calculator annotations removed) followed by ``" </think> <answer> {ground_truth} </answer>"``.

The data options are ``rlvr train``'s: the source, split, dataset config, columns and answer format,
the prompt (a built-in, a template file, or ``chat`` with ``--system`` / ``--user-template``), and chat
rows (a question column of messages); ``--config FILE`` reads all of them from a training config, so
that the warm start sees the prompts that GRPO will. Under the chat prompt a pair is rendered with the
model's chat template (``--chat-template FILE`` gives one to a fresh or base model) and the response
ends with the template's end of turn.

The model is a local checkpoint directory, a hub id, or a fresh OLMo-2 model of a named size
(``tiny``, ``small``, ``20m``, ``olmo2-1b``); a fresh model gets a byte-level BPE tokenizer trained on
the training prompts and responses first. The output directory holds the model and tokenizer
(``save_pretrained``), loadable by ``rlvr eval`` and ``rlvr train`` as a base model, plus
``sft_config.json`` and ``metrics.jsonl`` (``train/loss``, ``lr``, ``train/grad_norm`` and ``train/n_tokens``
per step, the format ``rlvr plot`` reads; mirrored to wandb / TensorBoard when asked) and ``summary.json``
(``running``, then ``finished``, ``interrupted`` or ``failed``). Checkpoints every ``--save-every`` steps and on
Ctrl-C or SIGTERM (exit 130 / 143) go to ``checkpoints/`` (the model, the optimizer and the data order); ``--resume
OUT`` continues the same run to the weights an uninterrupted one ends with (``rlvr.training.scaffold``). The
arguments and the output directory are checked before any work; an earlier fine-tune in ``--out`` is replaced only
with ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlvr import modeling
from rlvr.commands.sft_instruct import main as instruct_main
from rlvr.config import load_config_file
from rlvr.errors import UserError
from rlvr.machine import usable_device
from rlvr.modeling import check_chat_template_before_load, read_chat_template, save_model_and_tokenizer
from rlvr.ranges import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, PROBABILITY, Range, check_flags
from rlvr.task.build import check_chat_rows
from rlvr.task.chat import tokenize_prompt_completion
from rlvr.task.data import DataError, Example, load_examples
from rlvr.task.prompts import CHAT, render, resolve_prompt
from rlvr.training.checkpoint import load_trainer_state, refuse_edited_settings, resumable_checkpoint, save_checkpoint
from rlvr.training.logprobs import get_response_log_probs
from rlvr.training.metrics_log import MetricsLogger, truncate_metrics
from rlvr.training.optim import lr_factor
from rlvr.training.rundir import RunDirLock, atomic_write_json
from rlvr.training.scaffold import (
    TrainingRun,
    claimed_output_dir,
    remove_outputs,
    resumed_settings,
    saved_settings,
)
from rlvr.training.tokenize import pad_token_id, tokenize_from_ids, tokenize_prompt_and_output

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlvr.task.prompts import Prompt


@dataclass
class SFTConfig:
    """Supervised fine-tuning of a causal LM on prompt/response pairs (loss on response tokens only)."""

    data: str = "arith:steps=2,max_value=20"
    """Training data: a task spec (``arith:steps=2,max_value=20``), a GSM8K directory or JSONL file, or ``openai/gsm8k``."""
    model: str = "small"
    """A named size for a fresh model (tiny, small, 20m, olmo2-1b), a local checkpoint directory, or a hub id."""
    out: Path = Path("runs/sft")
    """Directory for the checkpoint (model + tokenizer), config and log."""
    config: Path | None = None
    """A training config file (rlvr train --config): its data and prompt settings replace --data, --split, --max-examples, --data-config, the columns, --answer-format, --prompt, --system, --user-template and --data-seed."""
    prompt: str = "r1_zero"
    """Prompt template that wraps each question: a built-in, a template file, or chat (the model's chat template; see ``rlvr.task.prompts``)."""
    system: str | None = None
    """--prompt chat: the system message (as prompt_options.system of rlvr train)."""
    user_template: str | None = None
    """--prompt chat: the user message, a template text or file with a {question} placeholder (as prompt_options.user_template)."""
    chat_template: Path | None = None
    """A Jinja chat template file for the tokenizer (a fresh model or a base model has none); saved with the model."""
    split: str = "train"
    """Which split of ``data`` to train on."""
    data_config: str | None = None
    """The dataset config of a hub ``data`` (as data.config of ``rlvr train``)."""
    question_field: str = "question"
    """The column holding the question (file and hub data)."""
    answer_field: str = "answer"
    """The column holding the worked solution with its final answer (file and hub data)."""
    answer_format: str = "gsm8k"
    """How the answer column ends in its final answer: gsm8k (after '####'), boxed (the last \\boxed{}), raw."""
    max_examples: int | None = None
    """Use at most this many training examples (the first ones of the split; data.train_size of rlvr train)."""
    steps: int | None = None
    """Optimizer steps; when unset, ``epochs`` passes over the data decide."""
    epochs: float = 1.0
    """Passes over the training examples (used when ``steps`` is unset)."""
    batch_size: int = 32
    """Examples per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to ``lr``."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at ``lr * min_lr_ratio``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value."""
    seed: int = 0
    """Seed for model initialisation and data order."""
    data_seed: int = 0
    """Seed of the synthetic task's generator (ignored for GSM8K)."""
    vocab_size: int = 640
    """Vocabulary of the tokenizer trained for a fresh model (at 640 every word of ``arith`` is one token)."""
    device: str = "cpu"
    """Torch device (``cpu``, ``cuda``, ``cuda:1``)."""
    progress: bool = True
    """Show a progress bar with the loss."""
    wandb: bool = False
    """Mirror metrics to Weights & Biases (needs the wandb extra)."""
    wandb_project: str = "rlvr"
    """W&B project name."""
    tensorboard: bool = False
    """Mirror metrics to TensorBoard event files under OUT/tensorboard."""
    overwrite: bool = False
    """Replace an earlier fine-tuned model in ``out`` (otherwise that is an error)."""
    save_every: int = 0
    """Checkpoint for --resume every this many steps (and on Ctrl-C or SIGTERM; 0: only then)."""
    resume: Path | None = None
    """Continue the fine-tune in this directory from its newest intact checkpoint (with its saved config; --steps, --epochs, --save-every, progress and logging may change)."""
    fresh_optimizer: bool = False
    """With --resume: accept a checkpoint that holds weights only (its trainer_state.pt deleted or lost) and continue from its step with a fresh optimizer."""


def sft_response(example: Example) -> str:
    """The r1_zero response that SFT teaches for ``example``.

    A solution that already holds ``</answer>`` is used as is; otherwise it is a rationale and gets
    the final answer appended in the r1_zero format.
    """
    if not example.solution:
        raise DataError(
            f"example {example.question[:60]!r} has no solution to learn from; SFT needs data with worked "
            "solutions (GSM8K rationales or a synthetic task)"
        )
    if "</answer>" in example.solution:
        return example.solution
    return f"{example.solution.strip()} </think> <answer> {example.ground_truth} </answer>"


def sft_pairs(examples: list[Example], prompt: str = "r1_zero") -> tuple[list[str], list[str]]:
    """``(prompts, responses)`` for SFT: each question rendered with ``prompt``, and its response."""
    return [render(prompt, ex.question) for ex in examples], [sft_response(ex) for ex in examples]


def chat_pair_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, example: Example) -> tuple[list[int], list[int]]:
    """The token ids of ``example``'s chat prompt (with the generation prompt) and of its SFT response as
    the assistant's message, ending with the template's end of turn (``rlvr.task.chat``)."""

    return tokenize_prompt_completion(
        tokenizer, prompt.example_messages(example), [{"role": "assistant", "content": sft_response(example)}]
    )


def response_nll(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Mean negative log-likelihood of the labels where ``response_mask`` is True; (B, T) inputs."""

    mask = response_mask.to(next(model.parameters()).device)
    log_probs = get_response_log_probs(model, input_ids, labels)["log_probs"]
    return -(log_probs * mask).sum() / mask.sum().clamp(min=1)


def sft_loss(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list[str], responses: list[str]
) -> tuple[torch.Tensor, int]:
    """Mean NLL over the response tokens of the batch, and the number of those tokens."""

    batch = tokenize_prompt_and_output(prompts, responses, tokenizer)
    loss = response_nll(model, batch["input_ids"], batch["labels"], batch["response_mask"])
    return loss, int(batch["response_mask"].sum())


def sft_loss_from_ids(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[list[int], list[int]]]
) -> tuple[torch.Tensor, int]:
    """``sft_loss`` for pairs already tokenized as ``(prompt ids, response ids)``."""

    batch = tokenize_from_ids([p for p, _ in pairs], [r for _, r in pairs], pad_token_id(tokenizer))
    loss = response_nll(model, batch["input_ids"], batch["labels"], batch["response_mask"])
    return loss, int(batch["response_mask"].sum())


def init_model(config: SFTConfig, examples: list[Example]) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)``: a fresh model of a named size (with a tokenizer trained on ``examples``),
    or a checkpoint from a local directory or the hub."""

    device = usable_device(config.device)
    if config.model in modeling.MODEL_SIZES:
        corpus = modeling.tokenizer_corpus(examples, None if config.prompt == CHAT else config.prompt)
        tokenizer = modeling.train_tokenizer(corpus, config.vocab_size)
        model = modeling.fresh_model(config.model, tokenizer, seed=config.seed).to(device)  # type: ignore[arg-type]  # transformers' stub of .to
        return model, tokenizer
    _check_model(config.model)
    return modeling.load_model_and_tokenizer(config.model, device=device, dtype=torch.float32)


def _check_model(name: str) -> None:

    if name in modeling.MODEL_SIZES:
        return
    if not Path(name).exists() and "/" not in name:
        raise UserError(
            f"--model {name!r} is neither a named size ({', '.join(modeling.MODEL_SIZES)}), "
            "a local directory, nor a hub id (owner/name)"
        )
    modeling.check_model_source(name)


OUTPUT_FILES = ("config.json", "model.safetensors", "sft_config.json", "metrics.jsonl", "summary.json", "checkpoints")
RESUMABLE = ("steps", "epochs", "save_every", "progress", "wandb", "wandb_project", "tensorboard")
"""Settings that ``--resume`` takes from the command line; the others come from the run's sft_config.json."""
SFT_RANGES: dict[str, Range] = {
    "max_examples": AT_LEAST_ONE,
    "steps": AT_LEAST_ONE,
    "epochs": POSITIVE,
    "batch_size": AT_LEAST_ONE,
    "lr": POSITIVE,
    "warmup_steps": NON_NEGATIVE,
    "min_lr_ratio": PROBABILITY,
    "weight_decay": NON_NEGATIVE,
    "max_grad_norm": POSITIVE,
    "seed": NON_NEGATIVE,
    "data_seed": NON_NEGATIVE,
    "vocab_size": AT_LEAST_ONE,
    "save_every": NON_NEGATIVE,
}
"""The allowed range of every numeric field of ``SFTConfig`` (``rlvr.ranges``)."""


def check_args(config: SFTConfig) -> None:
    """Reject impossible arguments before any work (``UserError``); ``--out`` is checked under its
    lock by ``run_sft``."""

    check_flags(
        config,
        SFT_RANGES,
        [
            (
                config.steps is not None and config.steps < 1,
                f"--steps must be >= 1 (or left out to use --epochs), got {config.steps}",
            ),
            (config.epochs <= 0, f"--epochs must be > 0, got {config.epochs}"),
            (config.batch_size < 1, f"--batch-size must be >= 1, got {config.batch_size}"),
            (config.lr <= 0, f"--lr must be > 0, got {config.lr}"),
            (config.warmup_steps < 0, f"--warmup-steps must be >= 0, got {config.warmup_steps}"),
            (not 0 <= config.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {config.min_lr_ratio}"),
            (config.max_grad_norm <= 0, f"--max-grad-norm must be > 0, got {config.max_grad_norm}"),
            (
                config.max_examples is not None and config.max_examples < 1,
                f"--max-examples must be >= 1 (or left out for all), got {config.max_examples}",
            ),
            (
                config.fresh_optimizer and config.resume is None,
                "--fresh-optimizer applies to a resumed run: pass it with --resume DIR",
            ),
        ],
    )
    _check_model(config.model)


# The flags that a training config file (--config) sets instead, and the keys they come from.
CONFIG_FLAGS = (
    "data",
    "split",
    "max_examples",
    "data_config",
    "question_field",
    "answer_field",
    "answer_format",
    "prompt",
    "system",
    "user_template",
    "data_seed",
)


def with_training_config(config: SFTConfig) -> SFTConfig:
    """``config`` with the data and prompt settings of its ``--config`` training config file (none: as is);
    ``UserError`` when flags that the file sets are also given."""

    if config.config is None:
        return config
    defaults = SFTConfig()
    given = [f"--{k.replace('_', '-')}" for k in CONFIG_FLAGS if getattr(config, k) != getattr(defaults, k)]
    if given:
        raise UserError(
            f"--config {config.config} sets the data and the prompt; leave out {', '.join(given)} (or leave out --config)"
        )
    train = load_config_file(config.config)
    d, o = train.data, train.prompt_options
    return dataclasses.replace(
        config,
        data=d.train_source,
        split=d.train_split,
        max_examples=d.train_size,
        data_config=d.config,
        question_field=d.question_field,
        answer_field=d.answer_field,
        answer_format=d.answer_format,
        prompt=train.prompt,
        system=o.system,
        user_template=o.user_template,
        data_seed=train.seed,
    )


def run_sft(config: SFTConfig) -> Path:
    """Fine-tune per ``config`` (or resume ``config.resume``) and save the model; returns the output
    directory, locked before anything in it is read or replaced (``rlvr.training.scaffold``)."""
    if config.resume is None:
        config = with_training_config(config)
        check_args(config)
        # An earlier fine-tune's metrics go with it, or the new run's would be appended to them.
        replaced = ("metrics.jsonl", "tensorboard", "summary.json", "checkpoints")
        with claimed_output_dir(config.out, OUTPUT_FILES, config.overwrite, replaces=replaced, command="rlvr sft"):
            return _run(config, None)
    run_dir = Path(config.resume)
    if not run_dir.is_dir():
        raise UserError(f"--resume {run_dir}: no such directory; give the directory of an earlier `rlvr sft` run")
    with RunDirLock(run_dir, command="rlvr sft"):
        config = resumed_settings(
            config, run_dir, "sft_config.json", RESUMABLE, "rlvr sft", accepts=lambda saved: "command" not in saved
        )
        check_args(config)
        ckpt = resumable_checkpoint(run_dir, fresh_optimizer=config.fresh_optimizer)
        if ckpt is not None:
            refuse_edited_settings(ckpt, saved_settings(config), (*RESUMABLE, "out"), run_dir / "sft_config.json")
        else:
            print(f"rlvr: {run_dir} holds no checkpoint; starting the run again from step 0", file=sys.stderr)
            remove_outputs(run_dir, ("metrics.jsonl", "summary.json"))
        return _run(config, ckpt)


def _rng_to_json(rng: random.Random) -> list[Any]:
    """``rng``'s state as JSON-able lists (``getstate`` holds tuples)."""
    version, internal, gauss_next = rng.getstate()
    return [version, list(internal), gauss_next]


def _rng_from_json(state: list[Any]) -> random.Random:
    rng = random.Random()
    rng.setstate((state[0], tuple(state[1]), state[2]))
    return rng


def next_batch(rng: random.Random, order: list[int], n_examples: int, batch_size: int) -> tuple[list[int], list[int]]:
    """``(indices of the next batch, the order left)``: ``order`` is topped up with a fresh shuffle of the
    ``n_examples`` examples (drawn from ``rng``) whenever fewer than ``batch_size`` are left."""
    if len(order) < batch_size:
        perm = list(range(n_examples))
        rng.shuffle(perm)
        order = order + perm
    return order[:batch_size], order[batch_size:]


def _run(config: SFTConfig, ckpt: Path | None) -> Path:
    """The work of ``run_sft`` in its claimed output directory, from ``ckpt`` (None: step 0)."""
    from tqdm.auto import tqdm

    examples = load_examples(
        config.data,
        split=config.split,
        limit=config.max_examples,
        seed=config.data_seed,
        question_field=config.question_field,
        answer_field=config.answer_field,
        answer_format=config.answer_format,
        config=config.data_config,
        option_prefix="--",
    )
    if not examples:
        raise UserError(f"no training examples in {config.data!r} (split {config.split!r}); check --data and --split")

    prompt = resolve_prompt(config.prompt, config.system, config.user_template)
    check_chat_rows(prompt, [("train", examples)])
    chat_template = read_chat_template(config.chat_template)
    if prompt.kind == CHAT and chat_template is None:
        check_chat_template_before_load(
            str(ckpt / "model") if ckpt is not None else config.model, "--prompt chat", "pass --chat-template FILE"
        )
    responses = [sft_response(ex) for ex in examples]
    torch.manual_seed(config.seed)
    if ckpt is None:
        model, tokenizer = init_model(config, examples)
    else:
        device = usable_device(config.device)
        model, tokenizer = modeling.load_model_and_tokenizer(ckpt / "model", device=device, dtype=torch.float32)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    prompt = prompt.bind(tokenizer)
    if prompt.kind == CHAT:  # token ids cut where the generation prompt ends, as rlvr.task.chat renders them
        pair_ids = [chat_pair_ids(tokenizer, prompt, ex) for ex in examples]
    else:
        prompts = [prompt.render_example(ex) for ex in examples]
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)

    batch_size = min(config.batch_size, len(examples))
    total = config.steps if config.steps is not None else max(1, math.ceil(config.epochs * len(examples) / batch_size))
    rng = random.Random(config.seed)
    order: list[int] = []
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    begin = 0
    if ckpt is not None:
        loop = load_trainer_state(ckpt, optimizer, None)
        begin = loop["step"]
        if "order" in loop:
            rng, order = _rng_from_json(loop["rng"]), list(loop["order"])
        else:  # weights only (--fresh-optimizer): the data order is replayed to the checkpoint's step
            for _ in range(begin):
                _, order = next_batch(rng, order, len(examples), batch_size)
        truncate_metrics(out / "metrics.jsonl", begin)
    start = time.time()
    settings = saved_settings(config)
    atomic_write_json(out / "sft_config.json", settings)

    def save(step: int) -> None:
        state = {"order": list(order), "rng": _rng_to_json(rng)}
        save_checkpoint(out, step, model, tokenizer, optimizer, None, state=state, run_config=settings)

    run = TrainingRun(out, total, f"rlvr sft --resume {out}", save, start=begin, resumed=ckpt is not None)
    logger = MetricsLogger(out, settings, config.wandb, config.wandb_project, config.tensorboard)
    with contextlib.closing(logger), run.guarded():
        with tqdm(total=total, initial=begin, desc="sft", disable=not config.progress) as bar:
            for step in range(begin, total):
                with run.step_block(step + 1):
                    idx, order = next_batch(rng, order, len(examples), batch_size)
                    scale = lr_factor(step, total, "cosine", config.warmup_steps, config.min_lr_ratio)
                    for group in optimizer.param_groups:
                        group["lr"] = config.lr * scale
                    if prompt.kind == CHAT:
                        loss, n_tokens = sft_loss_from_ids(model, tokenizer, [pair_ids[i] for i in idx])
                    else:
                        loss, n_tokens = sft_loss(
                            model, tokenizer, [prompts[i] for i in idx], [responses[i] for i in idx]
                        )
                    loss.backward()
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    record = {
                        "step": step + 1,
                        "train/loss": loss.item(),
                        "lr": config.lr * scale,
                        "train/grad_norm": grad_norm,
                        "train/n_tokens": n_tokens,
                        "time": round(time.time() - start, 3),
                    }
                    logger.log(record)
                if config.save_every and (step + 1) % config.save_every == 0 and step + 1 < total:
                    run.checkpoint()
                bar.set_postfix(loss=f"{record['train/loss']:.3f}")
                bar.update(1)
        model.eval()
        save_model_and_tokenizer(model, tokenizer, out)
    run.summary("finished")
    return out


def main(argv: list[str] | None = None) -> int:
    import tyro

    if argv and argv[0] == "instruct":  # instruction tuning on packed {prompt, response} data
        return instruct_main(argv[1:])

    config = tyro.cli(SFTConfig, args=argv, prog="rlvr sft", description=__doc__.split("\n\n")[0])
    out = run_sft(config)
    print(f"saved the fine-tuned model and tokenizer to {out}")
    return 0
