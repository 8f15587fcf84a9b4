"""Prefect tasks: one per stage, each a thin adapter that sends one command to its DP
group's engine host and returns the host's metrics. No sample data passes through here."""

from tasks.stages import (
    checkpoint,
    checkpoint_wait,
    dynamic_filter,
    evaluate,
    export_policy,
    genrm_score,
    rollout,
    rollout_and_score,
    setup_engines,
    sync_weights,
    train_step,
    validate_inputs,
)

__all__ = [
    "validate_inputs", "setup_engines", "rollout", "genrm_score", "rollout_and_score", "dynamic_filter",
    "train_step", "sync_weights", "checkpoint", "checkpoint_wait", "evaluate", "export_policy",
]
