"""PPO's critic on Megatron-Core (``engines/backends/megatron/critic.py``) and the critic's export.

- ``MegatronCritic``'s values, value loss, statistics and Adam step equal ``TorchCritic``'s on the
  same weights and batch (two minibatches of several passes), as test_megatron.py checks the
  policy trainers against each other (same tolerances: fp32 forwards within ~1e-6, weights after
  an Adam step within 1e-5);
- DP=2 (two processes over gloo, each on its shard, (3, 5) rows, two minibatches) equals one
  process on the whole batch: the gradients are all-reduced (summed over DP-global token counts);
- sleep releases every storage and wake restores it bit for bit; a checkpoint resumes exactly;
- an engine host's PPO step and checkpoint with train.backend=megatron (policy and critic both
  Megatron), resumed exactly by another host;
- the critic's export (``final/critic/``): a ``*ForTokenClassification`` folder whose logits are the
  values, loaded back as ``model.critic`` by either backend with the same values.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

import megatron_cpu

megatron_cpu.install()  # before Megatron is imported
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from engines.backends.base import TrainBatch  # noqa: E402
from engines.backends.megatron.critic import MegatronCritic  # noqa: E402
from engines.backends.megatron.trainer import MegatronTrainer  # noqa: E402
from engines.backends.torch.critic import TorchCritic  # noqa: E402
from engines.config import RunConfig  # noqa: E402
from engines.host.checkpointing import Checkpoints  # noqa: E402
from engines.host.validation import InputError, check_critic  # noqa: E402
from engines.host.worker import Worker  # noqa: E402
from engines.wire.commands import Checkpoint, DynamicFilter, ExportPolicy, TrainStep  # noqa: E402
from tests.helpers import STEP_RTOL, free_port, parity, random_batch, scored_rows, step_gap  # noqa: E402
from storage import datasets, objectstore  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

ATOL = 1e-5
HYPER = {"lr": 1e-3, "betas": (0.8, 0.95), "weight_decay": 0.1, "grad_clip": 0.5}
PPO = {"dp": 1, "train": {"backend": "megatron", "algorithm": {"name": "ppo"}, "minibatches": 2, "micro_batch_tokens": 24},
       "checkpoint": {"asynchronous": False}}
ALGORITHM = RunConfig.model_validate(PPO).train.algorithm


def with_head(critic, seed: int = 0):
    """The same non-zero value head in either critic (a fresh one's is zero: no backbone gradient)."""
    g = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(1, 32, generator=g) * 0.5, torch.randn(1, generator=g) * 0.1
    head = critic.model.value_head if isinstance(critic, TorchCritic) else critic.model.module.output_layer
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return critic


def critic_batch(critic, seed: int, n: int = 6) -> TrainBatch:
    """Old values and returns near the critic's values: both branches of the value loss are taken."""
    rng = random.Random(seed)
    batch = random_batch(n, seed=seed, max_response=9)
    now = critic.values(batch)
    batch.values = [[v + rng.uniform(-0.4, 0.4) for v in row] for row in now]
    batch.returns = [[v + rng.uniform(-0.6, 0.6) for v in row] for row in now]
    return batch


def exported(critic, folder) -> dict[str, torch.Tensor]:
    critic.save_hf(str(folder))
    return load_file(str(folder / "model.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def value_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_values_loss_and_step_match_torch_critic(megatron_model, tmp_path):
    fresh = MegatronCritic(megatron_model, **HYPER)
    probe = random_batch(4, seed=1)
    assert all(v == 0.0 for row in fresh.values(probe) for v in row)  # zero head: the first values are 0, as torch's
    megatron, reference = with_head(fresh), with_head(TorchCritic(megatron_model, **HYPER))
    batch = critic_batch(reference, seed=3)
    assert value_diff(megatron.values(batch), reference.values(batch)) <= 1e-6
    before = exported(reference, tmp_path / "before")
    kwargs = {"minibatches": 2, "micro_batch_tokens": 24}  # several passes per minibatch
    stats, ref_stats = megatron.train_step(batch, ALGORITHM, **kwargs), reference.train_step(batch, ALGORITHM, **kwargs)
    assert stats.keys() == ref_stats.keys() == {"value_loss", "value_clip_fraction", "explained_variance", "critic_grad_norm"}
    for key, value in stats.items():
        assert value == pytest.approx(ref_stats[key], rel=1e-6, abs=1e-5), key  # a grad norm of ~50 is 1e-5 apart on plain kernels
    assert 0 < stats["value_clip_fraction"] < 1 and stats["critic_grad_norm"] > HYPER["grad_clip"]  # both branches; clipping on
    after, ref_after = exported(megatron, tmp_path / "after"), exported(reference, tmp_path / "ref-after")
    assert max_diff(ref_after, before) > 50 * ATOL  # the step moved the weights, the head and the transformer
    assert (ref_after["model.layers.0.mlp.up_proj.weight"] - before["model.layers.0.mlp.up_proj.weight"]).abs().max() > 50 * ATOL
    assert parity("megatron vs torch critic: step", step_gap(after, ref_after, before)) <= STEP_RTOL
    assert value_diff(megatron.values(batch), reference.values(batch)) <= 1e-4


def _dp_worker(rank: int, port: int, megatron_model: str, cases_file: str, out: str) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        steps = torch.load(cases_file, weights_only=False)
        critic = with_head(MegatronCritic(megatron_model, **HYPER))
        stats = [critic.train_step(step[rank], ALGORITHM, minibatches=2, micro_batch_tokens=24) for step in steps]
        weights = exported(critic, Path(out) / f"rank{rank}")
        torch.save({"stats": stats, "weights": weights}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_dp2_equals_one_process(megatron_model, tmp_path):
    probe = with_head(TorchCritic(megatron_model, **HYPER))
    steps = [[critic_batch(probe, seed + rank, n) for rank, n in enumerate((3, 5))] for seed in (20, 30)]
    torch.save(steps, tmp_path / "steps.pt")
    mp.spawn(_dp_worker, args=(free_port(), megatron_model, str(tmp_path / "steps.pt"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert max_diff(rank0["weights"], rank1["weights"]) == 0.0  # replicas stay equal
    one, solo = with_head(MegatronCritic(megatron_model, **HYPER)), with_head(MegatronCritic(megatron_model, **HYPER))
    for k, step in enumerate(steps):  # minibatch k of every rank before minibatch k + 1 of any (test_dp.py's order)
        parts = [b.split(2) for b in step]
        stats = one.train_step(TrainBatch.concat([p[m] for m in range(2) for p in parts]), ALGORITHM, minibatches=2)
        for key in ("explained_variance", "critic_grad_norm"):  # DP-global (value_loss is each rank's own)
            assert rank0["stats"][k][key] == pytest.approx(stats[key], rel=1e-5), key
        solo.train_step(step[1], ALGORITHM, minibatches=2)  # what a missing all-reduce amounts to
    weights, initial = exported(one, tmp_path / "one"), exported(with_head(MegatronCritic(megatron_model, **HYPER)), tmp_path / "initial")
    assert parity("megatron critic: dp=2 vs one process, 2 steps", step_gap(rank0["weights"], weights, initial)) <= STEP_RTOL
    assert parity("control: megatron critic, a rank without the all-reduce",
                  step_gap(exported(solo, tmp_path / "solo"), weights, initial)) > 50 * STEP_RTOL


def _tp_worker(rank: int, port: int, megatron_model: str, cases_file: str, out: str) -> None:
    """One critic split over two tensor-parallel ranks, the whole batch on each."""
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        steps = torch.load(cases_file, weights_only=False)
        critic = with_head(MegatronCritic(megatron_model, tensor_parallel=2, **HYPER))
        values = critic.values(steps[0])
        critic.save_hf(os.path.join(out, "tp-initial"))  # collective: the shards gathered, TP rank 0 writes
        stats = [critic.train_step(step, ALGORITHM, minibatches=2, micro_batch_tokens=24) for step in steps]
        critic.save_hf(os.path.join(out, "tp-after"))
        torch.save({"values": values, "stats": stats}, os.path.join(out, f"tp-rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_tp2_equals_one_process(megatron_model, tmp_path):
    """train.tensor_parallel=2: the critic's values, its steps and its gathered export are one
    process's (the export before any step bit for bit)."""
    probe = with_head(TorchCritic(megatron_model, **HYPER))
    steps = [critic_batch(probe, seed, 6) for seed in (40, 50)]
    torch.save(steps, tmp_path / "steps.pt")
    mp.spawn(_tp_worker, args=(free_port(), megatron_model, str(tmp_path / "steps.pt"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"tp-rank{r}.pt", weights_only=False) for r in range(2))
    one = with_head(MegatronCritic(megatron_model, **HYPER))
    initial = exported(one, tmp_path / "initial")
    assert max_diff(load_file(str(tmp_path / "tp-initial" / "model.safetensors")), initial) == 0.0
    assert rank0["values"] == rank1["values"]
    assert parity("megatron critic: tp=2 vs one process, values", value_diff(rank0["values"], one.values(steps[0]))) <= 1e-5
    for k, step in enumerate(steps):
        stats = one.train_step(step, ALGORITHM, minibatches=2, micro_batch_tokens=24)
        for key, value in stats.items():
            assert rank0["stats"][k][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    after = load_file(str(tmp_path / "tp-after" / "model.safetensors"))
    assert parity("megatron critic: tp=2 vs one process, 2 steps", step_gap(after, exported(one, tmp_path / "one"), initial)) <= STEP_RTOL


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16", "distributed_optimizer": True}], ids=["fp32", "bf16-distopt"])
def test_sleep_wake_and_exact_resume(megatron_model, tmp_path, options):
    a = with_head(MegatronCritic(megatron_model, **HYPER, **options), seed=1)
    first, second, probe = critic_batch(a, 5), critic_batch(a, 6), random_batch(4, seed=9)
    a.train_step(first, ALGORITHM, minibatches=2)
    values = a.values(probe)
    weights = exported(a, tmp_path / "awake")
    assert a.sleep() > 0 and a.asleep
    with pytest.raises(RuntimeError, match="asleep"):
        a.values(probe)
    assert max_diff(exported(a, tmp_path / "asleep"), weights) == 0.0  # an export reads the host copy
    a.wake()
    assert a.values(probe) == values  # bit for bit
    files = a.save_checkpoint(str(tmp_path / "ckpt"))
    assert {"metadata.json", "common.pt"} <= set(files)
    a.train_step(second, ALGORITHM, minibatches=2)
    b = MegatronCritic(megatron_model, **HYPER, **options)  # a zero head: the checkpoint brings its own
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.values(probe) == values
    b.train_step(second, ALGORITHM, minibatches=2)  # Adam moments and step count came back too
    assert max_diff(exported(b, tmp_path / "b"), exported(a, tmp_path / "a")) == 0.0


def test_exported_critic_loads_back_as_model_critic(megatron_model, tmp_path):
    """final/critic/: a Hugging Face token classifier whose logits are the values; both backends
    load it as model.critic with the values it had; a folder with other labels is refused."""
    from transformers import AutoModelForTokenClassification

    trained = with_head(MegatronCritic(megatron_model, **HYPER), seed=2)
    trained.train_step(critic_batch(trained, 8), ALGORITHM)
    probe = random_batch(5, seed=10)
    values = trained.values(probe)
    trained.save_hf(str(tmp_path / "critic"))
    assert value_diff(MegatronCritic(str(tmp_path / "critic"), **HYPER).values(probe), values) == 0.0
    torch_critic = TorchCritic(str(tmp_path / "critic"), **HYPER)
    assert value_diff(torch_critic.values(probe), values) <= 1e-6
    hf = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic")).eval()
    for p, r, v in zip(probe.prompt_ids, probe.response_ids, values):
        logits = hf(torch.tensor([p + r])).logits[0, len(p) - 1 : -1, 0]
        assert logits.tolist() == pytest.approx(v, abs=1e-6)
    torch_critic.save_hf(str(tmp_path / "again"))  # the torch critic's export is the same format
    assert value_diff(TorchCritic(str(tmp_path / "again"), **HYPER).values(probe), torch_critic.values(probe)) == 0.0

    bad = tmp_path / "again" / "config.json"
    bad.write_text(json.dumps(json.loads(bad.read_text()) | {"id2label": {"0": "LABEL_0", "1": "LABEL_1"}}))
    config = RunConfig.model_validate({"model": {"policy": megatron_model, "critic": str(tmp_path / "again")}, **PPO})
    with pytest.raises(InputError, match="^model.critic: .*num_labels \\(id2label\\) is 2; a critic's value head has 1 output"):
        check_critic(config, megatron_model)


def test_qwen2_tied_critic_matches_torch(tmp_path):
    """The other mapped family (Q/K/V bias, tied embeddings: the folder has no lm_head to leave out)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engines.demo.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # HF initialises biases to zero: make the mapping matter
    model.save_pretrained(tmp_path / "qwen2")
    tokenizer.save_pretrained(tmp_path / "qwen2")
    megatron, reference = with_head(MegatronCritic(str(tmp_path / "qwen2"), **HYPER)), with_head(TorchCritic(str(tmp_path / "qwen2"), **HYPER))
    batch = random_batch(5, seed=2)
    assert value_diff(megatron.values(batch), reference.values(batch)) <= 1e-6
    assert max_diff(exported(megatron, tmp_path / "m"), exported(reference, tmp_path / "t")) == 0.0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]


def megatron_ppo_host(megatron_model: str, seed: int = 0) -> Worker:
    return Worker(rank=0, world=1, threads=1, config=RunConfig.model_validate(PPO), trainer=MegatronTrainer(megatron_model, lr=1e-2),
                  critic=with_head(MegatronCritic(megatron_model, lr=1e-2), seed=seed),
                  checkpoints=Checkpoints(0, "megatron", [["part-00000.parquet", 8]]))


def ppo_step(h: Worker, tmp, step: int) -> dict:
    scored = objectstore.normalize(str(tmp / f"scored-{step}.parquet"))
    rows = scored_rows(step)
    for row in rows:  # the policy's own log-probabilities: on-policy
        row["logprobs"] = h.trainer.logprobs(TrainBatch([row["prompt_ids"]], [row["response_ids"]], [row["logprobs"]], [0.0]))[0]
    datasets.write_rows(scored, rows, datasets.SCORED)
    out = objectstore.normalize(str(tmp / f"experience-{step}.parquet"))
    h.dynamic_filter(DynamicFilter(step=step, scored=[scored], out=out, target_groups=3))
    experience = datasets.read_table(out, datasets.EXPERIENCE).to_pylist()
    values = h.critic.values(TrainBatch([r["prompt_ids"] for r in experience], [r["response_ids"] for r in experience],
                                        [r["logprobs"] for r in experience], [0.0] * len(experience)))
    for row, v in zip(experience, values):  # gamma = lam = 1: A_t = R - V_t with the critic's values
        assert row["values"] == pytest.approx(v, abs=1e-6)
        assert row["token_advantages"] == pytest.approx([row["reward"] - x for x in v], abs=1e-6)
    return h.train_step(TrainStep(experience=out)).statistics


def test_megatron_host_ppo_steps_checkpoint_export_and_resume(megatron_model, tmp_path):
    """An engine host with train.backend=megatron: PPO steps (filter values, per-token advantages,
    policy and critic trained), full colocation's switches, a checkpoint that holds
    critic-megatron/, an export with critic/, and a resumed host that continues exactly."""
    h = megatron_ppo_host(megatron_model)
    stats = ppo_step(h, tmp_path, 0)
    assert {"loss", "clip_fraction", "value_loss", "value_clip_fraction", "explained_variance", "critic_grad_norm"} <= set(stats)
    assert stats["value_loss"] > 0 and stats["critic_grad_norm"] > 0
    h.devices.take("policy")  # the rollout engine takes the devices: the critic sleeps like the trainer
    assert h.critic.asleep and h.trainer.asleep
    h.export_policy(ExportPolicy(uri=objectstore.normalize(str(tmp_path / "final"))))
    assert h.critic.asleep  # read from its host copy
    manifest = objectstore.read_json(objectstore.normalize(str(tmp_path / "final" / "MANIFEST.json")))["files"]
    assert {"model.safetensors", "critic/model.safetensors", "critic/config.json"} <= set(manifest)
    uri = objectstore.normalize(str(tmp_path / "ckpt"))
    files = h.checkpoint(Checkpoint(uri=uri)).files  # checkpoint.asynchronous=false; wakes the critic to write its shards
    assert "critic-megatron/metadata.json" in files and any(f.startswith("trainer-megatron/") for f in files)
    after = ppo_step(h, tmp_path, 1)
    other = megatron_ppo_host(megatron_model, seed=9)
    other.checkpoints.load(other.trainer, uri, other.critic)
    assert ppo_step(other, tmp_path, 1) == after
    assert max_diff(exported(other.critic, tmp_path / "o"), exported(h.critic, tmp_path / "h")) == 0.0
