"""Supervised fine-tuning: the warm start for the policy and the generative reward model.

Training runs until the model has learned what it is shown, not for a fixed number of
steps. A tiny transformer learning a positional task (which digits to add) sits on a loss
plateau for a while before it finds the pattern, and how long depends on the seed and on
the CPU's floating-point kernels: a fixed step count lands on either side of that
transition by luck. So every ``check_every`` steps the model answers held-out prompts
greedily, and training stops once ``target`` of the answers are the expected ones.

At each check the whole training state (weights, optimizer, schedule, random streams) is
handed to ``save``; given back as ``resume``, training continues exactly as if it had not
stopped. ``flows/sft.py`` keeps that state on object storage and writes the finished model.
"""

from __future__ import annotations

import random
import time
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.agents import tools
from engines.backends import chat, multimodal
from engines.demo.tiny import build_char_tokenizer, build_tiny_llama


class Optimiser:
    """The optimisation ``yattflow sft`` and ``yattflow rm`` both run, and what a continued run
    restores: AdamW, the learning rate warmed up linearly over the first 100 steps and then
    constant (a decay tied to a step budget would cool the model before it had converged, and a
    run continued with a larger budget follows the same schedule), gradients clipped at norm 1,
    the Python and torch random streams."""

    def __init__(self, model, lr: float, seed: int):
        self.model, self.rng = model, random.Random(seed)
        torch.manual_seed(seed)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min((s + 1) / 100, 1.0))

    def step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()

    def state(self, **figures) -> dict:
        """The whole training state, with the caller's ``figures`` (step, loss, ...)."""
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "schedule": self.sched.state_dict(),
                "python_rng": self.rng.getstate(), "torch_rng": torch.get_rng_state()} | figures

    def restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["schedule"])
        self.rng.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])


