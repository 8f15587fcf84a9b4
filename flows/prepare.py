"""Prepare the demo: prompt datasets, a tokenizer and two tiny models, all built locally.

Nothing can be downloaded here, so ``prepare`` makes what a user would otherwise point
the config at: Arrow prompt datasets (train and held-out) and two Hugging Face folders —
the policy, warm-started by SFT on a sloppy teacher's demonstrations, and a generative
reward model, trained by SFT to write ``correct``/``wrong`` for a candidate answer given
the reference. Each output is skipped when it is already committed (its manifest), so
``prepare`` is cheap to run again; an output folder that holds anything else is somebody's data
or model, and ``prepare`` stops, naming it, rather than write over it.
"""

from __future__ import annotations

import tempfile

import pyarrow as pa
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines import arithmetic
from engines.sft import sft
from engines.tiny import build_char_tokenizer, build_tiny_llama
from engines.torch_engines import TorchGenerator
from engines.config import RunConfig, load_config
from flows.training import run_label
from storage import datasets, objectstore


class WouldOverwrite(RuntimeError):
    """An output of ``prepare`` is a folder it did not make: it is never overwritten."""


# A dataset's commit marker: with a leading underscore, which Parquet readers (pyarrow, pandas,
# Spark) skip, so the folder still reads as a dataset outside yattflow too.
DATASET_MANIFEST = "_MANIFEST.json"


def needs_building(uri: str, field: str) -> bool:
    """Whether ``prepare`` should build its output ``uri`` (the config field ``field``): yes when
    nothing is there, no when ``prepare`` (or any yattflow upload) committed it already (a model's
    MANIFEST.json, a dataset's _MANIFEST.json). Anything else is somebody's data or model, and
    ``prepare`` stops, naming it."""
    if any(objectstore.exists(objectstore.join(uri, marker)) for marker in ("MANIFEST.json", DATASET_MANIFEST)):
        return False
    if objectstore.exists(uri) and objectstore.list_files(uri):
        raise WouldOverwrite(
            f"{field}: {uri} already holds files that prepare did not write (it has no MANIFEST.json or "
            f"{DATASET_MANIFEST}), and prepare never overwrites them: point {field} at a new folder (e.g. "
            f"{field}=models/my-prepared), or move that folder away"
        )
    return True


def _write_prompts(uri: str, problems: list[tuple[str, str]], first_id: int) -> None:
    table = pa.table({
        "prompt_id": pa.array(range(first_id, first_id + len(problems)), pa.int64()),
        "prompt": [p for p, _ in problems],
        "answer": [a for _, a in problems],
    })
    datasets.write_table(objectstore.join(uri, "part-00000.parquet"), table, datasets.PROMPTS)
    objectstore.write_json(objectstore.join(uri, DATASET_MANIFEST), {"files": ["part-00000.parquet"]})  # last: committed


def _problems(config: RunConfig) -> tuple[list, list]:
    p = config.prepare
    heldout = arithmetic.make_problems(p.heldout_prompts, p.digits, seed=config.seed + 1)
    train = arithmetic.make_problems(p.train_prompts, p.digits, seed=config.seed + 2, exclude={q for q, _ in heldout})
    return train, heldout


@task(cache_policy=NO_CACHE, task_run_name="make prompt datasets")
def make_datasets(config: RunConfig) -> dict:
    train, heldout = _problems(config)
    for field, path, problems, first in (("data.prompts", config.data.prompts, train, 0),
                                         ("data.heldout", config.data.heldout, heldout, 10_000_000)):
        if path is None:
            continue
        uri = config.uri(path)
        if needs_building(uri, field):
            _write_prompts(uri, problems, first)
    return {"train": len(train), "heldout": len(heldout)}


class SFTNotConverged(RuntimeError):
    """The warm start did not learn its demonstrations within ``prepare.sft_max_steps``."""


