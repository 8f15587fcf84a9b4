"""``TorchGenerator``: sampling with transformers, the CPU default and the numerical reference.

It serves both roles that generate text (policy rollout and the generative reward model) and
speaks Hugging Face parameter names, so the vLLM backend can take its place behind the same
methods.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from engines.backends import chat, multimodal
from engines.backends.base import Generation, WeightSyncError, refuse_unwritten
from engines.backends.digest import BucketDigest, sync_check
from engines.backends.torch import routing
from engines.backends.torch.model import decode_attention, forward_precision, load_model, resolve_device, without


class TorchGenerator:
    """Sampling with per-token log-probabilities, and weight updates by HF name.

    ``device``: where the model lives and computes (None: the current CUDA device, else the CPU);
    ``autocast``: bf16 autocast of the forward passes (None: on CUDA only); ``prompt_format``: how
    prompts are rendered (``engines.backends.chat``; None: as they are, no chat template);
    ``record_routes``: each generation carries a MoE model's routes (``routing``, router replay)."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: torch.device | str | None = None,
                 autocast: bool | None = None, prompt_format: chat.PromptFormat | None = None,
                 record_routes: bool = False):
        self.device = resolve_device(device)
        self.autocast = autocast
        self.tokenizer, self.model, self.processor = load_model(model_dir, dtype, self.device)
        self.renderer = chat.Renderer(self.processor or self.tokenizer, prompt_format)
        self.model.eval()
        # a vision model's image tokens are input only: sampling one would start a fake image
        self.suppress = multimodal.image_token_ids(self.processor) if self.processor is not None else None
        self.record_routes = record_routes and bool(routing.routers(self.model))

    @torch.no_grad()
    def generate(
        self,
        prompts: list[chat.Prompt],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        seed: int = 0,
        greedy: bool = False,
        images: list[list[bytes]] | None = None,
    ) -> list[Generation]:
        tok, special = self.tokenizer, self.renderer.encode_kwargs
        if images is not None:
            if self.processor is None:
                raise ValueError("images given to a text-only model")
            texts = [self.renderer.text(p) for p in prompts for _ in range(n)]
            batch = multimodal.model_inputs(self.processor, texts, [im for im in images for _ in range(n)], **special)
            batch = batch.to(self.device)
        else:  # input ids and mask only (a tokenizer that adds token_type_ids makes generate() refuse them), left-padded
            ids = [row for row in self.renderer.batch_ids(prompts) for _ in range(n)]
            batch = tok.pad({"input_ids": ids}, return_tensors="pt", return_attention_mask=True).to(self.device)
        if not greedy:  # greedy draws nothing: leave the process-wide RNG alone (a judge on another
            torch.manual_seed(seed)  # thread must not reseed the rollout's sampling: placement.mode=partial)
        recording = routing.recording(self.model) if self.record_routes else contextlib.nullcontext()
        with forward_precision(self.device, self.autocast), decode_attention(self.device), recording as calls:
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
                suppress_tokens=self.suppress,
            )
        new_tokens = out.sequences[:, batch["input_ids"].shape[1] :]
        logits = without(torch.stack(out.logits, dim=1).float(), self.suppress) / (1.0 if greedy else temperature)
        token_logprobs = torch.log_softmax(logits, -1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        ends = [ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids) for ids in new_tokens.tolist()]
        routes = routing.generated_routes(calls, batch["attention_mask"], ends) if self.record_routes else [None] * len(ends)
        results = []
        for row, end in enumerate(ends):
            ids = new_tokens[row].tolist()
            prompt_ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            results.append(
                Generation(
                    prompt_index=row // n,
                    prompt_ids=prompt_ids,
                    response_ids=ids[:end],
                    response=tok.decode(ids[:end], skip_special_tokens=True),
                    logprobs=token_logprobs[row, :end].tolist(),
                    truncated=tok.eos_token_id not in ids[:end],
                    routed_experts=routes[row],
                )
            )
        return results

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> list[str]:
        """Copy Hugging Face-named tensors into the model, a bucket at a time; answers each bucket's
        fingerprint as read back from the model (``base.load_weights``): each parameter reduced on its
        device right after its copy, in the sender's dtype (``digest.BucketDigest``)."""
        params = dict(self.model.named_parameters())
        written: set[str] = set()
        digests = []
        mode = sync_check()
        with torch.no_grad():
            for bucket in buckets:
                digest = BucketDigest(mode)
                for name, tensor in bucket:
                    if name not in params:
                        raise WeightSyncError(f"weight sync: the rollout engine has no parameter {name!r}")
                    params[name].copy_(tensor)
                    digest.add(name, params[name].to(tensor.dtype))
                    written.add(name)
                digests.append(digest)
        refuse_unwritten(params.keys() - written)
        return [d.hexdigest() for d in digests]  # read back to the host once, at the end

    # The reference engine stays resident: on a GPU beside the others, on a CPU nothing moves.
    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass
