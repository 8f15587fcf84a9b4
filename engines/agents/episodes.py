"""Many episodes at once, token-in/token-out (``rollout.env``, ``rollout.tools``).

Each sample of a prompt is an episode: its own environment instance (``reset(row)`` gives the
first prompt), then turns. Every turn, the live episodes of a chunk go into **one** generate call
(vLLM batches them continuously); then each episode's turn is read: tool calls in it are run and
answered as ``tool`` turns; else the environment's ``step(text)`` answers the next observation, a
reward and whether it is done (every episode's calls and steps at once, on threads); with
neither, the first answer ends the episode.

What is trained is exactly what the engine saw and sampled: the prompt's tokens, then each
assistant turn's sampled tokens (loss mask 1, their rollout log-probs) and the observation's
tokens after it (loss mask 0, log-prob 0), tokenized as the chat template renders the observation
after an assistant turn (``chat.Renderer.observation_ids``). The conversation is never rendered
again, so earlier turns are never re-tokenized: a template that is not append-only cannot put
tokens the model never produced into training. The next turn's prompt is those same tokens
(``chat.Tokens``).

An episode ends when the environment says done, when the model answers without a tool call and
there is no environment, or cut (``truncated``): at ``rollout.max_turns`` turns, at
``rollout.episode_tokens`` response tokens, or when a turn hit ``rollout.max_new_tokens``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engines.agents import environment, sandbox, tools as toolbox
from engines.backends import chat
from engines.backends.base import Generation, Generator, report_progress

@dataclass
class Episode:
    row: dict  # the prompts row (every column)
    env: object | None
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    env_reward: float | None = None
    done: bool = False
    truncated: bool = False
    text: str = ""  # the last turn as sampled: what the tools and the environment read
    cut_eos: bool = False  # the last turn ended without its end-of-sequence token
    routes: list[int] | None = None  # a MoE policy's routes of every token fed (train.router_replay; _sampled)

    def response(self, tokenizer) -> str:
        """The whole episode after its prompt as text: turns and observations (what the rule reads)."""
        return tokenizer.decode(self.response_ids, skip_special_tokens=True)

    def columns(self, tokenizer) -> dict:
        """The rollout row's fields of this episode (``storage.datasets.ROLLOUTS``)."""
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                "response": self.response(tokenizer), "logprobs": self.logprobs,
                "truncated": self.truncated, "loss_mask": self.loss_mask, "turns": self.turns,
                "tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "tool_s": self.tool_s,
                "env_reward": self.env_reward, "routed_experts": self.routes}


