"""Input checks that run before any engine loads: bad input fails fast, by name."""

from __future__ import annotations

import torch

from storage import datasets, objectstore


class InputError(ValueError):
    """Bad input; the message names the file (or config field) and the field or row."""


# vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_model_folder(field: str, uri: str, backend: str = "torch") -> str:
    """A readable Hugging Face folder that the backend can serve, else an error naming the
    config field, the URI and the offending config.json field."""
    from transformers import AutoConfig  # here: every host imports this module, only rank 0 validates

    try:
        path = objectstore.local_folder(uri)
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure means the folder is unusable
        raise InputError(f"{field}: {uri} is not a readable Hugging Face model folder ({type(e).__name__}: {e})") from e
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if backend == "vllm" and not torch.cuda.is_available() and head_size not in VLLM_CPU_HEAD_SIZES:
        raise InputError(
            f"{field}: {uri}/config.json: head size {head_size} (hidden_size / num_attention_heads) is not one "
            f"vLLM's CPU attention supports {VLLM_CPU_HEAD_SIZES}; use the torch backend or another model"
        )
    return path


def validate_inputs(config) -> dict:
    """Model folders load; prompts match the schema, are non-empty, fit ``max_prompt_tokens``
    and have unique ids."""
    policy = check_model_folder("model.policy", config.uri(config.model.policy), config.rollout.backend)
    if config.reward.genrm_weight > 0:
        check_model_folder("model.judge", config.uri(config.model.judge), config.judge.backend)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    counts = {}
    for field, path in (("data.prompts", config.data.prompts), ("data.heldout", config.data.heldout)):
        if path is None:
            continue
        uri = config.uri(path)
        try:
            table = datasets.read_table(uri, datasets.PROMPTS)
        except objectstore.StorageError as e:
            raise InputError(f"{field}: {e}") from e
        if len(table) == 0:
            raise InputError(f"{uri}: no prompts")
        ids = table.column("prompt_id").to_pylist()
        if len(set(ids)) != len(ids):
            raise InputError(f"{uri}: field 'prompt_id' has duplicate values")
        for pid, prompt in zip(ids, table.column("prompt").to_pylist()):
            if not prompt.strip():
                raise InputError(f"{uri}: field 'prompt' is empty (prompt_id {pid})")
            length = len(tokenizer(prompt)["input_ids"])
            if length > config.data.max_prompt_tokens:
                raise InputError(
                    f"{uri}: field 'prompt' is {length} tokens (prompt_id {pid}); "
                    f"the limit is data.max_prompt_tokens={config.data.max_prompt_tokens}"
                )
        counts[field] = len(table)
    return counts
