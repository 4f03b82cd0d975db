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


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    if not rows:
        raise ValueError(f"{path} holds no records")
    return rows


def _need(row: dict, keys, path) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"{path}: record lacks {missing} (fields: {sorted(row)})")


def gsm8k(path) -> list[Prompt]:
    """GSM8K test.jsonl: {"question", "answer": "... #### 72"}; numeric answer match."""
    out = []
    for i, r in enumerate(read_jsonl(path)):
        _need(r, ["question", "answer"], path)
        ref = r["answer"].split("####")[-1]
        out.append(Prompt(f"gsm8k/{i}", r["question"] + BOXED, MATH_CAP,
                          lambda text, ref=ref: scoring.numeric_match(text, ref)))
    return out


def math500(path) -> list[Prompt]:
    """MATH-500 test.jsonl: {"problem", "answer", "unique_id"}; boxed-answer exact match."""
    out = []
    for i, r in enumerate(read_jsonl(path)):
        _need(r, ["problem", "answer"], path)
        out.append(Prompt(r.get("unique_id", f"math500/{i}"), r["problem"] + BOXED, MATH_CAP,
                          lambda text, ref=r["answer"]: scoring.boxed_match(text, ref)))
    return out


def humaneval(path) -> list[Prompt]:
    """HumanEval.jsonl(.gz): {"task_id", "prompt", "test", "entry_point"}; function completion,
    pass@1 by running `prompt + completion + test + check(entry_point)`."""
    out = []
    for r in read_jsonl(path):
        _need(r, ["task_id", "prompt", "test", "entry_point"], path)

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
        _need(r, ["task_id", "test_list"], path)
        text = r.get("text") or r.get("prompt")
        if text is None:
            raise ValueError(f"{path}: MBPP record {r['task_id']} has neither 'text' nor 'prompt'")
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
        _need(r, ["query"], path)
        if r.get("lang", "en") != "en":
            continue
        out.append(Prompt(f"writingbench/{r.get('index', len(out))}", r["query"], WRITING_CAP))
    return out


def arithmetic(limit: int) -> list[Prompt]:
    """Held-out grade-school problems of the embedded model's corpus; exact answer."""
    from packed_ss_jax.training import corpus
    from packed_ss_jax.training.evaluate import MAX_NEW_ARITH

    out = []
    for i, p in enumerate(corpus.arithmetic_test(limit)):
        out.append(Prompt(f"arithmetic/{i}", p.prompt, MAX_NEW_ARITH,
                          lambda text, a=p.answer: corpus.parse_answer(text) == a))
    return out


def code(limit: int) -> list[Prompt]:
    from packed_ss_jax.training import corpus

    return [Prompt(f"code/{i}", t, 64, stop_at_eos=False)
            for i, t in enumerate(corpus.code_prompts(limit))]


def prose(limit: int) -> list[Prompt]:
    from packed_ss_jax.training import corpus

    return [Prompt(f"prose/{i}", t, 64, stop_at_eos=False)
            for i, t in enumerate(corpus.prose_prompts(limit))]


FILE_TASKS = {"gsm8k": gsm8k, "math500": math500, "humaneval": humaneval, "mbpp": mbpp,
              "writingbench": writingbench}
OFFLINE_TASKS = {"arithmetic": arithmetic, "code": code, "prose": prose}


def load(name: str, data: str | None, limit: int | None) -> list[Prompt]:
    if name in OFFLINE_TASKS:
        return OFFLINE_TASKS[name](limit or 100)
    if name in FILE_TASKS:
        if data is None:
            raise ValueError(f"task {name!r} reads a local file: pass --data PATH "
                             "(its public jsonl format)")
        prompts = FILE_TASKS[name](data)
        return prompts[:limit] if limit else prompts
    raise ValueError(f"unknown task {name!r}; expected one of "
                     f"{sorted(OFFLINE_TASKS) + sorted(FILE_TASKS)}")
