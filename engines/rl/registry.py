"""Every algorithm ``train.algorithm.name`` can pick: one config class each (``engines/rl/<name>.py``).
Adding one is a file and a line here."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Discriminator, Tag

from engines.rl.cispo import CISPOConfig
from engines.rl.dpo import DPOConfig
from engines.rl.grpo import GRPOConfig
from engines.rl.gspo import GSPOConfig
from engines.rl.online_dpo import OnlineDPOConfig
from engines.rl.ppo import PPOConfig
from engines.rl.reinforce_pp import ReinforcePPConfig
from engines.rl.rloo import RLOOConfig

ALGORITHMS = (GRPOConfig, GSPOConfig, CISPOConfig, RLOOConfig, ReinforcePPConfig, PPOConfig, OnlineDPOConfig, DPOConfig)
DEFAULT = GRPOConfig  # DAPO's settings: what the demo's figures were measured with


def _name(value) -> str:
    # a section without a name is the default algorithm's (train.algorithm.kl_coef=0.1 alone keeps grpo)
    return value.get("name", DEFAULT.model_fields["name"].default) if isinstance(value, dict) else value.name


AlgorithmChoice = Annotated[
    Union[tuple(Annotated[c, Tag(c.model_fields["name"].default)] for c in ALGORITHMS)],  # noqa: UP007
    Discriminator(_name),
]
