"""Chat prompts (``engines/backends/chat.py``): a prompts row (plain text or ``messages``) rendered
with the model's own chat template, the same by every engine and by the input checks; single BOS;
``data.chat_template=none``; prompts that need a template the model lacks, or that are too long once
rendered, fail before any engine loads, naming the file and field."""

from __future__ import annotations

import pyarrow as pa
import pytest
from tests.helpers import ROOT  # noqa: F401  (puts the checkout on sys.path)

from engines.backends import chat, multimodal
from engines.backends.torch.generator import TorchGenerator
from engines.config import load_config
from engines.demo.tiny_hub import build_bpe_tokenizer, save_tiny_hub_model
from engines.host import validation
from storage import datasets
from tests.helpers import save_tiny_model

AUTO = chat.PromptFormat("auto")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return str(save_tiny_hub_model("qwen3", tmp_path_factory.mktemp("qwen3"), hidden_size=64, num_layers=1))


def test_plain_text_and_messages_render_with_the_models_template_one_bos():
    qwen = chat.Renderer(build_bpe_tokenizer("qwen"), chat.PromptFormat("auto", "Be brief."))
    assert qwen.templated
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert qwen.text("What is 1+1?") == rendered  # plain text: one user turn after the system prompt
    assert qwen.text(MESSAGES) == rendered  # the conversation's own system turn, not a second one
    assert chat.Renderer(build_bpe_tokenizer("qwen"), AUTO).text("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    llama = build_bpe_tokenizer("llama3")  # its template writes <|begin_of_text|>; the tokenizer adds one too
    ids = chat.Renderer(llama, AUTO).ids("What is 1+1?")
    assert ids.count(llama.bos_token_id) == 1 and ids[0] == llama.bos_token_id
    assert chat.Renderer(llama, AUTO).encode_kwargs == {"add_special_tokens": False}

    # none: the text as it is, tokenized as before (BOS added by the tokenizer)
    plain = chat.Renderer(llama, chat.PromptFormat("none"))
    assert plain.text("What is 1+1?") == "What is 1+1?" and plain.ids("hi") == llama("hi")["input_ids"]
    with pytest.raises(chat.ChatTemplateError, match="data.chat_template=none"):
        plain.text(MESSAGES)


def test_prompts_need_a_template_the_model_lacks():
    from engines.demo.tiny import build_char_tokenizer

    bare = chat.Renderer(build_char_tokenizer(), AUTO)  # the tiny demo's: no template, so the demo is unchanged
    assert not bare.templated and bare.text("12+7=") == "12+7=" and bare.encode_kwargs == {}
    with pytest.raises(chat.ChatTemplateError, match="tokenizer has none"):
        bare.text(MESSAGES)
    with pytest.raises(chat.ChatTemplateError, match="data.system_prompt needs a chat template"):
        chat.Renderer(build_char_tokenizer(), chat.PromptFormat("auto", "Be brief.")).text("12+7=")


def test_the_rule_reads_the_raw_prompt():
    assert chat.question({"prompt": "12+7=", "messages": None}) == "12+7="
    assert chat.question({"prompt": None, "messages": MESSAGES + [{"role": "assistant", "content": "2"},
                                                                  {"role": "user", "content": "And 2+2?"}]}) == "And 2+2?"
    assert chat.source({"prompt": "x", "messages": MESSAGES}) == MESSAGES
    assert chat.source({"prompt": "x", "messages": None}) == "x"


def test_a_vision_processor_renders_through_its_own_template():
    from engines.demo.tiny_vision import build_vision_processor

    processor = build_vision_processor("0123456789+=?")
    assert not chat.Renderer(processor, AUTO).templated  # the vision demo's: none, so it is unchanged
    processor.chat_template = (  # Idefics3's (SmolVLM's) template: typed content parts
        "{% for m in messages %}{{ m['role'] | capitalize }}: {% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
        "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
    renderer = chat.Renderer(processor, AUTO)
    assert renderer.text("<image>1+2=?") == "User: <image>1+2=?<end_of_utterance>\nAssistant:"
    from engines.demo import vision

    image = vision.make_problems(1, 0)[0][1][0]
    batch = multimodal.model_inputs(processor, [renderer.text("<image>1+2=?")], [[image]], **renderer.encode_kwargs)
    ids = batch["input_ids"][0].tolist()
    assert processor.tokenizer.bos_token_id not in ids  # no BOS added to a rendered template
    plain = multimodal.model_inputs(processor, ["<image>1+2=?"], [[image]])["input_ids"][0].tolist()
    assert plain[0] == processor.tokenizer.bos_token_id  # plain text: added, as before


def test_every_engine_prompts_with_the_rendered_template(qwen3):
    generator = TorchGenerator(qwen3, prompt_format=chat.PromptFormat("auto", "Be brief."))
    out = generator.generate(["What is 1+1?", MESSAGES], greedy=True, max_new_tokens=2)
    expected = chat.Renderer(generator.tokenizer, chat.PromptFormat("auto", "Be brief.")).ids("What is 1+1?")
    assert out[0].prompt_ids == expected and out[1].prompt_ids == expected  # what the trainer trains on too
    assert TorchGenerator(qwen3).generate(["hi"], greedy=True, max_new_tokens=1)[0].prompt_ids == generator.tokenizer("hi")["input_ids"]


def _prompts(path, rows) -> str:
    datasets.write_table(str(path), pa.Table.from_pylist(rows), datasets.PROMPTS)
    return str(path)


def _config(tmp_path, policy, prompts, *overrides):
    return load_config(None, [f"storage.root={tmp_path}", f"model.policy={policy}", f"data.prompts={prompts}", "data.heldout=null",
                              "reward.genrm_weight=0", "reward.rule=engines.rl.math_rules:math_answer", "reward.rule_weight=1",
                              *overrides])


def test_bad_chat_prompts_fail_before_engines_load_naming_file_and_field(qwen3, tmp_path):
    chats = _prompts(tmp_path / "chats.parquet", [{"prompt_id": 1, "messages": MESSAGES, "answer": "2"}])
    assert validation.validate_inputs(_config(tmp_path, qwen3, chats)) == {"data.prompts": 1}

    # a messages column for a model without a chat template (the tiny char-tokenizer Llama)
    bare = save_tiny_model(tmp_path / "bare")
    with pytest.raises(validation.InputError, match=r"field 'messages' \(prompt_id 1\): chat messages .* tokenizer has none") as e:
        validation.validate_inputs(_config(tmp_path, bare, chats))
    assert chats in str(e.value) and "model.policy" in str(e.value)
    with pytest.raises(validation.InputError, match=r"data.chat_template=none renders none"):
        validation.validate_inputs(_config(tmp_path, qwen3, chats, "data.chat_template=none"))
    plain = _prompts(tmp_path / "plain.parquet", [{"prompt_id": 1, "prompt": "What is 1+1?", "answer": "2"}])
    with pytest.raises(validation.InputError, match=r"field 'prompt' \(prompt_id 1\): data.system_prompt needs a chat template"):
        validation.validate_inputs(_config(tmp_path, bare, plain, "data.system_prompt=Be brief."))

    # the length limit measures the rendered prompt: 8 tokens of text, more with the template
    text_only = len(build_bpe_tokenizer("qwen")("What is 1+1?")["input_ids"])
    limit = text_only + 2
    assert validation.validate_inputs(_config(tmp_path, qwen3, plain, f"data.max_prompt_tokens={limit}",
                                              "data.chat_template=none")) == {"data.prompts": 1}
    with pytest.raises(validation.InputError, match=rf"plain.parquet: field 'prompt' is \d+ tokens with the chat template "
                                                    rf"applied \(prompt_id 1\); the limit is data.max_prompt_tokens={limit}"):
        validation.validate_inputs(_config(tmp_path, qwen3, plain, f"data.max_prompt_tokens={limit}"))

    # neither a prompt nor messages; an empty user turn
    for rows, pattern in [([{"prompt_id": 1, "answer": "2"}], "missing field 'prompt'"),
                          ([{"prompt_id": 1, "prompt": None, "messages": MESSAGES, "answer": "2"},
                            {"prompt_id": 2, "prompt": None, "messages": None, "answer": "2"}],
                           r"field 'prompt' is null and there are no 'messages' \(prompt_id 2\)"),
                          ([{"prompt_id": 3, "messages": [{"role": "user", "content": " "}], "answer": "2"}],
                           r"field 'messages' has an empty last user turn \(prompt_id 3\)"),
                          ([{"prompt_id": 4, "messages": [{"role": "human", "content": "1+1?"}], "answer": "2"}],
                           r"field 'messages'\[0\] has role 'human' \(prompt_id 4\); a turn's role is one of system, user"),
                          # a number is refused, not converted: the demo's zero-padded '031' would become '31'
                          ([{"prompt_id": 5, "prompt": "1+1?", "answer": 31}],
                           r"field 'answer' has type int64, expected string: write it as text")]:
        path = tmp_path / "bad.parquet"
        path.unlink(missing_ok=True)
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        with pytest.raises((validation.InputError, datasets.SchemaError), match=pattern) as e:
            validation.validate_inputs(_config(tmp_path, qwen3, str(path)))
        assert str(path) in str(e.value)
