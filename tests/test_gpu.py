"""Checks that need a CUDA device: the production engines on the device they target, without
the CPU shim. Skipped where there is no GPU (tests/conftest.py); ``dp=2`` over NCCL needs two."""

from __future__ import annotations

import os

import pytest



def _megatron():
    pytest.importorskip("megatron.core", reason="Megatron-Core is optional (pip install -e .[megatron])")


def _devices(*roots) -> set[str]:
    """Device types of every tensor the trainer keeps (modules, Megatron's buffers, optimizers),
    but 0-dim ones: torch's (unfused) Adam keeps its step counters on the host by design."""
    from engines.backends.megatron.offload import trainer_tensors

    return {t.device.type for t in trainer_tensors(*roots) if t.dim() > 0}


@pytest.mark.gpu
def test_benchmark_runs_both_engines():
    _megatron()
    from bench.megatron_gpu import main

    result = main(["--sizes", "0.44b", "--layers", "2", "--hidden", "512", "--heads", "8", "--kv-heads", "4", "--seq", "256",
                   "--batch", "4", "--steps", "2", "--warmup", "1"])
    assert [r["engine"] for r in result["runs"]] == ["megatron", "transformers"]
    for run in result["runs"]:
        assert "error" not in run, run
        assert run["tokens_per_s"] > 0 and run["mfu"] > 0 and run["peak_gib"] > 0


@pytest.mark.gpu
def test_megatron_bf16_train_step_with_everything_on_cuda(tmp_path):
    """The H100 failure: bf16 Megatron's norms stayed on the CPU. Now every parameter, buffer,
    gradient buffer and optimizer state is on the GPU, the step runs, and its log-probs are the
    fp32 reference's up to bf16 rounding."""
    _megatron()
    import torch

    from engines.backends.megatron.trainer import MegatronTrainer

    from engines.backends.megatron.model import SDPAttention
    from engines.backends.torch.trainer import TorchTrainer
    from engines.rl.grpo import GRPOConfig
    from tests.helpers import random_batch, save_tiny_model, with_old_logprobs

    model_dir = save_tiny_model(tmp_path / "model", hidden_size=256, num_layers=2)
    trainer = MegatronTrainer(model_dir, lr=1e-3, dtype="bfloat16", reference=True)
    assert trainer.device.type == "cuda"
    assert isinstance(trainer.model.module.decoder.layers[0].self_attention.core_attention, SDPAttention)
    reference = TorchTrainer(model_dir, device="cpu")  # fp32 on the CPU
    batch = random_batch(8, seed=1)
    ours, ref = trainer.logprobs(batch), reference.logprobs(batch)
    assert max(abs(a - b) for x, y in zip(ours, ref) for a, b in zip(x, y)) < 2e-2  # bf16 rounding
    before = dict(trainer.export_weights())
    stats = trainer.train_step(with_old_logprobs(batch, ref, noise=0.3, seed=1), GRPOConfig(kl_coef=0.1))
    assert stats["grad_norm"] > 0 and trainer.version == 1
    assert max((v.float() - before[k].float()).abs().max().item() for k, v in trainer.export_weights()) > 0
    assert _devices(trainer.model, trainer.reference, trainer.optimizer) == {"cuda"}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


