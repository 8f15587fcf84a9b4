"""``TorchRewardModel``: a scalar reward model (``model.reward_model``) scoring samples on an engine host.

It stands on the judge's side of placement: under full colocation it holds the devices while the
samples are scored and releases them otherwise (``sleep``: its weights to host memory on a GPU;
nothing to do on a CPU); under partial colocation it runs where the judge does
(``engines.backends.build.make_reward_model``). How a sample is read is ``engines/reward_model.py``'s.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from engines import reward_model
from engines.backends import chat
from engines.backends.torch.model import resolve_device


class TorchRewardModel:
    """An ``AutoModelForSequenceClassification`` with one output, scoring (prompt, response) samples."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: torch.device | str | None = None,
                 prompt_format: chat.PromptFormat | None = None, batch_size: int = 64):
        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        # the pad token the model's head skips over to find each sequence's last (rightmost non-pad) token
        self.pad = next(t for t in (self.model.config.pad_token_id, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
                        if t is not None)
        self.model.config.pad_token_id = self.pad
        self.renderer = chat.Renderer(self.tokenizer, prompt_format)
        self.batch_size = batch_size

    def score(self, prompts: list[chat.Prompt], responses: list[str]) -> list[float]:
        texts = [reward_model.sample_text(self.renderer, p, r) for p, r in zip(prompts, responses)]
        return reward_model.scores(self.model, reward_model.encode(self.tokenizer, self.renderer, texts), self.pad, self.batch_size)

    def sleep(self) -> None:
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
