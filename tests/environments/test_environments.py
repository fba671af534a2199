"""Environments and multi-turn rollouts: tools and their schemas, tool-call parsing per template family,
the tool environment's answers, the conversation driver (what the engine is asked at each turn), the
loss mask on the model's own tokens (checked by gradients), and the single-turn equivalence."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import family_model, padded_and_packed

from rlvr.checks import resolve_config, validate_config
from rlvr.config import (
    ConfigError,
    DataConfig,
    EngineConfig,
    EnvConfig,
    LogConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
)
from rlvr.engines import make_engine
from rlvr.engines.base import Completion, SamplingParams
from rlvr.engines.rollouts import SyncRollouts, tokenize_groups
from rlvr.environments import ENVIRONMENTS, EnvStep, SingleTurn, build_environment, register_environment
from rlvr.environments.formats import ToolCall, parse_hermes, parse_llama3, tool_format
from rlvr.environments.rollout import ChatRenderer, Episodes, TextRenderer, episode_metrics, tokenize_episodes
from rlvr.environments.tool import ToolEnvironment
from rlvr.environments.tools import ToolError, as_tool, calculator, get_tools
from rlvr.task.data import Example
from rlvr.training.tokenize import tokenize_from_ids, tokenize_from_pieces

# -- tools ------------------------------------------------------------------------------------


def test_calculator_evaluates_arithmetic_without_eval():
    assert calculator("7 + 5") == "12"
    assert calculator("(7 + 5) * 2 - 3") == "21"
    assert calculator("12 / 4") == "3"  # an integral quotient reads as an integer
    assert calculator("7 / 2") == "3.5"
    assert calculator("-2 ** 3") == "-8"
    assert calculator("17 // 5 + 17 % 5") == "5"
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "'a' * 3"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_a_tool_schema_comes_from_the_signature_and_docstring():
    def lookup(city: str, days: int = 1) -> str:
        """Look up the weather.

        Args:
            city: The city's name.
            days: How many days ahead.
        """
        return f"{city}: sunny for {days} days"

    tool = as_tool(lookup)
    assert tool.name == "lookup"
    params = tool.schema["function"]["parameters"]
    assert tool.schema["function"]["description"] == "Look up the weather."
    assert params["properties"]["city"] == {"type": "string", "description": "The city's name."}
    assert params["properties"]["days"]["type"] == "integer" and params["required"] == ["city"]
    assert tool({"city": "Oslo", "days": 2}) == "Oslo: sunny for 2 days"
    assert tool({"city": 3, "days": "x"}).startswith("Oslo") is False  # whatever the function returns, as text

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ToolError, match="docstring"):
        as_tool(undocumented)
    with pytest.raises(ToolError, match="unknown tool 'search'"):
        get_tools(["calculator", "search"])


def test_a_raising_tool_answers_with_an_error_message():
    tool = as_tool(calculator)
    assert tool({"expression": "1 +"}).startswith("error: SyntaxError")


# -- parsing per template family --------------------------------------------------------------


def test_hermes_calls_qwen_style():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "7+5"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
    )
    assert parse_hermes(text) == [
        ToolCall("calculator", {"expression": "7+5"}),
        ToolCall("python", {"code": "print(1)"}),  # arguments written as a JSON string
    ]
    assert parse_hermes("The answer is 12.") == []
    (bad,) = parse_hermes("<tool_call>{name: calculator}</tool_call>")
    assert bad.name is None and "not valid JSON" in bad.error


def test_llama3_calls_are_the_whole_message():
    call = ToolCall("calculator", {"expression": "3*4"})
    assert parse_llama3('{"name": "calculator", "parameters": {"expression": "3*4"}}') == [call]
    assert parse_llama3('<|python_tag|>{"name": "calculator", "parameters": {"expression": "3*4"}}') == [call]
    assert parse_llama3("The answer is {12}.") == []  # prose, not a call
    assert parse_llama3("{12}") == []  # braces that are not a JSON object: an ordinary answer


def test_plain_format_stops_at_the_closing_tag_and_writes_the_result():
    plain = tool_format("plain")
    assert plain.stop == ("</tool_call>",)
    assert plain.parse(' <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>') == [
        ToolCall("calculator", {"expression": "2+2"})
    ]
    assert plain.render_result is not None and plain.render_result("4") == " <tool_response>4</tool_response>"


def test_auto_picks_the_format_from_the_chat_template():
    assert tool_format("auto", "{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert tool_format("auto", "<|start_header_id|>ipython<|end_header_id|>").name == "llama3"
    assert tool_format("auto", "<|user|>\n{{ content }}<|assistant|>\n").name == "plain"  # OLMo-2 instruct
    assert tool_format("auto", None).name == "plain"
    with pytest.raises(ConfigError.__mro__[1], match="unknown env.tool_format 'xml'"):
        tool_format("xml")


# -- the tool environment ---------------------------------------------------------------------


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_the_tool_environment_answers_calls_and_ends_at_an_answer():
    env = ToolEnvironment(get_tools(["calculator"]), "plain")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "7+5"}}</tool_call>'
    conv = [{"role": "user", "content": "Q"}, _assistant(" " + call)]
    step = env.step(conv)
    assert not step.done
    assert step.messages == [{"role": "tool", "content": "12", "name": "calculator"}]
    assert step.reward_fields == {"tool_calls": 1, "tool_errors": 0}
    conv += step.messages + [_assistant(' <tool_call>{"name": "search", "arguments": {}}</tool_call>')]
    step = env.step(conv)
    assert step.messages[0]["content"].startswith("error: no tool named 'search'")
    assert step.reward_fields == {"tool_calls": 2, "tool_errors": 1}
    conv += step.messages + [_assistant(' <tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>')]
    step = env.step(conv)
    assert step.messages[0]["content"] == "error: missing a required argument: 'expression'"
    conv += step.messages + [_assistant(" </think> <answer> 12 </answer>")]
    step = env.step(conv)
    assert step.done and step.messages == [] and step.reward_fields == {"tool_calls": 3, "tool_errors": 2}


def test_environments_come_from_the_table():
    assert isinstance(build_environment(EnvConfig()), SingleTurn)
    env = build_environment(EnvConfig(name="tool", tools=("calculator", "python"), tool_format="hermes"))
    assert isinstance(env, ToolEnvironment) and sorted(env.tools) == ["calculator", "python"]
    assert [s["function"]["name"] for s in env.schemas] == ["calculator", "python"]


@pytest.mark.parametrize(
    ("env", "engine", "message"),
    [
        ({"name": "chess"}, "hf", "unknown env.name 'chess': choose one of"),
        ({"name": "tool", "tools": ("search",)}, "hf", "unknown tool 'search' in env.tools"),
        ({"name": "tool", "tools": ()}, "hf", "needs at least one tool"),
        ({"name": "tool", "tool_format": "xml"}, "hf", "unknown env.tool_format 'xml'"),
        ({"name": "tool"}, "hf-worker", "use engine.name hf, hf-fast or vllm"),
        ({"name": "tool", "max_turns": 0}, "hf", "env.max_turns must be >= 1"),
        ({"name": "tool", "max_tokens": 0}, "hf", "env.max_tokens must be >= 1"),
    ],
)
def test_env_settings_that_cannot_run_are_one_line_errors(env, engine, message):
    config = TrainConfig(env=EnvConfig(**env), engine=EngineConfig(name=engine, device="cpu"), policy_device="cpu")
    with pytest.raises(ConfigError, match=message) as e:
        validate_config(resolve_config(config))
    assert "\n" not in str(e.value)


# -- tokenisation and the loss mask -----------------------------------------------------------


def test_pieces_mask_only_the_model_tokens():
    # prompt [1, 2], model turn [3, 4], tool output [5, 6, 7], model turn [8]; a second row is one turn
    out = tokenize_from_pieces(
        [[1, 2], [1]], [[([3, 4], True), ([5, 6, 7], False), ([8], True)], [([9, 9], True)]], pad_id=0
    )
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7], [1, 9, 9, 0, 0, 0, 0]]
    assert out["labels"].tolist() == [[2, 3, 4, 5, 6, 7, 8], [9, 9, 0, 0, 0, 0, 0]]
    # labels 3, 4 and 8 are the model's; 5, 6, 7 (the tool's) and the prompt's 2 are not
    assert out["response_mask"].int().tolist() == [[0, 1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0, 0]]


def test_one_model_piece_tokenises_as_a_single_turn():
    prompts, outputs = [[5, 6, 7], [5], [8, 9]], [[1, 2], [3, 4, 4, 4], [2]]
    pieces = [[(o, True)] for o in outputs]
    a, b = tokenize_from_pieces(prompts, pieces, 0), tokenize_from_ids(prompts, outputs, 0)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_masked_tool_tokens_get_no_gradient(tiny_model, tiny_tokenizer):
    """The final hidden state at a position feeds only that position's logits, so its gradient is the
    loss's through that label alone: zero exactly at the tool's tokens, nonzero at the model's."""
    from rlvr.training.logprobs import get_response_log_probs

    out = tokenize_from_pieces([[1, 2, 3]], [[([4, 5], True), ([6, 7, 8], False), ([9, 10], True)]], pad_id=0)
    mask = out["response_mask"]
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["h"] = output

    handle = tiny_model.model.norm.register_forward_hook(keep)
    try:
        log_probs = get_response_log_probs(tiny_model, out["input_ids"], out["labels"])["log_probs"]
    finally:
        handle.remove()
    loss = -(log_probs * mask).sum()
    loss.backward()
    grad = captured["h"].grad[0].abs().sum(dim=-1)
    assert mask[0].tolist() == [False, False, True, True, False, False, False, True, True]
    assert torch.all(grad[~mask[0]] == 0)
    assert torch.all(grad[mask[0]] > 0)
    # the tool's tokens still shape the model's later tokens through attention: they are context
    emb = tiny_model.get_input_embeddings().weight.grad
    assert emb[[6, 7, 8]].abs().sum() > 0


