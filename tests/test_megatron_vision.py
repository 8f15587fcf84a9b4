"""The Megatron trainer on a vision-language model: the tiny Idefics3 (SmolVLM's architecture) as
the Hugging Face vision tower and connector beside a Megatron-Core GPT (engines/backends/megatron/vision.py).

``TorchTrainer`` (transformers) is the reference, as in test_megatron.py, whose CPU shim this uses:
log-probabilities of a batch with images (two images in some prompts, rows of unequal image
counts) agree to 1e-5 in fp32; one train step leaves the same parameters, connector included,
and the frozen vision tower untouched; the Hugging Face folder the trainer saves loads in
TorchTrainer with the same log-probabilities; checkpoints and sleep/wake carry the connector.
"""

from __future__ import annotations

import random

import pytest

import megatron_cpu

megatron_cpu.install()  # before Megatron is imported: its modules are patched as they load
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

from engines.backends import multimodal  # noqa: E402
from engines.backends.base import TrainBatch  # noqa: E402
from engines.backends.megatron.trainer import MegatronTrainer  # noqa: E402
from engines.backends.torch.trainer import TorchTrainer  # noqa: E402
from engines.demo import vision  # noqa: E402
from engines.demo.tiny_vision import build_tiny_idefics3, build_vision_processor  # noqa: E402
from tests.helpers import STEP_RTOL, parity, step_gap  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

ATOL = 1e-5
# Parameters after a step: AdamW's first step moves each weight by about lr * g / (|g| + eps), so
# gradients of ~1e-8 (there are thousands here, born of cancellation) turn summation-order
# differences (Megatron fuses Q/K/V and gate/up) into elementwise weight differences that depend on
# the CPU's kernels; the step as a whole is compared instead (tests/helpers.py: step_gap, STEP_RTOL),
# and the gradients themselves, relative to each tensor's largest.
HYPER = {"lr": 1e-3, "betas": (0.8, 0.95), "weight_decay": 0.1, "grad_clip": 0.5}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny Idefics3 folder; Megatron in this process: a world of one, torn down afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("megatron-vlm") / "policy"
    processor = build_vision_processor("0123456789+=sum:")
    build_tiny_idefics3(processor.tokenizer, seed=0, init_std=0.1).save_pretrained(str(path))
    processor.save_pretrained(str(path))
    yield str(path)
    torch.set_num_threads(threads)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def vision_batch(model_dir: str, n: int, seed: int) -> TrainBatch:
    """``n`` sequences of expanded prompts with one or two images each and random responses."""
    processor = multimodal.load_processor(model_dir)
    expand = multimodal.PromptIds(processor)
    banned = set(multimodal.image_token_ids(processor))
    allowed = [i for i in range(len(processor.tokenizer)) if i not in banned and i != processor.tokenizer.pad_token_id]
    rng = random.Random(seed)
    problems = vision.make_problems(2 * n, seed)
    prompts, responses, images = [], [], []
    for k in range(n):
        two = k % 3 == 1
        row = problems[2 * k][1] + (problems[2 * k + 1][1] if two else [])
        text = vision.PROMPT * (2 if two else 1) + "+" * rng.randint(0, 3)
        prompts.append(expand(text, row))
        responses.append([rng.choice(allowed) for _ in range(rng.randint(2, 7))])
        images.append(row)
    advantages = [rng.uniform(-1.5, 1.5) for _ in range(n)]
    return TrainBatch(prompts, responses, [[0.0] * len(r) for r in responses], advantages, images=images)


def near(batch: TrainBatch, logprobs, noise: float = 0.5, seed: int = 0) -> TrainBatch:
    rng = random.Random(seed)
    old = [[lp + rng.uniform(-noise, noise) for lp in row] for row in logprobs]
    return TrainBatch(batch.prompt_ids, batch.response_ids, old, batch.advantages, images=batch.images)


def lp_diff(a, b) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def megatron_grads(trainer: MegatronTrainer) -> dict:
    """The gradients Megatron's optimizer stepped with (DDP's ``main_grad``, clipped), by Hugging Face name."""
    from engines.backends.megatron import vision as megatron_vision
    from engines.backends.megatron.mapping import _param_to_hf

    out = {}
    for name, p in trainer.model.module.named_parameters():
        if not p.requires_grad:
            continue
        hf = megatron_vision.hf_name(name)
        if hf is not None:
            out[hf] = p.main_grad.detach().clone()
            continue
        out.update({megatron_vision.to_vlm_name(k): t for k, t in _param_to_hf(name, [p.main_grad.detach()], trainer.text_config).items()})
    return out


