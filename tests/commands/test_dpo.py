"""DPO: the loss by hand and a second way on a tiny model, HH and generic pair loading, and `rlvr dpo`
(metrics, the best checkpoint, reference log-probs once per pair, exact resume)."""

from __future__ import annotations

import copy
import gzip
import json
import math

import pytest
import torch

from rlvr import compute_per_instance_dpo_loss
from rlvr.commands.dpo import DPOConfig, dpo_loss, hh_pair, hh_turns, load_preference_pairs, run_dpo
from rlvr.errors import UserError
from rlvr.task.instruction_data import alpaca_format


def test_dpo_loss_worked_by_hand():
    # beta 0.5: chosen reward 0.5 * (-10 - -11) = 0.5, rejected 0.5 * (-12 - -11) = -0.5, margin 1
    out = dpo_loss(torch.tensor(-10.0), torch.tensor(-12.0), torch.tensor(-11.0), torch.tensor(-11.0), beta=0.5)
    assert out["chosen_reward"].item() == pytest.approx(0.5) and out["rejected_reward"].item() == pytest.approx(-0.5)
    assert out["margin"].item() == pytest.approx(1.0)
    assert out["loss"].item() == pytest.approx(math.log(1 + math.exp(-1)))  # -log sigmoid(1) = 0.31326
    even = dpo_loss(torch.tensor(-3.0), torch.tensor(-4.0), torch.tensor(-3.0), torch.tensor(-4.0), beta=0.1)
    assert even["loss"].item() == pytest.approx(math.log(2)) and even["margin"].item() == 0.0


def _manual_sequence_logp(model, ids: list[int], start: int) -> torch.Tensor:
    """sum_t log p(ids[t] | ids[:t]) for t >= start, from the model's plain logits of one unpadded sequence."""
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(x).logits[0, :-1].double(), dim=-1)
    targets = torch.tensor(ids[1:])
    return logp[torch.arange(len(ids) - 1), targets][start - 1 :].sum()


def test_per_instance_loss_equals_a_second_computation(tiny_model, tiny_tokenizer):
    policy = tiny_model
    reference = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    prompt, chosen, rejected = "What is 3 + 4?", "3 + 4 = 7.", "It is 12, I think."
    loss = compute_per_instance_dpo_loss(
        lm=policy,
        lm_ref=reference,
        tokenizer=tiny_tokenizer,
        beta=0.3,
        prompt=prompt,
        response_chosen=chosen,
        response_rejected=rejected,
    )
    # Second way: the response tokens only (the shared prompt cancels), float64, unbatched.
    eos = tiny_tokenizer.eos_token_id
    head = tiny_tokenizer(alpaca_format(prompt), add_special_tokens=False)["input_ids"]
    seq = {r: head + tiny_tokenizer(r, add_special_tokens=False)["input_ids"] + [eos] for r in (chosen, rejected)}
    assert tiny_tokenizer(alpaca_format(prompt, chosen), add_special_tokens=False)["input_ids"] + [eos] == seq[chosen]
    with torch.no_grad():
        lp = {
            (m, r): _manual_sequence_logp(model, seq[r], len(head))
            for m, model in (("pi", policy), ("ref", reference))
            for r in (chosen, rejected)
        }
    margin = 0.3 * ((lp["pi", chosen] - lp["pi", rejected]) - (lp["ref", chosen] - lp["ref", rejected]))
    expected = -torch.nn.functional.logsigmoid(margin)
    assert loss.shape == () and loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-5)
    assert abs(margin.item()) > 1e-3  # the two models differ: the test would notice a dropped reference

    loss.backward()
    assert all(p.grad is not None for p in policy.parameters())
    assert all(p.grad is None for p in reference.parameters())
    # policy = reference: margin 0, loss log 2
    same = compute_per_instance_dpo_loss(policy, copy.deepcopy(policy), tiny_tokenizer, 0.1, prompt, chosen, rejected)
    assert same.item() == pytest.approx(math.log(2), abs=1e-6)


