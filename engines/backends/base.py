"""What an engine is: the two interfaces the stage work calls, and the data that crosses them.

A *generator* samples completions (the policy's rollout engine, the GenRM judge); a *trainer*
updates the policy. torch (transformers), vLLM, Megatron-Core and the timing stubs implement
them (``engines/backends/build.py`` builds the one a config names). Weights cross between the two
with Hugging Face parameter names; models come in and go out as Hugging Face folders.

``sleep`` / ``wake`` are placement (``engines/host/devices.py``, ``Devices.take``): under full
colocation each engine gives the group's devices back before the next one takes them. An
engine with nothing to release (torch engines, vLLM on a CPU) implements them as no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:  # the protocols name it; this module stays free of torch and pydantic
    from engines.rl.base import AlgorithmConfig


_progress: Callable[[], None] = lambda: None


def on_progress(callback: Callable[[], None]) -> None:
    """Where ``report_progress`` goes: the engine host sets its heartbeat here
    (``engines.wire.channel.progress``); elsewhere (tests, benchmarks) progress goes nowhere."""
    global _progress
    _progress = callback


def report_progress() -> None:
    """An engine finished a piece of work (a generated chunk, a trained micro-batch): a host whose
    engines report nothing for ``timeouts.stage_s`` is hung."""
    _progress()


def fingerprint(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """A fingerprint of weights by name, computed where they are (``engines/backends/digest.py``: an
    integer reduction of each tensor's bytes on its own device, one small vector copied to the host):
    equal bits under the same names, dtypes and shapes give equal fingerprints, in whatever order
    they come and on whatever device; a single flipped bit in any tensor always changes it. Reads one
    tensor at a time (a 1.2B policy is never held twice). Every weight sync compares the trainer's
    buckets with the rollout engine's (``load_weights``); DP replicas compare the shards they hold
    (``engines/host/replica_check.py``)."""
    from engines.backends.digest import fingerprint as device_fingerprint

    return device_fingerprint(named_tensors)


def load_torch_file(source, name: str, **kwargs):
    """A torch file yattflow wrote (a trainer's, a critic's, an RNG state), read with ``weights_only``:
    tensors and plain data only, never an unpickled object. Anything else (a pickled object, a
    truncated or damaged file) is refused in one line naming the file ``name``."""
    import pickle

    import torch

    try:
        return torch.load(source, weights_only=True, **kwargs)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        text = str(e).strip()
        reason = ("it holds objects other than tensors and plain data" if "Weights only load failed" in text
                  else text.splitlines()[0][:200] if text else type(e).__name__)
        raise ValueError(f"{name}: not a torch file yattflow wrote ({reason}); it is never unpickled in full "
                         "(unpickling can run code)") from None


class WeightSyncError(RuntimeError):
    """A weight sync left the rollout engine holding weights other than the trainer's."""


def buckets(named_tensors: Iterable[tuple[str, Any]], max_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive tensors of at most ``max_bytes`` together (a larger one alone): the unit in
    which a weight sync gathers, sends and checks the trainer's weights."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def refuse_unwritten(names: set[str]) -> None:
    """A rollout engine's parameters that a full weight sync never reached: refused."""
    if names:
        raise WeightSyncError(f"weight sync: {len(names)} of the rollout engine's parameters got no tensor "
                              f"(e.g. {', '.join(sorted(names)[:3])}): they would keep their old weights")


def load_weights(engine: Generator, named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int = 64 << 20) -> int:
    """The trainer's Hugging Face-named tensors into a rollout engine, a bucket at a time (only
    the buckets in flight are held here), checked: the engine answers a fingerprint of each bucket
    as it loaded it, which must be the trainer's (``WeightSyncError`` names the first bucket that
    differs; the engine itself refuses a name it lacks and a parameter no tensor reached). The
    trainer's side digests each tensor on its device as the trainer hands it over, while it is
    still in the cache (``digest.BucketDigest``; ``YATTFLOW_SYNC_CHECK``: the benchmarks' other
    checks). Answers the number of tensors."""
    from concurrent.futures import ThreadPoolExecutor

    from engines.backends.digest import BucketDigest, sha256_fingerprint, sync_check

    mode = sync_check()
    sent: list[tuple[int, str, str, Any]] = []  # per bucket: tensors, first name, last name, its fingerprint (or a future)
    passed = BucketDigest("off" if mode == "sha256" else mode)  # the tensors handed over, not yet in a sent bucket

    def digested():
        for name, tensor in named_tensors:
            passed.add(name, tensor)  # reduced on its device as the trainer hands it over, while it is in the cache
            yield name, tensor

    with ThreadPoolExecutor(1, thread_name_prefix="sync-fingerprint") as pool:

        def fingerprinted():
            for bucket in buckets(digested(), bucket_bytes):
                # sha256 (a benchmark's baseline): as before issue 67, hashed on the host on a thread of its own
                fingerprint_of = pool.submit(sha256_fingerprint, bucket) if mode == "sha256" else passed.take(len(bucket))
                sent.append((len(bucket), bucket[0][0], bucket[-1][0], fingerprint_of))
                yield bucket

        answered = engine.update_weights(fingerprinted())
        ours = [s[3].result() if mode == "sha256" else s[3].hexdigest() for s in sent]
    if len(answered) != len(sent):
        raise WeightSyncError(f"weight sync: the rollout engine answered {len(answered)} bucket fingerprints for {len(sent)} buckets")
    for k, ((count, first, last, _), mine, theirs) in enumerate(zip(sent, ours, answered)):
        if theirs != mine:
            raise WeightSyncError(f"weight sync: bucket {k} ({count} tensors, {first} .. {last}) differs between the trainer "
                                  f"and the rollout engine (fingerprint {mine} against {theirs})")
    return sum(s[0] for s in sent)


@dataclass
class Generation:
    """One sampled completion of ``prompts[prompt_index]``."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response: str
    logprobs: list[float]  # per response token, under the sampling temperature
    truncated: bool  # hit max_new_tokens before end-of-sequence
    routed_experts: list[int] | None = None  # a MoE policy's routes, when recorded (engines/backends/torch/routing.py)


@dataclass
class TrainBatch:
    """Sequences for one optimizer step on this DP rank (may be empty): one entry per sequence in
    every field. A new per-sequence field is one line here: ``take`` (and so ``split``, the
    micro-batches and the balanced exchange) loops over the fields."""

    prompt_ids: list[list[int]]  # vision prompts: as the processor expanded them (image tokens included)
    response_ids: list[list[int]]
    old_logprobs: list[list[float]]
    advantages: list[float] | list[list[float]]  # per sequence, or per response token (an algorithm with a critic)
    prompt_rows: list[int] | None = None  # each prompt's row in the prompts dataset (where its images are)
    returns: list[list[float]] | None = None  # the critic's targets per response token (Needs.critic)
    values: list[list[float]] | None = None  # the critic's values the advantages were computed with (its value clip)
    images: list[list[bytes]] | None = None  # encoded images of each sequence's prompt (None: a text batch)
    is_weights: list[list[float]] | None = None  # per response token: the off-policy correction (engines/rl/off_policy.py)
    loss_mask: list[list[int]] | None = None  # per response token: 1 sampled by the policy, 0 an observation (engines/agents)
    routed_experts: list[list[int] | None] | None = None  # the rollout's MoE routes, replayed (train.router_replay)

    def trained_tokens(self) -> list[int]:
        """Each sequence's tokens that the loss reads: its response tokens, less an episode's observations."""
        if self.loss_mask is None:
            return [len(r) for r in self.response_ids]
        return [len(r) if m is None else sum(m) for r, m in zip(self.response_ids, self.loss_mask)]

    def __len__(self) -> int:
        return len(self.response_ids)

    def take(self, indices) -> "TrainBatch":
        """The sequences at ``indices``, in that order."""
        return TrainBatch(**{f.name: None if (v := getattr(self, f.name)) is None else [v[i] for i in indices]
                             for f in fields(TrainBatch)})

    @classmethod
    def concat(cls, parts: list["TrainBatch"]) -> "TrainBatch":
        """``parts`` one after the other (an optional field stays None if it is None in every part)."""
        def joined(f) -> list | None:
            values = [getattr(p, f.name) for p in parts]
            if f.default is None and all(v is None for v in values):
                return None
            return [x for v, p in zip(values, parts) for x in (v if v is not None else [None] * len(p))]

        return cls(**{f.name: joined(f) for f in fields(TrainBatch)})

    def split(self, parts: int, unit: int = 1) -> list["TrainBatch"]:
        """``parts`` minibatches of near-equal size; some may be empty (a rank with little data
        still joins every collective). ``unit``: cut only between runs of that many consecutive
        rows (a pair algorithm's (chosen, rejected) rows stay together)."""
        units = len(self) // unit
        bounds = [unit * round(i * units / parts) for i in range(parts)] + [len(self)]
        return [self.take(range(bounds[i], bounds[i + 1])) for i in range(parts)]


@dataclass
class FrozenCheckpoint:
    """A trainer's checkpoint as it was when taken (``Trainer.freeze_checkpoint``).

    ``write()`` puts the trainer's files into the folder it was frozen for and returns their
    names; after a ``copy=True`` freeze it reads only host-memory copies, so it may run on
    another thread while training goes on. ``hf_weights``: the policy's Hugging Face-named
    tensors as they were (host copies, rank 0 of a copying freeze), or None to read the live ones."""

    write: Callable[[], list[str]]
    hf_weights: dict[str, Any] | None = None


@runtime_checkable
class Generator(Protocol):
    """Samples completions with per-token log-probabilities."""

    def generate(self, prompts: list, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 16, seed: int = 0, greedy: bool = False,
                 images: list[list[bytes]] | None = None) -> list[Generation]:
        """``n`` samples per prompt, prompt-major; ``greedy``: argmax decoding (``seed`` unused).
        A prompt is plain text or chat messages (``engines.backends.chat.Prompt``), rendered by the
        engine's ``chat.Renderer`` (its model's chat template, per the engine's ``PromptFormat``).
        ``images``: each prompt's encoded images (a vision-language model), the prompt text holding
        the model's image placeholder once per image."""

    def update_weights(self, buckets: Iterable[list[tuple[str, Any]]]) -> list[str]:
        """Load Hugging Face-named tensors, a bucket at a time (every parameter once in all);
        answers each bucket's ``fingerprint`` as this engine loaded it (``load_weights`` compares
        them with the trainer's). Raises ``WeightSyncError`` on a name it has no parameter for, or
        a parameter no tensor reached."""

    def sleep(self) -> None:
        """Give the devices back (weights to host memory, KV cache dropped)."""

    def wake(self) -> None:
        """Take the devices again, as before ``sleep``."""


@runtime_checkable
class Trainer(Protocol):
    """Updates the policy; every DP rank's trainer joins the same collectives."""

    version: int  # optimizer updates so far (the policy version rollouts are tagged with)

    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Each response token's log-probability under the current weights."""

    def train_step(self, batch: TrainBatch, algorithm: AlgorithmConfig | None = None, minibatches: int = 1,
                   micro_batch_tokens: int | None = None) -> dict[str, float]:
        """One rollout batch → ``minibatches`` optimizer steps with ``algorithm``'s loss (an
        ``engines.rl.base.AlgorithmConfig``; None: the default); ``loss``, ``grad_norm``, ``tokens``
        and the algorithm's statistics per trained token (``engines.rl.loss_step.LossStep``). Batches are
        cut (minibatches, micro-batches) only between ``LossStep.unit`` rows: a pair's two together."""

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """Hugging Face-named tensors (from the host copy while asleep)."""

    def local_parameters(self) -> Iterator[tuple[str, Any]]:
        """The policy's parameters this rank holds, as it holds them: its shard (FSDP2's local
        shard, Megatron's TP / pipeline / expert share), on its device (the host copy while asleep),
        named the same on every rank at the same place in its DP group. No collective, no copy: the
        replica check (``engines/host/replica_check.py``) digests them where they are."""

    def save_hf(self, local_dir: str, tensors: dict[str, Any] | None = None) -> None:
        """The policy as a Hugging Face folder; ``tensors``: weights taken earlier instead of the live ones."""

    def freeze_checkpoint(self, local_dir: str, copy: bool, hf_weights: bool) -> FrozenCheckpoint:
        """Take this rank's checkpoint share now, to be written into ``local_dir`` (see
        ``FrozenCheckpoint``); ``hf_weights``: also keep the policy's weights (rank 0)."""

    def load_checkpoint(self, local_dir: str) -> None:
        """Restore from a whole checkpoint folder (every rank's files)."""

    def sleep(self) -> int | None:
        """Give the devices back: weights, gradients and optimizer state to host memory."""

    def wake(self) -> int | None:
        """Everything ``sleep`` moved, back on the devices."""
