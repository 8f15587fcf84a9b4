"""Shared helpers for the unit tests: a tiny HF model folder, hand-made train batches,
free ports, and the data-parallel worker that ``torch.multiprocessing`` spawns.

Everything here is plain data plumbing; the formulas under test are re-derived in the
test files themselves.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the product packages are not installed; tests run from the checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engines.demo.tiny import build_char_tokenizer, build_tiny_llama  # noqa: E402
from engines.backends.base import TrainBatch  # noqa: E402

from tests.sizes import STUBS, TASK, TINY  # noqa: E402,F401  (the suite's run shapes; torch-free there)

BOS, EOS = 1, 2
FIRST_CHAR_ID = 4  # ids 0..3 are <pad> <s> </s> <unk>


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(root: str, *extra: str) -> dict:
    """The ``train`` flow in this process on the tiny demo under ``root`` (the session's Prefect server)."""
    import asyncio

    from flows.training import train

    return asyncio.run(train(overrides=TINY + [f"storage.root={root}", *extra]))


def run_demo(root, *overrides: str, env: dict | None = None, config: str = "deployments/demo.yaml") -> tuple[float, float]:
    """``yattflow demo -c config`` (relative to the checkout) on ``root`` in a subprocess, as a user runs it: its
    held-out score before and after RL, in percent."""
    import re
    import subprocess

    out = subprocess.run([sys.executable, "-m", "flows.cli", "demo", "-c", config, f"storage.root={root}", *overrides],
                         cwd=ROOT, capture_output=True, text=True, timeout=1500, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    match = re.search(r"([\d.]+)% before RL → ([\d.]+)% after", out.stdout)
    assert match, out.stdout[-2000:]
    return float(match.group(1)), float(match.group(2))


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all held open while choosing, so no repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def save_tiny_model(path: str | Path, hidden_size: int = 32, num_layers: int = 1, seed: int = 0) -> str:
    """A tiny random Llama plus the char tokenizer, saved as a Hugging Face folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(
        len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=2, seed=seed
    )
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def save_tiny_vlm(path, seed: int = 0) -> str:
    """The tiny Idefics3 (SmolVLM's architecture) and its processor, saved as a Hugging Face folder."""
    from engines.demo.tiny_vision import build_tiny_idefics3, build_vision_processor

    processor = build_vision_processor("0123456789+=sum:")
    model = build_tiny_idefics3(processor.tokenizer, seed=seed, init_std=0.1)
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return str(path)


def random_batch(n: int, seed: int, vocab: int = 49, max_prompt: int = 5, max_response: int = 6) -> TrainBatch:
    """``n`` sequences: prompts start with <s>, responses end with </s>; lengths vary.

    Advantages are random with both signs; old log-probabilities are placeholders (fill
    them with :func:`with_old_logprobs`).
    """
    rng = random.Random(seed)
    prompts, responses, advantages = [], [], []
    for _ in range(n):
        prompts.append([BOS] + [rng.randrange(FIRST_CHAR_ID, vocab) for _ in range(rng.randint(1, max_prompt))])
        responses.append([rng.randrange(FIRST_CHAR_ID, vocab) for _ in range(rng.randint(0, max_response - 1))] + [EOS])
        advantages.append(rng.uniform(-1.5, 1.5))
    return TrainBatch(prompts, responses, [[0.0] * len(r) for r in responses], advantages)


def scored_rows(seed: int) -> list[dict]:
    """Three prompts x two samples whose rewards differ (the filter keeps them), as a rollout writes them."""
    batch = random_batch(6, seed=seed)
    return [{"prompt_id": i // 2, "sample_index": i % 2, "policy_version": 0, "wave": 0, "prompt": "p", "answer": "a",
             "prompt_row": i // 2, "prompt_ids": p, "response": "r", "response_ids": r, "logprobs": [-1.0] * len(r),
             "truncated": False, "judge_text": None, "genrm_reward": None, "rule_reward": float(i % 2),
             "format_reward": None, "reward": float(i % 2)} for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids))]


def with_old_logprobs(batch: TrainBatch, logprobs: list[list[float]], noise: float = 0.0, seed: int = 0) -> TrainBatch:
    """The same batch with ``old_logprobs = logprobs + uniform(-noise, noise)``."""
    rng = random.Random(seed)
    old = [[lp + rng.uniform(-noise, noise) for lp in row] for row in logprobs]
    return TrainBatch(batch.prompt_ids, batch.response_ids, old, batch.advantages)


def concat(*batches: TrainBatch) -> TrainBatch:
    return TrainBatch(
        [p for b in batches for p in b.prompt_ids],
        [r for b in batches for r in b.response_ids],
        [o for b in batches for o in b.old_logprobs],
        [a for b in batches for a in b.advantages],
    )


def global_order(batches: list[TrainBatch], minibatches: int) -> TrainBatch:
    """All DP ranks' sequences as one process takes them: minibatch k of every rank before minibatch
    k+1 of any (then one process's minibatch k is the ranks' minibatches k together)."""
    parts = [b.split(minibatches) for b in batches]
    return TrainBatch.concat([p[k] for k in range(minibatches) for p in parts])  # every field (a critic's values, returns)


def params_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# Parity after an optimizer step (DP vs one process, Megatron vs torch, TP vs one rank, micro-batches
# vs one pass). Adam divides each gradient by its own running size, so an element whose gradient is
# fp32 noise (born of cancellation) moves by anything up to +-lr depending on the summation order of
# the CPU's kernels: the largest elementwise difference after a step measures the kernels (under
# 1e-5 on an AMD EPYC, 1.2e-5 and 1.9e-5 on an Intel Xeon: issue 42), not the code. What the code
# controls is the step as a whole: ``step_gap``, the distance from the reference step relative to the
# step's own size. Measured on every kernel path by ``python -m bench.parity`` (docs/testing.md has the
# table): at most 1.2e-4 (TP splits the matmuls); a missed all-reduce, a local normalisation or a
# misplaced row gives 0.25-0.93.
STEP_RTOL = 1e-3


def step_gap(after: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    """||after - reference|| / ||reference - before||, L2 over every parameter (in float64)."""
    assert after.keys() == reference.keys() == before.keys()
    apart = sum(float(((after[k].double() - reference[k].double()) ** 2).sum()) for k in reference)
    moved = sum(float(((reference[k].double() - before[k].double()) ** 2).sum()) for k in reference)
    assert moved > 0, "the reference step did not move the parameters"
    return (apart / moved) ** 0.5


def parity(check: str, value: float) -> float:
    """``value``, a parity test's figure, also appended to $YATTFLOW_PARITY_LOG when set (``bench.parity``
    reads it: each figure on each kernel path beside its tolerance)."""
    log = os.environ.get("YATTFLOW_PARITY_LOG")
    if log:
        import json

        with open(log, "a") as f:
            f.write(json.dumps({"check": check, "value": float(value), "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n")
    return value


def dp_worker(rank: int, world_size: int, port: int, model_dir: str, cases_file: str, out_dir: str) -> None:
    """One DP replica: joins a gloo group and runs every case's ``train_step`` on its shard.

    ``cases_file`` holds ``{name: {"batches": [TrainBatch per rank], "kwargs": {...}, "trainer": {...}}}``;
    the replica writes its parameters and step stats to ``{out_dir}/{name}-rank{rank}.pt``.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from engines.backends.torch.trainer import TorchTrainer

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        cases = torch.load(cases_file, weights_only=False)
        for name, case in cases.items():
            trainer = TorchTrainer(model_dir, **case["trainer"])
            stats = trainer.train_step(case["batches"][rank], **case["kwargs"])
            torch.save({"params": params_of(trainer.model), "stats": stats}, os.path.join(out_dir, f"{name}-rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- reading a run back from Prefect


async def children(client, flow_run_id) -> list:
    """The sub-flow runs of one flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
    )


async def read_run_tree(run_name: str, api_url: str | None = None) -> dict:
    """{flow-run name: (state, {task-run name: state})} under the newest ``train-<run_name>``
    run, read through the Prefect API (``api_url``, else the current one); {} if there is none.

    Read after the run ended, once the server has recorded it (``settled``)."""
    import contextlib

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read(client) -> dict:
        # filtered by the server: an unfiltered read returns one page, which a busy session server outgrows
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"train-{run_name}"])))
        if not runs:
            return {}
        top = max(runs, key=lambda r: r.created)
        tree = {top.name: (top.state.type.value, {})}
        for it in await children(client, top.id):
            tree[it.name] = (it.state.type.value, {})
            for group in await children(client, it.id):
                task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [group.id]}))
                tree[group.name] = (group.state.type.value, {t.name: t.state.type.value for t in task_runs})
        return tree

    with temporary_settings({PREFECT_API_URL: api_url}) if api_url else contextlib.nullcontext():
        async with get_client() as client:
            return await settled(lambda: read(client))


