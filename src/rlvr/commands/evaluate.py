"""`rlvr eval`: prompting baselines and validation.

For each prompt the model answers every question (``n`` samples each) through an engine; each
response is graded by the reward (``--reward``, else the prompt's own) and falls in one of three
categories:

* ``correct``: formatted and right (format 1, answer above 0.5);
* ``formatted_wrong``: formatted but wrong (format 1, answer 0);
* ``unformatted``: the grader could not find an answer (format 0).

``DIR/results.json`` holds ``{"config": ..., "results": {prompt: metrics}}`` where metrics are ``n``
(graded responses), ``accuracy`` (mean reward), ``format_rate``, ``mean_response_length`` (tokens),
``truncated_rate`` (share that hit the token limit), ``categories``, ``tokens_per_s`` and ``time_s``;
with ``n`` = k samples per question also ``avg_at_k`` (the share of a question's k samples that are
correct, averaged over questions) and ``pass_at_k`` (``{j: pass@j}`` for j = 1, 2, 4, ... and k: the
chance that at least one of j samples drawn from the k is correct, by the unbiased estimator of Chen
et al. 2021); with a reward that reports extra numbers, ``rewards`` (the mean of each).
The prompt, data and reward flags are those of training (``--prompt chat``, ``--question-field``,
``--reward path/to/file.py:function``, ...); ``--config FILE`` takes them from a training config
instead and evaluates its validation sets, keyed by their names when ``data.val_sources`` names them.
``DIR/samples.jsonl`` has one line per response. The trainer calls ``evaluate()`` for validation.
``rlvr eval`` checks its arguments and ``--out`` before loading anything, and refuses to replace an
earlier evaluation's results in ``--out`` unless given ``--overwrite``.

    rlvr eval --model allenai/OLMo-2-0425-1B --prompt r1_zero --prompt question_only \\
        --data openai/gsm8k --split test --limit 1024 --out runs/eval-base
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import tyro

from rlvr import modeling
from rlvr.config import (
    DataConfig,
    EngineConfig,
    ModelConfig,
    PromptOptions,
    RewardConfig,
    TrainConfig,
    load_config_file,
)
from rlvr.engines import build_engine, make_engine
from rlvr.engines.base import SamplingParams, generate_in_chunks
from rlvr.environments import episodes_for
from rlvr.environments.rollout import episode_metrics
from rlvr.errors import UserError
from rlvr.grpo.advantages import pass_at_k
from rlvr.machine import usable_device
from rlvr.modeling import check_model_source
from rlvr.ranges import (
    ABOVE_ZERO_TO_ONE,
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Range,
    check_flags,
    flag_name,
    range_problems,
)
from rlvr.suites.run import main as suite_main
from rlvr.task.build import (
    DataSource,
    TaskConfigError,
    build_prompt,
    check_chat_rows,
    check_chat_tokenizer,
    prepare_reward,
    set_rewards,
    task_config_problems,
    val_sources,
)
from rlvr.task.prompts import CHAT, Prompt, resolve_prompt
from rlvr.task.rewards import BUILTIN_REWARDS, Reward, row_fields, score_responses
from rlvr.tokens import context_length, longest_prompt
from rlvr.training.checkpoint import run_model
from rlvr.training.rundir import atomic_write_json, atomic_write_jsonl
from rlvr.training.scaffold import claimed_output_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rlvr.engines.base import Engine
    from rlvr.task.data import Example

CATEGORIES = ("correct", "formatted_wrong", "unformatted")


@dataclass
class EvalConfig:
    """Evaluate one or several prompts on a model and write results.json and samples.jsonl."""

    model: str
    """Local model directory, hub id (e.g. allenai/OLMo-2-0425-1B), or an rlvr train run directory (its best model; see --checkpoint)."""
    out: Path
    """Output directory for results.json and samples.jsonl."""
    prompt: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Prompt to evaluate: a built-in (r1_zero, question_only, r1_zero_three_shot), a template file with a {question} placeholder, or chat (the model's chat template); repeat the flag for several (default: r1_zero)."""
    system: str | None = None
    """prompt chat: the system message."""
    user_template: str | None = None
    """prompt chat: the user message, a template text or file with a {question} placeholder."""
    stop: tuple[str, ...] | None = None
    """Stop strings, replacing the prompt's own."""
    reward: str | None = None
    """Reward function: r1_zero, question_only, boxed, exact, package.module:function or path/to/file.py:function (default: each prompt's own)."""
    reward_fns: tuple[str, ...] = ()
    """Several reward functions summed with --reward-weights (instead of --reward)."""
    reward_weights: tuple[float, ...] = ()
    """Weight of each of --reward-fns (default: 1 each)."""
    reward_timeout_s: float = 10.0
    """Seconds one call of a user reward function may take (then it scores 0 and is counted)."""
    data: str = "openai/gsm8k"
    """Data: a JSONL, JSON, Parquet or CSV file, a folder with the split's file, a hub dataset id, or a task such as arith:steps=2."""
    split: str = "test"
    """Data split to evaluate."""
    data_config: str | None = None
    """Config (subset) name of a hub dataset."""
    question_field: str = "question"
    """Column that holds the question."""
    answer_field: str = "answer"
    """Column that holds the answer; the other columns reach the reward function."""
    answer_format: str = "gsm8k"
    """How the ground truth comes out of the answer: gsm8k (after the last ####), boxed (the last \\boxed{}) or raw."""
    config: Path | None = None
    """A training config file: evaluate its validation sets with its prompt, data and reward settings (instead of the flags above)."""
    limit: int | None = None
    """Evaluate only the first N questions (of each validation set with --config)."""
    temperature: float = 1.0
    """Sampling temperature (0 is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 512
    """Maximum new tokens per response."""
    seed: int = 0
    """Sampling seed; the same seed reproduces the run."""
    n: int = 1
    """Samples per question."""
    engine: Literal["hf", "hf-fast", "auto", "hf-worker", "vllm"] = "hf"
    """Rollout engine: hf (in-process), hf-fast (in-process with a static KV cache and CUDA graphs: the fast one on a GPU; OLMo-2, Llama, Qwen2 and Qwen3 models), auto (hf-fast when it runs the model, else hf), hf-worker (its own process and device) or vllm (a running vLLM server)."""
    device: str = "auto"
    """Device for the model: auto (cuda when available), cpu, cuda, cuda:1, ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Model dtype; auto is bfloat16 on CUDA and float32 on CPU."""
    batch_size: int = 64
    """Maximum sequences decoded together by the hf, hf-fast and hf-worker engines."""
    examples: int = 2
    """Examples printed per category."""
    overwrite: bool = False
    """Replace the results of an earlier evaluation in ``out`` (otherwise that is an error)."""
    checkpoint: Literal["best", "latest"] = "best"
    """With --model a training run directory: evaluate its best model (checkpoints/best) or its latest checkpoint."""


def resolve_run_model(cfg: EvalConfig, echo: Callable[[str], object] = print) -> EvalConfig:
    """``cfg`` with ``--model`` a training run directory replaced by the model folder it left (best by
    default, ``--checkpoint latest`` for the newest checkpoint), saying which."""
    found = run_model(cfg.model, cfg.checkpoint)
    if found is None:
        if (Path(cfg.model) / "checkpoints").is_dir():
            raise UserError(
                f"--model {cfg.model} is a training run without a saved model yet (no checkpoints/best or complete "
                "checkpoint); wait for its first validation or checkpoint, or give a model directory"
            )
        return cfg
    path, which = found
    echo(f"rlvr eval: {cfg.model} is a training run; evaluating {which}: {path}")
    return dataclasses.replace(cfg, model=str(path))


def _category(format_reward: float, answer_reward: float) -> str:
    if format_reward < 0.5:
        return "unformatted"
    return "correct" if answer_reward > 0.5 else "formatted_wrong"


def evaluate(
    model: torch.nn.Module | None,
    tokenizer: PreTrainedTokenizerBase | None,
    examples: Sequence[Example],
    prompt_name: Prompt | str,
    engine: Engine | None = None,
    params: SamplingParams | None = None,
    progress: bool = False,
    chunk_size: int = 256,
    reward: Callable[[str, str], dict] | None = None,
    render: Callable[[Sequence[Example], Prompt], list[str]] | None = None,
) -> tuple[dict, list[dict]]:
    """Sample, grade and summarise ``examples`` under a prompt: a ``Prompt`` or a name ``resolve_prompt`` takes.

    ``engine`` defaults to an in-process ``HFEngine`` on ``model``. The prompt owns its stop strings
    (they replace ``params.stop`` and are kept in the output). Questions go to the engine in chunks of
    ``chunk_size`` (chunk ``i`` uses seed ``params.seed + i``), which is what the progress bar counts.
    ``reward`` grades the responses (default: the prompt's own); a ``Reward`` also gets each
    example's other fields and adds ``rewards`` (the mean of each extra number it reports) to the metrics.
    ``render(examples, prompt)`` makes the engine's inputs instead of the prompt (a multi-turn
    environment's openings, with an engine that plays whole conversations).
    Returns ``(metrics, samples)``; see the module docstring for the metric keys.
    """

    prompt = prompt_name if isinstance(prompt_name, Prompt) else resolve_prompt(prompt_name)
    prompt = prompt.bind(tokenizer)
    prompt_name = prompt.name
    if engine is None:
        if model is None or tokenizer is None:
            raise ValueError("evaluate needs an engine, or a model and its tokenizer for the default hf engine")
        engine = make_engine("hf", model, tokenizer)
    params = params or SamplingParams()
    params = dataclasses.replace(params, stop=prompt.stop, include_stop_str_in_output=True)
    reward_fn = reward if reward is not None else BUILTIN_REWARDS[prompt.default_reward]
    prompts = render(examples, prompt) if render is not None else [prompt.render_example(ex) for ex in examples]

    outputs, elapsed = generate_in_chunks(
        engine, prompts, params, chunk_size, progress=f"eval {prompt_name}" if progress else None, seed_per_chunk=True
    )

    samples = []
    flat = [
        (q, j, ex, text, comp)
        for q, (ex, text, group) in enumerate(zip(examples, prompts, outputs))
        for j, comp in enumerate(group)
    ]
    if isinstance(reward_fn, Reward):
        _, meta = score_responses(
            reward_fn,
            [f[4].text for f in flat],
            [f[2].ground_truth for f in flat],
            [row_fields(f[2].fields, f[3], prompt.example_messages(f[2])) for f in flat],
        )
        scores, extra = meta["scores"], meta["logged"]
    else:
        scores, extra = [reward_fn(f[4].text, f[2].ground_truth) for f in flat], {}
    for (q, j, ex, text, comp), r in zip(flat, scores):
        samples.append(
            {
                "prompt_name": prompt_name,
                "question_index": q,
                "sample_index": j,
                "question": ex.question,
                "prompt": text,
                "response": comp.text,
                "ground_truth": ex.ground_truth,
                "format_reward": float(r.get("format_reward", 0.0)),
                "answer_reward": float(r.get("answer_reward", r["reward"])),
                "reward": float(r["reward"]),
                "finish_reason": comp.finish_reason,
                "num_tokens": len(comp.token_ids),
                "category": _category(r.get("format_reward", 0.0), r.get("answer_reward", r["reward"])),
                **{
                    k: v
                    for k, v in r.items()
                    if k not in ("reward", "format_reward", "answer_reward") and not (k == "timed_out" and not v)
                },
            }
        )
    n = len(samples)
    tokens = sum(s["num_tokens"] for s in samples)
    mean = (lambda key: sum(s[key] for s in samples) / n) if n else (lambda key: 0.0)
    metrics = {
        "n": n,
        "accuracy": mean("reward"),
        "format_rate": mean("format_reward"),
        "mean_response_length": tokens / n if n else 0.0,
        "truncated_rate": (sum(s["finish_reason"] == "length" for s in samples) / n) if n else 0.0,
        "categories": {c: sum(s["category"] == c for s in samples) for c in CATEGORIES},
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "time_s": elapsed,
    }
    if extra:
        metrics["rewards"] = {k.removeprefix("reward/"): v for k, v in extra.items()}
    conversations = [f[4] for f in flat if "pieces" in f[4].meta]
    if conversations:
        metrics["episodes"] = {k.removeprefix("train/"): v for k, v in episode_metrics(conversations).items()}
    k = params.n
    if n and k > 1:
        metrics.update(sample_metrics([s["category"] == "correct" for s in samples], k))
    return metrics, samples


def sample_metrics(correct: list[bool], k: int) -> dict:
    """``avg_at_k`` and ``pass_at_k`` (``{j: value}`` for j = 1, 2, 4, ... up to k, and k itself) over
    questions with k graded samples each, ``correct`` in question order."""
    import torch

    if len(correct) % k:
        raise ValueError(f"{len(correct)} samples is not a whole number of questions with {k} samples each")
    ks = sorted({2**i for i in range(k.bit_length()) if 2**i <= k} | {k})
    return {
        "avg_at_k": sum(correct) / len(correct),
        "pass_at_k": {str(j): v for j, v in pass_at_k(torch.tensor(correct, dtype=torch.float64), k, ks).items()},
    }


def print_report(results: dict[str, dict], samples: list[dict], examples_per_category: int = 2) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="rlvr eval")
    k = max((int(j) for m in results.values() for j in m.get("pass_at_k", {})), default=0)
    columns = [
        "prompt",
        "n",
        "accuracy",
        "format",
        "mean len",
        "truncated",
        "correct",
        "fmt wrong",
        "unformatted",
        "tok/s",
    ] + ([f"avg@{k}", f"pass@{k}"] if k else [])
    for col in columns:
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for name, m in results.items():
        c = m["categories"]
        row = [
            name,
            str(m["n"]),
            f"{m['accuracy']:.3f}",
            f"{m['format_rate']:.3f}",
            f"{m['mean_response_length']:.1f}",
            f"{m['truncated_rate']:.3f}",
            str(c["correct"]),
            str(c["formatted_wrong"]),
            str(c["unformatted"]),
            f"{m['tokens_per_s']:.0f}",
        ]
        if k:
            row += [f"{m['avg_at_k']:.3f}", f"{m['pass_at_k'][str(k)]:.3f}"] if "avg_at_k" in m else ["", ""]
        table.add_row(*row)
    console.print(table)
    for name in results:
        for cat in CATEGORIES:
            picked = [s for s in samples if s["prompt_name"] == name and s["category"] == cat][:examples_per_category]
            for s in picked:
                response = s["response"] if len(s["response"]) <= 400 else s["response"][:400] + " ..."
                console.rule(f"{name} · {cat} · question {s['question_index']} · truth {s['ground_truth']}")
                console.print(response, markup=False, highlight=False)


OUTPUT_FILES = ("results.json", "samples.jsonl")
EVAL_RANGES: dict[str, Range] = {
    "reward_weights": NON_NEGATIVE,
    "reward_timeout_s": POSITIVE,
    "limit": AT_LEAST_ONE,
    "temperature": NON_NEGATIVE,
    "top_p": ABOVE_ZERO_TO_ONE,
    "max_tokens": AT_LEAST_ONE,
    "seed": NON_NEGATIVE,
    "n": AT_LEAST_ONE,
    "batch_size": AT_LEAST_ONE,
    "examples": NON_NEGATIVE,
}
"""The allowed range of every numeric field of ``EvalConfig`` (``rlvr.ranges``)."""


def check_args(cfg: EvalConfig) -> None:
    """Reject impossible arguments before any work (``UserError``); ``--out`` is checked under its
    lock by ``run``."""

    check_flags(
        cfg,
        EVAL_RANGES,
        [
            (
                cfg.limit is not None and cfg.limit < 1,
                f"--limit must be >= 1 (or left out for every question), got {cfg.limit}",
            ),
            (cfg.n < 1, f"--n must be >= 1, got {cfg.n}"),
            (cfg.max_tokens < 1, f"--max-tokens must be >= 1, got {cfg.max_tokens}"),
            (cfg.batch_size < 1, f"--batch-size must be >= 1, got {cfg.batch_size}"),
            (cfg.temperature < 0, f"--temperature must be >= 0 (0 is greedy), got {cfg.temperature}"),
            (not 0 < cfg.top_p <= 1, f"--top-p must be in (0, 1], got {cfg.top_p}"),
            (cfg.examples < 0, f"--examples must be >= 0, got {cfg.examples}"),
        ],
    )
    if cfg.temperature == 0 and cfg.n > 1:
        warnings.warn(
            f"--temperature 0 is greedy decoding: the --n {cfg.n} samples of a question are the same answer, so "
            "pass@k and avg@k equal one sample's accuracy; sample with --temperature > 0 or use --n 1",
            stacklevel=2,
        )
    check_model_source(cfg.model)


# -- the task of rlvr eval --------------------------------------------------------------------------------------

# The rlvr eval flags that a training config file (--config) sets instead.
EVAL_TASK_FLAGS = (
    "prompt",
    "system",
    "user_template",
    "stop",
    "reward",
    "reward_fns",
    "reward_weights",
    "reward_timeout_s",
    "data",
    "split",
    "data_config",
    "question_field",
    "answer_field",
    "answer_format",
)


@dataclass
class EvalTasks:
    """What ``rlvr eval`` evaluates: prompts x data sets, graded by the reward of each prompt."""

    configs: list
    """One ``TrainConfig`` per prompt, holding that prompt's prompt, data and reward settings."""
    prompts: list
    sources: list[DataSource]

    def load_data(self) -> list[tuple[str, list]]:
        return [(s.name, s.load()) for s in self.sources]

    def rewards(self, examples: list[Example]) -> list[Reward]:
        """One started ``Reward`` per prompt (user functions checked against the fields of ``examples``)."""
        return [prepare_reward(c, examples, p) for c, p in zip(self.configs, self.prompts)]

    def result_name(self, set_name: str, prompt: Prompt) -> str:
        if not set_name:
            return prompt.name
        return set_name if len(self.prompts) == 1 else f"{set_name}/{prompt.name}"


def eval_tasks(cfg: EvalConfig) -> EvalTasks:
    """The prompts, data sets and rewards of ``rlvr eval`` flags (an ``EvalConfig``), or of the training
    config file it names with ``--config`` (its validation sets, as validation in training reads them).
    ``TaskConfigError`` for settings that cannot work, before anything loads."""
    if cfg.config is not None:
        defaults = EvalConfig(model=cfg.model, out=cfg.out)
        given = [f"--{k.replace('_', '-')}" for k in EVAL_TASK_FLAGS if getattr(cfg, k) != getattr(defaults, k)]
        if given:
            raise TaskConfigError(
                f"--config {cfg.config} sets the prompt, data and reward; leave out "
                f"{', '.join(given)} (or leave out --config)"
            )
        train_config = dataclasses.replace(load_config_file(cfg.config), model=ModelConfig(name_or_path=cfg.model))
        configs = [train_config]
        sources = val_sources(train_config) if (train_config.data.val_size or train_config.data.val_sources) else []
        if not sources:
            raise TaskConfigError(
                f"{cfg.config} has no validation set (data.val_size is 0); set data.val_size or data.val_sources there"
            )
        if cfg.limit is not None:
            sources = [dataclasses.replace(s, size=cfg.limit) for s in sources]
    else:
        data = DataConfig(
            train_source=cfg.data,
            val_split=cfg.split,
            config=cfg.data_config,
            question_field=cfg.question_field,
            answer_field=cfg.answer_field,
            answer_format=cfg.answer_format,
        )
        names = list(dict.fromkeys(cfg.prompt or ("r1_zero",)))
        chat_flags = [f for f, v in (("--system", cfg.system), ("--user-template", cfg.user_template)) if v is not None]
        if chat_flags and CHAT not in names:
            flags, verb = " and ".join(chat_flags), "apply" if len(chat_flags) > 1 else "applies"
            raise TaskConfigError(
                f"{flags} {verb} to --prompt chat (the model's chat template), not to {', '.join(names)}; "
                f"add --prompt chat or leave {flags} out"
            )
        # Beside a chat prompt, --system and --user-template are that prompt's; the others keep --stop alone.
        chat_options = PromptOptions(system=cfg.system, user_template=cfg.user_template, stop=cfg.stop)
        other_options = PromptOptions(stop=cfg.stop)
        reward = RewardConfig(
            fn=cfg.reward, fns=cfg.reward_fns, weights=cfg.reward_weights, timeout_s=cfg.reward_timeout_s
        )
        configs = [
            TrainConfig(
                model=ModelConfig(name_or_path=cfg.model),
                data=data,
                prompt=p,
                prompt_options=chat_options if p == CHAT else other_options,
                reward=reward,
            )
            for p in names
        ]
        sources = [
            DataSource(
                "",
                cfg.data,
                cfg.split,
                cfg.limit,
                cfg.data_config,
                cfg.question_field,
                cfg.answer_field,
                cfg.answer_format,
            )
        ]
    problems = list(dict.fromkeys(p for c in configs for p in task_config_problems(c)))
    if problems:
        raise TaskConfigError("; ".join(problems))
    prompts = [build_prompt(c) for c in configs]
    if any(p.kind == "chat" for p in prompts):
        check_chat_tokenizer(cfg.model)
    return EvalTasks(configs, prompts, sources)


def run(cfg: EvalConfig) -> dict:
    cfg = resolve_run_model(cfg)
    out_of_range = range_problems(cfg, EVAL_RANGES, flag_name)  # named by flag, before the task is built
    if out_of_range:
        raise UserError("; ".join(out_of_range))
    tasks = eval_tasks(cfg)  # the prompts, data sets and reward, checked before anything loads
    if not cfg.prompt:
        cfg = dataclasses.replace(cfg, prompt=tuple(p.name for p in tasks.prompts))
    check_args(cfg)
    # The lock before --out is read or written: a second evaluation into it is refused, not mixed in.
    with claimed_output_dir(cfg.out, OUTPUT_FILES, cfg.overwrite, command="rlvr eval"):
        return _run(cfg, tasks)


def _check_prompt_lengths(
    cfg: EvalConfig,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    tasks: EvalTasks,
    data_sets: list[tuple[str, list[Example]]],
) -> None:
    """Refuse, before any generation, a prompt that leaves no room for --max-tokens in the model's context."""
    context = context_length(model)
    if context is None:
        return
    for set_name, examples in data_sets:
        for prompt in tasks.prompts:
            bound = prompt.bind(tokenizer)
            index, tokens = longest_prompt(tokenizer, [bound.render_example(ex) for ex in examples])
            if tokens > context - cfg.max_tokens:
                raise UserError(
                    f"question {index + 1} of {set_name or cfg.data} makes a {prompt.name} prompt of {tokens} tokens; "
                    f"with --max-tokens {cfg.max_tokens} it needs more than the model's context of {context} positions. "
                    "Leave out the long questions (--limit, or a smaller data file) or lower --max-tokens"
                )


def _run(cfg: EvalConfig, tasks: EvalTasks) -> dict:
    import torch

    device = usable_device(cfg.device)
    dtype = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    data_sets = tasks.load_data()
    for set_name, examples in data_sets:
        if not examples:
            raise UserError(f"no examples loaded from {set_name or cfg.data!r}; check --data and --split")
    for prompt in tasks.prompts:
        check_chat_rows(prompt, data_sets)
    rewards = tasks.rewards(data_sets[0][1])
    own_rewards = set_rewards(tasks.configs[0], tasks.sources, data_sets)
    # Through the module, so that a test can make loading fail and prove that every check runs before it.
    model, tokenizer = modeling.load_model_and_tokenizer(cfg.model, device=device, dtype=dtype)
    # A vLLM server takes the second GPU, beside the model loaded here for the tokenizer and grading.
    engine_device = "cuda:1" if cfg.engine == "vllm" else device
    engine = build_engine(
        EngineConfig(name=cfg.engine, device=engine_device, max_batch_size=cfg.batch_size),
        model,
        tokenizer,
        served_model=cfg.model,
    )
    params = SamplingParams(
        n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_tokens, seed=cfg.seed
    )
    results, all_samples = {}, []
    try:
        _check_prompt_lengths(cfg, model, tokenizer, tasks, data_sets)  # before the engine generates
        # A training config's multi-turn environment plays each question out as in its validation.
        episodes = [
            episodes_for(c, tokenizer, prompt.bind(tokenizer)) for c, prompt in zip(tasks.configs, tasks.prompts)
        ]
        for set_name, examples in data_sets:
            for prompt, reward, played in zip(tasks.prompts, rewards, episodes):
                metrics, samples = evaluate(
                    model,
                    tokenizer,
                    examples,
                    prompt,
                    engine if played is None else played.engine(engine),
                    params,
                    progress=True,
                    reward=own_rewards.get(set_name, reward),
                    render=None if played is None else played.render,
                )
                key = tasks.result_name(set_name, prompt)
                results[key] = metrics
                all_samples += [dict(s, prompt_name=key) for s in samples]
    finally:
        engine.close()
        for reward in [*rewards, *own_rewards.values()]:
            reward.close()

    cfg.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}
    config["prompt"] = list(cfg.prompt)
    atomic_write_jsonl(cfg.out / "samples.jsonl", all_samples)
    atomic_write_json(cfg.out / "results.json", {"config": config, "results": results})
    print_report(results, all_samples, cfg.examples)
    return results


USAGE = (
    "Prompting baselines and validation: each prompt's answers graded by the reward, with accuracy, format "
    "categories and samples in --out.\n\n"
    "`rlvr eval --suite mmlu gsm8k alpaca_eval sst --model M --out DIR` runs the assistant suites instead "
    "(`rlvr eval --suite mmlu --help` lists their options)."
)


def main(argv: list[str] | None = None) -> int:
    # The assistant suites (mmlu, gsm8k, alpaca_eval, sst) have their own options.
    if argv and any(a == "--suite" or a.startswith("--suite=") for a in argv):
        return suite_main(argv)
    cfg = tyro.cli(EvalConfig, args=argv, prog="rlvr eval", description=USAGE)
    run(cfg)
    return 0