# -- the conversation driver ------------------------------------------------------------------


class ScriptedEngine:
    """An engine of this project's protocol that answers from a script, recording what it was asked."""

    def __init__(self, turns: list[list[str]]) -> None:
        self.turns, self.calls = turns, []

    def generate(self, prompts, params):
        self.calls.append((list(prompts), params))
        texts = iter(self.turns[len(self.calls) - 1])
        return [[self._completion(next(texts)) for _ in range(params.n)] for _ in prompts]

    @staticmethod
    def _completion(text):
        return Completion(text, list(range(len(text.split()))), "length" if text.endswith("...") else "stop")

    def sync_weights(self, model):
        return {}

    def close(self):
        pass


CALL = ' <tool_call>{"name": "calculator", "arguments": {"expression": "7+5"}}</tool_call>'


def _tool_episodes(tokenizer, max_turns=4, max_tokens=1000):
    env = ToolEnvironment(get_tools(["calculator"]), "plain")
    return Episodes(env, tokenizer, TextRenderer(env.format), max_turns, max_tokens)


def test_a_conversation_goes_back_to_the_engine_with_the_tool_result(tiny_tokenizer):
    episodes = _tool_episodes(tiny_tokenizer)
    rows = [Example("Q1", "12"), Example("Q2", "3")]
    prompts = episodes.open(rows, [[{"role": "user", "content": "P1:"}], [{"role": "user", "content": "P2:"}]])
    assert prompts == ["P1:", "P2:"]
    answer = " <answer> 12 </answer>"
    engine = ScriptedEngine([[CALL, " </think> <answer> 9 </answer>", CALL, CALL], [answer] * 3])
    params = SamplingParams(n=2, max_new_tokens=50, stop=("</answer>",), prompt_seeds=(11, 22))
    groups = episodes.generate(engine, prompts, params)
    first, second = engine.calls
    assert first[0] == prompts and first[1].stop == ("</answer>", "</tool_call>") and first[1].n == 2
    result = " <tool_response>12</tool_response>"
    # one call for the round after the first turns: P1's one conversation that goes on, then P2's two
    assert second[0] == ["P1:" + CALL + result] + ["P2:" + CALL + result] * 2
    assert second[1].n == 1
    assert len(set(second[1].prompt_seeds)) == 3  # each conversation its own draws
    a, b = groups[0]
    assert a.text == CALL + result + " <answer> 12 </answer>" and a.meta["turns"] == 2
    assert a.meta["pieces"] == [(CALL, True), (result, False), (" <answer> 12 </answer>", True)]
    assert [m["role"] for m in a.meta["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert a.meta["reward_fields"] == {"tool_calls": 1, "tool_errors": 0}
    assert b.text == " </think> <answer> 9 </answer>" and b.meta["turns"] == 1 and b.finish_reason == "stop"
    assert episode_metrics([a, b] + groups[1]) == {
        "train/turns": 7 / 4,
        "train/tool_calls": 3 / 4,
        "train/tool_errors": 0,
    }
    tokens = tokenize_groups(tiny_tokenizer, prompts, groups)
    ids = tokens["labels"][0][tokens["response_mask"][0]].tolist()
    model_ids = tiny_tokenizer(CALL, add_special_tokens=False)["input_ids"]
    model_ids += tiny_tokenizer(" <answer> 12 </answer>", add_special_tokens=False)["input_ids"]
    assert ids == model_ids  # the loss sees the model's two turns, token for token, and nothing else


def test_max_turns_and_max_tokens_end_a_conversation_as_cut(tiny_tokenizer):
    rows = [Example("Q", "12")]
    for kwargs in ({"max_turns": 2}, {"max_tokens": 5}):
        episodes = _tool_episodes(tiny_tokenizer, **kwargs)
        prompts = episodes.open(rows, [[{"role": "user", "content": "P:"}]])
        engine = ScriptedEngine([[CALL], [CALL], [CALL]])
        (c,) = episodes.generate(engine, prompts, SamplingParams(n=1, max_new_tokens=50))[0]
        assert c.finish_reason == "length"
        assert c.meta["turns"] == (2 if "max_turns" in kwargs else 1)
        assert c.meta["pieces"][-1][1] is False  # it ends on the tool's answer, which nobody trains on


def test_a_turn_cut_at_max_new_tokens_ends_the_conversation(tiny_tokenizer):
    episodes = _tool_episodes(tiny_tokenizer)
    prompts = episodes.open([Example("Q", "1")], [[{"role": "user", "content": "P:"}]])
    engine = ScriptedEngine([[" <tool_call>{..."]])
    (c,) = episodes.generate(engine, prompts, SamplingParams(n=1))[0]
    assert c.finish_reason == "length" and c.meta["turns"] == 1 and len(engine.calls) == 1


def test_single_turn_through_the_driver_equals_the_one_turn_path(tiny_model, tiny_tokenizer):
    """The trainer keeps its own path for single_turn; this shows the driver would give the same batch."""
    prompts = ["Natalia sold clips to 48 of her friends.", "How many"]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=7, prompt_seeds=(1, 2))
    engine = make_engine("hf", tiny_model, tiny_tokenizer)
    plain = SyncRollouts(engine, tiny_tokenizer, lambda s: (prompts, params)).next_batch(1, tiny_model)
    episodes = Episodes(SingleTurn(), tiny_tokenizer, TextRenderer(), 4, 1000)
    opened = episodes.open([Example(p, "") for p in prompts], [[{"role": "user", "content": p}] for p in prompts])
    driven = SyncRollouts(episodes.engine(engine), tiny_tokenizer, lambda s: (opened, params)).next_batch(1, tiny_model)
    assert opened == prompts and driven.responses == plain.responses
    for key in ("input_ids", "labels", "response_mask"):
        assert torch.equal(getattr(driven, key), getattr(plain, key))


class CountingEngine:
    """A real engine, with the number of ``generate`` calls it served."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def generate(self, prompts, params):
        self.calls += 1
        return self.inner.generate(prompts, params)


class CalculatorEcho:
    """Three model turns: after each of the first two the environment answers with a calculator result
    (the tool run in the round's thread pool). Turns stop at a space or an "e", so that a random model's
    turns end at different lengths."""

    stop: tuple[str, ...] = (" ", "e")

    def reset(self, row, messages):
        return messages

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns >= 3:
            return EnvStep(done=True, reward_fields={"turns": turns})
        return EnvStep(messages=[{"role": "user", "content": f" ={calculator(f'{turns} + 7')}."}])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, temperature=0.0, max_new_tokens=16),
        SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=5, prompt_seeds=(1, 2, 3, 4)),
    ],
    ids=["greedy", "seeded"],
)
def test_one_call_per_round_equals_one_call_per_row(tiny_model, tiny_tokenizer, params):
    """The hf engine gives the same conversations (tokens, masks, reward fields) whether a round's later
    turns go in one call or in one call per row, greedy and seeded (each prompt draws from its own seed)."""
    prompts = ["Betty is saving money for a new wallet.", "How many", "A robe takes 2 bolts", "James writes a letter"]
    rows = [Example(p, "") for p in prompts]
    out = {}
    for one_call in (True, False):
        episodes = Episodes(CalculatorEcho(), tiny_tokenizer, TextRenderer(), 3, 1000, one_call_per_round=one_call)
        opened = episodes.open(rows, [[{"role": "user", "content": p}] for p in prompts])
        engine = CountingEngine(make_engine("hf", tiny_model, tiny_tokenizer, max_batch_size=4))
        groups = episodes.generate(engine, opened, params)
        out[one_call] = (groups, tokenize_episodes(tiny_tokenizer, opened, groups), engine.calls)
    (batched, batched_tokens, batched_calls), (per_row, per_row_tokens, per_row_calls) = out[True], out[False]
    turns = [c.meta["turns"] for g in batched for c in g]
    assert max(turns) == 3, "the test needs conversations that reach a third turn"
    assert batched_calls == max(turns) < per_row_calls  # the first turns, then one call a round
    for a, b in zip(batched, per_row):
        assert [(c.text, c.token_ids, c.finish_reason, c.meta) for c in a] == [
            (c.text, c.token_ids, c.finish_reason, c.meta) for c in b
        ]
    for key in ("input_ids", "labels", "response_mask"):
        assert torch.equal(batched_tokens[key], per_row_tokens[key])


def test_hf_fast_continues_conversations_from_its_cache(tiny_model, tiny_tokenizer):
    """Greedy conversations on hf-fast (later turns prefilled past the K/V it kept) equal those on hf
    (every context read whole), and the fast engine took part of each later context from its cache."""
    prompts = ["Betty is saving money for a new wallet.", "How many", "A robe takes 2 bolts", "James writes a letter"]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    out = {}
    for name in ("hf", "hf-fast"):
        episodes = Episodes(CalculatorEcho(), tiny_tokenizer, TextRenderer(), 3, 1000)
        opened = episodes.open([Example(p, "") for p in prompts], [[{"role": "user", "content": p}] for p in prompts])
        engine = make_engine(name, tiny_model, tiny_tokenizer, max_batch_size=8)
        out[name] = (episodes.generate(engine, opened, params), engine)
    (plain, _), (fast, engine) = out["hf"], out["hf-fast"]
    assert max(c.meta["turns"] for g in fast for c in g) == 3
    assert [[(c.token_ids, c.meta) for c in g] for g in fast] == [[(c.token_ids, c.meta) for c in g] for g in plain]
    assert engine.stats["reused_tokens"] > 0


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(',') }}; "
    "call one as <tool_call>{json}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_chat_conversation_continues_as_the_template_renders_it(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = HERMES_TEMPLATE
    env = ToolEnvironment(get_tools(["calculator"]), "auto").bind(tok.chat_template)
    assert env.format.name == "hermes"
    renderer = ChatRenderer(tok, env.schemas)
    user = [{"role": "user", "content": "What is 7+5?"}]
    prompt = renderer.prompt(user)
    assert (
        prompt
        == "<|im_start|>system\nTools: calculator; call one as <tool_call>{json}</tool_call><|im_end|>\n<|im_start|>user\nWhat is 7+5?<|im_end|>\n<|im_start|>assistant\n"
    )
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7+5"}}\n</tool_call>'
    conv = user + [_assistant(call)]
    step = env.step(conv)
    after = renderer.after(conv, step.messages)
    assert (
        after
        == "<|im_end|>\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # the continued text is the template's rendering of the whole conversation so far
    full = tok.apply_chat_template(conv + step.messages, tools=env.schemas, tokenize=False, add_generation_prompt=True)
    assert prompt + call + after == full


# -- the training loop ------------------------------------------------------------------------


class EchoEnvironment:
    """Two model turns: after the first, the environment says " ok." (not trained on). Turns stop at a
    space or an "e", so that a random model's turns end before max_new_tokens."""

    stop: tuple[str, ...] = (" ", "e")

    def reset(self, row, messages):
        return messages

    def step(self, messages):
        if sum(m["role"] == "assistant" for m in messages) >= 2:
            return EnvStep(done=True, reward_fields={"echoes": 1})
        return EnvStep(messages=[{"role": "user", "content": " ok."}])


@pytest.fixture()
def echo_env():
    register_environment("echo", lambda config: EchoEnvironment())
    yield "echo"
    del ENVIRONMENTS["echo"]


def _parity(response: str, ground_truth: str) -> dict:
    r = float(len(response) % 2 == 0)
    return {"reward": r, "answer_reward": r, "format_reward": 1.0}


def _trainer_config(gsm8k_path, env: str, n_steps: int = 2, **overrides) -> TrainConfig:
    base = dict(
        data=DataConfig(train_source=str(gsm8k_path), train_size=16, val_size=2),
        rollout=RolloutConfig(n_prompts_per_rollout_batch=2, group_size=4, max_new_tokens=6),
        optim=OptimConfig(lr=1e-3, gradient_accumulation_steps=2),
        log=LogConfig(progress=False, val_samples=2),
        env=EnvConfig(name=env, max_turns=3, max_tokens=64),
        prompt="question_only",
        n_steps=n_steps,
        eval_every=0,
        dump_every=1,
        save_every=0,
    )
    base.update(overrides)
    return TrainConfig(**base)


def test_training_on_conversations_dumps_every_turn(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, echo_env):
    from rlvr.commands.train import train
    from rlvr.training.metrics_log import read_metrics

    train(
        _trainer_config(gsm8k_path, echo_env), tmp_path, model=tiny_model, tokenizer=tiny_tokenizer, reward_fn=_parity
    )
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert 1 <= r["train/turns"] <= 2 and r["train/grad_norm"] >= 0
    assert rows[-1]["val/turns"] >= 1
    dump = [json.loads(line) for line in (tmp_path / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    two = [d for d in dump if d["turns"] == 2]
    assert two, "no conversation went to a second turn"
    for d in two:
        roles = [m["role"] for m in d["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert d["response"] == d["messages"][1]["content"] + " ok." + d["messages"][3]["content"]
        # the loss saw the model's two turns; " ok." is not among its tokens
        own = sum(len(tiny_tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in d["messages"][1::2])
        assert d["n_train_tokens"] == own


def test_off_policy_and_packed_training_take_conversations(gsm8k_path, tiny_model, tiny_tokenizer, tmp_path, echo_env):
    from rlvr.commands.train import train
    from rlvr.config import AlgorithmConfig
    from rlvr.training.metrics_log import read_metrics

    cfg = _trainer_config(
        gsm8k_path,
        echo_env,
        algorithm=AlgorithmConfig(preset="dr_grpo", reweighting="grpo"),
        optim=OptimConfig(
            lr=1e-3, train_batch_size=4, gradient_accumulation_steps=2, epochs_per_rollout_batch=2, shared_prefix=True
        ),
    )
    train(cfg, tmp_path, model=tiny_model, tokenizer=tiny_tokenizer, reward_fn=_parity)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["train/n_updates"] == 4 and 0 <= r["train/clip_fraction"] <= 1 for r in rows[1:])


def test_packed_conversations_equal_padded(tiny_tokenizer):
    """Shared-prompt packing takes a conversation's whole span (the environment's tokens as input only):
    log-probs, entropies and gradients equal the padded path's."""
    from rlvr.training.packing import shared_prefix_plan

    model = family_model("olmo2", tiny_tokenizer)
    enc = lambda text: tiny_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt_a, prompt_b = enc("What is 7 plus 5? Think."), enc("Name a fruit.")
    tool = enc(" <tool_response>12</tool_response>")
    pieces = [
        [(enc(CALL), True), (tool, False), (enc(" <answer> 12 </answer>"), True)],
        [(enc(" It is 12."), True)],
        [(enc(CALL), True), (tool, False), (enc(" 12"), True), (enc(" ok."), False), (enc(" done"), True)],
        [(enc(" An apple"), True)],
    ]
    tok = tokenize_from_pieces([prompt_a, prompt_a, prompt_a, prompt_b], pieces, 0)
    mask = tok["response_mask"]
    assert shared_prefix_plan(tok["input_ids"], mask, [True] * 4, 4, spans=True) == [[0, 1, 2, 3]]
    (padded, g_padded), (packed, g_packed) = padded_and_packed(model, tok, torch.randn(mask.shape), chunk_tokens=5)
    assert packed["backbone_tokens"] < mask.numel()
    assert bool((packed["log_probs"][~mask] == 0).all()) and bool((packed["token_entropy"][~mask] == 0).all())
    torch.testing.assert_close(packed["log_probs"], padded["log_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed["token_entropy"], padded["token_entropy"], rtol=1e-5, atol=1e-5)
    for a, b in zip(g_packed, g_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_resumed_conversation_run_equals_an_uninterrupted_one(gsm8k_path, tiny_tokenizer, tmp_path, echo_env):
    """Conversations are a function of (seed, step) like single-turn rollouts: a run stopped after its
    step-2 checkpoint and resumed gives the metrics and weights of a run that never stopped."""
    from rlvr.commands.train import train
    from rlvr.errors import GraderError
    from rlvr.modeling import build_model, small_olmo2_config
    from rlvr.training.checkpoint import latest_checkpoint
    from rlvr.training.metrics_log import read_metrics

    def fresh():
        return build_model(small_olmo2_config(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=4), seed=0)

    cfg = _trainer_config(gsm8k_path, echo_env, n_steps=3, save_every=2)
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    model_a = fresh()
    train(cfg, straight, model=model_a, tokenizer=tiny_tokenizer, reward_fn=_parity)
    calls = {"n": 0}

    def crashes_in_step_3(response, gt):  # 8 conversations per step: call 17 is the first of step 3
        calls["n"] += 1
        if calls["n"] > 16:
            raise ValueError("grader bug")
        return _parity(response, gt)

    with pytest.raises(GraderError):
        train(cfg, broken, model=fresh(), tokenizer=tiny_tokenizer, reward_fn=crashes_in_step_3)
    assert latest_checkpoint(broken).name == "step_000002"
    model_b = fresh()
    train(cfg, broken, resume=True, model=model_b, tokenizer=tiny_tokenizer, reward_fn=_parity)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per_s"))} for r in rows]  # noqa: E731
    assert strip(read_metrics(straight / "metrics.jsonl")) == strip(read_metrics(broken / "metrics.jsonl"))
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True))


def test_arith_tool_traces_are_what_the_tool_environment_reads_and_writes():
    from rlvr.task.generated.arithmetic import load_arithmetic

    examples = load_arithmetic("train", limit=40, steps=2, tool=0.5, noise=0.5)
    traces = [ex for ex in examples if "<tool_call>" in ex.solution]
    assert 10 < len(traces) < 30
    env = ToolEnvironment(get_tools(["calculator"]), "plain")
    for ex in traces:
        turn, _, rest = ex.solution.partition("</tool_call>")
        step = env.step([{"role": "user", "content": ex.question}, _assistant(turn + "</tool_call>")])
        assert step.messages[0]["content"] == ex.ground_truth  # the call computes the answer
        assert rest == f"{env.format.render_result(ex.ground_truth)} </think> <answer> {ex.ground_truth} </answer>"
    # without the knob nothing changes: the same questions and solutions as before it existed
    plain = load_arithmetic("train", limit=40, steps=2, noise=0.5)
    assert [e.question for e in plain] == [e.question for e in examples]
    assert all("<tool_call>" not in e.solution for e in plain)


def test_rlvr_eval_with_a_training_config_plays_its_environment(tmp_path, gsm8k_path, tiny_model, tiny_tokenizer):
    """``rlvr eval --config`` of a run with ``env.name tool`` answers through the environment, as that
    run's validation does: every sample is a conversation, and the results count its turns."""
    from rlvr.cli import main

    tiny_model.save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    config = {
        "data": {"train_source": str(gsm8k_path), "val_source": str(gsm8k_path), "val_split": "test", "val_size": 4},
        "prompt": "r1_zero",
        "env": {"name": "tool", "tools": ["calculator"], "tool_format": "plain", "max_turns": 2, "max_tokens": 24},
    }
    (tmp_path / "run.json").write_text(json.dumps(config))
    out = tmp_path / "eval"
    argv = ["eval", "--config", str(tmp_path / "run.json"), "--model", str(tmp_path / "model"), "--out", str(out)]
    assert main([*argv, "--max-tokens", "8", "--device", "cpu", "--seed", "3"]) == 0
    (metrics,) = json.loads((out / "results.json").read_text())["results"].values()
    assert metrics["n"] == 4 and 1 <= metrics["episodes"]["turns"] <= 2
    # The same config without its environment answers in one turn, as before.
    del config["env"]
    (tmp_path / "run.json").write_text(json.dumps(config))
    argv[-1] = str(tmp_path / "eval-single-turn")
    assert main([*argv, "--max-tokens", "8", "--device", "cpu", "--seed", "3"]) == 0
    (single,) = json.loads((tmp_path / "eval-single-turn" / "results.json").read_text())["results"].values()
    assert single["n"] == 4 and "episodes" not in single
