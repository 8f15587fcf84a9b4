"""``yattflow sft``: supervised fine-tuning of a causal LM on a Parquet of prompts and the
completions to learn: the warm start that RL begins from.

    yattflow sft sft.data=mine/sft sft.heldout=mine/sft-heldout sft.output=models/mine-sft

The examples' columns are checked before any model loads. Training starts from ``sft.base``
(any Hugging Face folder, local or on object storage) or from a tiny Llama built from
scratch, runs in ``engines/sft.py``, and the model folder is committed with its MANIFEST.json
last. Every ``sft.check_every`` steps the whole training state goes to ``runs/<name>/sft``:
the same command after Ctrl-C, a crash or a missed ``sft.target`` continues from there, and
the state is deleted once the model is committed. ``prepare`` trains the demo's two models
with the same task.
"""

from __future__ import annotations

import io
import pickle
import tempfile

import pyarrow as pa
import torch
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.backends import chat
from engines.config import ConfigError, RunConfig, SFTConfig, load_config
from engines.sft import sft as train_sft
from engines.sft import start_model
from flows.curves import percent
from flows.console import shown
from flows.training import run_label
from storage import datasets, objectstore
from storage.runstate import RunStateError

# A dataset's commit marker: with a leading underscore, which Parquet readers (pyarrow, pandas,
# Spark) skip, so the folder still reads as a dataset outside yattflow too.
DATASET_MANIFEST = "_MANIFEST.json"
# What changes the weights SFT computes: a saved state made under other values is not continued.
# (max_steps, target, check_every and output may change between a run and its continuation.)
# SFT's resume state, in runs/<name>/<sft name>/: the whole training state, and the step it holds
STATE, PROGRESS = "state.pt", "progress.json"
SETUP_FIELDS = ("data", "prompt_field", "response_field", "base", "batch_size", "lr", "hidden_size", "layers", "heads",
                "kv_heads", "init_std", "experts", "vision")


class WouldOverwrite(RuntimeError):
    """An output folder holds files yattflow did not write: it is never overwritten."""


class SFTNotConverged(RuntimeError):
    """SFT did not reach its held-out target within its step limit."""


def needs_building(uri: str, field: str) -> bool:
    """Whether to build the output ``uri`` (the config field ``field``): yes when nothing is there, no
    when yattflow committed it already (a model's MANIFEST.json, a dataset's _MANIFEST.json). Anything
    else is somebody's data or model: stop, naming it."""
    if any(objectstore.exists(objectstore.join(uri, marker)) for marker in ("MANIFEST.json", DATASET_MANIFEST)):
        return False
    if objectstore.exists(uri) and objectstore.list_files(uri):
        raise WouldOverwrite(
            f"{field}: {uri} already holds files that yattflow did not write (it has no MANIFEST.json or "
            f"{DATASET_MANIFEST}), and yattflow never overwrites them: point {field} at a new folder, or move that "
            "folder away"
        )
    return True


def read_examples(uri: str, prompt_field: str, response_field: str, field: str) -> tuple[list[tuple], list | None]:
    """(prompt, completion) pairs from the Parquet file or folder ``uri``, in file order, and each
    pair's encoded images when the file has an ``images`` column (else None). A prompt is the
    ``prompt_field`` text, or where that is null or absent the row's ``messages`` (a chat: ``[{role,
    content}]``, the turns before the completion, as RL's prompts files have them), which the model's
    chat template renders as RL's engines do."""
    schema = pa.schema([pa.field(prompt_field, pa.string()), pa.field("messages", datasets.MESSAGES),
                        pa.field(response_field, pa.string(), nullable=False),
                        pa.field("images", pa.list_(pa.binary()))], metadata={"one_of": f"{prompt_field},messages"})
    try:
        table = datasets.read_table(uri, schema)
    except (datasets.SchemaError, objectstore.StorageError) as e:
        raise datasets.SchemaError(
            f"{field}: {e} (columns '{prompt_field}' and '{response_field}': set sft.prompt_field, sft.response_field or "
            "sft.heldout_field to the names in the file; a chat's 'messages' may stand for the prompt)") from None
    if not len(table):
        raise datasets.SchemaError(f"{field}: {uri} has no rows")
    images = table.column("images")
    prompts = [text if text is not None else messages
               for text, messages in zip(table.column(0).to_pylist(), table.column(1).to_pylist())]
    if any(p is None or p == [] for p in prompts):
        row = next(i for i, p in enumerate(prompts) if p is None or p == [])
        raise datasets.SchemaError(f"{field}: {uri} row {row} has neither a '{prompt_field}' text nor 'messages'")
    pairs = list(zip(prompts, table.column(2).to_pylist()))
    return pairs, None if images.null_count == len(table) else [im or [] for im in images.to_pylist()]


