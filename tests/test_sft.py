"""``yattflow sft``: supervised fine-tuning on a user's Parquet, from scratch or from a Hugging Face
folder, resumable, never writing over somebody's folder. Real runs: the ``sft`` flow on a Prefect
server, on the data of docs/own-task (reverse a three-letter word)."""

from __future__ import annotations

import hashlib
import re
import runpy
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.config import ConfigError
from flows.sft import SFTNotConverged, WouldOverwrite, sft
from storage.datasets import SchemaError

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["sft.hidden_size=32", "sft.layers=1", "sft.batch_size=16", "sft.check_every=10"]


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    """docs/own-task/make_data.py's Parquet files, as the docs make them."""
    folder = tmp_path_factory.mktemp("own-task")
    runpy.run_path(str(ROOT / "docs" / "own-task" / "make_data.py"))["main"](str(folder))
    return folder


def run_sft(root: Path, data: Path, *extra: str) -> dict:
    return sft(overrides=[f"storage.root={root}", f"sft.data={data / 'sft.parquet'}", f"sft.heldout={data / 'heldout.parquet'}",
                          "sft.heldout_field=answer", *SMALL, *extra])


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_a_stopped_sft_continues_where_it_stopped_and_ends_where_an_unstopped_one_does(prefect_server, task_data, tmp_path):
    # 20 steps short of an unreachable target: an error naming what to change, no model, the state kept
    with pytest.raises(SFTNotConverged, match=r"sft SFT reached [\d.]+% held-out exact match after 20 steps, short of "
                       r"sft.target=1.0: raise sft.max_steps \(20\) and run the same command \(it continues from step 20\)"):
        run_sft(tmp_path, task_data, "name=stopped", "sft.max_steps=20", "sft.target=1", "sft.output=models/stopped")
    assert not (tmp_path / "models" / "stopped").exists()
    assert (tmp_path / "runs" / "stopped" / "sft" / "state.pt").exists()
    # the same command with more steps (and no target) continues from step 20 ...
    resumed = run_sft(tmp_path, task_data, "name=stopped", "sft.max_steps=40", "sft.output=models/stopped")
    assert resumed["steps"] == 40 and not (tmp_path / "runs" / "stopped" / "sft").exists()  # state deleted once committed
    # ... to the very weights of 40 steps run at once
    run_sft(tmp_path, task_data, "name=straight", "sft.max_steps=40", "sft.output=models/straight")
    stopped, straight = tmp_path / "models" / "stopped", tmp_path / "models" / "straight"
    assert md5(stopped / "model.safetensors") == md5(straight / "model.safetensors")
    assert (stopped / "MANIFEST.json").exists() and (stopped / "tokenizer.json").exists()
    # a character tokenizer over the data: every character of the prompts spells as itself
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stopped)
    assert tokenizer.decode(tokenizer("reverse abc:")["input_ids"], skip_special_tokens=True) == "reverse abc:"

    # from a Hugging Face folder (sft.base): it loads, trains on, and the output is a new folder
    straight_md5 = md5(straight / "model.safetensors")
    based = run_sft(tmp_path, task_data, "name=based", "sft.max_steps=10", f"sft.base={straight}", "sft.output=models/based")
    assert based["steps"] == 10
    assert md5(straight / "model.safetensors") == straight_md5  # the base is read, never written
    assert md5(tmp_path / "models" / "based" / "model.safetensors") != straight_md5
    # the output exists now: the same command trains nothing and says so
    again = run_sft(tmp_path, task_data, "name=based", "sft.max_steps=10", f"sft.base={straight}", "sft.output=models/based")
    assert again == {"uri": f"file://{tmp_path}/models/based", "skipped": True}


def test_a_saved_state_of_another_setup_is_not_continued(prefect_server, task_data, tmp_path):
    with pytest.raises(SFTNotConverged):
        run_sft(tmp_path, task_data, "name=changed", "sft.max_steps=10", "sft.target=1")
    with pytest.raises(ConfigError, match=r"runs/changed/sft/state.pt holds the state of an SFT run set up differently "
                       r"\(lr 0.002 → 0.001\): run it with its own settings to continue it, or give this one another run name"):
        run_sft(tmp_path, task_data, "name=changed", "sft.max_steps=10", "sft.lr=1e-3")
    # a state planted by whoever can write to the storage: refused, naming the file; its code never runs
    import pickle

    from storage.runstate import RunStateError

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "runs" / "changed" / "sft" / "state.pt").write_bytes(pickle.dumps({"model": Payload()}))
    with pytest.raises(RunStateError, match=r"runs/changed/sft/state.pt: not a resume state yattflow wrote"):
        run_sft(tmp_path, task_data, "name=changed", "sft.max_steps=10", "sft.target=1")
    assert not marker.exists()


