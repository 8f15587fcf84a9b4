"""``yattflow sft`` renders its prompts as RL will: the policy's chat template, ``data.system_prompt`` and the
schemas of ``rollout.tools`` (flows/sft.py ``tool_schemas``, engines/sft.py ``tools``), chat ``messages`` as
well as text; and it says how it is doing at least every 30 s between its checks (``on_progress``).

A tool-using policy SFT'd on plain prompts never called its tool once RL prompted it with the tools' schemas:
here the ids SFT trains on are the ids of RL's first episode prompt, token for token, and the SFT'd tiny Qwen3
answers RL's prompt with the tool call it was shown. No Prefect server, no engine host: seconds.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.agents.episodes import Episodes
from engines.backends import chat
from engines.config import ConfigError, load_config
from engines.demo.tiny_hub import save_tiny_hub_model
from engines.sft import exact_match, sft
from flows.sft import read_examples, tool_schemas

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
SYSTEM = "Use the calculator."
TOOLS = ['rollout.tools=["engines.agents.tools:calculator"]', f"data.system_prompt={SYSTEM}"]


@pytest.fixture
def tiny_qwen3(tmp_path):
    folder = save_tiny_hub_model("qwen3", tmp_path / "qwen3", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                 max_positions=1024)
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)


def test_sft_trains_on_the_prompt_rl_gives_and_then_calls_the_tool(tiny_qwen3):
    tokenizer, model = tiny_qwen3
    config = load_config(None, TOOLS)
    renderer = chat.Renderer(tokenizer, chat.PromptFormat.policy(config))
    schemas = tool_schemas(config, renderer)
    episodes = Episodes(config.rollout, renderer)  # RL's: what an episode's first prompt is
    assert schemas == episodes.schemas and schemas[0]["function"]["name"] == "calculator"
    rl_prompt = episodes._start({"prompt": "What is 2+3?", "messages": None}).prompt_ids
    assert SYSTEM in tokenizer.decode(rl_prompt) and '"calculator"' in tokenizer.decode(rl_prompt)

    seen: list[list[int]] = []
    forward = model.forward

    def spy(*args, **kwargs):
        if model.training:
            seen.append(kwargs["input_ids"][0].tolist())
        return forward(*args, **kwargs)

    model.forward = spy
    torch.set_num_threads(1)
    pairs = [("What is 2+3?", CALL)]
    result = sft(model, tokenizer, pairs, pairs, target=1.0, max_steps=200, check_every=20, batch_size=1, lr=1e-2, seed=0,
                 log=lambda line: None, renderer=renderer, tools=schemas)
    trained_prompt = seen[0][:len(rl_prompt)]
    assert trained_prompt == list(rl_prompt)  # the very ids RL prompts with: template, system turn, the tool's schema
    assert result["converged"], result
    budget = len(tokenizer(CALL, add_special_tokens=False)["input_ids"]) + 1  # the call and its end, as SFT checks it
    assert exact_match(model, tokenizer, pairs, budget, renderer=renderer, tools=schemas) == 1.0
    # the same model, asked without the tools' schemas (the old SFT's prompt), is asked something it never saw
    assert tokenizer.decode(renderer.ids("What is 2+3?")) != tokenizer.decode(rl_prompt)


def test_sft_learns_from_chat_messages_with_the_tool_turn(tiny_qwen3, tmp_path):
    """A second example of an episode: the user's question, the model's call and the tool's result as
    ``messages``, the answer to learn as ``response`` (read from Parquet as RL's prompts files are)."""
    tokenizer, model = tiny_qwen3
    after = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": CALL},
             {"role": "tool", "content": "5"}]
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2+3?", None], "messages": [None, after], "response": [CALL, "5"]}), path)
    pairs, images = read_examples(str(path), "prompt", "response", "sft.data")
    assert pairs == [("What is 2+3?", CALL), (after, "5")] and images is None
    config = load_config(None, TOOLS)
    renderer = chat.Renderer(tokenizer, chat.PromptFormat.policy(config))
    schemas = tool_schemas(config, renderer)
    assert "<tool_response>\n5\n</tool_response>" in renderer.text(after, schemas)
    torch.set_num_threads(1)
    result = sft(model, tokenizer, pairs, pairs, target=1.0, max_steps=300, check_every=20, batch_size=2, lr=1e-2, seed=0,
                 log=lambda line: None, renderer=renderer, tools=schemas)
    assert result["converged"], result
    pq.write_table(pa.table({"prompt": [None], "messages": pa.array([None], pa.list_(pa.struct([("role", pa.string()),
                                                                                             ("content", pa.string())]))),
                             "response": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(Exception, match="row 0 has neither a 'prompt' text nor 'messages'"):
        read_examples(str(tmp_path / "bad.parquet"), "prompt", "response", "sft.data")


def test_a_template_that_cannot_show_tools_is_refused(tmp_path):
    folder = save_tiny_hub_model("qwen3", tmp_path / "plain", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                 chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    renderer = chat.Renderer(AutoTokenizer.from_pretrained(folder), chat.PromptFormat("auto"))
    with pytest.raises(ConfigError, match="does not render tools"):
        tool_schemas(load_config(None, TOOLS[:1]), renderer)
    assert tool_schemas(load_config(None, []), renderer) is None


def test_sft_says_how_it_is_doing_between_checks(tiny_qwen3):
    """``on_progress`` after a step once ``progress_every_s`` passed since the last line (0 here: every step),
    never at a check (the check says it); ``yattflow sft`` logs each as a console line, at least every 30 s."""
    tokenizer, model = tiny_qwen3
    calls, checks = [], []
    sft(model, tokenizer, [("What is 2+3?", "5")], [("What is 2+3?", "5")], target=None, max_steps=10, check_every=5,
        batch_size=1, lr=1e-3, seed=0, log=lambda line: None, on_check=checks.append, on_progress=calls.append,
        progress_every_s=0.0)
    assert [c["step"] for c in calls] == [1, 2, 3, 4, 6, 7, 8, 9] and [c["step"] for c in checks] == [5, 10]
    assert set(calls[0]) == {"step", "max_steps", "loss", "seconds"} and calls[0]["max_steps"] == 10
