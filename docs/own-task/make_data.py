"""Data for the task in docs/your-own-task.md: reverse a three-letter word.

    python docs/own-task/make_data.py my-task

writes three Parquet files under ``my-task/``:

- ``sft.parquet`` (prompt, response): demonstrations by a sloppy teacher who copies the word
  instead of reversing it 70% of the time, so a model fine-tuned on them mostly copies;
- ``prompts.parquet`` (prompt_id, prompt, answer): the RL prompts, with the right answers;
- ``heldout.parquet`` (the same columns): words never trained on, for held-out accuracy;
- ``judge.parquet`` and ``judge-heldout.parquet`` (prompt, response): for the optional judge, the
  judge's prompt (``judge.template``'s default, ``{prompt}{response}:{answer}?``) for a right or
  a wrong candidate, and the verdict to learn, ``correct`` or ``wrong``.

RL then has something to find: the model already samples the reversal now and then, and
the reward rule (``rules.py``) pays only for it.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

LETTERS = "abcdef"
SLIP = 0.7  # how often the teacher copies instead of reversing
TEMPLATE = "{prompt}{response}:{answer}?"  # judge.template (the default)


def judge_examples(words: list[str], rng: random.Random) -> tuple[list[str], list[str]]:
    """Judge prompts for the right answer, a copy, or another word, and their verdicts."""
    prompts, verdicts = [], []
    for w in words:
        candidate = rng.choice([w[::-1], w[::-1], w, "".join(rng.sample(LETTERS, 3))])
        prompts.append(TEMPLATE.format(prompt=f"reverse {w}:", response=candidate, answer=w[::-1]))
        verdicts.append("correct" if candidate == w[::-1] else "wrong")
    return prompts, verdicts


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = ["".join(w) for w in itertools.product(LETTERS, repeat=3)]
    rng.shuffle(words)
    heldout, train = words[:40], words[40:]
    demonstrations = [(w, w if rng.random() < SLIP else w[::-1]) for w in train for _ in range(4)]
    pq.write_table(pa.table({"prompt": [f"reverse {w}:" for w, _ in demonstrations],
                             "response": [r for _, r in demonstrations]}), out / "sft.parquet")
    for name, part, first_id in (("prompts", train, 0), ("heldout", heldout, 1000)):
        pq.write_table(pa.table({"prompt_id": list(range(first_id, first_id + len(part))),
                                 "prompt": [f"reverse {w}:" for w in part],
                                 "answer": [w[::-1] for w in part]}), out / f"{name}.parquet")
    for name, part in (("judge", train * 4), ("judge-heldout", heldout)):
        prompts, verdicts = judge_examples(part, rng)
        pq.write_table(pa.table({"prompt": prompts, "response": verdicts}), out / f"{name}.parquet")
    print(f"{len(demonstrations)} SFT demonstrations, {len(train)} RL prompts, {len(heldout)} held out → {out}/")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "my-task")
