"""Task scorers: numeric answer match, boxed-answer exact match, pass@1 by running tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(s: str) -> float | None:
    s = s.replace(",", "").replace("$", "").strip()
    try:
        return float(s)
    except ValueError:
        return None


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} (nested braces allowed)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None


def numeric_answer(text: str) -> float | None:
    """The model's final number: a `#### N` line, else a boxed number, else the last number."""
    m = re.search(r"####\s*(-?[\d,]+(?:\.\d+)?)", text)
    if m:
        return _number(m.group(1))
    boxed = last_boxed(text)
    if boxed is not None and _number(boxed) is not None:
        return _number(boxed)
    numbers = _NUMBER.findall(text)
    return _number(numbers[-1]) if numbers else None


def numeric_match(text: str, reference: str | float) -> bool:
    """GSM8K scoring: the final number equals the reference answer."""
    got = numeric_answer(text)
    want = reference if isinstance(reference, (int, float)) else numeric_answer(str(reference))
    return got is not None and want is not None and abs(got - float(want)) < 1e-6


def normalize_math(s: str) -> str:
    s = s.strip().replace(" ", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = s.rstrip(".").replace("^\\circ", "").replace("^{\\circ}", "").replace("\\$", "")
    if s.startswith("(") is False and s.endswith(".0"):
        s = s[:-2]
    return s


def boxed_match(text: str, reference: str) -> bool:
    """MATH-500 scoring: exact match of the normalised last boxed answer."""
    got = last_boxed(text)
    return got is not None and normalize_math(got) == normalize_math(reference)


def run_tests(program: str, timeout_s: float = 10.0) -> bool:
    """pass@1: the program (solution + tests) exits 0 within the timeout, in a subprocess."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prog.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            r = subprocess.run([sys.executable, path], cwd=d, capture_output=True,
                               timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
        return r.returncode == 0
