"""Benchmark tasks: the embedded model's offline tasks, and the paper's tasks from local
files in their public formats (App. E.1, E.3).

A task is a list of `Prompt`s (text, output cap, optional scorer). Output caps follow
the paper: 1,024 tokens for mathematics, 512 for code and writing.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Callable

from ..validate import InputError

from . import scoring

MATH_CAP, CODE_CAP, WRITING_CAP = 1024, 512, 512
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass
class Prompt:
    id: str
    text: str
    max_new_tokens: int
    score: Callable[[str], bool] | None = None  # continuation -> correct?
    stop_at_eos: bool = True
    ids: list[int] | None = None   # the prompt as ids, when it went through a chat template

    @property
    def source(self):
        """What is decoded: the ids when a chat template made them, else the text."""
        return self.text if self.ids is None else self.ids


class TaskError(InputError):
    """A task file that cannot be read as its task's public format."""


def read_jsonl(path: str | Path) -> list[dict]:
    """The records (JSON objects, one a line) of a .jsonl or .jsonl.gz file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    if path.is_dir():
        raise TaskError(f"task file {path} is a directory")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TaskError(f"{path}:{n}: not JSON ({e})") from None
                if not isinstance(row, dict):
                    raise TaskError(f"{path}:{n}: a record must be a JSON object, got "
                                    f"{type(row).__name__}")
                rows.append(row)
    except UnicodeDecodeError as e:
        raise TaskError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (gzip.BadGzipFile, EOFError) as e:
        raise TaskError(f"{path} is not a readable gzip file ({e})") from None
    if not rows:
        raise TaskError(f"{path} holds no records")
    return rows


def _need(row: dict, keys, path, types: dict | None = None) -> None:
    """The record has `keys`; those named in `types` hold values of that type."""
    missing = [k for k in keys if k not in row]
    if missing:
        raise TaskError(f"{path}: record lacks {missing} (fields: {sorted(row)})")
    for key, kind in (types or {}).items():
        value = row.get(key)
        if key not in row or (value is None and key not in keys):  # optional, absent or null
            continue
        if not isinstance(value, kind):
            what = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise TaskError(f"{path}: record field {key!r} must be a {what}, got "
                            f"{type(value).__name__} ({str(value)[:40]!r})")


def gsm8k(path) -> list[Prompt]:
    """GSM8K test.jsonl: {"question", "answer": "... #### 72"}; numeric answer match."""
    out = []
    for i, r in enumerate(read_jsonl(path)):
        _need(r, ["question", "answer"], path, {"question": str, "answer": str})
        ref = r["answer"].split("####")[-1]
        out.append(Prompt(f"gsm8k/{i}", r["question"] + BOXED, MATH_CAP,
                          lambda text, ref=ref: scoring.numeric_match(text, ref)))
    return out


def math500(path) -> list[Prompt]:
    """MATH-500 test.jsonl: {"problem", "answer", "unique_id"}; boxed-answer exact match."""
    out = []
    for i, r in enumerate(read_jsonl(path)):
        _need(r, ["problem", "answer"], path,
              {"problem": str, "answer": (str, int, float), "unique_id": str})
        out.append(Prompt(r.get("unique_id", f"math500/{i}"), r["problem"] + BOXED, MATH_CAP,
                          lambda text, ref=str(r["answer"]): scoring.boxed_match(text, ref)))
    return out


def humaneval(path) -> list[Prompt]:
    """HumanEval.jsonl(.gz): {"task_id", "prompt", "test", "entry_point"}; function completion,
    pass@1 by running `prompt + completion + test + check(entry_point)`."""
    out = []
    for r in read_jsonl(path):
        _need(r, ["task_id", "prompt", "test", "entry_point"], path,
              {"prompt": str, "test": str, "entry_point": str})

        def score(text, r=r):
            program = f"{r['prompt']}{text}\n\n{r['test']}\n\ncheck({r['entry_point']})\n"
            return scoring.run_tests(program)

        out.append(Prompt(r["task_id"], r["prompt"], CODE_CAP, score))
    return out


def _code_block(text: str) -> str:
    """The code of a completion: the prompt opens a ```python fence, so the code runs up
    to the closing fence; a completion that opens its own fence gives that block."""
    if text.lstrip().startswith("```"):
        body = text.lstrip()[3:]
        body = body.split("\n", 1)[1] if "\n" in body else ""
        return body.split("```", 1)[0]
    return text.split("```", 1)[0]


