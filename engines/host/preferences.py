"""Offline DPO on the engine host: a preference dataset's rows as a step's samples.

With ``data.preferences`` set (an algorithm that ``Needs.preferences``), the host's prompt stream
reads that dataset instead of ``data.prompts``, and the rollout stage, instead of generating,
writes each row's two responses as the prompt's two samples: ``chosen`` (sample 0) and
``rejected`` (sample 1), tokenized as the policy's engines tokenize (its chat template, then the
response and end of sequence). Scoring gives them their label as the reward (1 and 0; the judge
is not asked, the rule and format rule are still computed for the step's accuracy), and the
dynamic filter's pair step (``engines/host/experience.py``) pairs them. Everything after that
(training, the DP balance, weights sync, checkpoints, resume, held-out evaluation) is the RL
step's, unchanged.

The rows have no rollout log-probabilities (no policy sampled them): ``logprobs`` are zeros, which
DPO's loss never reads; the step's ``entropy`` and ``kl_rollout`` statistics mean nothing here.
"""

from __future__ import annotations

from engines.backends import chat
from engines.host.validation import InputError

LABELS = (1.0, 0.0)  # the reward of sample 0 (chosen) and sample 1 (rejected)


class PreferenceRows:
    """Turns preference rows into rollout rows, with the policy's tokenizer and chat template."""

    def __init__(self, policy_dir: str, config, vision: bool):
        if vision:
            raise InputError("data.preferences: offline DPO takes text prompts; model.policy is a vision-language model")
        from transformers import AutoTokenizer  # here: a host without preference rows (a stub's) never imports it

        self.tokenizer = AutoTokenizer.from_pretrained(policy_dir)
        self.renderer = chat.Renderer(self.tokenizer, chat.PromptFormat.policy(config))

    def response_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    def rollout_rows(self, chunk: list[dict], wave: int, policy_version: int) -> list[dict]:
        """Rollout rows (``storage.datasets.ROLLOUTS``) of ``chunk``'s rows: chosen, then rejected."""
        out = []
        for row in chunk:
            prompt_ids = self.renderer.ids(chat.source(row))
            for index, column in enumerate(("chosen", "rejected")):
                ids = self.response_ids(row[column])
                out.append({"prompt_id": row["prompt_id"], "sample_index": index, "policy_version": policy_version,
                            "wave": wave, "prompt": row["prompt"], "answer": row["answer"], "prompt_row": row["prompt_row"],
                            "prompt_ids": prompt_ids, "response": row[column], "response_ids": ids,
                            "logprobs": [0.0] * len(ids), "truncated": False})
        return out

    @staticmethod
    def reward(row: dict) -> float:
        return LABELS[row["sample_index"]]
