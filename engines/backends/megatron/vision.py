"""Vision-language models on the Megatron trainer: the hybrid Megatron-Bridge and slime use.

Idefics3 (SmolVLM's architecture) is a SigLIP-style vision tower (``model.vision_model``), a
pixel-shuffle connector (``model.connector``) and a Llama (``model.text_model`` + ``lm_head``).
Megatron-Core has no module for the first two, so they stay the Hugging Face torch modules and
only the language model becomes a Megatron ``GPTModel`` (built from ``hf_config.text_config`` with
the Llama mapping of ``mapping.py``, the text model's names translated from ``model.text_model.*``
to the ``model.*`` that mapping speaks, and back).

The two Hugging Face modules are attached to the ``GPTModel`` as the submodule ``hf_vision``
(``hf_vision.vision_model``, ``hf_vision.connector``) before Megatron's DDP wraps it, so
everything Megatron does to the GPT's parameters it does to theirs: the trainable ones (the
connector; the tower too with ``freeze_vision=False``) get DDP gradient buffers, the DP all-reduce
(a sum) in ``finalize_model_grads``, the Megatron optimizer's AdamW step and its gradient clipping
over the joint norm; every parameter is in ``sharded_state_dict`` (plain modules are saved as
replicated tensors by Megatron's ``sharded_state_dict_default``) and in the offload's tensors.
``GPTModel.forward`` never calls ``hf_vision``: the trainer computes the token embeddings with the
GPT's embedding, scatters the connector's image features into the image-token positions (as
``Idefics3Model.inputs_merger`` does) and hands the result in as ``decoder_input``.

Tensor parallelism: the tower and connector are replicated on every TP rank, and their
gradients agree there (the first layer's column-parallel input all-reduces the gradient of
``decoder_input`` over TP), so only the DP all-reduce applies to them, as for the norms.
"""

from __future__ import annotations

import copy

import torch

from engines.backends.megatron.mapping import HFState

# model_type -> the transformers module that holds its vision tower and connector classes
VISION_MODELS = {"idefics3": "idefics3", "smolvlm": "smolvlm"}
VISION_PREFIX = "hf_vision."  # the Megatron-side names of the Hugging Face modules
TEXT_PREFIX = "model.text_model."


def is_supported(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) in VISION_MODELS


def check_supported(hf_config) -> None:
    if not is_supported(hf_config):
        raise NotImplementedError(
            f"model_type {hf_config.model_type!r}: the Megatron trainer pairs a Megatron GPT with the Hugging Face "
            f"vision tower for {tuple(VISION_MODELS)} only")


def text_config(hf_config):
    """The language model's (Llama) config, its embeddings tied as the whole model's are."""
    text = copy.deepcopy(hf_config.text_config)
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", text.tie_word_embeddings))
    return text


def text_state(hf_state: HFState) -> HFState:
    """The language model's tensors under the Llama names ``mapping.hf_to_megatron`` reads (none read yet)."""
    return hf_state.view({("model." + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name): name
                          for name in hf_state if name.startswith(TEXT_PREFIX) or name == "lm_head.weight"})


def to_vlm_name(text_name: str) -> str:
    """A Llama name from ``mapping`` → the Idefics3 name of the same tensor."""
    if text_name.startswith("model."):
        return TEXT_PREFIX + text_name[len("model."):]
    return text_name  # lm_head.weight


def hf_name(megatron_name: str) -> str | None:
    """The Hugging Face name of a parameter of ``hf_vision`` (None for the GPT's own)."""
    if megatron_name.startswith(VISION_PREFIX):
        return "model." + megatron_name[len(VISION_PREFIX):]
    return None


def attach(gpt: torch.nn.Module, hf_config, hf_state: HFState, device, dtype: torch.dtype, freeze_vision: bool = True) -> None:
    """Build the Hugging Face vision tower and connector from ``hf_state`` and attach them to
    ``gpt`` as ``hf_vision`` (before DDP wraps it). ``freeze_vision``: the tower takes no gradient
    (the connector always trains)."""
    import importlib

    check_supported(hf_config)
    modeling = importlib.import_module(f"transformers.models.{VISION_MODELS[hf_config.model_type]}.modeling_{hf_config.model_type}")
    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[hf_config.model_type]
    container = torch.nn.Module()
    # sdpa, as TorchTrainer loads the whole model (engines/backends/torch/model.py)
    container.vision_model = getattr(modeling, f"{prefix}VisionTransformer")._from_config(
        hf_config.vision_config, attn_implementation="sdpa")
    container.connector = getattr(modeling, f"{prefix}Connector")(hf_config)
    state = {name[len("model."):]: hf_state[name] for name in hf_state  # these tensors only (an HFState reads them)
             if name.startswith(("model.vision_model.", "model.connector."))}
    missing, unexpected = container.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"Hugging Face vision tower/connector mismatch: missing {missing}, unexpected {unexpected}")
    container.to(device=device, dtype=dtype)
    container.vision_model.requires_grad_(not freeze_vision)
    gpt.hf_vision = container


def image_features(container: torch.nn.Module, hf_config, pixel_values: torch.Tensor,
                   pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[real images, image tokens, hidden]: ``Idefics3Model.get_image_features`` (all-zero padding
    images dropped, the patch mask from the pixel mask, tower, connector)."""
    batch, images = pixel_values.shape[:2]
    dtype = next(container.connector.parameters()).dtype
    pixel_values = pixel_values.to(dtype).view(batch * images, *pixel_values.shape[2:])
    real = (pixel_values == 0.0).sum(dim=(-1, -2, -3)) != pixel_values.shape[1:].numel()
    pixel_values = pixel_values[real].contiguous()
    if pixel_attention_mask is None:
        pixel_attention_mask = torch.ones([pixel_values.shape[i] for i in (0, 2, 3)], dtype=torch.bool, device=pixel_values.device)
    else:
        pixel_attention_mask = pixel_attention_mask.view(batch * images, *pixel_attention_mask.shape[2:])[real].contiguous()
    patch = hf_config.vision_config.patch_size
    subgrid = pixel_attention_mask.unfold(1, patch, patch).unfold(2, patch, patch)
    patch_mask = (subgrid.sum(dim=(-1, -2)) > 0).bool()
    tower = container.vision_model
    frozen = not any(p.requires_grad for p in tower.parameters())
    with torch.no_grad() if frozen else torch.enable_grad():  # a frozen tower keeps no activations
        hidden = tower(pixel_values=pixel_values, patch_attention_mask=patch_mask, return_dict=True).last_hidden_state
    return container.connector(hidden)


def merge(embeddings: torch.Tensor, ids: torch.Tensor, features: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """Megatron's [seq, batch, hidden] token embeddings with the image features in the positions of
    the image tokens, row by row in order (``inputs_merger``'s masked_scatter over [batch, seq])."""
    mask = ids == image_token_id
    if int(mask.sum()) != features.shape[0] * features.shape[1]:
        raise ValueError(f"{int(mask.sum())} image tokens in the batch for {features.shape[0]} image(s) of "
                         f"{features.shape[1]} features each")
    merged = embeddings.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), features.to(embeddings.dtype))
    return merged.transpose(0, 1).contiguous()
