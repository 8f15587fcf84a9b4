"""Flow-level tests: real Prefect server, real engine-host processes, real gloo collective."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

from tests.helpers import TINY, assert_steps_completed, children, read_run_tree, run_train, wrote_nothing



class OpenRecorder:
    """Records every file the *parent* process opens (``sys.audit`` 'open' events)."""

    active: list | None = None

    @classmethod
    def hook(cls, event, args):
        if event == "open" and cls.active is not None and isinstance(args[0], (str, bytes)):
            cls.active.append(str(args[0]))


sys.addaudithook(OpenRecorder.hook)


def test_two_iterations_dp2_on_the_prefect_api(prepared):
    """Two RL steps, two DP groups: every sub-flow and stage task is on the API, Completed,
    named by step/group/wave; the parent never opens sample data; a second call resumes."""
    opened: list[str] = []
    OpenRecorder.active = opened
    try:
        summary = run_train(prepared, "name=flowtest", "steps=2", "dp=2", "checkpoint.every=1")
    finally:
        OpenRecorder.active = None
    run_dir = Path(prepared) / "runs" / "flowtest"

    # The hosts really wrote every stage's output ...
    for stage in ("rollouts", "scored", "experience"):
        for g in (0, 1):
            assert list((run_dir / "steps" / "000001" / stage / f"group={g}").glob("part-*.parquet"))
    # ... and the parent process never opened a dataset or a stage output.
    data_files = [p for p in opened if "/steps/" in p or "/data/" in p or p.endswith(".parquet")]
    assert data_files == [], data_files

    tree = asyncio.run(read_run_tree("flowtest"))
    assert tree["train-flowtest"][0] == "COMPLETED"
    assert_steps_completed(tree, steps=(0, 1), groups=(0, 1), also=("checkpoint dp={g} step={step}",))

    # Replicas equal after every step (the flow also checks this and would fail).
    assert len(summary["history"]) == 2
    # Warm hosts: each loaded its models once for the whole run, not once per iteration.
    assert [m["engine_loads"] for m in summary["history"]] == [1, 1]
    assert all(0 < m["engine_s"] < m["seconds"] < m["step_s"] for m in summary["history"])  # step_s: the iteration flow's own cost too
    # Checkpoint committed: manifest lists model, trainer state and both ranks' RNG.
    state = json.loads((run_dir / "state.json").read_text())
    assert state["step"] == 1 and len(state["cursors"]) == 2
    manifest = json.loads((Path(state["checkpoint"].removeprefix("file://")) / "MANIFEST.json").read_text())
    assert {"trainer-torch/trainer.pt", "rng-0.pt", "rng-1.pt", "model/config.json"} <= set(manifest["files"])

    # The same run again with more steps resumes: only step 2 runs, cursors continue.
    resumed = run_train(prepared, "name=flowtest", "steps=3", "dp=2", "checkpoint.every=1")
    assert [m["step"] for m in resumed["history"]] == [2]
    assert resumed["history"][0]["engine_loads"] == 1  # the resumed run's new hosts: one load each
    assert json.loads((run_dir / "state.json").read_text())["cursors"][0] > state["cursors"][0]  # step 2's checkpoint
    tree = asyncio.run(read_run_tree("flowtest"))
    assert [n for n in tree if n.startswith("iteration-") and "-dp-" not in n] == ["iteration-0002"]


def test_flow_parameters_are_metadata_only(prepared):
    """Every flow run's parameters are small (config, step, cursors), never sample text."""
    run_train(prepared, "name=paramtest", "steps=1", "dp=2")

    async def params():
        """(name, parameters) of the run and every flow run under it."""
        async with get_client() as client:
            found = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["train-paramtest"])))
            todo, seen = list(found), []
            while todo:
                run = todo.pop()
                seen.append((run.name, json.dumps(run.parameters, default=str)))
                todo += await children(client, run.id)
            return seen

    prompts = pq.read_table(Path(prepared) / "data" / "train").column("prompt").to_pylist()[:50]
    runs = asyncio.run(params())
    assert {"train-paramtest", "iteration-0000", "iteration-0000-dp-0", "iteration-0000-dp-1"} <= {n for n, _ in runs}
    for name, blob in runs:
        assert len(blob) < 8192, name
        assert not any(p in blob for p in prompts), name


