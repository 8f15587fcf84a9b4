"""Tiny random models of the architectures users train, with a byte-level BPE tokenizer and the
chat template of the real model, built locally.

No weights can be downloaded here, so every architecture is checked from a tiny configuration of
its own Hugging Face class (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``Qwen2ForCausalLM``,
``LlamaForCausalLM``, ``Gemma3ForCausalLM``) with random weights, and a tokenizer trained here with ``tokenizers`` and
saved with a chat template in the style of the real model's (ChatML for Qwen, header tokens for
Llama 3, turns for Gemma 3). ``save_tiny_hub_model`` writes an ordinary Hugging Face folder, so
everything downstream loads it through the same ``from_pretrained`` code a downloaded
Qwen3-0.6B or Llama-3.2-1B-Instruct goes through.

    python -m engines.demo.tiny_hub qwen3 models/tiny-qwen3     # one folder, for trying things
"""

from __future__ import annotations

import argparse
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM)

# The real models' chat templates, cut down to what a prompt/response dataset uses (system, user
# and assistant turns; ChatML also tools, as Qwen's: their schemas in the system turn, each result a
# <tool_response> in a user turn). ``add_generation_prompt`` opens the assistant's turn.
CHATML = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call functions. Their signatures:\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "\n</tools>\n\nCall one as:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Gemma has no system role: its template puts the system prompt at the top of the first user turn.
GEMMA3 = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """What differs between the families' tokenizers: special tokens, chat template, whether a BOS is prepended."""

    template: str
    bos: str | None
    eos: str
    pad: str
    extra: tuple[str, ...] = ()


FAMILIES = {
    "qwen": Family(CHATML, bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",)),
    "llama3": Family(LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
                     extra=("<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>")),
    "gemma": Family(GEMMA3, bos="<bos>", eos="<end_of_turn>", pad="<pad>", extra=("<start_of_turn>", "<eos>")),
}
ARCHITECTURES = {"qwen3": "qwen", "qwen3_moe": "qwen", "qwen3_5_text": "qwen", "qwen2": "qwen", "llama": "llama3", "gemma3_text": "gemma"}

# What the tokenizer is trained on: enough for BPE merges over digits, words and math notation.
CORPUS = [
    "What is 12 + 7? Think step by step, then put the final answer in \\boxed{}.",
    "The answer is \\boxed{19}. Solve for x: 3x + 5 = 20, so x = 5.",
    "You are a helpful assistant. Please reason step by step.",
    "\\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}; sqrt(16) = 4; 2^10 = 1024.",
    string.ascii_letters + string.digits + string.punctuation,
]


def build_bpe_tokenizer(family: str, corpus: Iterable[str] = CORPUS, vocab_size: int = 512,
                        chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE (the kind Qwen, Llama 3 and GPT-2 use: every byte is a token, so any text
    encodes) trained on ``corpus``, with ``family``'s special tokens and chat template (or
    ``chat_template``: e.g. the real model's own)."""
    spec = FAMILIES[family]
    specials = [t for t in (spec.pad, spec.bos, spec.eos, *spec.extra) if t]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(list(corpus), trainer=trainer)
    if spec.bos:  # Llama 3 and Gemma prepend their BOS when text is tokenized with special tokens
        core.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A $B", special_tokens=[(spec.bos, core.token_to_id(spec.bos))])
    else:
        core.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=spec.bos, eos_token=spec.eos,
                                        pad_token=spec.pad, padding_side="left")
    tokenizer.chat_template = chat_template or spec.template
    return tokenizer


def build_tiny_model(model_type: str, tokenizer: PreTrainedTokenizerFast, hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 2, num_kv_heads: int = 1, max_positions: int = 512, seed: int = 0,
                     init_std: float = 0.02, experts: int = 4, experts_per_token: int = 2) -> PreTrainedModel:
    """A randomly initialised model of ``model_type`` (``ARCHITECTURES``) in float32, with the
    traits of the real family's small models: Qwen2.5 has Q/K/V biases, Qwen3 per-head q/k norms,
    Qwen3-MoE (Qwen3-30B-A3B's kind) a mixture of experts in every layer, 4 experts of which each
    token takes 2 (``experts``, ``experts_per_token``; the real one takes 8 of 128), Qwen3.5 (text) its
    hybrid layers, Gated DeltaNet linear attention and full attention alternating (the real one: 3 to 1),
    Llama 3.2 rope scaling, Gemma 3 sliding-window layers; the small Qwen, Llama 3.2 and Gemma 3
    models tie their input and output embeddings. Head size is hidden_size / num_heads (vLLM's CPU
    attention needs 32 or more)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 3,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_positions, initializer_range=init_std, tie_word_embeddings=True,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    head_dim = hidden_size // num_heads
    if model_type == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=head_dim, rms_norm_eps=1e-6,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    elif model_type == "qwen3_moe":  # Qwen3-30B-A3B normalises the chosen experts' weights (norm_topk_prob) and ties nothing
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common | {"tie_word_embeddings": False}, head_dim=head_dim,
                                                   rms_norm_eps=1e-6, num_experts=experts,
                                                   num_experts_per_tok=experts_per_token,
                                                   moe_intermediate_size=hidden_size, norm_topk_prob=True,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    elif model_type == "qwen3_5_text":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, head_dim=head_dim, rms_norm_eps=1e-6, linear_num_key_heads=num_kv_heads,
            linear_num_value_heads=num_heads, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
            layer_types=["linear_attention", "full_attention"] * (num_layers // 2) + ["linear_attention"] * (num_layers % 2)))
    elif model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rms_norm_eps=1e-6,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    elif model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=head_dim, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": max_positions // 2}))
    elif model_type == "gemma3_text":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                                   sliding_window=16, rms_norm_eps=1e-6,
                                                   layer_types=["sliding_attention", "full_attention"] * (num_layers // 2)
                                                   + ["sliding_attention"] * (num_layers % 2)))
    else:
        raise ValueError(f"model_type {model_type!r}: the tiny builders are {sorted(ARCHITECTURES)}")
    return model.float()


def save_tiny_hub_model(model_type: str, folder: str | Path, seed: int = 0, chat_template: str | None = None,
                        **shape) -> Path:
    """Write a tiny ``model_type`` model and its family's tokenizer (with chat template) to ``folder``."""
    folder = Path(folder)
    tokenizer = build_bpe_tokenizer(ARCHITECTURES[model_type], chat_template=chat_template)
    build_tiny_model(model_type, tokenizer, seed=seed, **shape).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_type", choices=sorted(ARCHITECTURES))
    parser.add_argument("folder")
    args = parser.parse_args()
    print(save_tiny_hub_model(args.model_type, args.folder))