def test_vlm_logprobs_match_torch_trainer(vlm):
    megatron, reference = MegatronTrainer(vlm), TorchTrainer(vlm)
    batch = vision_batch(vlm, 6, seed=1)
    assert any(len(row) == 2 for row in batch.images) and any(len(row) == 1 for row in batch.images)
    ours = megatron.logprobs(batch)
    diff = lp_diff(ours, reference.logprobs(batch))
    print(f"\nlog-prob max |Megatron - TorchTrainer| = {diff:.2e}")
    assert diff <= ATOL
    # the images are really used: other pictures, other log-probabilities
    shuffled = TrainBatch(batch.prompt_ids, batch.response_ids, batch.old_logprobs, batch.advantages,
                          images=[vision_batch(vlm, 6, seed=2).images[i] for i in range(6)])
    assert lp_diff(ours, megatron.logprobs(shuffled)) > 1e-3
    # the full Idefics3 state under Hugging Face names, equal to the folder's
    assert max_diff(dict(megatron.export_weights()), {k: v.detach() for k, v in reference.export_weights()}) == 0


def test_vlm_train_step_checkpoint_sleep_and_save_hf(vlm, tmp_path):
    megatron, reference = MegatronTrainer(vlm, **HYPER), TorchTrainer(vlm, **HYPER)
    batch = near(vision_batch(vlm, 8, seed=3), reference.logprobs(vision_batch(vlm, 8, seed=3)))
    before = {k: v.clone() for k, v in reference.export_weights()}
    kwargs = {"minibatches": 1, "micro_batch_tokens": 64}  # several passes, accumulated
    stats, ref_stats = megatron.train_step(batch, **kwargs), reference.train_step(batch, **kwargs)
    grads, ref_grads = megatron_grads(megatron), {n: p.grad for n, p in reference.model.named_parameters() if p.requires_grad}
    assert grads.keys() == ref_grads.keys() and any(".connector." in k for k in grads)
    assert not any(".vision_model." in k for k in grads)
    grad_diff = max(float((grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()) for k in grads)
    after, ref_after = dict(megatron.export_weights()), {k: v.detach() for k, v in reference.export_weights()}
    assert parity("idefics3 megatron vs torch trainer: clipped gradients / their largest", grad_diff) <= ATOL
    assert parity("idefics3 megatron vs torch trainer: step", step_gap(after, ref_after, before)) <= STEP_RTOL
    connector = [k for k in after if ".connector." in k]
    tower = [k for k in after if ".vision_model." in k]
    text = [k for k in after if ".text_model." in k or k == "lm_head.weight"]
    assert connector and tower and text and len(connector) + len(tower) + len(text) == len(after)
    assert max(float((after[k] - before[k]).abs().max()) for k in connector) > 100 * ATOL  # the connector trained
    assert max(float((after[k] - before[k]).abs().max()) for k in text) > 100 * ATOL
    assert all(torch.equal(after[k], before[k]) for k in tower)  # frozen (train.freeze_vision's default)
    assert stats["grad_norm"] > HYPER["grad_clip"]  # clipping was active, over the joint norm (connector included)
    for key in ("loss", "clip_fraction", "tokens", "grad_norm"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-6, abs=1e-5), key  # a grad norm of ~50 is 1e-5 apart on plain kernels

    probe = vision_batch(vlm, 4, seed=4)
    expected = megatron.logprobs(probe)

    # checkpoint: model (connector and tower included) and optimizer, loaded into a fresh trainer
    megatron.save_checkpoint(str(tmp_path / "ckpt"))
    restored = MegatronTrainer(vlm, **HYPER)
    restored.load_checkpoint(str(tmp_path / "ckpt"))
    assert max_diff(dict(restored.export_weights()), after) == 0
    # the optimizer state came back too: the next step is the same on both
    nxt = near(probe, expected, seed=5)
    megatron.train_step(nxt)
    restored.train_step(nxt)
    assert max_diff(dict(restored.export_weights()), dict(megatron.export_weights())) == 0
    del restored
    expected = megatron.logprobs(probe)
    exported = dict(megatron.export_weights())

    # sleep moves the Hugging Face modules' tensors too; export reads the host copy; wake restores them
    moved = megatron.sleep()
    assert moved > 0 and all(p.untyped_storage().nbytes() == 0 for p in megatron.model.module.hf_vision.parameters())
    asleep = dict(megatron.export_weights())
    assert max_diff(asleep, exported) == 0
    megatron.wake()
    assert megatron.logprobs(probe) == expected

    # the Hugging Face folder: the whole Idefics3 under its names, the processor, loadable by torch
    megatron.save_hf(str(tmp_path / "hf"))
    loaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"))
    assert loaded.state_dict().keys() == exported.keys()
    assert multimodal.load_processor(str(tmp_path / "hf")).image_seq_len == multimodal.load_processor(vlm).image_seq_len
    diff = lp_diff(TorchTrainer(str(tmp_path / "hf")).logprobs(probe), expected)
    print(f"saved folder in TorchTrainer: max |log-prob difference| = {diff:.2e}")
    assert diff <= ATOL


# --- two processes over gloo: TP=2 (tower and connector replicated), PP=2 (tower and connector on the first
# stage), DP=2 (connector all-reduced) ---


def _worker(rank: int, port: int, model_dir: str, cases_file: str, out: str) -> None:
    import os
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        cases = torch.load(cases_file, weights_only=False)
        trainer = MegatronTrainer(model_dir, **HYPER, tensor_parallel=2)
        tp = {"logprobs": trainer.logprobs(cases["whole"]), "stats": trainer.train_step(cases["whole"]),
              "after": dict(trainer.export_weights())}
        del trainer
        parallel_state.destroy_model_parallel()
        # two stages, the tower and connector on the first; passes of at most 64 tokens on the 1F1B schedule
        trainer = MegatronTrainer(model_dir, **HYPER, pipeline_parallel=2)
        pp = {"logprobs": trainer.logprobs(cases["whole"]), "stats": trainer.train_step(cases["whole"], micro_batch_tokens=64),
              "after": dict(trainer.export_weights())}
        del trainer
        parallel_state.destroy_model_parallel()
        trainer = MegatronTrainer(model_dir, **HYPER)
        dp = {"stats": trainer.train_step(cases["halves"][rank]), "after": dict(trainer.export_weights())}
        torch.save({"tp": tp, "pp": pp, "dp": dp}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_vlm_tp2_pp2_and_dp2_equal_one_process(vlm, tmp_path):
    import torch.multiprocessing as mp
    from tests.helpers import free_port

    probe = TorchTrainer(vlm)
    halves = [vision_batch(vlm, n, seed=20 + rank) for rank, n in enumerate((3, 5))]
    halves = [near(b, probe.logprobs(b), seed=rank) for rank, b in enumerate(halves)]
    whole = TrainBatch.concat(halves)
    torch.save({"whole": whole, "halves": halves}, tmp_path / "cases.pt")
    # the spawned processes build their own world: this one's (a world of one) is torn down first
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    mp.spawn(_worker, args=(free_port(), vlm, str(tmp_path / "cases.pt"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]

    single = MegatronTrainer(vlm, **HYPER)
    initial = dict(single.export_weights())
    single_lp = single.logprobs(whole)
    single_stats = single.train_step(whole)
    single_after = dict(single.export_weights())
    connector = [k for k in initial if ".connector." in k]
    assert max(float((single_after[k] - initial[k]).abs().max()) for k in connector) > 100 * ATOL
    for mode in ("tp", "pp", "dp"):
        rank0, rank1 = (r[mode] for r in results)
        assert max_diff(rank0["after"], rank1["after"]) == 0.0, mode  # replicas (and TP gathers) agree
        connector_only = {k: v for k, v in initial.items() if ".connector." in k}
        assert parity(f"idefics3 megatron {mode}=2 vs one process: step", step_gap(rank0["after"], single_after, initial)) <= STEP_RTOL
        assert step_gap({k: rank0["after"][k] for k in connector_only}, {k: single_after[k] for k in connector_only},
                        connector_only) <= STEP_RTOL, mode
        assert rank0["stats"]["grad_norm"] == pytest.approx(single_stats["grad_norm"], rel=1e-5), mode
    assert lp_diff(results[0]["tp"]["logprobs"], single_lp) <= ATOL
    assert lp_diff(results[0]["pp"]["logprobs"], single_lp) <= ATOL and results[0]["pp"]["logprobs"] == results[1]["pp"]["logprobs"]
