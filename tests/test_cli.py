"""`packed-ss generate | convert | bench` given careless input: one line on stderr
(`packed-ss <command>: error: ...`), exit status 2, no traceback, no hang, and, where
the input can be judged without the model, nothing loaded or compiled first."""

from __future__ import annotations

import contextlib
import json
import signal

import pytest

import packed_ss_jax as ps
from packed_ss_jax import cli, loading
import compiles


class Hang(BaseException):
    """Raised when a command runs past its deadline (a BaseException: nothing catches it)."""


@contextlib.contextmanager
def deadline(seconds: int):
    def expire(signum, frame):
        raise Hang(f"still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def files(tmp_path_factory, nemotron_dir):
    """Careless inputs on disk: a file where a directory belongs, broken config files,
    broken task files, an existing output."""
    root = tmp_path_factory.mktemp("careless")
    nemotron_cfg = json.loads((nemotron_dir / "config.json").read_text())

    def checkpoint(name, content):
        d = root / name
        d.mkdir()
        if isinstance(content, dict):
            content = json.dumps(content)
        (d / "config.json").write_bytes(content if isinstance(content, bytes) else content.encode())
        return d

    f = {"root": root, "nemotron": nemotron_dir}
    f["file"] = root / "a_file.txt"
    f["file"].write_text("not a directory\n")
    f["empty_dir"] = root / "empty"
    f["empty_dir"].mkdir()
    f["config_list"] = checkpoint("config_list", "[1, 2, 3]")
    f["config_bad_json"] = checkpoint("config_bad_json", '{"model_type": ')
    f["config_latin1"] = checkpoint("config_latin1", "{\"name\": \"caf\u00e9\"}".encode("latin-1"))
    f["config_str_size"] = checkpoint("config_str_size", dict(nemotron_cfg, hidden_size="64"))
    f["config_null_layers"] = checkpoint("config_null_layers",
                                         dict(nemotron_cfg, num_hidden_layers=None))
    f["config_dir"] = root / "config_dir"
    (f["config_dir"] / "config.json").mkdir(parents=True)
    f["lora_no_r"] = checkpoint("lora_no_r", nemotron_cfg)
    (f["lora_no_r"] / "linear_spec_lora").mkdir()
    (f["lora_no_r"] / "linear_spec_lora" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "lora_alpha": 16, "target_modules": ["o_proj"]}))
    f["existing"] = root / "existing_out"
    f["existing"].mkdir()
    for name, text in [("bad_json", '{"question": "q", "answer": "#### 1"}\n{oops\n'),
                       ("list_record", '[1, 2]\n'), ("empty", "\n\n"),
                       ("missing_field", '{"question": "q"}\n'),
                       ("number_answer", '{"question": "q", "answer": 72}\n'),
                       ("not_english", '{"index": 1, "query": "q", "lang": "zh"}\n')]:
        (root / f"{name}.jsonl").write_text(text)
    (root / "latin1.jsonl").write_bytes("{\"question\": \"caf\u00e9\"}\n".encode("latin-1"))
    (root / "fake.jsonl.gz").write_bytes(b"this is not gzip")
    return f


