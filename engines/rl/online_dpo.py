"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"): DPO's
loss (``engines/rl/dpo.py``) on pairs the policy samples every step. Each prompt's
``rollout.samples_per_prompt`` samples are ranked by the step's reward (whatever the run scores
with: the judge, the rule, the format rule, the overlong penalty); the best and the worst form a
(chosen, rejected) pair, and groups whose rewards are all equal give none. The reference is the
starting policy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engines.rl.base import Needs
from engines.rl.dpo import DPOConfig


class OnlineDPOConfig(DPOConfig):
    name: Literal["online_dpo"] = "online_dpo"
    # a sampled pair's best sample need not be right (the judge's or the rule's best of a group):
    # learning its likelihood is not the default here, as it is for a dataset's chosen responses
    rpo_alpha: float = Field(0.0, ge=0, description="Weight of RPO's chosen-response NLL per token (engines/rl/dpo.py); "
                             "0: plain DPO, as online DPO was measured.")

    @property
    def needs(self) -> Needs:
        return Needs(reference=True, pairs=True)
