"""``yattflow rm``: train a scalar reward model (a sequence-classification head with one output)
from preference pairs, with the Bradley-Terry loss, into a Hugging Face folder that
``model.reward_model`` can name.

    yattflow rm rm.data=mine/prefs rm.heldout=mine/prefs-heldout rm.base=models/my-sft rm.output=models/my-rm
    yattflow rm -c deployments/demo.yaml rm.demo=true      # the arithmetic demo's pairs, after `yattflow prepare`

The pairs' columns are checked before any model loads. Every ``rm.check_every`` steps the held-out
pairwise accuracy is printed and the whole training state goes to ``runs/<name>/rm``: the same
command after Ctrl-C, a crash or a missed ``rm.target`` continues from there (``flows/sft.py``'s
state files), and the state is deleted once the model is committed (MANIFEST.json last). The
maths are in ``engines/reward_model.py``.
"""

from __future__ import annotations

import tempfile

import pyarrow as pa
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines import reward_model
from engines.backends import chat
from engines.config import ConfigError, RunConfig, load_config
from engines.demo import arithmetic
from flows.curves import percent
from flows.console import shown
from flows.sft import _load_state, _save_state, local_base, needs_building
from flows.training import run_label
from storage import datasets, objectstore

STATE_NAME = "rm"  # runs/<name>/rm: the resume state
DEMO_DATA = ("data/rm/train", "data/rm/heldout")  # rm.demo's pairs
# What changes the weights training computes: a saved state made under other values is not continued.
SETUP_FIELDS = ("data", "base", "batch_size", "lr")
SCRATCH_FIELDS = ("hidden_size", "layers", "heads", "kv_heads", "init_std")  # sft.*: the from-scratch shape
PAIRS = pa.schema([pa.field("prompt", pa.string()), pa.field("messages", datasets.MESSAGES),
                   pa.field("chosen", pa.string(), nullable=False), pa.field("rejected", pa.string(), nullable=False)],
                  metadata={"one_of": "prompt,messages"})


class RMNotConverged(RuntimeError):
    """The reward model did not reach its held-out target within rm.steps."""


def read_pairs(uri: str, field: str) -> list[tuple[chat.Prompt, str, str]]:
    """(prompt, chosen, rejected) from the Parquet file or folder ``uri`` (the config field ``field``):
    the prompt is the row's ``messages`` when it has them, else its ``prompt`` text."""
    try:
        table = datasets.read_table(uri, PAIRS)
    except (datasets.SchemaError, objectstore.StorageError) as e:
        raise datasets.SchemaError(f"{field}: {e} (preference pairs: columns 'chosen' and 'rejected', and 'prompt' or "
                                   "'messages')") from None
    if not len(table):
        raise datasets.SchemaError(f"{field}: {uri} has no rows")
    out = []
    for i, row in enumerate(table.to_pylist()):
        if not row["messages"] and row["prompt"] is None:
            raise datasets.SchemaError(f"{field}: {uri}: row {i}: field 'prompt' is null and there are no 'messages'")
        out.append((chat.source(row), row["chosen"], row["rejected"]))
    return out


def write_demo_pairs(config: RunConfig) -> tuple[str, str]:
    """The arithmetic demo's preference pairs, from ``yattflow prepare``'s problems (the same split:
    held-out pairs are of held-out prompts), unless already written."""
    from flows.prepare import _problems, _write_dataset

    train, heldout = _problems(config)
    for path, problems, seed in ((DEMO_DATA[0], train, config.seed), (DEMO_DATA[1], heldout, config.seed + 1)):
        if needs_building(config.uri(path), "storage.root"):
            rows = arithmetic.hard_preference_pairs(problems, seed)
            _write_dataset(config.uri(path), pa.table({"prompt": [p for p, *_ in rows], "messages": pa.nulls(len(rows), datasets.MESSAGES),
                                                       "chosen": [c for *_, c, _ in rows], "rejected": [r for *_, r in rows]}), PAIRS)
    return DEMO_DATA