@task(cache_policy=NO_CACHE, task_run_name="sft {role}")
def sft_model(config: RunConfig, role: str) -> dict:
    """SFT a fresh tiny Llama for ``role`` ("policy" or "judge") and commit its folder.

    The policy trains until it answers held-out prompts as the teacher most often does (the
    carry mistake learned); the judge until its held-out verdicts are right. Both results
    are then the same on every CPU, whatever its floating-point kernels."""
    logger = get_run_logger()
    field = "model.policy" if role == "policy" else "model.judge"
    uri = config.uri(config.model.policy if role == "policy" else config.model.judge)
    if not needs_building(uri, field):
        logger.info("%s model already at %s", role, uri)
        return {"uri": uri, "skipped": True}
    p = config.prepare
    train, heldout = _problems(config)
    # what differs between the two roles, in one place: demonstrations, held-out check, target
    # and its field, initialisation, learning rate and its field
    if role == "policy":
        pairs = arithmetic.teacher_demonstrations(train, p.teacher_slip, seed=config.seed)
        check = arithmetic.teacher_majority(heldout, p.teacher_slip)
        target, target_field, init_std, lr, lr_field = p.sft_target, "sft_target", p.policy_init_std, p.sft_lr, "sft_lr"
    else:
        pairs = arithmetic.judge_examples(train, config.judge.template, seed=config.seed)
        check = arithmetic.judge_examples(heldout, config.judge.template, seed=config.seed + 1)
        target, target_field, init_std, lr, lr_field = p.judge_target, "judge_target", p.judge_init_std, p.judge_sft_lr, "judge_sft_lr"
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(
        len(tokenizer), hidden_size=p.hidden_size, num_layers=p.layers, num_heads=p.heads, num_kv_heads=p.kv_heads,
        seed=config.seed, init_std=init_std,
    )
    result = sft(
        model, tokenizer, pairs, check, target=target, max_steps=p.sft_max_steps, check_every=p.sft_check_every,
        batch_size=p.sft_batch_size, lr=lr, seed=config.seed, log=logger.info,
    )
    if not result["converged"]:
        raise SFTNotConverged(
            f"{role} SFT reached {100 * result['exact_match']:.1f}% held-out exact match after {result['steps']} steps, "
            f"short of prepare.{target_field}={target}: raise prepare.sft_max_steps ({p.sft_max_steps}) or change "
            f"prepare.{lr_field} ({lr}); nothing was written to {uri}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # the figure users compare with RL's: the right answer, not the teacher's
        accuracy = heldout_accuracy(tmp, heldout) if role == "policy" else result["exact_match"]
        objectstore.upload_folder(tmp, uri)
    logger.info(
        "%s model: held-out %s %.1f%% after %d SFT steps (%.0fs) → %s", role,
        "exact match" if role == "policy" else "verdict accuracy", 100 * accuracy, result["steps"], result["seconds"], uri,
    )
    return {"uri": uri, "heldout_exact_match": accuracy, "sft_steps": result["steps"], "sft_seconds": result["seconds"]}


def heldout_accuracy(model_dir: str, problems: list[tuple[str, str]]) -> float:
    """Greedy exact match on the right answers, through the same loading code as RL's engines."""
    outs = TorchGenerator(model_dir).generate([q for q, _ in problems], greedy=True, max_new_tokens=8)
    return sum(o.response == problems[o.prompt_index][1] for o in outs) / len(problems)


@flow(name="prepare", flow_run_name=run_label("prepare"))
def prepare(config_file: str | None = None, overrides: list[str] | None = None) -> dict:
    config = load_config(config_file, overrides or [])
    objectstore.check_reachable(config.uri(""))
    outputs = {"data.prompts": config.data.prompts, "data.heldout": config.data.heldout,
               "model.policy": config.model.policy, "model.judge": config.model.judge}
    for field, path in outputs.items():  # refuse somebody's folder before writing anything
        if path is not None:
            needs_building(config.uri(path), field)
    counts = make_datasets(config)
    # One after the other: torch's global RNG seeds each model's initialisation, and two
    # threads drawing from it at once would make the demo irreproducible.
    return {"datasets": counts, "policy": sft_model(config, "policy"), "judge": sft_model(config, "judge")}
