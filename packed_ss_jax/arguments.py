"""Command-line plumbing shared by every command (`packed-ss generate|convert|bench`).

Every command runs through `run_command`: an expected failure (a bad command line, a
missing or malformed file, a config or checkpoint the package cannot use, a request it
cannot decode, an OS error on a path) is one line on stderr, `<prog>: error: ...`, and
exit status 2. Anything else is a bug and keeps its traceback. The argument types refuse
a bad value while parsing, before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import math
import os
import re
import socket
import sys
import threading
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
    from .results import NonFiniteError
    from .validate import InputError

    # NonFiniteError: a checkpoint whose numbers overflow to NaN/Inf is a bad input, not a
    # bug of the package; the message says where decoding stopped.
    return (UsageError, InputError, ConfigError, CheckpointError, DestinationError,
            NonFiniteError, OSError)


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    # Multi-line messages (e.g. a list of mismatched tensors) are joined onto one line.
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


# The running command's name, for the one error line that does not come back through
# `run_command`: the missing-peer deadline, which ends the process from another thread.
_running = {"prog": "packed-ss"}


def run_command(prog: str, body: Callable[[list[str] | None, str], int],
                argv: list[str] | None) -> int:
    """Runs `body(argv, prog)`; expected failures become one line on stderr and status 2."""
    outer, _running["prog"] = _running["prog"], prog
    try:
        return body(argv, prog)
    except _expected() as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # SIGTERM during a conversion arrives as `Interrupted`, which knows its signal.
        print(f"{prog}: {e or 'interrupted'}", file=sys.stderr)
        return getattr(e, "exit_status", 130)
    finally:
        _running["prog"] = outer


# --- argument types: a bad value is refused while parsing, before any work ----------------------

def _shown(text: str, limit: int = 40) -> str:
    """`text` as an error message quotes it: a 5000-digit number is cut short."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:  # also past Python's 4300-digit limit
        return None


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    what = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        value = _integer(text)
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {what}, got {_shown(text)}")
        return value

    parse.__name__ = f"integer {what}"
    return parse


def ints_at_least(minimum: int) -> Callable[[str], list[int]]:
    """A comma-separated list of integers >= minimum ('1,8,32')."""
    one = int_at_least(minimum)

    def parse(text: str) -> list[int]:
        parts = [t.strip() for t in text.split(",")]
        try:
            return [one(t) for t in parts]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be integers >= {minimum}, comma-separated, "
                                             f"got {_shown(text)}") from None

    parse.__name__ = f"integers >= {minimum}"
    return parse


def seed(text: str) -> int:
    value = _integer(text)
    if value is None or not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {_shown(text)}")
    return value


def _number(text: str, ok: Callable[[float], bool], what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value):  # NaN fails every check
        raise argparse.ArgumentTypeError(f"must be {what}, got {_shown(text)}")
    return value


def temperature(text: str) -> float:
    return _number(text, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def probability(text: str) -> float:
    return _number(text, lambda v: 0 < v <= 1, "in (0, 1]")


def seconds(text: str) -> float:
    """A time limit: a finite number of seconds > 0."""
    return _number(text, lambda v: math.isfinite(v) and 0 < v <= 86400,
                   "a number of seconds in (0, 86400]")


MAX_TOKEN_ID = 2**31 - 1  # ids are int32 on the device


def token_ids(text: str) -> list[int]:
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("no token ids given")
    ids = [_integer(t) for t in parts]
    if any(i is None or not 0 <= i <= MAX_TOKEN_ID for i in ids):
        raise argparse.ArgumentTypeError(f"must be integers in [0, 2**31) (e.g. '1,17,42'), "
                                         f"got {_shown(text)}")
    return ids


def text(value: str) -> str:
    """Command-line text (a prompt, a stop marker, a system message). Python decodes argv
    with surrogateescape, so bytes that are not UTF-8 arrive as lone surrogates, which no
    tokenizer takes: refused here rather than deep inside the tokenizer."""
    from .validate import InputError, text as checked

    try:
        return checked(value, "the value")
    except InputError as e:
        raise argparse.ArgumentTypeError(f"{e}; the command line must be UTF-8") from None


def origins(value: str) -> tuple[str, ...]:
    """Web origins, comma-separated (`https://app.example.com,http://localhost:3000`), or
    `*` for any: each a scheme, a host and an optional port, as a browser sends it."""
    found = tuple(x.strip() for x in text(value).split(",") if x.strip())
    if not found:
        raise argparse.ArgumentTypeError("no origin given")
    for origin in found:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise argparse.ArgumentTypeError(
                f"{_shown(origin)} is not an origin (scheme://host[:port], no path)")
    return found


# Bounds of the multi-host arguments: JAX takes the count as int32 and allocates per
# process (2**31 - 1 processes hang it), far more than any real run.
MAX_PROCESSES = 2**16
COORDINATOR_TIMEOUT_S = 60.0


# A host name or IPv4 address (ASCII letters, digits, '.', '-', '_'), or an IPv6 address in
# brackets. Anything else is refused before JAX sees it: gRPC crashes on some of it.
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9._-]{0,251}[A-Za-z0-9_])?")
_IPV6 = re.compile(r"\[([0-9A-Fa-f:.]{2,45}(%[A-Za-z0-9_.-]{1,64})?)\]")  # zone: an interface
_PORT = re.compile(r"[0-9]{1,5}")