# (command line, may load the model). Paths in braces come from `files`.
CASES = {
    # generate: arguments
    "gen-no-prompt": (["generate"], False),
    "gen-empty-prompt": (["generate", "  "], False),
    "gen-prompt-and-ids": (["generate", "hi", "--ids", "1,2"], False),
    "gen-ids-not-ints": (["generate", "--ids", "1,x"], False),
    "gen-ids-empty": (["generate", "--ids", " , "], False),
    "gen-max-new-0": (["generate", "hi", "--max-new-tokens", "0"], False),
    "gen-max-new-neg": (["generate", "hi", "--max-new-tokens", "-3"], False),
    "gen-block-1": (["generate", "hi", "--block-size", "1"], False),
    "gen-block-float": (["generate", "hi", "--block-size", "2.5"], False),
    "gen-temp-neg": (["generate", "hi", "--temperature", "-1"], False),
    "gen-temp-nan": (["generate", "hi", "--temperature", "nan"], False),
    "gen-temp-inf": (["generate", "hi", "--temperature", "inf"], False),
    "gen-top-k-0": (["generate", "hi", "--temperature", "1", "--top-k", "0"], False),
    "gen-top-p-0": (["generate", "hi", "--temperature", "1", "--top-p", "0"], False),
    "gen-top-p-2": (["generate", "hi", "--temperature", "1", "--top-p", "2"], False),
    "gen-seed-neg": (["generate", "hi", "--seed", "-1"], False),
    "gen-seed-big": (["generate", "hi", "--seed", str(2**32)], False),
    "gen-schedule": (["generate", "hi", "--schedule", "cubic"], False),
    "gen-dtype": (["generate", "hi", "--dtype", "float16"], False),
    "gen-unknown-flag": (["generate", "hi", "--fast"], False),
    "gen-model-missing": (["generate", "hi", "--model", "{root}/nowhere"], False),
    # generate: checkpoints and requests the model refuses (loaded, nothing compiled)
    "gen-model-file": (["generate", "hi", "--model", "{file}"], True),
    "gen-model-no-config": (["generate", "hi", "--model", "{empty_dir}"], True),
    "gen-config-list": (["generate", "hi", "--model", "{config_list}"], True),
    "gen-config-bad-json": (["generate", "hi", "--model", "{config_bad_json}"], True),
    "gen-config-latin1": (["generate", "hi", "--model", "{config_latin1}"], True),
    "gen-config-str-size": (["generate", "hi", "--model", "{config_str_size}"], True),
    "gen-config-dir": (["generate", "hi", "--model", "{config_dir}"], True),
    "gen-ids-outside-vocab": (["generate", "--ids", "1,99999"], True),
    "gen-exceeds-cache": (["generate", "hi", "--max-new-tokens", "5000"], True),
    "gen-block-exceeds-cache": (["generate", "hi", "--block-size", "4096",
                                 "--max-new-tokens", "8"], True),
    "gen-text-without-tokenizer": (["generate", "hi", "--model", "{nemotron}",
                                    "--max-new-tokens", "4"], True),
    # convert
    "conv-no-args": (["convert"], False),
    "conv-one-arg": (["convert", "{nemotron}"], False),
    "conv-dtype": (["convert", "{nemotron}", "{root}/out1", "--dtype", "float16"], False),
    "conv-lora-and-no-lora": (["convert", "{nemotron}", "{root}/out2", "--lora", "--no-lora"],
                              False),
    "conv-src-missing": (["convert", "{root}/nowhere", "{root}/out3"], True),
    "conv-src-file": (["convert", "{file}", "{root}/out4"], True),
    "conv-dst-exists": (["convert", "{nemotron}", "{existing}", "--quiet"], True),
    "conv-no-config": (["convert", "{empty_dir}", "{root}/out5", "--quiet"], True),
    "conv-config-list": (["convert", "{config_list}", "{root}/out6", "--quiet"], True),
    "conv-config-null": (["convert", "{config_null_layers}", "{root}/out7", "--quiet"], True),
    "conv-lora-no-r": (["convert", "{lora_no_r}", "{root}/out8", "--quiet"], True),
    # bench: every argument judged before the model is loaded
    "bench-limit-neg": (["bench", "--limit", "-1"], False),
    "bench-limit-0": (["bench", "--limit", "0"], False),
    "bench-limit-x": (["bench", "--limit", "x"], False),
    "bench-resamples-0": (["bench", "--resamples", "0"], False),
    "bench-repeats-0": (["bench", "--repeats", "0"], False),
    "bench-temp-neg": (["bench", "--temperature", "-0.5"], False),
    "bench-temp-nan": (["bench", "--temperature", "nan"], False),
    "bench-max-new-0": (["bench", "--max-new-tokens", "0"], False),
    "bench-seed-neg": (["bench", "--seed", "-1"], False),
    "bench-seed-overflow": (["bench", "--seed", str(2**32 - 2), "--limit", "5"], False),
    "bench-block-1": (["bench", "--block-size", "1"], False),
    "bench-block-x": (["bench", "--block-size", "x"], False),
    "bench-block-empty-value": (["bench", "--block-size", "packed="], False),
    "bench-block-not-scheduled": (["bench", "--schedules", "ar,packed",
                                   "--block-size", "linear=4"], False),
    "bench-probe-1": (["bench", "--probe", "1,4"], False),
    "bench-schedules-unknown": (["bench", "--schedules", "packed,cubic"], False),
    "bench-schedules-empty": (["bench", "--schedules", ","], False),
    "bench-split": (["bench", "--split", "half"], False),
    "bench-task": (["bench", "--task", "trivia"], False),
    "bench-task-needs-data": (["bench", "--task", "gsm8k"], False),
    "bench-data-missing": (["bench", "--task", "gsm8k", "--data", "{root}/none.jsonl"], False),
    "bench-data-dir": (["bench", "--task", "gsm8k", "--data", "{root}"], False),
    "bench-data-bad-json": (["bench", "--task", "gsm8k", "--data", "{root}/bad_json.jsonl"], False),
    "bench-data-list-record": (["bench", "--task", "gsm8k", "--data",
                                "{root}/list_record.jsonl"], False),
    "bench-data-empty": (["bench", "--task", "gsm8k", "--data", "{root}/empty.jsonl"], False),
    "bench-data-missing-field": (["bench", "--task", "gsm8k", "--data",
                                  "{root}/missing_field.jsonl"], False),
    "bench-data-wrong-type": (["bench", "--task", "gsm8k", "--data",
                               "{root}/number_answer.jsonl"], False),
    "bench-data-latin1": (["bench", "--task", "gsm8k", "--data", "{root}/latin1.jsonl"], False),
    "bench-data-not-gzip": (["bench", "--task", "gsm8k", "--data", "{root}/fake.jsonl.gz"], False),
    "bench-data-no-prompts": (["bench", "--task", "writingbench", "--data",
                               "{root}/not_english.jsonl"], False),
    "bench-data-for-offline-task": (["bench", "--data", "{root}/bad_json.jsonl"], False),
    "bench-json-dir": (["bench", "--json", "{root}"], False),
    "bench-json-below-a-file": (["bench", "--json", "{file}/nowhere/r.json"], False),
    "bench-json-parent-file": (["bench", "--json", "{file}/r.json"], False),
    "bench-plot-no-linear": (["bench", "--schedules", "ar,packed", "--plot", "{root}/f.png"], False),
    "bench-plot-format": (["bench", "--plot", "{root}/f.docx"], False),
    "bench-plot-below-a-file": (["bench", "--plot", "{file}/nowhere/f.png"], False),
    "bench-profile-file": (["bench", "--profile", "{file}"], False),
    "bench-profile-under-file": (["bench", "--profile", "{file}/trace"], False),
    "bench-json-is-plot": (["bench", "--json", "{root}/same", "--plot", "{root}/same"], False),
    "bench-unknown-flag": (["bench", "--fast"], False),
    # bench: judged once the model is loaded, still before anything is compiled
    "bench-model-missing": (["bench", "--model", "{root}/nowhere"], True),
    "bench-config-list": (["bench", "--model", "{config_list}"], True),
    "bench-block-exceeds-cache": (["bench", "--limit", "1", "--block-size", "4096"], True),
    "bench-probe-exceeds-cache": (["bench", "--limit", "1", "--probe", "4,4096"], True),
}


