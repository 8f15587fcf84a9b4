"""torch/transformers engines: the CPU default and the numerical reference.

``TorchGenerator`` serves both roles that generate text (policy rollout and the
generative reward model); ``TorchTrainer`` trains the policy with data parallelism over
``torch.distributed`` (gloo on CPU, NCCL on GPUs). Both speak Hugging Face parameter names, so
the vLLM and Megatron-Core backends can take their place behind the same methods.

Both run on the device they are given (default: the current CUDA device, else the CPU), with
model, buffers and optimizer state there. On CUDA the forward passes run under bf16 autocast
(parameters and Adam state stay in the model's dtype, fp32 by default) with SDPA attention and
the fused AdamW: the plain-PyTorch GPU baseline. On the CPU they compute in the model's dtype
without autocast, the fp32 reference the other engines are tested against.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import io
import os
from typing import Iterable, Iterator, Literal

import torch
import torch.distributed as dist
from torch.profiler import record_function

from engines import algorithms
from engines.channel import progress
from engines.protocols import FrozenCheckpoint, Generation, TrainBatch


def load_model(model_dir: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    # imported here, not at the top: engine hosts import this module for TrainBatch and the
    # checkpoint helpers, and transformers adds ~100 MB per host (64 timing-stub hosts: 6 GB)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    # SDPA: flash / memory-efficient kernels on CUDA (transformers' default too, here made explicit)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return tokenizer, model.to(device)


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        from engines.distributed import default_device

        return default_device()
    return torch.device(device)


def forward_precision(device: torch.device, autocast: bool | None):
    """The context the engines' forward passes run in: bf16 autocast (``autocast`` None: on
    CUDA only) or nothing (the model's own dtype)."""
    if autocast is None:
        autocast = device.type == "cuda"
    if autocast:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token t | tokens < t) for every position t >= 1; shape [batch, len-1]."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class TorchGenerator:
    """Sampling with per-token log-probabilities, and weight updates by HF name.

    ``device``: where the model lives and computes (None: the current CUDA device, else the CPU);
    ``autocast``: bf16 autocast of the forward passes (None: on CUDA only)."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: torch.device | str | None = None,
                 autocast: bool | None = None):
        self.device = resolve_device(device)
        self.autocast = autocast
        self.tokenizer, self.model = load_model(model_dir, dtype, self.device)
        self.model.eval()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seed: int = 0,
        greedy: bool = False,
    ) -> list[Generation]:
        tok = self.tokenizer
        # input ids and mask only: a tokenizer that adds token_type_ids makes generate() refuse them
        batch = tok([p for p in prompts for _ in range(n)], return_tensors="pt", padding=True, return_token_type_ids=False).to(self.device)
        if not greedy:  # greedy draws nothing: leave the process-wide RNG alone (a judge on another
            torch.manual_seed(seed)  # thread must not reseed the rollout's sampling: placement.mode=partial)
        with forward_precision(self.device, self.autocast):
            out = self.model.generate(
                **batch,
                do_sample=not greedy,
                temperature=temperature if not greedy else None,
                top_p=top_p if not greedy else None,
                top_k=None,
                max_new_tokens=max_new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        new_tokens = out.sequences[:, batch["input_ids"].shape[1] :]
        logits = torch.stack(out.logits, dim=1).float() / (1.0 if greedy else temperature)
        token_logprobs = torch.log_softmax(logits, -1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results = []
        for row in range(new_tokens.shape[0]):
            ids = new_tokens[row].tolist()
            end = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
            prompt_ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            results.append(
                Generation(
                    prompt_index=row // n,
                    prompt_ids=prompt_ids,
                    response_ids=ids[:end],
                    response=tok.decode(ids[:end], skip_special_tokens=True),
                    logprobs=token_logprobs[row, :end].tolist(),
                    truncated=tok.eos_token_id not in ids[:end],
                )
            )
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy Hugging Face-named tensors into the model; returns the count updated."""
        params = dict(self.model.named_parameters())
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
                count += 1
        return count

    # The reference engine stays resident: on a GPU beside the others, on a CPU nothing moves.
    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


