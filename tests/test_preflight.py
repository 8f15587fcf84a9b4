"""Issue 65: bad input is named in seconds, before anything starts.

Everything that can be checked without engines runs in the command's own process before the Prefect
server or any engine host starts (``flows/preflight.py``, ``engines.host.validation.preflight``): the
config's keys, the layout against the model's config.json, the user's rule, environment and tools, the
prompts' text and images. Each case is checked by a direct call; one ``yattflow train`` per class of
error shows what a person sees: one line, exit code 2, nothing started (no Prefect server, no run
folder). The models are built here (no prepare flow, no server): a tiny Llama and its char tokenizer.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import save_tiny_model
from engines.config import load_config
from engines.host import rewards, validation
from flows import preflight
from storage import datasets

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A storage root with a tiny policy (4 heads, 2 key/value heads, 1 layer, no chat template), the
    demo's kind of prompts, and the user's code of the cases below."""
    root = tmp_path_factory.mktemp("store")
    save_tiny_model(root / "models" / "policy")
    (root / "data" / "train").mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": [0, 1, 2], "prompt": ["01+01=", "02+02=", "03+03="], "answer": ["20", "40", "60"]}),
                   root / "data" / "train" / "part-0.parquet")
    (root / "mine.py").write_text(textwrap.dedent('''
        import time
        from engines.agents.environment import Step

        class Fine:
            def reset(self, row): return row["prompt"]
            def step(self, text): return Step(None, reward=1.0, done=True)

        class WrongStep:
            def reset(self, row): return row["prompt"]
            def step(self, text): return {"observation": "not a Step"}

        class NoStep:
            def reset(self, row): return row["prompt"]

        class SlowStep:
            def reset(self, row): return row["prompt"]
            def step(self, text): time.sleep(3600)

        def three(a: str, b: str, c: str) -> str:
            """Join three strings.

            Args:
                a: The first.
                b: The second.
                c: The third.
            """
            return a + b + c

        def one_needed(text: str, sep: str = "-") -> str:
            """Split text.

            Args:
                text: What to split.
                sep: Where.
            """
            return text

        def a_number(n: int) -> str:
            """Double a number.

            Args:
                n: The number.
            """
            return str(2 * n)

        def untyped(text):
            """Echo.

            Args:
                text: Anything.
            """
            return text

        def hangs(prompt, response, answer):
            time.sleep(3600)

        def hangs_on_wrong_answers(prompt, response, answer):
            if response.strip() != answer:
                time.sleep(3600)
            return 1.0
    '''))
    return root


def config(store: Path, *overrides: str):
    return load_config(None, [f"storage.root={store}", "model.policy=models/policy", "data.prompts=data/train",
                              "data.heldout=null", "reward.genrm_weight=0", "reward.rule_weight=1", "dp=1",
                              "data.max_prompt_tokens=48", *overrides])


def refused(store: Path, *overrides: str) -> str:
    with pytest.raises(validation.InputError) as e:
        preflight.run(config(store, *overrides))
    return str(e.value)


def test_good_input_passes_and_is_remembered_so_the_hosts_skip_it(store):
    good = config(store)
    assert not preflight.passed(good)
    preflight.run(good)
    assert preflight.passed(good) and not preflight.passed(config(store, "seed=1"))
    # deployed hosts check their own devices and files, whatever passed here
    assert not preflight.passed(config(store, "hosts.launch=deployment"))


# ---------------------------------------------------------------------------- the layout against config.json


