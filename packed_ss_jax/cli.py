"""The `packed-ss` command: `generate`, `convert`, `bench` and `serve`, for every model family.

Schedules, width arguments and options come from the family table (families.py), so a
new family or schedule reaches every command without a change here. Expected failures
are one line on stderr and exit status 2 (see arguments.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys

from . import families
from .arguments import (Parser, UsageError, int_at_least, load_model, model_args, origins,
                        probability, run_command, seconds, seed, temperature, text, token_ids,
                        width_args, width_of)


# --- commands -------------------------------------------------------------------------------------

def _convert(argv: list[str] | None, prog: str, family: str | None = None) -> int:
    p = Parser(
        prog=prog,
        description="Convert a Hugging Face checkpoint directory (Nemotron-Labs-Diffusion: "
                    "config.json + safetensors, optional linear_spec_lora/; SetDLM: "
                    "config.json + pytorch_model.bin or safetensors) to orbax params.")
    p.add_argument("src", help="Hugging Face checkpoint directory, or a hub id "
                               "ORG/NAME[@REVISION] (fetched through the hub's cache)")
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="stored param dtype (default bfloat16; float32 for CPU parity work)")
    p.add_argument("--base-config", default=None,
                   help="SetDLM: the base (Qwen3) model's config.json, for checkpoints whose "
                        "config.json only names their backbone")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--lora", dest="lora", action="store_true", default=None,
                      help="require and include the draft-only linear_spec_lora adapter")
    lora.add_argument("--no-lora", dest="lora", action="store_false",
                      help="leave the adapter out even when present")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier conversion output or an empty directory (nothing else)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    args = p.parse_args(argv)
    if family is not None:
        _require_family(args.src, families.FAMILIES[family], prog)

    from .conversion import convert

    convert(args.src, args.dst, dtype=args.dtype, lora=args.lora, overwrite=args.overwrite,
            progress=not args.quiet, base_config=args.base_config)
    return 0


def convert_main(argv: list[str] | None = None, prog: str = "packed-ss-convert",
                 family: str | None = None) -> int:
    """`packed-ss convert`; with `family`, the source must be a checkpoint of that family
    (the per-family scripts in convert/)."""
    return run_command(prog, lambda a, p: _convert(a, p, family), argv)


def _require_family(src: str, family, prog: str) -> None:
    """Refuses a source whose config.json names another model type than `family`'s."""
    from .config import read_hf_config
    from .hub import is_hub_name, resolve

    # A hub checkpoint's config is fetched first: its weights only once it is the family's.
    model_type = read_hf_config(resolve(src, weights=False) if is_hub_name(src)
                                else src).get("model_type")
    if model_type != family.model_type:
        raise UsageError(f"{src} is not a {family.title} checkpoint (its config.json says "
                         f"model_type {model_type!r}, not {family.model_type!r}): {prog} "
                         "converts that family only; `packed-ss convert` converts every family")


def _table(results) -> str:
    head = "| schedule | tokens | NFE | tokens/NFE | wall (ms) | tokens/s |"
    rows = [head, "|" + "---|" * 6]
    for r in results:
        f = families.FAMILIES[r.family]
        name = r.schedule if r.schedule == f.reference else f"{r.schedule} ({f.width_symbol}={r.width})"
        if r.schedule == "branched":
            name = name[:-1] + f", k={r.branches})"
        if r.order != f.orders[0]:
            name += f", {r.order}"
        rows.append(f"| {name} | {len(r.tokens)} | {r.nfe} | {r.tokens_per_nfe:.2f} | "
                    f"{1e3 * r.wall_s:.1f} | {r.tokens_per_s:.1f} |")
    return "\n".join(rows)


def stop_marker(value: str):
    """A --stop value: token ids ("13" or "13,13") or text (UTF-8)."""
    if not value:
        raise argparse.ArgumentTypeError("empty: a stop marker needs at least one character")
    if re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", value):
        return token_ids(value)
    return text(value)