def test_pairs_per_forward_changes_nothing_but_speed(tiny_model, tiny_tokenizer):
    from rlvr.commands.dpo import ReferenceCache, dpo_step, pair_token_ids

    reference = copy.deepcopy(tiny_model).requires_grad_(False)
    token_pairs = [
        tuple(pair_token_ids(tiny_tokenizer, f"Question {i}?", [f"Yes {i}.", f"No, not at all {i}."])) for i in range(5)
    ]
    results = []
    for per_forward in (1, 2, 5):
        policy = copy.deepcopy(tiny_model)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        metrics = dpo_step(
            policy,
            optimizer,
            token_pairs,
            [4, 0, 2, 3],
            ReferenceCache(reference, 0, 5),
            0.2,
            0,
            None,
            pairs_per_forward=per_forward,
        )
        results.append((metrics, [p.detach().clone() for p in policy.parameters()]))
    for metrics, params in results[1:]:
        assert metrics["train/loss"] == pytest.approx(results[0][0]["train/loss"], abs=1e-6)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, results[0][1]))
    assert results[0][0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference before the step


HH_SINGLE = {
    "chosen": "\n\nHuman: How do I bake bread?\n\nAssistant: Mix flour, water and yeast.\n\nThen bake it.",
    "rejected": "\n\nHuman: How do I bake bread?\n\nAssistant: Buy some.",
}
HH_MULTI = {
    "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: No.",
    "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: Why did...",
}
HH_SAME = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!"}


def test_hh_single_turn_split():
    assert hh_turns(HH_MULTI["chosen"]) == [
        ("Human", "Hi"),
        ("Assistant", "Hello!"),
        ("Human", "Tell me a joke"),
        ("Assistant", "No."),
    ]
    pair = hh_pair(HH_SINGLE, "helpful-base/train.jsonl.gz")
    assert (pair.prompt, pair.chosen, pair.rejected, pair.source) == (
        "How do I bake bread?",
        "Mix flour, water and yeast.\n\nThen bake it.",
        "Buy some.",
        "helpful-base/train.jsonl.gz",
    )
    assert hh_pair(HH_MULTI) is None


def test_loading_hh_directories_and_generic_pairs(tmp_path):
    for subset, rows in (("harmless-base", [HH_SINGLE, HH_MULTI]), ("helpful-base", [HH_SAME, HH_SINGLE])):
        (tmp_path / "hh" / subset).mkdir(parents=True)
        with gzip.open(tmp_path / "hh" / subset / "train.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with gzip.open(tmp_path / "hh" / subset / "test.jsonl.gz", "wt") as f:
            f.write(json.dumps(HH_SINGLE) + "\n")
    pairs, counts = load_preference_pairs([str(tmp_path / "hh")])
    assert [p.source for p in pairs] == ["hh/harmless-base/train.jsonl.gz", "hh/helpful-base/train.jsonl.gz"]
    assert counts == {"rows": 4, "multi_turn": 1, "identical": 1, "kept": 2}
    test_pairs, _ = load_preference_pairs([str(tmp_path / "hh")], split="test")
    assert len(test_pairs) == 2
    generic = tmp_path / "pairs.jsonl"
    generic.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    pairs, _ = load_preference_pairs([str(generic)])
    assert (pairs[0].prompt, pairs[0].chosen, pairs[0].rejected, pairs[0].source) == ("p", "a", "b", "pairs.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "p"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: cannot tell the format"):
        load_preference_pairs([str(tmp_path / "bad.jsonl")])


# --- rlvr dpo --------------------------------------------------------------------------------------

WORDS = ["red", "blue", "green", "gold", "pink", "gray", "teal", "navy", "plum", "rose", "sand", "jade"]


@pytest.fixture()
def dpo_inputs(tiny_model, tiny_tokenizer, tmp_path):
    from rlvr.modeling import save_model_and_tokenizer

    model_dir = save_model_and_tokenizer(tiny_model, tiny_tokenizer, tmp_path / "sft")
    path = tmp_path / "pairs.jsonl"
    with path.open("w") as f:
        for i, w in enumerate(WORDS):
            f.write(
                json.dumps(
                    {
                        "prompt": f"Name colour {i}.",
                        "chosen": f"The colour is {w}.",
                        "rejected": f"No colour, sorry {i}.",
                    }
                )
                + "\n"
            )
    return model_dir, path


def _config(model_dir, path, out, **kw):
    base = dict(
        model=str(model_dir),
        data=(str(path),),
        out=out,
        val_size=4,
        batch_size=2,
        lr=1e-3,
        eval_every=2,
        save_every=2,
        progress=False,
        device="cpu",
        eval_batch_pairs=3,
    )
    return DPOConfig(**{**base, **kw})


def _count_reference_rows(monkeypatch):
    import rlvr.commands.dpo as dpo

    seen = {"rows": 0}
    original = dpo.sequence_log_probs

    def counting(model, sequences, *args, **kwargs):
        if not next(model.parameters()).requires_grad:  # the frozen reference
            seen["rows"] += len(sequences)
        return original(model, sequences, *args, **kwargs)

    monkeypatch.setattr(dpo, "sequence_log_probs", counting)
    return seen


def test_dpo_run_logs_keeps_the_best_and_scores_each_pair_once(dpo_inputs, tmp_path, monkeypatch):
    model_dir, path = dpo_inputs
    seen = _count_reference_rows(monkeypatch)
    out = run_dpo(_config(model_dir, path, tmp_path / "run", epochs=2.0))  # 8 training pairs, 2 epochs: 8 steps
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(0, 9))
    assert rows[0]["val/preference_accuracy"] == 0.0 and rows[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in (
        "train/loss",
        "train/reward_margin",
        "train/chosen_logp",
        "train/rejected_logp",
        "train/grad_norm",
        "lr",
        "train/preference_accuracy",
    ):
        assert key in rows[1]
    assert all("val/preference_accuracy" in r for r in rows if r["step"] % 2 == 0)
    assert seen["rows"] == 2 * (8 + 4)  # each training and validation pair scored by the reference exactly once
    val = [r for r in rows if r["step"] > 0 and "val/loss" in r]
    best = max(val, key=lambda r: r["val/preference_accuracy"])  # the first of the best
    saved = json.loads((out / "best.json").read_text())
    assert saved["step"] == best["step"] and (out / "best" / "config.json").is_file()
    assert rows[-1]["val/preference_accuracy"] > 0.5 and rows[-1]["val/loss"] < math.log(2)
    summary = json.loads((out / "summary.json").read_text())
    with pytest.raises(UserError, match="--overwrite"):  # a finished run is not replaced by surprise
        run_dpo(_config(model_dir, path, out))
    assert summary["train_pairs"] == 8 and summary["val_pairs"] == 4 and summary["best_step"] == best["step"]


def test_resume_is_exact(dpo_inputs, tmp_path):
    from safetensors.torch import load_file

    model_dir, path = dpo_inputs
    straight = run_dpo(_config(model_dir, path, tmp_path / "straight", steps=4))
    run_dpo(_config(model_dir, path, tmp_path / "resumed", steps=2))
    resumed = run_dpo(DPOConfig(resume=tmp_path / "resumed", steps=4, progress=False))
    a = load_file(str(straight / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "step_000004" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def rows(run):
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]

    assert rows(straight) == rows(resumed)


def test_cli_errors_are_one_line(capsys, tmp_path):
    from rlvr.cli import main

    assert main(["dpo", "--data", "x.jsonl", "--out", str(tmp_path)]) == 2
    assert "--model is required" in capsys.readouterr().err
    assert main(["dpo", "--model", "m", "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "none.jsonl" in capsys.readouterr().err


# --- conversational pairs (TRL's preference rows as message lists) ---------------------------------

USER_Q = [{"role": "user", "content": "Q"}]
ANSWER_A, ANSWER_B = [{"role": "assistant", "content": "A"}], [{"role": "assistant", "content": "B"}]


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": USER_Q, "chosen": ANSWER_A, "rejected": ANSWER_B},  # explicit prompt
        {"prompt": USER_Q, "chosen": USER_Q + ANSWER_A, "rejected": USER_Q + ANSWER_B},  # whole conversations
        {"chosen": USER_Q + ANSWER_A, "rejected": USER_Q + ANSWER_B},  # implicit prompt: the shared start
        {"prompt": USER_Q, "chosen": "A", "rejected": "B"},  # strings as one assistant message
    ],
)
def test_conversational_rows_give_one_pair(tmp_path, row):
    path = tmp_path / "chat_pairs.jsonl"
    path.write_text(json.dumps(row) + "\n")
    pairs, _ = load_preference_pairs([str(path)])
    assert (pairs[0].prompt, pairs[0].chosen, pairs[0].rejected) == (USER_Q, ANSWER_A, ANSWER_B)
    assert pairs[0].conversational


def test_conversational_rows_without_a_shared_prompt_are_named(tmp_path):
    path = tmp_path / "chat_pairs.jsonl"
    path.write_text(json.dumps({"chosen": ANSWER_A, "rejected": ANSWER_B}) + "\n")
    with pytest.raises(UserError, match="chat_pairs.jsonl:1: no prompt column and chosen and rejected share no"):
        load_preference_pairs([str(path)])


def test_conversational_pairs_score_the_response_tokens_only(tiny_tokenizer):
    from conftest import chat_tokenizer

    from rlvr.commands.dpo import PreferencePair, TokenPair, sequence_log_probs, tokenize_pairs
    from rlvr.modeling import build_model, small_olmo2_config

    tok = chat_tokenizer(tiny_tokenizer)
    model = build_model(small_olmo2_config(tok, hidden_size=32, num_layers=2, num_heads=4), seed=0).eval()
    chat = PreferencePair(USER_Q, ANSWER_A, [{"role": "assistant", "content": "B longer"}])
    plain = PreferencePair("Q", "A", "B")
    (chat_ids, plain_ids), _, dropped = tokenize_pairs(tok, [chat, plain], max_tokens=1024)
    head = tok.convert_tokens_to_ids(["<|user|>", "Q", "<|end|>", "<|assistant|>"])
    eos = tok.eos_token_id
    b_longer = tok("B longer", add_special_tokens=False)["input_ids"]
    assert chat_ids == TokenPair(head + [tok.convert_tokens_to_ids("A"), eos], head + b_longer + [eos], 4)
    assert plain_ids.scored_from == 1 and dropped == 0  # Alpaca pairs: every token after the first, as before
    with torch.no_grad():
        got = sequence_log_probs(model, [chat_ids.chosen, chat_ids.rejected], tok.pad_token_id, scored_from=[4, 4])
        for sequence, value in zip((chat_ids.chosen, chat_ids.rejected), got):
            assert value.item() == pytest.approx(_manual_sequence_logp(model, sequence, 4).item(), rel=1e-5)
        # scored from 1 is the old whole-sequence sum, bit for bit
        whole = sequence_log_probs(model, [plain_ids.chosen, plain_ids.rejected], tok.pad_token_id)
        same = sequence_log_probs(model, [plain_ids.chosen, plain_ids.rejected], tok.pad_token_id, scored_from=[1, 1])
    assert torch.equal(whole, same)


def test_dpo_run_on_conversational_pairs(tiny_tokenizer, tmp_path):
    from conftest import chat_tokenizer

    from rlvr.modeling import build_model, save_model_and_tokenizer, small_olmo2_config

    tok = chat_tokenizer(tiny_tokenizer)
    model = build_model(small_olmo2_config(tok, hidden_size=32, num_layers=2, num_heads=4), seed=0)
    model_dir = save_model_and_tokenizer(model, tok, tmp_path / "sft")
    path = tmp_path / "chat_pairs.jsonl"
    with path.open("w") as f:
        for i, w in enumerate(WORDS):
            prompt = [{"role": "user", "content": f"Name colour {i}."}]
            chosen = [{"role": "assistant", "content": f"The colour is {w}."}]
            rejected = [{"role": "assistant", "content": f"No colour, sorry {i}."}]
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    tiny_tokenizer.save_pretrained(tmp_path / "no-template")  # a tokenizer alone: the model never loads
    with pytest.raises(UserError, match="has no chat template; start from a model trained on chat rows"):
        run_dpo(_config(tmp_path / "no-template", path, tmp_path / "refused"))
    out = run_dpo(_config(model_dir, path, tmp_path / "run", epochs=2.0))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[-1]["val/preference_accuracy"] > 0.5 and rows[-1]["val/loss"] < math.log(2)