def sft(
    model,
    tokenizer,
    pairs: list[tuple[str, str]],
    check: list[tuple[str, str]],
    target: float | None = 0.95,
    max_steps: int = 6000,
    check_every: int = 100,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
    resume: dict | None = None,
    save: Callable[[dict], None] | None = None,
    processor=None,
    images: list[list[bytes]] | None = None,
    check_images: list[list[bytes]] | None = None,
    on_check: Callable[[dict], None] | None = None,
    renderer: chat.Renderer | None = None,
    tools: list[dict] | None = None,
    on_progress: Callable[[dict], None] | None = None,
    progress_every_s: float = 30.0,
) -> dict:
    """Train ``model`` on (prompt, completion) pairs until its greedy completions of the
    ``check`` prompts equal their expected completions for a ``target`` fraction of them,
    or ``max_steps`` pass (``target`` None, or no ``check`` pairs: ``max_steps``, exactly).
    The loss covers completion tokens (and end-of-sequence) only.
    The optimisation is :class:`Optimiser`'s.

    A vision-language model (``processor`` given) learns from ``images`` (each pair's encoded
    images; ``check_images`` the check pairs'): its prompts are expanded by the processor and its
    pixel tensors made per batch, as the RL trainer does. ``renderer``: how prompts become the
    model's prompt text (``engines.backends.chat``: its chat template, as RL's engines render them;
    None: as they are); ``tools``: the JSON schemas of the tools RL's episodes offer (``rollout.tools``), put in
    every prompt as the template shows them, so the model learns on the prompts RL will give it. A prompt
    is text or chat messages (``[{role, content}]``, e.g. a user turn, the model's tool call and the tool's
    result before the answer to learn).

    ``on_check``: called after every check with its figures (step, max_steps, loss, exact_match,
    seconds) instead of ``log``-ging them as a line. ``on_progress``: called with (step, max_steps, loss,
    seconds) after a step when ``progress_every_s`` have passed since the last check or progress call: a
    real model's checks may be many minutes apart."""
    optimiser = Optimiser(model, lr, seed)
    rng = optimiser.rng
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    renderer = renderer or chat.Renderer(processor or tokenizer)
    special = renderer.encode_kwargs
    prompt_ids = multimodal.PromptIds(processor, **special) if processor is not None else None
    pixel_cache = multimodal.PixelCache(processor, keep=False) if processor is not None else None

    def encode_prompt(i: int, prompt: chat.Prompt) -> list[int]:
        text = renderer.text(prompt, tools)
        return prompt_ids(text, images[i]) if processor is not None else tokenizer(text, **special)["input_ids"]

    encoded = [(encode_prompt(i, p), tokenizer(c, add_special_tokens=False)["input_ids"] + [eos], i)
               for i, (p, c) in enumerate(pairs)]
    expected = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for _, c in check]
    answer_tokens = max(len(c) for c in [c for _, c, _ in encoded] + expected)  # the longest completion, and its end
    start, loss_ema, matched, step, converged = time.perf_counter(), None, None, 0, False
    said = start  # the last check or progress call
    if resume is not None:
        optimiser.restore(resume)
        step, loss_ema, matched = resume["step"], resume["loss"], resume["exact_match"]
        converged = target is not None and matched is not None and matched >= target
        log(f"sft: continuing from step {step} (held-out exact match {_pct(matched)})")
    while step < max_steps and not converged:
        model.train()
        chunk = rng.sample(encoded, min(batch_size, len(encoded)))
        width = max(len(p) + len(c) for p, c, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (p, c, _) in enumerate(chunk):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
            attn[i, : len(p) + len(c)] = 1
        pixels = {}
        if processor is not None:  # the images, and the token types a Qwen-VL derives its positions from
            pixels = pixel_cache.batch([images[k] for _, _, k in chunk], "cpu") | multimodal.token_types(processor, ids)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels, **pixels).loss
        optimiser.step(loss)
        step += 1
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        checking = step % check_every == 0 or step == max_steps
        if on_progress is not None and not checking and time.perf_counter() - said >= progress_every_s:
            said = time.perf_counter()
            on_progress({"step": step, "max_steps": max_steps, "loss": loss_ema, "seconds": said - start})
        if checking:
            if check:
                matched = exact_match(model, tokenizer, check, answer_tokens, processor=processor, images=check_images,
                                      renderer=renderer, tools=tools)
                converged = target is not None and matched >= target
            seconds = time.perf_counter() - start
            if on_check is not None:
                on_check({"step": step, "max_steps": max_steps, "loss": loss_ema, "exact_match": matched, "seconds": seconds})
            else:
                log(f"sft step {step}/{max_steps} loss {loss_ema:.4f} held-out exact match {_pct(matched)} ({seconds:.0f}s)")
            if save is not None:
                save(optimiser.state(step=step, loss=loss_ema, exact_match=matched))
            said = time.perf_counter()
    model.eval()
    return {"steps": step, "converged": converged, "exact_match": matched, "loss": loss_ema, "seconds": time.perf_counter() - start}


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def start_model(base_dir: str | None, texts: list[str], seed: int, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 2, num_kv_heads: int = 1, init_std: float = 0.1, experts: int = 0, vision: str | None = None):
    """(model, tokenizer, processor) SFT starts from: the Hugging Face folder ``base_dir`` (a
    vision-language folder comes with its processor), or (None) a tiny model drawn with ``seed``
    over a character tokenizer that spells every character of ``texts``, with room for sequences
    twice the longest of them: a Llama, with ``experts`` a Qwen3-MoE of that many experts
    (``engines/demo/tiny_hub.py``), or with ``vision`` that vision-language family (``idefics3``,
    ``qwen2_5_vl``, ``qwen3_vl``: ``engines/demo/tiny_vision.py``; its language model has ``hidden_size``,
    ``num_layers`` and ``num_heads``). The processor is None
    for a text model."""
    if base_dir is not None:
        processor = multimodal.load_processor(base_dir)
        if processor is not None:
            from transformers import AutoModelForImageTextToText

            return AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32), processor.tokenizer, processor
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        if tokenizer.pad_token is None:  # many causal LMs ship without one; padding is masked out anyway
            tokenizer.pad_token = tokenizer.eos_token
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), tokenizer, None
    characters = set().union(*texts)
    longest = max(len(t) for t in texts) + 2  # begin and end of sequence
    max_positions = max(64, 1 << (2 * longest - 1).bit_length())
    if vision:
        from engines.demo import tiny_vision

        shape = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads, "max_positions": max_positions,
                 "seed": seed, "init_std": init_std}
        if vision == "idefics3":
            processor = tiny_vision.build_vision_processor(characters)
            model = tiny_vision.build_tiny_idefics3(processor.tokenizer, **shape)
        else:
            processor = tiny_vision.build_qwen_vl_processor(vision, characters)
            model = tiny_vision.build_tiny_qwen_vl(vision, processor.tokenizer, **shape)
        return model, processor.tokenizer, processor
    tokenizer = build_char_tokenizer(characters, [w for w in tools.MARKERS if any(w in t for t in texts)])
    if experts:
        from engines.demo.tiny_hub import build_tiny_model

        model = build_tiny_model("qwen3_moe", tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                                 num_kv_heads=num_kv_heads, max_positions=max_positions, seed=seed, init_std=init_std,
                                 experts=experts)
        return model, tokenizer, None
    model = build_tiny_llama(len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, max_positions=max_positions, seed=seed, init_std=init_std)
    return model, tokenizer, None


@torch.no_grad()
def exact_match(model, tokenizer, expected: list[tuple[str, str]], max_new_tokens: int, batch_size: int = 256,
                processor=None, images: list[list[bytes]] | None = None, renderer: chat.Renderer | None = None,
                tools: list[dict] | None = None) -> float:
    """The fraction of prompts whose greedy completion is exactly the expected one (a vision model:
    with ``processor`` and each prompt's ``images``; prompts rendered by ``renderer``, default as they are,
    with ``tools``' schemas when given)."""
    renderer = renderer or chat.Renderer(processor or tokenizer)
    model.eval()
    hits, side = 0, tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues each prompt from its last token
    suppress = multimodal.image_token_ids(processor) if processor is not None else None
    for i in range(0, len(expected), batch_size):
        rows = expected[i : i + batch_size]
        texts = [renderer.text(p, tools) for p, _ in rows]
        if processor is not None:
            batch = multimodal.model_inputs(processor, texts, images[i : i + batch_size], **renderer.encode_kwargs)
        else:  # input ids and mask only: some tokenizers add token_type_ids, which generate() refuses
            batch = tokenizer(texts, return_tensors="pt", padding=True, return_token_type_ids=False, **renderer.encode_kwargs)
        out = model.generate(
            **batch, do_sample=False, max_new_tokens=max_new_tokens, top_k=None, top_p=None, temperature=None,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, suppress_tokens=suppress,
        )
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        hits += sum(a.strip() == c.strip() for a, (_, c) in zip(answers, rows))
    tokenizer.padding_side = side
    return hits / len(expected)
