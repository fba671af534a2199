"""Config: defaults reproduce the course's settings, presets resolve, impossible settings are errors naming the fix,
files (YAML/TOML) plus command-line overrides parse, and the shipped example configs validate."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from rlvr.checks import resolve_config, validate_config
from rlvr.commands.train import parse_command
from rlvr.config import (
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    load_config_file,
    save_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def resolved(**kw) -> TrainConfig:
    return resolve_config(TrainConfig(**kw))


def test_defaults_are_spec_hyperparameters():
    c = resolved()
    assert c.n_steps == 200 and c.optim.lr == 1e-5 and c.optim.betas == (0.9, 0.95) and c.optim.weight_decay == 0
    assert c.rollout_batch_size == 256 and c.rollout.group_size == 8 and c.train_batch_size == 256
    assert c.optim.gradient_accumulation_steps == 32 and c.microbatch_size == 8 and c.optim.max_grad_norm == 1.0
    assert (c.rollout.temperature, c.rollout.top_p, c.rollout.max_new_tokens) == (1.0, 1.0, 512)
    assert c.eval_every == 10 and c.data.val_size >= 1024 and c.dump_every == 40 and c.data.train_size == 6400
    assert not c.off_policy and c.updates_per_rollout_batch == 1
    assert (c.algorithm.baseline, c.algorithm.advantage_normalizer, c.algorithm.loss_normalization) == (
        "mean",
        "std",
        "sequence",
    )
    assert validate_config(c) == []


@pytest.mark.parametrize(
    "preset,axes",
    [
        ("grpo", ("mean", "std", "sequence")),
        ("grpo_constant", ("mean", "std", "constant")),
        ("dr_grpo", ("mean", "none", "constant")),
        ("rft", ("none", "none", "constant")),
        ("maxrl", ("mean", "mean", "constant")),
        ("rloo", ("loo", "none", "constant")),
    ],
)
def test_presets_resolve_and_axes_override(preset, axes):
    a = resolved(algorithm=AlgorithmConfig(preset=preset)).algorithm
    assert (a.baseline, a.advantage_normalizer, a.loss_normalization) == axes
    if axes[2] == "constant":
        assert a.normalization_constant == 256 * 512  # Dr. GRPO: batch x max generation length
    b = resolved(
        algorithm=AlgorithmConfig(preset=preset, advantage_normalizer="none", normalization_constant=7.0)
    ).algorithm
    assert b.advantage_normalizer == "none" and b.baseline == axes[0]
    if axes[2] == "constant":
        assert b.normalization_constant == 7.0


def test_cliprange_defaults_per_method_and_off_policy_32x():
    c = resolved(
        algorithm=AlgorithmConfig(reweighting="gspo"),
        optim=OptimConfig(train_batch_size=8, gradient_accumulation_steps=1),
    )
    assert c.algorithm.cliprange == 3e-4 and c.off_policy and c.updates_per_rollout_batch == 32
    assert resolved(algorithm=AlgorithmConfig(reweighting="grpo")).algorithm.cliprange == 0.2
    assert resolved(algorithm=AlgorithmConfig(reweighting="grpo", cliprange=0.1)).algorithm.cliprange == 0.1
    assert resolve_config(c) == c  # idempotent
    assert validate_config(c) == []


def test_clip_higher_is_a_config():
    a = resolved(algorithm=AlgorithmConfig(reweighting="ppo_clip", cliprange_high=0.28)).algorithm
    assert (a.cliprange, a.cliprange_low, a.cliprange_high) == (0.2, 0.2, 0.28)  # low from the method's default
    b = resolved(algorithm=AlgorithmConfig(reweighting="ppo_clip", cliprange_low=0.1, cliprange_high=0.3))
    assert (b.algorithm.cliprange, b.algorithm.cliprange_low, b.algorithm.cliprange_high) == (0.1, 0.1, 0.3)
    assert resolve_config(b) == b and validate_config(b) == []
    sym = resolved(algorithm=AlgorithmConfig(reweighting="gspo")).algorithm
    assert sym.cliprange_low == sym.cliprange_high == 3e-4
    with pytest.raises(ConfigError, match="disagree"):
        resolved(algorithm=AlgorithmConfig(reweighting="ppo_clip", cliprange=0.2, cliprange_low=0.1))
    with pytest.raises(ConfigError, match="does not clip asymmetrically"):
        validate_config(resolved(algorithm=AlgorithmConfig(reweighting="noclip", cliprange_high=0.28)))
    with pytest.raises(ConfigError, match="cliprange_high must be > 0"):
        validate_config(resolved(algorithm=AlgorithmConfig(reweighting="ppo_clip", cliprange_high=-1.0)))


@pytest.mark.parametrize(
    "kw,fix",
    [
        (dict(optim=OptimConfig(train_batch_size=48)), "pick a divisor of 256"),
        (
            dict(optim=OptimConfig(gradient_accumulation_steps=3)),
            "not divisible by optim.gradient_accumulation_steps=3",
        ),
        (dict(algorithm=AlgorithmConfig(preset="ppo")), "unknown algorithm.preset 'ppo'"),
        (dict(algorithm=AlgorithmConfig(reweighting="clipped")), "unknown algorithm.reweighting 'clipped'"),
        (dict(algorithm=AlgorithmConfig(baseline="median")), "unknown algorithm.baseline"),
        (dict(algorithm=AlgorithmConfig(reweighting="grpo", cliprange=-0.2)), "cliprange must be > 0"),
        (
            dict(algorithm=AlgorithmConfig(preset="dr_grpo", normalization_constant=0.0)),
            "positive algorithm.normalization_constant",
        ),
        (dict(rollout=RolloutConfig(group_size=1)), "group_size >= 2"),
        (dict(algorithm=AlgorithmConfig(preset="rloo"), rollout=RolloutConfig(group_size=1)), "baseline=loo"),
        (dict(algorithm=AlgorithmConfig(kl_coef=-0.1)), "algorithm.kl_coef must be >= 0"),
        (dict(algorithm=AlgorithmConfig(kl_coef=0.1, kl_estimator="k4")), "unknown algorithm.kl_estimator 'k4'"),
        (dict(algorithm=AlgorithmConfig(entropy_coef=-1.0)), "algorithm.entropy_coef must be >= 0"),
        (
            dict(
                algorithm=AlgorithmConfig(kl_coef=0.1, kl_reference_device="cpu"),
                model=ModelConfig(lora=LoraConfig(rank=4)),
            ),
            "under LoRA the reference is the policy",
        ),
        (
            dict(reward=RewardConfig(overlong_buffer=600)),
            "reward.overlong_buffer must be in",
        ),
        (dict(reward=RewardConfig(overlong_penalty=-1.0)), "reward.overlong_penalty must be >= 0"),
        (
            dict(rollout=RolloutConfig(filter_groups=True), engine=EngineConfig(name="hf-worker")),
            "rollout.filter_groups samples more prompts",
        ),
        (dict(rollout=RolloutConfig(filter_max_rounds=0)), "rollout.filter_max_rounds must be >= 1"),
        (dict(rollout=RolloutConfig(rollout_batch_size=100, group_size=8)), "not divisible by rollout.group_size=8"),
        (dict(rollout=RolloutConfig(temperature=0.0)), "temperature must be > 0"),
        (dict(prompt="cot"), "unknown prompt 'cot'"),
        (dict(optim=OptimConfig(schedule="step")), "unknown optim.schedule"),
        (dict(data=DataConfig(train_size=16)), "smaller than one rollout batch"),
        (dict(engine=EngineConfig(max_staleness=2)), "engine.max_staleness must be 0"),
        (
            dict(engine=EngineConfig(name="hf", max_staleness=1), algorithm=AlgorithmConfig(reweighting="grpo")),
            "Set engine.name=hf-worker",
        ),
        (dict(engine=EngineConfig(name="hf-worker", max_staleness=1)), "Set algorithm.reweighting to grpo"),
    ],
)
def test_impossible_settings_name_the_fix(kw, fix):
    with pytest.raises(ConfigError, match=fix.replace("(", r"\(").replace(".", r"\.")):
        validate_config(resolve_config(TrainConfig(**kw)))


def test_each_section_reports_its_own_problems():
    """A section checks itself, with the message ``validate`` gives; a check that needs another section
    (the group size that a std normaliser needs) is ``validate``'s alone."""
    for section in (AlgorithmConfig(), RolloutConfig(), RewardConfig(), OptimConfig(), EngineConfig(), ModelConfig()):
        assert section.problems() == [], section
    assert RolloutConfig(top_p=0.0, max_new_tokens=0).problems() == [
        "rollout.top_p must be in (0, 1], got 0.0",
        "rollout.max_new_tokens must be >= 1, got 0",
    ]
    assert EngineConfig(name="hf", max_staleness=1).problems() == [
        "engine.max_staleness=1 needs an engine with its own copy of the weights that can run ahead of the "
        "trainer; engine.name='hf' cannot. Set engine.name=hf-worker (or max_staleness=0)"
    ]
    assert RolloutConfig(group_size=1).problems() == []
    with pytest.raises(ConfigError, match="advantage_normalizer=std needs rollout.group_size >= 2"):
        validate_config(resolved(rollout=RolloutConfig(group_size=1)))