# ---------------------------------------------------------------------------- bad input


def _bad_prompts(root: Path, table: pa.Table) -> str:
    folder = root / "bad"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "part-0.parquet")
    return str(folder)


def checked(root: str, *extra: str) -> None:
    """What ``yattflow train`` checks in its own process before the Prefect server and the engine hosts
    start (``flows.preflight``); tests/test_preflight.py runs the command itself."""
    from engines.config import load_config
    from flows import preflight

    preflight.run(load_config(None, TINY + [f"storage.root={root}", *extra]))


@pytest.mark.parametrize(
    "case, table, message",
    [
        ("schema", pa.table({"prompt_id": [1, 2], "question": ["1+1=", "2+2="]}), "missing field 'prompt'"),
        ("empty", pa.table({"prompt_id": [1, 2], "prompt": ["01+01=", "  "]}), "field 'prompt' is empty (prompt_id 2)"),
        ("long", pa.table({"prompt_id": [1, 2], "prompt": ["01+01=", "1+" * 40 + "="]}), "field 'prompt' is 82 tokens (prompt_id 2)"),
        ("ids", pa.table({"prompt_id": [1, 1], "prompt": ["01+01=", "02+02="]}), "field 'prompt_id' has duplicate values"),
    ],
)
def test_bad_prompts_fail_fast_and_write_nothing(prepared, tmp_path, case, table, message):
    from engines.host.validation import InputError

    bad = _bad_prompts(tmp_path, table)
    with pytest.raises(InputError) as err:
        checked(prepared, f"name=bad-{case}", "dp=1", f"data.prompts={bad}")
    assert message in str(err.value) and bad in str(err.value)
    assert wrote_nothing(Path(prepared) / "runs" / f"bad-{case}")


def test_missing_model_folder_is_named(prepared):
    from engines.host.validation import InputError

    with pytest.raises(InputError) as err:
        checked(prepared, "name=bad-model", "dp=1", "model.policy=models/nope")
    assert "model.policy" in str(err.value) and "models/nope" in str(err.value)
    assert wrote_nothing(Path(prepared) / "runs" / "bad-model")


def test_unreachable_storage_is_named(tmp_path):
    from engines.host.validation import InputError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(InputError) as err:
        checked(str(blocker / "root"), "name=bad-storage", "dp=1")
    assert "not reachable" in str(err.value) and str(blocker) in str(err.value)


def test_model_vllm_cannot_serve_is_named_before_anything_starts(prepared):
    # the tiny test models have head size 16; vLLM's CPU attention starts at 32
    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU head-size limit only applies without CUDA")
    from engines.host.validation import InputError

    with pytest.raises(InputError) as err:
        checked(prepared, "name=bad-head", "dp=1", "rollout.backend=vllm")
    assert "model.policy" in str(err.value) and "config.json: head size 16" in str(err.value)
    assert wrote_nothing(Path(prepared) / "runs" / "bad-head")


def test_sft_short_of_its_target_fails_naming_the_field_and_writes_no_model(prefect_server, tmp_path):
    """A warm start that has not learned its demonstrations is an error, not a quietly worse demo."""
    from flows.prepare import prepare
    from flows.sft import SFTNotConverged

    with pytest.raises(SFTNotConverged, match=r"sft-policy SFT reached .* after 2 steps, short of prepare.sft_target=1.0: "
                       r"raise sft.max_steps \(2\) and run the same command \(it continues from step 2\), or change sft.lr"):
        prepare(overrides=TINY + [f"storage.root={tmp_path}", "prepare.sft_target=1", "sft.max_steps=2",
                                  "sft.check_every=1"])
    assert (tmp_path / "data" / "train" / "part-00000.parquet").exists()  # the datasets, committed before the SFT
    assert not (tmp_path / "models").exists()
