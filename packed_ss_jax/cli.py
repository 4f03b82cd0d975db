"""Command-line entry points.

Every command runs through `run_command`: an expected failure (a bad command line, a
missing or malformed file, a config or checkpoint the package cannot use, a request it
cannot decode, an OS error on a path) is one line on stderr, `<prog>: error: ...`, and
exit status 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable


class UsageError(Exception):
    """A command line that cannot be run."""


class Parser(argparse.ArgumentParser):
    """argparse whose complaints raise `UsageError` (one line, status 2, from
    `run_command`) instead of printing the usage and exiting."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _expected() -> tuple[type[BaseException], ...]:
    from .checkpoints.errors import CheckpointError
    from .config import ConfigError
    from .checkpoints.store import DestinationError
    from .requests import InputError

    return UsageError, InputError, ConfigError, CheckpointError, DestinationError, OSError


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    # Multi-line messages (e.g. a list of mismatched tensors) are joined onto one line.
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def run_command(prog: str, body: Callable[[list[str] | None, str], int],
                argv: list[str] | None) -> int:
    """Runs `body(argv, prog)`; expected failures become one line on stderr and status 2."""
    try:
        return body(argv, prog)
    except _expected() as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # SIGTERM during a conversion arrives as `Interrupted`, which knows its signal.
        print(f"{prog}: {e or 'interrupted'}", file=sys.stderr)
        return getattr(e, "exit_status", 130)


# --- argument types: a bad value is refused while parsing, before any work ----------------------

def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def token_ids(text: str) -> list[int]:
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("no token ids given")
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be integers (e.g. '1,17,42'), got {text!r}") from None


# --- commands -------------------------------------------------------------------------------------

def _convert(argv: list[str] | None, prog: str) -> int:
    p = Parser(
        prog=prog,
        description="Convert a Hugging Face Nemotron-Labs-Diffusion checkpoint directory "
                    "(config.json + safetensors, optional linear_spec_lora/) to orbax params.")
    p.add_argument("src", help="Hugging Face checkpoint directory")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="stored param dtype (default bfloat16; float32 for CPU parity work)")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--lora", dest="lora", action="store_true", default=None,
                      help="require and include the draft-only linear_spec_lora adapter")
    lora.add_argument("--no-lora", dest="lora", action="store_false",
                      help="leave the adapter out even when present")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier conversion output or an empty directory (nothing else)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    args = p.parse_args(argv)

    from .conversion import convert

    convert(args.src, args.dst, dtype=args.dtype, lora=args.lora, overwrite=args.overwrite,
            progress=not args.quiet)
    return 0


def convert_main(argv: list[str] | None = None, prog: str = "packed-ss-convert") -> int:
    return run_command(prog, _convert, argv)


def _table(results) -> str:
    head = "| schedule | tokens | NFE | tokens/NFE | wall (ms) | tokens/s |"
    rows = [head, "|" + "---|" * 6]
    for r in results:
        name = r.schedule if r.schedule == "ar" else f"{r.schedule} (B={r.block_size})"
        rows.append(f"| {name} | {len(r.tokens)} | {r.nfe} | {r.tokens_per_nfe:.2f} | "
                    f"{1e3 * r.wall_s:.1f} | {r.tokens_per_s:.1f} |")
    return "\n".join(rows)


def _generate(argv: list[str] | None, prog: str) -> int:
    from .schedules import SCHEDULES

    p = Parser(
        prog=prog,
        description="Decoding with Packed-SS (default), one other schedule or all four; greedy "
                    "unless --temperature > 0. Without --model it runs the small model shipped "
                    "with the package.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (needs a tokenizer)")
    p.add_argument("--ids", type=token_ids,
                   help="prompt as token ids, e.g. '1,17,42' (instead of text)")
    p.add_argument("--model", default=None,
                   help="Hugging Face or converted checkpoint directory (default: the embedded "
                        "model)")
    p.add_argument("--schedule", default="packed", choices=sorted(SCHEDULES) + ["all"],
                   help="decoding schedule (default packed); 'all' compares ar, linear, "
                        "quadratic and packed on the same prompt")
    p.add_argument("--block-size", type=int_at_least(2), default=None,
                   help="B (default: the config's)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    p.add_argument("--no-eos", action="store_true", help="ignore EOS (stop at the length limit)")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0 (default) is greedy; > 0 samples exactly from the AR distribution")
    p.add_argument("--top-k", type=int_at_least(1), default=None)
    p.add_argument("--top-p", type=probability, default=None)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the checksum check of a converted --model (faster load)")
    args = p.parse_args(argv)
    if args.prompt is None and args.ids is None:
        p.error("give a prompt (text) or --ids")
    if args.prompt is not None and args.ids is not None:
        p.error("give a prompt (text) or --ids, not both")
    if args.prompt is not None and not args.prompt.strip():
        p.error("the prompt is empty: give some text, e.g. packed-ss generate \"Question: ...\"")
    if args.model is not None and not Path(args.model).exists():
        raise FileNotFoundError(f"--model {args.model}: no such directory")

    from . import api, loading

    model = loading.load(args.model, dtype=args.dtype, verify=not args.no_verify)
    prompt = args.ids if args.ids is not None else args.prompt
    schedules = ["ar", "linear", "quadratic", "packed"] if args.schedule == "all" else [args.schedule]
    results = [api.decode(model, prompt, schedule=s, block_size=args.block_size,
                          max_new_tokens=args.max_new_tokens,
                          eos_id=None if args.no_eos else -1, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed)
               for s in schedules]
    first = results[0]
    print(first.text if first.text is not None else " ".join(map(str, first.tokens)))
    if args.temperature == 0 and any(r.tokens != first.tokens for r in results):
        print("warning: schedules disagree (numerical near-tie?)", file=sys.stderr)
    print()
    print(_table(results))
    print(f"\n(compile time excluded from wall: {sum(r.compile_s for r in results):.1f}s)")
    return 0


def generate_main(argv: list[str] | None = None, prog: str = "packed-ss generate") -> int:
    return run_command(prog, _generate, argv)


def bench_main(argv: list[str] | None = None, prog: str = "packed-ss bench") -> int:
    from benchmarks.bench import main as bench

    return bench(argv, prog=prog)


COMMANDS = {"generate": generate_main, "convert": convert_main, "bench": bench_main}
USAGE = ("usage: packed-ss {generate,convert,bench} ...\n\n"
         "  generate   decode a prompt with AR / Linear-SS / Quadratic-SS / Packed-SS\n"
         "  convert    convert a Hugging Face checkpoint to orbax params\n"
         "  bench      measure schedules on a task (tokens/NFE, throughput, CIs)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"packed-ss: error: unknown command {argv[0]!r}; expected one of "
              f"{', '.join(COMMANDS)} (see packed-ss --help)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:], prog=f"packed-ss {argv[0]}")
