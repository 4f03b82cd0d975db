"""Chat templates: a checkpoint's Jinja template rendered as Hugging Face renders it.

The template is the checkpoint's `chat_template.jinja`, else the `chat_template` of
`tokenizer_config.json` (of a list of named ones, "default"); it renders as transformers'
`apply_chat_template` does, seeing `messages`, `add_generation_prompt`, `tools`,
`documents`, the special tokens and any extra keyword, and the text is tokenized without
adding special tokens. A template is code from the internet, so it runs in a worker
process under limits (template_render.py; `of(model, time_limit=..., max_chars=...)` sets
them) and sees plain data only. The environment and the limits: docs/api.md#chat and
docs/hostile_input.md#chat-templates.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import template_render, validate
from .validate import InputError, InputTypeError
from .template_render import MAX_CHARS, TIME_LIMIT, RenderFailure, memory_limit

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")
MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few kB
MAX_DEPTH = 64  # levels of lists and dicts in the template's data (tool schemas use ~10)
# Names render() gives the template itself, or takes for its limits: not template kwargs.
# (add_generation_prompt, tools and documents are render()'s too, but a request may give
# them there: the API has no field of its own for them.)
RESERVED = ("messages", "time_limit", "max_chars")
_LIMITS = ("time_limit", "max_chars")


class TemplateError(InputError):
    """A chat template that cannot be read or rendered, or messages it refuses."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str                       # the Jinja text
    special_tokens: tuple = ()        # (name, text) pairs: bos_token, eos_token, ...
    origin: str = ""                  # the file it came from
    # The render's limits. Fields, not render() arguments: a request's chat_template_kwargs
    # reach render() as keywords, and must not be able to lift them.
    time_limit: float = TIME_LIMIT    # seconds of wall time
    max_chars: int = MAX_CHARS        # characters of output

    def __post_init__(self):
        time_limit, max_chars = _limits(self.time_limit, self.max_chars)
        object.__setattr__(self, "time_limit", time_limit)
        object.__setattr__(self, "max_chars", max_chars)

    @property
    def name(self) -> str:
        """How messages name the template: its checkpoint folder and file, not the whole
        path (an error a server returns must not tell where it is installed)."""
        return short_name(self.origin) if self.origin else ""

    def limited(self, time_limit: float | None = None, max_chars: int | None = None):
        """This template with other limits (None keeps one)."""
        return dataclasses.replace(
            self, time_limit=self.time_limit if time_limit is None else time_limit,
            max_chars=self.max_chars if max_chars is None else max_chars)

    def render(self, messages, /, *, add_generation_prompt: bool = True, tools=None,
               documents=None, **kwargs) -> str:
        """The conversation as the model's prompt text, rendered in the template worker
        (template_render.py) within this template's time_limit and max_chars."""
        _refuse_reserved(kwargs, RESERVED)
        context, size = self._context(messages, add_generation_prompt, tools, documents,
                                      kwargs)
        if size > self.max_chars:
            raise InputError(f"the messages and template arguments hold {size} characters, "
                             f"more than the chat template may render ({self.max_chars})")
        try:
            return template_render.render(self.source, context, time_limit=self.time_limit,
                                          max_chars=self.max_chars)
        except RenderFailure as f:
            if f.kind == "unavailable":
                raise RuntimeError(f"cannot render chat templates: {f.detail}") from None
            raise TemplateError(self._explain(f)) from None

    def _context(self, messages, add_generation_prompt, tools, documents, kwargs):
        """What the template sees, as plain data, and how many characters it holds."""
        size = [0]
        context = {name: _plain(text, (name,), size) for name, text in self.special_tokens}
        for key, value in kwargs.items():
            context[key] = _plain(value, ("chat_template_kwargs", key), size)
        context["messages"] = check_messages(messages, size)
        context["tools"] = _plain(tools, ("tools",), size)
        context["documents"] = _plain(documents, ("documents",), size)
        context["add_generation_prompt"] = _plain(add_generation_prompt,
                                                  ("add_generation_prompt",), size)
        return context, size[0]

    def _explain(self, f: RenderFailure) -> str:
        fields = {"line": "?", "at": "?", "code": 0, **f.extra}
        return _FAILURES.get(f.kind, _CRASHED).format(
            who=f"the chat template ({self.name})" if self.name else "the chat template",
            detail=f.detail or f.kind, time_limit=self.time_limit, max_chars=self.max_chars,
            memory=memory_limit(self.max_chars) >> 20, **fields)