def _address_problem(host: str, port: str) -> str | None:
    if not host:
        return "the host is empty"
    if host.startswith("[") and host.endswith("]"):
        match = _IPV6.fullmatch(host)
        try:
            ipaddress.IPv6Address(match[1] if match else "")
        except ValueError:
            return f"{_shown(host)} is not an IPv6 address in brackets"
    elif ":" in host:
        return "an IPv6 host goes in brackets, e.g. [::1]:1234"
    elif not _HOST_NAME.fullmatch(host):
        return f"{_shown(host)} is not a host name or IPv4 address"
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        return "the port must be an integer in [1, 65535]"
    return None


def coordinator(value: str) -> str:
    """--coordinator HOST:PORT (IPv6: [ADDR]:PORT), as JAX takes it (the port without
    leading zeros)."""
    host, colon, port = value.rpartition(":")
    problem = _address_problem(host, port) if colon else \
        "must be HOST:PORT (e.g. 10.0.0.1:1234 or [::1]:1234)"
    if problem:
        raise argparse.ArgumentTypeError(f"{_shown(value)}: {problem}")
    return f"{host}:{int(port)}"


# --- model and width arguments, shared by the commands that decode -------------------------------

def model_args(p: Parser) -> None:
    """The checkpoint arguments every command that loads a model takes."""
    p.add_argument("--model", default=None,
                   help="Hugging Face or converted checkpoint directory, the name of an "
                        "embedded model, or a Hugging Face hub id ORG/NAME[@REVISION], "
                        "fetched through the hub's cache (HF_HUB_OFFLINE=1: the cache only) "
                        "(default: the embedded nld-tiny)")
    p.add_argument("--base-config", default=None,
                   help="SetDLM: the base (Qwen3) model's config.json, for checkpoints whose "
                        "config.json only names their backbone")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json (or its directory) for checkpoints that ship none")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the weights' dtype (default float32; bfloat16 for the real "
                        "checkpoints on a GPU)")
    p.add_argument("--matmul-precision", choices=["default", "high", "highest"],
                   default="default", help="matmul precision: default follows JAX (TF32 for "
                   "float32 on GPUs); highest: full float32 products")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the checksum check of a converted --model (faster load)")
    p.add_argument("--compile-cache", metavar="DIR|off", type=text, default=None,
                   help="where compiled programs are kept between runs (default: "
                        "$PACKED_SS_COMPILE_CACHE, else ~/.cache/packed_ss_jax/xla); off: "
                        "none")
    p.add_argument("--mesh", metavar="data=D,model=M", type=mesh_spec, default=None,
                   help="decode on a mesh of D x M devices (every device of every process): "
                        "sequences split over data, tensor-parallel over model (default: one "
                        "device)")
    p.add_argument("--coordinator", metavar="HOST:PORT", type=coordinator, default=None,
                   help="several hosts: the address of process 0 (jax.distributed); an "
                        "IPv6 address in brackets, [ADDR]:PORT")
    p.add_argument("--num-processes", type=int_at_least(1, MAX_PROCESSES), default=None,
                   help="several hosts: how many processes take part")
    p.add_argument("--process-id", type=int_at_least(0, MAX_PROCESSES - 1), default=None,
                   help="several hosts: this process's index, 0 .. num-processes - 1")
    p.add_argument("--coordinator-timeout", metavar="SECONDS", type=seconds,
                   default=COORDINATOR_TIMEOUT_S,
                   help=f"several hosts: how long a process waits for all of them to join "
                        f"before it gives up with an error (default "
                        f"{COORDINATOR_TIMEOUT_S:g} s)")


