"""Build a tiny Llama-style model and a character tokenizer locally.

Nothing can be downloaded here, so the demo makes its own Hugging Face folders:
a character-level tokenizer (``tokenizer.json``) and a small ``LlamaForCausalLM``.
Everything downstream loads them with the ordinary ``from_pretrained`` code, so a
user can point the config at any Hugging Face folder instead.
"""

from __future__ import annotations

import string
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = string.digits + string.ascii_lowercase + " +-*=?:.,"


def build_char_tokenizer(characters: Iterable[str] = (), words: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (BPE with no merges splits text into characters) over digits,
    lowercase letters and some punctuation, and any other ``characters``, in sorted order after them;
    ``words`` are whole tokens after those (the plain tool-call format's ``<tool_call>`` and kin)."""
    extra = sorted(set(characters) - set(CHARACTERS))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARACTERS) + extra)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()  # characters join without spaces
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.add_tokens(list(words))
    return tokenizer


def build_tiny_llama(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 64,
    seed: int = 0,
    init_std: float = 0.02,
) -> LlamaForCausalLM:
    """A randomly initialised Llama with grouped-query attention (heads share KV); its weights
    are drawn with standard deviation ``init_std`` (Llama's own default is 0.02)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=init_std,
    )
    return LlamaForCausalLM(config).float()
