"""The training corpus: built offline from the generator below and the interpreter itself.

Three sources, each split into disjoint train and test parts: generated arithmetic word
problems with worked solutions (`plus` / `minus` work sums in columns, ones first), split
by a hash of the question text, with the practice (`drills`) and copying (`recall`)
sheets training also reads; Python source of the standard library, split by file; and
English prose bundled with the interpreter (standard-library docstrings, read with `ast`,
and the `pydoc_data` help topics), split by file or topic. Everything is a pure function
of (seed, interpreter), so the corpus is reproducible. What each source holds and the
training mix: packed_ss_jax/embedded/nld-tiny/README.md.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import random
import re
import sysconfig
from pathlib import Path
from typing import Iterator

TEST_PERCENT = 10  # hash bucket share of the test split
PROMPT_SUFFIX = "\nAnswer:"
ANSWER_RE = re.compile(r"####\s*(-?\d+)")


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % 100


def split_of(key: str) -> str:
    """'test' for a TEST_PERCENT share of keys, chosen by hash; 'train' otherwise."""
    return "test" if _bucket(key) < TEST_PERCENT else "train"


# ---------------------------------------------------------------------------------------
# Arithmetic word problems

NAMES = ["Ava", "Ben", "Carla", "Dev", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack",
         "Kira", "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara",
         "Uma", "Victor", "Wendy", "Yusuf", "Zoe", "Omar", "Lena", "Marco", "Nina", "Theo"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells",
         "cards", "balloons", "eggs", "oranges", "coins", "flowers", "toy cars", "candles",
         "buttons", "crayons", "beads", "muffins"]
CONTAINERS = ["boxes", "bags", "packs", "jars", "baskets", "crates", "trays", "cartons"]
PLACES = ["the market", "the school fair", "the bakery", "the library sale", "the corner shop"]


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str
    solution: str   # step-by-step lines, the last one "#### N"
    answer: int

    @property
    def prompt(self) -> str:
        return f"Question: {self.question}{PROMPT_SUFFIX}"

    @property
    def text(self) -> str:
        return f"{self.prompt} {self.solution}"


def plus(a: int, b: int) -> str:
    """`a + b (working) = c`, the working in columns, ones first: `(8+9=17,2+0+1=3)` for
    28 + 9 is the ones sum, then the tens with the carry. Every step is a one-digit fact
    a small model can memorise (as it does the times table), where `28 + 9 = 37` in one
    step asks it to find the carry before writing the first digit."""
    ones = a % 10 + b % 10
    carry = ones // 10
    return (f"{a} + {b} ({a % 10}+{b % 10}={ones},"
            f"{a // 10}+{b // 10}+{carry}={a // 10 + b // 10 + carry}) = {a + b}")


def minus(a: int, b: int) -> str:
    """`a - b (working) = c` for a >= b >= 0, in columns: `(15-7=8,4-1-1=2)` for 45 - 17
    (the ones borrow ten when they must; the tens pay it back)."""
    borrow = int(a % 10 < b % 10)
    top = a % 10 + 10 * borrow
    return (f"{a} - {b} ({top}-{b % 10}={top - b % 10},"
            f"{a // 10}-{b // 10}-{borrow}={a // 10 - b // 10 - borrow}) = {a - b}")


def _add(r, name, item):
    a, b = r.randint(2, 30), r.randint(2, 20)
    q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
    s = f"{name} has {plus(a, b)} {item} now.\n#### {a + b}"
    return q, s, a + b


def _sub(r, name, item):
    a = r.randint(10, 50)
    b = r.randint(1, a - 1)
    q = f"{name} has {a} {item}. {name} gives away {b} {item}. How many {item} are left?"
    s = f"{name} has {minus(a, b)} {item} left.\n#### {a - b}"
    return q, s, a - b


def _mul(r, name, item):
    a, b = r.randint(2, 10), r.randint(2, 10)
    box = r.choice(CONTAINERS)
    q = f"{name} buys {a} {box} of {item}. Each of the {box} holds {b} {item}. How many {item} does {name} buy?"
    s = f"{name} buys {a} * {b} = {a * b} {item}.\n#### {a * b}"
    return q, s, a * b


def _div(r, name, item):
    a, b = r.randint(2, 9), r.randint(2, 9)
    q = (f"{name} shares {a * b} {item} equally among {b} friends. "
         f"How many {item} does each friend get?")
    s = f"Each friend gets {a * b} / {b} = {a} {item}.\n#### {a}"
    return q, s, a


def _packs_plus(r, name, item):
    a, b, c = r.randint(2, 20), r.randint(2, 6), r.randint(2, 6)
    box = r.choice(CONTAINERS)
    q = (f"{name} has {a} {item}. Then {name} buys {b} {box} with {c} {item} in each. "
         f"How many {item} does {name} have in total?")
    s = (f"The {box} hold {b} * {c} = {b * c} {item}.\n"
         f"{name} has {plus(a, b * c)} {item} in total.\n#### {a + b * c}")
    return q, s, a + b * c


def _earn_spend(r, name, item):
    a, b = r.randint(2, 9), r.randint(2, 6)
    c = r.randint(1, a * b - 1)
    q = (f"{name} earns {a} dollars a day for {b} days and then spends {c} dollars at "
         f"{r.choice(PLACES)}. How many dollars does {name} have left?")
    s = (f"{name} earns {a} * {b} = {a * b} dollars.\n"
         f"{name} has {minus(a * b, c)} dollars left.\n#### {a * b - c}")
    return q, s, a * b - c


def _two_friends(r, name, item):
    other = r.choice([n for n in NAMES if n != name])
    a, b = r.randint(2, 20), r.randint(2, 15)
    q = (f"{name} has {a} {item}. {other} has {b} more {item} than {name}. "
         f"How many {item} do they have together?")
    s = (f"{other} has {plus(a, b)} {item}.\n"
         f"Together they have {plus(a, a + b)} {item}.\n#### {2 * a + b}")
    return q, s, 2 * a + b


def _buy_eat(r, name, item):
    a, b = r.randint(5, 30), r.randint(2, 20)
    c = r.randint(1, a + b - 1)
    q = (f"{name} has {a} {item}, buys {b} more at {r.choice(PLACES)} and then uses {c} of them. "
         f"How many {item} does {name} have left?")
    s = (f"After buying, {name} has {plus(a, b)} {item}.\n"
         f"After using some, {name} has {minus(a + b, c)} {item} left.\n#### {a + b - c}")
    return q, s, a + b - c


def _price(r, name, item):
    a, b = r.randint(2, 9), r.randint(2, 6)
    c = r.randint(a * b, a * b + 20)
    q = (f"Each of the {item} costs {a} dollars. {name} buys {b} of them and pays with "
         f"{c} dollars. How much change does {name} get?")
    s = (f"The {item} cost {a} * {b} = {a * b} dollars.\n"
         f"The change is {minus(c, a * b)} dollars.\n#### {c - a * b}")
    return q, s, c - a * b


TEMPLATES = [_add, _sub, _mul, _div, _packs_plus, _earn_spend, _two_friends, _buy_eat, _price]


def make_problem(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    q, s, ans = r.choice(TEMPLATES)(r, name, item)
    return Problem(q, s, ans)


def arithmetic(split: str, seed: int = 0) -> Iterator[Problem]:
    """An endless, seeded stream of problems of one split."""
    r = random.Random(f"arith-{split}-{seed}")
    while True:
        p = make_problem(r)
        if split_of(p.question) == split:
            yield p


def arithmetic_test(n: int = 200, seed: int = 0) -> list[Problem]:
    """`n` distinct held-out problems (questions never in the train split)."""
    seen, out = set(), []
    for p in arithmetic("test", seed):
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
        if len(out) == n:
            return out
    return out


def _drill_line(r: random.Random) -> str:
    """One equation of the kinds the solutions use, with operands in their ranges."""
    op = r.random()
    if op < 0.35:
        a, b = r.randint(0, 60), r.randint(0, 40)
        return plus(a, b)
    if op < 0.65:
        a = r.randint(1, 80)
        b = r.randint(0, a)
        return minus(a, b)
    if op < 0.9:
        a, b = r.randint(1, 10), r.randint(1, 10)
        return f"{a} * {b} = {a * b}"
    a, b = r.randint(1, 10), r.randint(1, 9)
    return f"{a * b} / {b} = {a}"


def drills(seed: int = 0) -> Iterator[str]:
    """An endless, seeded stream of practice sheets: the arithmetic facts the solutions
    need, densely (12 equations a sheet). Train split only; no word problem in it."""
    r = random.Random(f"drill-{seed}")
    while True:
        yield "Arithmetic practice:\n" + "\n".join(_drill_line(r) for _ in range(12))


def _recall_pair(r: random.Random) -> str:
    # Each word: a name, an item, a container or a number (numbers twice as likely).
    # (Candidates of every kind are drawn for every word: the shipped model's stream.)
    words = [r.choice((r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS),
                       str(r.randint(0, 99)), str(r.randint(0, 99))))
             for _ in range(r.randint(3, 10))]
    line = " ".join(words)
    return f"List: {line}\nAgain: {line}"


def recall(seed: int = 0) -> Iterator[str]:
    """An endless, seeded stream of copying sheets (4 lists, each repeated once).

    A solution restates the question's names, items and numbers, so a model must look
    them up in its context (an induction head). Random lists make that look-up the only
    way to predict the repeat, which teaches it in far fewer steps than the problems
    alone, where the template text dominates the loss. Train split only.
    """
    r = random.Random(f"recall-{seed}")
    while True:
        yield "\n".join(_recall_pair(r) for _ in range(4))


def parse_answer(text: str) -> int | None:
    m = ANSWER_RE.search(text)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------
# Standard library source and bundled documentation

def stdlib_files() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in lib.glob("*.py") if p.is_file())


def _read(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def code(split: str, max_chars: int = 20000) -> list[str]:
    """Standard-library modules of one split (by file name), cut into chunks."""
    out = []
    for p in stdlib_files():
        if split_of("code:" + p.name) != split:
            continue
        src = _read(p)
        if src:
            out += [src[i:i + max_chars] for i in range(0, len(src), max_chars)]
    return out


def _docstrings(src: str) -> list[str]:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:
                out.append(doc)
    return out


def prose(split: str) -> list[str]:
    """Docstrings of the standard library and pydoc help topics of one split."""
    return list(_prose(split))


@functools.lru_cache(maxsize=None)
def _prose(split: str) -> tuple[str, ...]:
    # Parsing every standard-library module takes seconds; training reads the split twice
    # (the tokenizer, then the streams).
    out = []
    for p in stdlib_files():
        if split_of("prose:" + p.name) == split:
            src = _read(p)
            if src:
                out += _docstrings(src)
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions leave pydoc_data out
        topics = {}
    for name in sorted(topics):
        if split_of("topic:" + name) == split:
            out.append(topics[name].strip())
    return tuple(out)


def code_prompts(n: int = 10, length: int = 160) -> list[str]:
    """Openings of held-out standard-library functions."""
    out = []
    for p in stdlib_files():
        if split_of("code:" + p.name) != "test":
            continue
        src = _read(p) or ""
        for m in re.finditer(r"\ndef \w+\(.*\):\n", src):
            out.append(src[m.start() + 1: m.end() + length].rsplit("\n", 1)[0] + "\n")
            break
        if len(out) == n:
            break
    return out


def prose_prompts(n: int = 10, length: int = 120) -> list[str]:
    """Openings of held-out docstrings / help topics."""
    docs = prose("test")
    out = []
    for d in docs:
        cut = d[:length].rsplit(" ", 1)[0]
        if len(cut) > 40:
            out.append(cut)
        if len(out) == n:
            break
    return out
