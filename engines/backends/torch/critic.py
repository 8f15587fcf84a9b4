"""``TorchCritic``: the value model of an algorithm with a critic (``Needs.critic``: PPO), a trainer
of its own beside the policy's.

A Hugging Face causal LM's transformer (``AutoModel``: the folder's weights without its LM head)
with a fresh scalar value head, zero-initialised so that every replica starts the same and the
first values are 0 (the first advantages are then the rewards themselves). The value of response
token t is read at the position that predicts it (where the policy's log-probability of t is
read), i.e. the value of the state before t. Its own AdamW; data parallel like ``TorchTrainer``
(one all-reduce of the gradients, losses normalised by DP-global token counts), and sharded with
FSDP2 as the policy is (``train.fsdp``: ``shards`` ranks per DP group, each training its share of
the group's rows; its values a collective of the group's ranks, which all compute them on the
whole batch; checkpoints in sharded files that any layout reads: ``shards.py``).

On CUDA ``sleep`` moves weights and optimizer state to host memory (full colocation, like the
Megatron trainer's offload); on the CPU it has nothing to release, nor sharded (resident, as the
sharded policy).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from engines.backends import value_head
from engines.backends.base import FrozenCheckpoint, TrainBatch, load_torch_file, report_progress
from engines.backends.batching import Packed, pad_batch
from engines.backends.torch import fsdp
from engines.backends.torch.model import forward_precision, packing_refusal, resolve_device
from engines.backends.torch.trainer import all_reduce_grads, copy_state
from engines.rl.loss_step import on_response_tokens

CHECKPOINT_FILE = "critic.pt"


class ValueModel(torch.nn.Module):
    """A transformer and a scalar value head on its last hidden states."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Values [batch, len - 1]: position p's value is of the state after tokens <= p, the one
        the policy's log-probability of token p + 1 is read at (``sequence_logprobs``). Right-padded
        rows (``attention_mask``), or packed lanes (``position_ids`` restarting per row, no mask:
        ``batching.Packed``)."""
        if attention_mask is not None:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        with torch.autocast(input_ids.device.type, enabled=False):  # the head in fp32 even under bf16 autocast
            return self.value_head(hidden[:, :-1].float()).squeeze(-1)


class TorchCritic:
    """The critic: ``values`` before a step (the advantages' baseline), ``train_step`` on the
    step's returns with the algorithm's ``critic_loss``, checkpoints of its weights and optimizer."""

    def __init__(self, model_dir: str, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 grad_clip: float = 1.0, dtype: str = "float32", device: torch.device | str | None = None,
                 autocast: bool | None = None, shards: int = 1, packed: bool = True):
        from transformers import AutoModel, AutoTokenizer  # here: hosts without a critic never import it

        self.device = resolve_device(device)
        self.autocast = autocast
        backbone = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        self.model = ValueModel(backbone, backbone.config.hidden_size)
        # packed passes as the policy's (TorchTrainer's ``packed``); else why padded
        self.packing = packing_refusal(backbone.config) if packed else "packed=False"
        head = value_head.read_head(model_dir)  # an exported critic's head (value_head.py); else the zeros
        if head is not None:
            with torch.no_grad():
                self.model.value_head.weight.copy_(head[0])
                self.model.value_head.bias.copy_(head[1])
        self.model.train()
        self.mesh = fsdp.mesh(shards, self.device) if shards > 1 else None  # train.fsdp: the policy's mesh
        if self.mesh is not None:  # each rank's device takes its shards (fsdp.shard), never the whole critic
            fsdp.shard(self.model, self.mesh, self.device)
        else:
            self.model.to(self.device)
        self._names = [n for n, _ in self.model.named_parameters()]  # the optimizer's order
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = self.tokenizer.pad_token_id or 0  # masked out: any id will do
        fused = True if self.device.type == "cuda" else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, fused=fused)
        self.grad_clip = grad_clip
        self._staged: dict | None = None  # the last checkpoint's host copy, reused by the next one

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _forward(self, batch: TrainBatch):
        """Values [rows, width - 1] and the response mask, in :func:`pad_batch`'s row layout."""
        ids, attn, resp, _ = (t.to(self.device) for t in pad_batch(batch, self.pad_id))
        with forward_precision(self.device, self.autocast):
            if self.packing is None:
                packed = Packed(batch, self.pad_id).to(self.device)
                return packed.rows(self.model(packed.ids, position_ids=packed.positions)), resp
            return self.model(ids, attn), resp

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> list[list[float]]:
        """Each response token's value under the current weights."""
        if not len(batch):
            return []
        values, resp = self._forward(batch)
        return [values[i][resp[i].bool()].tolist() for i in range(len(batch))]

    def train_step(self, batch: TrainBatch, algorithm, minibatches: int = 1, micro_batch_tokens: int | None = None
                   ) -> dict[str, float]:
        """``minibatches`` optimizer steps on ``batch.returns`` (the same split as the policy's),
        the per-token loss ``algorithm.critic_loss(values, batch.values, batch.returns)`` averaged
        over the minibatch's DP-global trained tokens (an episode's: sampled ones). Returns this
        rank's ``value_loss`` and the loss's statistics per token, ``explained_variance`` of the
        returns by the step's old values (1 - Var(R - V) / Var(R) over its tokens), and
        ``critic_grad_norm``."""
        sums: dict[str, torch.Tensor] = {}
        grad_norm = 0.0
        for part in batch.split(minibatches):
            self.optimizer.zero_grad(set_to_none=True)
            # FSDP: this rank's share of the group's rows, and as many passes as the group's busiest rank
            mine, passes, real = fsdp.passes(part, micro_batch_tokens, 1, self.mesh, self.device, self.pad_id,
                                             packed=self.packing is None)
            total = torch.tensor([float(sum(mine.trained_tokens()))], dtype=torch.float64, device=self.device)
            if self.distributed:
                dist.all_reduce(total)
            for k, micro in enumerate(passes):
                report_progress()
                if self.mesh is not None:
                    fsdp.sync_gradients(self.model, now=k == len(passes) - 1)
                values, resp = self._forward(micro)
                if k >= real:  # a filler pass
                    (values.sum() * 0.0).backward()
                    continue
                old, returns = (on_response_tokens(x, resp).to(values.dtype) for x in (micro.values, micro.returns))
                loss_per_token, stats = algorithm.critic_loss(values, old, returns)
                (loss_per_token * resp).sum().div(max(total.item(), 1.0)).backward()
                with torch.no_grad():
                    for name, value in {"value_loss": loss_per_token, **stats}.items():
                        sums[name] = sums.get(name, 0.0) + (value.double() * resp).sum()
            if self.mesh is None:  # FSDP reduced them in the last backward pass
                all_reduce_grads(self.model, self.distributed)
            grad_norm = float(fsdp.full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)))
            self.optimizer.step()
        if self.mesh is not None:  # each rank's sums are of its rows: the group's are their sums
            sums = dict(zip(sums, fsdp.group_sums([float(v) for v in sums.values()], self.mesh, self.device)))
        tokens = float(sum(batch.trained_tokens()))
        out = {name: float(value) / max(tokens, 1.0) for name, value in sums.items()}
        # over every DP group's tokens (one all-reduce): equal on every group, like the gradient norm
        moments = torch.tensor(variance_sums(batch.returns or [], batch.values or []), dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(moments)
        copies = self.mesh.size(1) if self.mesh is not None else 1  # ranks given each group's batch
        return out | {"explained_variance": explained_variance((moments / copies).tolist()), "critic_grad_norm": grad_norm}

    # -- placement ---------------------------------------------------------------------------

    def sleep(self) -> None:
        """Full colocation: weights and optimizer state to host memory (CUDA; nothing on the CPU)."""
        self._move("cpu")

    def wake(self) -> None:
        self._move(self.device)

    def _move(self, device) -> None:
        if self.device.type == "cpu" or self.mesh is not None:
            return
        self.model.to(device)  # in place: the optimizer's parameters are the same objects
        for state in self.optimizer.state.values():
            for key, value in state.items():  # moments and (fused AdamW) step: with their parameter
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device)
        if torch.device(device).type == "cpu":
            torch.cuda.empty_cache()

    # -- export ----------------------------------------------------------------------------------

    def save_hf(self, local_dir: str) -> None:
        """The critic as a Hugging Face ``*ForTokenClassification`` folder (``value_head.py``): what a
        run can load back as ``model.critic``."""
        backbone, head = self.model.backbone, self.model.value_head  # sharded: gathered (collective over the group)
        tensors = {f"{backbone.base_model_prefix}.{k}": fsdp.full(v.detach()).to("cpu", copy=True)
                   for k, v in backbone.state_dict().items()}
        tensors |= {value_head.WEIGHT: fsdp.full(head.weight.detach()).cpu(), value_head.BIAS: fsdp.full(head.bias.detach()).cpu()}
        value_head.save_folder(local_dir, backbone.config, tensors, self.tokenizer)

    # -- checkpoints ---------------------------------------------------------------------------

    def freeze_checkpoint(self, local_dir: str, copy: bool) -> FrozenCheckpoint:
        """As ``TorchTrainer.freeze_checkpoint``: weights (value head included) and optimizer,
        copied into host memory with ``copy``; rank 0 writes (replicas are equal). Sharded, every
        rank writes its shards now (a collective, on this thread) and ``write`` lists them."""
        if self.mesh is not None:
            from engines.backends.torch import shards

            written = shards.save(self.model, self.optimizer, local_dir)
            return FrozenCheckpoint(lambda: written)
        if self.distributed and dist.get_rank() != 0:
            return FrozenCheckpoint(lambda: [])
        state = None
        if copy:
            state = self._staged = copy_state(self._live_state(), into=self._staged)

        def write() -> list[str]:
            os.makedirs(local_dir, exist_ok=True)
            torch.save(state if state is not None else self._live_state(), os.path.join(local_dir, CHECKPOINT_FILE))
            return [CHECKPOINT_FILE]

        return FrozenCheckpoint(write)

    def _live_state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_checkpoint(self, local_dir: str) -> None:
        """Either kind of checkpoint into either layout: ``critic.pt`` (whole; its optimizer's state
        by index, or by name from a sharded critic before sharded files) or sharded files."""
        from engines.backends.torch import shards

        if shards.is_sharded(local_dir):
            return shards.load(self.model, self.optimizer, local_dir)
        path = os.path.join(local_dir, CHECKPOINT_FILE)
        state = load_torch_file(path, path, map_location="cpu")
        optimizer = state["optimizer"]
        named = any(isinstance(p, str) for g in optimizer["param_groups"] for p in g["params"])
        if self.mesh is not None:
            fsdp.load_full_state(self.model, self.optimizer, state["model"], optimizer if named else fsdp.by_name(optimizer, self._names))
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(fsdp.by_index(optimizer, self._names) if named else optimizer)


def variance_sums(returns: list[list[float]], values: list[list[float]]) -> list[float]:
    """[count, sum R, sum R^2, sum (R - V), sum (R - V)^2] over every token: what
    :func:`explained_variance` needs, summable over DP groups."""
    r = torch.tensor([x for row in returns for x in row], dtype=torch.float64)
    d = r - torch.tensor([x for row in values for x in row], dtype=torch.float64)
    return [float(r.numel()), r.sum().item(), (r * r).sum().item(), d.sum().item(), (d * d).sum().item()]


def explained_variance(sums: list[float]) -> float:
    """1 - Var(R - V) / Var(R) from :func:`variance_sums` (1: the values predict the returns; 0: no
    better than their mean; negative: worse). 0 when the returns do not vary."""
    n, r, rr, d, dd = sums
    if n < 2:
        return 0.0
    var_r = rr / n - (r / n) ** 2
    var_d = dd / n - (d / n) ** 2
    return 1.0 - var_d / var_r if var_r > 1e-12 else 0.0
