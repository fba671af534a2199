"""Named algorithms as data: each preset fixes the advantage and aggregation axes.

| preset        | baseline | normalizer | loss normalization | source                                   |
|---------------|----------|------------|--------------------|------------------------------------------|
| grpo          | mean     | std        | sequence           | Shao et al. 2024 (DeepSeekMath)          |
| grpo_constant | mean     | std        | constant           | GRPO advantages, Dr. GRPO aggregation    |
| dr_grpo       | mean     | none       | constant           | Liu et al. 2025 (Understanding R1-Zero)  |
| rft           | none     | none       | constant           | rejection fine-tuning: SFT on successes  |
| maxrl         | mean     | mean       | constant           | MaxRL: advantages scaled by 1/p          |
| rloo          | loo      | none       | constant           | RLOO (Ahmadian et al. 2024)              |

RLOO's baseline is the mean of the group's other samples, and its loss the REINFORCE loss of the
whole sequence (the token sum, no per-length mean): ``constant`` aggregation.

Off-policy runs combine any preset with a reweighting method (``noclip``, ``ppo_clip`` with eps 0.2 (also
called ``grpo``),
``gspo`` with eps 3e-4, ``cispo``) and their default clip ranges below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    baseline: str
    advantage_normalizer: str
    loss_normalization: str


PRESETS: dict[str, Preset] = {
    "grpo": Preset("mean", "std", "sequence"),
    "grpo_constant": Preset("mean", "std", "constant"),
    "dr_grpo": Preset("mean", "none", "constant"),
    "rft": Preset("none", "none", "constant"),
    "maxrl": Preset("mean", "mean", "constant"),
    "rloo": Preset("loo", "none", "constant"),
}

DEFAULT_CLIPRANGE: dict[str, float | None] = {
    "none": None,
    "noclip": None,
    "ppo_clip": 0.2,
    "grpo": 0.2,
    "gspo": 3e-4,
    "cispo": 0.2,
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}: choose one of {sorted(PRESETS)}") from None