def mbpp(path) -> list[Prompt]:
    """MBPP jsonl: {"task_id", "text", "test_list", "test_setup_code"?}; the original base
    tests are shown in the prompt (visible test cases) and run for pass@1."""
    out = []
    for r in read_jsonl(path):
        _need(r, ["task_id", "test_list"], path,
              {"test_list": list, "text": str, "prompt": str, "test_setup_code": str})
        if not all(isinstance(t, str) for t in r["test_list"]):
            raise TaskError(f"{path}: MBPP record {r['task_id']}: test_list must hold strings")
        text = r.get("text") or r.get("prompt")
        if text is None:
            raise TaskError(f"{path}: MBPP record {r['task_id']} has neither 'text' nor 'prompt'")
        tests = "\n".join(r["test_list"])
        prompt = (f"You are an expert Python programmer, and here is your task: {text} "
                  f"Your code should pass these tests:\n\n{tests}\n```python\n")

        def score(completion, r=r, tests=tests):
            program = f"{r.get('test_setup_code', '')}\n{_code_block(completion)}\n\n{tests}\n"
            return scoring.run_tests(program)

        out.append(Prompt(f"mbpp/{r['task_id']}", prompt, CODE_CAP, score))
    return out


def writingbench(path) -> list[Prompt]:
    """WritingBench jsonl: {"index", "query", "lang"?}; English prompts, speed only."""
    out = []
    for r in read_jsonl(path):
        _need(r, ["query"], path, {"query": str})
        if r.get("lang", "en") != "en":
            continue
        out.append(Prompt(f"writingbench/{r.get('index', len(out))}", r["query"], WRITING_CAP))
    return out


def arithmetic(limit: int) -> list[Prompt]:
    """Held-out grade-school problems of the embedded model's corpus; exact answer."""
    from ..training import corpus
    from ..training.evaluate import MAX_NEW_ARITH

    out = []
    for i, p in enumerate(corpus.arithmetic_test(limit)):
        out.append(Prompt(f"arithmetic/{i}", p.prompt, MAX_NEW_ARITH,
                          lambda text, a=p.answer: corpus.parse_answer(text) == a))
    return out


def code(limit: int) -> list[Prompt]:
    from ..training import corpus

    return [Prompt(f"code/{i}", t, 64, stop_at_eos=False)
            for i, t in enumerate(corpus.code_prompts(limit))]


def prose(limit: int) -> list[Prompt]:
    from ..training import corpus

    return [Prompt(f"prose/{i}", t, 64, stop_at_eos=False)
            for i, t in enumerate(corpus.prose_prompts(limit))]


FILE_TASKS = {"gsm8k": gsm8k, "math500": math500, "humaneval": humaneval, "mbpp": mbpp,
              "writingbench": writingbench}
OFFLINE_TASKS = {"arithmetic": arithmetic, "code": code, "prose": prose}


def load(name: str, data: str | None, limit: int | None) -> list[Prompt]:
    """The first `limit` prompts (None: the offline tasks' 100, a file's all) of a task;
    never an empty list."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise TaskError(f"limit must be an integer >= 1 (or None), got {limit!r}")
    if name in OFFLINE_TASKS:
        prompts = OFFLINE_TASKS[name](limit or 100)
    elif name in FILE_TASKS:
        if data is None:
            raise TaskError(f"task {name!r} reads a local file: pass --data PATH "
                            "(its public jsonl format)")
        prompts = FILE_TASKS[name](data)[:limit]
    else:
        raise TaskError(f"unknown task {name!r}; expected one of "
                        f"{sorted(OFFLINE_TASKS) + sorted(FILE_TASKS)}")
    if not prompts:
        raise TaskError(f"task {name!r} has no prompts" + (f" in {data}" if data else "")
                        + (" (WritingBench: English records only)" if name == "writingbench" else ""))
    return prompts