def test_clip_method_without_cliprange_is_an_error(monkeypatch):
    import rlvr.grpo.presets as presets

    monkeypatch.setitem(presets.DEFAULT_CLIPRANGE, "grpo", None)
    with pytest.raises(ConfigError, match="needs algorithm.cliprange"):
        validate_config(resolved(algorithm=AlgorithmConfig(reweighting="grpo")))


def test_off_policy_without_reweighting_warns_but_on_policy_clip_is_fine():
    off = resolved(optim=OptimConfig(epochs_per_rollout_batch=2))
    with pytest.warns(UserWarning, match="stale samples without importance weights"):
        validate_config(off)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_config(resolved(algorithm=AlgorithmConfig(reweighting="grpo"))) == []  # on-policy, ratio 1


def test_eval_size_larger_than_data_is_an_error():
    c = resolved()
    with pytest.raises(ConfigError, match="validation data has only 500 examples"):
        c.check_data(n_train=6400, n_val=500)
    with pytest.raises(ConfigError, match="fewer than one rollout batch"):
        c.check_data(n_train=10, n_val=2000)


def test_yaml_and_toml_files_plus_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("algorithm: {preset: dr_grpo}\noptim: {lr: 2.0e-6, betas: [0.8, 0.9]}\nseed: 3\n")
    t = tmp_path / "c.toml"
    t.write_text('seed = 3\n[algorithm]\npreset = "dr_grpo"\n[optim]\nlr = 2e-6\nbetas = [0.8, 0.9]\n')
    a, b = load_config_file(y), load_config_file(t)
    assert a == b and a.optim.betas == (0.8, 0.9) and a.seed == 3 and a.rollout.group_size == 8
    flags = ["--optim.lr", "5e-6", "--algorithm.reweighting", "gspo", "--rollout.group_size", "4"]
    c, _, _, _ = parse_command(["--config", str(y), "--out", str(tmp_path / "run"), *flags])
    assert c.optim.lr == 5e-6 and c.algorithm.reweighting == "gspo" and c.rollout.group_size == 4
    assert c.algorithm.preset == "dr_grpo" and c.seed == 3  # the file's values survive
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {learning_rate: 1.0e-5}\n")
    with pytest.raises(ConfigError, match="unknown config key.*optim.learning_rate"):
        load_config_file(bad)


def test_config_json_round_trips(tmp_path):
    c = resolved(algorithm=AlgorithmConfig(preset="maxrl", reweighting="cispo"))
    save_config(c, tmp_path / "config.json")
    back = TrainConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert back == c


@pytest.mark.parametrize(
    "name",
    [
        "gsm8k_olmo2_1b_grpo.yaml",
        "gsm8k_olmo2_1b_grpo_2gpu.yaml",
        "gsm8k_olmo2_1b_offpolicy_32x.toml",
        "tiny_cpu.yaml",
        "gsm8k_olmo2_1b_async_2gpu.yaml",
        "gsm8k_olmo2_1b_dapo.yaml",
    ],
)
def test_example_configs_validate(name):
    c = resolve_config(load_config_file(CONFIGS / name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_config(c)
    if "async" in name:
        assert c.engine.max_staleness == 1 and c.engine.name == "hf-worker" and c.engine.device != c.policy_device
        assert c.algorithm.reweighting == "grpo" and c.algorithm.cliprange == 0.2 and not c.off_policy
    if "dapo" in name:
        a = c.algorithm
        assert (a.reweighting, a.cliprange_low, a.cliprange_high, a.loss_normalization) == (
            "ppo_clip",
            0.2,
            0.28,
            "token",
        )
        assert a.kl_coef == 0 and c.rollout.filter_groups and c.reward.overlong_buffer == 128 and c.off_policy
    if "32x" in name:
        assert c.updates_per_rollout_batch == 32 and c.algorithm.cliprange == 0.2
    if "olmo2_1b_grpo" in name:
        defaults = resolve_config(TrainConfig())
        assert (
            dataclasses.replace(
                c, engine=defaults.engine, policy_device=defaults.policy_device, save_every=defaults.save_every
            )
            == defaults
        )


def test_async_on_the_policy_gpu_warns_that_nothing_overlaps():
    kw = dict(algorithm=AlgorithmConfig(reweighting="grpo"), policy_device="cuda:0")
    with pytest.warns(UserWarning, match="barely overlap"):
        validate_config(resolved(engine=EngineConfig(name="hf-worker", device="cuda:0", max_staleness=1), **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            validate_config(resolved(engine=EngineConfig(name="hf-worker", device="cuda:1", max_staleness=1), **kw))
            == []
        )


# -------------------------------------------------------------------------------------------------
# Typed values: one reader for files, sweeps and config.json
# -------------------------------------------------------------------------------------------------


def test_values_are_converted_to_their_field_types():
    c = TrainConfig.from_dict(
        {
            "optim": {"lr": 1, "betas": [0.8, 1], "train_batch_size": None},
            "algorithm": {"advantage_eps": 0, "cliprange": 2},
            "data": {"train_size": 64.0},
            "plugins": ["a.py"],
            "n_steps": 5,
        }
    )
    assert c.optim.lr == 1.0 and isinstance(c.optim.lr, float)
    assert c.optim.betas == (0.8, 1.0) and all(isinstance(b, float) for b in c.optim.betas)
    assert isinstance(c.algorithm.advantage_eps, float) and c.algorithm.cliprange == 2.0
    assert c.data.train_size == 64 and isinstance(c.data.train_size, int)  # a whole float is an integer
    assert c.plugins == ("a.py",) and c.n_steps == 5


@pytest.mark.parametrize(
    "data,message",
    [
        ({"n_steps": "3"}, "config key n_steps must be an integer, got string '3' (write the number without quotes)"),
        (
            {"optim": {"lr": "1e-3"}},
            "config key optim.lr must be a number, got string '1e-3' (write the number without quotes)",
        ),
        ({"n_steps": 2.5}, "config key n_steps must be an integer, got number 2.5"),
        ({"log": {"wandb": "yes"}}, "config key log.wandb must be true or false, got string 'yes'"),
        ({"optim": {"schedule": "cosin"}}, "config key optim.schedule must be one of 'constant', 'cosine', 'linear'"),
        ({"optim": {"betas": [0.9]}}, "config key optim.betas must be a list of 2 numbers, got list [0.9]"),
        ({"data": {"train_size": "all"}}, "config key data.train_size must be an integer (or null), got string 'all'"),
        ({"seed": True}, "config key seed must be an integer, got boolean True"),
        ({"model": "tiny"}, "config key model must be a mapping of keys to values, got string 'tiny'"),
        ({"plugins": "a.py"}, "config key plugins must be a list of strings"),
    ],
)
def test_wrong_types_name_the_key_and_the_expected_type(data, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(data)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_yaml_files_read_exponents_as_numbers(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("optim: {lr: 1e-3, weight_decay: 1E-2}\nalgorithm: {advantage_eps: 1e-6}\n")
    c = load_config_file(y)
    assert (c.optim.lr, c.optim.weight_decay, c.algorithm.advantage_eps) == (1e-3, 1e-2, 1e-6)
    y.write_text("optim: {lr: [1e-3}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:1: not valid YAML"):
        load_config_file(y)
    y.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping of config keys"):
        load_config_file(y)


def test_group_of_one_with_a_mean_baseline_is_an_error():
    with pytest.raises(ConfigError, match="rollout.group_size=1 with algorithm.baseline=mean makes every advantage 0"):
        validate_config(
            resolved(rollout=RolloutConfig(group_size=1), algorithm=AlgorithmConfig(advantage_normalizer="none"))
        )
    rft = resolved(rollout=RolloutConfig(group_size=1), algorithm=AlgorithmConfig(preset="rft"))
    assert rft.algorithm.baseline == "none"
    validate_config(rft)  # no baseline: the rewards themselves are the advantages, so a group of one trains


def test_no_shipped_config_uses_the_vllm_engine():
    """vllm is opt-in: it has never run against a real server (rlvr.engines.vllm). Comments may mention it."""
    files = sorted(CONFIGS.rglob("*.yaml")) + sorted(CONFIGS.rglob("*.toml"))
    assert len(files) > 10
    for path in files:
        settings = [line.split("#", 1)[0] for line in path.read_text().splitlines()]
        assert not [line for line in settings if "vllm" in line.lower()], path
