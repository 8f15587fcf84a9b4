"""A critic's value head in Hugging Face form, shared by the torch and Megatron critics.

A critic starts from a causal-LM folder (its transformer; a fresh, zero head) or from a critic a
run exported (``final/critic/``): a Hugging Face ``*ForTokenClassification`` folder with
``num_labels=1``, whose ``score`` linear (weight [1, hidden], bias [1]) is the value head. That
is the format veRL's Megatron critic loads its head from (``score.weight``), and one a user can open
with ``AutoModelForTokenClassification`` (``logits[..., 0]`` are the values) or give back to a run
as ``model.critic`` to continue training it.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHT, BIAS = "score.weight", "score.bias"
HEAD = (WEIGHT, BIAS)


def is_critic_folder(model_dir: str | Path) -> bool:
    """An exported critic (a token-classification folder), not a causal LM."""
    config = json.loads(Path(model_dir, "config.json").read_text())
    return any(a.endswith("ForTokenClassification") for a in config.get("architectures") or [])


def check_folder(model_dir: str | Path) -> None:
    """``ValueError`` naming the file and field when a token-classification folder is not a
    critic's (one label, a ``score`` with a bias); a causal-LM folder passes (its head is fresh)."""
    if not is_critic_folder(model_dir):
        return
    config = json.loads(Path(model_dir, "config.json").read_text())
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if labels != 1:
        raise ValueError(f"{model_dir}/config.json: num_labels (id2label) is {labels}; a critic's value head has 1 output")
    if not config.get("token_classification_bias", True):
        raise ValueError(f"{model_dir}/config.json: token_classification_bias is false; the critic's value head has a bias")


def read_head(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The value head (weight [1, hidden], bias [1]) of an exported critic; None for a causal LM."""
    if not is_critic_folder(model_dir):
        return None
    check_folder(model_dir)
    found: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            found |= {k: handle.get_tensor(k) for k in HEAD if k in handle.keys()}
    missing = [k for k in HEAD if k not in found]
    if missing:
        raise ValueError(f"{model_dir}: a token-classification critic folder without {missing} in its *.safetensors")
    return found[WEIGHT], found[BIAS]


def export_config(hf_config):
    """The causal LM's config as its ``*ForTokenClassification`` with one label (the value)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    config = copy.deepcopy(hf_config)
    name = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ValueError(f"model_type {config.model_type!r} has no *ForTokenClassification class in transformers")
    config.architectures = [name]
    config.num_labels = 1  # transformers writes id2label/label2id from it
    return config


def save_folder(local_dir: str, hf_config, tensors: dict[str, torch.Tensor], tokenizer) -> None:
    """An exported critic: config.json (``export_config``), model.safetensors (the transformer's
    Hugging Face names and ``score.*``), the tokenizer. ``local_dir`` is staged: the caller uploads
    it with its manifest last (``objectstore.upload_folder``)."""
    if not set(HEAD) <= tensors.keys():
        raise ValueError(f"a critic export needs {HEAD}")
    os.makedirs(local_dir, exist_ok=True)
    export_config(hf_config).save_pretrained(local_dir)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(local_dir, "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(local_dir)
