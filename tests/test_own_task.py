"""docs/your-own-task.md, run as written: a task other than addition (reverse a three-letter word)
from scratch on the CPU — data, reward rule, `yattflow sft`, RL, curves in TensorBoard and MLflow,
a judge of one's own, and the exported model. Real commands in a shell's working directory, on
a real Prefect server."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "docs/own-task/reverse.yaml"


def yattflow(cwd: Path, *args: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out.stdout + out.stderr


@pytest.mark.slow
def test_your_own_task_from_scratch_as_the_docs_say(prefect_server, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shutil.copytree(ROOT / "docs" / "own-task", tmp_path / "docs" / "own-task")  # the user's checkout of the example
    subprocess.run([sys.executable, "docs/own-task/make_data.py", "my-task"], cwd=tmp_path, check=True, timeout=120)
    task = tmp_path / "my-task"

    # 1. the warm start, from scratch: a character tokenizer over the data, a tiny Llama
    sft = yattflow(tmp_path, "sft", "-c", CONFIG)
    assert re.search(r"sft 'reverse': held-out exact match [\d.]+%, loss [\d.]+ after 600 steps; model: "
                     rf"file://{task}/models/reverse-sft", sft), sft[-2000:]
    assert (task / "models" / "reverse-sft" / "MANIFEST.json").exists()

    # 2. RL with the rule, curves to TensorBoard (always) and MLflow (MLFLOW_TRACKING_URI)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rl = yattflow(tmp_path, "train", "-c", CONFIG, env={"MLFLOW_TRACKING_URI": tracking})
    found = re.search(r"held-out mean docs/own-task/rules.py:reversed_word reward: ([\d.]+)% before RL → ([\d.]+)% after "
                      r"20 RL steps", rl)
    assert found, rl[-2000:]
    before, after = float(found.group(1)), float(found.group(2))
    assert after >= before + 15, f"RL did not improve on its SFT start: {before}% → {after}%"

    events = EventAccumulator(str(task / "runs" / "reverse" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"rollout/reward", "rollout/accuracy", "rollout/response_tokens", "sampling/kept_groups", "sampling/dropped_groups",
            "train/loss", "train/kl_rollout", "train/kl_reference", "train/clip_fraction", "train/entropy",
            "seconds/step", "seconds/rollout", "seconds/train_step"} <= tags, tags
    assert [e.step for e in events.Scalars("rollout/reward")] == list(range(1, 21))
    heldout = events.Scalars("heldout/mean docs/own-task/rules.py:reversed_word reward")
    assert [e.step for e in heldout] == [0, 5, 10, 15, 20]  # before RL, eval.every, after
    assert round(100 * heldout[0].value, 1) == before and round(100 * heldout[-1].value, 1) == after
    assert all(e.value > 0 for e in events.Scalars("train/entropy"))

    import mlflow

    client = mlflow.MlflowClient(tracking)  # (not mlflow.set_tracking_uri: it sets MLFLOW_TRACKING_URI for the whole process)
    (run,) = client.search_runs([client.get_experiment_by_name("yattflow").experiment_id],
                                filter_string="tags.mlflow.runName = 'reverse'")
    rewards = client.get_metric_history(run.info.run_id, "rollout/reward")
    assert sorted(m.step for m in rewards) == list(range(1, 21))
    assert run.data.params["reward.rule"] == "docs/own-task/rules.py:reversed_word"

    # 3. a judge of one's own: `yattflow sft` on verdict examples, then RL scored by it alone
    judge = yattflow(tmp_path, "sft", "-c", CONFIG, "name=reverse-judge", "sft.data=judge.parquet",
                     "sft.heldout=judge-heldout.parquet", "sft.heldout_field=null", "sft.output=models/reverse-judge",
                     "sft.max_steps=200")
    assert "sft 'reverse-judge': held-out exact match" in judge, judge[-2000:]
    judged = yattflow(tmp_path, "train", "-c", CONFIG, "name=reverse-judged", "reward.genrm_weight=1", "reward.rule_weight=0",
                      "steps=3")
    assert re.search(r"% before RL → [\d.]+% after 3 RL steps", judged), judged[-2000:]

    # 4. export: the final policy is a Hugging Face folder any tool loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = task / "runs" / "reverse" / "final"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    ids = tokenizer("reverse abc:", return_tensors="pt", return_token_type_ids=False)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert len(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)) > 0
