"""DP load balancing: the partition algorithm (engines/host/balance.py) and the balanced train
step in real engine hosts (two processes, gloo).

The balanced step must be the *same* update as the unbalanced one: every global minibatch
keeps its sequences, only which rank computes which changes, and the loss is normalised by
global counts — so parameters agree up to float summation order.
"""

from __future__ import annotations

import itertools
import random
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest


from engines.host import balance
from engines.host.balance import greedy, imbalance, karmarkar_karp, max_total, partition, plan, plan_totals, split_bounds


def sums(weights, parts):
    return [sum(weights[i] for i in p) for p in parts]


def optimum(weights, parts):
    """Brute force: the lightest possible heaviest part."""
    best = sum(weights)
    for assignment in itertools.product(range(parts), repeat=len(weights)):
        totals = [0] * parts
        for i, p in enumerate(assignment):
            totals[p] += weights[i]
        best = min(best, max(totals))
    return best


# --------------------------------------------------------------------------- the algorithm


@pytest.mark.parametrize("fn", [karmarkar_karp, greedy, partition])
def test_every_index_exactly_once(fn):
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 6)
        w = [rng.randint(0, 200) for _ in range(rng.randint(0, 25))]
        parts = fn(w, k)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(len(w)))
        assert all(p == sorted(p) for p in parts)


def test_deterministic_and_independent_of_call_history():
    rng = random.Random(1)
    w = [rng.choice([5, 5, 7, 7, 9, 1]) for _ in range(40)]  # many ties
    first = karmarkar_karp(w, 4)
    karmarkar_karp(list(reversed(w)), 3)
    assert karmarkar_karp(list(w), 4) == first
    assert partition(w, 4) == partition(list(w), 4)
    assert plan([w[:17], w[17:]], 2) == plan([list(w[:17]), list(w[17:])], 2)


@pytest.mark.parametrize("weights,parts,greedy_max,kk_max", [
    ([4, 5, 6, 7, 8], 2, 17, 16),               # the classic: LPT 17|13, KK 16|14 (optimum 15|15)
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 16, 15),   # KK finds 15/15/15
    ([5, 5, 4, 4, 3, 3, 3], 3, 11, 10),         # Graham's LPT worst case for 3 machines (optimum 9)
    ([10, 9, 8, 7, 6, 5, 4], 3, 19, 17),
])
def test_beats_greedy_on_adversarial_inputs(weights, parts, greedy_max, kk_max):
    assert max_total(weights, greedy(weights, parts)) == greedy_max
    assert max_total(weights, karmarkar_karp(weights, parts)) == kk_max < greedy_max
    assert max_total(weights, partition(weights, parts)) == kk_max


def test_never_worse_than_greedy():
    """KK alone loses to greedy on a few inputs (~1% of these); ``partition`` takes the better."""
    rng = random.Random(2)
    kk_better = kk_worse = 0
    for _ in range(500):
        k = rng.randint(2, 4)
        w = [rng.randint(1, 100) for _ in range(rng.randint(1, 14))]
        kk, lpt, best = (max_total(w, f(w, k)) for f in (karmarkar_karp, greedy, partition))
        assert best == min(kk, lpt)
        kk_better += kk < lpt
        kk_worse += kk > lpt
    assert kk_better > 10 * kk_worse


@pytest.mark.parametrize("weights,parts", [
    ([2, 2, 2, 2], 2), ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3), ([7] * 6, 3), ([100, 1, 1, 1, 1, 1], 2),
    ([8, 7, 6, 5, 4, 3, 2, 1], 2), ([30, 20, 20, 10, 10, 5, 5], 2), ([9, 9, 1, 1], 4),
])
def test_known_optimal_cases(weights, parts):
    assert max_total(weights, partition(weights, parts)) == optimum(weights, parts)


def test_more_parts_than_items_and_empty_parts():
    assert karmarkar_karp([10, 1, 1], 5) == [[0], [1], [2], [], []]
    assert karmarkar_karp([], 3) == [[], [], []]
    assert karmarkar_karp([0, 0], 2) in ([[0], [1]], [[1], [0]])
    assert karmarkar_karp([5], 1) == [[0]]
    with pytest.raises(ValueError):
        karmarkar_karp([1], 0)


