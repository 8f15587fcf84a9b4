"""engines/config/__init__.py: defaults, YAML file, key=value overrides, and errors that name the
file and the field."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests import helpers


from engines.config import ConfigError, RunConfig, load_config


def write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_validate():
    config = load_config()
    assert isinstance(config, RunConfig)
    assert config == RunConfig()  # load_config adds nothing to the typed defaults
    # the documented defaults
    assert config.train.algorithm.name == "grpo"  # with DAPO's settings: what the demo's figures were measured with
    assert config.train.algorithm.loss_aggregation == "token"
    assert config.train.algorithm.advantage_scale == "std"
    assert config.train.algorithm.clip_low == 0.2 and config.train.algorithm.clip_high == 0.28
    assert config.rollout.samples_per_prompt >= 2
    # defaults survive a round trip through the validator
    assert RunConfig.model_validate(config.model_dump()) == config


def test_yaml_file_applies(tmp_path):
    path = write(
        tmp_path,
        """
        name: my-run
        dp: 3
        train:
          lr: 0.001
          algorithm:
            loss_aggregation: sequence
          betas: [0.8, 0.95]
        data:
          heldout: null
        """,
    )
    config = load_config(path)
    assert config.name == "my-run"
    assert config.dp == 3
    assert config.train.lr == 0.001
    assert config.train.algorithm.loss_aggregation == "sequence"
    assert config.train.betas == (0.8, 0.95)
    assert config.data.heldout is None
    # untouched fields keep their defaults
    assert config.train.minibatches == RunConfig().train.minibatches
    assert config.rollout == RunConfig().rollout


def test_a_command_parses_its_config_once_and_each_caller_gets_its_own_copy(tmp_path):
    """The command line, the flow run's name and the flow itself load the same config: one parse. A file
    whose text changed is parsed again; a caller's change to its copy is not seen by the next."""
    from engines.config import _parsed_text

    path = tmp_path / "run.yaml"
    path.write_text("name: once\ndp: 2\n")
    _parsed_text.cache_clear()
    first = load_config(path, ["train.lr=0.001"])
    first.dp = 7
    again = load_config(str(path), ["train.lr=0.001"])
    assert (again.name, again.dp, again.train.lr) == ("once", 2, 0.001)
    assert _parsed_text.cache_info().misses == 1
    path.write_text("name: twice\ndp: 2\n")
    assert load_config(path, ["train.lr=0.001"]).name == "twice"
    assert _parsed_text.cache_info().misses == 2


def test_empty_yaml_file_is_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == RunConfig()