def test_a_megatron_layout_the_model_cannot_take_is_named_from_its_config_json(store):
    said = refused(store, "train.backend=megatron", "train.tensor_parallel=4")
    assert said.startswith("model.policy: file://") and "policy/config.json: num_attention_heads=4 and " \
        "num_key_value_heads=2 do not split over train.tensor_parallel=4 ranks" in said
    assert "num_hidden_layers=1 do not split into train.pipeline_parallel=2 stages" in refused(
        store, "train.backend=megatron", "train.pipeline_parallel=2")
    from transformers import LlamaConfig

    megatron = config(store, "train.backend=megatron", "train.tensor_parallel=2")
    with pytest.raises(validation.InputError, match=r"^x: intermediate_size=100 does not split over train\.tensor_parallel=8"):
        validation.check_megatron_split(config(store, "train.backend=megatron", "train.tensor_parallel=8", "dp=1"), "x",
                                        LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                                                    intermediate_size=100))
    with pytest.raises(validation.InputError, match=r"vocab_size=49 \(padded to 128\) does not split over "
                                                    r"train\.tensor_parallel=3"):
        validation.check_megatron_split(config(store, "train.backend=megatron", "train.tensor_parallel=3"), "x",
                                        LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                                                    intermediate_size=96, vocab_size=49))
    validation.check_megatron_split(megatron, "x", LlamaConfig(hidden_size=32, num_attention_heads=4,
                                                               num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2))


def test_a_vllm_tensor_parallel_the_model_cannot_take_is_named(store, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path / "six-heads")
    vllm = config(store, "train.fsdp=4", "rollout.backend=vllm", "rollout.tensor_parallel=4", "placement.stream_chunk=4")
    with pytest.raises(validation.InputError, match=r"num_attention_heads=6 and num_key_value_heads=3 do not split over "
                                                    r"rollout\.tensor_parallel=4 vLLM ranks"):
        validation.check_tensor_parallel(vllm, "rollout", "model.policy", str(tmp_path / "six-heads"))
    validation.check_tensor_parallel(vllm, "rollout", "model.policy", str(store / "models" / "policy"))  # 4 and 2: fine


def test_a_controller_whose_hosts_run_elsewhere_reads_a_remote_model_folder_without_its_weights(store, tmp_path, monkeypatch):
    """hosts.launch=deployment: the hosts download the weights on their machines; the command checks the
    folder's config, tokenizer and the names of its weights (pickles refused by name) without them."""
    import fsspec

    monkeypatch.setenv("YATTFLOW_CACHE", str(tmp_path / "cache"))
    memory = fsspec.filesystem("memory")
    for f in (store / "models" / "policy").iterdir():
        memory.pipe(f"/preflight-test/policy/{f.name}", f.read_bytes())
    path = validation.check_model_folder("model.policy", "memory://preflight-test/policy", weights=False)
    assert "config.json" in os.listdir(path) and not [n for n in os.listdir(path) if n.endswith(".safetensors")]
    memory.pipe("/preflight-test/pickled/config.json", (store / "models" / "policy" / "config.json").read_bytes())
    memory.pipe("/preflight-test/pickled/pytorch_model.bin", b"a pickle")
    with pytest.raises(validation.InputError, match=r"memory://preflight-test/pickled/pytorch_model\.bin: pickled weights"):
        validation.check_model_folder("model.policy", "memory://preflight-test/pickled", weights=False)


# ---------------------------------------------------------------------------- the environment and the tools


@pytest.mark.parametrize("overrides, said", [
    (["rollout.env={store}/nope.py:Fine"], r"^rollout\.env \S+nope\.py:Fine: no file "),
    (["rollout.env={store}/mine.py:Missing"], r"^rollout\.env: \S+mine\.py has no Class 'Missing'"),
    (["rollout.env={store}/mine.py:NoStep"], r"mine\.py:NoStep has no method step\(text\)"),
    (["rollout.env={store}/mine.py:WrongStep"], r"^file://\S+/data/train: rollout\.env \S+:WrongStep: prompt_id 0, turn 1: "
                                                r"step\(\) answers a Step or \(observation, reward, done\), not dict"),
    (["rollout.env={store}/mine.py:SlowStep", "rollout.tool_timeout_s=0.5"],
     r"prompt_id 0, turn 1: step\(\) ran past 0\.5s \(rollout\.tool_timeout_s\) when it was tried before the run"),
    (["rollout.tools=[{store}/mine.py:untyped]"], r"^rollout\.tools: \S+:untyped: no JSON schema"),
    (["rollout.tools=[{store}/mine.py:three]"], r"^rollout\.tools: \S+:three: it takes 3 arguments without defaults \(a, b, "
                                                r"c\), but the policy has no chat template .*"
                                                r"<tool_call>three\(text\)</tool_call>"),
    (["rollout.tools=[{store}/mine.py:a_number]"], r":a_number: its first parameter 'n' is typed integer, not text"),
])
def test_an_environment_or_tool_that_cannot_work_is_named(store, overrides, said):
    with_env = [o.format(store=store) for o in overrides] + (["reward.env_weight=1"] if "rollout.env" in overrides[0] else [])
    text = refused(store, *with_env)
    assert re.search(said, text), text