@task(cache_policy=NO_CACHE, task_run_name="train reward model")
def train_reward_model(config: RunConfig) -> dict:
    """Train ``rm.base`` (or a tiny model from scratch) on ``rm.data`` and commit it to ``rm.output``."""
    logger, settings = get_run_logger(), config.rm
    output = config.uri(settings.output)
    if not needs_building(output, "rm.output"):
        logger.info("rm: a model is already committed at %s", output, extra=shown("note"))
        return {"uri": output, "skipped": True}
    pairs = read_pairs(config.uri(settings.data), "rm.data")
    check = read_pairs(config.uri(settings.heldout), "rm.heldout") if settings.heldout is not None else []
    base = local_base(config, settings.base, "rm.base")
    state_folder = objectstore.join(config.run_uri, STATE_NAME)
    scratch = config.sft.model_dump(include=set(SCRATCH_FIELDS))
    setup = settings.model_dump(include=set(SETUP_FIELDS)) | {"seed": config.seed} | ({} if base else scratch)
    resume = _load_state(objectstore.join(state_folder, "state.pt"), setup)
    texts = [t for p, c, r in pairs + check for t in (p if isinstance(p, str) else "".join(m["content"] for m in p), c, r)]
    try:
        model, tokenizer = reward_model.start_classifier(
            base, texts, config.seed, hidden_size=scratch["hidden_size"], num_layers=scratch["layers"],
            num_heads=scratch["heads"], num_kv_heads=scratch["kv_heads"], init_std=scratch["init_std"])
    except reward_model.NotARewardModel as e:
        raise ConfigError(f"rm.base: {e}: a base is a causal LM or a sequence classifier with num_labels=1") from None
    renderer = chat.Renderer(tokenizer, chat.PromptFormat.policy(config))  # as the engine hosts render for it
    logger.info("rm: %d preference pairs, %d held out, from %s, %s parameters", len(pairs), len(check),
                settings.base or "scratch (a tiny Llama, character tokenizer)", f"{sum(p.numel() for p in model.parameters()):,}",
                extra=shown("start", name="rm", run=config.name, done=resume["step"] if resume else 0, total=settings.steps))
    goal = "" if settings.target is None else f" (stops at {percent(settings.target)})"

    def checked(c: dict) -> None:
        logger.info("rm step %d/%d loss %.4f held-out pairwise accuracy %s (%.0fs)", c["step"], c["steps"], c["loss"],
                    percent(c["accuracy"]), c["seconds"], extra=shown(
                        "advance", name="rm", run=config.name, done=c["step"], total=c["steps"],
                        figures=f"loss {c['loss']:.4f}, held-out pairwise accuracy {percent(c['accuracy'])}{goal}"))

    try:
        result = reward_model.train(model, tokenizer, renderer, pairs, check, target=settings.target, steps=settings.steps,
                                    check_every=settings.check_every, batch_size=settings.batch_size, lr=settings.lr,
                                    seed=config.seed, resume=resume, on_check=checked,
                                    save=lambda state: _save_state(state_folder, state | {"setup": setup}))
    except chat.ChatTemplateError as e:
        raise ConfigError(f"rm.data: {e} (the reward model's tokenizer, data.chat_template={config.data.chat_template})") from None
    if settings.target is not None and not result["converged"]:
        raise RMNotConverged(
            f"rm reached {percent(result['accuracy'])} held-out pairwise accuracy after {result['steps']} steps, short of "
            f"rm.target={settings.target}: raise rm.steps ({settings.steps}) and run the same command (it continues from "
            f"step {result['steps']}), or change rm.lr ({settings.lr}); nothing was written to {output}")
    with tempfile.TemporaryDirectory() as tmp:  # written whole locally, then committed by its MANIFEST.json, last
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        objectstore.upload_folder(tmp, output)
    objectstore.remove(state_folder)
    logger.info("rm: held-out pairwise accuracy %s, loss %.4f after %d steps (%.0fs) → %s", percent(result["accuracy"]),
                result["loss"], result["steps"], result["seconds"], output,
                extra=shown("finish", name="rm", run=config.name, done=result["steps"]))
    return {"uri": output, **result}


def summary_line(result: dict) -> str:
    """What ``yattflow rm`` prints at the end: ``held-out pairwise accuracy 97.0%, loss … after 400 steps; model: …``."""
    if result.get("skipped"):
        return f"a model is already committed at {result['uri']} (nothing trained)"
    return (f"held-out pairwise accuracy {percent(result['accuracy'])}, loss {result['loss']:.4f} after {result['steps']} "
            f"steps; model: {result['uri']}")


@flow(name="rm", flow_run_name=run_label("rm"))
def rm(config_file: str | None = None, overrides: list[str] | None = None) -> dict:
    config = load_config(config_file, overrides or [])
    objectstore.check_reachable(config.uri(""))
    if config.rm.demo:
        data, heldout = write_demo_pairs(config)
        config = config.model_copy(update={"rm": config.rm.model_copy(update={"data": config.rm.data or data,
                                                                              "heldout": config.rm.heldout or heldout})})
    if config.rm.data is None:
        raise ConfigError("rm.data is not set: name a Parquet file or folder of preference pairs (columns 'chosen', "
                          "'rejected', and 'prompt' or 'messages'), e.g. rm.data=data/my-prefs; or rm.demo=true")
    return train_reward_model(config)
