"""Command-line plumbing shared by every command (`packed-ss generate|convert|bench`).

Every command runs through `run_command`: an expected failure (a bad command line, a
missing or malformed file, a config or checkpoint the package cannot use, a request it
cannot decode, an OS error on a path) is one line on stderr, `<prog>: error: ...`, and
exit status 2. Anything else is a bug and keeps its traceback. The argument types refuse
a bad value while parsing, before any work.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

from . import families


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


def _number(text: str, ok: Callable[[float], bool], what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value):  # NaN fails every check
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def temperature(text: str) -> float:
    return _number(text, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def probability(text: str) -> float:
    return _number(text, lambda v: 0 < v <= 1, "in (0, 1]")


def token_ids(text: str) -> list[int]:
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("no token ids given")
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be integers (e.g. '1,17,42'), got {text!r}") from None


# --- model and width arguments, shared by the commands that decode -------------------------------

def model_args(p: Parser) -> None:
    """The checkpoint arguments every command that loads a model takes."""
    p.add_argument("--model", default=None,
                   help="Hugging Face or converted checkpoint directory, or the name of an "
                        "embedded model (default: the embedded nld-tiny)")
    p.add_argument("--base-config", default=None,
                   help="SetDLM: the base (Qwen3) model's config.json, for checkpoints whose "
                        "config.json only names their backbone")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json (or its directory) for checkpoints that ship none")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--matmul-precision", choices=["default", "high", "highest"],
                   default="default", help="matmul precision: default follows JAX (TF32 for "
                   "float32 on GPUs); highest: full float32 products")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the checksum check of a converted --model (faster load)")
    p.add_argument("--compile-cache", metavar="DIR|off", default=None,
                   help="where compiled programs are kept between runs (default: "
                        "$PACKED_SS_COMPILE_CACHE, else ~/.cache/packed_ss_jax/xla); off: "
                        "none")
    p.add_argument("--mesh", metavar="data=D,model=M", type=mesh_spec, default=None,
                   help="decode on a mesh of D x M devices (every device of every process): "
                        "sequences split over data, tensor-parallel over model (default: one "
                        "device)")
    p.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="several hosts: the address of process 0 (jax.distributed)")
    p.add_argument("--num-processes", type=int_at_least(1), default=None,
                   help="several hosts: how many processes take part")
    p.add_argument("--process-id", type=int_at_least(0), default=None,
                   help="several hosts: this process's index, 0 .. num-processes - 1")


def mesh_spec(text: str) -> dict:
    from .sharding import MeshError, parse

    try:
        return parse(text)
    except MeshError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def distributed(args) -> None:
    """Joins the processes of a multi-host run (`--coordinator`, `--num-processes`,
    `--process-id`) before anything touches a device; every process runs the same
    command line with its own --process-id."""
    given = [args.coordinator, args.num_processes, args.process_id]
    if all(x is None for x in given):
        return
    if any(x is None for x in given):
        raise UsageError("--coordinator, --num-processes and --process-id go together")
    if args.process_id >= args.num_processes:
        raise UsageError(f"--process-id {args.process_id} must be below --num-processes "
                         f"{args.num_processes}")
    import jax

    if jax.distributed.is_initialized():  # joined already (a command may ask twice)
        return
    # CPU devices of several processes talk through gloo (GPUs use NCCL whatever this says).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)


def load_model(args, lora: bool | None = None):
    """The model the command line names (`model_args`); also applies --compile-cache.
    `lora` as `loading.load` takes it (None: the draft-only adapter if the checkpoint has one)."""
    from . import loading
    from .compile_cache import OFF, set_compile_cache

    if args.compile_cache is not None:
        off = args.compile_cache.strip().lower() in OFF
        set_compile_cache(None if off else args.compile_cache)

    if args.model is not None and not Path(args.model).exists() \
            and args.model not in loading.embedded_models():
        raise FileNotFoundError(f"--model {args.model}: no such directory (embedded models: "
                                f"{', '.join(loading.embedded_models())})")
    distributed(args)
    mesh = None
    if getattr(args, "mesh", None) is not None:
        from .sharding import MeshError, make_mesh

        try:
            mesh = make_mesh(**args.mesh)
        except MeshError as e:
            raise UsageError(f"--mesh: {e}") from None
    # With several processes each shows its loading progress on its own stderr: how many
    # bytes of weights it read (on a mesh, the slices its own devices hold).
    several = (args.num_processes or 1) > 1
    return loading.load(args.model, dtype=args.dtype, verify=not args.no_verify,
                        base_config=args.base_config, tokenizer=args.tokenizer,
                        matmul_precision=args.matmul_precision, lora=lora, mesh=mesh,
                        progress=several)


def width_args(p: Parser) -> None:
    """Every family's width argument (--block-size, --window), one per family."""
    for name in dict.fromkeys(f.width_name for f in families.FAMILIES.values()):
        users = [f for f in families.FAMILIES.values() if f.width_name == name]
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                       type=int_at_least(min(f.min_width for f in users)),
                       help=f"{', '.join(f.title for f in users)}: the {name} "
                            f"(default: the checkpoint's)")


def width_of(args, family) -> int | None:
    """The width the command line gives, under the loaded family's own flag."""
    for f in families.FAMILIES.values():
        if f.width_name != family.width_name and getattr(args, f.width_name, None) is not None:
            raise UsageError(f"--{f.width_name.replace('_', '-')} is for {f.title} models; "
                             f"this {family.title} model takes "
                             f"--{family.width_name.replace('_', '-')}")
    return getattr(args, family.width_name, None)