def test_environments_and_tools_that_can_work_pass(store):
    preflight.run(config(store, f"rollout.env={store}/mine.py:Fine", "reward.env_weight=1"))
    # the plain call format passes one text: a tool whose other parameters have defaults takes it
    preflight.run(config(store, f"rollout.tools=[{store}/mine.py:one_needed,engines.agents.tools:calculator]"))


# ---------------------------------------------------------------------------- the reward rule's time-out


def test_a_rule_that_hangs_is_cut_at_its_time_out_and_named_on_any_thread(store):
    rule = rewards.load_rule(f"{store}/mine.py:hangs", timeout_s=0.5)
    with pytest.raises(rewards.RuleTimeout, match=rf"^reward\.rule {store}/mine\.py:hangs ran past reward\.rule_timeout_s="
                                                  r"0\.5s on prompt_id 7, response 'r', answer 'a'"):
        rule("p", "r", "a", 7)  # the main thread: interrupted (SIGALRM)
    caught = []

    def elsewhere():  # another thread (the partial placement's judge): its call abandoned
        try:
            rule("p", "r", "a", 8)
        except rewards.RuleTimeout as e:
            caught.append(str(e))
        caught.append(rewards.load_rule("engines.demo.arithmetic:exact_match", timeout_s=0.5)("p", "20", "20", 9))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert "prompt_id 8" in caught[0] and caught[1] == 1.0
    # the pre-flight calls the rule on the first prompt (its reference answer as the response), within the time-out
    said = refused(store, f"reward.rule={store}/mine.py:hangs", "reward.rule_timeout_s=0.5")
    assert said.startswith(f"reward.rule {store}/mine.py:hangs ran past reward.rule_timeout_s=0.5s on prompt_id 0, ")
    assert said.endswith(f"(the first prompt of file://{store}/data/train, called with its reference answer as the response)")


def test_a_call_within_a_timed_call_keeps_the_sooner_deadline_and_restores_sigalrm():
    """An environment's step within the pre-flight's time-out, a rule within a caller's: the sooner
    deadline holds, the outer one after the inner call returns; the SIGALRM handler is put back."""
    import signal

    from engines import deadline

    def inner_then_sleep():
        assert deadline.call(30, lambda: 7) == 7  # returns: the outer deadline holds again
        threading.Event().wait(30)

    before = signal.getsignal(signal.SIGALRM)
    with pytest.raises(deadline.Expired):
        deadline.call(0.5, inner_then_sleep)
    with pytest.raises(deadline.Expired):
        deadline.call(0.5, deadline.call, 30, threading.Event().wait, 30)  # the outer one is the sooner
    assert signal.getsignal(signal.SIGALRM) is before


def test_a_rule_time_out_comes_before_the_stage_watchdog_and_is_no_lost_host(store):
    """The host's stage watchdog takes a stage without progress for timeouts.stage_s as a hung host and
    restarts the run's hosts (retries.run): a rule's own time-out must come first, and its error is the
    rule's (the run stops, naming it), not a lost host's."""
    from engines.wire.channel import HostError
    from flows.stops import failure_cause, input_error
    from flows.training import _host_lost

    assert rewards.timeout_of(config(store)) == 10.0
    assert rewards.timeout_of(config(store, "reward.rule_timeout_s=100", "timeouts.stage_s=60")) == 30.0
    error = HostError("genrm_score failed")
    error.remote = ("RuleTimeout", "reward.rule x:y ran past reward.rule_timeout_s=10s on prompt_id 3, response 'r'")
    assert not _host_lost(error) and input_error(error) and failure_cause(error).startswith("reward.rule x:y ran past")
    # scoring a rollout row on the host: the rule's time-out, naming the row's prompt and response
    rule = rewards.load_rule(f"{store}/mine.py:hangs_on_wrong_answers", timeout_s=0.5)
    row = {"prompt": "01+01=", "response": "21", "answer": "20", "prompt_id": 5, "response_ids": [1, 2]}
    assert rewards.scored(config(store), row | {"response": "20"}, None, None, rule, None)["rule_reward"] == 1.0
    with pytest.raises(rewards.RuleTimeout, match=r"on prompt_id 5, response '21', answer '20'"):
        rewards.scored(config(store), row, None, None, rule, None)