def pad_batch(batch: TrainBatch, pad_id: int):
    """Right-padded ids, attention mask and response mask (aligned with logprobs[:, 1:])."""
    seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width - 1))
    old = torch.zeros((len(seqs), width - 1))
    for i, (p, r, lp) in enumerate(zip(batch.prompt_ids, batch.response_ids, batch.old_logprobs)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        resp[i, len(p) - 1 : len(p) - 1 + len(r)] = 1
        old[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(lp)
    return ids, attn, resp, old


def micro_batches(batch: TrainBatch, max_tokens: int | None) -> list[TrainBatch]:
    """``batch`` cut into forward passes of at most ``max_tokens`` *padded* tokens each (rows x
    longest row, what :func:`pad_batch` computes), so that short rows are padded to short rows
    rather than to the minibatch's longest. ``None``: one pass, rows in their order; empty: none.

    Rows are sorted longest first and cut into consecutive passes: the fewest passes the budget
    allows (as many forwards as filling each pass greedily) and, among those, the cuts that pad
    least, so a pass does not mix long and short rows when another cut avoids it. A row longer
    than ``max_tokens`` is a pass of its own. Passes come longest first (running out of memory
    shows on the first). Cost: rows x rows-per-pass steps.

    Which rows share a pass changes only float summation order: every pass's loss is
    normalised by the whole (DP-global) minibatch's counts and gradients accumulate."""
    if not len(batch):
        return []
    if max_tokens is None:
        return [batch]
    length = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    order = sorted(range(len(batch)), key=lambda i: -length[i])  # stable: ties keep their order
    width = [length[i] for i in order]  # a pass of sorted rows i..j is padded to width[i]
    # best[j]: (passes, padded tokens) of the best cut of the first j sorted rows; first[j]: where its last pass starts
    best: list[tuple[int, int]] = [(0, 0)]
    first: list[int] = [0]
    lo = 0  # the first row that can open a pass ending at row j (never decreases with j)
    for j in range(len(order)):
        while lo < j and (j - lo + 1) * width[lo] > max_tokens:
            lo += 1
        options = ((best[i][0] + 1, best[i][1] + (j - i + 1) * width[i], i) for i in range(lo, j + 1))
        passes, padded, i = min(options)
        best.append((passes, padded))
        first.append(i)
    cuts, j = [], len(order)
    while j:
        cuts.append((first[j], j))
        j = first[j]
    fields = (batch.prompt_ids, batch.response_ids, batch.old_logprobs, batch.advantages)
    return [TrainBatch(*([field[k] for k in order[a:b]] for field in fields)) for a, b in reversed(cuts)]


class TorchTrainer:
    """GRPO/DAPO policy training; data parallel when ``torch.distributed`` is initialised.

    Gradients are summed with one all-reduce over a flat buffer, and the loss of every
    rank is normalised by the *global* token (or sequence) count, so each replica takes
    exactly the step one process would take on the concatenated batch. Both all-reduces are of
    tensors on ``device``, over the default group (NCCL on CUDA: ``engines/distributed.py``).

    ``device`` and ``autocast``: as for :class:`TorchGenerator`; the reference model lives there
    too, and on CUDA the optimizer is the fused AdamW (its state is created on the device).
    """

    def __init__(
        self,
        model_dir: str,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        temperature: float = 1.0,
        reference: bool = False,
        dtype: str = "float32",
        device: torch.device | str | None = None,
        autocast: bool | None = None,
    ):
        self.device = resolve_device(device)
        self.autocast = autocast
        self.tokenizer, self.model = load_model(model_dir, dtype, self.device)
        self.model.train()
        self.reference = load_model(model_dir, dtype, self.device)[1].eval() if reference else None
        # fused: one kernel for all parameters on CUDA; on the CPU torch's default, as always
        fused = True if self.device.type == "cuda" else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)
        self.grad_clip = grad_clip
        self.temperature = temperature
        self.version = 0  # optimizer steps taken: the policy version rollouts are stamped with
        self._staged: dict | None = None  # the last checkpoint's host copy, whose buffers the next one reuses

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _global_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(t)
        return t.item()

    def _all_reduce_grads(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # every rank steps every parameter (AdamW's weight decay included)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not self.distributed:  # nothing to add: no flat copy of every gradient (GBs on a large model)
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The trainer's log-probabilities of each response token under the current weights."""
        if not len(batch):
            return []
        ids, attn, resp, _ = (t.to(self.device) for t in pad_batch(batch, self.tokenizer.pad_token_id))
        with forward_precision(self.device, self.autocast):
            lp = sequence_logprobs(self.model, ids, attn, self.temperature)
        return [lp[i][resp[i].bool()].tolist() for i in range(len(batch))]

    def train_step(
        self,
        batch: TrainBatch,
        minibatches: int = 1,
        aggregation: Literal["token", "sequence"] = "token",
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        kl_coef: float = 0.0,
        micro_batch_tokens: int | None = None,
    ) -> dict:
        """One rollout batch → ``minibatches`` optimizer steps (identical count on every rank).

        ``micro_batch_tokens``: each minibatch's forward/backward runs in length-sorted passes of
        at most this many padded tokens (see :func:`micro_batches`), gradients accumulating
        before the one all-reduce and optimizer step; the loss weights use the whole minibatch's
        DP-global counts, so the update is the one-pass update (up to float summation order)
        while the compute follows tokens rather than rows x longest row. None: one pass."""
        totals = {"loss": 0.0, "clip_fraction": 0.0, "tokens": 0.0, "grad_norm": 0.0}
        stats = torch.zeros(3, dtype=torch.float64)  # entropy, kl_rollout, kl_reference (token sums)
        for part in batch.split(minibatches):
            self.optimizer.zero_grad(set_to_none=True)
            local_tokens = float(sum(len(r) for r in part.response_ids))
            total = self._global_sum(local_tokens if aggregation == "token" else float(len(part)))
            loss_value = 0.0
            for micro in micro_batches(part, micro_batch_tokens):
                progress()  # the host's heartbeat: a long train step is moving (engines/channel.py)
                # the named regions are what a profile of the step shows (bench/train_step.py)
                with record_function("pad_batch"):
                    ids, attn, resp, old = (t.to(self.device) for t in pad_batch(micro, self.tokenizer.pad_token_id))
                with record_function("forward"), forward_precision(self.device, self.autocast):  # the loss: fp32 either way
                    logprobs = sequence_logprobs(self.model, ids, attn, self.temperature)
                    ref = None
                    if self.reference is not None and kl_coef > 0:
                        with torch.no_grad():
                            ref = sequence_logprobs(self.reference, ids, attn, self.temperature)
                with record_function("loss"):
                    adv = torch.tensor(micro.advantages, dtype=logprobs.dtype, device=self.device)
                    per_token, clipped = algorithms.policy_loss_terms(logprobs, old, adv, clip_low, clip_high, ref, kl_coef)
                    # global ``total`` (not this pass's own count): the passes' losses sum to the minibatch's
                    weights = algorithms.token_weights(resp, aggregation, total)
                    loss = (per_token * weights).sum()
                with record_function("backward"):
                    loss.backward()  # accumulates into .grad
                with record_function("statistics"):
                    loss_value += loss.item()
                    totals["clip_fraction"] += (clipped * resp).sum().item()
                    stats += algorithms.step_statistics(logprobs, old, resp, ref).cpu()
            with record_function("all_reduce"):
                self._all_reduce_grads()
            with record_function("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
                self.optimizer.step()
            totals["loss"] += self._global_sum(loss_value)
            totals["tokens"] += local_tokens
            totals["grad_norm"] = float(grad_norm)
        self.version += 1
        totals["clip_fraction"] /= max(totals["tokens"], 1.0)
        return totals | dict(zip(algorithms.STEP_STATISTICS, (stats / max(totals["tokens"], 1.0)).tolist()))

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face-named tensors, for a generator's ``update_weights``."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def sleep(self) -> None:  # resident, as TorchGenerator
        pass

    def wake(self) -> None:
        pass

    def freeze_checkpoint(self, local_dir: str, copy: bool, hf_weights: bool = True) -> FrozenCheckpoint:
        """This rank's checkpoint as it is now: with ``copy``, model, optimizer and version copied
        into host memory (rank 0; reusing the last copy's buffers), serialised by ``write`` on any
        thread; without, ``write`` saves the live state (call it at once). Replicas are equal, so
        the copy's model is also the policy's Hugging Face weights."""
        state = None
        if copy:
            state = self._staged = self.checkpoint_state(into=self._staged)
        return FrozenCheckpoint(lambda: self.save_checkpoint(local_dir, state), state["model"] if state is not None else None)

    def checkpoint_state(self, into: dict | None = None) -> dict | None:
        """A copy of model, optimizer and version in host memory, to write later (on any thread)
        while training goes on: the next ``train_step`` changes parameters and Adam moments in
        place, never the copy. ``into``: an earlier copy that nobody reads any more, whose tensors
        are overwritten instead of allocating new ones (copying into memory that is already mapped
        is several times faster). None on ranks that write nothing (see :meth:`save_checkpoint`).
        """
        if self.distributed and dist.get_rank() != 0:
            return None
        live = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version}
        return copy_state(live, into)

    def save_checkpoint(self, local_dir: str, state: dict | None = None) -> list[str]:
        """Model, optimizer and version into ``local_dir``; returns the files this rank wrote.

        ``state``: a copy from :meth:`checkpoint_state` to write instead of the live state.
        Replicas are identical, so rank 0 writes everything and the others nothing.
        """
        if self.distributed and dist.get_rank() != 0:
            return []
        os.makedirs(local_dir, exist_ok=True)
        if state is None:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version}
        torch.save(state, os.path.join(local_dir, "trainer.pt"))
        return ["trainer.pt"]

    def load_checkpoint(self, local_dir: str) -> None:
        # read into host memory (a checkpoint may come from another device); load_state_dict
        # copies into the parameters, and the optimizer moves its state to theirs
        state = torch.load(os.path.join(local_dir, "trainer.pt"), weights_only=True, map_location="cpu")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]

    def save_hf(self, local_dir: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """The policy as a Hugging Face folder; ``tensors``: Hugging Face-named weights to write
        instead of the live ones (the ``model`` part of a :meth:`checkpoint_state` copy)."""
        # save_pretrained drops keys from the dict it is given (tied weights): give it its own
        self.model.save_pretrained(local_dir, safe_serialization=True, state_dict=dict(tensors) if tensors is not None else None)
        self.tokenizer.save_pretrained(local_dir)


def copy_state(obj, into=None):
    """A deep copy of a nested state (dicts, lists, tuples, tensors, plain values) with every
    tensor copied to host memory. Tensors that share memory in ``obj`` (tied weights) share it
    in the copy. Where ``into`` (an earlier copy of the same structure) has a tensor of the same
    shape and dtype at the same place, the data is copied into it rather than into a new one."""
    reusable: dict[tuple, torch.Tensor] = {}

    def collect(node, path):
        if isinstance(node, torch.Tensor):
            reusable[path] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                collect(v, path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                collect(v, path + (i,))

    if into is not None:
        collect(into, ())
    shared: dict[tuple, torch.Tensor] = {}

    def walk(node, path):
        if isinstance(node, torch.Tensor):
            node = node.detach()
            key = (node.untyped_storage().data_ptr(), node.storage_offset(), tuple(node.shape), node.stride(), node.dtype, node.device)
            if node.numel() and key in shared:
                return shared[key]
            old = reusable.get(path)
            if old is not None and old.shape == node.shape and old.dtype == node.dtype and old.stride() == node.stride():
                copy = old.copy_(node)
            else:
                copy = node.to("cpu", copy=True)
            shared[key] = copy
            return copy
        if isinstance(node, dict):
            out = type(node)((k, walk(v, path + (k,))) for k, v in node.items())
            if hasattr(node, "_metadata"):  # a module's state_dict keeps its modules' versions here
                out._metadata = copy_module.deepcopy(node._metadata)
            return out
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, path + (i,)) for i, v in enumerate(node))
        return copy_module.deepcopy(node)

    return walk(obj, ())


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)
