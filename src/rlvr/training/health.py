"""Health signals: what goes wrong in RL runs, said in one line when it starts.

A ``HealthMonitor`` reads each rollout step's metrics (the dict the trainer logs) and returns the
warnings that step raises. Each signal names the likely cause and the setting to change:

``val_drop``        the main validation reward has fallen well below its best so far (a learning rate
                    too high for the model is the usual cause; the best model is kept apart)
``entropy``         the policy's token entropy (mean of recent steps) has collapsed: it samples nearly one
                    answer per prompt
``length_collapse`` the mean response length has fallen far below where the run started
``length_cap``      many responses hit ``rollout.max_new_tokens`` (truncated answers score as wrong)
``no_signal``       nearly every group has all-equal rewards, so nearly nothing trains
``clip``            off-policy: many tokens' importance ratios left the trust region within a step
``ratio_drift``     off-policy: the policy moved far from the sampling policy over a step's updates
                    (their mean KL, k3: one update's small batch swings widely in runs that learn)
``grad_spike``      a step's largest gradient norm jumped far above the recent steps' largest (like
                    with like: with many updates a step, the largest is many times the mean)
``nonfinite``       an optimizer step had a non-finite loss or gradient and was skipped

A signal fires when its condition becomes true and again only after it has cleared, so a run that
stays in one state warns once. Thresholds are the fields of ``rlvr.config.HealthConfig``. The
monitor's state (best validation, first-step references, recent gradient norms) is checkpointed
with the run, so a resumed run warns exactly as an uninterrupted one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlvr.config import HealthConfig

SIGNALS = (
    "val_drop",
    "entropy",
    "length_collapse",
    "length_cap",
    "no_signal",
    "clip",
    "ratio_drift",
    "grad_spike",
    "nonfinite",
)
VAL_METRIC = "val/reward"
_GRAD_HISTORY = 20
"""The largest gradient norms of this many recent steps make the median a spike is measured against."""
_GRAD_MIN_HISTORY = 3


@dataclass(frozen=True)
class HealthWarning:
    signal: str
    step: int
    message: str

    def as_record(self) -> dict[str, Any]:
        return {"signal": self.signal, "step": self.step, "message": self.message}

    def line(self) -> str:
        return f"rlvr: health warning at step {self.step} [{self.signal}]: {self.message}"


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


@dataclass
class HealthMonitor:
    """Watches a run's per-step metrics; ``observe(metrics)`` returns the warnings of that step."""

    config: HealthConfig
    best_val: float | None = None
    best_val_step: int | None = None
    first_entropy: float | None = None
    first_length: float | None = None
    grad_peaks: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    active: list[str] = field(default_factory=list)
    """Signals whose condition held at the last step (they do not fire again until it clears)."""
    no_signal_streak: int = 0
    nonfinite_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_val": self.best_val,
            "best_val_step": self.best_val_step,
            "first_entropy": self.first_entropy,
            "first_length": self.first_length,
            "grad_peaks": list(self.grad_peaks),
            "entropies": list(self.entropies),
            "active": list(self.active),
            "no_signal_streak": self.no_signal_streak,
            "nonfinite_seen": self.nonfinite_seen,
        }

    @classmethod
    def from_state(cls, config: HealthConfig, state: dict[str, Any] | None) -> HealthMonitor:
        monitor = cls(config)
        for key, value in (state or {}).items():
            if hasattr(monitor, key):
                setattr(monitor, key, list(value) if isinstance(value, list) else value)
        return monitor

    def observe(self, metrics: dict[str, Any]) -> list[HealthWarning]:
        """The warnings that the step whose metrics these are raises (``metrics["step"]``)."""
        if not self.config.enabled:
            return []
        step = int(metrics.get("step", 0))
        conditions: dict[str, str] = {}
        for check in (
            self._val_drop,
            self._entropy,
            self._length,
            self._no_signal,
            self._off_policy,
            self._grad_spike,
            self._nonfinite,
        ):
            conditions.update(check(metrics))
        fired = [HealthWarning(s, step, conditions[s]) for s in SIGNALS if s in conditions and s not in self.active]
        self.active = [s for s in SIGNALS if s in conditions]
        return fired

    # -- the signals: each returns {signal: message} for the conditions that hold now -------------
    def _val_drop(self, m: dict[str, Any]) -> dict[str, str]:
        val = _finite(m.get(VAL_METRIC))
        if val is None:
            # No validation this step: the condition holds as it did at the last validation.
            return {"val_drop": ""} if "val_drop" in self.active else {}
        step = int(m.get("step", 0))
        if self.best_val is None or val >= self.best_val:
            self.best_val, self.best_val_step = val, step
            return {}
        drop = self.best_val - val
        if drop < self.config.val_drop:
            return {}
        return {
            "val_drop": (
                f"{VAL_METRIC} {val:.3f} is {drop:.3f} below its best, {self.best_val:.3f} at step "
                f"{self.best_val_step}: the policy is getting worse. A learning rate too high for the model is the "
                "usual cause: lower optim.lr (a third to a tenth). The best model is kept in checkpoints/best."
            )
        }

    def _entropy(self, m: dict[str, Any]) -> dict[str, str]:
        entropy = _finite(m.get("train/entropy"))
        if entropy is None:
            return {"entropy": ""} if "entropy" in self.active else {}
        if self.first_entropy is None:
            self.first_entropy = entropy
        # The mean of the last `patience` steps: one step's entropy swings with the prompts it drew.
        self.entropies = (self.entropies + [entropy])[-self.config.patience :]
        recent = sum(self.entropies) / len(self.entropies)
        floor = self.config.entropy_min
        if len(self.entropies) < self.config.patience or recent >= floor:
            return {}
        return {
            "entropy": (
                f"token entropy {recent:.2g} nats over the last {len(self.entropies)} steps is below "
                f"health.entropy_min={floor:g} (it started at {self.first_entropy:.2g}): the policy samples nearly "
                "one answer per prompt, so groups stop differing and learning stalls. Lower optim.lr, or add "
                "algorithm.entropy_coef or a KL to the reference (algorithm.kl_coef)."
            )
        }

    def _length(self, m: dict[str, Any]) -> dict[str, str]:
        out: dict[str, str] = {}
        length = _finite(m.get("train/response_length"))
        if length is not None:
            if self.first_length is None:
                self.first_length = length
            if self.first_length > 0 and length < self.config.length_collapse * self.first_length:
                out["length_collapse"] = (
                    f"mean response length {length:.1f} tokens is below {self.config.length_collapse:g} x its "
                    f"first step's {self.first_length:.1f}: responses are collapsing (often the reward pays a "
                    "short, degenerate answer, or the learning rate is too high). Check the rollouts in "
                    "DIR/rollouts and the reward, or lower optim.lr."
                )
        truncated = _finite(m.get("train/truncated_frac"))
        if truncated is not None and truncated > self.config.truncated_max:
            out["length_cap"] = (
                f"{truncated:.0%} of responses hit rollout.max_new_tokens and are cut off (graded as they "
                "stand): raise rollout.max_new_tokens, or leave truncated responses out of the loss "
                "(algorithm.mask_truncated)."
            )
        return out

    def _no_signal(self, m: dict[str, Any]) -> dict[str, str]:
        share = _finite(m.get("train/zero_adv_frac"))
        if share is None:
            return {}
        self.no_signal_streak = self.no_signal_streak + 1 if share >= self.config.no_signal_max else 0
        if self.no_signal_streak < self.config.patience:
            return {}
        reward = _finite(m.get("train/reward"))
        why = (
            "the task is solved at this difficulty: use harder data"
            if reward is not None and reward >= 0.5
            else "almost every answer is wrong: use easier data or a warm start"
        )
        return {
            "no_signal": (
                f"{share:.0%} of groups had all-equal rewards for {self.no_signal_streak} steps, so nearly "
                f"nothing trains ({why}, raise rollout.group_size, or drop such groups with rollout.filter_groups)."
            )
        }

    def _off_policy(self, m: dict[str, Any]) -> dict[str, str]:
        records = [r for r in m.get("updates") or [] if isinstance(r, dict)]
        clip = [v for v in (_finite(r.get("token_clip_frac")) for r in records) if v is not None]
        kl = [v for v in (_finite(r.get("kl_k3")) for r in records) if v is not None]
        out: dict[str, str] = {}
        if clip and max(clip) >= self.config.clip_fraction_max:
            out["clip"] = (
                f"{max(clip):.0%} of tokens had importance ratios outside [0.8, 1.2] in one update of this step "
                f"(health.clip_fraction_max={self.config.clip_fraction_max:g}): the policy moves too far per rollout "
                "batch. Lower optim.lr or take fewer updates per rollout batch (a larger optim.train_batch_size "
                "or fewer optim.epochs_per_rollout_batch)."
            )
        if kl and (drift := statistics.fmean(kl)) >= self.config.ratio_kl_max:
            out["ratio_drift"] = (
                f"the policy drifted from the sampling policy by KL {drift:.3g} (k3, the mean over this step's "
                f"{len(kl)} update{'s' * (len(kl) != 1)}; health.ratio_kl_max={self.config.ratio_kl_max:g}): "
                "importance weights become unreliable. Lower optim.lr or take fewer updates per rollout batch."
            )
        return out

    def _grad_spike(self, m: dict[str, Any]) -> dict[str, str]:
        # The step's largest norm against the median of recent steps' largest: the mean would be the
        # wrong yardstick off-policy, where the largest of many small updates is routinely far above it.
        peak = _finite(m.get("train/grad_norm_max", m.get("train/grad_norm")))
        out: dict[str, str] = {}
        if peak is not None and len(self.grad_peaks) >= _GRAD_MIN_HISTORY:
            median = statistics.median(self.grad_peaks)
            if median > 0 and peak >= self.config.grad_spike * median:
                out["grad_spike"] = (
                    f"gradient norm {peak:.3g} is {peak / median:.0f} x the recent steps' median {median:.3g}: one "
                    "batch pushed hard (optim.max_grad_norm clips it). Repeated spikes precede divergence: lower "
                    "optim.lr or optim.max_grad_norm."
                )
        if peak is not None and peak > 0:
            self.grad_peaks = (self.grad_peaks + [peak])[-_GRAD_HISTORY:]
        return out

    def _nonfinite(self, m: dict[str, Any]) -> dict[str, str]:
        total = m.get("train/skipped_nonfinite")
        if not isinstance(total, int) or total <= self.nonfinite_seen:
            return {}
        new, self.nonfinite_seen = total - self.nonfinite_seen, total
        return {
            "nonfinite": (
                f"{new} optimizer step(s) had a non-finite loss or gradient and were skipped; the run stops after "
                "max_consecutive_nonfinite in a row, keeping its last checkpoint. Lower optim.lr, check the "
                "rewards for NaN, or train in float32 (model.dtype)."
            )
        }


def summarize(warnings: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{signal: {"count", "first_step", "message"}}`` over a run's logged warning records."""
    out: dict[str, dict[str, Any]] = {}
    for w in warnings:
        entry = out.setdefault(w["signal"], {"count": 0, "first_step": w["step"], "message": w["message"]})
        entry["count"] += 1
    return out