async def settled(read, settle_s: float = 30.0):
    """``await read()`` (states of runs that ended, in dicts and tuples), read again every 0.5 s until none of
    them is Scheduled, Pending or Running, for up to ``settle_s``; the last read. A task run's states reach the
    API as events that the server's task-run recorder writes in batches (once a second, later on a loaded
    machine), so a task that ended just before its run can still read Running a moment after the run returned."""
    import asyncio
    import time

    def unsettled(value) -> bool:
        if isinstance(value, str):
            return value in ("SCHEDULED", "PENDING", "RUNNING")
        return any(unsettled(v) for v in (value.values() if isinstance(value, dict) else value))

    deadline = time.monotonic() + settle_s
    while unsettled(found := await read()) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return found


def assert_steps_completed(tree: dict, steps, groups, also: tuple[str, ...] = ()) -> None:
    """Every iteration and DP-group sub-flow of ``steps`` COMPLETED, with its stage tasks (and
    the task names in ``also``, formatted with ``step`` and ``g``) all COMPLETED."""
    for step in steps:
        assert tree[f"iteration-{step:04d}"][0] == "COMPLETED"
        for g in groups:
            state, task_runs = tree[f"iteration-{step:04d}-dp-{g}"]
            assert state == "COMPLETED"
            expected = {f"rollout dp={g} wave=0", f"genrm_score dp={g} wave=0", f"dynamic_filter dp={g} wave=0",
                        f"train_step dp={g}", f"sync_weights dp={g}", *(name.format(step=step, g=g) for name in also)}
            assert expected <= set(task_runs), task_runs
            assert set(task_runs.values()) == {"COMPLETED"}, task_runs


