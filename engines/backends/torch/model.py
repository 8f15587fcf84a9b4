"""Loading a Hugging Face model for the torch engines, and the forward pass both of them share.

On CUDA the forward passes run under bf16 autocast (parameters and Adam state stay in the model's
dtype, fp32 by default) with SDPA attention: the plain-PyTorch GPU baseline. On the CPU they
compute in the model's dtype without autocast, the fp32 reference the other engines are tested
against.
"""

from __future__ import annotations

import contextlib

import torch


def load_model(model_dir: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    """(tokenizer, model, processor) of a Hugging Face folder: a causal LM (processor None) or a
    vision-language model with its processor (``engines/backends/multimodal.py``)."""
    # imported here, not at the top: engine hosts import this module for TrainBatch and the
    # checkpoint helpers, and transformers adds ~100 MB per host (64 timing-stub hosts: 6 GB)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from engines.backends.multimodal import load_processor

    processor = load_processor(model_dir)
    tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    auto = AutoModelForImageTextToText if processor is not None else AutoModelForCausalLM
    # SDPA: flash / memory-efficient kernels on CUDA (transformers' default too, here made explicit)
    model = auto.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return tokenizer, model.to(device), processor


# a vision-language model's vision encoder by its Hugging Face module name (Idefics3/SmolVLM
# ``vision_model``, Qwen-VL ``visual``, LLaVA ``vision_tower``); the connector that maps its features
# into the language model is not part of it (it trains)
VISION_TOWERS = ("vision_model", "visual", "vision_tower")
# the same as a peft ``exclude_modules`` pattern (re.fullmatch on module names)
VISION_TOWER_PATTERN = rf"(.*\.)?({'|'.join(VISION_TOWERS)})(\..*)?"


def is_vision_tower(name: str) -> bool:
    """A parameter or module of a vision-language model's vision encoder (``VISION_TOWERS``)."""
    return any(part in name.split(".") for part in VISION_TOWERS)


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        from engines.backends.distributed import default_device

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


def decode_attention(device: torch.device):
    """The attention kernels ``generate()`` runs with: on CUDA, SDPA without cuDNN's. torch 2.11
    prefers cuDNN attention on Hopper, and cuDNN builds an execution plan for every shape it has
    not seen; a decode step's key length is new at every token, so on an H200 a generate call at a
    batch size not seen before took 3.1 s where a repeat took 0.24 s, 2.7 s of it inside SDPA
    (2026-11-28, docs/gpu). Flash and memory-efficient attention have no per-shape set-up."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                      pixels: dict[str, torch.Tensor] | None = None, banned: list[int] | None = None) -> torch.Tensor:
    """log p(token t | tokens < t) for every position t >= 1; shape [batch, len-1]. ``pixels``: a
    vision-language model's image inputs (``multimodal.PixelCache.batch``); ``banned``: tokens the
    policy never samples (a VLM's image tokens), outside its distribution (see ``without``)."""
    if pixels:  # batches are right-padded: default positions are right, and Qwen-VL derives its 3-D ones
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **pixels).logits
    else:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = without(logits[:, :-1].float(), banned) / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def without(logits: torch.Tensor, banned: list[int] | None) -> torch.Tensor:
    """``logits`` with the ``banned`` tokens out of reach: the distribution the rollout samples from
    (and vLLM reports log-probabilities of), so rollout and trainer log-probabilities agree. A large
    finite value rather than -inf: prompt positions whose next token is an image token stay finite
    (they are masked out of the loss, and -inf times a zero mask would be NaN)."""
    if not banned:
        return logits
    logits = logits.clone()
    logits[..., banned] = -1e9
    return logits


# model types whose packed forward (position ids restarting per row, no attention mask: transformers'
# block-diagonal causal mask, ``batching.Packed``) is tested equal to the padded one
# (tests/test_packing.py); every other family trains padded, for the reason ``packing_refusal`` gives
PACKED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")


def packing_refusal(config, vision: bool = False) -> str | None:
    """Why a model (its Hugging Face ``config``) cannot train on packed micro-batches, or None if it can.
    ``vision``: a vision-language policy (its processor turns images into media tokens)."""
    kind = getattr(config, "model_type", "?")
    if vision:
        return (f"{kind} is a vision-language model: its image features are merged into each row's media tokens and "
                "Qwen-VL derives 3-D positions per row from them, which a packed row would mix up")
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        return (f"{kind} has linear-attention (Gated DeltaNet) layers: their recurrent state and causal convolution run "
                "across a packed lane, and transformers' PyTorch kernels take no per-row starts, so one row would leak into the next")
    if kind not in PACKED_FAMILIES:
        return f"{kind} is not among the families whose packed forward is tested equal to the padded one ({', '.join(PACKED_FAMILIES)})"
    return None


def packed_logprobs(model, packed, temperature: float, banned: list[int] | None = None) -> torch.Tensor:
    """:func:`sequence_logprobs` of a packed pass (``batching.Packed``), in its rows' padded layout
    [rows, width - 1] (0 past a row's end). No attention mask: transformers reads the rows' boundaries
    from where ``position_ids`` restart and masks attention block-diagonally; no cache, which would
    turn that reading off."""
    logits = model(input_ids=packed.ids, position_ids=packed.positions, use_cache=False).logits
    logits = without(logits[:, :-1].float(), banned) / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, packed.ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return packed.rows(lp)
