"""Every numeric setting of every command has its range checked before any model loads: one line
naming the key (or flag) and the allowed range, exit status 2."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from rlvr.checks import resolve_config, validate_config
from rlvr.cli import main as cli
from rlvr.commands.dpo import DPO_RANGES, DPOConfig
from rlvr.commands.evaluate import EVAL_RANGES, EvalConfig
from rlvr.commands.sft import SFT_RANGES, SFTConfig
from rlvr.commands.sft_instruct import INSTRUCT_SFT_RANGES, InstructSFTConfig
from rlvr.config import TRAIN_RANGES, AlgorithmConfig, ConfigError, OptimConfig, RewardConfig, TrainConfig
from rlvr.ranges import AT_LEAST_ONE, BELOW_ONE, POSITIVE, PROBABILITY, Range, flag_name, numeric_fields, range_problems
from rlvr.suites.run import SUITE_RANGES, SuiteConfig


def test_range_bounds_and_wording():
    assert [POSITIVE.contains(x) for x in (-1, 0, 1e-12, 5)] == [False, False, True, True]
    assert [BELOW_ONE.contains(x) for x in (-0.1, 0, 0.999, 1)] == [False, True, True, False]
    assert [PROBABILITY.contains(x) for x in (0, 1, 1.5)] == [True, True, False]
    assert not any(Range().contains(x) for x in (math.nan, math.inf, -math.inf))
    assert [str(r) for r in (POSITIVE, AT_LEAST_ONE, BELOW_ONE, Range(high=3, high_open=True), Range(0, 1, True))] == [
        "> 0",
        ">= 1",
        "in [0, 1)",
        "< 3",
        "in (0, 1]",
    ]


@dataclasses.dataclass
class Inner:
    eps: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.95)


@dataclasses.dataclass
class Outer:
    steps: int | None = None
    inner: Inner = dataclasses.field(default_factory=Inner)
    on: bool = False
    name: str = ""


def test_range_problems_name_the_key_the_range_and_the_value():
    table = {"steps": AT_LEAST_ONE, "inner.eps": POSITIVE, "inner.betas": BELOW_ONE}
    assert numeric_fields(Outer) == ["steps", "inner.eps", "inner.betas"]
    assert range_problems(Outer(), table) == []  # None is unset, not out of range
    bad = Outer(steps=0, inner=Inner(eps=-1.0, betas=(0.9, 1.0)))
    assert range_problems(bad, table) == [
        "steps must be >= 1, got 0",
        "inner.eps must be > 0, got -1.0",
        "each of inner.betas must be in [0, 1), got [0.9, 1.0]",
    ]
    assert range_problems(bad, table, flag_name)[0] == "--steps must be >= 1, got 0"
    # A key that the command's own checks already reported is not reported twice.
    assert range_problems(bad, table, known=["steps must be at least one step"])[0].startswith("inner.eps")


@pytest.mark.parametrize(
    "config,table",
    [
        (TrainConfig, TRAIN_RANGES),
        (DPOConfig, DPO_RANGES),
        (InstructSFTConfig, INSTRUCT_SFT_RANGES),
        (SFTConfig, SFT_RANGES),
        (EvalConfig, EVAL_RANGES),
        (SuiteConfig, SUITE_RANGES),
    ],
    ids=["train", "dpo", "sft_instruct", "sft", "eval", "eval_suite"],
)
def test_every_numeric_field_has_a_range(config, table):
    fields = numeric_fields(config)
    missing = [f for f in fields if f not in table]
    assert not missing, f"give these numeric fields of {config.__name__} a range in its table: {missing}"
    assert sorted(set(table) - set(fields)) == []


@pytest.mark.parametrize(
    "section,key,message",
    [
        (dict(algorithm=AlgorithmConfig(advantage_eps=-1.0)), "advantage_eps", "algorithm.advantage_eps must be > 0"),
        (dict(optim=OptimConfig(weight_decay=-0.1)), "weight_decay", "optim.weight_decay must be >= 0, got -0.1"),
        (dict(optim=OptimConfig(lr=math.nan)), "lr", "optim.lr must be > 0, got nan"),
        (dict(reward=RewardConfig(timeout_s=0.0)), "timeout_s", "reward.timeout_s must be > 0, got 0.0"),
        (dict(seed=-3), "seed", "seed must be >= 0, got -3"),
    ],
)
def test_train_config_values_out_of_range_are_refused(section, key, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        validate_config(resolve_config(TrainConfig(**section)))
    assert "\n" not in str(e.value)


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and f"rlvr {command}: warning: " not in line]
    assert len(lines) == 1 and lines[0].startswith(f"rlvr {command}: "), err
    return lines[0]


def test_each_command_refuses_a_value_out_of_range_in_one_line(tmp_path: Path, capsys):
    """Before any model loads: the models named here do not exist, and nothing is created."""
    model = str(tmp_path / "no-model")
    cases = [
        (
            ["train", "--out", str(tmp_path / "t"), "--algorithm.advantage_eps", "-1"],
            "train",
            "advantage_eps must be > 0",
        ),
        (
            ["dpo", "--model", model, "--data", "d.jsonl", "--out", str(tmp_path / "d"), "--weight-decay", "-0.5"],
            "dpo",
            "--weight-decay must be >= 0, got -0.5",
        ),
        (
            ["sft", "instruct", "--data", "d.jsonl", "--model", model, "--out", str(tmp_path / "i"), "--lr", "0"],
            "sft",
            "--lr must be > 0, got 0.0",
        ),
        (
            ["sft", "--model", "tiny", "--data", "arith", "--out", str(tmp_path / "s"), "--weight-decay", "-1"],
            "sft",
            "--weight-decay must be >= 0, got -1.0",
        ),
        (
            ["eval", "--model", model, "--data", "arith", "--out", str(tmp_path / "e"), "--reward-timeout-s", "-2"],
            "eval",
            "--reward-timeout-s must be > 0, got -2.0",
        ),
    ]
    for argv, command, message in cases:
        assert cli(argv) == 2, argv
        assert message in one_line_error(capsys, command)
    assert list(tmp_path.iterdir()) == []
