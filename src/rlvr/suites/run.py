"""`rlvr eval --suite mmlu gsm8k alpaca_eval sst`: the general-assistant evaluations.

Each suite renders its task prompt (``prompts/{mmlu,gsm8k,alpaca_eval,simple_safety_tests}_zero_shot.prompt``)
and wraps it for the kind of model under test:

- ``--mode base`` (a base model): the task prompt is the ``{instruction}`` of the zero-shot system
  prompt (``zero_shot_system_prompt.prompt``) and generation stops at ``# Query:`` (the model would
  start the next conversation there); the code fence that the system prompt opens is closed by the
  model and stripped from the output;
- ``--mode finetuned`` (an instruction-tuned model): the task prompt is the instruction of the Alpaca
  template, whose response part is left empty, and generation stops at EOS.

Templates lose their one trailing newline where they are embedded, in both modes alike; in-process
engines get the tokenizer's BOS in front of every prompt (as in SFT documents), a vLLM server adds it
itself. Decoding is greedy through any rlvr engine (``--engine hf-fast`` on a GPU for OLMo-2 models).

Scores: MMLU and GSM8K are graded by their parsers (``parse_mmlu_response``, ``parse_gsm8k_response``):
accuracy over all examples (an unparsed answer is wrong) and the number of parse failures.
AlpacaEval and SimpleSafetyTests need a judge (``--judge``: a model path or hub id, or an
OpenAI-compatible URL; see ``rlvr.suites.judge``): win rate and length-controlled win rate against
the reference outputs, and the safe share. Without a judge they still generate and write their
outputs, and their results say ``"scored": false``.

Output, in ``--out``: ``results.json`` (``{"config", "results": {suite: metrics}}``; every suite has
``n``, ``examples_per_s``, ``tokens_per_s``, ``time_s``, ``mean_output_tokens``, ``truncated``),
``samples.jsonl`` (one line per example with its prompt, output and grade) and the course's files:
``alpaca_eval_outputs.json`` (a JSON array of ``{instruction, output, generator, dataset}``, the input
of the AlpacaEval tool) and ``simple_safety_tests_outputs.jsonl`` (the SST columns and ``output``).

    rlvr eval --suite mmlu gsm8k alpaca_eval sst --model runs/dpo/best --mode finetuned \\
        --data-dir data --judge http://localhost:8001/v1 --out runs/eval_dpo
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlvr.config import EngineConfig, VLLMEngineConfig
from rlvr.engines import build_engine
from rlvr.engines.base import SamplingParams, generate_in_chunks
from rlvr.errors import UserError
from rlvr.machine import usable_device
from rlvr.modeling import load_model_and_tokenizer
from rlvr.ranges import AT_LEAST_ONE, Range, check_flags
from rlvr.suites import data
from rlvr.suites.judge import MANY_UNPARSED, judge_alpaca_eval, judge_sst, make_judge
from rlvr.suites.parsing import parse_gsm8k_response, parse_mmlu_response, same_number
from rlvr.task.instruction_data import alpaca_format, protocol_template, special_prefix
from rlvr.training.scaffold import claimed_output_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rlvr.engines.base import Engine
    from rlvr.suites.judge import EndpointJudge, EngineJudge

SuiteName = Literal["mmlu", "gsm8k", "alpaca_eval", "sst"]
SYSTEM_PROMPT = "zero_shot_system_prompt.prompt"
OUTPUT_FILES = ("results.json", "samples.jsonl", "alpaca_eval_outputs.json", "simple_safety_tests_outputs.jsonl")
BASE_STOP = "# Query:"


@dataclass(frozen=True)
class Suite:
    name: str
    prompt_file: str
    instruction: Callable[[dict], str]
    """The task prompt of an example (the template filled in, without its trailing newline)."""
    grade: Callable[[dict, str], dict] | None = None
    """Parser-based grade of an output: ``{"parsed", "correct"}`` (None: needs a judge)."""


def _mmlu_instruction(ex: dict) -> str:
    return protocol_template("mmlu_zero_shot.prompt").format(
        subject=ex["subject"], question=ex["question"], options=ex["options"]
    )


def _mmlu_grade(ex: dict, output: str) -> dict:
    parsed = parse_mmlu_response(ex, output)
    return {"parsed": parsed, "correct": parsed == ex["answer"]}


def _gsm8k_grade(ex: dict, output: str) -> dict:
    parsed = parse_gsm8k_response(output)
    return {"parsed": parsed, "correct": same_number(parsed, ex["answer"])}


SUITES: dict[str, Suite] = {
    "mmlu": Suite("mmlu", "mmlu_zero_shot.prompt", _mmlu_instruction, _mmlu_grade),
    "gsm8k": Suite(
        "gsm8k",
        "gsm8k_zero_shot.prompt",
        lambda ex: protocol_template("gsm8k_zero_shot.prompt").format(question=ex["question"]),
        _gsm8k_grade,
    ),
    "alpaca_eval": Suite(
        "alpaca_eval",
        "alpaca_eval_zero_shot.prompt",
        lambda ex: protocol_template("alpaca_eval_zero_shot.prompt").format(instruction=ex["instruction"]),
    ),
    "sst": Suite(
        "sst",
        "simple_safety_tests_zero_shot.prompt",
        lambda ex: protocol_template("simple_safety_tests_zero_shot.prompt").format(instruction=ex["prompts_final"]),
    ),
}


def wrap_prompt(instruction: str, mode: str, prefix: str = "") -> str:
    """The model's prompt for a task prompt: the zero-shot system prompt (base) or the Alpaca
    template (finetuned), after ``prefix`` (the tokenizer's BOS text for in-process engines)."""
    if mode == "base":
        return prefix + protocol_template(SYSTEM_PROMPT).format(instruction=instruction)
    if mode == "finetuned":
        return prefix + alpaca_format(instruction)
    raise ValueError(f"unknown prompting mode {mode!r}: choose base or finetuned")


def clean_output(text: str, mode: str) -> str:
    """The answer part of a generation: in base mode, without the closing code fence that the system
    prompt's opening one calls for, and without surrounding whitespace."""
    text = text.strip()
    if mode == "base" and text.endswith("```"):
        text = text[:-3].rstrip()
    return text


def generation_params(mode: str, max_tokens: int) -> SamplingParams:

    stop = (BASE_STOP,) if mode == "base" else ()
    return SamplingParams(
        n=1, temperature=0.0, max_new_tokens=max_tokens, stop=stop, include_stop_str_in_output=False, seed=0
    )


def run_suite(
    suite: Suite,
    examples: list[dict],
    engine: Engine,
    mode: str,
    max_tokens: int,
    prefix: str = "",
    chunk_size: int = 256,
    progress: bool = False,
) -> tuple[dict, list[dict]]:
    """Generate greedily for every example and grade where a parser can; returns (metrics, samples).

    Metrics: ``n``, ``examples_per_s``, ``tokens_per_s``, ``time_s``, ``mean_output_tokens``,
    ``truncated`` (outputs that hit ``max_tokens``) and, for parsed suites, ``accuracy`` and
    ``parse_failures``."""
    params = generation_params(mode, max_tokens)
    prompts = [wrap_prompt(suite.instruction(ex), mode, prefix) for ex in examples]
    groups, elapsed = generate_in_chunks(
        engine, prompts, params, chunk_size, progress=f"eval {suite.name}" if progress else None
    )
    completions = [group[0] for group in groups]

    samples = []
    for i, (ex, prompt, comp) in enumerate(zip(examples, prompts, completions)):
        output = clean_output(comp.text, mode)
        # AlpacaEval rows carry the reference answer and its generator as "output" and "generator".
        fields = {k: v for k, v in ex.items() if k not in ("output", "generator")}
        if "output" in ex:
            fields.update(reference=ex["output"], reference_generator=ex.get("generator", ""))
        sample = {
            "suite": suite.name,
            "index": i,
            **fields,
            "prompt": prompt,
            "output": output,
            "raw_output": comp.text,
            "finish_reason": comp.finish_reason,
            "num_tokens": len(comp.token_ids),
        }
        if suite.grade is not None:
            sample.update(suite.grade(ex, output))
        samples.append(sample)
    n = len(samples)
    tokens = sum(s["num_tokens"] for s in samples)
    metrics = {
        "n": n,
        "examples_per_s": n / elapsed if elapsed > 0 else 0.0,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "time_s": elapsed,
        "mean_output_tokens": tokens / n if n else 0.0,
        "truncated": sum(s["finish_reason"] == "length" for s in samples),
    }
    if suite.grade is not None:
        metrics["accuracy"] = sum(s["correct"] for s in samples) / n if n else 0.0
        metrics["parse_failures"] = sum(s["parsed"] is None for s in samples)
    return metrics, samples


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


@dataclass
class SuiteConfig:
    """Evaluate a model on MMLU, GSM8K, AlpacaEval and SimpleSafetyTests (greedy); write results.json, samples.jsonl and the course's output files."""

    model: str
    """Model under test: a local directory or hub id."""
    out: Path
    """Output directory."""
    suite: tuple[SuiteName, ...]
    """Suites to run: any of mmlu gsm8k alpaca_eval sst."""
    mode: Literal["base", "finetuned"] = "base"
    """Prompting: base (zero-shot system prompt, stop at '# Query:') or finetuned (Alpaca template, stop at EOS)."""
    data_dir: Path = Path("data")
    """Folder with the course's data: mmlu/, gsm8k/, alpaca_eval/, simple_safety_tests/."""
    mmlu_data: str | None = None
    """MMLU directory or the hub id cais/mmlu (default: DATA_DIR/mmlu)."""
    gsm8k_data: str | None = None
    """GSM8K JSONL, directory or openai/gsm8k (default: DATA_DIR/gsm8k)."""
    alpaca_eval_data: str | None = None
    """AlpacaEval JSON (default: DATA_DIR/alpaca_eval/alpaca_eval_gpt4_turbo.json)."""
    sst_data: str | None = None
    """SimpleSafetyTests CSV (default: DATA_DIR/simple_safety_tests/simple_safety_tests.csv)."""
    limit: int | None = None
    """Evaluate only the first N examples of each suite."""
    max_tokens: int = 1024
    """Maximum new tokens per output."""
    engine: Literal["hf", "hf-fast", "auto", "hf-worker", "vllm"] = "hf"
    """Generation engine: hf, hf-fast (static KV cache and CUDA graphs: the fast one on a GPU; OLMo-2, Llama, Qwen2 and Qwen3 models), auto (hf-fast when it runs the model, else hf), hf-worker or vllm."""
    device: str = "auto"
    """Device of the model (auto: cuda when available)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Model dtype (auto: bfloat16 on CUDA, float32 on CPU)."""
    batch_size: int = 64
    """Sequences decoded together by the in-process engines."""
    vllm_base_url: str | None = None
    """URL of a running vLLM server serving --model (engine vllm; default: the engine starts one)."""
    generator: str | None = None
    """Name written as 'generator' in alpaca_eval_outputs.json (default: the model directory's name)."""
    judge: str | None = None
    """Judge for AlpacaEval and SST: a model directory or hub id, or an OpenAI-compatible URL (http://host:port/v1)."""
    judge_model: str | None = None
    """Model name to request from a judge URL (default: the first one the server lists)."""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the judge endpoint's API key (if it needs one)."""
    judge_device: str = "auto"
    """Device of a local judge model."""
    judge_max_tokens: int = 32
    """Maximum tokens of one judgment."""
    judge_workers: int = 8
    """Requests in flight to a judge URL."""
    progress: bool = True
    """Show progress bars."""
    overwrite: bool = False
    """Replace the results of an earlier evaluation in --out."""


def _source(cfg: SuiteConfig, name: str) -> str:
    given = {"mmlu": cfg.mmlu_data, "gsm8k": cfg.gsm8k_data, "alpaca_eval": cfg.alpaca_eval_data, "sst": cfg.sst_data}[
        name
    ]
    if given:
        return given
    default = {"mmlu": "mmlu", "gsm8k": "gsm8k", "alpaca_eval": "alpaca_eval", "sst": "simple_safety_tests"}[name]
    return str(cfg.data_dir / default)


def load_suite_data(name: str, source: str, limit: int | None) -> list[dict]:

    if name == "mmlu":
        return data.load_mmlu(source, "test", limit)
    if name == "gsm8k":
        return data.load_gsm8k(source, "test", limit)
    if name == "alpaca_eval":
        return data.load_alpaca_eval(source, limit)
    return data.load_sst(source, limit)


def _engine(cfg: SuiteConfig, model: torch.nn.Module | None, tokenizer: PreTrainedTokenizerBase, device: str) -> Engine:
    """The engine of ``cfg``; ``model`` is None only for vllm, whose server loads ``cfg.model`` itself."""
    config = EngineConfig(
        name=cfg.engine, device=device, max_batch_size=cfg.batch_size, vllm=VLLMEngineConfig(base_url=cfg.vllm_base_url)
    )
    if model is None and cfg.engine != "vllm":
        raise ValueError(f"engine {cfg.engine} generates with a local model; none was loaded")
    # build_engine types the model of the in-process engines; VLLMEngine reads it only for a default
    # served_model, given here.
    return build_engine(config, model, tokenizer, served_model=cfg.model)  # type: ignore[arg-type]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


SUITE_RANGES: dict[str, Range] = {
    "limit": AT_LEAST_ONE,
    "max_tokens": AT_LEAST_ONE,
    "batch_size": AT_LEAST_ONE,
    "judge_max_tokens": AT_LEAST_ONE,
    "judge_workers": AT_LEAST_ONE,
}
"""The allowed range of every numeric field of ``SuiteConfig`` (``rlvr.ranges``)."""


def run_suites(
    cfg: SuiteConfig,
    model: torch.nn.Module | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    engine: Engine | None = None,
    judge: EngineJudge | EndpointJudge | None = None,
) -> dict:
    """Run every suite of ``cfg`` and write the outputs; returns ``{suite: metrics}``.

    ``model``/``tokenizer``/``engine``/``judge`` replace loading them from ``cfg`` (tests, experiments)."""
    if not cfg.suite:
        raise UserError("--suite needs at least one of mmlu gsm8k alpaca_eval sst")
    check_flags(cfg, SUITE_RANGES)
    # The lock before --out is read or written: a second evaluation into it is refused, not mixed in.
    with claimed_output_dir(cfg.out, OUTPUT_FILES, cfg.overwrite, command="rlvr eval --suite"):
        return _run_suites(cfg, model, tokenizer, engine, judge)


def _run_suites(
    cfg: SuiteConfig,
    model: torch.nn.Module | None,
    tokenizer: PreTrainedTokenizerBase | None,
    engine: Engine | None,
    judge: EngineJudge | EndpointJudge | None,
) -> dict:
    import torch

    # Data (and a local judge's path) before any model loads.
    data = {name: load_suite_data(name, _source(cfg, name), cfg.limit) for name in dict.fromkeys(cfg.suite)}
    for name, rows in data.items():
        if not rows:
            raise UserError(f"no {name} examples loaded from {_source(cfg, name)}")
    if (
        judge is None
        and cfg.judge
        and not cfg.judge.startswith(("http://", "https://"))
        and not Path(cfg.judge).exists()
        and cfg.judge.count("/") != 1
    ):
        raise UserError(f"--judge {cfg.judge!r} is neither an http(s) URL, a local directory, nor a hub id")

    device = usable_device(cfg.device)
    own_engine, own_model = engine is None, model is None
    if model is None and cfg.engine == "vllm":  # the server loads the weights; only the tokenizer is needed here
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    elif model is None:
        dtype = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        model, tokenizer = load_model_and_tokenizer(cfg.model, device=device, dtype=dtype)
        model.eval()
    if tokenizer is None:
        raise ValueError("run_suites was given a model without its tokenizer")
    if engine is None:
        engine = _engine(cfg, model, tokenizer, device)
    prefix = "" if cfg.engine == "vllm" else special_prefix(tokenizer)
    results: dict[str, dict] = {}
    samples: dict[str, list[dict]] = {}
    try:
        for name, rows in data.items():
            results[name], samples[name] = run_suite(
                SUITES[name],
                rows,
                engine,
                cfg.mode,
                cfg.max_tokens,
                prefix,
                chunk_size=max(1, cfg.batch_size),
                progress=cfg.progress,
            )
    finally:
        if own_engine:
            engine.close()

    needs_judge = [n for n in ("alpaca_eval", "sst") if n in results]
    own_judge = judge is None
    if needs_judge and judge is None and cfg.judge:
        if own_model:  # free the model under test before a judge loads on the same device
            model = engine = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

        judge = make_judge(
            cfg.judge,
            cfg.judge_model,
            cfg.judge_api_key_env,
            usable_device(cfg.judge_device, "--judge-device"),
            max_tokens=cfg.judge_max_tokens,
            workers=cfg.judge_workers,
            batch_size=cfg.batch_size,
        )
    try:
        for name in needs_judge:
            if judge is None:
                results[name].update(scored=False, note="unscored: no judge given (pass --judge MODEL_OR_URL)")
                continue
            t0 = time.perf_counter()
            scorer = judge_alpaca_eval if name == "alpaca_eval" else judge_sst
            metrics, verdicts = scorer(judge, samples[name])
            for s, v in zip(samples[name], verdicts):
                s.update(v)
            results[name].update(
                scored=True, judge=getattr(judge, "name", cfg.judge), judge_time_s=time.perf_counter() - t0, **metrics
            )
    finally:
        if judge is not None and own_judge:
            judge.close()

    out = Path(cfg.out)
    config = {
        k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
        for k, v in dataclasses.asdict(cfg).items()
    }
    _write_json(out / "results.json", {"config": config, "results": results})
    with (out / "samples.jsonl").open("w", encoding="utf-8") as f:
        for sample_name in samples:
            for s in samples[sample_name]:
                f.write(json.dumps(s, ensure_ascii=False) + "\n")
    if "alpaca_eval" in samples:
        generator = cfg.generator or Path(cfg.model.rstrip("/")).name
        _write_json(
            out / "alpaca_eval_outputs.json",
            [
                {
                    "instruction": s["instruction"],
                    "output": s["output"],
                    "generator": generator,
                    "dataset": s.get("dataset", ""),
                }
                for s in samples["alpaca_eval"]
            ],
        )
    if "sst" in samples:
        columns = ("id", "harm_area", "counter", "category", "prompts_final")
        with (out / "simple_safety_tests_outputs.jsonl").open("w", encoding="utf-8") as f:
            for s in samples["sst"]:
                row = {k: s[k] for k in columns if k in s}
                f.write(json.dumps({**row, "output": s["output"]}, ensure_ascii=False) + "\n")
    return results


def format_table(results: dict[str, dict]) -> str:
    """A Markdown table of the headline number of every suite."""
    lines = ["| suite | n | score | parse/judge failures | examples/s |", "|---|---:|---|---:|---:|"]
    for name, m in results.items():
        if "accuracy" in m:
            score, fails = f"accuracy {m['accuracy']:.3f}", m["parse_failures"]
        elif not m.get("scored"):
            score, fails = "unscored (no judge)", "-"
        else:
            if name == "alpaca_eval":
                score = f"win rate {m['win_rate']:.3f}, LC {m['lc_win_rate']:.3f} over {m['judged']} judged"
            else:
                score = f"safe share {m['safe_share']:.3f}"
            fails = f"{m['judge_parse_failures']} of {m['judgments']} judgments unparsed"
            if m["unparsed_share"] >= MANY_UNPARSED:
                score = f"{m['unparsed_share']:.0%} OF JUDGMENTS UNPARSED: {score}"
        lines.append(f"| {name} | {m['n']} | {score} | {fails} | {m['examples_per_s']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import tyro

    cfg = tyro.cli(SuiteConfig, args=argv, prog="rlvr eval", description=__doc__.split("\n\n")[0])
    results = run_suites(cfg)
    print(format_table(results))
    print(f"rlvr eval: results in {cfg.out}/results.json, every example in {cfg.out}/samples.jsonl")
    return 0
