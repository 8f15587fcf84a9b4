"""LoRA on the torch trainer (``train.lora``, ``engines/backends/torch/lora.py``).

- Only the adapter requires gradients and is in AdamW; a train step changes adapter tensors only.
- The weights sent to the rollout engine are peft's ``merge_and_unload`` weights, bit for bit, under
  the base model's names; a torch generator synced with them answers as the exported merged model.
- The KL reference is the base (adapter disabled): no second model.
- A checkpoint holds the adapter (and its optimizer state), records the base; a resume continues
  exactly, and refuses another base folder.
- Export writes an adapter folder peft loads and, with ``export_merged``, a merged folder
  transformers loads alone.
- A target that matches no module fails validation (before any engine loads), naming the field;
  LoRA with the Megatron trainer fails config validation with the reason.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import random_batch, save_tiny_model, with_old_logprobs

from engines.backends.base import load_weights
from engines.backends.torch import lora
from engines.backends.torch.generator import TorchGenerator
from engines.backends.torch.model import sequence_logprobs
from engines.backends.torch.trainer import TorchTrainer
from engines.config import ConfigError, RunConfig, load_config
from engines.config.train import LoraConfig
from engines.rl.grpo import GRPOConfig
from engines.host import validation
from engines.host.checkpointing import Checkpoints
from engines.host.worker import Worker
from engines.wire.commands import Checkpoint, CheckpointWait, ExportPolicy
from storage import objectstore

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("lora") / "policy", num_layers=2)


def make_trainer(policy: str, seed: int = 0, **kwargs) -> TorchTrainer:
    return TorchTrainer(policy, lr=1e-2, lora=LoraConfig(**LORA), seed=seed, **kwargs)  # seed: the adapter's initialisation


def train_once(trainer: TorchTrainer, seed: int, kl_coef: float = 0.0) -> dict:
    batch = random_batch(6, seed=seed)
    return trainer.train_step(with_old_logprobs(batch, trainer.logprobs(batch), noise=0.3, seed=seed),
                              GRPOConfig(kl_coef=kl_coef), minibatches=2)


def test_only_the_adapter_trains(policy):
    torch.set_num_threads(1)
    trainer = make_trainer(policy)
    params = dict(trainer.model.named_parameters())
    trained = {name for name, p in params.items() if p.requires_grad}
    assert trained and all(lora.is_adapter(name) for name in trained)
    assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trained} == set(LORA["target_modules"])
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(params[name]) for name in trained}
    before = {name: p.detach().clone() for name, p in params.items()}
    train_once(trainer, seed=1)
    changed = {name for name, p in params.items() if not torch.equal(p, before[name])}
    assert changed and changed <= trained and any(".lora_A." in n for n in changed) and any(".lora_B." in n for n in changed)
    # the optimizer state is adapter-sized: two moments per adapter parameter, nothing for the base
    moments = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in trainer.optimizer.state.values())
    assert moments == 2 * sum(params[name].numel() for name in trained)
    assert moments < sum(p.numel() for p in params.values()) / 4


def test_the_adapter_starts_from_the_seed_on_every_replica(policy):
    """DP replicas (hosts whose RNGs differ) start from the same adapter, and building it draws nothing
    from the process's RNG (the run's streams stay where a resume puts them)."""
    torch.manual_seed(1)
    state = torch.get_rng_state()
    a = lora.adapter_state(make_trainer(policy, seed=7).model)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(2)
    b = lora.adapter_state(make_trainer(policy, seed=7).model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = lora.adapter_state(make_trainer(policy, seed=8).model)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_rollout_weights_are_the_merged_model(policy):
    trainer = make_trainer(policy)
    train_once(trainer, seed=2)
    sent = dict(trainer.export_weights())
    base_names = [name for name, _ in TorchGenerator(policy).model.named_parameters()]
    assert list(sent) == base_names  # the base model's names, no peft prefixes
    reference = dict(copy.deepcopy(trainer.model).merge_and_unload().named_parameters())
    assert sent.keys() == reference.keys() and all(torch.equal(sent[k], reference[k]) for k in sent)
    adapted = [k for k in sent if ".q_proj." in k]
    assert adapted and all(not torch.equal(sent[k], dict(trainer.model.get_base_model().named_parameters())
                                           [k.replace(".weight", ".base_layer.weight")]) for k in adapted)


def test_kl_reference_is_the_base_with_the_adapter_disabled(policy):
    trainer = make_trainer(policy, reference=True)
    assert trainer.reference is None  # no second copy of the policy
    train_once(trainer, seed=3)
    stats = train_once(trainer, seed=4, kl_coef=0.1)
    assert stats["kl_reference"] > 0
    base = TorchGenerator(policy).model
    ids = torch.tensor([random_batch(1, seed=5).prompt_ids[0] + [7, 8, 9]])
    attn = torch.ones_like(ids)
    with torch.no_grad(), trainer._reference() as reference:
        ref = sequence_logprobs(reference, ids, attn, 1.0)
    assert trainer.model.training  # back in train mode after the block
    assert torch.allclose(ref, sequence_logprobs(base, ids, attn, 1.0).detach(), atol=1e-6)
    with torch.no_grad():
        adapted = sequence_logprobs(trainer.model.eval(), ids, attn, 1.0)  # eval: no adapter dropout
    assert not torch.allclose(ref, adapted, atol=1e-6)  # the adapter has moved the policy off its base


# ---------------------------------------------------------------- checkpoints and export


@pytest.fixture
def host(policy, tmp_path):
    """An engine host's worker with a LoRA torch trainer, without the rest of ``setup_engines``."""
    torch.set_num_threads(1)
    h = Worker(rank=0, world=1, threads=1, config=RunConfig.model_validate({"dp": 1, "train": {"lora": LORA | {"export_merged": True}}}),
               trainer=make_trainer(policy), checkpoints=Checkpoints(0, "torch", [["part-00000.parquet", 8]]))
    train_once(h.trainer, seed=1)  # Adam moments exist
    return h