def _generate_parser(prog: str) -> Parser:
    """The `generate` command line: the prompt (text or ids), the model, the schedule and
    its width, stop markers, the chat template's inputs and the sampling options."""
    p = Parser(
        prog=prog,
        description="Decoding with Packed-SS (default), one other schedule or all of a "
                    "family's schedules; greedy unless --temperature > 0. Without --model it "
                    "runs the small model shipped with the package.")
    p.add_argument("prompt", nargs="?", type=text, default=None,
                   help="prompt text (needs a tokenizer)")
    p.add_argument("--ids", type=token_ids,
                   help="prompt as token ids, e.g. '1,17,42' (instead of text)")
    model_args(p)
    p.add_argument("--schedule", default="packed",
                   choices=families.all_schedules() + ["auto", "all"],
                   help="decoding schedule (default packed); 'auto' picks the exact schedule "
                        "predicted fastest on this device (calibrated on first use); 'all' "
                        "runs every schedule of the model's family on the same prompt")
    width_args(p)
    p.add_argument("--order", default=None,
                   help="SetDLM: verification order, ltr (default) or confidence")
    p.add_argument("--stop", action="append", type=stop_marker, default=[],
                   help="a stop marker, token ids ('13,13') or text; repeatable (default: "
                        "none but EOS)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message: render it with the checkpoint's chat "
                        "template (and --system)")
    p.add_argument("--system", type=text, default=None,
                   help="with --chat: a system message first")
    p.add_argument("--no-thinking", action="store_true",
                   help="with --chat: pass enable_thinking=False to the template")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64,
                   help="the most tokens to generate (default 64)")
    p.add_argument("--no-eos", action="store_true", help="ignore EOS (stop at the length limit)")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0 (default) is greedy; > 0 samples exactly from the AR distribution")
    p.add_argument("--top-k", type=int_at_least(1), default=None,
                   help="with --temperature > 0: sample among the k most likely tokens only "
                        "(default: all)")
    p.add_argument("--top-p", type=probability, default=None,
                   help="with --temperature > 0: sample from the smallest set of tokens whose "
                        "probability reaches p (default 1: all)")
    p.add_argument("--seed", type=seed, default=0,
                   help="the sampling seed, in [0, 2**32) (default 0)")
    return p


def _check_prompt(p: Parser, args) -> None:
    """Refuses, before any model is loaded, a prompt that is missing, given twice or
    empty, and chat options that do not fit together."""
    if args.prompt is None and args.ids is None:
        p.error("give a prompt (text) or --ids")
    if args.prompt is not None and args.ids is not None:
        p.error("give a prompt (text) or --ids, not both")
    if args.prompt is not None and not args.prompt.strip():
        p.error("the prompt is empty: give some text, e.g. packed-ss generate \"Question: ...\"")
    if args.chat and args.prompt is None:
        p.error("--chat needs the user's message as the prompt text")
    if (args.system is not None or args.no_thinking) and not args.chat:
        p.error("--system and --no-thinking go with --chat")


def _check_schedule(schedule: str, family, also: str = "") -> None:
    """Refuses a schedule the model's family does not decode with; `also` names what
    the command accepts besides the family's schedules (e.g. " (or all)")."""
    if schedule not in family.schedules and schedule != "auto":
        raise UsageError(f"--schedule {schedule}: {family.title} models decode with "
                         f"{', '.join(family.schedules)}{also}")


def _decode_options(args, family):
    """The decode's `DecodeOptions` for the parsed command line (the schedule set per
    run): limits, sampling, seed, width, branches, order and stops."""
    from .options import DecodeOptions

    options = DecodeOptions(width=width_of(args, family), branches=args.branches,
                            max_new_tokens=args.max_new_tokens,
                            eos_id=None if args.no_eos else -1, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            stop_sequences=tuple(args.stop))
    return options if args.order is None else dataclasses.replace(options, order=args.order)


def _prompt(args) -> dict:
    """What to decode: the prompt (text or --ids), or with --chat the messages (the
    user's, after --system's) and the chat template's keywords."""
    if not args.chat:
        return {"prompt": args.ids if args.ids is not None else args.prompt}
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": args.prompt}]
    return {"messages": messages,
            "chat_template_kwargs": {"enable_thinking": False} if args.no_thinking else None}


def _for(schedule: str, options, every: bool):
    """`options` for one schedule: with --schedule all (`every`), --branches goes to
    Branched-SS alone (given with another schedule, the decode refuses it)."""
    keep = schedule == "branched" or not every
    return dataclasses.replace(options, schedule=schedule,
                               branches=options.branches if keep else None)


def _stream_to_stdout(model, prompt: dict, options):
    """Decodes `prompt` with `options`, printing the text (or, without a tokenizer, the
    token ids) as it arrives, then a newline; returns the decode's result."""
    from . import api

    first = None
    for piece in api.stream(model, **prompt, options=options):
        if piece.text is not None:
            print(piece.text, end="", flush=True)
        elif piece.tokens:
            print(" ".join(map(str, piece.tokens)), end=" ", flush=True)
        first = piece.result or first
    print()
    return first


