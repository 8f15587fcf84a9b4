"""Prepare the demo: prompt datasets, a tokenizer and two tiny models, all built locally.

Nothing can be downloaded here, so ``prepare`` makes what a user would otherwise point
the config at: Arrow prompt datasets (train and held-out) and two Hugging Face folders,
each trained from scratch by ``yattflow sft`` (``flows/sft.py``) on examples ``prepare`` writes
first (``data/sft/``): the policy on a sloppy teacher's demonstrations, and a generative reward
model that writes ``correct``/``wrong`` for a candidate answer given the reference. Each output
is skipped when it is already committed (its manifest), so ``prepare`` is cheap to run again; an
output folder that holds anything else is somebody's data or model, and ``prepare`` stops,
naming it, rather than write over it.
"""

from __future__ import annotations

import random

import pyarrow as pa
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.backends import video
from engines.demo import agent, arithmetic, sums, vision
from engines.demo.tiny_vision import PLACEHOLDERS
from engines.config import RunConfig, load_config
from engines.backends.torch.generator import TorchGenerator
from flows.console import shown
from flows.sft import DATASET_MANIFEST, fine_tune, needs_building
from flows.training import run_label
from storage import datasets, objectstore

_MODEL_FIELD = {"policy": "model.policy", "judge": "model.judge"}
SFT_EXAMPLES = pa.schema([pa.field("prompt", pa.string(), nullable=False), pa.field("response", pa.string(), nullable=False),
                          pa.field("images", pa.list_(pa.binary()))])


def _sft_data(role: str) -> tuple[str, str]:
    """Where ``prepare`` writes the SFT examples of ``role``: training and held-out."""
    return f"data/sft/{role}", f"data/sft/{role}-heldout"


def _write_dataset(uri: str, table: pa.Table, schema: pa.Schema) -> None:
    datasets.write_table(objectstore.join(uri, "part-00000.parquet"), table, schema)
    objectstore.write_json(objectstore.join(uri, DATASET_MANIFEST), {"files": ["part-00000.parquet"]})  # last: committed


def _prompts(problems: list[tuple], first_id: int) -> pa.Table:
    ids = pa.array(range(first_id, first_id + len(problems)), pa.int64())
    if problems and isinstance(problems[0][0], list):  # (chat messages, answer): the sums task's
        return pa.table({"prompt_id": ids, "messages": pa.array([p[0] for p in problems], datasets.MESSAGES),
                         "answer": [p[-1] for p in problems]})
    table = pa.table({"prompt_id": ids, "prompt": [p[0] for p in problems], "answer": [p[-1] for p in problems]})
    if problems and len(problems[0]) >= 3:  # (prompt, images, answer): the vision demo's; (prompt, images, videos, answer)
        for k, column in enumerate(("images", "videos")[: len(problems[0]) - 2]):
            table = table.append_column(column, pa.array([p[1 + k] for p in problems], pa.list_(pa.binary())))
    return table


def _examples(pairs: list[tuple[str, str]], images: list[list[bytes]] | None = None) -> pa.Table:
    return pa.table({"prompt": [p for p, _ in pairs], "response": [c for _, c in pairs],
                     "images": pa.array(images, pa.list_(pa.binary())) if images is not None else pa.nulls(len(pairs))})


def _problems(config: RunConfig, train: bool = True) -> tuple[list, list]:
    """The demo's training and held-out problems (``train=False``: no training ones): (prompt,
    answer), for the vision demo (prompt, [image], answer), for the video task (prompt, [],
    [clip], answer), the pictures on the two sides drawn apart."""
    p = config.prepare
    if p.task == "vision":  # the prompt's image placeholder is the policy's family's (sft.vision)
        image = PLACEHOLDERS[config.sft.vision_family or "idefics3"]
        return ([(q, im, a) for q, im, a, _ in vision.make_problems(p.train_prompts if train else 0, seed=config.seed + 2,
                                                                     placeholder=image)],
                [(q, im, a) for q, im, a, _ in vision.make_problems(p.heldout_prompts, seed=config.seed + 1, placeholder=image)])
    if p.task == "video":
        clips = lambda count, seed: [(q, [], c, a) for q, c, a, _ in vision.make_video_problems(count, seed)]  # noqa: E731
        return clips(p.train_prompts if train else 0, config.seed + 2), clips(p.heldout_prompts, config.seed + 1)
    if p.task == "sums":  # a real chat model's questions, as chat messages (engines/demo/sums.py)
        heldout = sums.make_problems(p.heldout_prompts, seed=config.seed + 1)
        asked = {m[-1]["content"] for m, _ in heldout}
        return sums.make_problems(p.train_prompts if train else 0, seed=config.seed + 2, exclude=asked), heldout
    if p.task == "agent":
        heldout = agent.make_problems(p.heldout_prompts, seed=config.seed + 1)
        return agent.make_problems(p.train_prompts, seed=config.seed + 2, exclude={q for q, _ in heldout}), heldout
    heldout = arithmetic.make_problems(p.heldout_prompts, p.digits, seed=config.seed + 1)
    train = arithmetic.make_problems(p.train_prompts, p.digits, seed=config.seed + 2, exclude={q for q, _ in heldout})
    return train, heldout