def _argv(template: list[str], files) -> list[str]:
    return [a.format(**{k: str(v) for k, v in files.items()}) for a in template]


def _failures(command: str, files, capsys, monkeypatch) -> list[str]:
    """Runs every case of `command`; returns how each one that misbehaves misbehaves."""
    wrong = []
    programs = compiles.record(monkeypatch)
    for name, (template, may_load) in CASES.items():
        if template[0] != command:
            continue
        with monkeypatch.context() as m:
            if not may_load:
                def refuse(*a, **k):
                    raise AssertionError("the model was loaded before the arguments were "
                                         "checked")

                m.setattr(loading, "load", refuse)
                m.setattr(ps, "load", refuse)
            compiled = len(programs)
            try:
                with deadline(120):
                    rc = cli.main(_argv(template, files))
            except BaseException as e:  # noqa: BLE001 - SystemExit, a hang, any exception
                capsys.readouterr()
                wrong.append(f"{name}: raised {type(e).__name__}: {e}")
                continue
        out, err = capsys.readouterr()
        lines = err.splitlines()
        if rc != 2 or len(lines) != 1 or not lines[0].startswith(f"packed-ss {command}: error: ") \
                or "Traceback" in err + out:
            wrong.append(f"{name}: status {rc}, stderr {err!r}")
        elif len(programs) != compiled:
            wrong.append(f"{name}: compiled a program before refusing")
    if any(p.name.startswith("out") for p in files["root"].iterdir()):
        wrong.append("an output was written")
    return wrong


@pytest.mark.parametrize("command", ["generate", "convert", "bench"])
def test_careless_command_lines(command, files, capsys, monkeypatch):
    """Every case: status 2, one stderr line `packed-ss <command>: error: ...`, no
    traceback, no hang; nothing compiled; the model not even loaded when the command
    line alone is wrong."""
    wrong = _failures(command, files, capsys, monkeypatch)
    assert not wrong, f"{len(wrong)} cases:\n" + "\n".join(wrong)


def test_only_expected_errors_become_one_line(monkeypatch, tmp_path, capsys):
    """An expected failure is one line with the command's name (the convert script keeps
    its own); a bug keeps its traceback."""
    from packed_ss_jax.cli import convert_main
    from packed_ss_jax.config import ConfigError

    def refuse(*a, **k):
        raise ConfigError("first line\nsecond line")

    monkeypatch.setattr(loading, "load", refuse)
    assert cli.main(["generate", "hi"]) == 2
    assert capsys.readouterr().err == "packed-ss generate: error: first line; second line\n"
    assert convert_main([str(tmp_path)]) == 2  # dst missing
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("packed-ss-convert: error: ")

    def broken(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(loading, "load", broken)
    with pytest.raises(ZeroDivisionError):
        cli.main(["generate", "hi"])


def test_unknown_command_is_one_line(capsys):
    assert cli.main(["decode", "hi"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("packed-ss: error: unknown command 'decode'")


def test_version(capsys):
    import jax
    import jaxlib

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == (f"packed-ss {ps.__version__} (jax {jax.__version__}, "
                                       f"jaxlib {jaxlib.__version__})\n")


@pytest.mark.parametrize("build", [cli._generate_parser, cli._serve_parser])
def test_every_flag_says_what_it_does_and_its_default(build):
    import argparse

    for action in build("packed-ss")._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings} has no help text"
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        shown = not flag and action.default is not None and action.default not in (
            [], (), argparse.SUPPRESS)
        assert not shown or "default" in action.help, \
            f"{action.option_strings}: its help does not say its default {action.default!r}"