def _report(results, family, greedy: bool) -> None:
    """Prints the table of the schedules' results and the compile time left out of it;
    when greedy, warns on stderr if the exact schedules' tokens differ."""
    exact = [r for r in results if r.schedule not in family.inexact]
    if greedy and any(r.tokens != exact[0].tokens for r in exact[1:]):
        print("warning: schedules disagree (numerical near-tie?)", file=sys.stderr)
    print()
    print(_table(results))
    print(f"\n(compile time excluded from wall: {sum(r.compile_s for r in results):.1f}s)")


def _generate(argv: list[str] | None, prog: str) -> int:
    """`packed-ss generate`: decodes one prompt with one schedule or all of the family's,
    streaming the first, then prints a table comparing them."""
    p = _generate_parser(prog)
    args = p.parse_args(argv)
    _check_prompt(p, args)

    from . import api

    model = load_model(args)
    family = families.of(model.config)
    if args.schedule != "all":
        _check_schedule(args.schedule, family, " (or all)")
    options, prompt = _decode_options(args, family), _prompt(args)
    schedules = list(family.schedules) if args.schedule == "all" else [args.schedule]
    # The first schedule prints as it decodes; the others (--schedule all) only add rows.
    every = args.schedule == "all"
    if every and args.branches is not None:   # checked before any schedule decodes
        if "branched" not in schedules:
            raise UsageError(f"--branches is for --schedule branched, which {family.title} "
                             "models do not have")
        from .options import branches

        branches(args.branches, "branched", options.width or model.config.block_size,
                 family.width_name)
    planner = _auto_progress(model) if args.schedule == "auto" else None
    first = _stream_to_stdout(model, prompt, _for(schedules[0], options, every))
    results = [first] + [api.decode(model, **prompt, options=_for(s, options, every))
                         for s in schedules[1:]]
    _report(results, family, greedy=args.temperature == 0)
    if planner is not None:
        print(f"auto chose {first.auto['label']} (predicted "
              f"{first.auto['predicted_tokens_per_s']:.0f} tokens/s; calibration "
              f"{planner.calibration_s:.1f} s)")
    return 0


def _auto_progress(model):
    """Schedule auto's planner for `model`, telling stderr about each candidate its first
    use calibrates (a calibration kept on disk is read back silently)."""
    from .api import auto_planner

    def progress(i, n, label):
        print(f"calibrating auto: {label} ({i + 1} of {n})", file=sys.stderr, flush=True)

    planner = auto_planner(model)
    planner.progress = progress
    return planner


def generate_main(argv: list[str] | None = None, prog: str = "packed-ss generate") -> int:
    return run_command(prog, _generate, argv)


def _serve_parser(prog: str) -> Parser:
    """The `serve` command line: the model, where to listen, the served name, the
    schedule and its width, the slots, the API key and the HTTP limits."""
    p = Parser(prog=prog,
               description="Serve a model over an OpenAI-compatible HTTP API (/v1/models, "
                           "/v1/completions, /v1/chat/completions, /health) until Ctrl-C or "
                           "SIGTERM, which drain the requests in flight.")
    model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int_at_least(0), default=8000,
                   help="port (default 8000; 0: any free port, printed at startup)")
    p.add_argument("--served-model-name", type=text, default=None,
                   help="the model id clients ask for (default: the checkpoint's folder name)")
    p.add_argument("--schedule", default="packed", choices=families.all_schedules() + ["auto"],
                   help="decoding schedule (default packed); 'auto' picks the exact schedule "
                        "predicted fastest with every slot busy (calibrated on first use)")
    width_args(p)
    p.add_argument("--max-num-seqs", type=int_at_least(1, 256), default=8,
                   help="requests (each choice of one) decoded at once, in the slots of one "
                        "batched state (default 8)")
    p.add_argument("--max-model-len", type=int_at_least(2), default=None,
                   help="the most tokens a request may hold, prompt and output (the cache "
                        "size of every slot; default: the model's context, at most 4096)")
    p.add_argument("--steps-per-launch", type=int_at_least(1, 1024), default=4,
                   help="decode loop iterations between two looks of the host: fewer reach "
                        "clients and start waiting requests sooner, at a host round trip "
                        "each (default 4)")
    p.add_argument("--max-queue", type=int_at_least(0), default=256,
                   help="requests waiting for a slot past this get 503 with Retry-After "
                        "(default 256)")
    p.add_argument("--api-key", type=text, default=os.environ.get("PACKED_SS_API_KEY") or None,
                   help="clients must send 'Authorization: Bearer KEY' (default: "
                        "$PACKED_SS_API_KEY; none: no key)")
    p.add_argument("--allowed-origins", type=origins, default=(),
                   help="web origins whose pages may call the server from a browser (CORS), "
                        "comma-separated, or '*' for any (default: none)")
    _limit_args(p)
    p.add_argument("--docs", action="store_true",
                   help="serve the interactive API docs at /docs and /openapi.json")
    p.add_argument("--warmup-only", action="store_true",
                   help="make every program ready (compiled, and kept on disk for the next "
                        "start), then exit without listening: a deployment's build step")
    return p