# ---------------------------------------------------------------------------- text that is not UTF-8


def _not_utf8(folder: Path, column: str = "prompt") -> Path:
    """Three prompts, the second's text with bytes that are not UTF-8 (Parquet stores what it is given)."""
    texts = [b"01+01=", b"02+02=\xff\xfe", b"03+03="]
    offsets = pa.array([0, *(sum(len(t) for t in texts[: i + 1]) for i in range(3))], pa.int32()).buffers()[1]
    bad = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"".join(texts))])
    if column == "messages":
        bad = pa.ListArray.from_arrays(pa.array([0, 1, 2, 3], pa.int32()),
                                       pa.StructArray.from_arrays([pa.array(["user"] * 3), bad], names=["role", "content"]))
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": [10, 11, 12], column: bad, "answer": ["20", "40", "60"]}), folder / "part-0.parquet")
    return folder


@pytest.mark.parametrize("column", ["prompt", "messages"])
def test_text_that_is_not_utf8_is_named_by_file_field_and_prompt_id(store, tmp_path, column):
    folder = _not_utf8(tmp_path / "bad", column)
    part = f"file://{folder}/part-0.parquet"
    said = rf"field '{column}' is not UTF-8 text \(prompt_id 11\): invalid start byte at byte \d+ of b'.*\\xff\\xfe'"
    with pytest.raises(datasets.SchemaError, match=rf"^{part} \(row group 0\): {said}"):
        datasets.PromptReader(str(folder)).rows([0])
    with pytest.raises(datasets.SchemaError, match=rf"^{part}: {said}"):
        datasets.read_table(str(folder), datasets.PROMPTS)
    text = refused(store, f"data.prompts={folder}")
    assert text.startswith(f"{part} (row group 0): field '{column}' is not UTF-8 text (prompt_id 11)")


