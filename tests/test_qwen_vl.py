"""The Qwen-VL family on the CPU's torch engines: a tiny random Qwen2.5-VL and Qwen3-VL
(engines/demo/tiny_vision.py) saved as Hugging Face folders, their processors loaded back for
images only (``multimodal.images_only``: the video processor needs torchvision, which has no build
for the CPU torch here), rolled out with two images per prompt and trained, the trainer's
log-probabilities of the sampled tokens equal to the rollout's."""

from __future__ import annotations

import pytest
import torch

from engines.backends import multimodal
from engines.backends.base import TrainBatch
from engines.backends.torch.generator import TorchGenerator
from engines.backends.torch.trainer import TorchTrainer
from engines.demo import vision
from engines.demo.tiny_vision import PLACEHOLDERS, build_qwen_vl_processor, build_tiny_qwen_vl


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_rolls_out_and_trains_with_two_images_per_prompt(tmp_path, family, monkeypatch):
    processor = build_qwen_vl_processor(family, "0123456789+=sum:")
    build_tiny_qwen_vl(family, processor.tokenizer, seed=0, init_std=0.1).save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    pictures = [im for _, ims, *_ in vision.make_problems(4, seed=0) for im in ims]
    images = [[pictures[i], pictures[(i + 1) % 4]] for i in range(3)]  # two pictures per prompt, each in two prompts
    prompt = PLACEHOLDERS[family] * 2 + "sum:"

    generator = TorchGenerator(str(tmp_path))
    assert type(generator.processor).__name__.endswith("ImagesOnly")  # loaded from the folder without torchvision
    gens = generator.generate([prompt] * 3, n=2, max_new_tokens=6, seed=1, images=images)
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert all(g.prompt_ids.count(image_token) == 2 * 4 for g in gens)  # each 56-pixel picture: 4 tokens after the merge
    trainer = TorchTrainer(str(tmp_path))
    batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                       [1.0, -1.0] * 3, images=[images[g.prompt_index] for g in gens])
    ref = trainer.logprobs(batch)
    gap = max(abs(a - b) for g, r in zip(gens, ref) for a, b in zip(g.logprobs, r))
    assert gap < 2e-5, gap

    # the 3-D rotary positions are what makes them equal: without the token types Qwen2.5-VL falls back
    # to 1-D positions (what the trainer computed before it passed them: 3e-3 apart on an H200), Qwen3-VL refuses
    with monkeypatch.context() as m:
        m.setattr(multimodal, "token_types", lambda processor, input_ids: {})
        if family == "qwen3_vl":
            with pytest.raises(ValueError, match="mm_token_type_ids"):
                trainer.logprobs(batch)
        else:
            flat = trainer.logprobs(batch)
            assert max(abs(a - b) for g, r in zip(gens, flat) for a, b in zip(g.logprobs, r)) > 100 * max(gap, 1e-6)

    stats = trainer.train_step(TrainBatch(batch.prompt_ids, batch.response_ids, ref, batch.advantages, images=batch.images))
    assert stats["tokens"] == sum(len(g.response_ids) for g in gens) and stats["grad_norm"] > 0
    after = trainer.logprobs(batch)
    assert max(abs(a - b) for r, s in zip(ref, after) for a, b in zip(r, s)) > 1e-4  # the step moved the policy

    # the trained policy saved as a folder (weights and the images-only processor) is a rollout engine's again
    trainer.save_hf(str(tmp_path / "trained"))
    reloaded = TorchGenerator(str(tmp_path / "trained"))
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, params[name]) for name, p in reloaded.model.named_parameters())
    again = reloaded.generate([prompt] * 3, n=2, max_new_tokens=6, seed=1, images=images)
    assert [g.prompt_ids for g in again] == [g.prompt_ids for g in gens]


@pytest.mark.parametrize("backends, message", [
    (("vllm", "torch"), r"model\.policy: .*config\.json: model_type 'qwen2_5_vl': vLLM's Qwen-VL modules import torchvision"),
    (("torch", "megatron"), r"train\.backend=megatron: .* model_type 'qwen2_5_vl'.*Qwen-VL's 3-D rotary positions"),
])
def test_qwen2_5_vl_is_refused_before_engines_load_where_it_cannot_run(tmp_path, backends, message):
    import pyarrow as pa

    from engines.config import load_config
    from engines.host import validation
    from storage import datasets

    if torch.cuda.is_available() and backends[0] == "vllm":
        pytest.skip("vLLM on a GPU machine with torchvision loads Qwen2.5-VL")
    processor = build_qwen_vl_processor("qwen2_5_vl", "0123456789+=sum:")
    build_tiny_qwen_vl("qwen2_5_vl", processor.tokenizer).save_pretrained(tmp_path / "policy")
    processor.save_pretrained(tmp_path / "policy")
    prompt, images, answer, _ = vision.make_problems(1, seed=0, placeholder=PLACEHOLDERS["qwen2_5_vl"])[0]
    prompts = str(tmp_path / "prompts.parquet")
    datasets.write_table(prompts, pa.Table.from_pylist([{"prompt_id": 1, "prompt": prompt, "answer": answer, "images": images}]),
                         datasets.PROMPTS)
    config = load_config(None, [f"storage.root={tmp_path}", f"model.policy={tmp_path / 'policy'}", f"data.prompts={prompts}",
                                "data.heldout=null", "reward.genrm_weight=0", "reward.rule_weight=1",
                                f"rollout.backend={backends[0]}", f"train.backend={backends[1]}"])
    with pytest.raises(validation.InputError, match=message):
        validation.validate_inputs(config)
    validation.validate_inputs(config.model_copy(update={"rollout": config.rollout.model_copy(update={"backend": "torch"}),
                                                         "train": config.train.model_copy(update={"backend": "torch"})}))