def tool_schemas(config: RunConfig, renderer: chat.Renderer) -> list[dict] | None:
    """The JSON schemas of ``rollout.tools`` as RL's episodes put them in every prompt (None: no tools), so that
    SFT renders its prompts as RL will (engines/agents/episodes.py)."""
    if not config.rollout.tools:
        return None
    from engines.agents import tools as toolbox

    try:
        loaded = toolbox.load(config.rollout.tools, plain=not renderer.templated)
    except toolbox.ToolError as e:
        raise ConfigError(str(e)) from None
    if renderer.templated and not renderer.supports_tools():
        raise ConfigError(f"rollout.tools={config.rollout.tools}: the model's chat template does not render tools (it never "
                          "reads 'tools'), so RL's prompts would not show them either: use a model whose template does")
    return [toolbox.schema(fn) for fn in loaded.values()] or None


def _text(prompt) -> str:
    """A prompt's characters (a chat's contents): what a character tokenizer built from scratch must spell."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] or "" for m in prompt)


@task(cache_policy=NO_CACHE, task_run_name="{name}")
def fine_tune(config: RunConfig, settings: SFTConfig, name: str = "sft", fields: dict[str, str] | None = None) -> dict:
    """SFT ``settings.base`` (or a tiny model from scratch) on ``settings.data`` and commit it to
    ``settings.output``; its resume state lives in ``runs/<config.name>/<name>``. ``fields`` names
    the config fields that set ``settings`` where they are not ``sft.*`` (prepare's)."""
    logger = get_run_logger()
    field = {key: f"sft.{key}" for key in SFTConfig.model_fields} | (fields or {})
    output = config.uri(settings.output)
    if not needs_building(output, field["output"]):
        logger.info("%s: a model is already committed at %s", name, output, extra=shown("note"))
        return {"uri": output, "skipped": True}
    pairs, images = read_examples(config.uri(settings.data), settings.prompt_field, settings.response_field, field["data"])
    check, check_images = [], None
    if settings.heldout is not None:
        check, check_images = read_examples(config.uri(settings.heldout), settings.prompt_field,
                                            settings.heldout_field or settings.response_field, field["heldout"])
    base = local_base(config, settings.base, field["base"])

    state_folder = objectstore.join(config.run_uri, name)
    setup = settings.model_dump(include=set(SETUP_FIELDS)) | {"seed": config.seed}
    resume = _load_state(objectstore.join(state_folder, STATE), setup)
    model, tokenizer, processor = start_model(
        base, [_text(text) for pair in pairs + check for text in pair], config.seed, hidden_size=settings.hidden_size,
        num_layers=settings.layers, num_heads=settings.heads, num_kv_heads=settings.kv_heads, init_std=settings.init_std,
        experts=settings.experts, vision=settings.vision_family,
    )
    if (images is not None or check_images is not None) and processor is None:
        raise ConfigError(f"{field['data']}: the examples have an 'images' column, but the model SFT starts from is a text "
                          f"model: set {field['base']} to a vision-language folder, or sft.vision=true to build a tiny one")
    if processor is not None and (images is None or (check and check_images is None)):
        raise ConfigError(f"{field['data']}: a vision-language model learns from examples with an 'images' column "
                          "(a list of encoded images per example; the prompt holds one image placeholder per image)")
    kind = {"idefics3": "Idefics3", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}.get(settings.vision_family) if settings.vision else f"Qwen3-MoE of {settings.experts} experts" if settings.experts else "Llama"
    scratch = f"scratch (a tiny {kind}, character tokenizer)"
    logger.info("%s: %d examples, %d held out, from %s, %s parameters", name, len(pairs), len(check),
                settings.base or scratch, f"{sum(p.numel() for p in model.parameters()):,}",
                extra=shown("start", name=name, run=config.name, done=resume["step"] if resume else 0, total=settings.max_steps))

    goal = "" if settings.target is None else f" (stops at {percent(settings.target)})"  # else at max_steps, what the bar counts to

    def checked(c: dict) -> None:
        logger.info("%s step %d/%d loss %.4f held-out exact match %s (%.0fs)", name, c["step"], c["max_steps"], c["loss"],
                    percent(c["exact_match"]), c["seconds"], extra=shown(
                        "advance", name=name, run=config.name, done=c["step"], total=c["max_steps"],
                        figures=f"loss {c['loss']:.4f}, held-out exact match {percent(c['exact_match'])}{goal}"))

    def progress(c: dict) -> None:  # between checks, at least every 30 s: a real model's checks are minutes apart
        logger.info("%s step %d/%d loss %.4f (%.0fs)", name, c["step"], c["max_steps"], c["loss"], c["seconds"], extra=shown(
            "advance", name=name, run=config.name, done=c["step"], total=c["max_steps"],
            figures=f"loss {c['loss']:.4f} (held-out check every {settings.check_every} steps){goal}"))

    # the prompts as RL renders them: the policy's chat template, data.system_prompt and rollout.tools' schemas
    renderer = chat.Renderer(processor or tokenizer, chat.PromptFormat.policy(config))
    schemas = tool_schemas(config, renderer)
    if schemas:
        logger.info("%s: every prompt rendered with the %d tool schema(s) of rollout.tools, as RL's prompts are", name,
                    len(schemas), extra=shown("note"))
    result = train_sft(
        model, tokenizer, pairs, check, target=settings.target, max_steps=settings.max_steps,
        check_every=settings.check_every, batch_size=settings.batch_size, lr=settings.lr, seed=config.seed,
        log=lambda line: logger.info(line, extra=shown("note")), resume=resume,
        save=lambda state: _save_state(state_folder, state | {"setup": setup}),
        processor=processor, images=images, check_images=check_images, on_check=checked,
        renderer=renderer, tools=schemas, on_progress=progress,
    )
    if settings.target is not None and not result["converged"]:
        raise SFTNotConverged(
            f"{name} SFT reached {100 * result['exact_match']:.1f}% held-out exact match after {result['steps']} steps, "
            f"short of {field['target']}={settings.target}: raise {field['max_steps']} ({settings.max_steps}) and run "
            f"the same command (it continues from step {result['steps']}), or change {field['lr']} ({settings.lr}); "
            f"nothing was written to {output}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        (processor or tokenizer).save_pretrained(tmp)
        objectstore.upload_folder(tmp, output)  # MANIFEST.json last: committed
    objectstore.remove(state_folder)
    logger.info("%s: held-out exact match %s, loss %.4f after %d steps (%.0fs) → %s", name, percent(result["exact_match"]),
                result["loss"], result["steps"], result["seconds"], output,
                extra=shown("finish", name=name, run=config.name, done=result["steps"]))
    return {"uri": output, **result}


def saved_step(config: RunConfig, name: str = "sft") -> int | None:
    """The step whose state SFT ``name`` of run ``config.name`` saved last (None: none saved), from the
    small ``progress.json`` beside the state."""
    progress = objectstore.join(config.run_uri, name, PROGRESS)
    return objectstore.read_json(progress)["step"] if objectstore.exists(progress) else None


def stopped_line(config: RunConfig, command: str) -> str:
    """``stopped; resume state: step M; …`` after Ctrl-C of ``yattflow sft`` or ``yattflow rm`` (their
    states live in ``runs/<name>/<command>``; their sections are ``config.<command>``)."""
    step = saved_step(config, command)
    if step is None:
        return (f"stopped before the first check ({command}.check_every={getattr(config, command).check_every}); "
                "the same command starts over")
    return f"stopped; resume state: step {step}; run the same command to continue"


def local_base(config: RunConfig, base: str | None, field: str) -> str | None:
    """The folder a model starts from (``field``'s value ``base``, local or on object storage) on this
    machine; None: none (from scratch)."""
    if base is None:
        return None
    try:
        return objectstore.local_folder(config.uri(base))
    except objectstore.StorageError as e:
        raise ConfigError(f"{field}: {e}") from None


def _load_state(uri: str, setup: dict) -> dict | None:
    if not objectstore.exists(uri):
        return None
    try:  # tensors and plain data only: a state file from storage never runs code (no pickled objects)
        state = torch.load(io.BytesIO(objectstore.read_bytes(uri)), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RunStateError(f"{uri}: not a resume state yattflow wrote ({reason[:200]}); delete it to start this SFT over, "
                            "or give the run another name (name=...)") from None
    if state["setup"] != setup:
        changed = ", ".join(f"{k} {state['setup'].get(k)!r} → {v!r}" for k, v in setup.items() if state["setup"].get(k) != v)
        raise ConfigError(f"{uri} holds the state of an SFT run set up differently ({changed}): run it with its own "
                          "settings to continue it, or give this one another run name (name=...)")
    return state


def _save_state(folder: str, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    objectstore.write_bytes(objectstore.join(folder, STATE), buffer.getvalue())  # atomic: a kill mid-write keeps the previous state
    objectstore.write_json(objectstore.join(folder, PROGRESS), {"step": state["step"]})


@flow(name="sft", flow_run_name=run_label("sft"))
def sft(config_file: str | None = None, overrides: list[str] | None = None) -> dict:
    config = load_config(config_file, overrides or [])
    if config.sft.data is None:
        raise ConfigError("sft.data is not set: name a Parquet file or folder of examples (columns sft.prompt_field "
                          "and sft.response_field), e.g. sft.data=data/my-sft")
    objectstore.check_reachable(config.uri(""))
    return fine_tune(config, config.sft)
