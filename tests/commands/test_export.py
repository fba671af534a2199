"""`rlvr export` on real tiny CPU runs: the folder holds the run's best model, its tokenizer with the
chat template, a generation config and a model card with the run's data and validation figures, and
loads with transformers; a LoRA run keeps its adapters as a peft folder in every checkpoint and in the
export, which peft loads onto a fresh base model with the merged model's logits; bad input is one
line and exit status 2."""

from __future__ import annotations

import copy
import dataclasses

import torch
from test_health_runs import config, run, with_parity_validation

from rlvr import cli
from rlvr.commands.export import validation_figures
from rlvr.config import LoraConfig, ModelConfig
from rlvr.training.checkpoint import best_model
from rlvr.training.metrics_log import read_metrics

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _one_line_error(capsys, argv: list[str], says: str) -> None:
    capsys.readouterr()  # what ran before (progress bars, the run's warnings) is not this command's
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr export: ") and says in err and "\n" not in err, err


def test_export_writes_a_complete_folder_that_transformers_loads(tmp_path, tiny_model, tiny_tokenizer, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tiny_tokenizer = copy.deepcopy(tiny_tokenizer)  # the fixture is shared by the session: never mutate it
    tiny_tokenizer.chat_template = CHAT_TEMPLATE
    cfg = with_parity_validation(config(lr=0.05, n_steps=4), tmp_path)
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    run(cfg, run_dir, tiny_model, tiny_tokenizer)

    assert cli.main(["export", str(run_dir), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= names
    assert "adapter" not in names  # no LoRA in this run

    best_dir, record = best_model(run_dir)
    exported, best = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(best_dir)
    for (name, got), (_, want) in zip(exported.state_dict().items(), best.state_dict().items(), strict=True):
        assert torch.equal(got, want), name
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
    generation = GenerationConfig.from_pretrained(out)
    assert generation.max_new_tokens == cfg.rollout.max_new_tokens
    assert generation.eos_token_id == tiny_tokenizer.eos_token_id

    vals = [(r["step"], r["val/reward"]) for r in read_metrics(run_dir / "metrics.jsonl") if "val/reward" in r]
    figures = validation_figures(run_dir)
    assert figures["best"] == (record["step"], record["val/reward"])
    assert figures["final"] == max(vals)
    card = (out / "README.md").read_text()
    assert f"| best | {record['val/reward']:.4f} at step {record['step']} |" in card
    assert f"| final | {vals[-1][1]:.4f} at step {vals[-1][0]} |" in card
    assert cfg.data.train_source in card and '"n_steps": 4' in card

    # OUT exists: refused without --overwrite, replaced with it (here by the newest checkpoint's model).
    _one_line_error(capsys, ["export", str(run_dir), str(out)], "--overwrite")
    _one_line_error(capsys, ["export", str(run_dir), str(run_dir / "exported")], "inside the run directory")
    _one_line_error(capsys, ["export", str(run_dir), str(tmp_path), "--overwrite"], "holds the run")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not an export")
    _one_line_error(capsys, ["export", str(run_dir), str(other), "--overwrite"], "not an export")
    assert cli.main(["export", str(run_dir), str(out), "--checkpoint", "latest", "--overwrite"]) == 0
    assert "step_000004" in (out / "README.md").read_text()


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    _one_line_error(capsys, ["export", str(tmp_path / "nothing"), str(tmp_path / "out")], "not a training run")
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.json").write_text("{}")
    _one_line_error(capsys, ["export", str(started), str(tmp_path / "out")], "no saved model")
    assert not (tmp_path / "out").exists()


def test_a_lora_run_keeps_a_peft_adapter_that_gives_the_merged_logits(tmp_path, tiny_model, tiny_tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    tiny_model.save_pretrained(base_dir)
    tiny_tokenizer.save_pretrained(base_dir)
    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj"))
    cfg = dataclasses.replace(
        with_parity_validation(config(lr=0.05, n_steps=2), tmp_path),
        model=ModelConfig(name_or_path=str(base_dir), lora=lora),
    )
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    run(cfg, run_dir, AutoModelForCausalLM.from_pretrained(base_dir), tiny_tokenizer)
    for kept in ("step_000002", "best"):
        assert (run_dir / "checkpoints" / kept / "adapter" / "adapter_config.json").is_file(), kept

    # The newest checkpoint's: the best validation may be the untrained start, whose adapters are zero.
    assert cli.main(["export", str(run_dir), str(out), "--checkpoint", "latest"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out / "adapter").eval()
    fresh_base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = torch.randint(2, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, base = merged(input_ids=ids).logits, adapted(input_ids=ids).logits, fresh_base(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-4, "training left the adapters at zero: nothing to compare"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
