"""Command-line entry points."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def convert_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="packed-ss-convert",
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

    from .checkpoints.errors import CheckpointError
    from .config import ConfigError
    from .conversion import DestinationError, Interrupted, convert

    try:
        convert(args.src, args.dst, dtype=args.dtype, lora=args.lora, overwrite=args.overwrite,
                progress=not args.quiet)
    except (CheckpointError, ConfigError, DestinationError, FileNotFoundError, FileExistsError,
            NotADirectoryError, PermissionError) as e:
        print(f"packed-ss-convert: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"\npacked-ss-convert: {e}", file=sys.stderr)
        return e.exit_status
    return 0


def _one_line(e: BaseException) -> str:
    """A multi-line message (a list of tensors) as one line for the terminal."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return lines[0] + "".join(f"{'; ' if i else ' '}{line}" for i, line in enumerate(lines[1:]))


def _prompt_arg(args, model):
    if args.ids is not None:
        try:
            return [int(t) for t in args.ids.replace(",", " ").split()]
        except ValueError:
            raise SystemExit(f"packed-ss: error: --ids must be integers, got {args.ids!r}")
    return args.prompt


def _table(results) -> str:
    head = "| schedule | tokens | NFE | tokens/NFE | wall (ms) | tokens/s |"
    rows = [head, "|" + "---|" * 6]
    for r in results:
        name = r.schedule if r.schedule == "ar" else f"{r.schedule} (B={r.block_size})"
        rows.append(f"| {name} | {len(r.tokens)} | {r.nfe} | {r.tokens_per_nfe:.2f} | "
                    f"{1e3 * r.wall_s:.1f} | {r.tokens_per_s:.1f} |")
    return "\n".join(rows)


def generate_main(argv: list[str] | None = None) -> int:
    from . import api, loading
    from .checkpoints.errors import CheckpointError
    from .config import ConfigError
    from .schedules import SCHEDULES

    p = argparse.ArgumentParser(
        prog="packed-ss generate",
        description="Decoding with Packed-SS (default), one other schedule or all four; greedy "
                    "unless --temperature > 0. Without --model it runs the small model shipped "
                    "with the package.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (needs a tokenizer)")
    p.add_argument("--ids", help="prompt as token ids, e.g. '1,17,42' (instead of text)")
    p.add_argument("--model", default=None,
                   help="Hugging Face or converted checkpoint directory (default: the embedded "
                        "model)")
    p.add_argument("--schedule", default="packed", choices=sorted(SCHEDULES) + ["all"],
                   help="decoding schedule (default packed); 'all' compares ar, linear, "
                        "quadratic and packed on the same prompt")
    p.add_argument("--block-size", type=int, default=None, help="B (default: the config's)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-eos", action="store_true", help="ignore EOS (stop at the length limit)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default) is greedy; > 0 samples exactly from the AR distribution")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the checksum check of a converted --model (faster load)")
    args = p.parse_args(argv)
    if args.prompt is None and args.ids is None:
        p.error("give a prompt (text) or --ids")
    if args.prompt is not None and not args.prompt.strip():
        p.error("the prompt is empty: give some text, e.g. packed-ss generate \"Question: ...\"")
    if args.model is not None and not Path(args.model).exists():
        print(f"packed-ss: error: --model {args.model}: no such directory", file=sys.stderr)
        return 2
    try:
        model = loading.load(args.model, dtype=args.dtype, verify=not args.no_verify)
        prompt = _prompt_arg(args, model)
        schedules = ["ar", "linear", "quadratic", "packed"] if args.schedule == "all" else [args.schedule]
        results = [api.decode(model, prompt, schedule=s, block_size=args.block_size,
                              max_new_tokens=args.max_new_tokens,
                              eos_id=None if args.no_eos else -1, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
                   for s in schedules]
    except (CheckpointError, ConfigError, FileNotFoundError, NotADirectoryError, ValueError,
            TypeError) as e:
        print(f"packed-ss: error: {e}", file=sys.stderr)
        return 2
    first = results[0]
    print(first.text if first.text is not None else " ".join(map(str, first.tokens)))
    if args.temperature == 0 and any(r.tokens != first.tokens for r in results):
        print("warning: schedules disagree (numerical near-tie?)", file=sys.stderr)
    print()
    print(_table(results))
    print(f"\n(compile time excluded from wall: {sum(r.compile_s for r in results):.1f}s)")
    return 0


def bench_main(argv: list[str] | None = None) -> int:
    from benchmarks.bench import main as bench

    return bench(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"generate": generate_main, "convert": convert_main, "bench": bench_main}
    if not argv or argv[0] not in commands:
        print("usage: packed-ss {generate,convert,bench} ...\n\n"
              "  generate   decode a prompt with AR / Linear-SS / Quadratic-SS / Packed-SS\n"
              "  convert    convert a Hugging Face checkpoint to orbax params\n"
              "  bench      measure schedules on a task (tokens/NFE, throughput, CIs)",
              file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])
