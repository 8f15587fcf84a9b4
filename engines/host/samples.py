"""What a sample is: chosen once per run, when a host sets up its engines (``of``).

* ``Responses``: single-turn, G responses to each prompt from the rollout engine. A vision
  policy's prompts bring their images (rollout rows point at them by ``prompt_row``, never copy them).
* ``EpisodeSamples``: ``rollout.env`` / ``rollout.tools``: a sample is a multi-turn episode
  (engines/agents/episodes.py), its figures (turns, tool calls, ...) summed into the rollout's result.
* ``PreferencePairs``: ``data.preferences`` (offline DPO, engines/host/preferences.py): nothing is
  generated, the dataset's two responses are the samples, and a pair's label is its reward.

Each answers the same questions, so the stages (engines/host/worker.py) and the streaming lane
(engines/host/stream.py) never ask which kind they hold: ``generate`` a chunk's rollout rows,
``score`` them, ``answers`` to held-out prompts (an evaluation) and ``figures`` of a rollout. A new
kind of sample is a new class here. The scoring side every kind shares (the GenRM judge, the scalar
reward model, the rules) is ``Scorers``.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

from engines.backends import chat
from engines.host import rewards
from engines.wire.commands import EPISODE_FIGURES


@dataclass
class Scorers:
    """The judge's side of a DP group: the GenRM ``judge`` and scalar ``reward_model`` (None: the run
    has none, or this rank holds none), the rule and format rule, and what the judge is shown."""

    config: object  # the run's RunConfig
    judge: object = None
    reward_model: object = None
    rule: rewards.Rule | None = None
    format_rule: rewards.Rule | None = None
    prompts: object = None  # the group's PromptStream: a vision judge's images, a reward model's prompts
    sees_images: bool = False  # the judge is a vision-language model too
    placeholders: tuple[str, ...] = ()  # a vision policy's image text, taken out of a text judge's prompts
    turn: object = field(default_factory=threading.Lock)  # one judge generate at a time (a context manager)
    set_rules: dict = field(default_factory=dict)  # evaluation sets' rules, imported once

    def verdicts(self, rows: list[dict], images: list[list[bytes]] | None = None) -> list[str]:
        """The judge's greedy verdict on each row's response (``judge.template``). A vision-language
        judge sees the prompt's images too (``images``; default: the training prompts' at each row's
        ``prompt_row``); a text judge sees the prompt without its image placeholders."""
        cfg = self.config.judge
        if not self.sees_images:
            images = None
        elif images is None:
            images = self.prompts.images([r["prompt_row"] for r in rows])
        prompts = [cfg.template.format(prompt=self._text(r["prompt"]), response=r["response"], answer=r["answer"] or "")
                   for r in rows]
        with self.turn:
            return [o.response.strip() for o in self.judge.generate(prompts, greedy=True, max_new_tokens=cfg.max_new_tokens,
                                                                      images=images)]

    def score(self, rows: list[dict]) -> list[dict]:
        """``rows`` with their verdicts and rewards (new dicts: the rollout rows are left as they are)."""
        verdicts = self.verdicts(rows) if self.judge is not None and rows else [None] * len(rows)
        scores = rewards.model_scores(self.reward_model, self.prompts, rows)
        return [rewards.scored(self.config, r, v, rm, self.rule, self.format_rule) for r, v, rm in zip(rows, verdicts, scores)]

    def judge_answers(self, rows: list[dict], greedy: list[str], sampled: list[list[str]]) -> list[list[str]]:
        """An evaluation's verdicts: on each row's greedy answer, then on each of its samples (the set's
        own images)."""
        answered = [r | {"response": a} for r, g, k in zip(rows, greedy, sampled) for a in [g, *k]]
        verdicts = self.verdicts(answered, [r["images"] or [] for r in answered])
        out, i = [], 0
        for k in sampled:
            out.append(verdicts[i:i + 1 + len(k)])
            i += 1 + len(k)
        return out

    def rule_for(self, spec: str, field: str) -> rewards.Rule:
        """An evaluation set's rule, imported once (the run's own ``reward.rule`` is ``rule``)."""
        if field == "reward.rule" and self.rule is not None and self.rule.spec == spec:
            return self.rule
        if spec not in self.set_rules:
            self.set_rules[spec] = rewards.load_rule(spec, field, rewards.timeout_of(self.config))
        return self.set_rules[spec]

    def _text(self, prompt: str) -> str:
        for text in self.placeholders:  # Qwen-VL's vision start and end tokens too, where they are
            prompt = prompt.replace(text, "")
        return prompt


class Responses:
    """Single-turn samples: ``rollout.samples_per_prompt`` responses to each prompt."""

    episodes = None  # a multi-turn kind's (engines.agents.episodes.Episodes): the streaming lane plays them turn by turn

    def __init__(self, config, policy, weights, scorers: Scorers, vision: bool = False):
        self.config, self.policy, self.weights, self.scorers, self.vision = config, policy, weights, scorers, vision

    def generate(self, chunk: list[dict], wave: int, seed: int) -> list[dict]:
        """Rollout rows of ``chunk``'s prompts: G samples per prompt, prompt-major, all under one
        policy version (``weights``: a sync lands before or after the chunk)."""
        ro = self.config.rollout
        with self.weights as version:
            gens = self.policy.generate([chat.source(row) for row in chunk], n=ro.samples_per_prompt, temperature=ro.temperature,
                                        top_p=ro.top_p, max_new_tokens=ro.max_new_tokens, seed=seed, images=self.images(chunk))
        return [self.row(j, chunk[g.prompt_index], version, wave) | {
            "prompt_ids": g.prompt_ids, "response": g.response, "response_ids": g.response_ids, "logprobs": g.logprobs,
            "truncated": g.truncated, "routed_experts": g.routed_experts} for j, g in enumerate(gens)]

    def row(self, j: int, prompt: dict, version: int, wave: int) -> dict:
        """What every rollout row of sample ``j`` of a chunk says of its prompt."""
        return {"prompt_id": prompt["prompt_id"], "sample_index": j % self.config.rollout.samples_per_prompt,
                "policy_version": version, "wave": wave, "prompt": prompt["prompt"], "answer": prompt["answer"],
                "prompt_row": prompt["prompt_row"]}  # where its images are: rollouts never copy them

    def score(self, rows: list[dict]) -> list[dict]:
        return self.scorers.score(rows)

    def answers(self, rows: list[dict], k: int, temperature: float, seed: int) -> tuple[list[str], list[list[str]]]:
        """(each row's greedy answer, its ``k`` answers sampled at ``temperature``): an evaluation's."""
        prompts, images, budget = [chat.source(r) for r in rows], self.images(rows), self.config.rollout.max_new_tokens
        greedy = [""] * len(rows)
        for o in self.policy.generate(prompts, greedy=True, max_new_tokens=budget, images=images):
            greedy[o.prompt_index] = o.response
        samples: list[list[str]] = [[] for _ in rows]
        if k:
            for o in self.policy.generate(prompts, n=k, temperature=temperature, top_p=1.0, max_new_tokens=budget,
                                          seed=seed, images=images):
                samples[o.prompt_index].append(o.response)
        return greedy, samples

    def figures(self, rows: list[dict]) -> dict[str, float]:
        """A rollout's figures beyond its tokens (an episode's turns and tool calls)."""
        return {}

    def images(self, prompts: list[dict]) -> list[list[bytes]] | None:
        """The images of a vision policy's prompts (rows read from the prompts dataset), else None."""
        return [p["images"] or [] for p in prompts] if self.vision else None