def test_a_plan_for_hundreds_of_ranks_holds_each_row_once():
    """256 ranks x 16 rows: the textbook KK held parts x items subsets (127 MB on every rank, the
    256-group bench's OOM); the plan must stay a few MB, and at 1,024 ranks (LPT) too."""
    rng = random.Random(3)
    for world in (256, 1024):
        tokens = [[rng.randint(20, 200) for _ in range(16)] for _ in range(world)]
        tracemalloc.start()
        try:
            layout = plan(tokens, 1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 20e6, f"world {world}: plan peaked at {peak / 1e6:.0f} MB"
        assert sorted(row for rank in layout for row in rank[0]) == [(r, i) for r in range(world) for i in range(16)]
        assert imbalance(plan_totals(tokens, layout)) < 1.01


def test_imbalance():
    assert imbalance([10, 10]) == 1.0
    assert imbalance([30, 10]) == 1.5
    assert imbalance([0, 0]) == 1.0
    assert imbalance([]) == 1.0


# --------------------------------------------------------------------------- the plan


def test_split_bounds_match_trainbatch_split():
    from engines.backends.base import TrainBatch

    for n in range(0, 23):
        batch = TrainBatch([[1]] * n, [[i] for i in range(n)], [[0.0]] * n, [0.0] * n)
        for parts in (1, 2, 3, 4, 5):
            b = split_bounds(n, parts)
            assert [p.response_ids for p in batch.split(parts)] == [batch.response_ids[b[i] : b[i + 1]] for i in range(parts)]


def test_plan_keeps_every_global_minibatch_and_balances_it():
    rng = random.Random(3)
    for _ in range(200):
        world, mb = rng.randint(1, 4), rng.randint(1, 3)
        tokens = [[rng.randint(1, 10) * rng.choice([1, 1, 20]) for _ in range(rng.randint(0, 12))] for _ in range(world)]
        layout = plan(tokens, mb)
        assert len(layout) == world and all(len(rank) == mb for rank in layout)
        for k in range(mb):
            before = sorted((r, i) for r in range(world) for i in range(*split_bounds(len(tokens[r]), mb)[k : k + 2]))
            assert sorted(x for rank in layout for x in rank[k]) == before  # same rows in minibatch k
            weights = [tokens[r][i] for r, i in before]
            got = max(sum(tokens[s][i] for s, i in rank[k]) for rank in layout)
            home = max(sum(tokens[r][i] for i in range(*split_bounds(len(tokens[r]), mb)[k : k + 2])) for r in range(world))
            assert got == min(home, max_total(weights, partition(weights, world)))
            if got == home:  # nothing to gain: nothing moves
                assert all(src == r for r, rank in enumerate(layout) for src, _ in rank[k])


def test_plan_moves_heavy_rows_and_keeps_rows_home_when_it_can():
    tokens = [[100] * 4 + [90] * 4, [10] * 8]  # rank 0 has all the long sequences
    layout = plan(tokens, 2)
    totals = plan_totals(tokens, layout)
    assert imbalance([sum(t) for t in tokens]) > 1.6 and imbalance(totals) < 1.05
    assert all(src == r for r, rank in enumerate(plan([[5, 5], [5, 5]], 1)) for mb in rank for src, _ in mb)  # balanced already


def test_presplit_gives_back_its_minibatches():
    from engines.backends.base import TrainBatch

    parts = [TrainBatch([[1, 4]], [[5, 2]], [[0.0, 0.0]], [1.0]), TrainBatch([], [], [], []),
             TrainBatch([[1], [1, 7]], [[2], [8, 9, 2]], [[0.0], [0.0] * 3], [0.5, -0.5])]
    batch = balance.presplit(parts)
    assert len(batch) == 3 and batch.response_ids == [[5, 2], [2], [8, 9, 2]]
    assert [p.response_ids for p in batch.split(3)] == [p.response_ids for p in parts]
    with pytest.raises(ValueError, match="3 minibatches"):
        batch.split(2)


def test_only_the_order_within_a_minibatch_changes():
    """One process, no DP: the rows of each global minibatch in the balanced order give the same
    step as in the original order; the same rows with one minibatch boundary crossed (what
    balancing the whole step at once would do) give another step."""
    import tempfile

    from engines.backends.base import TrainBatch
    from engines.backends.torch.trainer import TorchTrainer
    from tests.helpers import STEP_RTOL, params_of, parity, random_batch, save_tiny_model, step_gap, with_old_logprobs

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(tmp, hidden_size=32, num_layers=1)
        probe = TorchTrainer(model_dir)
        batches = [random_batch(n, seed=20 + n, max_response=m) for n, m in ((6, 12), (4, 2))]
        batches = [with_old_logprobs(b, probe.logprobs(b), noise=0.3, seed=i) for i, b in enumerate(batches)]
        tokens = [[len(p) + len(r) for p, r in zip(b.prompt_ids, b.response_ids)] for b in batches]

        def step(minibatches: list[list[tuple[int, int]]]) -> dict:
            fields = ("prompt_ids", "response_ids", "old_logprobs", "advantages")
            parts = [TrainBatch(*([getattr(batches[src], f)[i] for src, i in mb] for f in fields)) for mb in minibatches]
            trainer = TorchTrainer(model_dir, lr=LR)
            trainer.train_step(balance.presplit(parts), minibatches=2)
            return params_of(trainer.model)

        original = [[(r, i) for r in range(2) for i in range(*split_bounds(len(tokens[r]), 2)[k : k + 2])] for k in range(2)]
        layout = plan(tokens, 2)
        balanced = [[x for rank in layout for x in rank[k]] for k in range(2)]
        assert balanced != original and [sorted(mb) for mb in balanced] == [sorted(mb) for mb in original]
        crossed = [original[0][:-1] + original[1][:1], original[0][-1:] + original[1][1:]]
        reference, initial = step(original), params_of(TorchTrainer(model_dir).model)
        assert parity("torch trainer: balanced minibatches vs the original, step", step_gap(step(balanced), reference, initial)) < STEP_RTOL
        assert parity("control: a row in another minibatch", step_gap(step(crossed), reference, initial)) > 10 * STEP_RTOL


# --------------------------------------------------------------------------- real engine hosts


RUN = "balance-test"
# Adam's first step is ~lr * sign(gradient), so float noise in tiny gradient components shows
# up at ~1e-3 * lr: reordering the rows of a minibatch in one process moves parameters by
# ~1e-6 here (1e-5 at lr 1e-2), moving one row to the other minibatch by ~4e-3.
LR = 1e-3


def experience_rows(batch, first_prompt_id: int) -> list[dict]:
    return [
        {"prompt_id": first_prompt_id + i // 2, "sample_index": i % 2, "policy_version": 0, "wave": 0, "prompt": "p",
         "answer": None, "prompt_ids": p, "response": "r", "response_ids": r, "logprobs": lp, "truncated": False,
         "judge_text": None, "genrm_reward": None, "rule_reward": None, "reward": 0.0, "advantage": a}
        for i, (p, r, lp, a) in enumerate(zip(batch.prompt_ids, batch.response_ids, batch.old_logprobs, batch.advantages))
    ]


@pytest.fixture(scope="module")
def host_runs(tmp_path_factory):
    """Two engine hosts; rank 0's experience is long sequences, rank 1's short. For token and
    sequence aggregation, one train step with balancing on and one off, each from the same
    freshly loaded weights (``SetupEngines`` again); parameters come back through ``ExportPolicy``."""
    import pyarrow as pa

    from engines.wire.channel import client
    from engines.wire.commands import ExportPolicy, SetupEngines, TrainStep
    from engines.wire.launch import LocalHosts
    from engines.backends.torch.trainer import TorchTrainer
    from engines.config import RunConfig
    from tests.helpers import EOS, FIRST_CHAR_ID, random_batch, save_tiny_model, with_old_logprobs
    from storage import datasets

    root = tmp_path_factory.mktemp("balance-store")
    model_dir = save_tiny_model(root / "models" / "policy", hidden_size=32, num_layers=1)
    datasets.write_table(str(root / "data" / "train" / "part-00000.parquet"),
                         pa.table({"prompt_id": [0, 1], "prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), datasets.PROMPTS)
    probe = TorchTrainer(model_dir, lr=LR)
    uris = []
    for rank, (rows, min_response, max_response) in enumerate(((7, 20, 30), (5, 1, 3))):
        rng = random.Random(10 + rank)
        batch = random_batch(rows, seed=10 + rank)
        batch.response_ids = [[rng.randrange(FIRST_CHAR_ID, 49) for _ in range(rng.randint(min_response, max_response) - 1)] + [EOS]
                              for _ in range(rows)]
        batch.old_logprobs = [[0.0] * len(r) for r in batch.response_ids]
        batch = with_old_logprobs(batch, probe.logprobs(batch), noise=0.3, seed=rank)  # ratio ~1, some tokens clipped
        uri = str(root / "experience" / f"group={rank}" / "part-000.parquet")
        datasets.write_table(uri, pa.Table.from_pylist(experience_rows(batch, 100 * rank), schema=datasets.EXPERIENCE), datasets.EXPERIENCE)
        uris.append(uri)

    def config(balance_tokens: bool, aggregation: str) -> RunConfig:
        return RunConfig(
            name=RUN, dp=2, storage={"root": str(root)}, model={"policy": "models/policy"},
            data={"prompts": "data/train", "heldout": None}, reward={"genrm_weight": 0.0, "rule_weight": 1.0}, host_timeout_s=120,
            train={"lr": LR, "minibatches": 2, "algorithm": {"loss_aggregation": aggregation}, "balance_tokens": balance_tokens},
        )

    def on_both(request_of):
        with ThreadPoolExecutor(2) as pool:  # collectives: both hosts at once
            futures = [pool.submit(client(RUN, g).call, request_of(g)) for g in range(2)]
            return [f.result()[0].model_dump() for f in futures]

    from safetensors.torch import load_file

    results = {}
    with LocalHosts(RUN, 2, 1, 180, fork=True) as hosts:
        for aggregation in ("token", "sequence"):
            for on in (True, False):
                on_both(lambda g: SetupEngines(config=config(on, aggregation), master=hosts.master))
                trained = on_both(lambda g: TrainStep(experience=uris[g]))
                out = root / "export" / f"{aggregation}-{on}"
                on_both(lambda g: ExportPolicy(uri=str(out)))
                results[(aggregation, on)] = {"train": trained, "params": load_file(str(out / "model.safetensors"))}
    initial = load_file(str(root / "models" / "policy" / "model.safetensors"))
    return {"results": results, "initial": initial}


@pytest.mark.integration
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_balanced_step_in_hosts(host_runs, aggregation):
    from tests.helpers import STEP_RTOL, parity, step_gap

    on = host_runs["results"][(aggregation, True)]
    off = host_runs["results"][(aggregation, False)]

    # (a) rank 0 came with far more tokens; after balancing the ranks hold about the same
    before = [m["tokens_before_balance"] for m in on["train"]]
    assert before[0] > 4 * before[1]
    assert on["train"][0]["balance_ratio_before"] > 1.5
    assert all(m["balance_ratio"] < 1.15 for m in on["train"])
    after = [m["tokens"] for m in on["train"]]
    assert max(after) / (sum(after) / 2) < 1.2 < max(before) / (sum(before) / 2)
    assert sum(m["rows_received"] for m in on["train"]) > 0

    # (b) every row trained exactly once: counts and tokens add up to the same totals
    assert sum(m["sequences"] for m in on["train"]) == sum(m["sequences_before_balance"] for m in on["train"]) == 12
    assert sum(after) == sum(before)
    # balancing off: nothing moves, the imbalance is still reported
    assert [m["sequences"] for m in off["train"]] == [7, 5]
    assert [m["rows_received"] for m in off["train"]] == [0, 0]
    assert off["train"][0]["balance_ratio"] == off["train"][0]["balance_ratio_before"] > 1.5

    # (c) the same update: replicas equal, balanced == unbalanced up to summation order
    for run in (on, off):
        assert run["train"][0]["params_sha"] == run["train"][1]["params_sha"]
    assert parity("hosts: balanced vs unbalanced dp=2 step", step_gap(on["params"], off["params"], host_runs["initial"])) < STEP_RTOL
    assert on["train"][0]["statistics"]["loss"] == pytest.approx(off["train"][0]["statistics"]["loss"], abs=1e-5)
