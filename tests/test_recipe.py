"""The recipe a user copies (deployments/recipes/qwen3-math-grpo.yaml, docs/recipes/qwen3-math-grpo.md),
run end to end on a tiny random Qwen3 (the architecture, a byte-level BPE and ChatML: engines/demo/tiny_hub.py).

It checks that the run completes with real rewards flowing, not that it learns: ``yattflow sft``
plants answers (through the same chat template RL renders with) — one prompt the policy always
answers ``\\boxed{7}``, one it answers ``\\boxed{0.5}`` or ``\\boxed{2}`` about equally — and the
scored responses of the run must be the verifier's verdicts on them: 1 for ``\\boxed{7}`` against
the reference ``7`` and for ``\\boxed{0.5}`` against ``\\frac{1}{2}``, 0 for ``\\boxed{2}``; the format rule 1 for a boxed answer.

The agentic recipe (deployments/recipes/qwen3-python-tool.yaml, docs/agents.md) runs the same way on a
tiny Qwen3 with Qwen3's own chat template, as TRL ships it (``trl/chat_templates/qwen3.jinja``).
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from engines.agents import sandbox, tools
from engines.backends import chat
from engines.demo.tiny_hub import save_tiny_hub_model
from engines.demo.tool_agent import save_tool_agent
from engines.rl.math_rules import math_answer
from flows.sft import sft
from flows.training import train
from storage import datasets
from tests.helpers import ROOT

RECIPE = str(ROOT / "deployments" / "recipes" / "qwen3-math-grpo.yaml")
SEVEN = "What is 3 + 4?"  # always answered \boxed{7}: the reference is 7
HALF = "What is half of one?"  # answered \boxed{0.5} or \boxed{2}: the reference is \frac{1}{2}
SMALL = [  # the recipe's run, shrunk to a CPU and a tiny model
    "dp=1", "steps=2", "model.dtype=float32", "rollout.backend=torch", "train.backend=torch", "rollout.max_new_tokens=12",
    "data.max_prompt_tokens=96", "data.heldout_limit=4", "eval.every=null", "rollout.samples_per_prompt=8",
    "sampling.prompts_per_wave=2", "sampling.target_groups=1", "sampling.max_waves=1", "sampling.max_empty_steps=null",
    "train.minibatches=1", "train.micro_batch_tokens=null", "train.lr=1e-4", "checkpoint.every=2", "placement.stream_chunk=2",
    "reward.overlong_buffer=0", "timeouts.stage_s=120",
]


def test_the_qwen3_math_recipe_runs_with_real_rewards(prefect_server, tmp_path):
    root = tmp_path / "math-run"
    save_tiny_hub_model("qwen3", root / "models" / "tiny-qwen3", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    pq.write_table(pa.table({"prompt": [SEVEN] * 32 + [HALF] * 32,
                             "response": ["\\boxed{7}"] * 32 + ["\\boxed{0.5}", "\\boxed{2}"] * 16}), root / "sft.parquet")
    prompts = [{"prompt_id": 1, "prompt": SEVEN, "messages": None, "answer": "7"},
               {"prompt_id": 2, "prompt": None, "messages": [{"role": "user", "content": HALF}], "answer": "\\frac{1}{2}"}]  # a chat row
    datasets.write_table(str(root / "data" / "train.parquet"), pa.Table.from_pylist(prompts), datasets.PROMPTS)
    datasets.write_table(str(root / "data" / "test.parquet"), pa.Table.from_pylist(prompts), datasets.PROMPTS)
    common = [f"storage.root={root}", *SMALL]

    # the warm start: the tiny Qwen3 learns the planted answers to the prompts as the chat template renders them
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine 2 threads ran this SFT 10x slower than 1 (119 s against 11 s)
    try:
        sft(RECIPE, common + ["sft.data=sft.parquet", "sft.base=models/tiny-qwen3", "sft.output=models/tiny-qwen3-sft",
                          "sft.max_steps=300", "sft.check_every=300", "sft.batch_size=8", "sft.lr=3e-3"])
    finally:
        torch.set_num_threads(threads)
    summary = asyncio.run(train(RECIPE, common + ["model.policy=models/tiny-qwen3-sft"]))
    assert len(summary["history"]) == 2 and summary["heldout_metric"] == "mean engines.rl.math_rules:math_answer reward"
    assert summary["heldout_before"] in (0.5, 1.0)  # greedy: \\boxed{7} right, and one of the two answers to the half

    parts = sorted((root / "runs" / "qwen3-math-grpo" / "steps").glob("*/scored/group=*/*.parquet"))
    scored = [row for part in parts for row in datasets.read_table(str(part), datasets.SCORED).to_pylist()]
    assert scored, "no scored responses"
    by_prompt = {pid: [r for r in scored if r["prompt_id"] == pid] for pid in (1, 2)}
    assert by_prompt[1] and by_prompt[2]
    assert by_prompt[2][0]["prompt"] == HALF  # a chat row: the rule reads its user turn
    tokenizer = AutoTokenizer.from_pretrained(root / "models" / "tiny-qwen3-sft")
    system = "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
    for pid, text in ((1, SEVEN), (2, HALF)):  # the policy was prompted with Qwen's template and the recipe's system prompt
        rendered = f"{system}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        assert tokenizer.decode(by_prompt[pid][0]["prompt_ids"]) == rendered
    for row in scored:
        boxed_right = row["response"].strip() in ("\\boxed{7}", "\\boxed{0.5}")
        assert row["rule_reward"] == float(boxed_right), row  # the verifier's verdict on the real response
        assert row["format_reward"] == float("\\boxed{" in row["response"] and row["response"].strip().endswith("}")), row
        assert abs(row["reward"] - (row["rule_reward"] + 0.1 * row["format_reward"])) < 1e-6
    # the forced answer scored 1; the mixed prompt got both verdicts (16 samples of a coin toss), so the steps trained on them
    assert [r["rule_reward"] for r in by_prompt[1]] == [1.0] * len(by_prompt[1])
    assert {r["rule_reward"] for r in by_prompt[2]} == {0.0, 1.0}, [r["response"] for r in by_prompt[2]]
    assert Path(root / "runs" / "qwen3-math-grpo" / "final" / "MANIFEST.json").exists()


TOOL_RECIPE = str(ROOT / "deployments" / "recipes" / "qwen3-python-tool.yaml")


def qwen3_template() -> str:
    """Qwen3's own chat template, as TRL keeps it ("Original Qwen3 chat template": its chat_templates/README.md)."""
    spec = importlib.util.find_spec("trl")  # found, not imported: only the template file is read
    assert spec, "TRL is a test dependency (requirements/*.lock, pyproject's test extra): `make test` installs it"
    return (Path(spec.submodule_search_locations[0]) / "chat_templates" / "qwen3.jinja").read_text()


@pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"no sandbox here: {sandbox.unavailable()}")
def test_the_qwen3_python_tool_recipe_plays_episodes_in_the_sandbox(prefect_server, tmp_path):
    """The recipe's run on a tiny Qwen3 with Qwen3's own chat template, taught to call the python
    tool on "What is 2+3?" and to answer after its result: the prompts are the template's render
    with the tool's schema and the recipe's system prompt, the programs run in the sandbox (no tool
    errors), their output comes back as Qwen3's <tool_response> turn with loss mask 0, the held-out
    greedy episodes answer right, and the rule scores the whole episode."""
    root = tmp_path / "tool-run"
    system = "Use the python tool to compute, and put your final answer within \\boxed{}."  # the recipe's
    save_tool_agent(root / "models" / "Qwen3-1.7B", tool="python", chat_template=qwen3_template(), system_prompt=system)
    rows = [{"prompt_id": i, "prompt": "What is 2+3?", "messages": None, "answer": "5"} for i in range(4)]
    for split in ("train", "test"):
        datasets.write_table(str(root / "data" / f"{split}.parquet"), pa.Table.from_pylist(rows), datasets.PROMPTS)
    summary = asyncio.run(train(TOOL_RECIPE, [
        f"storage.root={root}", "dp=1", "steps=2", "model.dtype=float32", "rollout.backend=torch", "train.backend=torch",
        "rollout.max_new_tokens=80", "rollout.episode_tokens=240", "rollout.temperature=0.3", "data.heldout_limit=1",
        "eval.every=null", "rollout.samples_per_prompt=4", "sampling.prompts_per_wave=2", "sampling.target_groups=1",
        "sampling.max_waves=1", "sampling.filter_equal_rewards=false", "train.minibatches=1", "train.micro_batch_tokens=null",
        "checkpoint.every=2", "placement.stream_chunk=2", "timeouts.stage_s=120"]))
    assert summary["heldout_before"] == 1.0  # a greedy episode: the program's output, then \boxed{5}
    for m in summary["history"]:
        assert m["episodes"]["tool_calls"] > 0 and m["episodes"]["tool_errors"] == 0, m["episodes"]

    tokenizer = AutoTokenizer.from_pretrained(root / "models" / "Qwen3-1.7B")
    assert tokenizer.chat_template == qwen3_template()
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "What is 2+3?"}],
                                             tools=[tools.schema(tools.python)], add_generation_prompt=True, tokenize=False)
    assert rendered.startswith(f"<|im_start|>system\n{system}\n\n# Tools\n\nYou may call one or more functions")
    parts = sorted((root / "runs" / "qwen3-python-tool" / "steps").glob("*/experience/group=*/*.parquet"))
    experience = [row for part in parts for row in pq.read_table(part).to_pylist()]
    calls = [row for row in experience if "</tool_call>" in tokenizer.decode(row["response_ids"])]
    assert calls and all(tokenizer.decode(row["prompt_ids"]) == rendered for row in experience)
    for row in calls:  # the call as sampled, then Qwen3's tool turn with what the sandbox printed
        observed = [t for t, m in zip(row["response_ids"], row["loss_mask"]) if m == 0]
        assert tokenizer.decode(observed).startswith("\n<|im_start|>user\n<tool_response>\n5\n\n</tool_response>")
    scored = [r for part in sorted((root / "runs" / "qwen3-python-tool" / "steps").glob("*/scored/group=*/*.parquet"))
              for r in datasets.read_table(str(part), datasets.SCORED).to_pylist()]
    assert any(r["rule_reward"] == 1.0 for r in scored)
    for r in scored:
        assert r["rule_reward"] == math_answer(r["prompt"], r["response"], "5"), r["response"]
    # Qwen3's template drops a turn's reasoning once a user turn follows: not append-only, and named so
    why = chat.Renderer(tokenizer, chat.PromptFormat("auto")).append_only()
    assert why and why.startswith("after a user turn the render differs from what the model saw"), why
