"""The run configuration: one typed tree that holds every default.

Load it from YAML and override any field with ``key=value`` (dotted keys, YAML values)::

    config = load_config("deployments/demo.yaml", ["train.lr=3e-4", "dp=2"])

A wrong key or value fails with a message that names the file and the field.
Paths without a scheme are relative to ``storage.root``. The sections and their defaults are in
``engines/config/sections.py`` (the ``train`` section: ``engines/config/train.py``; ``prepare`` and
``sft``: ``engines/config/prepare.py``).
"""

from __future__ import annotations

import copy
import difflib
import functools
import textwrap
from typing import Annotated, get_args, get_origin
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from engines.config.sections import (
    Section, StorageConfig, ModelConfig, DataConfig, EvalConfig, RolloutConfig,
    JudgeConfig, RewardConfig, SamplingConfig, PlacementConfig, CheckpointConfig, HostsConfig,
    RunControlConfig, RetriesConfig, TimeoutsConfig, GuardConfig,
)
from engines.config.prepare import PrepareConfig, SFTConfig
from engines.config.rm import RMConfig
from engines.config.controllers import ControllersConfig
from engines.config.layout import Layout
from engines.config.train import TrainConfig
from storage import objectstore


class RunConfig(Section):
    name: str = Field("demo", pattern=r"^[a-z0-9][a-z0-9-]*$", description="Run id; running the same name again resumes it.")
    seed: int = Field(0, description="Seed for sampling and data order.")
    steps: int = Field(30, gt=0, description="RL iterations (steps) in the run.")
    steps_per_run: int | None = Field(
        None, gt=0,
        description="When set, each run trains this many more steps after the last committed one, up to `steps` "
        "(a schedule that fires again continues the training); None: train up to `steps`.",
    )
    dp: int = Field(2, gt=0, description="Data-parallel groups; each has train.tensor_parallel x train.pipeline_parallel x "
                    "train.fsdp engine-host processes (one by default), one device each.")
    threads_per_host: int = Field(1, gt=0, description="torch threads in each engine host.")
    host_timeout_s: float = Field(600.0, gt=0, description="A host command (or collective) taking longer fails the task.")
    storage: StorageConfig = Field(default_factory=StorageConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rm: RMConfig = Field(default_factory=RMConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    hosts: HostsConfig = Field(default_factory=HostsConfig)
    controllers: ControllersConfig = Field(default_factory=ControllersConfig)
    run: RunControlConfig = Field(default_factory=RunControlConfig)
    retries: RetriesConfig = Field(default_factory=RetriesConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)

    @property
    def layout(self) -> Layout:
        """The run's engine-host ranks: ``dp`` groups of ``train.tensor_parallel x train.expert_parallel x
        train.pipeline_parallel x train.fsdp``, with ``rollout.replicas`` rollout engines of
        ``rollout.tensor_parallel`` ranks in each (and the judge's likewise; engines/config/layout.py)."""
        t, r, j = self.train, self.rollout, self.judge
        return Layout(self.dp, t.tensor_parallel, t.pipeline_parallel, t.fsdp, r.replicas, r.tensor_parallel, j.replicas,
                      j.tensor_parallel, ep=t.expert_parallel)

    @model_validator(mode="after")
    def _devices_per_group(self):
        world = self.layout.world
        try:
            self.hosts.work_queue.format(group=0, rank=0, local=0)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"hosts.work_queue={self.hosts.work_queue!r}: {type(e).__name__}: {e} (its fields: {{group}}, the "
                             "DP group; {rank}, the host's rank in the run; {local}, its rank in its group)") from None
        if self.hosts.devices is not None and len(self.hosts.devices) != world:
            per = "one per group" if world == self.dp else (f"one per rank: dp={self.dp} groups of {self.layout.size}, "
                                                            "train.tensor_parallel x train.expert_parallel x "
                                                            "train.pipeline_parallel x train.fsdp")
            raise ValueError(f"hosts.devices has {len(self.hosts.devices)} entries for {world} engine hosts ({per})")
        if self.reward.reward_model_weight > 0 and self.model.reward_model is None:
            raise ValueError(f"reward.reward_model_weight={self.reward.reward_model_weight} but model.reward_model is not "
                             "set: name the reward model's folder (e.g. one `yattflow rm` wrote: model.reward_model=models/rm)")
        if self.data.heldout is not None and not self.reward.rule and self.reward.genrm_weight == 0:
            raise ValueError("data.heldout is scored by reward.rule, else by the judge (reward.genrm_weight > 0), never by "
                             "the reward model: name a reward.rule (its rule_weight may be 0) or set data.heldout=null")
        return self

    @model_validator(mode="after")
    def _eval_sets_are_scored(self):
        unscored = [n for n, s in self.eval.sets.items() if not s.rule] if not self.reward.rule and self.reward.genrm_weight == 0 else []
        if unscored:
            raise ValueError(f"eval.sets.{unscored[0]} has no rule, and there is neither a reward.rule nor a judge "
                             f"(reward.genrm_weight > 0) to score it: set eval.sets.{unscored[0]}.rule=module:function")
        return self

    @model_validator(mode="after")
    def _pairs_have_a_source(self):
        # what an algorithm needs, not its name (rollout.samples_per_prompt >= 2 already gives online pairs)
        needs, name = self.train.algorithm.needs, self.train.algorithm.name
        if needs.preferences and self.data.preferences is None:
            raise ValueError(f"data.preferences is not set: train.algorithm.name={name} learns from a preference dataset's "
                             "(chosen, rejected) pairs; name a Parquet of them (data.prompts' columns plus 'chosen' and "
                             "'rejected'), e.g. data.preferences=data/preferences")
        if self.data.preferences is not None and not needs.preferences:
            raise ValueError(f"data.preferences={self.data.preferences}: train.algorithm.name={name} does not learn from a "
                             "preference dataset (it samples its own); unset data.preferences, or pick an algorithm that "
                             "does (docs/algorithms.md)")
        return self

    @model_validator(mode="after")
    def _model_parallel_runs_where_wired(self):
        t = self.train
        if self.layout.size > 1 and t.algorithm.needs.critic:
            critic = f"train.algorithm: name={t.algorithm.name} has a critic"
            if t.expert_parallel > 1:
                raise ValueError(f"{critic}, which splits over train.tensor_parallel and train.pipeline_parallel (Megatron) "
                                 f"or train.fsdp (torch), not over experts (the Megatron critic is a dense model's): set "
                                 f"train.expert_parallel=1 (now {t.expert_parallel})")
            if self.rollout.max_staleness:
                raise ValueError(f"{critic}, whose values every rank of a group of {self.layout.size} computes together in "
                                 "the dynamic filter, which rollout.max_staleness >= 1 runs on the rollout lane of the "
                                 "group's rollout engines alone: set rollout.max_staleness=0, or train.tensor_parallel=1 "
                                 "and train.fsdp=1")
        return self

    @model_validator(mode="after")
    def _routes_recorded_where_wired(self):
        if not self.train.router_replay:
            return self
        if self.rollout.backend != "torch":
            raise ValueError(f"train.router_replay: the routes are recorded by rollout.backend=torch only (now "
                             f"{self.rollout.backend}): vLLM records them (enable_return_routed_experts) only with its "
                             "Model Runner V2, which needs Triton, a GPU; that recording is not wired yet")
        return self

    @model_validator(mode="after")
    def _episodes_are_wired(self):
        r, algorithm = self.rollout, self.train.algorithm
        if self.reward.env_weight > 0 and r.env is None:
            raise ValueError(f"reward.env_weight={self.reward.env_weight} but rollout.env is not set: the environment's "
                             "rewards come from its step(); name one (module:Class) or set reward.env_weight=0")
        if not r.episodes:
            return self
        what = f"rollout.env={r.env}" if r.env else f"rollout.tools={r.tools}"
        if algorithm.needs.preferences:
            raise ValueError(f"{what}: train.algorithm.name={algorithm.name} trains on a preference dataset, not on "
                             "episodes; use grpo, dapo, gspo, cispo, rloo, reinforce_pp, ppo or online_dpo")
        if r.backend == "stub" or self.judge.backend == "stub":
            raise ValueError(f"{what}: the timing stubs generate no text an environment or a tool could read; use "
                             "rollout.backend torch or vllm")
        return self

    @model_validator(mode="after")
    def _replicas_fit_the_group(self):
        size, chunk, wave = self.layout.size, self.placement.stream_chunk, self.sampling.prompts_per_wave
        chunks = -(-wave // chunk)  # a full wave's chunks
        for role, section in (("rollout", self.rollout), ("judge", self.judge)):
            n, tp = section.replicas, section.tensor_parallel
            if n * tp > size:
                raise ValueError(f"{role}.replicas={n} x {role}.tensor_parallel={tp}: a DP group has {size} rank(s) "
                                 "(train.tensor_parallel x train.pipeline_parallel x train.fsdp), one device each, and "
                                 f"each replica takes {tp}")
            if tp > 1 and section.backend != "vllm":
                raise ValueError(f"{role}.tensor_parallel={tp} needs {role}.backend: vllm (vLLM splits the engine over "
                                 f"{tp} ranks' devices; the {section.backend} engine is one rank's)")
            if n > 1 and chunks < n:
                raise ValueError(f"{role}.replicas={n}: a wave of sampling.prompts_per_wave={wave} prompts is {chunks} "
                                 f"chunk(s) of placement.stream_chunk={chunk}, and a replica works on whole chunks: lower "
                                 f"placement.stream_chunk to at most {max(1, wave // n)}")
        if self.placement.mode == "partial" and self.judge.tensor_parallel > 1:
            raise ValueError(f"placement.mode=partial with judge.tensor_parallel={self.judge.tensor_parallel}: the partial "
                             "mode's judge is a process of its own on the leader's devices (placement.judge_devices); "
                             "use judge.tensor_parallel=1 there")
        if self.placement.mode == "partial" and self.layout.serving("judge") != self.layout.serving("rollout"):
            raise ValueError(f"placement.mode=partial with rollout.replicas={self.rollout.replicas} and judge.replicas="
                             f"{self.judge.replicas}: each rank scores the chunks it generates there; make them equal "
                             "(and rollout.tensor_parallel=1)")
        return self

    @model_validator(mode="after")
    def _overlap_has_what_it_needs(self):
        # rollout.max_staleness >= 1 runs the rollout lane's commands beside the train step in each host
        k = self.rollout.max_staleness
        if k and self.train.algorithm.needs.critic:
            raise ValueError(f"rollout.max_staleness={k} with train.algorithm.name={self.train.algorithm.name}: the dynamic "
                             "filter computes advantages with the critic the train step is updating at the same time; "
                             "use rollout.max_staleness=0 with an algorithm that has a critic")
        if k and self.controllers.groups_per_node:
            raise ValueError(f"rollout.max_staleness={k} with controllers.groups_per_node={self.controllers.groups_per_node}: "
                             "node controllers run each step's groups in order (overlap is one process's, flows/pipeline.py); "
                             "use one of the two")
        r = self.rollout
        if r.mode == "stream":
            if not k:
                raise ValueError("rollout.mode=stream with rollout.max_staleness=0: the lane generates while the trainer "
                                 "trains, so its samples are at least one version behind; set rollout.max_staleness to the "
                                 "versions a sample may lag (1 or more)")
            scorers = self.reward.genrm_weight > 0 or self.reward.reward_model_weight > 0
            if scorers and self.layout.serving("judge") != self.layout.serving("rollout"):
                raise ValueError(f"rollout.mode=stream with rollout.replicas={r.replicas} and judge.replicas="
                                 f"{self.judge.replicas}: each rollout replica's lane scores the groups it generates with "
                                 "its own rank's judge and reward model; make them equal (and judge.tensor_parallel = "
                                 "rollout.tensor_parallel)")
            if self.data.preferences is not None:
                raise ValueError("rollout.mode=stream with a preference dataset (data.preferences): its samples are the "
                                 "dataset's two responses, nothing is generated to stream; use rollout.mode=waves")
        return self

    def uri(self, path: str) -> str:
        """Resolve a config path against the storage root."""
        return objectstore.resolve(self.storage.root, path)

    @property
    def run_uri(self) -> str:
        return self.uri(f"runs/{self.name}")


def sections_of(annotation) -> list[type[BaseModel]]:
    """The sections a field may hold: several for a choice by name (``train.algorithm``, a tagged
    union), one for a section that may be off (``train.lora: LoraConfig | None``), none for a value."""
    members = [get_args(a)[0] if get_origin(a) is Annotated else a for a in get_args(annotation)]
    return [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]


def describe_fields(section: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every config field as ``key = default`` and its description, in the order of the tree:
    what ``yattflow train --help`` lists."""
    lines = []
    for name, field in section.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            lines += describe_fields(field.annotation, f"{prefix}{name}.")
            continue
        sections = sections_of(field.annotation)
        if len(sections) > 1:  # a choice of sections by name (train.algorithm): the choice, then each one's own fields
            lines.append(f"  {prefix}{name}.name = {field.get_default(call_default_factory=True).name}")
            lines += textwrap.wrap(field.description or "", width=96, initial_indent="      ", subsequent_indent="      ")
            for variant in sections:
                lines.append(f"    with {prefix}{name}.name={variant.model_fields['name'].default}:")
                lines += [line for line in describe_fields(variant, f"{prefix}{name}.") if f"{prefix}{name}.name =" not in line]
            continue
        default = "(required)" if field.is_required() else field.get_default(call_default_factory=True)
        lines.append(f"  {prefix}{name} = {'null' if default is None else default}")
        lines += textwrap.wrap(field.description or "", width=96, initial_indent="      ", subsequent_indent="      ")
        if sections:  # a section that is off (None) by default, e.g. train.lora, or one per name (eval.sets): its fields
            lines += describe_fields(sections[0], f"{prefix}{name}.{'<name>.' if get_origin(field.annotation) is dict else ''}")
    return lines


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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), tree: dict | None = None,
                source: str | None = None) -> RunConfig:
    """Defaults ← YAML file (or ``tree``, a config as a mapping read from ``source``) ← ``key=value``
    overrides, validated as a whole.

    A command parses its config once: the same file text and overrides parsed before in this process
    (the command line's check, the flow run's name, the flow itself) come back as a copy of that parse."""
    if tree is not None:
        return _parsed(None, tuple(overrides), source or "<defaults>", tree)
    text = None
    if path:
        try:
            text = Path(path).read_text()
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: config file not found") from e
    return _parsed_text(text, tuple(overrides), source or (str(path) if path else "<defaults>")).model_copy(deep=True)


@functools.lru_cache(maxsize=16)
def _parsed_text(text: str | None, overrides: tuple[str, ...], source: str) -> RunConfig:
    """The config of a file's ``text`` (None: no file) and ``overrides``; kept (errors are not)."""
    return _parsed(text, overrides, source)


def _parsed(text: str | None, overrides: tuple[str, ...], source: str, tree: dict | None = None) -> RunConfig:
    tree = copy.deepcopy(tree or {})
    if text is not None:
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from e
        if not isinstance(tree, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level")
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
        problems = "; ".join(_problem(err) for err in e.errors())
        raise ConfigError(f"{source}: {problems}") from None


def _problem(err: dict) -> str:
    """One validation error as ``field 'a.b': what is wrong``; a key that is no setting with the
    nearest valid names (``difflib``): in its own section, else anywhere in the tree."""
    if err["type"] != "extra_forbidden":
        return f"field '{'.'.join(str(p) for p in err['loc']) or '(root)'}': {err['msg']}"
    section, path, tag, others = _section_at(err["loc"])
    key, prefix = path[-1], ".".join(path[:-1])
    where = (f"a setting of {prefix}" if prefix else "a top-level setting") + (f" with {prefix}.name={tag}" if tag else "")
    names = list(section.model_fields) if section is not None else []
    near = [f"{prefix}.{n}" if prefix else n for n in difflib.get_close_matches(key, names, n=3, cutoff=0.6)]
    having = [f"{prefix}.name={name} has {'it' if found[0] == key else found[0]}" for name, variant in others.items()
              if not near and (found := difflib.get_close_matches(key, list(variant.model_fields), n=1, cutoff=0.8))]
    if having:  # another choice's setting (another algorithm's)
        hint = "; ".join(having)
    else:
        if not near and not tag:  # a setting of another section (lr at the top level: train.lr)
            everywhere = {name.rsplit(".", 1)[-1]: name for name in _dotted_names(RunConfig)}
            near = [everywhere[n] for n in difflib.get_close_matches(key, list(everywhere), n=3, cutoff=0.75)]
        hint = (f"did you mean {' or '.join(near)}?" if near else
                f"its settings: {', '.join(names)}" if names else "`yattflow train --help` lists every setting")
    return f"field '{'.'.join(path)}' is not {where} ({hint})"


def _section_at(loc: tuple) -> tuple[type[BaseModel] | None, list[str], str | None, dict]:
    """The section that holds the last key of ``loc`` (a validation error's location); ``loc`` as
    the config spells it (a choice's tag left out: ``train.algorithm.grpo.x`` is
    ``train.algorithm.x``); and where the section is one of a choice by name (``train.algorithm``),
    the name chosen and the other choices' sections by name."""
    section: type[BaseModel] | None = RunConfig
    parts, path, tag, others = [str(p) for p in loc], [], None, {}
    while len(parts) > 1:
        part = parts.pop(0)
        path.append(part)
        field = section.model_fields.get(part) if section is not None else None
        choices = sections_of(field.annotation) if field is not None else []
        tag, others = None, {}
        if field is not None and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            section = field.annotation
        elif len(choices) == 1:  # a section that may be off (train.lora)
            section = choices[0]
        elif choices:  # a choice of sections by name (train.algorithm): the tag pydantic puts in the location
            tags = {c.model_fields["name"].default: c for c in choices}
            section = None
            if parts and parts[0] in tags and len(parts) > 1:
                tag = parts.pop(0)
                section, others = tags[tag], {t: c for t, c in tags.items() if t != tag}
        else:
            section = None
    return section, path + parts, tag, others


def _dotted_names(section: type[BaseModel], prefix: str = "") -> list[str]:
    """Every setting's dotted name (a choice's variants' fields under its own name)."""
    names = []
    for name, field in section.model_fields.items():
        inner = ([field.annotation] if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
                 else sections_of(field.annotation))
        if not inner:
            names.append(f"{prefix}{name}")
        for variant in inner:
            names += [n for n in _dotted_names(variant, f"{prefix}{name}.") if n not in names]
    return names