# What each RenderFailure kind says (the template's own words go in as a value, `detail`).
_FAILURES = {
    "timeout": "{who} took longer than {time_limit:g} s to render",
    "too_long": "{who} rendered more than {max_chars} characters",
    "memory": "{who} needed more than {memory} MiB of memory to render",
    "refused": "{who} refused the messages: {detail}",
    "syntax": "{who} is not valid Jinja (line {line}): {detail}",
    "error": "{who} failed to render: {detail}",
    "surrogate": "{who} rendered invalid Unicode text: a lone surrogate (U+{code:04X}) at "
                 "character {at}",
}
_CRASHED = "{who} crashed the renderer: {detail}"


def short_name(path) -> str:
    """`folder/file` of a path: what messages show of a checkpoint's file."""
    path = Path(path)
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def template_kwargs(value) -> dict:
    """A request's `chat_template_kwargs`, checked: a dict of names to values, none of them
    a name render() sets itself (RESERVED; add_generation_prompt may be chosen)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InputTypeError(f"chat_template_kwargs must be a dict of names to values, got "
                             f"{type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise InputTypeError(f"chat_template_kwargs keys must be strings, got {key!r}")
    _refuse_reserved(value, RESERVED)
    return dict(value)


def _refuse_reserved(kwargs, names) -> None:
    for key in names:
        if key in kwargs:
            why = ("a limit on rendering, not a template argument" if key in _LIMITS
                   else "the template takes it from the request's own field")
            raise TemplateError(f"chat_template_kwargs may not set {key!r}: {why}")


def _limits(time_limit, max_chars) -> tuple[float, int]:
    if (isinstance(time_limit, bool) or not isinstance(time_limit, numbers.Real)
            or not math.isfinite(time_limit) or time_limit <= 0):
        raise InputError(f"time_limit must be a positive number of seconds, got "
                         f"{time_limit!r}")
    return float(time_limit), validate.integer(max_chars, "max_chars", 1)


def check_messages(messages, size: list | None = None) -> list[dict]:
    """A list of {"role": str, "content": ...} dicts (other keys are passed through), as
    plain data and valid Unicode text; adds their characters to size[0]."""
    size = [0] if size is None else size
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
        out.append(_plain(m, ("messages", i), size))
    return out


def _where(path: tuple) -> str:
    head, *rest = path
    return str(head) + "".join(f"[{k!r}]" for k in rest)


def _param(path: tuple) -> str | None:
    """The argument an error at `path` is about, where the path names it (a template
    keyword's); else left to the caller (`validate.about`)."""
    return "chat_template_kwargs" if path[0] == "chat_template_kwargs" else None


def _plain(value, path: tuple, size: list, depth: int = 0):
    """`value` as plain data (text, numbers, None, lists, tuples, dicts: what the template
    process takes), its text valid Unicode; adds the characters of its values to size[0].
    An error names the place, e.g. messages[0]['content'][1]['text']."""
    # Subclasses (enums, NumPy scalars) become the plain type: the worker unpickles only
    # builtins, so it never imports the modules that define them.
    if isinstance(value, str):
        size[0] += len(value)
        return validate.text(str.__str__(value), _where(path), _param(path))
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if depth >= MAX_DEPTH and isinstance(value, (Mapping, list, tuple)):
        raise InputError(f"{_where(path)} is nested more than {MAX_DEPTH} levels deep",
                         _param(path))
    if isinstance(value, Mapping):
        # Keys are checked, not counted: the size bounds the text a template is given.
        return {_plain(k, path + (k,), [0], depth + 1): _plain(v, path + (k,), size, depth + 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = (_plain(v, path + (i,), size, depth + 1) for i, v in enumerate(value))
        return tuple(items) if isinstance(value, tuple) else list(items)
    raise InputTypeError(f"{_where(path)} must be text, a number, a list or a dict for the "
                         f"chat template, got {type(value).__name__}", _param(path))


def _token_text(value):
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_text(path: Path) -> str:
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"{short_name(path)} is larger than {MAX_TEMPLATE_BYTES} bytes; "
                            "not a chat template")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TemplateError(f"{short_name(path)} is not UTF-8 text: {e}") from None


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
            raise TemplateError(f"{short_name(config_file)} is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise TemplateError(f"{short_name(config_file)} must hold a JSON object")
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
        raise TemplateError(f"{short_name(config_file)}: chat_template must be a string")
    return ChatTemplate(source, special, str(config_file))


def of(model, *, time_limit: float | None = None, max_chars: int | None = None
       ) -> ChatTemplate:
    """The chat template of a loaded model (from its checkpoint directory), with the given
    limits (None: the defaults, TIME_LIMIT and MAX_CHARS)."""
    source = getattr(model, "source", None)
    template = read(source) if source else None
    if template is None:
        name = Path(source).name if source else ""
        raise TemplateError(f"the model {name} has no chat template ({TEMPLATE_FILE}, or "
                            f"chat_template in {CONFIG_FILE}); pass a prompt instead of "
                            "messages")
    return template.limited(time_limit, max_chars)
