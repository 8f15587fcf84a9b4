"""Input checks that run before any engine loads: bad input fails fast, by name.

``validate_inputs`` is every check that needs no engine, host, server or device. The command line runs it
first (``preflight``, from ``flows/preflight.py``), in its own process, before the Prefect server and the
engine hosts start; a run started another way (a deployment) runs it on its first engine host, before the
engines load. The user's code (the rule, the environment, the tools) and the model folders' config.json
(the layout the run asks of them) come first: they are the quickest to check and the likeliest to be wrong.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engines.backends import chat, multimodal, video
from engines.backends.megatron import architectures  # imports no Megatron
from engines.backends.megatron.vision import VISION_MODELS as MEGATRON_VISION_MODELS  # imports no Megatron
from engines.config import dotted
from engines.host import rewards
from storage import datasets, objectstore


log = logging.getLogger("yattflow.host")


class InputError(ValueError):
    """Bad input; the message names the file (or config field) and the field or row."""


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates render

# vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# what vLLM's CPU build cannot load here, by model_type, and why (docs/engines.md#architectures)
VLLM_CPU_REFUSED = {
    "qwen3_5_text": "vLLM's Qwen3.5 module imports the Qwen2-VL image processor, which needs torchvision, and torchvision "
                    "has no build for the CPU torch here (its Gated DeltaNet layers do have CPU kernels)",
    **{qwen_vl: "vLLM's Qwen-VL modules import torchvision, which has no build for the CPU torch here"
       for qwen_vl in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")},
}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf", ".h5", ".msgpack")
LEFT_OUT = "YATTFLOW-WEIGHTS-LEFT-OUT.json"  # in a folder read without its weights: the names of those left out


def check_model_folder(field: str, uri: str, backend: str = "torch", devices: bool = True, weights: bool = True) -> str:
    """A readable Hugging Face folder that the backend can serve, else an error naming the
    config field, the URI and the offending config.json field. ``devices``: this machine's devices are
    the engines' (vLLM's CPU limits apply without CUDA here); ``weights``: a remote folder is downloaded
    whole (the engines on this machine load it from the same cache), else without its weights."""
    from transformers import AutoConfig

    try:
        path = objectstore.local_folder(uri) if weights or objectstore.is_local(uri) else folder_without_weights(uri)
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure means the folder is unusable
        raise InputError(f"{field}: {uri} is not a readable Hugging Face model folder ({type(e).__name__}: {e})") from e
    check_weights(field, uri, path)
    text = getattr(config, "text_config", None) or config  # a vision-language model: its language model's heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    on_cpu = devices and not torch.cuda.is_available()
    if backend == "vllm" and on_cpu and config.model_type in VLLM_CPU_REFUSED:
        raise InputError(f"{field}: {uri}/config.json: model_type {config.model_type!r}: "
                         f"{VLLM_CPU_REFUSED[config.model_type]}; use the torch backend on a CPU (vLLM on a GPU)")
    if backend == "vllm" and on_cpu and head_size not in VLLM_CPU_HEAD_SIZES:
        raise InputError(
            f"{field}: {uri}/config.json: head size {head_size} (hidden_size / num_attention_heads) is not one "
            f"vLLM's CPU attention supports {VLLM_CPU_HEAD_SIZES}; use the torch backend or another model"
        )
    return path


def folder_without_weights(uri: str) -> str:
    """A remote model folder's small files (config, tokenizer, processor), downloaded once into a cache
    of their own, the names of its weights in ``LEFT_OUT``: what a controller checks of a folder that
    engine hosts on other machines will download whole."""
    import json
    import tempfile

    cache = Path(os.environ.get("YATTFLOW_CACHE", "~/.cache/yattflow")).expanduser() / "without-weights"
    target = cache / uri.replace("://", "/").strip("/")
    if (target / LEFT_OUT).exists():
        return str(target)
    fs, root = objectstore.fs_for(uri)
    if not objectstore.exists(uri):
        raise objectstore.StorageError(f"{uri}: folder not found")
    files = [f for f in fs.find(root.rstrip("/")) if not f.endswith("/")]
    left_out = [f for f in files if f.endswith(WEIGHT_SUFFIXES)]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    for f in files:
        if f not in left_out:
            local = tmp / f[len(root.rstrip("/")) + 1:]
            local.parent.mkdir(parents=True, exist_ok=True)
            objectstore.retrying(uri, "download", lambda f=f, local=local: fs.get(f, str(local)))
    (tmp / LEFT_OUT).write_text(json.dumps([f.rsplit("/", 1)[-1] for f in left_out]))
    os.replace(tmp, target)
    return str(target)


def check_weights(field: str, uri: str, path: str) -> None:
    """The folder's weights are safetensors: pickled ones (``pytorch_model.bin``, ``*.pt``) can run
    code when loaded, so they are refused by name, never opened."""
    import json

    names = sorted(os.listdir(path))
    if LEFT_OUT in names:  # read without its weights (folder_without_weights): their names
        names = sorted(names + json.loads((Path(path) / LEFT_OUT).read_text()))
    if any(n.endswith(".safetensors") for n in names):
        return
    pickled = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    if pickled:
        raise InputError(f"{field}: {uri}/{pickled[0]}: pickled weights are never loaded (unpickling can run code); "
                         "save the model as safetensors (save_pretrained(..., safe_serialization=True))")
    raise InputError(f"{field}: {uri} holds no weights (*.safetensors)")


def validate_inputs(config, devices: bool = True, weights: bool = True) -> dict:
    """The reward rule imports, takes (prompt, response, answer) and returns a number within
    ``reward.rule_timeout_s`` (and the format rule); the environment and the tools import and have
    the right shape; model folders load, and their config.json takes the run's layout (heads, layers,
    experts over train.tensor_parallel, pipeline_parallel, expert_parallel; rollout.tensor_parallel);
    the judge's verdict words are tokens its tokenizer knows; prompts
    match the schema, are UTF-8, non-empty, render with the policy's chat template when they need one
    (``messages``, ``data.system_prompt``), fit ``max_prompt_tokens`` as rendered, have unique ids
    and the answers the rewards read; a
    vision-language policy has its processor, each prompt as many images as image placeholders,
    and images within ``data.max_image_bytes`` and ``data.max_image_pixels`` (read from their headers)
    whose headers and structure read (the first prompt's are decoded). Prompts are read a
    batch of rows at a time (a dataset of images is never held whole).

    ``devices``: this machine's devices are the engines' (False: a controller whose hosts run elsewhere
    leaves vLLM's CPU limits to them); ``weights``: remote model folders are downloaded whole (False:
    their small files only, ``folder_without_weights``)."""
    limit = rewards.timeout_of(config)
    rule = rewards.load_rule(config.reward.rule, timeout_s=limit) if config.reward.rule else None
    form = rewards.load_rule(config.reward.format_rule, "reward.format_rule", limit) if config.reward.format_rule else None
    check_user_code(config)
    policy = check_model_folder("model.policy", config.uri(config.model.policy), config.rollout.backend, devices, weights)
    check_megatron_architecture(config, policy)
    check_tensor_parallel(config, "rollout", "model.policy", policy)
    from transformers import AutoTokenizer

    if config.reward.genrm_weight > 0:
        judge = check_model_folder("model.judge", config.uri(config.model.judge), config.judge.backend, devices, weights)
        check_tensor_parallel(config, "judge", "model.judge", judge)
        check_verdict_words(config, AutoTokenizer.from_pretrained(judge))
    check_reward_model(config, devices, weights)
    processor = check_vision(config, policy)
    check_lora_targets(config, policy)
    check_critic(config, policy, weights)
    renderer = chat.Renderer(processor or AutoTokenizer.from_pretrained(policy), chat.PromptFormat.policy(config))
    schemas = check_episodes(config, renderer, processor)  # the tools' schemas are part of every prompt
    counts = {}
    training = (("data.preferences", config.data.preferences, datasets.PREFERENCES) if config.data.preferences
                else ("data.prompts", config.data.prompts, datasets.PROMPTS))  # the preferences are read instead
    # each evaluation set (engines/evaluation.py): its prompts like data.heldout's, its own rule (else reward.rule), its vote
    scored_by = {"data.heldout": (rule, form)}
    evaluation = []
    for name, s in config.eval.sets.items():
        own = rewards.load_rule(s.rule, f"eval.sets.{name}.rule", limit) if s.rule else rule
        if s.answer:
            dotted.load(s.answer, f"eval.sets.{name}.answer", InputError)
        scored_by[f"eval.sets.{name}.data"] = (own, None)
        evaluation.append((f"eval.sets.{name}.data", s.data, datasets.PROMPTS))
    for field, path, schema in (training, ("data.heldout", config.data.heldout, datasets.PROMPTS), *evaluation):
        if path is None:
            continue
        uri = config.uri(path)
        try:
            reader = datasets.PromptReader(uri, schema)
        except objectstore.StorageError as e:
            raise InputError(f"{field}: {e}") from e
        if len(reader) == 0:
            raise InputError(f"{uri}: no prompts")
        seen: set[int] = set()
        unanswered: list[int] = []  # prompt_ids without an answer
        first: dict | None = None
        for batch in reader.iter_batches(1024):
            first = first or batch[0]
            unanswered += [r["prompt_id"] for r in batch if r["answer"] is None]
            for row in batch:
                pid = row["prompt_id"]
                if pid in seen:
                    raise InputError(f"{uri}: field 'prompt_id' has duplicate values (prompt_id {pid})")
                seen.add(pid)
                column = check_prompt_text(uri, row)
                check_prompt_images(config, uri, row, processor, first=len(seen) == 1)
                try:
                    length = len(renderer.ids(chat.source(row), schemas))
                except chat.ChatTemplateError as e:
                    raise InputError(f"{uri}: field '{column}' (prompt_id {pid}): {e} (model.policy "
                                     f"{config.uri(config.model.policy)}, data.chat_template={config.data.chat_template})") from None
                if length > config.data.max_prompt_tokens:
                    shown = (" with the chat template applied" if renderer.templated else "") + (
                        " and the tools' schemas" if schemas else "")
                    raise InputError(
                        f"{uri}: field '{column}' is {length} tokens{shown} (prompt_id {pid}); "
                        f"the limit is data.max_prompt_tokens={config.data.max_prompt_tokens}"
                    )
        check_answers(config, field, uri, first, unanswered, len(reader), *scored_by.get(field, (rule, form)))
        counts[field] = len(reader)
    return counts


def check_user_code(config) -> None:
    """``rollout.env``'s class and ``rollout.tools``' functions import and have the right shape (the
    file, the class, its methods and their parameters; each tool's type hints and docstring), before
    any model folder is read (``check_episodes`` then checks them against the policy's chat template
    and tries the environment)."""
    ro = config.rollout
    if not ro.episodes:
        return
    from engines.agents import environment, tools

    try:
        if ro.env:
            environment.load(ro.env)
        tools.load(ro.tools)
    except (environment.EnvError, tools.ToolError) as e:
        raise InputError(str(e)) from None


def check_episodes(config, renderer: chat.Renderer, processor) -> list[dict] | None:
    """With rollout.env or rollout.tools: the environment class and the tools import and have the
    right shape, the policy's chat template renders tools (when there are some), the sandbox runs
    (the python tool), and the environment's ``reset`` takes the first training row; a template
    that is not append-only is named in a warning (``chat.Renderer.append_only``). Answers the
    tools' JSON schemas (None: no tools)."""
    ro = config.rollout
    if not ro.episodes:
        return None
    from engines.agents import environment, sandbox, tools
    from engines.agents.episodes import Episodes

    policy = config.uri(config.model.policy)
    if processor is not None:
        raise InputError(f"rollout.env / rollout.tools: model.policy {policy} is a vision-language model, and episodes "
                         "run text policies only for now")
    try:
        episodes = Episodes(ro, renderer)
    except (environment.EnvError, tools.ToolError) as e:
        raise InputError(str(e)) from None
    except chat.ChatTemplateError as e:
        raise InputError(f"model.policy {policy}: {e}") from None
    if any(fn is tools.python for fn in episodes.tools.values()) and (why := sandbox.unavailable()):
        raise InputError(f"rollout.tools: {tools.__name__}:python runs model-written code in a sandbox, and {why}")
    if episodes.not_append_only:
        log.warning("model.policy %s: its chat template is not append-only: %s. Episodes keep every turn as sampled "
                    "(token-in/token-out), so training is exact, but the model sees earlier turns as they were, not as "
                    "the template would render them when it is served (docs/agents.md)", policy, episodes.not_append_only)
    if episodes.env_class is not None:
        uri = config.uri(config.data.prompts)
        reader = datasets.PromptReader(uri, datasets.PROMPTS, extra=True)
        if len(reader):  # (an empty file: named by the pass over the prompts)
            try:  # built, reset on the first prompt and stepped once, within rollout.tool_timeout_s each
                episodes.try_environment(reader.rows([0])[0], ro.tool_timeout_s)
            except environment.EnvError as e:
                raise InputError(f"{uri}: {e}") from None
    return episodes.schemas


def check_reward_model(config, devices: bool = True, weights: bool = True) -> None:
    """With reward.reward_model_weight > 0, model.reward_model is a sequence classifier with one
    output (``engines.reward_model.reward_head_problem``), else an error naming the field and what
    its config.json holds."""
    if config.reward.reward_model_weight == 0:
        return
    from transformers import AutoConfig

    from engines.reward_model import reward_head_problem

    uri = config.uri(config.model.reward_model)
    found = AutoConfig.from_pretrained(check_model_folder("model.reward_model", uri, devices=devices, weights=weights))
    if problem := reward_head_problem(found):
        raise InputError(f"model.reward_model: {uri}/config.json: {problem}: a scalar reward model is an "
                         "AutoModelForSequenceClassification with num_labels=1 (`yattflow rm` trains one)")


def check_megatron_architecture(config, policy: str) -> None:
    """With train.backend=megatron, a text policy is of an architecture the Megatron mapping covers
    (``engines/backends/megatron/architectures.py``), else an error naming the field, the
    model_type and why; and the policy's language model (a vision-language policy's too) splits over
    the run's layout (``check_megatron_split``): before any server, host or engine starts, not as a
    mapping error inside the trainer."""
    if config.train.backend != "megatron":
        return
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(policy)
    where = f"model.policy: {config.uri(config.model.policy)}/config.json"
    if multimodal.is_vision_config(hf):  # its family is check_vision's; its language model splits as a text model's
        check_megatron_split(config, where, hf.text_config)
        return
    try:
        architectures.architecture(hf)
    except architectures.Unsupported as e:
        raise InputError(f"{where}: train.backend=megatron cannot train it: {e}") from None
    tp, pp = config.train.tensor_parallel, config.train.pipeline_parallel
    if architectures.architecture(hf).experts and (tp > 1 or pp > 1):
        raise InputError(f"{where}: a mixture of experts "
                         f"(model_type {hf.model_type!r}) trains on Megatron at train.tensor_parallel=1 and "
                         f"train.pipeline_parallel=1 only (now {tp} and {pp}): Megatron-Core's MoE layer needs sequence "
                         "parallelism under TP, which is not wired, and its allgather dispatcher takes no pipeline")
    ep, experts = config.train.expert_parallel, architectures.architecture(hf).experts
    if ep > 1 and (not experts or hf.num_experts % ep):
        held = f"{hf.num_experts} experts, which do not split" if experts else "no experts (a dense model), nothing to split"
        raise InputError(f"{where}: train.expert_parallel={ep}, but "
                         f"model_type {hf.model_type!r} has {held} over {ep} ranks: use an expert_parallel that divides "
                         "num_experts, or 1")
    check_megatron_split(config, where, hf)


def check_megatron_split(config, where: str, hf, field: str = "train") -> None:
    """A language model's config (``hf``) splits over the Megatron trainer's layout as the mapping
    splits it (``engines/backends/megatron/mapping.py``): whole query heads and key/value heads on each
    tensor-parallel rank, the MLP's intermediate_size and the padded vocabulary in equal slices, as many
    layers on each pipeline stage."""
    from engines.backends.megatron.mapping import padded_vocab_size  # (imports no Megatron)

    tp, pp = config.train.tensor_parallel, config.train.pipeline_parallel
    heads, groups, _ = architectures.attention_shape(hf)
    if heads % tp or groups % tp:  # each tensor-parallel rank holds whole heads (engines/backends/megatron/mapping.py)
        raise InputError(f"{where}: num_attention_heads={heads} and num_key_value_heads={groups} do not split over "
                         f"{field}.tensor_parallel={tp} ranks: use a tensor_parallel that divides both")
    intermediate = getattr(hf, "intermediate_size", None)
    if intermediate and intermediate % tp:
        raise InputError(f"{where}: intermediate_size={intermediate} does not split over {field}.tensor_parallel={tp} "
                         "ranks: use a tensor_parallel that divides it")
    if padded_vocab_size(hf) % tp:
        raise InputError(f"{where}: vocab_size={hf.vocab_size} (padded to {padded_vocab_size(hf)}) does not split over "
                         f"{field}.tensor_parallel={tp} ranks: use a tensor_parallel that divides it")
    if hf.num_hidden_layers % pp:  # every stage holds as many layers
        raise InputError(f"{where}: num_hidden_layers={hf.num_hidden_layers} "
                         f"do not split into {field}.pipeline_parallel={pp} stages of equal size: use a pipeline_parallel "
                         "that divides it")


def check_tensor_parallel(config, role: str, field: str, folder: str) -> None:
    """vLLM's tensor parallelism (``rollout.tensor_parallel``, ``judge.tensor_parallel`` > 1) takes the
    model's query heads in equal shares and its key/value heads split or replicated evenly (vLLM's own
    rule: num_key_value_heads divisible by the ranks, or the ranks by it)."""
    tp = getattr(config, role).tensor_parallel
    if tp == 1:
        return
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder)
    hf = getattr(hf, "text_config", None) or hf
    heads, groups, _ = architectures.attention_shape(hf)
    if heads % tp or (groups % tp and tp % groups):
        raise InputError(f"{field}: {config.uri(getattr(config.model, field.split('.')[1]))}/config.json: "
                         f"num_attention_heads={heads} and num_key_value_heads={groups} do not split over "
                         f"{role}.tensor_parallel={tp} vLLM ranks: use a tensor_parallel that divides num_attention_heads, "
                         "and that num_key_value_heads divides or divides it")


def check_critic(config, policy: str, weights: bool = True) -> None:
    """An algorithm with a critic (``Needs.critic``): ``model.critic`` (default: the policy's folder)
    is a text model that reads the policy's token ids (the same vocabulary), else an error naming
    the field."""
    if not config.train.algorithm.needs.critic:
        return
    from transformers import AutoConfig, AutoTokenizer

    from engines.backends import value_head
    from engines.host.critic import folder

    field = "model.critic" if config.model.critic else "model.critic (unset: model.policy)"
    uri = folder(config)
    path = check_model_folder(field, uri, weights=weights)
    if multimodal.is_vision_folder(path):
        raise InputError(f"{field}: {uri} is a vision-language model; train.algorithm.name={config.train.algorithm.name}'s "
                         "critic is a value head on a text model's transformer and never sees images: set model.critic "
                         "to a text model with the policy's tokenizer")
    try:  # an exported critic (final/critic/: *ForTokenClassification) must have one label, a value
        value_head.check_folder(path)
        if config.train.backend == "megatron":  # the Megatron critic maps its transformer as the policy's, in its layout
            architectures.architecture(AutoConfig.from_pretrained(path))
            check_megatron_split(config, f"{field}: {uri}/config.json", AutoConfig.from_pretrained(path))
    except (ValueError, architectures.Unsupported) as e:
        raise InputError(f"{field}: {uri}: train.backend={config.train.backend} cannot train it as a critic: {e}") from None
    if path != policy and AutoTokenizer.from_pretrained(path).get_vocab() != AutoTokenizer.from_pretrained(policy).get_vocab():
        raise InputError(f"{field}: {uri}: its tokenizer's vocabulary differs from model.policy's; the critic reads the "
                         "policy's token ids")


def check_prompt_text(uri: str, row: dict) -> str:
    """A row has a non-empty prompt: its ``messages`` (each turn a role and text), else its
    ``prompt``. Answers the column the model reads."""
    pid, messages = row["prompt_id"], row.get("messages")
    if messages:
        for i, turn in enumerate(messages):
            if not turn["role"] or turn["content"] is None:
                raise InputError(f"{uri}: field 'messages'[{i}] has no role or no content (prompt_id {pid})")
            if turn["role"] not in CHAT_ROLES:
                raise InputError(f"{uri}: field 'messages'[{i}] has role {turn['role']!r} (prompt_id {pid}); a turn's role "
                                 f"is one of {', '.join(CHAT_ROLES)}")
        if not chat.question(row).strip():
            raise InputError(f"{uri}: field 'messages' has an empty last user turn (prompt_id {pid})")
        return "messages"
    if row["prompt"] is None:
        raise InputError(f"{uri}: field 'prompt' is null and there are no 'messages' (prompt_id {pid})")
    if not row["prompt"].strip():
        raise InputError(f"{uri}: field 'prompt' is empty (prompt_id {pid})")
    return "prompt"


def check_vision(config, policy: str):
    """A vision-language policy's processor (None for a text model), or an error naming the field:
    a vision model without a processor, or a trainer that cannot train one."""
    if not multimodal.is_vision_folder(policy):
        return None
    if config.train.fsdp > 1 and not config.train.freeze_vision:
        raise InputError(f"train.freeze_vision=false with train.fsdp={config.train.fsdp}: {config.uri(config.model.policy)} "
                         "is a vision-language model, whose vision tower the FSDP2 torch trainer keeps whole on every rank, "
                         "frozen: set train.freeze_vision=true (the default), or train.fsdp=1 to train the tower")
    if config.train.backend == "megatron":
        model_type = multimodal.folder_model_type(policy)
        if model_type not in MEGATRON_VISION_MODELS:
            raise InputError(
                f"train.backend=megatron: {config.uri(config.model.policy)} is a vision-language model of model_type "
                f"{model_type!r}, and yattflow's Megatron trainer pairs the Hugging Face vision tower with a Megatron-Core "
                f"GPT language model for {tuple(MEGATRON_VISION_MODELS)} only (engines/backends/megatron/vision.py): its language "
                "model must be a mapped Llama and its image features must fill the image-token positions, which other "
                "families (Qwen-VL's 3-D rotary positions, LLaVA's, Gemma 3's) do not satisfy: use train.backend=torch")
    try:
        return multimodal.load_processor(policy)
    except Exception as e:  # noqa: BLE001 - any failure means no usable processor
        raise InputError(f"model.policy: {config.uri(config.model.policy)} is a vision-language model without a usable "
                         f"processor ({type(e).__name__}: {e})") from e


def check_lora_targets(config, policy: str) -> None:
    """Every ``train.lora.target_modules`` entry adapts a module of the policy (its modules built
    from its config.json on the meta device: no weights are read)."""
    lora = config.train.lora
    if lora is None:
        return
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from engines.backends.torch import lora as lora_adapter

    vision = multimodal.is_vision_folder(policy)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(AutoConfig.from_pretrained(policy))
    freeze_vision = vision and config.train.freeze_vision
    problems = lora_adapter.unmatched_targets(model, lora.target_modules, freeze_vision)
    if problems:
        where = " (the vision encoder is left out: train.freeze_vision is on)" if freeze_vision else ""
        raise InputError(
            f"train.lora.target_modules (model.policy {config.uri(config.model.policy)}{where}): "
            f"{'; '.join(f'{t!r} {why}' for t, why in problems.items())}; its adaptable modules are named "
            f"{lora_adapter.adaptable_names(model, freeze_vision)}")


def check_prompt_images(config, uri: str, row: dict, processor, first: bool) -> None:
    """As many images as the prompt has image placeholders and as many videos as ``<video>`` markers,
    each image within data.max_image_bytes with a sound header and structure, each video within
    data.max_video_bytes and data.max_video_seconds with a container that opens (the first prompt's
    decoded); each image's declared pixels within data.max_image_pixels, read from its header before
    anything is decoded; a text-only policy gets neither."""
    images, videos, pid = row["images"] or [], row.get("videos") or [], row["prompt_id"]
    if processor is None:
        for field, given in (("images", images), ("videos", videos)):
            if given:
                raise InputError(f"{uri}: field '{field}' holds {len(given)} {field[:-1]}(s) for prompt_id {pid}, but "
                                 f"model.policy {config.uri(config.model.policy)} is a text-only model")
        return
    mark = multimodal.placeholder(processor)
    column = "messages" if row.get("messages") else "prompt"
    text = "".join(m["content"] for m in row["messages"]) if column == "messages" else row["prompt"]
    if video.markers(text) != len(videos):
        missing = " (the file has no 'videos' column)" if row.get("videos") is None else ""
        raise InputError(f"{uri}: prompt_id {pid}: field '{column}' has {video.markers(text)} video marker(s) "
                         f"'{video.MARKER}' and field 'videos' {len(videos)} video(s){missing}: one marker per video")
    for i, blob in enumerate(videos):
        where, data = f"{uri} (prompt_id {pid}): field 'videos'[{i}]", config.data
        try:
            video.check_video(blob, where, data.max_video_bytes, data.max_video_seconds)
            if first:
                video.frames(blob, data.video_fps, data.max_frames, where, data.max_video_seconds)
        except multimodal.ImageError as e:
            raise InputError(str(e)) from None
    if text.count(mark) != len(images):
        missing = " (the file has no 'images' column)" if row["images"] is None else ""
        raise InputError(f"{uri}: prompt_id {pid}: field '{column}' has {text.count(mark)} image placeholder(s) "
                         f"'{mark}' and field 'images' {len(images)} image(s){missing}: one placeholder per image")
    for i, blob in enumerate(images):
        try:  # every image's header and structure; the first prompt's decoded too
            multimodal.check_image(blob, f"{uri} (prompt_id {pid}): field 'images'[{i}]", config.data.max_image_bytes,
                                   pixels=first, max_pixels=config.data.max_image_pixels)
        except multimodal.ImageError as e:
            raise InputError(str(e)) from None


def answers_needed_by(config, *rules: rewards.Rule | None) -> list[str]:
    """The configured rewards that read a prompt's reference answer."""
    needed = [f"{r.field} {r.spec} (its third parameter, answer, has no default)" for r in rules if r and r.needs_answer]
    if config.reward.genrm_weight > 0 and "{answer}" in config.judge.template:
        needed.append("judge.template (it has an {answer} field)")
    return needed


def check_answers(config, field: str, uri: str, first: dict, unanswered: list[int], rows: int,
                  rule: rewards.Rule | None, format_rule: rewards.Rule | None = None) -> None:
    """Every prompt has the answer the rewards read (``unanswered``: the prompt_ids of the ``rows``
    that have none), and the rule scores the ``first`` prompt as a number (its reference answer as
    the response): a rule that cannot fails here, before any engine loads."""
    needed = answers_needed_by(config, rule, format_rule)
    if needed and unanswered:
        raise InputError(
            f"{uri} ({field}): field 'answer' is missing or null in {len(unanswered)} of {rows} rows (first prompt_id "
            f"{unanswered[0]}), and {' and '.join(needed)} read(s) it: add an 'answer' column, or give the rule a default "
            "(answer=None) if it does not need one"
        )
    for rule in (r for r in (rule, format_rule) if r is not None):
        try:
            rule(chat.question(first), first["answer"] or "", first["answer"], first["prompt_id"])
        except rewards.RewardRuleError as e:
            if e.__cause__ is None and not isinstance(e, rewards.RuleTimeout):  # not a number: the error says so
                raise
            # it raised or hung: the error names the rule, the prompt and the response; this, where they came from
            raise InputError(f"{e} (the first prompt of {uri}, called with its reference answer as the response)") from e


def check_verdict_words(config, tokenizer) -> None:
    """``judge.good`` and ``judge.bad`` are spelled with tokens the judge's tokenizer knows: a word
    it maps to the unknown token can never be generated, so every verdict would score 0."""
    for name in ("good", "bad"):
        word = getattr(config.judge, name)
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        if not ids or (tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids):
            raise InputError(
                f"judge.{name}: the judge's tokenizer ({config.uri(config.model.judge)}) cannot spell '{word}' "
                f"(token ids {ids}, unknown token {tokenizer.unk_token_id}): choose a verdict word it knows"
            )


def preflight(config) -> dict:
    """``validate_inputs`` in a process that is not an engine host (the command line's, before the
    Prefect server and the hosts start: ``flows/preflight.py``), every refusal an ``InputError`` whose
    message names the file and the field. With ``hosts.launch=local`` the hosts run here, so the checks
    of this machine's devices run and remote model folders are downloaded whole (the hosts load them
    from the same cache); with deployed hosts those are left to the hosts (a remote folder is read
    without its weights)."""
    from engines.agents import environment, tools
    from engines.config import ConfigError

    local = config.hosts.launch == "local"
    try:
        return validate_inputs(config, devices=local, weights=local)
    except InputError:
        raise
    except (datasets.SchemaError, objectstore.StorageError, multimodal.ImageError, rewards.RewardRuleError,
            environment.EnvError, tools.ToolError, chat.ChatTemplateError, architectures.Unsupported, ConfigError) as e:
        raise InputError(" ".join(str(e).split())) from e