@pytest.mark.gpu
def test_megatron_sleep_export_wake_on_cuda(tmp_path):
    """Full colocation on a GPU: a sleeping trainer holds (almost) no device memory — weights,
    gradient buffers, Adam moments and fp32 main copies are in host memory — its export (the
    H100 crashed here: ``CUDA error: invalid argument``) reads the host copy without waking it,
    and after ``wake`` it trains exactly as a trainer that never slept."""
    _megatron()
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from engines.backends.megatron.trainer import MegatronTrainer
    from tests.helpers import random_batch, save_tiny_model, with_old_logprobs

    model_dir = save_tiny_model(tmp_path / "model", hidden_size=512, num_layers=4)
    options = {"lr": 1e-3, "dtype": "bfloat16", "distributed_optimizer": True}
    a, b = MegatronTrainer(model_dir, **options), MegatronTrainer(model_dir, **options)
    n = sum(p.numel() for p in a.model.parameters())
    for seed in (1, 2):
        batch = random_batch(8, seed=seed)
        batch = with_old_logprobs(batch, b.logprobs(batch), noise=0.5, seed=seed)
        a.train_step(batch)
        b.train_step(batch)
        awake = dict(a.export_weights())
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        moved = a.sleep()
        slept = time.perf_counter() - start
        freed = before - torch.cuda.memory_allocated()
        # bf16 weights (2 bytes), fp32 gradient buffer (4), fp32 main copy (4), two fp32 moments (8)
        assert moved >= 18 * n and freed >= 18 * n, (moved, freed, n)
        asleep = dict(a.export_weights())
        assert all(torch.equal(awake[k], asleep[k]) for k in awake)
        a.save_hf(str(tmp_path / f"hf-{seed}"))
        assert torch.cuda.memory_allocated() <= before - freed + 2**20  # exporting woke nothing
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{seed}", dtype=torch.bfloat16)
        assert all(torch.equal(p, awake[k]) for k, p in loaded.named_parameters())
        start = time.perf_counter()
        assert a.wake() == moved
        print(f"\n[offload] {moved / 2**20:.1f} MiB: sleep {slept * 1e3:.1f} ms, wake {(time.perf_counter() - start) * 1e3:.1f} ms")
    probe = random_batch(4, seed=3)
    assert a.logprobs(probe) == b.logprobs(probe)
    weights_a, weights_b = dict(a.export_weights()), dict(b.export_weights())
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_b)


