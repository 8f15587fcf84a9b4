"""LoRA on the torch trainer (``train.lora``), through ``peft``.

The policy is wrapped in a ``peft.PeftModel``: every base weight is frozen, and each target module
(``train.lora.target_modules``) gets an adapter ``B A`` (rank r) scaled by alpha / r. So:

* only adapter parameters require gradients and go into AdamW: the optimizer state is
  adapter-sized (``adapter_state``);
* the KL reference is the same model with the adapter disabled (``base_model_of``): no second copy;
* the rollout engine receives merged weights, W + B A * alpha / r, under the base model's Hugging
  Face names (``merged``: one adapted layer at a time, never a merged copy of the whole model);
* a checkpoint holds the adapter, its optimizer state and the policy folder it adapts
  (``base_record``; a resume refuses another base: ``check_base``);
* export writes the adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) and,
  on request, the merged model (``merged_state_dict``).

Validation before any engine loads (``engines/host/validation.py``) checks every target against the
policy's modules built on the meta device (``unmatched_targets``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from engines.backends.torch.fsdp import full
from engines.backends.torch.model import VISION_TOWER_PATTERN, is_vision_tower

ADAPTER = "default"  # peft's name for the one adapter
ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def adaptable(module: torch.nn.Module) -> bool:
    """A module type peft's LoRA can adapt (transformers' GPT-2-style ``Conv1D`` too)."""
    return isinstance(module, ADAPTABLE) or type(module).__name__ == "Conv1D"


def matches(name: str, target: str) -> bool:
    """peft's rule for a list of targets: the module's dotted name is the target or ends with '.' + target."""
    return name == target or name.endswith("." + target)


def unmatched_targets(model: torch.nn.Module, targets: list[str], freeze_vision: bool) -> dict[str, str]:
    """The entries of ``targets`` that would adapt nothing, or adapt wrongly, each with why: no
    module of ``model`` has that name (the vision encoder left out under ``freeze_vision``), only
    modules LoRA cannot adapt do, or one it matches shares its weight with another module (tied
    input and output embeddings: the adapter would change one use of the weight, and a merged weight
    both). ``model`` may live on the meta device."""
    modules = [(n, m) for n, m in model.named_modules() if n and not (freeze_vision and is_vision_tower(n))]
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    problems = {}
    for target in targets:
        hits = [(n, m) for n, m in modules if matches(n, target)]
        tied = [(n, other) for n, m in hits if adaptable(m) and getattr(m, "weight", None) is not None
                for other in owners.get(id(m.weight), []) if other != n]
        if not hits:
            problems[target] = "matches no module"
        elif not any(adaptable(m) for _, m in hits):
            kinds = sorted({type(m).__name__ for _, m in hits})
            problems[target] = f"matches only modules LoRA cannot adapt ({', '.join(kinds)}; e.g. {hits[0][0]})"
        elif tied:
            problems[target] = (f"matches {tied[0][0]}, whose weight is tied to {tied[0][1]}'s (tie_word_embeddings): "
                                "an adapter on one use of a shared weight cannot be merged into it")
    return problems


def adaptable_names(model: torch.nn.Module, freeze_vision: bool) -> list[str]:
    """The last names of the modules LoRA could adapt (for an error message: what to pick from)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if n and adaptable(m) and not (freeze_vision and is_vision_tower(n))})


def wrap(model: torch.nn.Module, lora, freeze_vision: bool, seed: int = 0):
    """``model`` as a ``peft.PeftModel`` with a fresh adapter (``lora``: ``engines.config.train.LoraConfig``
    or anything with its fields); every base weight frozen. A target that adapts nothing is an error.

    The adapter's random initialisation (``lora_A``; ``lora_B`` starts at zero, so the policy starts
    as its base) is drawn from ``seed``, not from the process's RNG: every DP replica starts with the
    same adapter, and the RNG streams of the run are not moved."""
    from peft import LoraConfig, get_peft_model

    problems = unmatched_targets(model, lora.target_modules, freeze_vision)
    if problems:
        raise ValueError(f"train.lora.target_modules: {problems}; adaptable modules: {adaptable_names(model, freeze_vision)}")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
                        exclude_modules=VISION_TOWER_PATTERN if freeze_vision else None, bias="none")
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def is_adapter(name: str) -> bool:
    """A parameter (or state) name of the adapter itself: ``lora_A``, ``lora_B``, ``lora_embedding_A`` ..."""
    return any(part.startswith("lora_") for part in name.split("."))


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the peft model's own names (``...q_proj.lora_A.default.weight``):
    what a checkpoint holds instead of the model."""
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}


def check_adapter_state(model, state: dict[str, torch.Tensor], where: str) -> None:
    """A checkpoint's adapter tensors are ``model``'s adapter's (the same names, all of them)."""
    ours = set(adapter_state(model))
    if set(state) != ours:
        raise ValueError(f"{where}: the checkpoint's adapter tensors differ from this run's (only in the checkpoint: "
                         f"{sorted(set(state) - ours)[:4]}, only here: {sorted(ours - set(state))[:4]})")