def test_examples_without_the_named_columns_fail_naming_file_and_fields(prefect_server, task_data, tmp_path):
    with pytest.raises(SchemaError, match=r"sft.data: .*prompts.parquet: missing field 'response' \(string\) \(columns "
                       r"'prompt' and 'response': set sft.prompt_field, sft.response_field or sft.heldout_field"):
        sft(overrides=[f"storage.root={tmp_path}", f"sft.data={task_data / 'prompts.parquet'}", *SMALL])
    # the fix the message names: the prompts file's reference answers are completions too
    result = sft(overrides=[f"storage.root={tmp_path}", f"sft.data={task_data / 'prompts.parquet'}", "sft.response_field=answer",
                            "sft.max_steps=2", *SMALL])
    assert result["steps"] == 2 and result["exact_match"] is None  # no held-out set: the loss only
    with pytest.raises(ConfigError, match=r"sft.data is not set"):
        sft(overrides=[f"storage.root={tmp_path}"])
    with pytest.raises(ConfigError, match=r"sft.target needs sft.heldout"):
        sft(overrides=[f"storage.root={tmp_path}", f"sft.data={task_data / 'sft.parquet'}", "sft.target=0.5"])
    with pytest.raises(ConfigError, match=r"sft.base: .*/nowhere: folder not found"):
        sft(overrides=[f"storage.root={tmp_path}", f"sft.data={task_data / 'sft.parquet'}", f"sft.base={tmp_path / 'nowhere'}",
                       "sft.output=models/other", *SMALL])


def test_sft_never_writes_over_a_folder_it_did_not_make(prefect_server, task_data, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    pq.write_table(pa.table({"x": [1]}), mine / "precious.parquet")
    before = md5(mine / "precious.parquet")
    with pytest.raises(WouldOverwrite, match=rf"sft.output: .*{mine} already holds files that yattflow did not write"):
        run_sft(tmp_path, task_data, f"sft.output={mine}", "sft.max_steps=2")
    assert md5(mine / "precious.parquet") == before and [p.name for p in mine.iterdir()] == ["precious.parquet"]


def test_ctrl_c_stops_sft_saying_where_it_can_continue(prefect_server, task_data, tmp_path):
    """The command line: Ctrl-C after a check says the step the saved state holds; the same
    command continues from it."""
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "flows.cli", "sft", f"storage.root={tmp_path}", f"sft.data={task_data / 'sft.parquet'}",
               "name=interrupted", "sft.max_steps=100000", *SMALL]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if "sft step 20/100000" in line:
            break
    proc.send_signal(signal.SIGINT)
    try:  # bounded: a stop that does not end fails here (it once ran on for 30 minutes on a loaded machine)
        rest, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        rest, _ = proc.communicate()
        raise AssertionError("yattflow sft did not stop within 120 s of Ctrl-C:\n" + "".join(out[-10:]) + rest[-3000:])
    out.append(rest)
    assert proc.returncode == 130, "".join(out[-30:])
    text = "".join(out)
    found = re.search(r"yattflow sft: stopped; resume state: step (\d+); run the same command to continue", text)
    assert found and int(found.group(1)) >= 10, text[-2000:]  # the last check saved (the log line comes first)
    assert "Traceback" not in text, text[-3000:]
    # continue to 20 steps past the saved one: SIGINT lands a moment after the step-20 line was read,
    # and a fast machine has saved later checks by then (a fixed max_steps=40 could already be reached)
    further = f"sft.max_steps={int(found.group(1)) + 20}"
    resumed = subprocess.run([*command[:-len(SMALL) - 1], further, *SMALL], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    continued = re.search(r"continuing from step (\d+)", resumed.stdout + resumed.stderr)
    # the step reported, or a later check's: the training thread may save once more between the
    # message and the process's exit (nothing is lost; the continuation starts there)
    assert continued and int(continued.group(1)) >= int(found.group(1)), (resumed.stdout + resumed.stderr)[-3000:]
