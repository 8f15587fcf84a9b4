"""Tiny vision-language models built locally: Idefics3 (SmolVLM's architecture), Qwen2.5-VL and Qwen3-VL.

Nothing can be downloaded here, so the vision demo makes its own Hugging Face folder: a
character tokenizer with Idefics3's image tokens, Idefics3's PIL image processor and processor,
and an ``Idefics3ForConditionalGeneration`` with random weights (a SigLIP-style vision tower, a
pixel-shuffle connector and a small Llama). ``save_pretrained`` writes what ``AutoProcessor`` and
``AutoModelForImageTextToText`` load back, the same code path as a downloaded SmolVLM; vLLM
serves it too (its Idefics3 module needs no torchvision).

Why Idefics3 for the demo: the Qwen-VL family's vLLM modules import torchvision, which has no CPU
build beside this project's CPU torch (docs/vision.md); Idefics3's do not. The Qwen-VL builds
(``sft.vision=qwen2_5_vl`` / ``qwen3_vl``) run on the torch engines: their processors take the PIL
image processor transformers ships for them and no video processor (``multimodal.images_only``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor,
                          PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                          Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor)

from engines.backends.multimodal import images_only
from engines.demo.tiny import build_char_tokenizer

# Idefics3's processor looks these up by name in the tokenizer
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
QWEN_VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# one image in a prompt's text: Idefics3's placeholder, Qwen-VL's as its chat template writes it
PLACEHOLDERS = {"idefics3": "<image>", "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
                "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>"}


def build_vision_processor(characters: Iterable[str] = (), image_size: int = 56, patch_size: int = 14,
                           scale_factor: int = 2) -> Idefics3Processor:
    """A character tokenizer (``engines.demo.tiny``) with Idefics3's image tokens, and a processor
    that resizes every image to ``image_size`` pixels square without splitting it: one image is
    ``(image_size / patch_size)^2 / scale_factor^2`` image tokens in the text model."""
    tokenizer = build_char_tokenizer(characters)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, do_resize=True, size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size}, do_pad=True)
    seq_len = (image_size // patch_size) ** 2 // scale_factor**2
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len)


def build_tiny_idefics3(tokenizer: PreTrainedTokenizerFast, image_size: int = 56, patch_size: int = 14,
                        scale_factor: int = 2, vision_hidden: int = 64, vision_layers: int = 2, hidden_size: int = 128,
                        num_layers: int = 2, num_heads: int = 4, max_positions: int = 128, seed: int = 0,
                        init_std: float = 0.02) -> Idefics3ForConditionalGeneration:
    """A randomly initialised Idefics3 drawn with ``seed``: a vision tower of ``vision_layers`` layers,
    a Llama of ``num_layers`` layers (head size hidden_size / num_heads: vLLM's CPU attention needs
    32 or more), weights of standard deviation ``init_std``."""
    torch.manual_seed(seed)
    config = Idefics3Config(
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
        pad_token_id=tokenizer.pad_token_id,
        vision_config={"hidden_size": vision_hidden, "intermediate_size": 4 * vision_hidden, "num_hidden_layers": vision_layers,
                       "num_attention_heads": 2, "image_size": image_size, "patch_size": patch_size,
                       "initializer_range": init_std},
        text_config={"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": hidden_size,
                     "intermediate_size": 4 * hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
                     "num_key_value_heads": num_heads, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id, "initializer_range": init_std, "tie_word_embeddings": False},
        tie_word_embeddings=False,
    )
    config.initializer_range = init_std
    model = Idefics3ForConditionalGeneration(config).float()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def build_qwen_vl_processor(family: str, characters: Iterable[str] = (), image_size: int = 56):
    """A character tokenizer with Qwen-VL's vision tokens and the family's processor over Qwen2-VL's PIL
    image processor (Qwen2.5-VL: 14-pixel patches, Qwen3-VL: 16), every image resized to about
    ``image_size`` pixels square: (image_size / (2 x patch))^2 image tokens after the 2x2 merge."""
    tokenizer = build_char_tokenizer(characters)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    patch = 16 if family == "qwen3_vl" else 14
    side = max(2 * patch, round(image_size / (2 * patch)) * 2 * patch)  # a multiple of patch x merge
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                               size={"shortest_edge": side * side, "longest_edge": side * side})
    cls = images_only(Qwen3VLProcessor if family == "qwen3_vl" else Qwen2_5_VLProcessor)
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def build_tiny_qwen_vl(family: str, tokenizer: PreTrainedTokenizerFast, vision_hidden: int = 64, vision_layers: int = 2,
                       hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4, max_positions: int = 128,
                       seed: int = 0, init_std: float = 0.02):
    """A randomly initialised Qwen2.5-VL or Qwen3-VL drawn with ``seed``: its vision tower (windowed
    attention for 2.5, DeepStack features for 3) of ``vision_layers`` layers, and its language model
    with 3-D rotary positions (M-RoPE; Qwen3-VL's interleaved) of ``num_layers`` layers."""
    torch.manual_seed(seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    half = hidden_size // num_heads // 2  # rotary frequencies per head, split over (time, height, width)
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = {"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 4 * hidden_size,
            "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_heads,
            "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "initializer_range": init_std,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "tie_word_embeddings": False}
    vision = {"depth": vision_layers, "hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden, "num_heads": 2,
              "out_hidden_size": hidden_size, "spatial_merge_size": 2, "temporal_patch_size": 2, "initializer_range": init_std}
    tokens = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}
    if family == "qwen3_vl":
        text |= {"head_dim": hidden_size // num_heads,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section,
                                     "mrope_interleaved": True}}
        vision |= {"patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
        config, cls = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens), \
            Qwen3VLForConditionalGeneration
    else:
        text |= {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}
        vision |= {"patch_size": 14, "window_size": 56, "fullatt_block_indexes": [vision_layers - 1]}
        config, cls = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens), \
            Qwen2_5_VLForConditionalGeneration
    config.initializer_range = init_std
    model = cls(config).float()
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    return model