def live_state(trainer: TorchTrainer) -> dict:
    return copy.deepcopy(trainer._live_state())


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_checkpoint_holds_the_adapter_and_resume_is_exact(host, policy, tmp_path):
    uri = objectstore.normalize(str(tmp_path / "ckpt"))
    expected = live_state(host.trainer)
    host.checkpoint(Checkpoint(uri=uri))
    files = host.checkpoint_wait(CheckpointWait()).files
    assert {"trainer-torch/trainer.pt", "model/adapter_config.json", "model/adapter_model.safetensors"} <= set(files)
    assert "model/model.safetensors" not in files  # not the full model
    local = Path(objectstore.fs_for(uri)[1])
    saved = torch.load(local / "trainer-torch" / "trainer.pt", weights_only=True)
    assert saved["model"] and all(lora.is_adapter(k) for k in saved["model"])
    assert saved["lora"]["policy"] == policy and saved["lora"]["rank"] == LORA["rank"]
    assert_same(saved, expected)  # adapter, its AdamW state, version, base: as at save time
    adapter = load_file(str(local / "model" / "adapter_model.safetensors"))  # peft's names: no adapter name
    assert adapter.keys() == {k.replace(".default", "") for k in saved["model"]}
    assert all(torch.equal(adapter[k.replace(".default", "")], v) for k, v in saved["model"].items())
    train_once(host.trainer, seed=5)  # the uninterrupted run (dropout draws from the RNG the checkpoint restores)
    resumed = make_trainer(policy, seed=9)  # another initial adapter, replaced by the checkpoint's
    host.checkpoints.load(resumed, uri)
    train_once(resumed, seed=5)
    assert_same(live_state(resumed), live_state(host.trainer))
    assert_same(dict(resumed.export_weights()), dict(host.trainer.export_weights()))

    other_base = save_tiny_model(tmp_path / "other", num_layers=2, seed=3)
    with pytest.raises(ValueError, match="model.policy: .*other is not the base model checkpoint"):
        host.checkpoints.load(make_trainer(other_base), uri)
    with pytest.raises(ValueError, match="train.lora: checkpoint .* was trained with LoRA"):
        host.checkpoints.load(TorchTrainer(policy), uri)
    wider = TorchTrainer(policy, lora=LoraConfig(**LORA | {"rank": 8}))
    with pytest.raises(ValueError, match="train.lora.rank: checkpoint .* was trained with 4, the config now says 8"):
        host.checkpoints.load(wider, uri)


def test_export_writes_a_loadable_adapter_and_merged_model(host, policy, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    uri = objectstore.normalize(str(tmp_path / "final"))
    host.export_policy(ExportPolicy(uri=uri))
    final = Path(objectstore.fs_for(uri)[1])
    assert json.loads((final / "adapter_config.json").read_text())["r"] == LORA["rank"]
    assert all(lora.is_adapter(k) for k in load_file(str(final / "adapter_model.safetensors")))
    sent = dict(host.trainer.export_weights())
    merged = AutoModelForCausalLM.from_pretrained(str(final / "merged"))  # transformers alone
    assert all(torch.equal(p, sent[name]) for name, p in merged.named_parameters())
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy), str(final)).merge_and_unload()
    assert all(torch.equal(p, sent[name]) for name, p in adapted.named_parameters())

    # the rollout engine after a sync answers as the exported merged model
    synced = TorchGenerator(policy)
    load_weights(synced, host.trainer.export_weights())
    prompts = ["ab", "hello", "xyz"]
    out = synced.generate(prompts, greedy=True, max_new_tokens=6)
    expected = TorchGenerator(str(final / "merged")).generate(prompts, greedy=True, max_new_tokens=6)
    assert [g.response_ids for g in out] == [g.response_ids for g in expected]


