"""A tiny vision-language model built locally: Idefics3, the architecture of SmolVLM.

Nothing can be downloaded here, so the vision demo makes its own Hugging Face folder: a
character tokenizer with Idefics3's image tokens, Idefics3's PIL image processor and processor,
and an ``Idefics3ForConditionalGeneration`` with random weights (a SigLIP-style vision tower, a
pixel-shuffle connector and a small Llama). ``save_pretrained`` writes what ``AutoProcessor`` and
``AutoModelForImageTextToText`` load back, the same code path as a downloaded SmolVLM; vLLM
serves it too (its Idefics3 module needs no torchvision).

Why Idefics3: the Qwen-VL family's vLLM modules import torchvision, which has no CPU build
beside this project's CPU torch (docs/vision.md); Idefics3's do not.
"""

from __future__ import annotations

from typing import Iterable

import torch
from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor,
                          PreTrainedTokenizerFast)

from engines.demo.tiny import build_char_tokenizer

# Idefics3's processor looks these up by name in the tokenizer
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]


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