class Episodes:
    """The run's environment class and tools (``rollout``'s fields), loaded and checked once; ``run``
    plays a chunk's episodes. ``renderer``: the policy's (its tokenizer and chat template)."""

    def __init__(self, rollout, renderer: chat.Renderer):
        self.config, self.renderer = rollout, renderer
        self.env_class = environment.load(rollout.env) if rollout.env else None
        self.tools = toolbox.load(rollout.tools, plain=not renderer.templated)  # no template: the plain call format
        self.schemas = [toolbox.schema(fn) for fn in self.tools.values()] or None
        if self.tools and renderer.templated and not renderer.supports_tools():  # no template: the plain call format
            raise chat.ChatTemplateError(f"rollout.tools={rollout.tools}: the policy's chat template does not render "
                                         "tools (it never reads 'tools'): use a model whose template does (Qwen3, Qwen2.5, "
                                         "Llama 3.1+, Hermes)")
        self.not_append_only = renderer.append_only(self.schemas)
        sandbox.configure(wall_s=rollout.tool_timeout_s)

    @classmethod
    def of(cls, config, model_dir: str) -> "Episodes":
        """The run's episodes (``config``: its ``RunConfig``) for the policy in ``model_dir``."""
        from transformers import AutoTokenizer

        return cls(config.rollout, chat.Renderer(AutoTokenizer.from_pretrained(model_dir), chat.PromptFormat.policy(config)))

    def run(self, generator: Generator, rows: list[dict], n: int, seed: int, greedy: bool = False) -> list[Episode]:
        """``n`` episodes of each row, prompt-major, on the rollout engine ``generator`` (with the
        run's sampling settings: ``rollout.temperature``, ``top_p``, ``max_new_tokens``; ``greedy``:
        every turn greedy, as held-out evaluation plays them)."""
        cfg = self.config
        episodes = [self._start(row) for row in rows for _ in range(n)]
        half = len(episodes) // 2
        lanes = [episodes[:half], episodes[half:]] if cfg.overlap_tools and half else [episodes]
        turns = [0] * len(lanes)
        pending = None  # (lane, its episodes, their observations: a future) being answered
        with ThreadPoolExecutor(1, thread_name_prefix="episode-answers") as background:
            while pending is not None or any(not e.done for e in episodes):
                for k, lane in enumerate(lanes):
                    if pending is not None and pending[0] == k:  # this lane's own answers first
                        self._continue(pending[1], pending[2].result())
                        pending = None
                    live = [e for e in lane if not e.done]
                    if live:
                        report_progress()
                        gens = generator.generate([chat.Tokens(tuple(e.prompt_ids + e.response_ids)) for e in live],
                                                  temperature=cfg.temperature, top_p=cfg.top_p,
                                                  max_new_tokens=cfg.max_new_tokens, greedy=greedy,
                                                  seed=(seed * 1009 + turns[k] * len(lanes) + k) % 2**32)
                        for e, g in zip(live, gens):
                            self._sampled(e, g)
                    if pending is not None:  # the other lane's tools ran while this lane generated
                        self._continue(pending[1], pending[2].result())
                        pending = None
                    if answering := [e for e in live if not e.done]:
                        pending = (k, answering, background.submit(self._observe, answering, turns[k]))
                    turns[k] += bool(live)
        return episodes

    def answers(self, generator: Generator, rows: list[dict]) -> list[dict]:
        """Each row with its greedy episode's text as ``response``: held-out evaluation."""
        return [e.row | {"response": e.response(self.renderer.tokenizer)} for e in self.run(generator, rows, 1, 0, greedy=True)]

    def first_prompt(self, row: dict, env) -> chat.Prompt:
        """The episode's first prompt: the environment's ``reset(row)`` (checked), else the row's own."""
        if env is None:
            return chat.source(row)
        first = self._call(env, "reset", row, row, 0)
        return first if isinstance(first, str) else environment.messages_of(first, self._where(row, 0))

    def try_environment(self, row: dict, timeout_s: float) -> None:
        """The run's environment tried on ``row`` before any engine loads: built, ``reset(row)``, then
        one ``step`` with the row's reference answer (or "") as the model's turn, each call within
        ``timeout_s``; what they answer is checked as an episode checks it (``EnvError`` naming the
        environment, the prompt, the turn and what is wrong)."""
        from engines import deadline

        what, where = "building it", f"rollout.env {self.config.env}"
        try:
            env = deadline.call(timeout_s, self.env_class)
            what, where = "reset()", self._where(row, 0)
            deadline.call(timeout_s, self.first_prompt, row, env)
            what, where = "step()", self._where(row, 1)
            answer = row.get("answer") if isinstance(row.get("answer"), str) else ""
            environment.checked_step(deadline.call(timeout_s, self._call, env, "step", answer, row, 1), where)
        except deadline.Expired:
            raise environment.EnvError(f"{where}: {what} ran past {timeout_s:g}s (rollout.tool_timeout_s) when it was "
                                       "tried before the run: it hangs or is too slow") from None
        except environment.EnvError:
            raise
        except Exception as e:  # noqa: BLE001 - its constructor raised: the user's to fix
            raise environment.EnvError(f"{where}: {what} raised {type(e).__name__}: {e}") from e

    def _start(self, row: dict) -> Episode:
        env = self.env_class() if self.env_class else None
        return Episode(row, env, self.renderer.ids(self.first_prompt(row, env), self.schemas))

    def _sampled(self, e: Episode, g: Generation) -> None:
        """The turn the engine sampled, on the episode (cut at the episode's token budget).

        A MoE policy's routes (``train.router_replay``) are stitched turn by turn: the tokens an
        earlier turn sampled keep the routes that turn's decoding chose, and this turn's call adds
        the rest it fed (the earlier turn's last token and the observation, from its prefill, then
        its own sampled tokens), so every token the trainer replays was routed as it was generated."""
        room = self.config.episode_tokens - len(e.response_ids)
        ids, logprobs = g.response_ids[:room], g.logprobs[:room]
        if g.routed_experts is not None:
            fed = len(e.prompt_ids) + len(e.response_ids) + len(g.response_ids) - 1  # the tokens this call fed
            width = len(g.routed_experts) // fed  # MoE layers x experts per token
            kept = e.routes or []
            e.routes = (kept + g.routed_experts[len(kept):])[: (len(e.prompt_ids) + len(e.response_ids) + len(ids) - 1) * width]
        e.response_ids += ids
        e.loss_mask += [1] * len(ids)
        e.logprobs += logprobs
        e.turns += 1
        e.text = g.response
        e.cut_eos = g.truncated or len(ids) < len(g.response_ids)
        if e.cut_eos:
            e.done = e.truncated = True

    def _observe(self, live: list[Episode], turn: int) -> dict[int, list[dict]]:
        """Each live episode's observation after its turn (by ``id``): its tools' results, else its
        environment's step; every episode's calls and steps at once, on threads. An episode the
        environment ends, or that answered without a tool and has no environment, is done."""
        calls = {id(e): toolbox.parse(e.text) if self.tools else [] for e in live}
        jobs = [(e, c) for e in live for c in calls[id(e)]] + [(e, None) for e in live if not calls[id(e)] and e.env]

        def run(job):
            e, c = job
            if c is not None:
                return toolbox.call(self.tools, c, self.config.tool_timeout_s)
            return self._call(e.env, "step", e.text, e.row, turn + 1)

        results = []
        if jobs:
            with ThreadPoolExecutor(min(32, len(jobs)), thread_name_prefix="episode-steps") as pool:
                results = list(pool.map(run, jobs))
        observations: dict[int, list[dict]] = {}
        for (e, c), r in zip(jobs, results):
            if c is not None:  # a tool's result: a tool turn
                e.tool_calls += 1
                e.tool_errors += r.error
                e.tool_s += r.seconds
                observations.setdefault(id(e), []).append({"role": "tool", "content": r.content})
                continue
            where = self._where(e.row, turn + 1)
            step = environment.checked_step(r, where)
            if step.reward is not None:
                e.env_reward = (e.env_reward or 0.0) + float(step.reward)
            if step.done:
                e.done = True
            else:
                observations[id(e)] = environment.messages_of(step.observation, where)
        for e in live:
            if id(e) not in observations:
                e.done = True
        return observations

    def _continue(self, live: list[Episode], observations: dict[int, list[dict]]) -> None:
        """Each episode that goes on gets its observation's tokens (mask 0), unless a limit cuts it
        there (tokenized on the caller's thread: the tokenizer is not shared between threads)."""
        for e in live:
            if e.done:
                continue
            if e.turns >= self.config.max_turns:
                e.done = e.truncated = True
                continue
            ids = self.renderer.observation_ids(observations[id(e)], after_eos=not e.cut_eos, tools=self.schemas)
            ids = ids[: self.config.episode_tokens - len(e.response_ids)]
            e.response_ids += ids
            e.loss_mask += [0] * len(ids)
            e.logprobs += [0.0] * len(ids)
            if len(e.response_ids) >= self.config.episode_tokens:
                e.done = e.truncated = True

    def _call(self, env, method: str, argument, row: dict, turn: int):
        try:
            return getattr(env, method)(argument)
        except Exception as e:  # noqa: BLE001 - the user's code: named, not retried (the same seed would fail again)
            raise environment.EnvError(f"{self._where(row, turn)}: {method}() raised {type(e).__name__}: {e}") from e

    def _where(self, row: dict, turn: int) -> str:
        return f"rollout.env {self.config.env}: prompt_id {row.get('prompt_id')}, turn {turn}"
