"""The docs run: every command and Python example a reader can copy from the project's
pages is run here, so the pages cannot drift from the code.

Pages: README.md, docs/*.md, benchmarks/results/*.md and packed_ss_jax/embedded/*/README.md.

What runs
---------
- In ```bash blocks, every command line that starts with `packed-ss ` or `python -m `
  (after any `NAME=value` environment settings, which are set for it). A command
  continues over lines that end with a backslash. Other lines (`pip install`, comments)
  are not run; ```text blocks (shown output) are never run.
- One ```bash block is one test case: its commands run in order in one scratch folder,
  so a command may use what an earlier command of its block wrote (a converted
  checkpoint, an adapter copy). The scratch folder links the repository's
  `packed_ss_jax/`, `tests/` and `convert/` and holds copies of `benchmarks/` (saved
  results included) and `tools/`: paths in the pages resolve as they do at the
  repository root, and what a command writes (`--json benchmarks/results/...`, `--out
  ...`) stays in the scratch folder.
- `packed-ss` runs as `python -m packed_ss_jax`, with this interpreter. A command fails
  the test when it exits with a non-zero status.
- `packed-ss serve` (the last command of its block) starts on a free port: `--host` and
  `--port` are dropped, `--port 0` is given and the address read back (tests/servers.py).
  The ```python blocks after it on its page, up to the next serve block, are its clients:
  they run in order, in one namespace, with `http://127.0.0.1:8000` replaced by the
  server's address; then the server is stopped.
- The other ```python blocks of a page run in order in one namespace (a later block may
  use names an earlier one defined), from a scratch folder as above: one test case per
  page.
- The quick loop (`-m "not slow"`) runs README.md's blocks and examples; the other
  pages', and the README's blocks marked `slow`, run in the whole suite
  (`test_slow_block`, `test_slow_python`: wholly slow in tests/slow.py); blocks marked
  `long` (the recipes of saved runs and trained models) run with `--long-checks`.

Markers
-------
A command's last line may end with a comment `# test: DIRECTIVES`; a ```python block's
first line may be one. Directives are separated by `;`:

    skip (why)       not run, because it needs what a test cannot have (a GPU, a
                     downloaded checkpoint, another host, hours, the test suite itself)
                     or another test runs it already. The reason is required. At most
                     MAX_SKIPPED commands and MAX_SKIPPED_PYTHON python blocks are skipped.
    long             the block reproduces a saved run or a trained model (at the small
                     limits its flags give): it runs with `--long-checks` only (CI's
                     step after the suite), not in the suite.
    slow             the block (for a python block: its page's examples) runs in the
                     whole suite only.
    --flag value     (commands) small limits: the command's `--flag` takes this value,
    --flag           or `--flag value` is appended where the command has no `--flag`; a
                     bare `--flag` is a switch, appended when missing.

    packed-ss bench --task arithmetic --limit 100 --json run.json  # test: slow; --limit 2

Checks of every page
--------------------
- No placeholders in copyable blocks (bash, sh, python): no ALL-CAPS word standing for a
  value (`BLOCKS`, `PATH`, `data=D`), no `<...>`, no `...`; `$NAME` and `NAME=value`
  environment settings are not placeholders, comments are not checked, and in Python only
  strings are.
- Every relative link (and image) points to an existing file, and a `#fragment` to a
  heading of the page it names.
- Every repository path in inline code (`benchmarks/gpu_timing.py`, `docs/...`) exists,
  and every `python -m benchmarks.x` / `tools.x` / `packed_ss_jax.x` / `convert.x` names
  a module that exists.

Run it: python -m pytest -q -n 0 tests/test_docs.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import servers

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "benchmarks" / "results").glob("*.md"),
                *(ROOT / "packed_ss_jax" / "embedded").glob("*/README.md")])
MAX_SKIPPED = 17   # the GPU, 8B, several-host and optional-extra commands
MAX_SKIPPED_PYTHON = 8
COMMAND_TIMEOUT = 900
SERVER_ADDRESS = "http://127.0.0.1:8000"
COMMAND = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)(packed-ss|python -m)\s")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------
# Reading the pages


@dataclasses.dataclass
class Block:
    page: Path
    line: int          # 1-based line of the opening fence
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{rel(self.page)}:{self.line}"


@dataclasses.dataclass
class Command:
    block: Block
    line: int
    text: str          # the command, continuation lines joined, without the comment
    directives: list[str]

    @property
    def skip(self) -> str | None:
        for d in self.directives:
            if d.startswith("skip"):
                return d
        return None

    @property
    def slow(self) -> bool:
        return "slow" in self.directives or self.long

    @property
    def long(self) -> bool:
        return "long" in self.directives

    @property
    def flags(self) -> list[str]:
        return [t for d in self.directives if d.startswith("--") for t in shlex.split(d)]


def blocks(page: Path) -> list[Block]:
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i + 1, m.group(1), []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        out.append(Block(page, start, lang, textwrap.dedent("\n".join(body))))
        i += 1
    return out


def split_comment(line: str) -> tuple[str, str | None]:
    """(the line without its trailing comment, the comment's text or None)."""
    for m in re.finditer(r"(^|\s)#", line):
        head = line[:m.start()]
        try:
            shlex.split(head)
        except ValueError:
            continue  # the '#' is inside quotes
        return head.rstrip(), line[m.end():].strip()
    return line.rstrip(), None


def parse_directives(comment: str | None) -> list[str]:
    if comment is None or not comment.startswith("test:"):
        return []
    return [d.strip() for d in comment[len("test:"):].split(";") if d.strip()]


def commands(block: Block) -> list[Command]:
    out, lines = [], block.text.splitlines()
    i = 0
    while i < len(lines):
        first, parts = i, []
        while True:
            code, comment = split_comment(lines[i])
            if code.endswith("\\"):
                parts.append(code[:-1])
                i += 1
                if i < len(lines):
                    continue
            else:
                parts.append(code)
            break
        i += 1
        text = " ".join(p.strip() for p in parts).strip()
        if COMMAND.match(text):
            out.append(Command(block, block.line + 1 + first, text, parse_directives(comment)))
    return out


def python_directives(block: Block) -> list[str]:
    first = block.text.lstrip().splitlines()[0] if block.text.strip() else ""
    return parse_directives(first[1:].strip()) if first.startswith("#") else []


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
BASH = [b for b in ALL_BLOCKS if b.lang == "bash" and commands(b)]
ALL_COMMANDS = [c for b in BASH for c in commands(b)]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]


