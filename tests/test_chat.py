"""Chat templates render as Hugging Face's apply_chat_template renders them: two real-world
templates (Mistral-style, from chat_template.jinja; Qwen3-style with enable_thinking, from
tokenizer_config.json) against expected strings written out here, and the embedded
models' own template, which gives the prompt format the embedded model was trained on."""

from pathlib import Path

import pytest

import packed_ss_jax as ps
from packed_ss_jax import api, chat

DATA = Path(__file__).parent / "data"
MISTRAL = chat.read(DATA / "chat_mistral")
QWEN3 = chat.read(DATA / "chat_qwen3")

TOOLS_PREAMBLE = (
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the "
    "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>\n")
TOOLS_END = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")


def test_mistral_style_template():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "What is 2+2?"}]
    # bos_token comes from an AddedToken dict; the file's trailing newline is trimmed.
    assert MISTRAL.render(messages) == \
        "<s>[INST] Hi [/INST]Hello!</s>[INST] What is 2+2? [/INST]"
    with pytest.raises(chat.TemplateError, match="roles must alternate"):
        MISTRAL.render([{"role": "assistant", "content": "x"}])


QWEN_CHAT = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello!"},
             {"role": "user", "content": "2+2?"}]
QWEN_HISTORY = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n"
                # reasoning of a turn before the last query is dropped
                "<|im_start|>assistant\nHello!<|im_end|>\n"
                "<|im_start|>user\n2+2?<|im_end|>\n")


def test_qwen3_style_template_with_and_without_thinking():
    assert QWEN3.render(QWEN_CHAT, enable_thinking=False) == \
        QWEN_HISTORY + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert QWEN3.render(QWEN_CHAT, enable_thinking=True) == \
        QWEN_HISTORY + "<|im_start|>assistant\n"
    assert QWEN3.render(QWEN_CHAT) == QWEN_HISTORY + "<|im_start|>assistant\n"
    assert QWEN3.render(QWEN_CHAT, add_generation_prompt=False) == QWEN_HISTORY
    # The last turn's reasoning (after the last query) is kept, normalised.
    last = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nYes."}]
    assert QWEN3.render(last, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nYes.<|im_end|>\n")


def test_qwen3_tools_use_transformers_tojson():
    tools = [{"type": "function", "function": {"name": "wetter",
                                               "description": "Wetter in München"}}]
    # json.dumps with the default separators and ensure_ascii=False (not Jinja's tojson,
    # which would escape and sort).
    assert QWEN3.render([{"role": "user", "content": "Hi"}], tools=tools) == (
        TOOLS_PREAMBLE + '{"type": "function", "function": {"name": "wetter", '
        '"description": "Wetter in München"}}' + TOOLS_END +
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_templates_are_sandboxed():
    evil = chat.ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(chat.TemplateError, match="failed to render"):
        evil.render([{"role": "user", "content": "x"}])
    immutable = chat.ChatTemplate("{% set _ = messages.append(1) %}")
    with pytest.raises(chat.TemplateError):
        immutable.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("bad,match", [
    ("hi", "messages must be a list"), ([], "messages is empty"),
    (["hi"], r"messages\[0\] must be a dict"), ([{"content": "x"}], r"\['role'\]"),
    ([{"role": "user", "content": 3}], r"\['content'\] must be a string"),
])
def test_bad_messages_are_named(bad, match):
    with pytest.raises(ps.InputError, match=match):
        QWEN3.render(bad)


def test_embedded_template_is_the_training_prompt():
    model = ps.load()
    messages = [{"role": "user", "content": "Ava has 3 apples. How many apples does Ava have?"}]
    text = chat.of(model).render(messages)
    assert text == "<s>Question: Ava has 3 apples. How many apples does Ava have?\nAnswer:"
    assert api.chat_prompt(model, messages) == model.tokenizer.encode(
        "Question: Ava has 3 apples. How many apples does Ava have?\nAnswer:").ids


def test_a_model_without_a_template_says_so(tmp_path):
    with pytest.raises(chat.TemplateError, match="no chat template"):
        chat.of(ps.Model(config=None, params=None, source=str(tmp_path)))
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [1]')
    with pytest.raises(chat.TemplateError, match="not valid JSON"):
        chat.read(tmp_path)


def test_bench_renders_prompts_through_the_template():
    from packed_ss_jax.bench import harness, tasks

    model = ps.load()
    prompts = harness.chat_prompts(model, tasks.load("arithmetic", None, 2), "arithmetic")
    for p in prompts:
        question = p.text.removeprefix("Question: ").removesuffix("\nAnswer:")
        assert p.ids == api.chat_prompt(model, [{"role": "user", "content": p.text}])
        assert model.tokenizer.decode(p.ids).startswith("Question: Question: " + question)
    assert harness.CHAT_TEMPLATE_KWARGS[("setdlm", "gsm8k")] == {"enable_thinking": True}