def _limit_args(p: Parser) -> None:
    """The server's HTTP limits (defaults from `Limits`)."""
    from .server.http_guard import Limits

    d = Limits()
    p.add_argument("--max-body-bytes", type=int_at_least(1024), default=d.max_body_bytes,
                   help=f"larger request bodies get 413 (default {d.max_body_bytes})")
    p.add_argument("--max-connections", type=int_at_least(1), default=d.max_connections,
                   help=f"connections past this get 503 (default {d.max_connections})")
    p.add_argument("--header-timeout", type=seconds, default=d.header_timeout_s,
                   help="seconds a connection has to send a request's headers "
                        f"(default {d.header_timeout_s:g})")
    p.add_argument("--body-timeout", type=seconds, default=d.body_timeout_s,
                   help=f"seconds a request's body may take (default {d.body_timeout_s:g})")
    p.add_argument("--prepare-timeout", type=seconds, default=d.prepare_timeout_s,
                   help="seconds to render a chat template and tokenize a request "
                        f"(default {d.prepare_timeout_s:g})")
    p.add_argument("--drain-timeout", type=seconds, default=d.drain_timeout_s,
                   help="on SIGTERM/Ctrl-C, seconds requests in flight get to finish "
                        f"(default {d.drain_timeout_s:g})")