class EpisodeSamples(Responses):
    """Multi-turn samples: an episode with the run's environment and tools is a sample."""

    def __init__(self, config, policy, weights, scorers: Scorers, episodes):
        super().__init__(config, policy, weights, scorers)
        self.episodes = episodes  # engines.agents.episodes.Episodes

    def generate(self, chunk: list[dict], wave: int, seed: int) -> list[dict]:
        with self.weights as version:
            played = self.episodes.run(self.policy, chunk, self.config.rollout.samples_per_prompt, seed)
            return [self.row(j, e.row, version, wave) | e.columns(self.episodes.renderer.tokenizer) for j, e in enumerate(played)]

    def answers(self, rows: list[dict], k: int, temperature: float, seed: int) -> tuple[list[str], list[list[str]]]:
        """Greedy episodes, then ``k`` at ``temperature`` with the same tools and environment."""
        greedy = [r["response"] for r in self.episodes.answers(self.policy, rows)]
        if not k:
            return greedy, [[] for _ in rows]
        sampler = copy.copy(self.episodes)
        sampler.config = self.episodes.config.model_copy(update={"temperature": temperature, "top_p": 1.0})
        played = sampler.run(self.policy, rows, k, seed)
        tokenizer = self.episodes.renderer.tokenizer
        return greedy, [[e.response(tokenizer) for e in played[i * k:(i + 1) * k]] for i in range(len(rows))]

    def figures(self, rows: list[dict]) -> dict[str, float]:
        return {name: float(sum(row[name] for row in rows)) for name in EPISODE_FIGURES}


class PreferencePairs(Responses):
    """A preference dataset's rows (chosen, rejected) as each prompt's two samples; held-out
    evaluation still answers with the rollout engine, as ``Responses`` does."""

    def __init__(self, config, policy, weights, scorers: Scorers, pairs, version):
        super().__init__(config, policy, weights, scorers)
        self.pairs, self.version = pairs, version  # engines.host.preferences.PreferenceRows; the trainer's version, asked

    def generate(self, chunk: list[dict], wave: int, seed: int) -> list[dict]:
        return self.pairs.rollout_rows(chunk, wave, self.version())

    def score(self, rows: list[dict]) -> list[dict]:
        """The rule and format rule still computed (the step's accuracy); the judge and the reward model
        not asked: a pair's label is its reward."""
        s = self.scorers
        return [rewards.scored(self.config, r, None, None, s.rule, s.format_rule) | {"reward": self.pairs.reward(r)}
                for r in rows]


def of(config, policy, weights, scorers: Scorers, *, vision: bool, episodes=None, pairs=None, version=None) -> Responses:
    """The run's kind of sample: preference pairs (``data.preferences``), episodes (``rollout.env`` /
    ``rollout.tools``, on a rank that holds a rollout engine) or single-turn responses."""
    if pairs is not None:
        return PreferencePairs(config, policy, weights, scorers, pairs, version)
    if episodes is not None:
        return EpisodeSamples(config, policy, weights, scorers, episodes)
    return Responses(config, policy, weights, scorers, vision)
