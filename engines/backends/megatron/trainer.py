"""Megatron-Core policy trainer: ``TorchTrainer``'s interface on a Megatron ``GPTModel``.

Models come in and go out as Hugging Face folders; inside, the policy is a Megatron-Core GPT
model with the local (non-Transformer-Engine) layer specs, whose core attention is replaced by
:class:`SDPAttention` (torch's fused scaled-dot-product attention), tensor parallel over
``tensor_parallel`` ranks and cut into ``pipeline_parallel`` stages, data parallel over the rest
of ``torch.distributed``'s world, wrapped in Megatron's ``DistributedDataParallel``, run on
Megatron's schedules (``pipeline.py``) and stepped by ``get_megatron_optimizer``.
Everything — model, reference model, gradient buffers, optimizer state — lives on the device
of the process (the current CUDA device, else the CPU).
The loss is the one ``TorchTrainer`` uses (the algorithm's, through ``engines.rl.loss_step.LossStep``), normalised by *global*
token or sequence counts, so a DP step equals one process stepping on the concatenated batch.

The ranks of one DP replica (its TP ranks and stages) must be given the same batch. Methods
marked *collective* must be called on every rank, in the same order.

Megatron-Core has no Hugging Face converter for GPT models: ``architectures.py`` holds one record
per mapped family (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE), ``mapping.py`` the conversion, ``model.py`` builds the model.
A mixture of experts (Qwen3-MoE) has Megatron-Core MoE layers, its experts split over
``expert_parallel`` ranks (which, as TP ranks, must be given the same batch). A vision-language model (Idefics3/SmolVLM) keeps its
Hugging Face vision tower and connector as torch modules beside the Megatron GPT language model
(``vision.py``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator, Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from engines.backends import multimodal
from engines.backends.base import FrozenCheckpoint, TrainBatch
from engines.backends.batching import micro_batches, pad_weights, response_values
from engines.backends.distributed import default_device
from engines.backends.megatron import optimizer as megatron_optimizer, pipeline, routing, vision
from engines.backends.megatron.architectures import architecture
from engines.backends.megatron.mapping import HFState, _param_to_hf, fuse_experts, global_name, padded_vocab_size, unfuse_experts
from engines.backends.megatron.model import RecomputeGranularity, _init_distributed, build_gpt, transformer_config
from engines.backends.megatron.offload import Offload, Sleeps, trainer_tensors
from engines.rl import registry
from engines.rl.base import AlgorithmConfig
from engines.rl.loss_step import LossStep


class MegatronTrainer(Sleeps):
    """Policy training (every algorithm of ``engines/rl``) on Megatron-Core; a drop-in for ``TorchTrainer``.

    Construction is collective when ``torch.distributed`` is initialised (process groups,
    optimizer parameter groups).
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
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        expert_parallel: int = 1,
        distributed_optimizer: bool = False,
        reshardable_optimizer: bool = False,
        recompute_granularity: RecomputeGranularity = "none",
        recompute_method: Literal["uniform", "block"] = "uniform",
        recompute_num_layers: int = 1,
        recompute_modules: list[str] | tuple[str, ...] = ("core_attn",),
        device: torch.device | str | None = None,
        freeze_vision: bool = True,  # a vision-language model's tower takes no gradient (as TorchTrainer's)
        router_replay: bool = False,  # a mixture's forward takes the rollout's experts (megatron/routing.py)
    ):
        # Megatron allocates on the *current* CUDA device: a device given here becomes it
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": the current device
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        _init_distributed(tensor_parallel, self.device, pipeline_parallel, expert_parallel)
        self.model_dir = model_dir
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        # a vision-language model: its processor, its image tokens (never sampled: outside the
        # distribution, as in TorchTrainer) and the language model's own config
        self.processor = multimodal.load_processor(model_dir)
        self.banned = None
        self.text_config = self.hf_config
        if self.processor is not None:
            vision.check_supported(self.hf_config)
            self.text_config = vision.text_config(self.hf_config)
            self.banned = multimodal.image_token_ids(self.processor)
        self.tokenizer = self.processor.tokenizer if self.processor is not None else AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        self.pad_id = self.tokenizer.pad_token_id  # right-pads the passes' rows (masked out)
        self.temperature = temperature
        self._adam_repairs = megatron_optimizer.needs_adam_repairs(distributed_optimizer)  # see load_checkpoint
        self._sharding = megatron_optimizer.sharding(reshardable_optimizer)  # the optimizer's checkpoint format
        self.version = 0  # optimizer steps taken: the policy version rollouts are stamped with
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype {dtype!r}: float32 or bfloat16 (float16 would need loss scaling)")
        torch_dtype = getattr(torch, dtype)
        self.config = transformer_config(self.text_config, tensor_parallel, torch_dtype, recompute_granularity,
                                         recompute_method, recompute_num_layers, recompute_modules, pipeline_parallel,
                                         expert_parallel)
        hf_state = HFState.open(model_dir)  # each tensor read when this rank's share needs it

        def build(freeze_vision: bool):
            if self.processor is None:
                return build_gpt(self.hf_config, self.config, hf_state, self.device)
            gpt = build_gpt(self.text_config, self.config, vision.text_state(hf_state), self.device)
            if parallel_state.is_pipeline_first_stage():  # the tower and connector sit beside the embedding
                vision.attach(gpt, self.hf_config, hf_state, self.device, torch_dtype, freeze_vision)
            return gpt

        model = build(freeze_vision)
        self.model = DistributedDataParallel(
            config=self.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
            ),
            module=model,
        )
        self.replays = None  # train.router_replay: each MoE layer's Replayed, in layer order
        if router_replay:
            if not architecture(self.text_config).experts:
                raise ValueError(f"train.router_replay: {model_dir} has no mixture-of-experts router to replay "
                                 f"(model_type {self.text_config.model_type!r} is dense); set train.router_replay=false")
            self.replays = routing.install(model)
        self.reference = None
        if reference:
            self.reference = build(True).eval()
            self.reference.requires_grad_(False)
        del hf_state

        self.optimizer = megatron_optimizer.megatron_adam(self.model, self.config, lr, betas, weight_decay, grad_clip,
                                                          distributed_optimizer)
        # Megatron's schedules (pipeline.py) call these: gradients accumulate unreduced over a
        # minibatch's passes, then one all-reduce (DP, and the tied embedding's over the first and last
        # stages). The loss is normalised by global counts already (LossStep), so the token count the
        # schedule hands over must not divide the gradients again.
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(chunks, None, **kw)
        self._checkpoints = AsyncCallsQueue()
        self._pending_checkpoint: Path | None = None
        self._offload = Offload(self.device)

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        per_rank = padded_vocab_size(self.text_config) // tensor_parallel
        vocab_ids = torch.arange(tp_rank * per_rank, (tp_rank + 1) * per_rank, device=self.device)
        padding = vocab_ids >= self.text_config.vocab_size
        self._vocab_padding = padding if padding.any() else None  # this rank's logits of padded ids
        self._banned = None  # this rank's logits of the image tokens
        if self.banned:
            banned = torch.isin(vocab_ids, torch.tensor(self.banned, device=self.device))
            self._banned = banned if banned.any() else None

    # --- forward -------------------------------------------------------------------------

    def _forward(self, model, ids: torch.Tensor, pixels: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """This stage's output: the next stage's input, or on the last stage the logits [batch, len, vocab / TP].

        Sequences are right-padded, so causal attention alone keeps real tokens away from
        padding, and positions 0..n-1 are the ones Hugging Face gives them. No mask tensor: the
        layers' causal mask type lets SDPA use its causal kernels (a [seq, seq] mask would rule
        flash attention out). ``pixels``: a vision batch's image inputs, whose features the
        connector puts in place of the image tokens' embeddings (``vision.py``; the first stage's:
        the others take the previous stage's activations)."""
        batch, length = ids.shape
        positions = torch.arange(length, device=ids.device).expand(batch, length)
        decoder_input = None
        if pixels:
            gpt = model.module if isinstance(model, DistributedDataParallel) else model
            features = vision.image_features(gpt.hf_vision, self.hf_config, **pixels)
            embeddings = gpt.embedding(input_ids=ids, position_ids=positions)  # [seq, batch, hidden]
            decoder_input = vision.merge(embeddings, ids, features, self.hf_config.image_token_id)
        return model(input_ids=ids, position_ids=positions, attention_mask=None, decoder_input=decoder_input)

    def _read(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """log p(token t | tokens < t) for t >= 1 from the last stage's logits; shape [batch, len-1]
        (on every TP rank)."""
        logits = logits[:, :-1].float()
        if self._banned is not None:  # as TorchTrainer's ``without``: finite, before the temperature
            logits = logits.masked_fill(self._banned, -1e9)
        logits = logits / self.temperature
        if self._vocab_padding is not None:
            logits = logits.masked_fill(self._vocab_padding, float("-inf"))
        return -vocab_parallel_cross_entropy(logits, ids[:, 1:])

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """The trainer's log-probabilities of each response token (collective over the replica's
        ranks: the last stage computes them, every stage answers them)."""
        self._require_awake("logprobs")
        if not len(batch):
            return []
        def response_logprobs(micro, padded, lp, k):
            return response_values(lp.cpu(), micro)

        (lps,) = pipeline.schedule(self, self.model, [batch], response_logprobs, forward_only=True) or [None]
        return pipeline.from_last_stage(lps, self.device)

    # --- training ------------------------------------------------------------------------

    def _dp_sums(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return t.tolist()

    def train_step(
        self,
        batch: TrainBatch,
        algorithm: AlgorithmConfig | None = None,
        minibatches: int = 1,
        micro_batch_tokens: int | None = None,
    ) -> dict[str, float]:
        """One rollout batch → ``minibatches`` optimizer steps (collective: every rank runs the
        same number of steps, an empty minibatch still joins the gradient all-reduce).

        ``algorithm`` and ``micro_batch_tokens``: as in ``TorchTrainer.train_step`` — the algorithm's
        loss through :class:`LossStep`; length-sorted passes of at most this many padded tokens,
        accumulating into DDP's grad buffers (under ``no_sync`` for all but the last pass), one
        all-reduce and optimizer step per minibatch."""
        self._require_awake("train_step")
        algorithm = algorithm if algorithm is not None else registry.DEFAULT()
        step = LossStep(algorithm, batch.advantages, self._dp_sums)
        loss_total, tokens, grad_norm = 0.0, 0.0, 0.0  # the step's statistics: the last stage's (where the loss is)
        self.model.train()
        pixel_cache = multimodal.PixelCache(self.processor) if self.processor is not None else None  # this step's images
        for part in batch.split(minibatches, step.unit):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            (total,) = self._dp_sums([step.count(part)])
            passes = micro_batches(part, micro_batch_tokens, step.unit)
            refs = None
            if self.reference is not None and algorithm.needs.reference:
                with torch.no_grad():
                    refs = pipeline.schedule(self, self.reference, passes, lambda micro, padded, lp, k: lp, True,
                                             pixel_cache)

            def loss(micro, padded, logprobs, k):
                # global ``total`` (not this pass's own count): the passes' losses sum to the minibatch's
                return step(logprobs, padded.old, micro.advantages, padded.response, total, refs[k] if refs else None,
                            pad_weights(micro))

            if passes:  # accumulates into DDP's grad buffer (main_grad), then the all-reduce
                losses = pipeline.schedule(self, self.model, passes, loss, False, pixel_cache)
            else:  # an empty minibatch still joins the all-reduce
                self.config.finalize_model_grads_func([self.model])
                losses = []
            _, grad_norm, _ = self.optimizer.step()
            loss_total += self._dp_sums([float(sum(x.item() for x in losses))])[0]  # the last stage's (0 elsewhere)
            tokens += float(sum(part.trained_tokens()))
            grad_norm = float(grad_norm)
        self.version += 1
        return pipeline.from_last_stage(step.result(tokens, loss=loss_total, grad_norm=grad_norm), self.device)

    # --- placement ---------------------------------------------------------------------

    def sleep(self) -> int:
        """Give the devices back while rollout and GenRM hold them: weights, gradient buffers,
        optimizer moments and main copies move to host memory (see ``engines/backends/megatron/offload.py``; on a
        CPU device too, so that CPU runs take the GPU's path). Answers the bytes moved (0 if
        asleep already). While asleep, ``export_weights`` (so ``save_hf``) reads the host copy;
        what needs the live state — ``logprobs``, ``train_step``, checkpoints — refuses."""
        self.finalize_checkpoint()  # an async checkpoint write still reads the live tensors
        return self._offload.offload(trainer_tensors(self.model, self.reference, self.optimizer))

    # --- weights out ---------------------------------------------------------------------

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face-named tensors on the CPU, one Megatron parameter at a time; from the
        host copy while the trainer sleeps (nothing is woken: the devices stay with whoever holds them).
        The names and shapes are those of the transformers model's ``named_parameters`` (what the
        rollout engines load by): a mixture's experts fused, one tensor per layer (``fuse_experts``).

        Collective over the DP group's ranks when it has several (each parameter's TP shards are
        all-gathered, each stage's parameters sent to the other stages, the experts to every
        expert-parallel rank: ``pipeline.whole_parameters``): every rank of the group must consume
        the whole iterator."""
        yield from fuse_experts(self._checkpoint_tensors(), self.text_config)

    def local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters this rank holds (see ``base.Trainer``): its TP shard of its stage's layers
        (a mixture's: its experts), under the whole model's layer numbers, where they are (the host
        copy while asleep). A last stage's tied output layer is its own copy, so it is among them."""
        offset = get_transformer_layer_offset(self.config) if parallel_state.get_pipeline_model_parallel_world_size() > 1 else 0
        for name, p in self.model.module.named_parameters():
            yield global_name(name, offset), self._offload.host_view(p.detach())

    def _checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """As :meth:`export_weights`, under the names checkpoints use (a mixture's experts one by one)."""
        for name, shards in pipeline.whole_parameters(self):
            vision_name = vision.hf_name(name)
            if vision_name is not None:  # the Hugging Face vision tower or connector: its own name
                yield vision_name, shards[0].to("cpu", copy=True).contiguous()
                continue
            for hf_name, tensor in _param_to_hf(name, shards, self.text_config).items():
                if self.processor is not None:
                    hf_name = vision.to_vlm_name(hf_name)
                yield hf_name, tensor.to("cpu", copy=True).contiguous()

    def save_hf(self, local_dir: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """config.json, model.safetensors (HF names) and the tokenizer (a vision model's processor,
        and its generation_config.json, as ``save_pretrained`` writes). Collective over the
        replica's ranks; its first (stage 0, TP rank 0) writes. ``tensors``: Hugging Face-named weights taken
        earlier (``dict(export_weights())``, host-memory copies) to write instead of the live
        ones; then nothing is collective and any thread may call it. A mixture's experts are
        written one by one, under the names ``save_pretrained`` gives them."""
        tensors = dict(self._checkpoint_tensors()) if tensors is None else unfuse_experts(tensors, self.text_config)
        if parallel_state.get_tensor_model_parallel_rank() != 0 or not parallel_state.is_pipeline_first_stage():
            return
        os.makedirs(local_dir, exist_ok=True)
        self.hf_config.save_pretrained(local_dir)
        save_file(tensors, os.path.join(local_dir, "model.safetensors"), metadata={"format": "pt"})
        if self.processor is None:
            self.tokenizer.save_pretrained(local_dir)
            return
        self.processor.save_pretrained(local_dir)
        generation = os.path.join(self.model_dir, "generation_config.json")
        if os.path.exists(generation):
            shutil.copyfile(generation, os.path.join(local_dir, "generation_config.json"))

    # --- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, local_dir: str, async_save: bool = False) -> list[str] | None:
        """Model + optimizer + version with ``dist_checkpointing`` (collective).

        Every rank writes into its own ``local_dir`` (new or empty) only the shards it owns;
        data-parallel replicas split the replicated tensors between them. The union of all
        ranks' folders is the checkpoint, so a caller can upload each rank's files under one
        prefix and later give every rank the whole folder. Returns the file names (relative to
        ``local_dir``) this rank wrote; with ``async_save`` the files are written in the
        background and :meth:`finalize_checkpoint` returns them.
        """
        self._require_awake("save_checkpoint")
        self.finalize_checkpoint()
        path = Path(local_dir)
        state = megatron_optimizer.sharded_state(self.model, self.optimizer, metadata=self._sharding, version=self.version)
        request = megatron_optimizer.save(state, path, async_save, self._sharding)
        if not async_save:
            return megatron_optimizer.files_under(path)
        self._checkpoints.schedule_async_request(request)
        self._pending_checkpoint = path
        return None

    def freeze_checkpoint(self, local_dir: str, copy: bool, hf_weights: bool) -> FrozenCheckpoint:
        """``dist_checkpointing``'s save is a collective (the DP ranks split the replicated tensors)
        that must not run on another thread beside the train step's collectives: the shards are
        written to ``local_dir`` now, and ``write`` only lists them. With ``copy`` and
        ``hf_weights``, the policy's Hugging Face weights are copied to host memory too."""
        written = self.save_checkpoint(local_dir)
        return FrozenCheckpoint(lambda: written, dict(self.export_weights()) if copy and hf_weights else None)

    def finalize_checkpoint(self) -> list[str]:
        """Wait for the async save in flight, if any (collective); returns its files on this rank."""
        if self._pending_checkpoint is None:
            return []
        self._checkpoints.maybe_finalize_async_calls(blocking=True)
        path, self._pending_checkpoint = self._pending_checkpoint, None
        return megatron_optimizer.files_under(path)

    def load_checkpoint(self, local_dir: str) -> None:
        """Restore model, optimizer and version from a whole checkpoint folder (collective)."""
        self._require_awake("load_checkpoint")
        self.finalize_checkpoint()
        state = megatron_optimizer.load(self.model, self.optimizer, local_dir, self._adam_repairs)
        self.version = int(state["version"])
