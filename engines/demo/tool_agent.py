"""A tiny policy that calls a tool: a random Qwen3 of the real architecture, taught to use the calculator
(or the python tool).

    python -m engines.demo.tool_agent models/tool-agent
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.agents import tools
from engines.backends import chat
from engines.demo.tiny_hub import save_tiny_hub_model

# What the agent is taught on "What is 2+3?", per tool: the call's arguments, the tool's result, the answer.
LESSONS = {
    "calculator": ({"expression": "2+3"}, "5", "5"),
    "python": ({"code": "print(2+3)"}, "5\n", "\\boxed{5}"),
}

# Taught until its summed loss is under LEARNT (about 140 steps): a fixed 120 steps, enough on an AMD EPYC's
# kernels, ended at 0.13 on an Intel Xeon's, whose samples then garbled the call.
LEARNT = 0.01
MAX_STEPS = 400


def save_tool_agent(path: str | Path, family: str = "qwen3", tool: str = "calculator",
                    chat_template: str | None = None, system_prompt: str | None = None) -> str:
    """A tiny random Qwen3 (head_dim 32: vLLM's CPU build serves it; ``family="qwen3_moe"``: a
    Qwen3-MoE) taught, in a few seconds of supervised steps, to call ``tool`` on "What is 2+3?" and
    to answer after the tool's result: real episodes with real turns (tests/test_agents.py,
    tests/test_vllm.py, tests/test_moe.py, tests/test_recipe.py, bench/agents.py). ``chat_template``:
    another tools-capable ChatML template than the tiny one (e.g. Qwen3's own); ``system_prompt``:
    the run's ``data.system_prompt``."""
    folder = save_tiny_hub_model(family, path, hidden_size=64, num_layers=2, max_positions=1024,
                                 chat_template=chat_template)
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    renderer = chat.Renderer(tokenizer, chat.PromptFormat("auto", system_prompt))
    schemas = [tools.schema(getattr(tools, tool))]
    arguments, result, answer = LESSONS[tool]
    call = f'<tool_call>\n{{"name": "{tool}", "arguments": {json.dumps(arguments)}}}\n</tool_call><|im_end|>'
    first = renderer.text("What is 2+3?", schemas)
    after = first + call + tokenizer.decode(renderer.observation_ids([{"role": "tool", "content": result}], True, schemas))
    pairs = [[tokenizer(t, add_special_tokens=False)["input_ids"] for t in pair]
             for pair in ((first, call), (after, answer + "<|im_end|>"))]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(MAX_STEPS):  # until it has learnt both turns, on whatever kernels this CPU has
        loss = sum(model(input_ids=torch.tensor([p + a]), labels=torch.tensor([[-100] * len(p) + a])).loss for p, a in pairs)
        if loss.item() < LEARNT:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise RuntimeError(f"the tool agent's loss is {loss.item():.4f} after {MAX_STEPS} steps, not under {LEARNT}")
    model.save_pretrained(folder)
    return str(folder)


if __name__ == "__main__":
    print(save_tool_agent(sys.argv[1]))
