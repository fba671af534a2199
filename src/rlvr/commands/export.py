"""`rlvr export RUN_DIR OUT`: a training run's model as a clean folder to share or serve.

``OUT`` holds the run's best model (``--checkpoint latest``: its newest checkpoint's) in Hugging Face
format, its tokenizer with the chat template it had, a ``generation_config.json`` and a model card
(``README.md``) with the run's config, data and validation figures; a LoRA run's adapters alone go
to ``OUT/adapter`` (``peft.PeftModel.from_pretrained(base, OUT / "adapter")``). ``--push-to-hub
REPO_ID`` then uploads the folder with ``huggingface_hub`` (log in first: ``hf auth login`` or
``HF_TOKEN``).

The folder is written beside ``OUT`` and renamed into place, so an interrupted export leaves no
half folder under ``OUT``'s name.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from rlvr.errors import TrainingError, UserError
from rlvr.training.checkpoint import ADAPTER_DIR, run_model
from rlvr.training.metrics_log import read_metrics

CARD = "README.md"
GENERATION_CONFIG = "generation_config.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def validation_figures(run_dir: Path) -> dict[str, tuple[int, float] | None]:
    """``{"best": (step, val/reward), "final": (step, val/reward)}`` from ``metrics.jsonl`` (each None
    when the run never validated); the best by the main validation reward, ties to the later step as
    the run's best model is chosen."""
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    vals = [
        (int(r["step"]), float(r["val/reward"]))
        for r in rows
        if isinstance(r.get("val/reward"), (int, float)) and isinstance(r.get("step"), int)
    ]
    vals = [(s, v) for s, v in vals if math.isfinite(v)]
    if not vals:
        return {"best": None, "final": None}
    best = max(vals, key=lambda sv: (sv[1], sv[0]))
    final = max(vals, key=lambda sv: sv[0])
    return {"best": best, "final": final}


def _figure(value: tuple[int, float] | None) -> str:
    return "not measured" if value is None else f"{value[1]:.4f} at step {value[0]}"


def model_card(run_dir: Path, which: str, config: dict[str, Any], summary: dict[str, Any], has_adapter: bool) -> str:
    """The model card (``README.md``): front matter the hub reads, then what was trained on what, the
    validation figures and the run's whole config."""
    model = config.get("model", {}) if isinstance(config.get("model"), dict) else {}
    data = config.get("data", {}) if isinstance(config.get("data"), dict) else {}
    algorithm = config.get("algorithm", {}) if isinstance(config.get("algorithm"), dict) else {}
    base = model.get("name_or_path")
    figures = validation_figures(run_dir)
    front = ["---", "library_name: transformers", "tags:", "- rlvr", "- reinforcement-learning"]
    # A hub id names the base model; a local folder or a model built from scratch (model.fresh) does not.
    if isinstance(base, str) and base and not model.get("fresh") and not Path(base).exists():
        front.append(f"base_model: {base}")
    front.append("---")
    val_sources = [data.get("val_source") or data.get("train_source"), *(data.get("val_sources") or ())]
    lines = [
        *front,
        "",
        f"# {run_dir.resolve().name}",
        "",
        f"Trained with rlvr from `{base}`: {algorithm.get('preset', '?')} "
        f"for {summary.get('step', config.get('n_steps', '?'))} steps "
        f"(run status: {summary.get('status', 'unknown')}). This folder holds the run's {which.removeprefix('its ')}.",
        "",
        "## Data",
        "",
        f"- training: `{data.get('train_source')}` (split `{data.get('train_split')}`, "
        f"{data.get('train_size') or 'all'} examples)",
        f"- validation: {', '.join(f'`{s}`' for s in val_sources if s)} (split `{data.get('val_split')}`, "
        f"{data.get('val_size')} examples)",
        f"- prompt: `{config.get('prompt')}`; reward: `{(config.get('reward') or {}).get('fn')}`",
        "",
        "## Validation (main validation reward, `val/reward`)",
        "",
        "| | val/reward |",
        "|---|---|",
        f"| best | {_figure(figures['best'])} |",
        f"| final | {_figure(figures['final'])} |",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER_OR_REPO")',
        'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER_OR_REPO")',
        "```",
    ]
    if has_adapter:
        lines += [
            "",
            "The LoRA adapters alone are in `adapter/` "
            f'(`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "adapter")`); '
            "the model at the top level has them merged.",
        ]
    lines += ["", "## Training config", "", "```json", json.dumps(config, indent=2), "```", ""]
    return "\n".join(lines)