def mesh_spec(text: str) -> dict:
    from .sharding import MeshError, parse

    try:
        return parse(text)
    except MeshError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def distributed(args) -> None:
    """Joins the processes of a multi-host run (`--coordinator`, `--num-processes`,
    `--process-id`) before anything touches a device; every process runs the same
    command line with its own --process-id. A process whose peers have not all joined
    within --coordinator-timeout ends with one error line and status 2."""
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
    if args.process_id == 0:
        _check_port_free(args.coordinator)
    # CPU devices of several processes talk through gloo (GPUs use NCCL whatever this says).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = getattr(args, "coordinator_timeout", COORDINATOR_TIMEOUT_S)
    late = (f"{_running['prog']}: error: not all {args.num_processes} processes joined at "
            f"--coordinator {args.coordinator} within {timeout:g} s (this is --process-id "
            f"{args.process_id}): start every process, each with its own --process-id, "
            f"or raise --coordinator-timeout")
    with _deadline(timeout, late):
        try:
            # JAX's own timeout is the watchdog's backstop only: when it expires JAX aborts
            # the process with a native stack dump.
            jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id,
                                       initialization_timeout=math.ceil(timeout) + 30)
        except RuntimeError as e:  # e.g. called after JAX started its backend
            raise UsageError(f"cannot join the processes: {e}") from None


@contextlib.contextmanager
def _deadline(seconds: float, message: str):
    """Ends the process with `message` and status 2 if the block has not finished within
    `seconds`. The block is a native call that keeps the main thread (JAX's join), so no
    exception can reach it: a thread writes the line and exits the process itself."""
    done = threading.Event()

    def expire():
        if not done.wait(seconds):
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            os._exit(2)

    threading.Thread(target=expire, name="coordinator-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _check_port_free(address: str) -> None:
    """Process 0 serves the coordinator on every interface at the address's port; gRPC
    crashes the process (no error) if that port is taken, so it is tried first."""
    port = int(address.rpartition(":")[2])
    for family, anywhere in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                # As a server binds: a port in TIME_WAIT is free, one in use is not.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((anywhere, port))
            return
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                raise UsageError(f"--coordinator {address}: process 0 cannot serve on port "
                                 f"{port} ({e.strerror}); choose another port") from None
            # Anything else (no IPv6 here): the next family, else JAX finds out itself.


def load_model(args, lora: bool | None = None):
    """The model the command line names (`model_args`); also applies --compile-cache.
    `lora` as `loading.load` takes it (None: the draft-only adapter if the checkpoint has one)."""
    from . import loading
    from .compile_cache import OFF, set_compile_cache
    from .hub import is_hub_name

    if args.compile_cache is not None:
        off = args.compile_cache.strip().lower() in OFF
        set_compile_cache(None if off else args.compile_cache)

    if args.model is not None and not Path(args.model).exists() \
            and args.model not in loading.embedded_models() and not is_hub_name(args.model):
        raise FileNotFoundError(f"--model {args.model}: no such directory (embedded models: "
                                f"{', '.join(loading.embedded_models())}; a Hugging Face hub "
                                "checkpoint is named ORG/NAME or ORG/NAME@REVISION)")
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
    p.add_argument("--branches", type=int_at_least(1), default=None,
                   help="--schedule branched: branches pre-drafted per call, 1 to the width "
                        "(B or W; default 2: the zero-accepted and the all-accepted ones)")


def width_of(args, family) -> int | None:
    """The width the command line gives (`DecodeOptions.width`), under the loaded family's
    own flag; another family's flag is a usage error naming both."""
    for other in families.FAMILIES.values():
        flag = other.width_name
        if flag != family.width_name and getattr(args, flag, None) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} is for {other.title} models; this "
                             f"{family.title} model takes "
                             f"--{family.width_name.replace('_', '-')}")
    return getattr(args, family.width_name, None)