def serve_commands(block: Block) -> list[Command]:
    return [c for c in commands(block) if not c.skip and argv_of(c)[3:4] == ["serve"]]


def is_client(block: Block) -> bool:
    """A python block after a `packed-ss serve` block on its page: a client of it."""
    return block.lang == "python" and any(
        b.page == block.page and b.line < block.line and serve_commands(b) for b in BASH)


def clients_after(block: Block) -> list[Block]:
    """The python blocks after `block` on its page, up to the next serve block."""
    out = []
    for b in ALL_BLOCKS:
        if b.page != block.page or b.line <= block.line:
            continue
        if b in BASH and serve_commands(b):
            break
        if b.lang == "python":
            out.append(b)
    return out


def block_is_slow(block: Block) -> bool:
    return any(c.slow for c in commands(block))


def python_pages(slow: bool) -> list[Path]:
    pages = sorted({b.page for b in PYTHON if not is_client(b)})
    return [p for p in pages
            if (p != ROOT / "README.md"
                or any("slow" in python_directives(b) for b in PYTHON if b.page == p)) == slow]


# ---------------------------------------------------------------------------------------
# Running


def argv_of(command: Command) -> list[str]:
    """The command as it runs here: its directives' limits applied, `packed-ss` as
    `python -m packed_ss_jax`, with this interpreter (environment settings left out)."""
    args = shlex.split(command.text)
    while args and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", args[0]):
        args.pop(0)
    flags = command.flags
    i = 0
    while i < len(flags):
        flag = flags[i]
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        i += 2 if value is not None else 1
        if flag in args:
            if value is not None:
                args[args.index(flag) + 1] = value
        else:
            args += [flag] + ([value] if value is not None else [])
    if args[0] == "packed-ss":
        return [sys.executable, "-m", "packed_ss_jax", *args[1:]]
    assert args[:2] == ["python", "-m"], command.text
    return [sys.executable, "-m", *args[2:]]


def env_of(command: Command, scratch: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(scratch))
    env.pop("PACKED_SS_API_KEY", None)
    for tok in shlex.split(command.text):
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", tok)
        if not m:
            break
        env[m.group(1)] = m.group(2)
    return env


