"""Chat templates are code from the internet: they render in a worker process within a wall
time and an output size (packed_ss_jax/template_render.py), and a template past either
fails with a TemplateError that names the template (by folder and file, never its whole
path) and the limit, from `ChatTemplate.render`, `api.chat_prompt` and `decode(messages=)`
alike. Templates that loop, recurse, format giant strings or write a hundred million
characters each end within the limit plus a margin; the worker is restarted after a kill,
renders what the in-process reference renders, and is never left behind."""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packed_ss_jax as ps
from packed_ss_jax import api, chat, template_render

DATA = Path(__file__).parent / "data"
MISTRAL = chat.read(DATA / "chat_mistral")
QWEN3 = chat.read(DATA / "chat_qwen3")
LIMIT = 0.5      # s: the deliberate timeouts
MARGIN = 2.0     # s: killing and reaping the worker, on a busy two-core machine
ORIGIN = "/opt/secret-install/evil-ckpt/chat_template.jinja"
NAME = "evil-ckpt/chat_template.jinja"
MESSAGES = [{"role": "user", "content": "Hi"}]
ANY_LIMIT = (rf"took longer than {LIMIT:g} s|rendered more than {chat.MAX_CHARS} characters|"
             rf"needed more than {template_render.memory_limit(chat.MAX_CHARS) >> 20} MiB")
FEW = settings(max_examples=3, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow])


def hostile(source: str, **limits) -> chat.ChatTemplate:
    return chat.ChatTemplate(source, origin=ORIGIN, **{"time_limit": LIMIT, **limits})


def refused(template: chat.ChatTemplate, pattern: str, messages=MESSAGES) -> str:
    """The render's error message, checked: within the limit, naming template and limit."""
    start = time.monotonic()
    with pytest.raises(chat.TemplateError) as e:
        template.render(messages)
    assert time.monotonic() - start < template.time_limit + MARGIN
    message = str(e.value)
    assert message.startswith(f"the chat template ({NAME})") and "secret" not in message
    assert re.search(pattern, message), message
    return message