def _generation_config(model_dir: Path, config: dict[str, Any]) -> Any:
    """The generation settings the run sampled with (temperature, top-p, response length), with the
    tokenizer's end and padding tokens."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    rollout = config.get("rollout", {}) if isinstance(config.get("rollout"), dict) else {}
    generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    if tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    temperature = float(rollout.get("temperature", 1.0))
    top_p = float(rollout.get("top_p", 1.0))
    generation.do_sample = temperature > 0
    if temperature > 0:
        generation.temperature = temperature
        generation.top_p = top_p
    if isinstance(rollout.get("max_new_tokens"), int):
        generation.max_new_tokens = rollout["max_new_tokens"]
    # Marked as set on purpose: transformers lets a model config's values override a generation config
    # that says it was only derived from one.
    generation._from_model_config = False
    return generation


def export_run(run_dir: str | Path, out: str | Path, checkpoint: str = "best", overwrite: bool = False) -> Path:
    """Write the export folder ``out`` of the training run ``run_dir`` (see the module's doc); bad
    input raises ``UserError`` before anything is written."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.json").is_file():
        raise UserError(f"{run_dir} is not a training run (no config.json); give the --out of an `rlvr train` run")
    found = run_model(run_dir, checkpoint)
    if found is None:
        raise UserError(f"{run_dir} has no saved model yet (no checkpoint); export it after its first checkpoint")
    model_dir, which = found
    if out.resolve() == run_dir.resolve() or run_dir.resolve() in out.resolve().parents:
        raise UserError(f"{out} is inside the run directory; export to a folder outside {run_dir}")
    if out.resolve() in run_dir.resolve().parents:
        raise UserError(f"{out} holds the run {run_dir}; export to a folder outside it")
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists; pass --overwrite to replace it, or choose another OUT")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder; choose another OUT")
    # --overwrite replaces an earlier export or an empty folder, never a folder of other files by a slip.
    if out.is_dir() and any(out.iterdir()) and not (out / CARD).is_file():
        raise UserError(f"{out} holds files that are not an export; choose another OUT")
    if not any(model_dir.glob("tokenizer*")):
        raise UserError(
            f"{model_dir} holds no tokenizer; the run saved its model without one, so it cannot be exported"
        )
    config = _read_json(run_dir / "config.json")
    summary = _read_json(run_dir / "summary.json")
    adapter = model_dir.parent / ADAPTER_DIR

    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model_dir, tmp)
    if adapter.is_dir():
        shutil.copytree(adapter, tmp / ADAPTER_DIR)
    _generation_config(model_dir, config).save_pretrained(str(tmp))
    (tmp / CARD).write_text(model_card(run_dir, which, config, summary, adapter.is_dir()))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def push_to_hub(folder: Path, repo_id: str, private: bool) -> str:
    """Upload ``folder`` to the hub model repository ``repo_id`` (created when missing); returns its URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model")
    except HfHubHTTPError as e:
        raise TrainingError(
            f"uploading to {repo_id} failed ({e}); log in with `hf auth login` or set HF_TOKEN, then run again"
        ) from e
    return f"https://huggingface.co/{repo_id}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rlvr export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the --out folder of an `rlvr train` run")
    parser.add_argument("out", type=Path, metavar="OUT", help="the folder to write")
    parser.add_argument(
        "--checkpoint",
        choices=("best", "latest"),
        default="best",
        help="best: the model of the best validation (the default); latest: the newest checkpoint's",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT when it exists")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload OUT to this hub model repository")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    args = parser.parse_args(argv)
    out = export_run(args.run_dir, args.out, checkpoint=args.checkpoint, overwrite=args.overwrite)
    print(f"rlvr export: wrote {out}")
    if args.push_to_hub:
        print(f"rlvr export: uploaded to {push_to_hub(out, args.push_to_hub, args.private)}")
    return 0