def make_scratch(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in ("packed_ss_jax", "tests", "convert"):
        (path / name).symlink_to(ROOT / name, target_is_directory=True)
    for name in ("benchmarks", "tools"):
        shutil.copytree(ROOT / name, path / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return path


def run(command: Command, scratch: Path) -> None:
    argv = argv_of(command)
    try:
        p = subprocess.run(argv, cwd=scratch, env=env_of(command, scratch),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command.block.id}: still running after {COMMAND_TIMEOUT} s: "
                    f"{command.text}")
    if p.returncode != 0:
        pytest.fail(f"{rel(command.block.page)}:{command.line}: exit status {p.returncode}\n"
                    f"  {command.text}\n  ran as: {shlex.join(argv)}\n"
                    f"--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}")


@contextlib.contextmanager
def serving(command: Command, scratch: Path):
    args = argv_of(command)
    kept, i = [], 0
    while i < len(args):
        if args[i] in ("--host", "--port"):
            i += 2
            continue
        kept.append(args[i])
        i += 1
    proc = subprocess.Popen([*kept, "--port", "0"], cwd=scratch, env=env_of(command, scratch),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    server = servers.Server(proc)
    try:
        server.wait_ready(300)
        yield server
    finally:
        server.stop()


def exec_python(block: Block, namespace: dict, address: str | None = None) -> None:
    source = block.text if address is None else block.text.replace(SERVER_ADDRESS, address)
    try:
        exec(compile(source, f"{block.id}", "exec"), namespace)
    except Exception as e:  # noqa: BLE001 (any failure of an example is the test's)
        raise AssertionError(f"the python block at {block.id} failed: {e!r}") from e


def run_block(block: Block, scratch: Path, long: bool = True) -> None:
    """The block's commands in `scratch` (without `long`: not those marked long)."""
    for command in commands(block):
        if command.skip or (command.long and not long):
            continue
        if argv_of(command)[3:4] == ["serve"]:
            clients = clients_after(block)
            assert clients, f"{block.id}: a serve command with no client block after it"
            namespace = {"__name__": "__docs__"}
            with serving(command, scratch) as server:
                for client in clients:
                    if not any(d.startswith("skip") for d in python_directives(client)):
                        exec_python(client, namespace, server.base)
        else:
            run(command, scratch)


# ---------------------------------------------------------------------------------------
# The tests


def _ids(items):
    return [b.id for b in items]


README = ROOT / "README.md"
# The quick loop runs the README's blocks; the other pages' blocks, and the README's
# blocks marked slow, run in the whole suite.
QUICK = [b for b in BASH if b.page == README and not block_is_slow(b)]
SLOW = [b for b in BASH if b not in QUICK]


@pytest.mark.parametrize("block", QUICK, ids=_ids(QUICK))
def test_block(block, tmp_path):
    run_block(block, make_scratch(tmp_path / "scratch"))


def _long_marked(items) -> list:
    """`items` as test parameters, a block with a `long` command marked `long_check`
    (deselected unless --long-checks is given: tests/conftest.py)."""
    return [pytest.param(b, id=b.id, marks=pytest.mark.long_check
                         if any(c.long for c in commands(b)) else ()) for b in items]


@pytest.mark.parametrize("block", _long_marked(SLOW))
def test_slow_block(block, tmp_path):
    run_block(block, make_scratch(tmp_path / "scratch"))


def _run_python_page(page: Path, tmp_path: Path, monkeypatch) -> None:
    scratch = make_scratch(tmp_path / "scratch")
    monkeypatch.chdir(scratch)
    namespace = {"__name__": "__docs__"}
    for block in PYTHON:
        if block.page != page or is_client(block):
            continue
        if any(d.startswith("skip") for d in python_directives(block)):
            continue
        exec_python(block, namespace)


QUICK_PY, SLOW_PY = python_pages(False), python_pages(True)


@pytest.mark.parametrize("page", QUICK_PY, ids=[rel(p) for p in QUICK_PY])
def test_python(page, tmp_path, monkeypatch):
    _run_python_page(page, tmp_path, monkeypatch)


@pytest.mark.parametrize("page", SLOW_PY, ids=[rel(p) for p in SLOW_PY])
def test_slow_python(page, tmp_path, monkeypatch):
    _run_python_page(page, tmp_path, monkeypatch)


WALKED = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.long_check
def test_the_pages_followed_in_one_clone_leave_its_quick_loop_green(tmp_path, monkeypatch):
    """A reader who follows README.md and then every docs page top to bottom in one clone
    (each command at its small limits, each example in its page's namespace, the recipes
    of saved runs left out: they rewrite benchmarks/results) leaves nothing there that
    git would see (whatever the pages write goes to ignored folders, `out/`), and the
    quick loop then passes in that clone."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    clone = tmp_path / "clone"
    subprocess.run([git, "clone", "--quiet", str(ROOT), str(clone)], check=True)
    monkeypatch.chdir(clone)
    for page in WALKED:
        namespace = {"__name__": "__docs__"}
        for block in blocks(page):
            if block.lang == "bash" and commands(block):
                run_block(block, clone, long=False)
            elif block.lang == "python" and not is_client(block) and not any(
                    d.startswith("skip") for d in python_directives(block)):
                exec_python(block, namespace)
    status = subprocess.run([git, "status", "--porcelain", "--untracked-files=all"],
                            cwd=clone, capture_output=True, text=True, check=True).stdout
    assert status == "", f"following the pages left files git sees:\n{status}"
    quick = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow",
                            "-p", "no:cacheprovider"], cwd=clone, capture_output=True,
                           text=True)
    assert quick.returncode == 0, quick.stdout[-4000:] + quick.stderr[-4000:]


def test_markers_are_well_formed():
    bad = []
    for c in ALL_COMMANDS:
        for d in c.directives:
            if d.startswith("skip"):
                if not re.fullmatch(r"skip \(.+\)", d):
                    bad.append(f"{rel(c.block.page)}:{c.line}: a skip needs its reason: {d!r}")
            elif d not in ("slow", "long") and not d.startswith("--"):
                bad.append(f"{rel(c.block.page)}:{c.line}: unknown directive {d!r}")
        if c.skip and (c.slow or c.flags):
            bad.append(f"{rel(c.block.page)}:{c.line}: a skipped command with other directives")
    for b in PYTHON:
        for d in python_directives(b):
            if not (re.fullmatch(r"skip \(.+\)", d) or d == "slow"):
                bad.append(f"{b.id}: python blocks take `skip (why)` or `slow`: {d!r}")
    for b in BASH:
        served = serve_commands(b)
        if served and (len(served) > 1 or commands(b)[-1].line != served[-1].line):
            bad.append(f"{b.id}: a serve command must be its block's last, and alone")
    assert not bad, "\n".join(bad)


def test_skipped_commands_stay_few():
    skipped = [f"{rel(c.block.page)}:{c.line}: {c.skip}" for c in ALL_COMMANDS if c.skip]
    skipped_py = [b.id for b in PYTHON
                  if any(d.startswith("skip") for d in python_directives(b))]
    assert len(ALL_COMMANDS) - len(skipped) >= 20, "the pages show fewer runnable commands"
    assert len(skipped) <= MAX_SKIPPED, "\n".join(skipped)
    assert len(skipped_py) <= MAX_SKIPPED_PYTHON, "\n".join(skipped_py)


# Placeholders: a word (between '=', ',', ':' and '/') that is ALL CAPS, `<...>`, `...`.
CAPS = re.compile(r"^[A-Z][A-Z0-9_]*$")
ENV_SETTING = re.compile(r"^\s*(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")
ANGLE = re.compile(r"<[A-Za-z_][^<>]*>")
STRING = re.compile(r"\"[^\"]*\"|'[^']*'")


def _fill_ins(token: str, single_letters: bool) -> list[str]:
    found = [w for w in re.split(r"[=,:/]", token)
             if CAPS.match(w) and (single_letters or len(w) > 1)]
    found += ANGLE.findall(token)
    if "..." in token:
        found.append("...")
    return found


def placeholders(block: Block) -> list[str]:
    found = []
    for n, line in enumerate(block.text.splitlines(), block.line + 1):
        if block.lang in ("bash", "sh", "shell"):
            code, _ = split_comment(line)
            code = ENV_SETTING.sub("", code).rstrip("\\")
            code = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "", code)
            try:
                tokens = shlex.split(code)
            except ValueError:  # a quote that a continuation line closes
                tokens = code.split()
            words = [w for t in tokens for w in _fill_ins(t, single_letters=True)]
        else:  # python: only what stands in strings is a value to fill in
            words = [w for s in STRING.findall(line) for w in _fill_ins(s[1:-1], False)]
        found += [f"{rel(block.page)}:{n}: {w!r} in {line.strip()!r}" for w in words]
    return found


def test_no_placeholders_in_copyable_blocks():
    found = [f for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell", "python")
             for f in placeholders(b)]
    assert not found, "\n".join(found)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if re.match(r"^\s*```", line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.add(slug(m.group(1)))
    return out


def prose(page: Path) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"(?ms)^\s*```.*?^\s*```\s*$", "", page.read_text())


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto:
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{rel(page)}: {target} (no {dest})")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                bad.append(f"{rel(page)}: {target} (no heading #{fragment} in {dest.name})")
    assert not bad, "\n".join(bad)


CODE_PATH = re.compile(r"`((?:packed_ss_jax|benchmarks|tools|tests|convert|docs|\.ci)/[^`\s*<>]*)`")
MODULE = re.compile(r"python -m ((?:packed_ss_jax|benchmarks|tools|convert)(?:\.\w+)*)")


def module_exists(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() \
        or (path / "__main__.py").is_file()


def test_paths_and_modules_named_in_the_pages_exist():
    bad = []
    for page in PAGES:
        text = page.read_text()
        for p in CODE_PATH.findall(prose(page)):
            if not (ROOT / p.split(":")[0]).exists():
                bad.append(f"{rel(page)}: `{p}` does not exist")
        for m in MODULE.findall(text):
            if not module_exists(m):
                bad.append(f"{rel(page)}: python -m {m}: no such module")
    assert not bad, "\n".join(bad)


def _repository_paths() -> set[str] | None:
    """Every path of the repository (tracked, or new and not ignored) and every folder
    above one, as git sees them; None outside a git checkout."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run([git, "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    paths = set()
    for line in out.stdout.splitlines():
        parts = Path(line).parts
        paths.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return paths


def test_readme_layout_names_every_module():
    """The README's Layout block names every top-level entry of the repository and of
    packed_ss_jax/ (a module as `name.py`, a folder as `name/`): what git tracks or would
    track, not what the docs' commands write into ignored folders (`out/`)."""
    text = README.read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    named = set(re.findall(r"[\w.-]+/?", layout))
    skip = {"__pycache__", "packed_ss_jax.egg-info", "README.md", "LICENSE", "out", "build",
            "dist"}   # without git: the ignored folders the docs and packaging write
    paths = _repository_paths()

    def entries(folder: Path) -> list[str]:
        return [p.name + ("/" if p.is_dir() else "") for p in sorted(folder.iterdir())
                if not p.name.startswith(".")
                and (p.is_dir() or p.suffix in (".py", ".toml"))
                and (p.name not in skip if paths is None
                     else p.relative_to(ROOT).as_posix() in paths)]

    missing = [f"packed_ss_jax/{e}" for e in entries(ROOT / "packed_ss_jax") if e not in named]
    missing += [e for e in entries(ROOT) if e not in named]
    assert not missing, f"the README's Layout does not name: {missing}"


def test_module_to_test_map_names_every_module():
    """docs/testing.md's module-to-test map has a row for every module of packed_ss_jax/
    (a folder's `__init__.py` aside), and every test file it names exists."""
    text = (ROOT / "docs" / "testing.md").read_text()
    table = text[text.index("## Module-to-test map"):]
    rows = dict(re.findall(r"^\| `(packed_ss_jax/[\w/]+\.py)` \| (.*) \|$", table, re.M))
    package = ROOT / "packed_ss_jax"
    modules = [p.relative_to(ROOT).as_posix() for p in sorted(package.rglob("*.py"))
               if not (p.name == "__init__.py" and p.parent != package)]
    missing = [m for m in modules if m not in rows]
    assert not missing, f"docs/testing.md's module-to-test map has no row for: {missing}"
    named = {t for tests in rows.values() for t in re.findall(r"`(test_\w+\.py)`", tests)}
    gone = sorted(t for t in named if not (ROOT / "tests" / t).exists())
    assert not gone, f"docs/testing.md's module-to-test map names missing tests: {gone}"