def test_overrides_are_dotted_and_yaml_typed(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.001\n  minibatches: 4\n")
    config = load_config(
        path,
        [
            "train.lr=0.05",  # override wins over the file
            "dp=4",  # int
            "sampling.filter_equal_rewards=false",  # bool
            "train.betas=[0.5, 0.6]",  # list -> tuple
            "reward.rule=null",  # None
            "reward.genrm_weight=2",
            "storage.root=s3://bucket/prefix",  # a string with ':' and '/'
            "judge.template='{prompt}={response}'",  # quoted YAML; only the first '=' splits
        ],
    )
    assert config.train.lr == 0.05
    assert config.train.minibatches == 4  # from the file, not overridden
    assert config.dp == 4 and isinstance(config.dp, int)
    assert config.sampling.filter_equal_rewards is False
    assert config.train.betas == (0.5, 0.6)
    assert config.reward.rule is None
    assert config.reward.genrm_weight == 2.0
    assert config.storage.root == "s3://bucket/prefix"
    assert config.judge.template == "{prompt}={response}"


def test_override_without_file():
    config = load_config(None, ["checkpoint.keep_last=5", "train.algorithm.kl_coef=0.1"])
    assert config.checkpoint.keep_last == 5
    assert config.train.algorithm.kl_coef == 0.1


def test_paths_resolve_against_storage_root(tmp_path):
    config = load_config(None, [f"storage.root={tmp_path}", "name=abc"])
    assert config.uri("data/train") == f"file://{tmp_path}/data/train"
    assert config.run_uri == f"file://{tmp_path}/runs/abc"
    assert config.uri("/elsewhere/x") == "file:///elsewhere/x"  # absolute paths stay
    s3 = load_config(None, ["storage.root=s3://bucket/prefix"])
    assert s3.uri("models/policy") == "s3://bucket/prefix/models/policy"
    assert s3.uri("file:///abs/model") == "file:///abs/model"  # URIs stay


@pytest.mark.parametrize(
    "yaml_text,field,words",
    [
        ("train:\n  lrr: 0.1\n", "train.lrr", "is not a setting of train (did you mean train.lr?)"),  # unknown key
        ("train:\n  lr: fast\n", "train.lr", "number"),  # wrong type
        ("train:\n  lr: -1\n", "train.lr", "greater than 0"),  # bad value
        ("train:\n  algorithm:\n    loss_aggregation: tokens\n", "train.algorithm.grpo.loss_aggregation", "token"),  # not a choice
        ("train:\n  algorithm:\n    name: ppo2\n", "train.algorithm", "'grpo', 'gspo', 'cispo', 'rloo', 'reinforce_pp'"),
        ("train:\n  algorithm:\n    name: gspo\n    advantage_scale: none\n", "train.algorithm.advantage_scale",
         "not a setting of train.algorithm with train.algorithm.name=gspo (train.algorithm.name=grpo has it)"),
        ("train:\n  clip_low: 0.1\n", "train", "train.clip_low moved to train.algorithm.clip_low"),  # the old place
        ("name: Bad_Name\n", "name", "pattern"),
        ("bogus: 1\n", "bogus", "is not a top-level setting"),  # unknown top-level key
        ("train: 3\n", "train", "dictionary"),  # a section given a scalar
        ("rollout:\n  samples_per_prompt: 1\n", "rollout.samples_per_prompt", "greater than or equal to 2"),
    ],
)
def test_file_errors_name_file_and_field(tmp_path, yaml_text, field, words):
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert f"'{field}'" in message
    assert words.lower() in message.lower()


@pytest.mark.parametrize(
    "override,field",
    [("train.lrr=1", "train.lrr"), ("train.lr=abc", "train.lr"), ("train.lr=-1", "train.lr"), ("dp=0", "dp")],
)
def test_override_errors_name_file_override_and_field(tmp_path, override, field):
    path = write(tmp_path, "dp: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, [override])
    message = str(info.value)
    assert str(path) in message and override in message and f"'{field}'" in message


@pytest.mark.parametrize("overrides, said", [
    (["train.lrr=1e-4"], "field 'train.lrr' is not a setting of train (did you mean train.lr?)"),
    (["trian.lr=1e-4"], "field 'trian' is not a top-level setting (did you mean train?)"),
    (["lr=1e-4"], "field 'lr' is not a top-level setting (did you mean train.lr?)"),  # a setting of another section
    (["rollout.tool=[x:y]"], "field 'rollout.tool' is not a setting of rollout (did you mean rollout.tools?)"),
    (["train.lora.rank=4", "train.lora.rnak=8"], "field 'train.lora.rnak' is not a setting of train.lora (did you mean "
                                                 "train.lora.rank?)"),  # a section that is off by default
    (["train.algorithm.name=gspo", "train.algorithm.kl_coeff=0"], "field 'train.algorithm.kl_coeff' is not a setting of "
     "train.algorithm with train.algorithm.name=gspo (did you mean train.algorithm.kl_coef?)"),
    (["train.algorithm.name=gspo", "train.algorithm.advantage_scal=std"], "(train.algorithm.name=grpo has advantage_scale)"),
    (["storage.bucket=x"], "field 'storage.bucket' is not a setting of storage (its settings: root)"),  # nothing near
])
def test_an_unknown_key_is_answered_with_the_nearest_valid_names(overrides, said):
    """Issue 65: 'Extra inputs are not permitted' named no valid key; difflib's nearest names in the key's
    own section (else anywhere in the tree; else the section's settings) say what was meant."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert said in str(info.value) and "Extra inputs" not in str(info.value)


def test_cross_field_validator_names_section(tmp_path):
    path = write(tmp_path, "reward:\n  genrm_weight: 0\n  rule_weight: 0\n")
    with pytest.raises(ConfigError, match="no reward") as info:
        load_config(path)
    assert str(path) in str(info.value) and "'reward'" in str(info.value)
    # a rule with weight is a reward on its own
    assert load_config(path, ["reward.rule_weight=1"]).reward.rule_weight == 1.0


def test_all_errors_are_reported_together(tmp_path):
    path = write(tmp_path, "train:\n  lr: -1\n  algorithm:\n    clip_low: -0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "'train.lr'" in str(info.value) and "'train.algorithm.grpo.clip_low'" in str(info.value)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(missing)
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("text, message", [("train:\n  lr: [0.1\n", "not valid YAML"), ("- a\n- b\n", "mapping")])
def test_bad_file_contents(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_override_value_that_is_not_yaml(tmp_path):
    path = write(tmp_path, "dp: 2\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_config(path, ["judge.template={prompt}={answer}"])
    assert str(path) in str(info.value) and "'judge.template'" in str(info.value)


def test_malformed_overrides():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["name=x", "name.sub=1"])


def test_assignment_is_validated():
    config = load_config()
    with pytest.raises(ValueError):
        config.train.lr = -1.0
    with pytest.raises(ValueError):
        config.train.algorithm.loss_aggregation = "mean"


def test_shipped_deployment_validates():
    path = helpers.ROOT / "deployments" / "demo.yaml"
    if not path.exists():
        pytest.skip("no deployments/demo.yaml in this checkout")
    config = load_config(path)
    assert config.name == "demo"
    assert config.uri("data/train").endswith("/yattflow-data/data/train")


def test_hosts_devices_one_entry_per_dp_group():
    assert load_config(None, ["dp=2", 'hosts.devices=["0", "1"]']).hosts.devices == ["0", "1"]
    with pytest.raises(ConfigError, match=r"hosts.devices has 1 entries for 2 engine hosts \(one per group\)"):
        load_config(None, ["dp=2", 'hosts.devices=["0"]'])
    with pytest.raises(ConfigError, match=r"field 'hosts.launch'"):
        load_config(None, ["hosts.launch=slurm"])


def test_recomputation_is_megatron_only_and_checked():
    config = load_config(None, ["train.backend=megatron", "train.recompute_granularity=selective", "train.recompute_modules=[mlp]"])
    assert config.train.recompute_granularity == "selective" and config.train.recompute_modules == ["mlp"]
    assert load_config().train.recompute_granularity == "none"
    with pytest.raises(ConfigError, match="'train.recompute_granularity'.*needs train.backend: megatron"):
        load_config(None, ["train.recompute_granularity=full"])
    with pytest.raises(ConfigError, match="'train.recompute_modules"):
        load_config(None, ["train.backend=megatron", "train.recompute_modules=[everything]"])
    with pytest.raises(ConfigError, match="'train.recompute_num_layers'"):
        load_config(None, ["train.backend=megatron", "train.recompute_num_layers=0"])


def test_every_field_is_described_and_listed_by_each_commands_help():
    """``yattflow train --help`` (and prepare's, demo's) lists every config field with its default
    and description: a field without a description is a defect."""
    import subprocess
    import sys
    from typing import get_origin

    from pydantic import BaseModel

    from engines.config import describe_fields, sections_of

    def leaves(section, prefix=""):
        for name, field in section.model_fields.items():
            variants = sections_of(field.annotation)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from leaves(field.annotation, f"{prefix}{name}.")
            elif len(variants) > 1:  # train.algorithm: the choice (described by the field), then every variant's fields
                yield f"{prefix}{name}.name", field
                for variant in variants:
                    yield from ((k, f) for k, f in leaves(variant, f"{prefix}{name}.") if k != f"{prefix}{name}.name")
            else:  # a value, a section that is off by default (train.lora), or one per name (eval.sets: a dict, its
                yield f"{prefix}{name}", field  # fields listed as eval.sets.<name>.data): the field, then its own fields
                each = "<name>." if get_origin(field.annotation) is dict else ""
                for variant in variants:
                    yield from leaves(variant, f"{prefix}{name}.{each}")

    undescribed = [key for key, field in leaves(RunConfig) if not (field.description or "").strip()]
    assert not undescribed, f"fields without a description: {undescribed}"
    listed = "\n".join(describe_fields())
    for command in ("train", "prepare", "demo"):
        out = subprocess.run([sys.executable, "-m", "flows.cli", command, "--help"], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parent.parent)
        assert out.returncode == 0 and f"usage: yattflow {command}" in out.stdout and listed in out.stdout
    for key, _ in leaves(RunConfig):
        assert f"\n  {key} = " in "\n" + listed, key


def test_the_controller_loads_no_engine_library():
    """The controller's modules (the command line, the flows, the configs and algorithms they read) import no
    torch, transformers, vLLM or Megatron-Core: those load in the engine hosts, and `yattflow train` starts in a
    fraction of a second (a torch imported by an algorithm's config cost 1.5 s per command)."""
    import subprocess
    import sys

    heavy = ("torch", "transformers", "vllm", "megatron")
    code = ("import sys, flows.cli, flows.training, flows.node_controller, flows.admin, flows.status, engines.config, "
            "engines.rl.registry; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=helpers.ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