@pytest.mark.parametrize("freeze", [True, False])
def test_lora_on_a_vision_language_policy(tmp_path, freeze):
    """Idefics3: with freeze_vision the vision encoder gets no adapter (and its weights stay as they
    are); without, it gets one too. A step with images trains the adapter, and the merged weights
    carry the base model's names."""
    from engines.backends.base import TrainBatch
    from engines.demo import vision
    from test_vision import save_tiny_vlm

    vlm = save_tiny_vlm(tmp_path / "vlm")
    rows = vision.make_problems(2, 3)
    gens = TorchGenerator(vlm).generate([p for p, *_ in rows], n=2, max_new_tokens=6, seed=2, images=[im for _, im, *_ in rows])
    trainer = TorchTrainer(vlm, lr=1e-2, freeze_vision=freeze, lora=LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    adapted = {n.split(".lora_")[0] for n, p in trainer.model.named_parameters() if p.requires_grad}
    in_tower = {n for n in adapted if "vision_model" in n.split(".")}
    assert adapted - in_tower and (not in_tower if freeze else in_tower)
    batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                       [1.0, -1.0] * (len(gens) // 2), images=[rows[g.prompt_index][1] for g in gens])
    assert trainer.train_step(batch, minibatches=2)["tokens"] > 0
    sent = dict(trainer.export_weights())
    assert list(sent) == [n for n, _ in TorchGenerator(vlm).model.named_parameters()]


# ---------------------------------------------------------------- bad input


def test_a_target_matching_no_module_fails_validation_naming_the_field(policy, tmp_path):
    config = RunConfig.model_validate({"dp": 1, "model": {"policy": policy}, "reward": {"genrm_weight": 0, "rule_weight": 1},
                                       "train": {"lora": {"target_modules": ["q_proj", "qkv_proj"]}}})
    with pytest.raises(validation.InputError, match=rf"train.lora.target_modules \(model.policy .*{Path(policy).name}\): "
                                                    r"'qkv_proj' matches no module; its adaptable modules .*'q_proj'"):
        validation.validate_inputs(config)
    config.train.lora = LoraConfig(target_modules=["self_attn"])  # a module LoRA cannot adapt
    with pytest.raises(validation.InputError, match="'self_attn' matches only modules LoRA cannot adapt"):
        validation.check_lora_targets(config, policy)
    from engines.demo.tiny_hub import save_tiny_hub_model

    qwen3 = str(save_tiny_hub_model("qwen3", tmp_path / "qwen3"))  # input and output embeddings tied
    config.train.lora = LoraConfig(target_modules=["q_proj", "lm_head"])
    with pytest.raises(validation.InputError, match="'lm_head' matches lm_head, whose weight is tied to model.embed_tokens"):
        validation.check_lora_targets(config, qwen3)


def test_lora_with_the_megatron_trainer_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="train.lora: LoRA is not implemented for train.backend=megatron: .*Megatron-Core"):
        load_config(None, ["train.backend=megatron", "train.lora.rank=8"])
    assert load_config(None, ["train.lora.rank=16"]).train.lora.rank == 16
    assert load_config(None, []).train.lora is None


# ---------------------------------------------------------------- a whole run


def test_a_lora_run_resumes_exactly_and_exports_adapter_and_merged_model(prepared):
    """Real runs (dp=2: the replicas' adapters must stay equal, a checkpoint every step): 2 steps in
    one go, and 1 step then the same run raised to 2 (it resumes from step 0's checkpoint, which holds
    the adapter only): the same samples and rewards every step, the same final adapter and merged model."""
    import asyncio

    from flows.training import train
    from tests.helpers import TINY
    from tests.helpers import trained

    common = [*TINY, "dp=2", "checkpoint.every=1", "data.heldout=null", f"storage.root={prepared}", "train.lora.rank=4",
              "train.lora.dropout=0.05", "train.lora.export_merged=true"]
    asyncio.run(train(overrides=[*common, "steps=2", "name=lora-reference"]))
    asyncio.run(train(overrides=[*common, "steps=1", "name=lora-resumed"]))
    asyncio.run(train(overrides=[*common, "steps=2", "name=lora-resumed"]))
    runs = Path(prepared) / "runs"
    want, got = trained(runs / "lora-reference"), trained(runs / "lora-resumed")
    assert sorted(want) == [0, 1] and got == want
    checkpoint = runs / "lora-resumed" / "checkpoints" / "000000"
    assert (checkpoint / "model" / "adapter_config.json").exists() and not (checkpoint / "model" / "model.safetensors").exists()
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        a, b = load_file(str(runs / "lora-resumed" / "final" / name)), load_file(str(runs / "lora-reference" / "final" / name))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), name