def merged(model, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (tensors of ``model.get_base_model()``, the transformers model holding the LoRA
    layers) with the adapter merged in: each adapted weight W becomes W + B A * alpha / r (peft's
    ``get_delta_weight``, what ``merge_and_unload`` adds), named as in the base model (no
    ``base_layer``), and the adapter's own tensors left out. One layer's delta at a time; a model
    sharded with FSDP2 gives each tensor and delta whole (collectives, in the same order on every rank)."""
    layers = dict(model.get_base_model().named_modules())
    for name, tensor in named:
        if is_adapter(name):
            continue
        tensor = full(tensor)
        if ".base_layer." in name:
            owner, leaf = name.rsplit(".base_layer.", 1)
            name = f"{owner}.{leaf}"
            if leaf == "weight":
                with torch.no_grad():
                    tensor = tensor + full(layers[owner].get_delta_weight(ADAPTER)).to(tensor.dtype)
        yield name, tensor.detach()


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole merged model's state dict (tied weights under each of their names): a Hugging Face
    folder of the base model's architecture with it loads without peft."""
    return dict(merged(model, model.get_base_model().state_dict().items()))


@contextlib.contextmanager
def eval_mode(model):
    """``model`` in eval mode (no adapter dropout) for the duration of the block."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def base_model_of(model):
    """The KL reference: ``model`` with its adapter disabled, in eval mode (as a separately loaded
    reference would be), for the duration of the block."""
    with eval_mode(model), model.disable_adapter():
        yield model


def base_record(model_dir: str, lora) -> dict:
    """What a checkpoint records of the base its adapter belongs to: the policy folder, a fingerprint
    of its files, and the adapter's shape (rank, alpha, targets)."""
    return {"policy": str(model_dir), "fingerprint": folder_fingerprint(model_dir), "rank": lora.rank,
            "alpha": float(lora.alpha), "target_modules": list(lora.target_modules)}


def check_base(recorded: dict, now: dict, checkpoint: str) -> None:
    """A resume adapts the base the checkpoint's adapter was trained on, with the same adapter shape."""
    if recorded["fingerprint"] != now["fingerprint"]:
        raise ValueError(
            f"model.policy: {now['policy']} is not the base model checkpoint {checkpoint} was trained on ({recorded['policy']}, "
            f"fingerprint {recorded['fingerprint'][:12]}; this folder's is {now['fingerprint'][:12]}): a LoRA checkpoint holds "
            "only the adapter, so resume with the same policy folder")
    for key in ("rank", "alpha", "target_modules"):
        if recorded[key] != now[key]:
            raise ValueError(f"train.lora.{key}: checkpoint {checkpoint} was trained with "
                             f"{recorded[key]!r}, the config now says {now[key]!r}")


def folder_fingerprint(model_dir: str, sample: int = 1 << 20) -> str:
    """A cheap fingerprint of a Hugging Face folder: config.json, and each weight file's name, size,
    first and last MiB (another checkpoint of the same architecture differs there)."""
    h = hashlib.sha256()
    folder = Path(model_dir)
    h.update((folder / "config.json").read_bytes())
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(sample))
            f.seek(max(size - sample, 0))
            h.update(f.read(sample))
    return h.hexdigest()


def save_adapter(model, local_dir: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter folder (``adapter_config.json``, ``adapter_model.safetensors``): loadable with
    ``peft.PeftModel.from_pretrained(base, local_dir)``, or ``AutoModelForCausalLM.from_pretrained``
    with peft installed (it loads the base from ``base_model_name_or_path``). ``tensors``: adapter
    tensors taken earlier (``adapter_state``) instead of the live ones."""
    os.makedirs(local_dir, exist_ok=True)
    model.save_pretrained(local_dir, state_dict=dict(tensors) if tensors is not None else None)