# ---------------------------------------------------------------------------- images, bounded by pixels


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def test_an_image_that_declares_too_many_pixels_is_refused_before_it_is_decoded(monkeypatch, tmp_path):
    """A 164 KB PNG declaring 13000 x 13000 passed the byte limit and took 1.09 GB to decode: its header
    says how many pixels it has, and that is checked first, by data.max_image_pixels."""
    from engines.backends import multimodal
    from engines.host.prompts import PromptStream

    bomb = _png(13000, 13000)
    assert len(bomb) < 200_000

    def decoded(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr(multimodal, "decode", decoded)
    with pytest.raises(multimodal.ImageError, match=r"^where: 13000 x 13000 = 169,000,000 pixels, over data\.max_image_pixels="
                                                    r"16,777,216 \(484 MiB decoded as RGB\): resize it"):
        multimodal.check_image(bomb, "where", 20 * 2**20, pixels=True, max_pixels=4096 * 4096)
    multimodal.check_image(_png(64, 64), "where", 20 * 2**20, max_pixels=4096)  # within: read, not decoded (pixels=False)
    # the host reads a wave's rows and checks each image the same way before any is decoded
    path = tmp_path / "p.parquet"
    datasets.write_table(str(path), pa.Table.from_pylist([{"prompt_id": 3, "prompt": "<image>sum:", "images": [bomb]}]),
                         datasets.PROMPTS)
    with pytest.raises(multimodal.ImageError, match=r"p\.parquet \(prompt_id 3\): field 'images'\[0\]: 13000 x 13000"):
        PromptStream(str(path), 0, 1, max_image_pixels=4096 * 4096).wave(0, 1)


def test_decoding_respects_pils_own_bomb_guard(monkeypatch):
    from PIL import Image

    from engines.backends import multimodal

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # over twice this PIL raises DecompressionBombError
    with pytest.raises(multimodal.ImageError, match=r"^img: not a decodable image \(DecompressionBombError"):
        multimodal.decode(_png(64, 64), "img")


# ---------------------------------------------------------------------------- what a person sees: yattflow train


def yattflow_train(store: Path, home: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``yattflow train`` as a person runs it, without a Prefect server of its own (PREFECT_API_URL unset:
    the command would start a temporary one in ``home``)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(home)}
    home.mkdir(exist_ok=True)
    args = [f"storage.root={store}", "model.policy=models/policy", "data.prompts=data/train", "data.heldout=null",
            "reward.genrm_weight=0", "reward.rule_weight=1", "dp=1", "data.max_prompt_tokens=48", *overrides]
    return subprocess.run([sys.executable, "-m", "flows.cli", "train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def vlm_store(store: Path) -> tuple[str, str]:
    """A tiny vision-language policy and prompts whose second image declares 13000 x 13000 pixels."""
    from engines.demo import vision
    from tests.helpers import save_tiny_vlm

    policy = store / "models" / "vlm"
    if not policy.exists():
        save_tiny_vlm(policy)
    image = vision.make_problems(1, 0)[0][1][0]
    rows = [{"prompt_id": 1, "prompt": vision.PROMPT, "answer": "1+2=30", "images": [image]},
            {"prompt_id": 2, "prompt": vision.PROMPT, "answer": "1+2=30", "images": [_png(13000, 13000)]}]
    datasets.write_table(str(store / "data" / "bomb" / "part-0.parquet"), pa.Table.from_pylist(rows), datasets.PROMPTS)
    return str(policy), str(store / "data" / "bomb")


# (overrides, the line the command prints) for one bad input of each class: a config that does not load (refused
# in the command's own process), and two the pre-flight child refuses: user code that hangs (a rule), a file's
# content (an image's header). Every other bad input is refused on the same path, its message checked by a direct
# call above (the layout, the environment and tools, text that is not UTF-8).
CLASSES = {
    "config": (["train.lrr=1e-4"], r"yattflow: <defaults> \+ .* \+ train\.lrr=1e-4: field 'train\.lrr' is not a setting of "
                                   r"train \(did you mean train\.lr\?\)"),
    "rule": (["reward.rule={store}/mine.py:hangs", "reward.rule_timeout_s=1"],
             r"yattflow: reward\.rule \S+mine\.py:hangs ran past reward\.rule_timeout_s=1s on prompt_id 0, response '20', "
             r"answer '20'"),
    "image": (["model.policy={vlm}", "data.prompts={bomb}", "data.max_prompt_tokens=1024"],
              r"yattflow: file://\S+/data/bomb \(prompt_id 2\): field 'images'\[0\]: 13000 x 13000 = 169,000,000 pixels, "
              r"over data\.max_image_pixels=16,777,216"),
}


@pytest.mark.parametrize("case", list(CLASSES))
def test_yattflow_train_names_bad_input_in_one_line_before_anything_starts(store, tmp_path, case):
    """One line on stderr, exit code 2, no traceback and no ERROR line on the console (the traceback is
    in the log file), and nothing started: no temporary Prefect server (its home stays empty: no
    database, no server log), so no flow, no lease, no engine host (no run folder)."""
    overrides, line = CLASSES[case]
    paths = {"store": store}
    if case == "image":
        paths["vlm"], paths["bomb"] = vlm_store(store)
    name = f"preflight-{case}"
    done = yattflow_train(store, tmp_path / "home", f"name={name}", *(o.format(**paths) for o in overrides))
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(said) == 1 and re.fullmatch(line + ".*", said[0]), done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr and "ERROR" not in done.stderr
    assert list((tmp_path / "home").iterdir()) == []  # no Prefect server was started
    assert not (store / "runs" / name).exists()  # no run: no lease taken, no host started
    if case != "config":  # (a config that does not load has no log file yet)
        assert "Traceback" in (store / "logs" / f"{name}-train.log").read_text()