def _sft_examples(config: RunConfig, role: str, train, heldout) -> tuple[list, list]:
    """The demo's SFT examples of ``role``: the policy learns the teacher's demonstrations and is
    checked against the teacher's most likely answers (the carry mistake learned); the judge learns
    and is checked on verdicts."""
    if role == "policy" and config.prepare.task == "agent":  # an episode: its call and its answer, two examples
        slip = config.prepare.teacher_slip
        return (agent.teacher_demonstrations(train, slip, agent.FORGET, seed=config.seed),
                agent.teacher_majority(heldout, slip, agent.FORGET))
    if role == "policy":
        return (arithmetic.teacher_demonstrations(train, config.prepare.teacher_slip, seed=config.seed),
                arithmetic.teacher_majority(heldout, config.prepare.teacher_slip))
    return (arithmetic.judge_examples(train, config.judge.template, seed=config.seed),
            arithmetic.judge_examples(heldout, config.judge.template, seed=config.seed + 1))


def _as_pictures(config: RunConfig, problems: list[tuple]) -> list[tuple]:
    """Video problems as what the policy is given (``engines.host.prompts.Frames``): (prompt with one
    image per frame, frames, answer), the frames decoded from each clip at ``data.video_fps``; other
    problems as they are."""
    if not problems or len(problems[0]) != 4:
        return problems
    frame, d = PLACEHOLDERS[config.sft.vision_family or "idefics3"], config.data
    out = []
    for q, images, clips, a in problems:
        (text,), pictures = video.expand([q], images, [video.frames(c, d.video_fps, d.max_frames) for c in clips], frame)
        out.append((text, pictures, a))
    return out


def _vision_sft_examples(config: RunConfig, train, heldout) -> tuple[tuple, tuple]:
    """The vision policy's SFT examples (teacher demonstrations; held out: the teacher's most likely
    answers), each with its picture (or a clip's frames): ((pairs, images), (pairs, images))."""
    rng, slip = random.Random(config.seed), config.prepare.teacher_slip
    train, heldout = _as_pictures(config, train), _as_pictures(config, heldout)

    def digits(answer: str) -> tuple[int, int]:
        return int(answer[0]), int(answer[2])  # "7+5=21": the digits the picture shows

    demos = [(q, vision.teacher_answer(*digits(a), slip=rng.random() < slip)) for q, _, a in train]
    likely = [(q, vision.teacher_answer(*digits(a), slip=slip > 0.5)) for q, _, a in heldout]
    return (demos, [im for _, im, _ in train]), (likely, [im for _, im, _ in heldout])


@task(cache_policy=NO_CACHE, task_run_name="make datasets")
def make_datasets(config: RunConfig) -> dict:
    """The prompt datasets, and the SFT examples of each model still to be trained."""
    train, heldout = _problems(config)
    outputs = [("data.prompts", config.data.prompts, _prompts(train, 0), datasets.PROMPTS),
               ("data.heldout", config.data.heldout, _prompts(heldout, 10_000_000), datasets.PROMPTS)]
    if config.data.preferences is not None and config.prepare.task == "arithmetic":  # offline DPO's pairs (docs/algorithms.md)
        rows = arithmetic.preference_pairs(train, seed=config.seed + 3)
        table = _prompts([(p, a) for p, a, _, _ in rows], 0).append_column("chosen", pa.array([c for *_, c, _ in rows]))
        outputs.append(("data.preferences", config.data.preferences, table.append_column("rejected", pa.array([r for *_, r in rows])),
                        datasets.PREFERENCES))
    for role, model in _roles(config):
        if not needs_building(config.uri(model), _MODEL_FIELD[role]):
            continue
        if config.prepare.task in ("vision", "video"):
            outputs += [("storage.root", path, _examples(pairs, images), SFT_EXAMPLES)
                        for path, (pairs, images) in zip(_sft_data(role), _vision_sft_examples(config, train, heldout))]
        else:
            outputs += [("storage.root", path, _examples(pairs), SFT_EXAMPLES)
                        for path, pairs in zip(_sft_data(role), _sft_examples(config, role, train, heldout))]
    for field, path, table, schema in outputs:
        if path is not None and needs_building(config.uri(path), field):
            _write_dataset(config.uri(path), table, schema)
    return {"train": len(train), "heldout": len(heldout)}


def _roles(config: RunConfig) -> list[tuple[str, str]]:
    """The models ``prepare`` trains: the policy (unless ``prepare.gguf`` gives it), and the GenRM when the
    reward uses one (the vision, agent and sums demos' reward is a rule: they have no judge to build)."""
    roles = [] if config.prepare.gguf or config.prepare.task == "sums" else [("policy", config.model.policy)]
    if config.prepare.task in ("vision", "video", "agent", "sums"):
        return roles
    return [*roles, ("judge", config.model.judge)]


