"""Chat templates: a checkpoint's Jinja template rendered as Hugging Face renders it.

The template comes from the checkpoint directory: `chat_template.jinja`, else the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates of
which "default" is used). Rendering follows transformers' `apply_chat_template`: a
sandboxed, immutable Jinja2 environment with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, `{% generation %}` blocks accepted, the `tojson` filter that
keeps non-ASCII text, and the globals `raise_exception` and `strftime_now`; the template
sees `messages`, `add_generation_prompt`, `tools`, `documents`, the special tokens
(`bos_token`, `eos_token`, ... from tokenizer_config.json) and any extra keyword
(e.g. `enable_thinking=False`). The rendered text already holds the special tokens the
template writes, so it is tokenized without adding any (as transformers does).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from .requests import InputError, InputTypeError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")
MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few kB


class TemplateError(InputError):
    """A chat template that cannot be read or rendered, or messages it refuses."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str                       # the Jinja text
    special_tokens: tuple = ()        # (name, text) pairs: bos_token, eos_token, ...
    origin: str = ""                  # the file it came from, for messages

    def render(self, messages, *, add_generation_prompt: bool = True, tools=None,
               documents=None, **kwargs) -> str:
        """The conversation as the model's prompt text."""
        messages = check_messages(messages)
        context = dict(self.special_tokens)
        context.update(kwargs)
        try:
            return _compile(self.source).render(
                messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **context)
        except TemplateError:
            raise
        except Exception as e:  # jinja2's errors, and what a template's own code raises
            raise TemplateError(f"chat template {self.origin or ''} failed to render: "
                                f"{type(e).__name__}: {e}") from None


def check_messages(messages) -> list[dict]:
    """A list of {"role": str, "content": ...} dicts (other keys are passed through)."""
    if not isinstance(messages, (list, tuple)):
        raise InputTypeError(f"messages must be a list of {{'role': ..., 'content': ...}} "
                             f"dicts, got {type(messages).__name__}")
    if not messages:
        raise InputError("messages is empty: give at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputTypeError(f"messages[{i}] must be a dict with 'role' and 'content', "
                                 f"got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise InputTypeError(f"messages[{i}]['role'] must be a string, got "
                                 f"{m.get('role')!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InputTypeError(f"messages[{i}]['content'] must be a string, got "
                                 f"{type(content).__name__}")
        out.append(dict(m))
    return out


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own filter: Jinja's built-in tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): rendered as
        their content, as transformers does when it does not collect masks."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template is not valid Jinja (line {e.lineno}): "
                            f"{e.message}") from None


def _token_text(value):
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_text(path: Path) -> str:
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"{path} is larger than {MAX_TEMPLATE_BYTES} bytes; not a chat "
                            "template")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TemplateError(f"{path} is not UTF-8 text: {e}") from None


def read(directory) -> ChatTemplate | None:
    """The chat template of a checkpoint directory, None when it has none."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    config: dict[str, Any] = {}
    config_file = directory / CONFIG_FILE
    if config_file.is_file():
        try:
            config = json.loads(_read_text(config_file))
        except json.JSONDecodeError as e:
            raise TemplateError(f"{config_file} is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise TemplateError(f"{config_file} must hold a JSON object")
    special = tuple((name, text) for name in SPECIAL_TOKENS
                    if (text := _token_text(config.get(name))) is not None)
    template_file = directory / TEMPLATE_FILE
    if template_file.is_file():
        return ChatTemplate(_read_text(template_file), special, str(template_file))
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise TemplateError(f"{config_file}: chat_template must be a string")
    return ChatTemplate(source, special, str(config_file))


def of(model) -> ChatTemplate:
    """The chat template of a loaded model (from its checkpoint directory)."""
    source = getattr(model, "source", None)
    template = read(source) if source else None
    if template is None:
        raise TemplateError(f"the model {source or ''} has no chat template "
                            f"({TEMPLATE_FILE}, or chat_template in {CONFIG_FILE}); pass a "
                            "prompt instead of messages")
    return template