def _check_serve_args(p: Parser, args) -> None:
    """Refuses, before any model is loaded, a port past 65535 and an empty API key."""
    if args.port > 65535:
        p.error(f"--port must be at most 65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        p.error("--api-key is empty")


def _limits(args):
    """The server's `Limits` from the parsed command line."""
    from .server.http_guard import Limits

    return Limits(max_body_bytes=args.max_body_bytes, max_connections=args.max_connections,
                  header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                  prepare_timeout_s=args.prepare_timeout,
                  drain_timeout_s=args.drain_timeout, api_key=args.api_key, docs=args.docs,
                  allowed_origins=args.allowed_origins)


def _serving_app(args, limits, warm: bool = False):
    """Loads the model and builds the HTTP app that serves it; returns (app, the model
    id clients ask for). Refuses a schedule the model's family does not decode with. Its
    programs are made ready when it starts (`warm`: here, before it is returned)."""
    from .server import create_app, model_name

    model = load_model(args)
    family = families.of(model.config)
    _check_schedule(args.schedule, family)
    width = width_of(args, family)
    name = args.served_model_name or model_name(args.model)
    context = model.config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > context:
        raise UsageError(f"--max-model-len {args.max_model_len} is longer than the model's "
                         f"context of {context} tokens")
    if args.schedule == "auto":
        _auto_progress(model)
    shape = {} if width is None else {"width": width}   # DecodeOptions' fields
    if args.branches is not None:
        shape["branches"] = args.branches
    app = create_app(model, name, schedule=args.schedule, limits=limits, width=shape or None,
                     max_model_len=args.max_model_len, slots=args.max_num_seqs,
                     steps=args.steps_per_launch, max_queue=args.max_queue, warm=warm,
                     on_ready=lambda error: _ready(app, error))
    d = app.app.state.decoder
    if args.schedule == "auto":
        auto = app.app.state.auto
        print(f"auto chose {auto['label']} for {auto['sequences']} slots (predicted "
              f"{auto['predicted_tokens_per_s']:.0f} tokens/s)", file=sys.stderr, flush=True)
    if not warm:
        print(f"making {d.programs} programs ready (compiled, or read from disk); /health "
              "answers 503 until they are", file=sys.stderr, flush=True)
    return app, name


class _Progress(logging.Handler):
    """A warm-up's progress lines (programs.Warming) on stderr, as the other lines of
    `packed-ss serve` are: to whatever `sys.stderr` is when a line comes."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"  {self.format(record)}", file=sys.stderr, flush=True)


def _show_progress() -> None:
    """Each program the warm-up makes ready, one line on stderr (`_Progress`); added once
    however many times a process serves."""
    from . import programs

    if not any(isinstance(h, _Progress) for h in programs.log.handlers):
        programs.log.addHandler(_Progress())
        programs.log.setLevel(logging.INFO)
        programs.log.propagate = False


def _ready(app, error: BaseException | None) -> None:
    """Tells stderr that the server's programs are ready (or why they are not: the server
    then stops, and `packed-ss serve` exits with status 2)."""
    d = app.app.state.decoder
    if error is not None:
        print(f"packed-ss serve: error: the server's programs could not be made ready: "
              f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return
    served = "greedy and sampled" if d.sampled else "greedy (the schedule does not sample)"
    loaded = f" ({d.loaded} read from disk)" if d.loaded else ""
    print(f"ready in {d.warm_s:.1f} s: {d.programs} programs{loaded} for {d.slots} slots, "
          f"{served} requests of up to {d.capacity} tokens", file=sys.stderr, flush=True)


def _listen(host: str, port: int):
    """The listening socket on host:port; a failure to bind is a usage error."""
    from .server import bind

    try:
        return bind(host, port)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: "
                         f"{e.strerror or e}") from None


def _announce(args, name: str, port: int) -> None:
    """Tells stderr where the server listens, warning first when it is reachable from
    other machines without an API key."""
    from .server import is_loopback

    if args.api_key is None and not is_loopback(args.host):
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach "
              f"port {port} can use this server", file=sys.stderr, flush=True)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {name} on http://{host}:{port}/v1 (Ctrl-C to stop)",
          file=sys.stderr, flush=True)


def _exit_now() -> None:
    """Ends the process at once: a compile or a tokenizer run still going cannot be
    interrupted, and waiting for it would keep a stopped server alive."""
    from .template_render import shutdown

    shutdown()  # the template worker (os._exit skips the exit hooks that stop it)
    sys.stdout.flush()
    os._exit(0)


def _serve(argv: list[str] | None, prog: str) -> int:
    """`packed-ss serve`: serves the model over HTTP until Ctrl-C or SIGTERM, which
    drain the requests in flight."""
    p = _serve_parser(prog)
    args = p.parse_args(argv)
    _check_serve_args(p, args)

    from .server import serve

    limits = _limits(args)
    _show_progress()
    if args.warmup_only:
        app, _ = _serving_app(args, limits, warm=True)
        _ready(app, None)
        return 0
    sock = _listen(args.host, args.port)  # a port in use is refused before compiling
    try:
        app, name = _serving_app(args, limits)
    except BaseException:
        sock.close()
        raise
    _announce(args, name, sock.getsockname()[1])
    ended = serve(app, sock, limits)
    print(f"{prog}: stopped", file=sys.stderr, flush=True)
    if not ended:  # a compile or a tokenizer run cannot be interrupted: leave without it
        _exit_now()
    return 0 if app.app.state.decoder.failed is None else 2


def serve_main(argv: list[str] | None = None, prog: str = "packed-ss serve") -> int:
    return run_command(prog, _serve, argv)


def bench_main(argv: list[str] | None = None, prog: str = "packed-ss bench") -> int:
    from .bench.harness import main as bench

    return bench(argv, prog=prog)


COMMANDS = {"generate": generate_main, "convert": convert_main, "bench": bench_main,
            "serve": serve_main}
USAGE = ("usage: packed-ss {generate,convert,bench,serve} ...\n\n"
         "  generate   decode a prompt with any schedule (AR / serial, Linear-SS, Quadratic-SS,\n"
         "             Packed-SS, SetDLM's native decoder)\n"
         "  convert    convert a Hugging Face checkpoint to orbax params\n"
         "  bench      measure schedules on a task (tokens/NFE, throughput, CIs)\n"
         "  serve      an OpenAI-compatible HTTP server (completions, chat, streaming)\n\n"
         "  --version  this package's version, with jax's and jaxlib's")


def version() -> str:
    """`packed-ss --version`: this package's version, jax's and jaxlib's, from the
    installed packages' metadata."""
    from importlib import metadata

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"packed-ss {of('packed-ss-jax')} (jax {of('jax')}, jaxlib {of('jaxlib')})"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(version())
        return 0
    if argv[0] not in COMMANDS:
        print(f"packed-ss: error: unknown command {argv[0]!r}; expected one of "
              f"{', '.join(COMMANDS)} (see packed-ss --help)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:], prog=f"packed-ss {argv[0]}")