@task(cache_policy=NO_CACHE, task_run_name="convert gguf")
def convert_policy(config: RunConfig) -> dict:
    """``prepare.gguf`` converted into ``model.policy`` (``yattflow convert``: flows/convert.py), checked on a few
    of the held-out questions and general ones; skipped when already converted."""
    from engines.backends.gguf import CHECK_PROMPTS
    from flows.convert import check_line, convert_to

    logger = get_run_logger()
    heldout = [p[0] for p in _problems(config, train=False)[1][:8]]
    questions = [p[-1]["content"] if isinstance(p, list) else p for p in heldout] + CHECK_PROMPTS
    report = convert_to(config.prepare.gguf, config.uri(config.model.policy), questions, min(config.rollout.max_new_tokens, 64),
                        field="model.policy",
                        log=lambda line: logger.info(line, extra=shown("note")))
    logger.info("policy: %s %s; %s", config.prepare.gguf, "was converted before" if report.get("skipped") else "converted",
                check_line(report), extra=shown("note"))
    return report


def sft_model(config: RunConfig, role: str) -> dict:
    """``yattflow sft`` from scratch on the examples of ``role``, with the ``sft`` section's settings
    (the judge: prepare's own target, learning rate and initialisation); the policy's held-out figure
    is then the right answer's exact match, through RL's own generation code."""
    p, policy = config.prepare, role == "policy"
    data, heldout = _sft_data(role)
    settings = config.sft.model_copy(update={
        "data": data, "heldout": heldout, "base": None, "output": config.model.policy if policy else config.model.judge,
        "target": p.sft_target if policy else p.judge_target, "vision": (config.sft.vision or True) if p.task in ("vision", "video") else False,
        **({} if policy else {"lr": p.judge_sft_lr, "init_std": p.judge_init_std, "experts": 0}),  # the judge: dense
    })
    fields = {"output": _MODEL_FIELD[role], "data": "storage.root", "heldout": "storage.root",
              "target": "prepare.sft_target" if policy else "prepare.judge_target"}
    if not policy:
        fields |= {"lr": "prepare.judge_sft_lr", "init_std": "prepare.judge_init_std"}
    result = fine_tune(config, settings, name=f"sft-{role}", fields=fields)
    if result.get("skipped"):
        return result
    # the figure users compare with RL's: the right answer, not the teacher's
    accuracy = result["exact_match"]
    if policy:
        accuracy = heldout_accuracy(objectstore.local_folder(result["uri"]), _as_pictures(config, _problems(config, train=False)[1]),
                                    config)
    get_run_logger().info("%s model: held-out %s %.1f%% after %d SFT steps (%.0fs) → %s", role,
                          "exact match" if policy else "verdict accuracy", 100 * accuracy, result["steps"],
                          result["seconds"], result["uri"], extra=shown("note"))
    return {**result, "heldout_exact_match": accuracy}


def heldout_accuracy(model_dir: str, problems: list[tuple], config: RunConfig | None = None) -> float:
    """Greedy exact match on the right answers, through the same loading code as RL's engines (the
    agent demo's: greedy episodes with the run's tools, its rule reading the last turn)."""
    if config is not None and config.prepare.task == "agent":
        from engines.agents.episodes import Episodes

        rows = [{"prompt_id": i, "prompt": q, "answer": a} for i, (q, a) in enumerate(problems)]
        answered = Episodes.of(config, model_dir).answers(TorchGenerator(model_dir), rows)
        return sum(agent.final_answer(r["prompt"], r["response"], r["answer"]) for r in answered) / len(problems)
    images = [p[1] for p in problems] if len(problems[0]) == 3 else None
    outs = TorchGenerator(model_dir).generate([p[0] for p in problems], greedy=True, max_new_tokens=8, images=images)
    return sum(o.response == problems[o.prompt_index][-1] for o in outs) / len(problems)


@flow(name="prepare", flow_run_name=run_label("prepare"))
def prepare(config_file: str | None = None, overrides: list[str] | None = None) -> dict:
    config = load_config(config_file, overrides or [])
    objectstore.check_reachable(config.uri(""))
    outputs = {"data.prompts": config.data.prompts, "data.heldout": config.data.heldout, "data.preferences": config.data.preferences,
               **{_MODEL_FIELD[role]: model for role, model in _roles(config)},
               **({"model.policy": config.model.policy} if config.prepare.gguf else {})}
    outputs = [*outputs.items(), *(("storage.root", path) for role, _ in _roles(config) for path in _sft_data(role))]
    for field, path in outputs:  # refuse somebody's folder before writing anything
        if path is not None:
            needs_building(config.uri(path), field)
    counts = make_datasets(config)
    converted = {"policy": convert_policy(config)} if config.prepare.gguf else {}
    # One after the other: torch's global RNG seeds each model's initialisation, and two
    # threads drawing from it at once would make the demo irreproducible.
    return {"datasets": counts, **converted, **{role: sft_model(config, role) for role, _ in _roles(config)}}
