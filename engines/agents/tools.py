"""Tools: typed Python functions the policy may call (``rollout.tools``), and calling them safely.

A tool is a function with type hints and a Google-style docstring (its ``Args:`` describe the
parameters); ``transformers.utils.get_json_schema`` turns it into the JSON schema the model's chat
template shows it (``apply_chat_template(tools=...)``). The model calls one as Hermes and Qwen3
do::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 45"}}
    </tool_call>

and reads the result as a ``tool`` turn. A policy without a chat template (a tiny model, a base
model: ``chat.Renderer.templated`` false) has no schema shown and no JSON to learn: it writes
``<tool_call>calculator(123*45)</tool_call>``, the text between the parentheses being the tool's
first argument, ends its turn (end of sequence, its stop), and reads
``<tool_response>5535</tool_response>`` appended after it. A bad call — an unknown tool, broken
JSON, wrong arguments, a tool that raises or runs past ``rollout.tool_timeout_s`` — is answered
with an ``error: ...`` result the model sees; it never fails the rollout.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable

from engines.agents import sandbox
from engines.config import dotted

MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # one token each in a tiny model's vocabulary
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PLAIN = re.compile(r"(\w+)\((.*)\)", re.DOTALL)  # calculator(123*45): a tiny model's call, its one argument as written


class ToolError(ValueError):
    """A tool named in the config that cannot be loaded or described."""


@dataclass
class Call:
    """One call the model wrote: the tool's name and arguments (a string: the plain format's one
    argument, the tool's first parameter), or why it could not be read."""

    name: str | None
    arguments: dict | str | None
    error: str | None = None


@dataclass
class Result:
    content: str
    error: bool
    seconds: float


def load(specs: list[str], field: str = "rollout.tools", plain: bool = False) -> dict[str, Callable]:
    """The tools ``specs`` name, by function name; each must have a schema (type hints, docstring).
    ``plain``: the policy has no chat template and writes the plain call format, ``name(text)``: each
    tool must take that one text as its first parameter, every other one having a default."""
    tools: dict[str, Callable] = {}
    for spec in specs:
        fn = dotted.load(spec, field, ToolError)
        if not callable(fn):
            raise ToolError(f"{field}: {spec} is not a function")
        found = schema(fn, f"{field}: {spec}")
        if plain and (problem := plain_call_problem(fn, found)):
            raise ToolError(f"{field}: {spec}: {problem}, but the policy has no chat template (data.chat_template=none, "
                            f"or its tokenizer has none), so it calls a tool as <tool_call>{fn.__name__}(text)</tool_call>, "
                            "one text argument given to the first parameter: give the others defaults, or use a policy "
                            "whose chat template renders tools (the JSON call format)")
        if fn.__name__ in tools:
            raise ToolError(f"{field}: two tools are named {fn.__name__!r}")
        tools[fn.__name__] = fn
    return tools


def schema(fn: Callable, where: str = "") -> dict:
    """The JSON schema of a tool, as chat templates take it (``{"type": "function", "function": ...}``)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' reasons (no docstring, an untyped argument) are the user's to fix
        raise ToolError(f"{where or fn.__name__}: no JSON schema ({type(e).__name__}: {e}); a tool needs type hints on "
                        "every argument and a docstring describing each under 'Args:'") from None


def plain_call_problem(fn: Callable, found: dict) -> str | None:
    """Why the plain call format (one text, the first parameter) cannot call ``fn`` (its JSON schema
    ``found``), or None."""
    parameters = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if not parameters:
        return "it takes no argument"
    required = [p.name for p in parameters[1:] if p.default is inspect.Parameter.empty]
    if required:
        return f"it takes {1 + len(required)} arguments without defaults ({', '.join([parameters[0].name, *required])})"
    kind = found.get("function", {}).get("parameters", {}).get("properties", {}).get(parameters[0].name, {}).get("type")
    if kind not in (None, "string") and not (isinstance(kind, list) and "string" in kind):
        return f"its first parameter {parameters[0].name!r} is typed {kind}, not text"
    return None


def parse(text: str) -> list[Call]:
    """The calls in an assistant turn (none: it answered)."""
    calls = []
    for body in CALL.findall(text):
        if (plain := PLAIN.fullmatch(body)) and not body.startswith("{"):
            calls.append(Call(plain.group(1), plain.group(2)))
            continue
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(Call(None, None, f"the call is not JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(Call(None, None, 'a call is {"name": ..., "arguments": {...}}'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(Call(data["name"], None, "arguments must be a JSON object"))
            continue
        calls.append(Call(data["name"], arguments))
    return calls


def call(tools: dict[str, Callable], c: Call, timeout_s: float) -> Result:
    """Run one call, answering what the model reads next: the tool's result, or ``error: ...``.
    The tool runs on a thread of its own, abandoned if it runs past ``timeout_s`` (a Python
    function cannot be stopped; the sandboxed ``python`` tool kills its program itself)."""
    start = time.perf_counter()
    if c.error is not None:
        return Result(f"error: {c.error}", True, 0.0)
    fn = tools.get(c.name)
    if fn is None:
        return Result(f"error: no tool named {c.name!r} (tools: {', '.join(tools)})", True, 0.0)
    signature = inspect.signature(fn)
    arguments = {next(iter(signature.parameters), ""): c.arguments} if isinstance(c.arguments, str) else c.arguments
    try:
        signature.bind(**arguments)
    except TypeError as e:
        return Result(f"error: bad arguments for {c.name}: {e}", True, 0.0)
    box: dict = {}

    def work():
        try:
            box["out"] = fn(**arguments)
        except BaseException as e:  # noqa: BLE001 - a raising tool is an observation, never a crashed step
            box["error"] = e

    thread = threading.Thread(target=work, name=f"tool-{c.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    seconds = time.perf_counter() - start
    if thread.is_alive():
        return Result(f"error: {c.name} ran past {timeout_s:g} s", True, seconds)
    if "error" in box:
        e = box["error"]
        return Result(f"error: {c.name} raised {type(e).__name__}: {e}", True, seconds)
    out = box.get("out")
    return Result(out if isinstance(out, str) else json.dumps(out, default=str), False, seconds)


# -- two tools every run can name ------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "123 * 45".
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    with warnings.catch_warnings():  # Python's SyntaxWarning on model-written text ("12e3x") is not the console's
        warnings.simplefilter("ignore")
        tree = ast.parse(expression.strip(), mode="eval")
    result = value(tree.body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


def python(code: str) -> str:
    """Run Python code in a sandbox (no network, no files but its own, limited time and memory) and return what it printed.

    Args:
        code: A Python program; print what you want to see.
    """
    run = sandbox.run_python(code)
    if run.timed_out:
        return f"error: the program ran past {run.limits.wall_s:g} s and was killed\n{run.output}"
    if run.exit_code != 0:
        return f"error: exit code {run.exit_code}\n{run.output}"
    return run.output
