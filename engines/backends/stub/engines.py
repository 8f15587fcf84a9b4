"""TIMING STUBS — for scale benchmarks, not training.

``TimingStubGenerator`` and ``TimingStubTrainer`` stand in for the torch/vLLM/Megatron engines
(``rollout.backend`` / ``judge.backend`` / ``train.backend`` = ``stub``) so that 16 or 64 DP
groups can be orchestrated on a 2-core machine with the real flows, tasks, engine hosts, object
storage and Prefect server (``bench/scale.py``). They compute nothing: they *sleep* for

    tokens x ``stub_seconds_per_token``

(the section's config field; its default was measured from the real torch engines with
``python -m engines.backends.stub.engines --measure``, see :func:`measure`; ``rollout.stub_seconds_per_token``
serves the policy and the judge stub alike), and return data of the right shape:

- ``generate``: one :class:`engines.backends.torch.trainer.Generation` per (prompt, sample) with prompt
  ids, response ids, log-probabilities and a ``truncated`` flag; the response length is drawn
  from 1..``max_new_tokens`` (+ a small chance of hitting the cap) by a generator seeded from
  (seed, prompt, sample), so retries and resumes reproduce it. The response *text* is a verdict
  word (``judge.good`` or ``judge.bad``, drawn) followed by digits: the same stub serves as policy
  and as judge, the judge's verdicts parse and differ across a group's samples (so dynamic
  sampling keeps most groups, as with a trained judge). Rewards are random; accuracy means nothing.
- ``TimingStubTrainer.train_step``: sleeps for this rank's (prompt + response) tokens, then does
  one real ``torch.distributed`` all-reduce of a 2-element tensor over the hosts' gloo group, so
  the DP collective — and the wait of an early group for a late one — stays real. Its "weights"
  are 4 floats, updated from the all-reduced sum (the same on every replica, so the iteration's
  replica check holds); the metric keys are those of ``TorchTrainer.train_step``.
- checkpoints: a small JSON state (``stub_state.json``, version and weights) written by rank 0;
  ``save_hf`` writes the model folder's config and tokenizer files plus ``STUB_WEIGHTS.json``
  (not a loadable model: there are no weights).

torch is imported lazily (the host has it anyway for its gloo group); transformers never.

Memory, the choice made: the stub trainer keeps the real gloo all-reduce, so a stub host still
imports torch (its ``Worker`` needs it anyway: gloo rendezvous in ``setup``, the parameter
fingerprint, checkpoint RNG state). Measured by bench/scale.py: ~400 MB RSS, 270–320 MB private
(USS) per host, so 16 hosts take ~5 GB and 64 would take ~20 GB — more than the 24 GB shared
machine can spare, and bench/scale.py skips 64 with that reason. ``hosts.fork: true`` starts the
hosts from one process that has imported torch (engines/wire/forkserver.py: the pages shared
copy-on-write, ~28 MB private per stub host; bench/nodes.py uses it, docs/controllers.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator

from engines.backends.digest import bucket_fingerprint, sync_check

BOS, EOS, FIRST_ID, ID_RANGE = 1, 2, 4, 60  # the char tokenizer's layout (engines/demo/tiny.py)


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class TimingStubGenerator:
    """TIMING STUB (not an engine): ``generate`` sleeps tokens x ``seconds_per_token``.

    ``long_tail=L`` (``rollout.stub_lengths=long_tail``, L = ``rollout.max_new_tokens``): a sampled
    response is about L / 8 tokens long (the median), one in twenty runs to L (8x the median), and
    a call costs what batched decoding costs: its longest response's tokens x its sequences (a
    finished sequence's slot idles until the call's last one ends). A sample longer than the call's
    ``max_new_tokens`` is cut there and remembered: a token-id prompt (``chat.Tokens``) that is
    such a cut sample continues it to the length it drew (a streaming lane's next segment,
    engines/host/stream.py)."""

    stub = True
    TAIL_FRACTION, TAIL_FACTOR = 0.05, 8

    def __init__(self, model_dir: str, seconds_per_token: float, verdicts: tuple[str, str] = ("correct", "wrong"),
                 long_tail: int | None = None):
        self.model_dir, self.seconds_per_token, self.verdicts, self.long_tail = model_dir, seconds_per_token, verdicts, long_tail
        self.version = 0  # weight updates received
        self.slept_s = 0.0
        self._unfinished: dict[tuple[int, ...], int] = {}  # a cut sample's ids (prompt + response so far) -> tokens left

    def _length(self, rng: random.Random, max_new_tokens: int, greedy: bool) -> int:
        """A response's length; above ``max_new_tokens``: cut there (truncated)."""
        if not self.long_tail or greedy:  # uniform; the judge and held-out evaluation (greedy) always
            return rng.randint(1, max_new_tokens + 1)
        median = max(1, self.long_tail // self.TAIL_FACTOR)
        if rng.random() < self.TAIL_FRACTION:
            return self.long_tail
        return rng.randint(max(1, median // 2), median + median // 2)

    def generate(self, prompts: list, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 16, seed: int = 0, greedy: bool = False, images=None) -> list:
        from engines.backends.base import Generation
        from engines.backends.chat import Tokens
        # images: carried by the bench's vision runs and not looked at (the stub reads no pixels)

        out, tokens, longest, seen = [], 0, 0, {}
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, Tokens):
                prompt_ids, key = list(prompt.ids), ",".join(map(str, prompt.ids))
            else:
                if not isinstance(prompt, str):  # chat messages: their text (the stub has no template)
                    prompt = "\n".join(m["content"] for m in prompt)
                prompt_ids, key = [BOS] + [FIRST_ID + ord(c) % ID_RANGE for c in prompt], prompt
            seen[key] = seen.get(key, -1) + 1  # the same prompt again in one call (a lane's G samples): drawn apart
            key += f"#{seen[key]}" if seen[key] else ""
            for j in range(n):
                rng = random.Random(f"{seed}/{key}/{j}/{self.version if not greedy else 0}")
                left = self._unfinished.pop(tuple(prompt_ids), None) if n == 1 else None
                length = left if left is not None else self._length(rng, max_new_tokens, greedy)
                truncated = length > max_new_tokens
                body = [FIRST_ID + rng.randrange(ID_RANGE) for _ in range(min(length, max_new_tokens) - (not truncated))]
                ids = body if truncated else body + [EOS]
                if truncated and self.long_tail:
                    self._unfinished[tuple(prompt_ids + ids)] = length - max_new_tokens
                    if len(self._unfinished) > 1 << 14:  # aborted samples are never continued: forget the oldest
                        del self._unfinished[next(iter(self._unfinished))]
                text = rng.choice(self.verdicts) + "".join(str(rng.randrange(10)) for _ in range(max(len(body) - 1, 0)))
                out.append(Generation(prompt_index=i, prompt_ids=prompt_ids, response_ids=ids, response=text,
                                      logprobs=[round(-rng.expovariate(2.0), 6) for _ in ids], truncated=truncated))
                tokens, longest = tokens + len(ids), max(longest, len(ids))
        seconds = (longest * len(out) if self.long_tail else tokens) * self.seconds_per_token
        self.slept_s += seconds
        _sleep(seconds)
        return out

    def update_weights(self, buckets: Iterable) -> list[str]:
        """No model to load into: each bucket's fingerprint as received (the sync's shape, not its check)."""
        mode = sync_check()
        digests = [bucket_fingerprint(bucket, mode) for bucket in buckets]
        self.version += 1
        return digests

    def sleep(self) -> None:  # placement: release the device (nothing to release)
        pass

    def wake(self) -> None:
        pass


class TimingStubTrainer:
    """TIMING STUB (not an engine): ``train_step`` sleeps tokens x ``seconds_per_token``, then
    does one real all-reduce over the DP group."""

    stub = True
    STATE = "stub_state.json"

    def __init__(self, model_dir: str, seconds_per_token: float, **_ignored):
        self.model_dir, self.seconds_per_token = model_dir, seconds_per_token
        self.version = 0
        self.weights = [0.0, 0.0, 0.0, 0.0]
        self.slept_s = 0.0

    @staticmethod
    def _rank_world() -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def logprobs(self, batch) -> list[list[float]]:
        return [list(lp) for lp in batch.old_logprobs]

    def train_step(self, batch, algorithm=None, minibatches: int = 1, micro_batch_tokens: int | None = None) -> dict:
        import torch
        import torch.distributed as dist

        response_tokens = float(sum(len(r) for r in batch.response_ids))
        all_tokens = response_tokens + sum(len(p) for p in batch.prompt_ids)
        seconds = all_tokens * self.seconds_per_token
        self.slept_s += seconds
        _sleep(seconds)
        pseudo_loss = sum(a * len(r) for a, r in zip(batch.advantages, batch.response_ids))
        t = torch.tensor([response_tokens, pseudo_loss], dtype=torch.float64)
        if self._rank_world()[1] > 1:
            dist.all_reduce(t)  # the one real collective: every group waits here for the last one
        total, loss_sum = t.tolist()
        loss = -loss_sum / max(total, 1.0)
        self.weights = [w + 1e-3 * loss * (k + 1) for k, w in enumerate(self.weights)]  # equal on every replica
        self.version += 1
        return {"loss": loss, "tokens": response_tokens, "grad_norm": abs(loss)}  # no loss computed: no statistics

    def export_weights(self) -> Iterator[tuple[str, object]]:
        import torch

        yield "stub.weights", torch.tensor(self.weights, dtype=torch.float32)

    def local_parameters(self) -> Iterator[tuple[str, object]]:
        return self.export_weights()  # 4 floats, whole on every rank

    def save_checkpoint(self, local_dir: str, state: dict | None = None) -> list[str]:
        """Rank 0 writes ``stub_state.json`` (replicas are equal); the files this rank wrote."""
        if self._rank_world()[0] != 0:
            return []
        os.makedirs(local_dir, exist_ok=True)
        Path(local_dir, self.STATE).write_text(json.dumps({"stub": type(self).__name__, "version": self.version,
                                                           "weights": self.weights}))
        return [self.STATE]

    def freeze_checkpoint(self, local_dir: str, copy: bool, hf_weights: bool):
        """Written now (a few bytes); with ``copy`` and ``hf_weights`` the weights are kept too."""
        from engines.backends.base import FrozenCheckpoint

        written = self.save_checkpoint(local_dir)
        return FrozenCheckpoint(lambda: written, dict(self.export_weights()) if copy and hf_weights else None)

    def sleep(self) -> None:  # placement: nothing on a device
        pass

    def wake(self) -> None:
        pass

    def load_checkpoint(self, local_dir: str) -> None:
        state = json.loads(Path(local_dir, self.STATE).read_text())
        self.version, self.weights = state["version"], [float(w) for w in state["weights"]]

    def save_hf(self, local_dir: str, tensors: dict | None = None) -> None:
        """The model folder's config and tokenizer files, and ``STUB_WEIGHTS.json`` (no weights)."""
        os.makedirs(local_dir, exist_ok=True)
        for p in Path(self.model_dir).iterdir():
            if p.is_file() and p.suffix in (".json", ".txt", ".model") and not p.name.startswith("MANIFEST"):
                shutil.copy(p, Path(local_dir, p.name))
        weights = [float(x) for x in tensors["stub.weights"].tolist()] if tensors else self.weights
        Path(local_dir, "STUB_WEIGHTS.json").write_text(json.dumps(
            {"stub": "timing stub for scale benchmarks, not a trained model", "version": self.version, "weights": weights}))


# --------------------------------------------------------------------------- calibration


def measure(repeats: int = 5, threads: int = 1) -> dict:
    """Seconds per token of the real torch engines at the test suite's TINY shapes (the shapes the
    scale bench's stub runs use): ``TorchGenerator.generate`` per generated token (16 prompts x 4
    samples, 8 new tokens: a rollout wave), the same greedy for the judge (64 prompts, 8 tokens: a
    scoring call), ``TorchTrainer.train_step`` per (prompt + response) token (the wave's 64
    sequences, 2 minibatches, one process). Medians over ``repeats`` after one warm-up."""
    import statistics
    import tempfile

    import torch

    from engines.demo import arithmetic
    from engines.demo.tiny import build_char_tokenizer, build_tiny_llama
    from engines.backends.base import TrainBatch
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="yattflow-stub-measure-") as tmp:
        tokenizer = build_char_tokenizer()
        model = build_tiny_llama(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        gen, trainer = TorchGenerator(tmp), TorchTrainer(tmp)
        prompts = [p for p, _ in arithmetic.make_problems(16, 2, seed=1)]
        figures: dict[str, list[float]] = {"generate": [], "judge": [], "train": []}
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            outs = gen.generate(prompts, n=4, max_new_tokens=8, seed=r)
            t1 = time.perf_counter()
            judged = gen.generate([p + o.response + ":?" for o, p in zip(outs, [prompts[o.prompt_index] for o in outs])],
                                  greedy=True, max_new_tokens=8)
            t2 = time.perf_counter()
            batch = TrainBatch([o.prompt_ids for o in outs], [o.response_ids for o in outs], [o.logprobs for o in outs],
                               [random.Random(i).uniform(-1, 1) for i in range(len(outs))])
            trainer.train_step(batch, minibatches=2)
            t3 = time.perf_counter()
            if r:
                figures["generate"].append((t1 - t0) / sum(len(o.response_ids) for o in outs))
                figures["judge"].append((t2 - t1) / sum(len(o.response_ids) for o in judged))
                figures["train"].append((t3 - t2) / sum(len(p) + len(q) for p, q in zip(batch.prompt_ids, batch.response_ids)))
    return {k: statistics.median(v) for k, v in figures.items()}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="timing stubs: measure the real torch engines' seconds per token")
    parser.add_argument("--measure", action="store_true", help="time the torch engines at the TINY shapes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.measure:
        costs = measure(args.repeats)
        print(json.dumps(costs))
        print(f"rollout.stub_seconds_per_token={costs['generate']:.2g} judge.stub_seconds_per_token={costs['judge']:.2g} "
              f"train.stub_seconds_per_token={costs['train']:.2g}")
