"""Dynamic sampling that adapts: how many prompts a DP group's next rollout wave draws.

A DP group trains on ``target_groups`` prompt groups whose rewards are not all equal (DAPO's
dynamic sampling: a group with equal rewards has zero advantage and teaches nothing). Each
rollout wave draws prompts; the filter keeps the groups whose rewards differ; more waves run
until the target is reached or ``max_waves`` waves ran. The share of a wave's prompts whose
group is kept — the *keep ratio* — moves as the policy learns (an easy task's groups become
all-correct), so a fixed wave size either overshoots (kept groups beyond the target were
thrown away) or undershoots (another whole wave, a long one if the ratio is low).

Adaptive waves (``sampling.adaptive``) draw what the estimated keep ratio says is missing::

    prompts = ceil(missing / keep_ratio * oversample), clipped to [1, max_prompts_per_wave]

where ``missing`` is the target minus the groups kept so far in this step (groups carried over
from the previous step count as kept). Before a group has observed any wave, it draws
``prompts_per_wave``. A wave always draws at least one prompt, so every step has fresh samples
from the current policy (its reward and accuracy metrics) even when the carry-over fills it.

The keep-ratio estimate is a recency-weighted pooled ratio over the group's waves: at every
wave ``kept ← decay·kept + kept_in_wave`` and ``drawn ← decay·drawn + prompts_in_wave``, and the
estimate is ``kept / drawn``. A wave of 40 prompts thus weighs more than a wave of 2 (a plain
EMA of per-wave ratios would let one tiny refill wave swing it), and old waves fade. It
carries across steps and is committed with each checkpoint (``RunState.sampling``).

Kept groups beyond the target are *carried over* (the engine host's ``dynamic_filter`` writes them to
``steps/{step}/carry/group={g}/part-000.parquet``) and come first in the next step's batch;
see ``sampling.max_carry_age``. The per-group state is small plain data — it travels through
flow parameters and ``state.json``, never sample data::

    {"carry": URI of the carried groups or None, "carried": how many, "kept": float, "drawn": float}
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class GroupSampling:
    """One DP group's dynamic-sampling state after a step (what the next step starts from)."""

    carry: str | None = None  # the kept groups carried into the next step (a Parquet object), or None
    carried: int = 0  # groups in ``carry``
    kept: float = 0.0  # recency-weighted groups kept ...
    drawn: float = 0.0  # ... over recency-weighted prompts drawn: the keep-ratio estimate
    ahead: list[int] = field(default_factory=list)  # rollout.mode=stream: prompts beyond the cursor taken already

    @property
    def keep_ratio(self) -> float | None:
        """The estimated share of drawn prompts whose group is kept; None before any wave."""
        return self.kept / self.drawn if self.drawn > 0 else None

    def observe(self, drawn: int, kept: int, decay: float) -> None:
        """One wave: ``drawn`` prompts, ``kept`` of their groups kept by the filter."""
        self.kept = decay * self.kept + kept
        self.drawn = decay * self.drawn + drawn

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict | None) -> "GroupSampling":
        return cls(**state) if state else cls()


def wave_size(missing: int, keep_ratio: float | None, *, first: int, oversample: float, cap: int) -> int:
    """Prompts for the next adaptive wave: ``ceil(missing / keep_ratio * oversample)`` clipped to
    ``[1, cap]``: 1 when nothing is missing; ``first`` (also clipped) while no keep ratio was
    observed; ``cap`` when nothing was ever kept (ratio 0)."""
    if missing <= 0:
        want = 1
    elif keep_ratio is None:
        want = first
    elif keep_ratio <= 0:
        want = cap
    else:
        want = math.ceil(missing / keep_ratio * oversample - 1e-9)  # 2 / 0.5 * 1.0 is 4, not 5
    return max(1, min(cap, want))


def plan_wave(sampling, state: GroupSampling, have: int) -> int:
    """Prompts the next wave of a group draws, by ``sampling`` (a ``SamplingConfig``): fixed waves
    draw ``prompts_per_wave``; adaptive waves follow the estimate in ``state`` for the groups
    missing when ``have`` are kept (carried-over groups included)."""
    if not sampling.adaptive:
        return sampling.prompts_per_wave
    return wave_size(sampling.target_groups - have, state.keep_ratio, first=sampling.prompts_per_wave,
                     oversample=sampling.oversample, cap=sampling.wave_cap)
