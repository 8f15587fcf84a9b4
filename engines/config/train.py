"""The ``train`` section of the run configuration: the training engine, its optimiser and the RL
loss. Beside ``sections.py`` because it grows with every trainer feature."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from engines.config.sections import MEASURED_TRAIN_S_PER_TOKEN, Section
from engines.rl.registry import DEFAULT, AlgorithmChoice

MOVED = ("loss_aggregation", "advantage_scale", "clip_low", "clip_high", "kl_coef")  # train.X → train.algorithm.X


LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """``train.lora``: train a low-rank adapter (LoRA, through ``peft``) instead of every weight."""

    rank: int = Field(8, gt=0, description="LoRA rank r: each adapted weight W (out x in) trains B (out x r) and A (r x in); "
                      "the update is B A * alpha / r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input during training (0: none; "
                           "the merged weights sent to the rollout engine never see it).")
    target_modules: list[str] = Field(
        LORA_DEFAULT_TARGETS, min_length=1,
        description="Modules that get an adapter, by name: an entry matches a module whose dotted name is the entry or "
        "ends with '.' + entry (peft's rule: 'q_proj' matches every layer's self_attn.q_proj). Every entry must match "
        "a module of model.policy (checked before the engines load). A vision-language policy's vision encoder gets "
        "none while train.freeze_vision is on. The default covers the attention and MLP projections of Llama, Qwen, "
        "Mistral and Gemma models.",
    )
    export_merged: bool = Field(
        False, description="Export: besides the adapter (runs/<name>/final: adapter_config.json and "
        "adapter_model.safetensors, with the tokenizer), write the merged full model (W + B A * alpha / rank) as a "
        "Hugging Face folder in runs/<name>/final/merged.")


class TrainConfig(Section):
    backend: Literal["torch", "megatron", "stub"] = Field(
        "torch", description="Training engine: torch (transformers) or megatron (Megatron-Core); stub: timing stub for scale "
        "benchmarks, not training (sleeps, then one real all-reduce of a tiny tensor)."
    )
    stub_seconds_per_token: float = Field(
        MEASURED_TRAIN_S_PER_TOKEN, ge=0,
        description="backend=stub only (timing stub for scale benchmarks, not training): seconds slept per (prompt + "
        "response) token of the group's batch; measured with `python -m engines.backends.stub.engines --measure`.",
    )
    tensor_parallel: int = Field(
        1, gt=0, description="Megatron-Core tensor-parallel size: the ranks of each DP group, one engine-host process and one "
        "device each, that split the policy's layers between them (docs/parallelism.md); backend=stub takes it as the "
        "layout alone."
    )
    pipeline_parallel: int = Field(
        1, gt=0, description="Megatron-Core pipeline-parallel size: each DP group's layers split into this many stages in "
        "a row, each stage train.tensor_parallel ranks, trained on Megatron-Core's 1F1B schedule over the minibatch's "
        "micro-batches (train.micro_batch_tokens cuts them; docs/parallelism.md); backend=stub takes it as the layout alone."
    )
    expert_parallel: int = Field(
        1, gt=0, description="Megatron-Core expert-parallel size for a mixture-of-experts policy: each DP group is this "
        "many engine-host processes, one device each, that hold every MoE layer's experts in equal shares (each of them "
        "the attention and the router) and train the group's batch together, each token sent to its experts' rank "
        "(Megatron's allgather dispatcher); at train.tensor_parallel=1 and train.pipeline_parallel=1 "
        "(docs/parallelism.md)."
    )
    fsdp: int = Field(
        1, gt=0, description="FSDP2 with the torch trainer: each DP group is this many engine-host processes, one device "
        "each, over which the policy's parameters, gradients and Adam state are sharded (fully_shard, one transformer "
        "block at a time), and PPO's critic's the same way; each trains its share of the group's rows, and the DP groups "
        "hold replicas of the shards (hybrid sharding; docs/parallelism.md). backend=stub takes it as the layout alone."
    )
    distributed_optimizer: bool = Field(False, description="Megatron-Core distributed optimizer (optimizer state sharded over DP).")
    reshardable_optimizer: bool = Field(
        False, description="With distributed_optimizer: checkpoint its state in Megatron-Core's fully_reshardable format, "
        "so that the run resumes under another tensor_parallel and pipeline_parallel too (docs/parallelism.md). Each save "
        "then gathers every rank's share of the optimizer state of its TP x PP part on its device for a moment (12 bytes "
        "per parameter of the part). false: dp_reshardable, each rank writes its own shard; resumes under another dp only.")
    recompute_granularity: Literal["none", "selective", "full"] = Field(
        "none",
        description="Megatron-Core activation recomputation: activations are dropped in the forward pass and recomputed "
        "in the backward pass, trading compute for activation memory. full: whole transformer layers (only their "
        "inputs are kept; see recompute_method); selective: the recompute_modules of every layer; none: keep everything.",
    )
    recompute_method: Literal["uniform", "block"] = Field(
        "uniform",
        description="recompute_granularity=full: uniform recomputes every chunk of recompute_num_layers layers (keeping "
        "each chunk's input); block recomputes only the first recompute_num_layers layers and keeps the rest.",
    )
    recompute_num_layers: int = Field(
        1, gt=0, description="recompute_granularity=full: layers per recomputed chunk (uniform) or layers recomputed (block)."
    )
    recompute_modules: list[Literal["core_attn", "mlp"]] = Field(
        ["core_attn"],
        description="recompute_granularity=selective: the parts of each layer recomputed. core_attn: the attention "
        "itself (little to gain with the engine's fused SDPA attention, which keeps no seq x seq scores); mlp: the "
        "feed-forward block (its 4x-wide activations: the larger saving).",
    )
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    minibatches: int = Field(2, gt=0, description="Optimizer steps per rollout batch.")
    micro_batch_tokens: int | None = Field(
        4096,
        gt=0,
        description="Tokens per forward/backward pass. The torch trainer and critic pack: each minibatch's sequences, "
        "longest first, are laid end to end in lanes as wide as the pass's longest sequence (positions restarting and "
        "attention kept within each sequence), lanes x width at most this size; a family that cannot pack (a "
        "vision-language model, linear attention) and the Megatron trainer pad instead: sequences sorted by length and "
        "cut into the fewest passes of at most this many padded tokens (sequences x longest sequence). Gradients "
        "accumulate before the minibatch's one optimizer step and every pass's loss is normalised by the whole "
        "minibatch's DP-global count: the update is the same (up to float summation order), a DP group's compute "
        "follows its tokens, and activation memory is bounded (docs/engines.md, Packed micro-batches). Set it about "
        "where one pass saturates the device. None: one pass per minibatch.",
    )
    algorithm: AlgorithmChoice = Field(
        default_factory=DEFAULT,
        description="The RL algorithm and its fields, picked by name (engines/rl/<name>.py): grpo (GRPO with DAPO's "
        "clip-higher and token-level loss by default; advantage_scale=none: Dr. GRPO), gspo (sequence-level ratio and "
        "clipping), cispo (clipped importance weight, gradient through every token), rloo (leave-one-out baseline), "
        "reinforce_pp (REINFORCE++: advantages normalised over the whole batch), ppo (a critic, model.critic, trained "
        "beside the policy; GAE advantages per token). Every one has loss_aggregation and kl_coef.",
    )
    freeze_vision: bool = Field(
        True, description="Vision-language policy: keep the vision encoder's weights fixed (the connector and the language "
        "model train). False trains it too.")
    lora: LoraConfig | None = Field(
        None, description="LoRA: train only a low-rank adapter of the policy (its optimizer state is the adapter's; "
        "checkpoints hold the adapter and record the policy folder it adapts; the rollout engine receives merged "
        "weights). null: train every weight. Set a field to turn it on (train.lora.rank=16), or train.lora={} for the "
        "defaults below. train.backend torch only.")
    router_replay: bool = Field(
        False, description="A mixture-of-experts policy: the rollout records the experts its router chose for each token, "
        "and the trainer's forward takes them (router replay, R3), its own router still weighting them. Where the two "
        "engines compute routing differently (bf16 against fp32, another kernel) a near-tie flips an expert and the "
        "trainer scores a token under another network than sampled it; replay keeps them one network "
        "(docs/engines.md#mixture-of-experts). rollout.backend torch records them; a dense policy is refused.")
    router_balance: float = Field(
        0.0, ge=0, description="A mixture-of-experts policy: the weight of the router's load-balancing loss (the Switch "
        "Transformer's, which Qwen3-MoE was pre-trained with at 0.001) added to the RL loss. Its value is the step's "
        "router_balance figure in TensorBoard either way: experts per token when the load is even, more as it gathers.")
    balance_tokens: bool = Field(
        True,
        description="Whether to spread each minibatch's sequences over the DP groups by token count "
        "(prompt + response, Karmarkar–Karp) before the train step, so that no group waits on a heavier one. "
        "The update is the same either way (up to float summation order); only which group computes which sequence changes.",
    )

    old_policy: Literal["bypass", "decoupled"] = Field(
        "bypass", description="The old policy of the clipped ratio. bypass: the rollout's log-probabilities (the behaviour "
        "policy) serve as it, no weight (exact when rollouts are on-policy, rollout.max_staleness=0). decoupled (AReaL): the "
        "trainer recomputes the old policy's log-probabilities at the start of the step and weights each token's loss by "
        "old / behaviour, corrected by off_policy_correction (docs/off-policy.md).")
    off_policy_correction: Literal["none", "tis", "mis"] = Field(
        "none", description="old_policy=decoupled: how the weight old / behaviour is bounded. none: as it is; tis: "
        "truncated at tis_cap per token; mis: whole sequences whose length-normalised ratio leaves [mis_low, mis_high] "
        "masked out. tis and mis need old_policy=decoupled.")
    tis_cap: float = Field(2.0, gt=0, description="off_policy_correction=tis: the cap C of min(old / behaviour, C).")
    mis_low: float = Field(0.5, gt=0, description="off_policy_correction=mis: a sequence whose geometric-mean ratio "
                           "old / behaviour is below this is masked.")
    mis_high: float = Field(2.0, gt=0, description="off_policy_correction=mis: a sequence whose geometric-mean ratio "
                            "old / behaviour is above this is masked.")

    @model_validator(mode="after")
    def _correction_needs_old_policy(self):
        if self.off_policy_correction != "none" and self.old_policy != "decoupled":
            raise ValueError(f"train.off_policy_correction={self.off_policy_correction} needs train.old_policy=decoupled "
                             "(under bypass the behaviour policy is the old policy: the ratio to correct is 1)")
        if self.mis_low >= self.mis_high:
            raise ValueError(f"train.mis_low ({self.mis_low}) must be below train.mis_high ({self.mis_high})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _moved_to_algorithm(cls, data):
        # the loss fields became the algorithm's own (each algorithm has its own set): say where they went
        moved = [key for key in MOVED if isinstance(data, dict) and key in data]
        if moved:
            raise ValueError("; ".join(f"train.{key} moved to train.algorithm.{key}" for key in moved)
                             + " (train.algorithm.name picks the algorithm, default grpo)")
        return data

    @field_validator("tensor_parallel", "pipeline_parallel", "expert_parallel", "distributed_optimizer", "reshardable_optimizer",
                     "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
    @classmethod
    def _megatron_only(cls, value, info):
        default = TrainConfig.model_fields[info.field_name].default
        # the timing stub takes the layout (its ranks), to scale-test the orchestration of groups of several ranks
        stub_layout = info.field_name in ("tensor_parallel", "pipeline_parallel") and info.data.get("backend") == "stub"
        if value != default and info.data.get("backend") != "megatron" and not stub_layout:
            raise ValueError("needs train.backend: megatron")
        return value

    @field_validator("reshardable_optimizer")
    @classmethod
    def _of_the_distributed_optimizer(cls, value, info):
        if value and not info.data.get("distributed_optimizer"):
            raise ValueError("is the distributed optimizer's checkpoint format (the plain optimizer's state always "
                             "reshards): set train.distributed_optimizer=true, or leave it false")
        return value

    @field_validator("fsdp")
    @classmethod
    def _torch_only(cls, value, info):
        if value != 1 and info.data.get("backend") == "megatron":
            raise ValueError("FSDP2 shards the torch trainer; train.backend=megatron splits a group's model with "
                             "train.tensor_parallel and train.pipeline_parallel")
        return value

    @model_validator(mode="after")
    def _lora_on_torch_only(self):
        if self.lora is not None and self.backend == "megatron":
            raise ValueError(
                "train.lora: LoRA is not implemented for train.backend=megatron: the Megatron trainer builds Megatron-Core "
                "layers (tensor-parallel ColumnParallelLinear/RowParallelLinear with fused QKV and gate/up weights), not "
                "the transformers modules peft adapts, and its Hugging Face mapping and distributed checkpoints know no "
                "adapter tensors; use train.backend=torch")
        if self.lora is not None and self.backend == "stub":
            raise ValueError("train.lora: the timing stub trains nothing; LoRA needs train.backend=torch")
        return self

    @model_validator(mode="after")
    def _routes_replayed_where_wired(self):
        if self.router_replay and self.backend == "stub":
            raise ValueError("train.router_replay: the timing stub routes nothing; use train.backend torch or megatron")
        if self.router_balance and self.backend != "torch":
            raise ValueError(f"train.router_balance: wired for train.backend=torch only (now {self.backend}): the Megatron "
                             "trainer maps a mixture of experts without its load-balancing loss")
        return self

    @model_validator(mode="after")
    def _critic_trainable(self):
        # what an algorithm needs, not its name: torch and Megatron train a critic (a VLM critic
        # folder and, on Megatron, an unmapped architecture are refused with the inputs)
        if self.algorithm.needs.critic and self.backend == "stub":
            raise ValueError(f"train.algorithm.name={self.algorithm.name} needs a critic (model.critic) and "
                             "train.backend=stub cannot train one: the timing stub trains nothing; use train.backend=torch "
                             "or megatron")
        return self