def no_engine_hosts_left() -> None:
    """No engine host this process started is still running (a failed attempt's are killed), within 30 s."""
    import time

    import psutil

    deadline = time.time() + 30
    def alive(p: psutil.Process) -> bool:  # (a forked host is the fork server's child, so this process's grandchild,
        try:                                 # named as python -m would name it; the server, kept, is not a host)
            return "-m engines.host " in " ".join(p.cmdline()) + " " and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    while hosts := [p for p in psutil.Process().children(recursive=True) if alive(p)]:
        assert time.time() < deadline, f"engine hosts left running: {hosts}"
        time.sleep(0.5)


def wrote_nothing(run_dir: Path) -> bool:
    """A run that failed before training wrote nothing but its released lease (storage/lease.py):
    no state, no checkpoint, no step output."""
    import json

    if not run_dir.exists():
        return True
    names = {p.name for p in run_dir.iterdir()}
    lease = run_dir / "lease.json"
    return names <= {"lease.json", "lease.json.lock"} and (not lease.exists() or json.loads(lease.read_text())["released"])


def trained(run_dir: Path) -> dict[int, list[tuple]]:
    """Per step of a run, what the train step learned from: (group, prompt_id, sample_index, reward) of every experience row."""
    import pyarrow.parquet as pq

    out = {}
    for step in sorted((run_dir / "steps").iterdir()):
        rows = []
        for f in sorted(step.glob("experience/group=*/*.parquet")):
            group = int(f.parent.name.split("=")[1])
            rows += [(group, r["prompt_id"], r["sample_index"], r["reward"])
                     for r in pq.read_table(f, columns=["prompt_id", "sample_index", "reward"]).to_pylist()]
        out[int(step.name)] = sorted(rows)
    return out


def final_parameters(run_dir: Path) -> dict:
    """A finished run's final model (final/model.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def same_training(run_dir: Path, reference: Path) -> None:
    """A run trained every step of ``reference`` (a finished run of the same config) on the same samples with the
    same rewards, and ended with the same parameters."""
    got, want = trained(run_dir), trained(reference)
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == want[step], f"step {step} trained other samples or rewards than the uninterrupted run"
    a, b = final_parameters(run_dir), final_parameters(reference)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), "final parameters differ"


def run_until_healed(args: list[str], faults: str, fired: Path, timeout: float) -> tuple[list[int], object, list]:
    """``flows.training.train(overrides=args)`` in a fresh Python under ``YATTFLOW_FAULTS=faults``
    (engines/host/faults.py; each fault fires once, recorded in ``fired``), run again until it
    exits 0, three tries at most: each try's return code, the last try (``subprocess.CompletedProcess``)
    and its training history."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), YATTFLOW_FAULTS_FIRED=str(fired), YATTFLOW_FAULTS=faults)
    script = ("import asyncio, json, sys\nfrom flows.training import train\n"
              "print('SUMMARY', json.dumps(asyncio.run(train(overrides=sys.argv[1:]))['history']))\n")
    codes = []
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", script, *args], cwd=root, capture_output=True, text=True,
                             timeout=timeout, env=env)
        codes.append(run.returncode)
        if run.returncode == 0:
            break
    history = json.loads(run.stdout.split("SUMMARY ", 1)[1]) if run.returncode == 0 else []
    return codes, run, history


def taken_prompts(step_dirs: list[Path], group: int) -> list:
    """The prompts group ``group``'s rollouts took over these steps, in order, each once (G samples per prompt)."""
    import pyarrow.parquet as pq

    taken = [r for s in step_dirs for r in pq.read_table(s / "rollouts" / f"group={group}").column("prompt_id").to_pylist()]
    return list(dict.fromkeys(taken))


def trained_once(step_dirs: list[Path], groups) -> dict:
    """{prompt_id: the step that trained it} over these steps' experience; fails if a prompt was
    trained in two steps."""
    import pyarrow.parquet as pq

    trained_in: dict = {}
    for g in groups:
        for s in step_dirs:
            for prompt in set(pq.read_table(s / "experience" / f"group={g}").column("prompt_id").to_pylist()):
                assert prompt not in trained_in, f"prompt {prompt} trained in steps {trained_in[prompt]} and {s.name}"
                trained_in[prompt] = int(s.name)
    return trained_in
