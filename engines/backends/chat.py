"""A prompt as the model sees it: the one place that knows about chat templates.

A prompts row is plain text (``prompt``) or a conversation (``messages``: ``[{"role", "content"}]``,
the turns before the model's answer). ``Renderer.text`` turns either into the text the model is
prompted with: with ``data.chat_template=auto`` and a tokenizer (or vision processor) that has a
chat template, the model's own template renders the conversation — plain text wrapped as one user
turn, after a ``data.system_prompt`` turn when one is set — and opens the assistant's turn;
otherwise the plain text is the prompt, as it is. Every engine (torch and vLLM generation, for the
policy and the judge) and the input checks (the length limit measures the rendered prompt) go
through it, so rollout, training (the trainer takes the rollout's prompt ids), evaluation and the
judge see the same prompt.

Tokenizing: a rendered template already holds the special tokens the model expects (Llama 3's
``<|begin_of_text|>``), so it is tokenized without adding any (``add_special_tokens=False``, as TRL
does); plain text is tokenized with them, as before. ``Renderer.encode_kwargs`` says which.

The reward rule and the judge's ``{prompt}`` read the raw prompt (``question``): the ``prompt``
column, else the last user turn of ``messages``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

Prompt = Union[str, list]  # plain text, or chat messages: [{"role": ..., "content": ...}, ...]


class ChatTemplateError(ValueError):
    """A prompt that needs a chat template the model does not have (or that data.chat_template turns off)."""


@dataclass(frozen=True)
class PromptFormat:
    """How prompts are rendered: ``chat_template`` "auto" (the model's template when it has one)
    or "none" (never), and the system turn put before every conversation that has none."""

    chat_template: str = "none"
    system_prompt: str | None = None

    @classmethod
    def policy(cls, config) -> "PromptFormat":
        """The policy's prompts (rollout, evaluation, the length check): ``data.chat_template`` and ``data.system_prompt``."""
        return cls(config.data.chat_template, config.data.system_prompt)

    @classmethod
    def judge(cls, config) -> "PromptFormat":
        """The judge's prompts (``judge.template`` filled in, one user turn): the template as the policy's, no system prompt."""
        return cls(config.data.chat_template, None)


def source(row: dict) -> Prompt:
    """What a prompts row asks the model: its ``messages`` when it has them, else its ``prompt`` text."""
    return row.get("messages") or row["prompt"]


def question(row: dict) -> str:
    """The raw prompt the reward rule and the judge read: the ``prompt`` text, else the content of
    the last user turn of ``messages`` (else of the last turn)."""
    if row.get("prompt") is not None:
        return row["prompt"]
    messages = row.get("messages") or []
    users = [m for m in messages if m.get("role") == "user"] or messages
    return users[-1]["content"] if users else ""


def template_of(owner) -> str | None:
    """The chat template of a tokenizer or processor (a processor's own, else its tokenizer's)."""
    template = getattr(owner, "chat_template", None)
    if not template and hasattr(owner, "tokenizer"):
        template = getattr(owner.tokenizer, "chat_template", None)
    return template or None


class Renderer:
    """Prompts → the model's prompt text, for one model (``owner``: its tokenizer, or its processor
    for a vision-language model) and one ``PromptFormat``."""

    def __init__(self, owner, prompt_format: PromptFormat | None = None):
        self.owner = owner
        self.tokenizer = getattr(owner, "tokenizer", owner)  # a processor's tokenizer; a tokenizer itself
        self.format = prompt_format or PromptFormat()
        self.templated = self.format.chat_template == "auto" and template_of(owner) is not None

    @property
    def encode_kwargs(self) -> dict:
        """Tokenizer keyword arguments for rendered text: no special tokens added to a rendered template."""
        return {"add_special_tokens": False} if self.templated else {}

    def text(self, prompt: Prompt) -> str:
        """The text the model is prompted with (its chat template applied, the assistant's turn opened)."""
        if not self.templated:
            if not isinstance(prompt, str):
                raise ChatTemplateError(self._why_not("chat messages ('messages')"))
            if self.format.system_prompt:
                raise ChatTemplateError(self._why_not("data.system_prompt"))
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.format.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.format.system_prompt})
        if self.tokenizer is not self.owner:  # a processor's template takes typed content parts
            messages = [m | {"content": [{"type": "text", "text": m["content"]}]} for m in messages]
        return self.owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids as the engines tokenize it (images not expanded)."""
        return self.tokenizer(self.text(prompt), **self.encode_kwargs)["input_ids"]

    def _why_not(self, what: str) -> str:
        if self.format.chat_template == "none":
            return f"{what} needs a chat template, and data.chat_template=none renders none: set data.chat_template=auto"
        return (f"{what} needs a chat template, and the model's tokenizer has none (no chat_template in its "
                "tokenizer_config.json or chat_template.jinja): use a model with one, or plain 'prompt' text without "
                "data.system_prompt")
