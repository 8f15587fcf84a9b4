"""A user's own task: their reward rule, their prompts, their model folders.

Bad input fails before anything starts, naming the file, field or function (checked here by calling
the command's pre-flight, ``flows.preflight.run``, directly: tests/test_preflight.py runs the command);
a run whose rewards never differ stops saying why instead of training on nothing; ``prepare`` never
writes over a folder it did not make. The runs here are real: a Prefect server, engine-host processes
and the torch engines on the tiny prepared models.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.config import load_config
from engines.host.rewards import RewardRuleError, load_rule
from engines.host.validation import InputError
from flows import preflight
from flows.training import NothingToLearn
from tests.helpers import TINY, run_train, save_tiny_model, wrote_nothing



def checked(root: str, *extra: str) -> None:
    """What ``yattflow train`` checks before the Prefect server and the engine hosts start."""
    preflight.run(load_config(None, TINY + [f"storage.root={root}", *extra]))


def rule_file(folder: Path, body: str, name: str = "my_rules.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


# ---------------------------------------------------------------------------- the rule, unit by unit


def test_a_rule_loads_from_a_module_or_a_file_and_says_whether_it_needs_the_answer(tmp_path):
    assert load_rule("engines.demo.arithmetic:exact_match").needs_answer
    path = rule_file(tmp_path, """
        from helper_words import WORD  # a neighbour of the rule file: its folder is on sys.path

        def longer_is_better(prompt, response, answer=None):
            return len(response) / 8 + (WORD == "x")
    """)
    (tmp_path / "helper_words.py").write_text("WORD = 'x'\n")
    rule = load_rule(f"{path}:longer_is_better")
    assert not rule.needs_answer
    assert rule("p", "abcd", None, prompt_id=7) == 1.5


@pytest.mark.parametrize("spec, words", [
    ("no_such_module_here:f", ["cannot import module 'no_such_module_here'", "PYTHONPATH", "reward.rule=path/to/no_such_module_here.py:f"]),
    ("engines.demo.arithmetic:no_such_function", ["engines.demo.arithmetic has no function 'no_such_function'"]),
    ("engines.demo.arithmetic", ["neither 'module:function' nor 'path/to/file.py:function'"]),
    ("missing/rules.py:f", ["no file", "missing/rules.py"]),
])
def test_a_rule_that_cannot_be_imported_is_named(spec, words):
    with pytest.raises(RewardRuleError) as err:
        load_rule(spec)
    for w in words:
        assert w in str(err.value)


def test_a_rule_with_the_wrong_parameters_or_a_non_number_is_named(tmp_path):
    path = rule_file(tmp_path, """
        def two(prompt, response):
            return 1.0

        def text(prompt, response, answer):
            return "yes"

        def nan(prompt, response, answer):
            return float("nan")
    """)
    with pytest.raises(RewardRuleError, match=r"called as two\(prompt, response, answer\), but it takes \(prompt, response\)"):
        load_rule(f"{path}:two")
    with pytest.raises(RewardRuleError, match=rf"reward.rule {path}:text returned 'yes' \(str\) for prompt_id 42: .*finite number"):
        load_rule(f"{path}:text")("p", "r", "a", 42)
    with pytest.raises(RewardRuleError, match=r"returned nan \(float\) for prompt_id 3"):
        load_rule(f"{path}:nan")("p", "r", "a", 3)


# ---------------------------------------------------------------------------- before any engine loads


def prompts_without_answers(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt_id": [1, 2, 3], "prompt": ["01+01=", "02+02=", "03+03="]}), folder / "part-0.parquet")
    return folder


def test_prompts_without_the_answer_the_rule_reads_fail_before_anything_starts(prepared, tmp_path):
    """The rule takes an answer and the judge's template has one: a prompts file without the
    column is refused, naming the file, the field, the first prompt and who reads it."""
    prompts = prompts_without_answers(tmp_path / "mine")
    with pytest.raises(InputError) as err:
        checked(prepared, "name=no-answers", "dp=1", f"data.prompts={prompts}", "reward.genrm_weight=0", "reward.rule_weight=1")
    text = str(err.value)
    assert f"{prompts}" in text and "field 'answer' is missing or null in 3 of 3 rows (first prompt_id 1)" in text
    assert "reward.rule engines.demo.arithmetic:exact_match" in text and "answer=None" in text
    assert wrote_nothing(Path(prepared) / "runs" / "no-answers")


def test_a_rule_that_needs_no_answer_trains_on_prompts_without_one_from_a_file_path(prepared, tmp_path):
    """The same answerless prompts with a rule that declares answer=None, given as a file path
    (imported by the engine hosts, whose working directory is not the rule's folder)."""
    prompts = prompts_without_answers(tmp_path / "mine")
    rule = rule_file(tmp_path, """
        def short_answers(prompt, response, answer=None):
            return 1.0 if len(response) <= 2 else 0.0
    """)
    summary = run_train(prepared, "name=own-rule", "dp=1", "steps=1", f"data.prompts={prompts}", "data.heldout=null",
                        "reward.genrm_weight=0", "reward.rule_weight=1", f"reward.rule={rule}:short_answers",
                        "sampling.max_empty_steps=null")
    assert summary["heldout_metric"] is None and len(summary["history"]) == 1
    # every scored sample got the rule's own verdict on its response, and the step's reward is their mean
    scored = [r for f in sorted((Path(prepared) / "runs" / "own-rule" / "steps" / "000000").glob("scored/group=*/*.parquet"))
              for r in pq.read_table(f, columns=["response", "reward"]).to_pylist()]
    assert scored and all(r["reward"] == (1.0 if len(r["response"]) <= 2 else 0.0) for r in scored)
    assert summary["history"][0]["reward"] == pytest.approx(sum(r["reward"] for r in scored) / len(scored))


def test_without_a_rule_the_heldout_score_is_the_judges_verdict_rate_and_eval_every_tags_each_step(prepared):
    """A GenRM-only task still gets its held-out figure, named for what it is; with eval.every=1
    every step's metrics carry it, tagged with the policy version and the checkpoint measured."""
    from storage.runstate import checkpoint_uri

    summary = run_train(prepared, "name=judge-only", "dp=1", "steps=2", "reward.rule=null", "sampling.max_empty_steps=null",
                        "eval.every=1", "checkpoint.every=2")
    assert summary["heldout_metric"] == "judge 'correct' rate"

    def a_rate_over_the_heldout_prompts(x: float) -> bool:  # k of the 40 prompts judged correct (TINY: heldout_limit=40)
        return 0.0 <= x <= 1.0 and abs(x * 40 - round(x * 40)) < 1e-9

    assert a_rate_over_the_heldout_prompts(summary["heldout_before"]) and a_rate_over_the_heldout_prompts(summary["heldout_after"])
    first, last = summary["history"]
    assert a_rate_over_the_heldout_prompts(first["heldout"]) and first["heldout_checkpoint"] is None and first["policy_version"] >= 1
    assert last["heldout"] == summary["heldout_after"]  # the same weights, scored the same greedy way
    assert last["heldout_checkpoint"] == checkpoint_uri(f"file://{prepared}/runs/judge-only", 1)


def test_a_rule_returning_text_fails_before_anything_starts_naming_rule_prompt_and_value(prepared, tmp_path):
    rule = rule_file(tmp_path, """
        def verdict(prompt, response, answer):
            return "correct" if response == answer else "wrong"
    """)
    with pytest.raises(InputError) as err:
        checked(prepared, "name=text-rule", "dp=1", "reward.genrm_weight=0", "reward.rule_weight=1", f"reward.rule={rule}:verdict")
    text = str(err.value)
    assert f"reward.rule {rule}:verdict returned 'correct' (str) for prompt_id 0" in text
    assert wrote_nothing(Path(prepared) / "runs" / "text-rule")


def test_a_verdict_word_the_judges_tokenizer_cannot_spell_is_named(prepared):
    # the demo's character tokenizer knows lower-case letters only
    with pytest.raises(InputError) as err:
        checked(prepared, "name=bad-verdict", "dp=1", "judge.good=CORRECT")
    assert "judge.good: the judge's tokenizer" in str(err.value) and "cannot spell 'CORRECT'" in str(err.value)


# ---------------------------------------------------------------------------- nothing to learn


def test_steps_that_keep_nothing_warn_then_stop_the_run_naming_the_causes(prepared, tmp_path, caplog):
    """A rule that scores everything 0: every group's rewards are equal, nothing is kept. The
    first such step warns; sampling.max_empty_steps=2 of them in a row stop the run, saying why."""
    rule = rule_file(tmp_path, """
        def always_zero(prompt, response, answer):
            return 0
    """)
    with pytest.raises(NothingToLearn) as err:
        run_train(prepared, "name=empty", "dp=1", "steps=5", "data.heldout=null", "reward.genrm_weight=0", "reward.rule_weight=1",
                  f"reward.rule={rule}:always_zero", "sampling.max_empty_steps=2", "sampling.max_waves=1")
    text = str(err.value)
    assert re.search(r"step 2 kept no prompt group: all \d+ groups of 4 samples had equal rewards \(mean reward 0.000\)", text)
    assert "(2 such step(s) in a row)" in text and "the 'answer' column of data/train (data.prompts)" in text
    assert "Stopped after sampling.max_empty_steps=2" in text
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "kept no prompt group" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("step 1 kept no prompt group")


# ---------------------------------------------------------------------------- prepare never overwrites


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("field", ["model.policy", "data.prompts"])
def test_prepare_stops_at_a_folder_it_did_not_make_and_writes_nothing(prefect_server, tmp_path, field):
    from flows.prepare import prepare
    from flows.sft import WouldOverwrite

    mine = tmp_path / "mine"
    if field == "model.policy":
        save_tiny_model(mine)
        precious = mine / "model.safetensors"
    else:
        precious = prompts_without_answers(mine) / "part-0.parquet"
    before, files = md5(precious), sorted(p.name for p in mine.iterdir())
    root = tmp_path / "root"
    with pytest.raises(WouldOverwrite, match=rf"{field}: .*{mine} already holds files that yattflow did not write .*never overwrites"):
        prepare(overrides=TINY + [f"storage.root={root}", f"{field}={mine}"])
    assert md5(precious) == before and sorted(p.name for p in mine.iterdir()) == files
    assert not (root / "data").exists() and not (root / "models").exists()  # refused before writing anything
