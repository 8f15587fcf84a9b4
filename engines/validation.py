"""Input checks that run before any engine loads: bad input fails fast, by name."""

from __future__ import annotations

from transformers import AutoConfig, AutoTokenizer

from storage import datasets, objectstore


class InputError(ValueError):
    """Bad input; the message names the file (or config field) and the field or row."""


def check_model_folder(field: str, uri: str) -> str:
    """A readable Hugging Face folder, else an error naming the config field and the URI."""
    try:
        path = objectstore.local_folder(uri)
        AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure means the folder is unusable
        raise InputError(f"{field}: {uri} is not a readable Hugging Face model folder ({type(e).__name__}: {e})") from e
    return path


def validate_inputs(config) -> dict:
    """Model folders load; prompts match the schema, are non-empty, fit ``max_prompt_tokens``
    and have unique ids."""
    policy = check_model_folder("model.policy", config.uri(config.model.policy))
    if config.reward.genrm_weight > 0:
        check_model_folder("model.judge", config.uri(config.model.judge))
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
