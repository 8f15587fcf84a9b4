"""The ``rm`` section: ``yattflow rm``, training a scalar reward model from preference pairs
(``flows/rm.py``, ``engines/reward_model.py``). A section of ``RunConfig`` like the others, kept in
its own file beside ``sections.py``."""

from __future__ import annotations

from pydantic import Field, model_validator

from engines.config.sections import Section


class RMConfig(Section):
    """``yattflow rm``: a sequence-classification head (num_labels=1) trained with the Bradley-Terry
    loss -log sigmoid(r_chosen - r_rejected) on preference pairs."""

    data: str | None = Field(
        None, description="Preference pairs: a Parquet file or folder with the columns 'chosen' and 'rejected' (the "
        "preferred and the other response) and 'prompt' (text) or 'messages' (a chat) (required by `yattflow rm`, "
        "unless rm.demo).")
    heldout: str | None = Field(
        None, description="Held-out preference pairs (same columns, never trained on): pairwise accuracy (the share of "
        "pairs scored chosen > rejected) is printed every check_every steps, and `target` is measured on them. None: "
        "the training loss only.")
    demo: bool = Field(
        False, description="Build the arithmetic demo's preference pairs first (two per problem, chosen the right sum; "
        "rejected the teacher's carry slip or a near miss, and a close miss: one digit off by one) from the prompts "
        "`yattflow prepare` makes, into data/rm/train and data/rm/heldout, and train on them (rm.data and rm.heldout "
        "default to those).")
    base: str | None = Field(
        None, description="Hugging Face folder to start from (local, file:// or s3://): a causal LM (its body is kept "
        "and a new one-output score head added) or an existing sequence classifier with num_labels=1. None: a tiny "
        "Llama from scratch (the sft section's hidden_size, layers, heads, kv_heads and init_std) with a character "
        "tokenizer over the data's characters.")
    output: str = Field(
        "models/rm", description="The Hugging Face folder written (an AutoModelForSequenceClassification with "
        "num_labels=1 and its tokenizer, committed by its MANIFEST.json last): what model.reward_model names; a folder "
        "that already holds anything else is never written over.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (constant after a 100-step linear warm-up).")
    batch_size: int = Field(64, gt=0, description="Preference pairs per step.")
    steps: int = Field(
        3000, gt=0, description="Most training steps. A run stopped before them (Ctrl-C, a crash, or target not "
        "reached) continues from its last check when run again with the same run name (state: runs/<name>/rm).")
    target: float | None = Field(
        None, ge=0, le=1, description="Stop once held-out pairwise accuracy reaches this (needs heldout); a run that "
        "has not reached it after `steps` fails and writes no model (raise rm.steps and run again: it continues). "
        "None: train `steps` steps.")
    check_every: int = Field(100, gt=0, description="Steps between held-out checks (and saves of the resume state).")

    @model_validator(mode="after")
    def _target_needs_heldout(self):
        if self.target is not None and self.heldout is None and not self.demo:
            raise ValueError("rm.target needs rm.heldout: pairwise accuracy is measured on held-out pairs")
        return self