def alive(pid: int) -> bool:
    """Whether any thread of `pid` runs (a zombie nobody reaped has ended; its leader is a
    zombie before its other threads are gone, and only then can it be reaped)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        states = [(t / "stat").read_text().rpartition(")")[2].split()[0] for t in tasks]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(state != "Z" for state in states)


def eventually_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


# --- each class of runaway template ends within its limit ---

@FEW
@given(depth=st.integers(2, 3), body=st.sampled_from(["", "{% set x = i %}", "{{ '' }}"]))
def test_loops_end_at_the_time_limit(depth, body):
    source = "{% for i in range(100000) %}" * depth + body + "{% endfor %}" * depth
    refused(hostile(source), rf"took longer than {LIMIT:g} s to render")


@FEW
@given(branches=st.integers(2, 4), piece=st.sampled_from(["", "x", "{{ n }}"]))
def test_recursion_ends(branches, piece):
    # A macro calling itself `branches` times per level: exponential work (or output).
    calls = "{{ f(n + 1) }}" * branches
    tree = ("{% macro f(n) %}{% if n < 60 %}" + calls + "{% else %}" + piece +
            "{% endif %}{% endmacro %}{{ f(0) }}")
    refused(hostile(tree), ANY_LIMIT)


def test_deep_recursion_is_a_render_error():
    deep = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    refused(hostile(deep), "failed to render: RecursionError")


# `{n}` is a size, literal or a variable.
FORMATS = ["('{{:>' ~ {n} ~ '}}').format(1)", "('%' ~ {n} ~ 'd') % 1", "'a' * {n}",
           "'x'|center({n})", "'x'.ljust({n})", "{{'a': [1, {{'b': 2}}]}}|tojson(indent={n})",
           "('ab' * 1000).replace('a', 'a' * ({n} // 1000))",
           "'x' * ({n} // 2) ~ 'y' * ({n} // 2)", "[0] * {n}"]


@pytest.mark.parametrize("form", FORMATS)
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(size=st.sampled_from([10**8, 10**9, 10**10]), via_variable=st.booleans())
def test_giant_strings_end_at_a_limit(form, size, via_variable):
    # A literal size is folded while Jinja compiles; a variable one while it renders.
    expr = form.format(n="n" if via_variable else size)
    source = ("{% set n = " + str(size) + " %}" if via_variable else "") + "{{ " + expr + " }}"
    refused(hostile(source, time_limit=5.0), ANY_LIMIT.replace(f"{LIMIT:g} s", "5 s"))


@pytest.mark.parametrize("source", [
    "{% for i in range(10000) %}{{ 'x' * 10000 }}{% endfor %}",        # 100 M in pieces
    "{% set n = 100000000 %}{{ 'x' * n }}",                             # in one piece
    "{% for m in messages * 100000 %}{{ m.content * 1000 }}{% endfor %}",
], ids=["pieces", "one-piece", "from-messages"])
def test_huge_output_ends_at_the_size_limit(source):
    refused(hostile(source, time_limit=5.0), rf"rendered more than {chat.MAX_CHARS} characters")
    small = hostile("{{ 'x' * 11 }}", max_chars=10)
    refused(small, "rendered more than 10 characters")
    assert small.limited(max_chars=11).render(MESSAGES) == "x" * 11


def test_a_killed_render_leaves_a_working_worker():
    assert QWEN3.render(MESSAGES)  # a worker is running
    before = template_render.worker_pid()
    refused(hostile("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}"), "took longer than")
    assert template_render.worker_pid() is None and not alive(before)
    assert MISTRAL.render(MESSAGES) == "<s>[INST] Hi [/INST]"
    assert template_render.worker_pid() not in (None, before)


def test_a_worker_killed_from_outside_is_replaced():
    QWEN3.render(MESSAGES)
    pid = template_render.worker_pid()
    os.kill(pid, signal.SIGKILL)
    assert eventually_gone(pid, MARGIN)
    assert MISTRAL.render(MESSAGES) == "<s>[INST] Hi [/INST]"  # died idle: replaced quietly
    loop = hostile("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                   "{% endfor %}", time_limit=30.0)
    pid = template_render.worker_pid()
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    refused(loop, r"crashed the renderer: the worker exited with status -9")
    assert MISTRAL.render(MESSAGES) == "<s>[INST] Hi [/INST]"


# --- what a template says and is given ---

@pytest.mark.parametrize("source,pattern", [
    ("{{ raise_exception('no tools here') }}", "refused the messages: no tools here"),
    ("{% if %}", r"is not valid Jinja \(line 1\): "),
    ("{{ messages.__class__.__mro__ }}", "failed to render: SecurityError"),
    ("{{ x.y }}", "failed to render: UndefinedError: 'x' is undefined"),
    ("{{ '\\ud800' }}", r"rendered invalid Unicode text: a lone surrogate \(U\+D800\) at "
                        "character 0"),
])
def test_template_errors_name_the_template(source, pattern):
    refused(hostile(source), pattern)
    anonymous = chat.ChatTemplate(source)
    with pytest.raises(chat.TemplateError, match=r"^the chat template (refused|is|failed|rend)"):
        anonymous.render(MESSAGES)


TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=4), system=TEXT,
       thinking=st.booleans(), generation=st.booleans())
def test_renderings_equal_the_in_process_reference(turns, system, thinking, generation):
    messages = [{"role": "system", "content": system}]
    for question, answer in turns:
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    for template, kwargs in ((QWEN3, {"enable_thinking": thinking}), (MISTRAL, {})):
        chat_only = messages[1:] if template is MISTRAL else messages
        context = {**dict(template.special_tokens), **kwargs, "messages": chat_only,
                   "tools": None, "documents": None, "add_generation_prompt": generation}
        try:
            expected = template_render.render_here(template.source, context)
        except template_render.RenderFailure as e:
            with pytest.raises(chat.TemplateError, match=re.escape(e.detail)):
                template.render(chat_only, add_generation_prompt=generation, **kwargs)
            continue
        assert template.render(chat_only, add_generation_prompt=generation,
                               **kwargs) == expected


def test_threads_share_the_worker():
    def one(i):
        return QWEN3.render([{"role": "user", "content": f"question {i}"}],
                            add_generation_prompt=False)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(24)))
    assert got == [f"<|im_start|>user\nquestion {i}<|im_end|>\n" for i in range(24)]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(text=TEXT, at=st.integers(0, 40), code=st.integers(0xD800, 0xDFFF),
       place=st.sampled_from(["content", "role", "part", "name"]))
def test_lone_surrogates_are_refused_where_they_are(text, at, code, place):
    bad = text[:at] + chr(code) + text[at:]
    message = {"role": "user", "content": "fine"}
    where = {"content": "messages[0]['content']", "role": "messages[0]['role']",
             "part": "messages[0]['content'][1]['text']", "name": "messages[0]['name']"}[place]
    if place == "part":
        message["content"] = [{"type": "text", "text": "ok"}, {"type": "text", "text": bad}]
    else:
        message[place] = bad
    with pytest.raises(ps.InputError, match=re.escape(where) + " is not valid Unicode text: "
                       rf"a lone surrogate \(U\+{code:04X}\) at character {min(at, len(text))}"):
        QWEN3.render([message])
    with pytest.raises(ps.InputError, match=r"chat_template_kwargs\['x'\] is not valid Unicode"):
        QWEN3.render(MESSAGES, x=bad)
    with pytest.raises(ps.InputError, match=r"tools\[0\]\['name'\] is not valid Unicode"):
        QWEN3.render(MESSAGES, tools=[{"name": bad}])


def test_template_data_must_be_plain():
    with pytest.raises(ps.InputError, match=r"chat_template_kwargs\['when'\] must be text, a "
                       "number, a list or a dict for the chat template, got object"):
        QWEN3.render(MESSAGES, when=object())
    nested: list = []
    for _ in range(chat.MAX_DEPTH + 1):
        nested = [nested]
    with pytest.raises(ps.InputError, match=f"nested more than {chat.MAX_DEPTH} levels deep"):
        QWEN3.render(MESSAGES, deep=nested)
    # Each error names the argument that holds the value (a server's 400 names the field).
    for kwargs, param in [({"deep": nested}, "chat_template_kwargs"),
                          ({"when": object()}, "chat_template_kwargs"),
                          ({"x": "\ud800"}, "chat_template_kwargs")]:
        with pytest.raises(ps.InputError) as e:
            QWEN3.render(MESSAGES, **kwargs)
        assert e.value.param == param
    with pytest.raises(ps.InputError) as e:
        QWEN3.render([{"role": "user", "content": nested}])
    assert e.value.param is None   # left to the caller: api.chat_prompt says "messages"
    with pytest.raises(ps.InputError, match=r"hold 12 characters, more than the chat "
                       r"template may render \(10\)"):
        hostile("{{ messages }}", max_chars=10).render([{"role": "user", "content": "a" * 8}])


@pytest.mark.parametrize("limits,pattern", [
    ({"time_limit": 0}, "time_limit must be a positive number of seconds, got 0"),
    ({"time_limit": float("inf")}, "time_limit must be a positive number"),
    ({"time_limit": True}, "time_limit must be a positive number"),
    ({"max_chars": 0}, r"max_chars must be an integer >= 1, got 0"),
    ({"max_chars": 2.5}, r"max_chars must be an integer >= 1, got 2.5"),
])
def test_limits_are_checked(limits, pattern):
    with pytest.raises(ps.InputError, match=pattern):
        chat.ChatTemplate("x", **limits)
    with pytest.raises(ps.InputError, match=pattern):
        chat.of(ps.load(), **limits)


# --- every entry point: API, decode, the server's check ---

@pytest.fixture(scope="module")
def evil_model(tmp_path_factory):
    """The embedded model with a 100-million-character template (its tokenizer would
    panic on that text)."""
    folder = tmp_path_factory.mktemp("ckpt") / "evil-ckpt"
    shutil.copytree(Path(ps.load().source), folder)
    (folder / "chat_template.jinja").write_text(
        "{% for i in range(10000) %}{{ 'x' * 10000 }}{% endfor %}")
    return ps.load(str(folder))


def test_every_entry_point_refuses_a_runaway_template(evil_model):
    expected = rf"^the chat template \({NAME}\) rendered more than {chat.MAX_CHARS} characters$"
    for call in (lambda: api.chat_prompt(evil_model, MESSAGES),
                 lambda: ps.decode(evil_model, messages=MESSAGES, max_new_tokens=2),
                 lambda: api.check(evil_model, messages=MESSAGES)):
        start = time.monotonic()
        with pytest.raises(chat.TemplateError, match=expected):
            call()
        assert time.monotonic() - start < chat.TIME_LIMIT + MARGIN


def test_chat_template_kwargs_cannot_collide():
    model = ps.load()
    for name in ("messages", "time_limit", "max_chars"):
        with pytest.raises(chat.TemplateError, match=f"chat_template_kwargs may not set "
                           f"'{name}'"):
            api.chat_prompt(model, MESSAGES, {name: 10**9})
    for name in chat.RESERVED:
        with pytest.raises(chat.TemplateError, match=f"may not set '{name}'"):
            chat.template_kwargs({name: []})
    assert chat.template_kwargs({"add_generation_prompt": False}) == \
        {"add_generation_prompt": False}
    with pytest.raises(ps.InputError, match="chat_template_kwargs must be a dict"):
        chat.template_kwargs(["x"])
    assert api.chat_prompt(model, MESSAGES, {"add_generation_prompt": False}) == \
        model.tokenizer.encode("Question: Hi\n").ids  # with <s>, the template's bos_token


def test_paths_stay_out_of_messages(tmp_path):
    folder = tmp_path / "secret-place" / "ckpt"
    folder.mkdir(parents=True)
    (folder / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(chat.TemplateError, match=r"^ckpt/tokenizer_config.json must hold") as e:
        chat.read(folder)
    assert "secret-place" not in str(e.value)
    with pytest.raises(chat.TemplateError, match="^the model ckpt has no chat template"):
        chat.of(ps.Model(config=None, params=None, source=str(tmp_path / "ckpt")))


# --- the worker process: never left behind ---

def test_shutdown_leaves_no_worker():
    QWEN3.render(MESSAGES)
    pid = template_render.worker_pid()
    assert alive(pid)
    template_render.shutdown()
    assert template_render.worker_pid() is None and not alive(pid)
    assert MISTRAL.render(MESSAGES) == "<s>[INST] Hi [/INST]"  # and it starts again


# Loads template_render.py alone (no JAX), renders, prints the worker's pid, then exits,
# is killed, or is killed mid-render.
CHILD = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("template_render", sys.argv[1])
tr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tr)
tr.render("{{ x }}", {"x": 1})
print(tr.worker_pid(), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "kill-mid-render":
    import threading
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    tr.render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
              "{% endfor %}", {}, time_limit=600)
"""


@pytest.mark.parametrize("how,within", [
    ("exit", 0.5), ("kill", MARGIN), ("kill-mid-render", template_render.ORPHAN_CHECK + MARGIN)])
def test_no_worker_outlives_its_parent(how, within):
    """At exit the worker is killed; after a parent killed outright it sees the end of its
    input, or, mid-render (of a template allowed 10 minutes), that its parent is gone."""
    child = subprocess.run([sys.executable, "-c", CHILD, template_render.__file__, how],
                           capture_output=True, text=True, timeout=60)
    pid = int(child.stdout.split()[0])
    assert eventually_gone(pid, within), f"the worker {pid} outlived its parent ({how})"


def test_worker_start_and_render_overhead_are_small():
    template_render.shutdown()
    start = time.perf_counter()
    MISTRAL.render(MESSAGES)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(50):
        MISTRAL.render(MESSAGES)
    each = (time.perf_counter() - start) / 50
    assert first < 10.0 and each < 0.05, (first, each)