@pytest.mark.gpu
def test_sdpa_attention_on_cuda_bf16_matches_the_local_spec(tmp_path):
    """On CUDA in bf16 SDPAttention takes the fused kernels (causal, GQA without a mask tensor);
    it agrees with the local spec's DotProductAttention up to bf16 rounding."""
    _megatron()
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from engines.backends.megatron.model import SDPAttention, _init_distributed

    _init_distributed(1, torch.device("cuda", torch.cuda.current_device()))
    config = TransformerConfig(num_layers=1, hidden_size=1024, num_attention_heads=8, num_query_groups=2, kv_channels=128,
                               attention_dropout=0.0, hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    kwargs = {"config": config, "layer_number": 1, "attn_mask_type": AttnMaskType.causal, "attention_type": "self"}
    seq, batch = 512, 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seq, batch, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(seq, batch, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    local = DotProductAttention(**kwargs)(q, k, v, None, attn_mask_type=AttnMaskType.causal).float()
    sdpa = SDPAttention(**kwargs)(q, k, v, None, attn_mask_type=AttnMaskType.causal).float()
    diff = (local - sdpa).abs()
    # bf16 scores in the local spec, fp32 accumulation in the fused kernels; a wrong pattern is off by ~0.3
    assert diff.mean().item() < 5e-3 and diff.max().item() < 0.1


@pytest.mark.gpu
def test_torch_engines_on_cuda(tmp_path):
    """The torch engines on the GPU: model, reference and AdamW state there. Without autocast they
    are the CPU's fp32 reference (up to GPU float summation); with it (the default on CUDA) one
    step moves the weights like the CPU's up to bf16 rounding; the generator samples on the GPU."""

    from engines.backends.base import load_weights
    from engines.backends.torch.generator import TorchGenerator

    from engines.backends.torch.trainer import TorchTrainer
    from tests.helpers import random_batch, save_tiny_model, with_old_logprobs

    model_dir = save_tiny_model(tmp_path / "model", hidden_size=128, num_layers=2)
    cpu = TorchTrainer(model_dir, lr=1e-3, device="cpu")
    fp32 = TorchTrainer(model_dir, lr=1e-3, autocast=False, reference=True)
    mixed = TorchTrainer(model_dir, lr=1e-3)
    assert fp32.device.type == mixed.device.type == "cuda" and mixed.optimizer.defaults["fused"]
    batch = random_batch(8, seed=1)
    batch = with_old_logprobs(batch, cpu.logprobs(batch), noise=0.3, seed=1)
    lp_cpu, lp_fp32, lp_mixed = cpu.logprobs(batch), fp32.logprobs(batch), mixed.logprobs(batch)
    diff = lambda x, y: max(abs(a - b) for r, s in zip(x, y) for a, b in zip(r, s))  # noqa: E731
    assert diff(lp_cpu, lp_fp32) < 1e-4 and diff(lp_cpu, lp_mixed) < 0.1
    for trainer in (cpu, fp32, mixed):
        trainer.train_step(batch, minibatches=2)
    assert _devices(fp32.model, fp32.reference) == {"cuda"}
    assert {t.device.type for s in mixed.optimizer.state.values() for t in s.values()} == {"cuda"}
    after = {k: v.cpu() for k, v in cpu.export_weights()}
    assert max((after[k] - v.cpu()).abs().max().item() for k, v in fp32.export_weights()) < 1e-4
    generator = TorchGenerator(model_dir)
    assert generator.device.type == "cuda"
    assert load_weights(generator, mixed.export_weights()) == len(after)
    outs = generator.generate(["12+7=", "3+4="], n=2, max_new_tokens=6, seed=0)
    assert len(outs) == 4 and all(len(o.logprobs) == len(o.response_ids) > 0 for o in outs)


@pytest.mark.gpu
def test_generation_on_cuda_runs_without_cudnn_attention(tmp_path):
    """torch 2.11 prefers cuDNN attention on Hopper, which sets up a plan for every shape it has not
    seen: every decode step of a batch size not generated before paid it (3.1 s against 0.24 s for
    a repeat on the H200, docs/gpu). generate() runs flash or memory-efficient attention instead
    (``model.decode_attention``); the trainer's forward keeps torch's choice (printed)."""
    from torch.profiler import ProfilerActivity, profile

    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer
    from tests.helpers import random_batch, save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", hidden_size=128, num_layers=2)
    sdpa = lambda prof: {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}  # noqa: E731
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        TorchGenerator(model_dir).generate(["12+7=", "3+4=", "5+5="], max_new_tokens=4, seed=0)
    generating = sdpa(prof)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        TorchTrainer(model_dir).logprobs(random_batch(3, seed=0))
    print(f"generate: {sorted(generating)}; the trainer: {sorted(sdpa(prof))}")
    assert generating and not any("cudnn" in op for op in generating)


@pytest.mark.gpu
def test_agent_episodes_on_cuda_are_token_in_token_out(tmp_path):
    """Issue 45's episodes on the GPU (tests/test_agents.py on the CPU): the tool agent's calls, the
    calculator's turns and its answers sampled on CUDA, prompted with the episodes' own token ids;
    in fp32 the trainer's log-probabilities of every sampled token are the rollout's, observation
    tokens carry no loss; with the CUDA default (bf16 autocast: on the H200, a max gap of 0.2 at
    temperature 0.3, 2026-11-28) the episodes train the same way and the gap is reported."""
    import torch

    from engines.agents.episodes import Episodes
    from engines.backends import chat
    from engines.backends.base import TrainBatch
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer
    from engines.config.sections import RolloutConfig
    from engines.demo.tool_agent import save_tool_agent

    agent = save_tool_agent(tmp_path / "agent")
    rows = [{"prompt_id": 7, "prompt": "What is 2+3?", "answer": "5"}]
    config = RolloutConfig(max_new_tokens=80, temperature=0.3, tools=["engines.agents.tools:calculator"], max_turns=3)
    for autocast in (False, None):
        generator = TorchGenerator(agent, prompt_format=chat.PromptFormat("auto"), autocast=autocast)
        assert generator.device.type == "cuda"
        played = Episodes(config, generator.renderer).run(generator, rows * 2, 2, 3)
        assert sum(e.tool_calls for e in played) >= 1 and all(e.turns >= 1 for e in played)
        assert all(len(e.loss_mask) == len(e.response_ids) == len(e.logprobs) for e in played)
        trainer = TorchTrainer(agent, temperature=0.3, autocast=autocast)
        batch = TrainBatch([e.prompt_ids for e in played], [e.response_ids for e in played], [e.logprobs for e in played],
                           [1.0, -1.0] * 2, loss_mask=[e.loss_mask for e in played])
        gaps = [abs(a - b) for e, lps in zip(played, trainer.logprobs(batch)) for a, b, m in zip(lps, e.logprobs, e.loss_mask) if m]
        print(f"autocast={autocast}: train-vs-rollout gap max {max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e} "
              f"over {len(gaps)} sampled tokens")
        assert autocast is not False or max(gaps) < 1e-4
        assert trainer.train_step(batch)["tokens"] == sum(batch.trained_tokens())
        del generator, trainer
        torch.cuda.empty_cache()


def _nccl_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from engines.backends import distributed
    from engines.backends.distributed import all_gather_ints
    from engines.backends.megatron.trainer import MegatronTrainer
    from tests.helpers import random_batch, with_old_logprobs

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the metadata group's gloo, on loopback
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    distributed.init_process_groups(device, rank, 2, store, timedelta(seconds=120))
    try:
        assert dist.get_backend() == "nccl" and dist.get_backend(distributed.metadata_group()) == "gloo"
        gathered = all_gather_ints([rank] * (rank + 1))  # CPU tensors: NCCL would refuse them
        trainer = MegatronTrainer(model_dir, lr=1e-3, dtype="bfloat16", device=device)
        batch = random_batch(4 + rank, seed=rank)
        stats = trainer.train_step(with_old_logprobs(batch, trainer.logprobs(batch), noise=0.3, seed=rank))
        torch.save({"gathered": gathered, "stats": stats, "weights": dict(trainer.export_weights())}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_megatron_dp2_over_nccl_with_gloo_metadata(tmp_path):
    """dp=2 on two GPUs (the H100 run could not: gloo cannot all-reduce CUDA tensors): the
    gradient all-reduce goes over NCCL, the balance plan's integers over the gloo group, and
    the replicas come out identical."""
    _megatron()
    import torch
    import torch.multiprocessing as mp

    from tests.helpers import free_port, save_tiny_model

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL takes one per rank)")
    model_dir = save_tiny_model(tmp_path / "model", hidden_size=128, num_layers=2)
    mp.spawn(_nccl_worker, args=(free_port(), model_dir, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["gathered"] == ranks[1]["gathered"] == [[0], [1, 1]]
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])
    assert ranks[0]["stats"]["loss"] == ranks[1]["stats"]["loss"]


def _nccl_layout_worker(rank: int, world: int, port: int, model_dir: str, layout: dict, out: str) -> None:
    """A Megatron trainer over ``world`` GPUs laid out as ``layout`` (NCCL): log-probs, one step of
    two minibatches in token-cut micro-batches, the gathered weights after."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from engines.backends import distributed
    from engines.backends.megatron.trainer import MegatronTrainer
    from tests.helpers import random_batch, with_old_logprobs

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")  # (rehearsed on a CPU, gloo)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    distributed.init_process_groups(device, rank, world, store, timedelta(seconds=120))
    try:
        trainer = MegatronTrainer(model_dir, lr=1e-3, device=device, **layout)  # fp32: TF32 is off for matmuls by default
        batch = random_batch(8, seed=7)
        logprobs = trainer.logprobs(batch)
        stats = trainer.train_step(with_old_logprobs(batch, logprobs, noise=0.3, seed=7), minibatches=2, micro_batch_tokens=24)
        after = {k: v.cpu() for k, v in trainer.export_weights()}
        torch.save({"logprobs": logprobs, "stats": stats, "after": after}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}], ids=["tp2", "pp2"])
def test_megatron_tp2_and_pp2_over_nccl_train_as_one_gpu(tmp_path, layout):
    """The CPU's TP=2 and PP=2 checks (tests/test_megatron.py, gloo) on two GPUs over NCCL: the
    log-probs and the step of a group of two ranks are one GPU's."""
    _megatron()
    import torch
    import torch.multiprocessing as mp

    from engines.backends.megatron.mapping import load_hf_state
    from tests.helpers import STEP_RTOL, free_port, save_tiny_model, step_gap

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL takes one per rank)")
    model_dir = save_tiny_model(tmp_path / "model", hidden_size=128, num_layers=2)  # 4 heads, 2 key/value heads
    (tmp_path / "one").mkdir()
    mp.spawn(_nccl_layout_worker, args=(1, free_port(), model_dir, {}, str(tmp_path / "one")), nprocs=1, join=True)
    mp.spawn(_nccl_layout_worker, args=(2, free_port(), model_dir, layout, str(tmp_path)), nprocs=2, join=True)
    one, rank0, rank1 = (torch.load(p, weights_only=False) for p in (tmp_path / "one" / "rank0.pt", tmp_path / "rank0.pt",
                                                                       tmp_path / "rank1.pt"))
    gap = max(abs(a - b) for ra, rb in zip(rank0["logprobs"], one["logprobs"]) for a, b in zip(ra, rb))
    assert gap <= 1e-4, gap
    assert rank0["after"].keys() == rank1["after"].keys() == one["after"].keys()
    assert all(torch.equal(rank0["after"][k], rank1["after"][k]) for k in one["after"])  # both ranks gathered the same
    assert step_gap(rank0["after"], one["after"], load_hf_state(model_dir)) <= STEP_RTOL
    assert rank0["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=1e-4)


@pytest.mark.gpu
def test_qwen2_5_vl_rolls_out_and_trains_with_images_on_cuda(tmp_path):
    """The same vision code path as the tiny Idefics3 on the CPU (tests/test_vision.py), on a tiny
    random Qwen2.5-VL: its processor (Qwen2-VL's image processor needs torchvision, which the GPU
    image has) expands the placeholder, the torch generator samples with the images, and the
    trainer's log-probabilities of the same tokens, with the pixel tensors it rebuilds, agree."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers import Qwen2VLImageProcessor

    from engines.backends.base import TrainBatch
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer
    from engines.demo import vision
    from engines.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789+=sum:")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                                "<|video_pad|>"]})
    try:  # transformers 5.19 refuses video_processor=None (seen on the H200, 2026-11-27); Qwen2-VL's needs torchvision
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        pixels = {"min_pixels": 56 * 56, "max_pixels": 56 * 56}
        processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                        video_processor=Qwen2VLVideoProcessor(**pixels))
    except Exception as e:  # noqa: BLE001 - the CPU machines cannot build it (no torchvision): say so
        pytest.skip(f"cannot build a Qwen2.5-VL processor here ({type(e).__name__}: {e})")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")}
    config = Qwen2_5_VLConfig(
        vision_start_token_id=ids["<|vision_start|>"], image_token_id=ids["<|image_pad|>"],
        vision_end_token_id=ids["<|vision_end|>"], video_token_id=ids["<|video_pad|>"],
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 128,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        text_config={"vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                     "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
    )
    Qwen2_5_VLForConditionalGeneration(config).float().save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>sum:"
    rows = vision.make_problems(3, seed=0)
    generator = TorchGenerator(str(tmp_path), device="cuda", autocast=False)
    gens = generator.generate([prompt] * 3, n=2, max_new_tokens=6, seed=1, images=[im for _, im, *_ in rows])
    assert all(len(g.prompt_ids) > len(tokenizer(prompt)["input_ids"]) for g in gens)  # the placeholder was expanded
    trainer = TorchTrainer(str(tmp_path), device="cuda", autocast=False)
    batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                       [0.0] * len(gens), images=[rows[g.prompt_index][1] for g in gens])
    ref = trainer.logprobs(batch)
    assert max(abs(a - b) for g, r in zip(gens, ref) for a, b in zip(g.logprobs, r)) < 1e-4
    assert trainer.train_step(TrainBatch(batch.prompt_ids, batch.response_ids, ref, [1.0, -1.0] * 3,
                                         images=batch.images))["tokens"] > 0
    assert torch.cuda.is_available()


@pytest.mark.gpu
def test_digests_on_cuda_are_the_cpus_and_a_checked_sync_copies_no_bucket_to_the_host(tmp_path, monkeypatch):
    """Issue 67: the device digest (engines/backends/digest.py) of CUDA tensors equals the CPU's of the
    same bytes, and a torch trainer → torch engine sync on the GPU is checked with only the stacked
    digests (one integer per tensor) copied to the host, never a bucket."""
    import torch

    from engines.backends import digest
    from engines.backends.base import load_weights
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.torch.trainer import TorchTrainer
    from tests.helpers import save_tiny_model

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        for n in (1, 7, 3 * digest.BLOCK + 5, 2**20 + 3):
            t = (torch.randn(n, generator=g) * 100).to(dtype)
            assert int(digest.tensor_digest(t.cuda())) == int(digest.tensor_digest(t)), (dtype, n)
    model_dir = save_tiny_model(tmp_path / "model", hidden_size=256, num_layers=2)
    trainer, engine = TorchTrainer(model_dir, autocast=False), TorchGenerator(model_dir)
    assert trainer.device.type == engine.device.type == "cuda"
    copied, cpu = [], torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copied.append(self.numel()) or cpu(self, *a, **k))
    count = load_weights(engine, trainer.export_weights(), bucket_bytes=1 << 20)
    assert count == len(dict(trainer.model.named_parameters())) and copied and max(copied) <= count
