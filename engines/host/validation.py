"""Input checks that run before any engine loads: bad input fails fast, by name."""

from __future__ import annotations

import torch

from engines.host import rewards
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
    """Model folders load; the reward rule imports, takes (prompt, response, answer) and returns a
    number; the judge's verdict words are tokens its tokenizer knows; prompts match the schema,
    are non-empty, fit ``max_prompt_tokens``, have unique ids and the answers the rewards read."""
    policy = check_model_folder("model.policy", config.uri(config.model.policy), config.rollout.backend)
    from transformers import AutoTokenizer

    if config.reward.genrm_weight > 0:
        check_verdict_words(config, AutoTokenizer.from_pretrained(check_model_folder("model.judge", config.uri(config.model.judge),
                                                                                     config.judge.backend)))
    rule = rewards.load_rule(config.reward.rule) if config.reward.rule else None
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
        check_answers(config, field, uri, table, rule)
        counts[field] = len(table)
    return counts


def answers_needed_by(config, rule: rewards.Rule | None) -> list[str]:
    """The configured rewards that read a prompt's reference answer."""
    needed = [f"reward.rule {rule.spec} (its third parameter, answer, has no default)"] if rule and rule.needs_answer else []
    if config.reward.genrm_weight > 0 and "{answer}" in config.judge.template:
        needed.append("judge.template (it has an {answer} field)")
    return needed


def check_answers(config, field: str, uri: str, table, rule: rewards.Rule | None) -> None:
    """Every prompt has the answer the rewards read, and the rule scores the first one as a number
    (the reference answer as the response): a rule that cannot fails here, before any engine loads."""
    needed = answers_needed_by(config, rule)
    answers = table.column("answer")
    if needed and answers.null_count:
        missing = [pid for pid, a in zip(table.column("prompt_id").to_pylist(), answers.to_pylist()) if a is None]
        raise InputError(
            f"{uri} ({field}): field 'answer' is missing or null in {len(missing)} of {len(table)} rows (first prompt_id "
            f"{missing[0]}), and {' and '.join(needed)} read(s) it: add an 'answer' column, or give the rule a default "
            "(answer=None) if it does not need one"
        )
    if rule is not None:
        first = table.slice(0, 1).to_pylist()[0]
        try:
            rule(first["prompt"], first["answer"] or "", first["answer"], first["prompt_id"])
        except rewards.RewardRuleError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's function, reported by name
            raise InputError(f"reward.rule {rule.spec} raised {type(e).__name__}: {e} on prompt_id {first['prompt_id']} of "
                             f"{uri} (called with its reference answer as the response)") from e


def check_verdict_words(config, tokenizer) -> None:
    """``judge.good`` and ``judge.bad`` are spelled with tokens the judge's tokenizer knows: a word
    it maps to the unknown token can never be generated, so every verdict would score 0."""
    for name in ("good", "bad"):
        word = getattr(config.judge, name)
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        if not ids or (tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids):
            raise InputError(
                f"judge.{name}: the judge's tokenizer ({config.uri(config.model.judge)}) cannot spell '{word}' "
                f"(token ids {ids}, unknown token {tokenizer.unk_token_id}): choose a verdict word it knows"
            )
