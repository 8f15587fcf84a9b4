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


@dataclass(frozen=True)
class Tokens:
    """A prompt already tokenized: an episode's conversation so far, as the engine sampled it and
    its observations were tokenized (``engines/agents/episodes.py``), never rendered again."""

    ids: tuple[int, ...]


Prompt = Union[str, list, Tokens]  # plain text, chat messages ([{"role": ..., "content": ...}, ...]), or token ids

_TURN = "\u2063yattflow-turn\u2063"  # stands for an assistant turn's content where only what follows it matters


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

    def text(self, prompt: Prompt, tools: list[dict] | None = None) -> str:
        """The text the model is prompted with (its chat template applied, the assistant's turn
        opened; ``tools``: the JSON schemas of the tools it may call, as its template shows them)."""
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
        return self.owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              **({"tools": tools} if tools else {}))

    def ids(self, prompt: Prompt, tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids as the engines tokenize it (images not expanded)."""
        if isinstance(prompt, Tokens):
            return list(prompt.ids)
        return self.tokenizer(self.text(prompt, tools), **self.encode_kwargs)["input_ids"]

    def batch_ids(self, prompts: list[Prompt]) -> list[list[int]]:
        """Each prompt's token ids (``Tokens`` as they are; text rendered and tokenized in one call)."""
        texts = {i: self.text(p) for i, p in enumerate(prompts) if not isinstance(p, Tokens)}
        encoded = dict(zip(texts, self.tokenizer(list(texts.values()), **self.encode_kwargs)["input_ids"])) if texts else {}
        return [list(p.ids) if isinstance(p, Tokens) else encoded[i] for i, p in enumerate(prompts)]

    # -- episodes (engines/agents): observations between sampled turns --------------------

    def observation_ids(self, observation: list[dict], after_eos: bool, tools: list[dict] | None = None) -> list[int]:
        """The tokens that go after an assistant turn as the engine sampled it: the rest of the
        template's end of that turn (what follows the end-of-sequence token the model sampled; all
        of it when the turn was cut short), the observation's turns (``observation``: messages,
        e.g. a ``tool`` turn), and the next assistant turn opened. Rendered after a stand-in
        assistant turn, so nothing the model wrote is ever rendered again. Without a chat template
        the observation's text is appended as it is, a tool's result as
        ``<tool_response>...</tool_response>`` (the plain call format: ``engines/agents/tools.py``)."""
        if not self.templated:
            text = "".join(f"<tool_response>{m['content']}</tool_response>" if m["role"] == "tool" else m["content"]
                           for m in observation)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN}]
        text = self.owner.apply_chat_template(base + observation, tokenize=False, add_generation_prompt=True,
                                              **({"tools": tools} if tools else {}))
        text = text[text.index(_TURN) + len(_TURN):]
        eos = self.tokenizer.eos_token
        if after_eos and eos and text.startswith(eos):
            text = text[len(eos):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def append_only(self, tools: list[dict] | None = None) -> str | None:
        """Why the model's chat template is not append-only (rendering a conversation one turn
        longer changes what it rendered before: earlier turns re-rendered, e.g. reasoning
        stripped), on a probe conversation; None when it is. Episodes never re-render what the
        model wrote (token-in/token-out), so such a template cannot make the trainer train on
        tokens the model did not sample; it means the context differs from what the template
        would render for the same conversation when the model is served."""
        if not self.templated:
            return None
        first = [{"role": "user", "content": "What is 2 + 2?"}]
        answer = {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}
        for reply in ({"role": "user", "content": "Are you sure?"}, {"role": "tool", "content": "4"}):
            if reply["role"] == "tool" and not tools:
                continue
            seen = self.text(first, tools) + answer["content"]  # the prompt and the turn as sampled
            after = self.text(first + [answer, reply], tools)
            if not after.startswith(seen):
                k = next((i for i, (a, b) in enumerate(zip(seen, after)) if a != b), len(after))
                return (f"after a {reply['role']} turn the render differs from what the model saw at character {k} "
                        f"({seen[k:k + 40]!r} became {after[k:k + 40]!r})")
        return None

    def supports_tools(self) -> bool:
        """The model's chat template renders tool schemas (it reads ``tools``)."""
        return self.templated and "tools" in (template_of(self.owner) or "")

    def _why_not(self, what: str) -> str:
        if self.format.chat_template == "none":
            return f"{what} needs a chat template, and data.chat_template=none renders none: set data.chat_template=auto"
        return (f"{what} needs a chat template, and the model's tokenizer has none (no chat_template in its "
                "tokenizer_config.json or chat_template.jinja): use a model with one, or plain 'prompt' text without "
                "data.system_prompt")
