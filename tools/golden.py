"""Golden decodes: what every schedule of both families returns today, pinned in
`tests/golden/decodes.json` and checked by `tests/test_golden.py`.

    python -m tools.golden --write        # rewrites tests/golden/decodes.json

The file was written from the code as it was before the engine refactor, so that the
refactor, and every change after it, can show that it changes no decode: the same
tokens, NFE, iterations, acceptance histogram, finish reason, text and stop position
(and SetDLM's row counts, a stream's chunks, a queue's round trips) for every case. A
change in this file must be explained: rewrite it only for a change that is meant to
change what a decode returns, and say in that change why each differing case differs.

The cases cover, on the test fixtures (no tokenizer: prompts and stop markers are token
ids) and on the embedded models (text prompts and stop strings): every schedule greedy;
every sampling schedule at four sampler settings (two on the fixtures) with fixed seeds;
SetDLM's confidence order; non-default widths; EOS and stop markers; a batch of prompts
of different lengths; streaming in chunks; and continuous batching over more prompts
than slots. Each case is a short decode (24 new tokens): the whole file is written in
about 7 minutes of CPU time. The values are float32 on the CPU with full-precision
matmuls (as the test suite runs them); another backend or precision may sample other
tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "decodes.json"
FIXTURES = ROOT / "tests" / "fixtures"

# name -> (what `load` is given, its keyword arguments). Fixtures by path, the embedded
# models by name.
MODELS: dict[str, tuple[str, dict]] = {
    "nemotron-fixture": (str(FIXTURES / "nemotron_tiny"), {}),       # with its draft adapter
    "nemotron-fixture-nolora": (str(FIXTURES / "nemotron_tiny"), {"lora": False}),
    "setdlm-fixture": (str(FIXTURES / "setdlm_tiny"), {}),
    "nld-tiny": ("nld-tiny", {}),
    "setdlm-tiny": ("setdlm-tiny", {}),
}
FAMILY = {"nemotron-fixture": "nemotron", "nemotron-fixture-nolora": "nemotron",
          "setdlm-fixture": "setdlm", "nld-tiny": "nemotron", "setdlm-tiny": "setdlm"}
SCHEDULES = {"nemotron": ("ar", "linear", "quadratic", "packed"),
             "setdlm": ("serial", "native", "linear", "quadratic", "packed")}
SAMPLED = {"nemotron": ("ar", "linear", "quadratic", "packed"),
           "setdlm": ("serial", "linear", "quadratic", "packed")}
CONFIDENCE = ("linear", "quadratic", "packed")  # SetDLM's speculative schedules

# Sampler settings: name -> (sampling options, seed).
SAMPLERS: dict[str, tuple[dict, int]] = {
    "t0.7": ({"temperature": 0.7}, 3),
    "t1-k20": ({"temperature": 1.0, "top_k": 20}, 17),
    "t0.8-p0.9": ({"temperature": 0.8, "top_p": 0.9}, 2024),
    "t0.9-k40-p0.95": ({"temperature": 0.9, "top_k": 40, "top_p": 0.95}, 4_000_000_000),
}
# The fixtures (whose drafts are rarely accepted) at two of them, the embedded models at all.
FIXTURE_SAMPLERS = ("t1-k20", "t0.9-k40-p0.95")
EMBEDDED = ("nld-tiny", "setdlm-tiny")

# Prompts of three lengths (ids for the fixtures, which have no tokenizer; text for the
# embedded models). The first is the single decodes' prompt; batches take all three and
# queues a fourth as well.
PROMPTS = {
    "nemotron": ([5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [17, 250],
                 [60, 61, 62, 63, 64, 65]),
    "setdlm": ([5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [17, 250],
               [60, 61, 62, 63, 64, 65]),
    "text": ("12+34=", "Once upon a time, a little fox", "def add(a, b):", "7 * 8 ="),
}
MAX_NEW = 24


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: `call` is "decode" (one prompt), "batch" (`decode` of a list),
    "stream" (the chunks of `stream`) or "continuous" (`decode_continuous`)."""

    id: str
    model: str
    call: str
    prompt: Any
    options: dict

    def describe(self) -> dict:
        """The case's inputs as stored beside its outputs (JSON values)."""
        return json.loads(json.dumps({"model": self.model, "call": self.call,
                                      "prompt": self.prompt, "options": self.options}))


def _prompts(model: str) -> tuple:
    return PROMPTS["text" if model in EMBEDDED else FAMILY[model]]


def _sampled(name: str) -> dict:
    """A sampler setting's options, with its seed."""
    options, seed = SAMPLERS[name]
    return {**options, "seed": seed}


def _cases_of(model: str, full: bool) -> list[Case]:
    """The cases of one model; `full`: the whole matrix (else the few that check the
    draft-adapter switch)."""
    prompts = _prompts(model)
    base = {"max_new_tokens": MAX_NEW}
    out: list[Case] = []

    def add(id_, call, prompt, **options):
        out.append(Case(f"{model}-{id_}", model, call,
                        list(prompt) if isinstance(prompt, tuple) else prompt,
                        {**base, **options}))

    if not full:
        add("packed-greedy", "decode", prompts[0], schedule="packed")
        add("packed-t0.7", "decode", prompts[1], schedule="packed", **_sampled("t0.7"))
        return out
    _add_schedule_cases(add, model, prompts)
    _add_width_cases(add, FAMILY[model], prompts)
    _add_eos_and_stop_cases(add, model, prompts)
    _add_call_cases(add, model, prompts)
    return out


def _add_schedule_cases(add: Callable[..., None], model: str, prompts: tuple) -> None:
    """Every schedule greedy, every sampling schedule at the model's sampler settings and
    SetDLM's speculative schedules in confidence order (single decodes)."""
    fam = FAMILY[model]
    p0, p1 = prompts[0], prompts[1]
    for s in SCHEDULES[fam]:
        add(f"{s}-greedy", "decode", p0, schedule=s)
    for s in SAMPLED[fam]:
        for name in SAMPLERS if model in EMBEDDED else FIXTURE_SAMPLERS:
            add(f"{s}-{name}", "decode", p1, schedule=s, **_sampled(name))
    if fam == "setdlm":
        for s in CONFIDENCE:
            add(f"{s}-confidence", "decode", p0, schedule=s, order="confidence")


def _add_width_cases(add: Callable[..., None], fam: str, prompts: tuple) -> None:
    """Non-default widths: block sizes for Nemotron, windows for SetDLM."""
    p0, p1 = prompts[0], prompts[1]
    if fam == "nemotron":
        for s in ("linear", "quadratic", "packed"):
            add(f"{s}-greedy-block_size4", "decode", p0, schedule=s, block_size=4)
        add("packed-t0.7-block_size3", "decode", p1, schedule="packed", block_size=3,
            **_sampled("t0.7"))
    else:
        for s in ("native", "linear", "packed"):
            add(f"{s}-greedy-window2", "decode", p0, schedule=s, window=2)
        add("packed-t0.7-window6", "decode", p1, schedule="packed", window=6,
            **_sampled("t0.7"))
        add("packed-confidence-window6", "decode", p0, schedule="packed", window=6,
            order="confidence")


def _add_eos_and_stop_cases(add: Callable[..., None], model: str, prompts: tuple) -> None:
    """Single decodes that end otherwise than at the config's EOS."""
    fam = FAMILY[model]
    p0, p1 = prompts[0], prompts[1]
    # EOS: none, and another id than the config's (one the sampled decode reaches).
    add("packed-greedy-no-eos", "decode", p1, schedule="packed", eos_id=None)
    add(f"packed-t0.7-eos{EOS[model]}", "decode", p1, schedule="packed", eos_id=EOS[model],
        **_sampled("t0.7"))
    # Stop markers.
    stops = STOPS[model]
    add("packed-greedy-stop", "decode", p0, schedule="packed", stop_sequences=stops)
    add(f"{SCHEDULES[fam][0]}-greedy-stop", "decode", p0, schedule=SCHEDULES[fam][0],
        stop_sequences=stops)
    add("packed-t0.7-stop", "decode", p1, schedule="packed", stop_sequences=stops,
        **_sampled("t0.7"))


def _add_call_cases(add: Callable[..., None], model: str, prompts: tuple) -> None:
    """The other calls: a batch, a stream and a queue (continuous batching)."""
    p0, p1 = prompts[0], prompts[1]
    # A batch of three prompts of different lengths.
    add("batch-packed-greedy", "batch", prompts[:3], schedule="packed")
    add("batch-linear-greedy", "batch", prompts[:3], schedule="linear")
    add("batch-packed-t0.7", "batch", prompts[:3], schedule="packed",
        **{**SAMPLERS["t0.7"][0], "seed": [5, 6, 7]})
    add("batch-packed-t1-k20-one-seed", "batch", prompts[:3], schedule="packed",
        **_sampled("t1-k20"))
    # Streaming, in chunks of a few iterations.
    add("stream-packed-greedy", "stream", p0, schedule="packed", chunk=4)
    add("stream-packed-t0.7", "stream", p1, schedule="packed", chunk=4, **_sampled("t0.7"))
    add("stream-packed-greedy-stop", "stream", p0, schedule="packed", chunk=3,
        stop_sequences=STOPS[model])
    # Continuous batching: four prompts through two slots.
    add("continuous-packed-greedy", "continuous", prompts, schedule="packed", slots=2, every=4)
    add("continuous-packed-t0.7", "continuous", prompts, schedule="packed", slots=2, every=4,
        **{**SAMPLERS["t0.7"][0], "seed": [8, 9, 10, 11]})

# Stop markers per model, each reached by the greedy decode of the first prompt or the
# sampled one of the second: token-id markers for the fixtures, strings for the embedded
# models (across token boundaries), and for one of them strings and ids together.
STOPS: dict[str, list] = {
    "nemotron-fixture": [[300, 14], [16, 101], [240]],
    "setdlm-fixture": [[93, 36], [199]],
    "nld-tiny": [" 12 eggs", "beads.", "or None"],
    "setdlm-tiny": ["6 more", [224, 25], "= 40"],
}
# An EOS id other than the config's, one that the sampled decode of the second prompt reaches.
EOS = {"nemotron-fixture": 265, "setdlm-fixture": 182, "nld-tiny": 355, "setdlm-tiny": 202}


# The cases the test suite runs (`python -m pytest`): on each model, Packed-SS greedy and
# sampled, and on the embedded models every call (batch, stream, queue) and a stop on the
# reference schedule. The whole matrix runs with the long checks (`python -m pytest
# --long-checks -m long_check`, a step of CI's own after the suite).
SUITE = frozenset(
    [f"{m}-packed-{k}" for m in EMBEDDED + ("nemotron-fixture",)
     for k in ("greedy", "t0.9-k40-p0.95")]
    + [f"{m}-{k}" for m in EMBEDDED for k in ("batch-packed-t0.7", "stream-packed-t0.7",
                                                 "continuous-packed-t0.7")]
    + ["nld-tiny-ar-greedy-stop", "setdlm-tiny-serial-greedy-stop",
       "setdlm-fixture-packed-greedy", "setdlm-fixture-packed-confidence",
       "nemotron-fixture-nolora-packed-greedy", "nemotron-fixture-nolora-packed-t0.7"])


def cases() -> list[Case]:
    """Every golden case, grouped by model (cases of one model share its programs)."""
    out = []
    for model in MODELS:
        out += _cases_of(model, full=model != "nemotron-fixture-nolora")
    ids = [c.id for c in out]
    assert len(set(ids)) == len(ids), "golden case ids must be unique"
    assert SUITE <= set(ids), f"SUITE names no case: {sorted(SUITE - set(ids))}"
    return out


CASES = cases()


def release() -> None:
    """Lets go of the models no longer held, and with the last engine of one its compiled
    programs (the engines hold at most `programs.max_programs()` in all)."""
    import gc

    gc.collect()


def load(name: str):
    """The model a case names (after `release`: drop the previous one first)."""
    import packed_ss_jax as ps

    release()
    path, kwargs = MODELS[name]
    return ps.load(path, **kwargs)


def record(result) -> dict:
    """What a DecodeResult pins: every deterministic output (not its timings)."""
    import numpy as np

    r = {"tokens": [int(t) for t in result.tokens], "nfe": int(result.nfe),
         "iterations": int(result.iterations),
         "accept_hist": [int(n) for n in np.asarray(result.accept_hist).ravel()],
         "finish_reason": result.finish_reason, "text": result.text,
         "stop_at": None if result.stop_at is None else int(result.stop_at)}
    if result.rows is not None:  # SetDLM's row accounting
        r["rows"], r["max_rows"] = int(result.rows), int(result.max_rows)
    return r


STATS = ("round_trips", "refills", "steps", "refill_calls", "forward_calls")


def run(case: Case, model) -> dict:
    """Runs one case on `model` (loaded from `case.model`) and returns its record."""
    import packed_ss_jax as ps

    options = dict(case.options)
    if case.call == "decode":
        return record(ps.decode(model, case.prompt, **options))
    if case.call == "batch":
        return {"results": [record(r) for r in ps.decode(model, case.prompt, **options)]}
    if case.call == "stream":
        chunks = list(ps.stream(model, case.prompt, **options))
        texts = [c.text for c in chunks]
        return {"stream_tokens": [int(t) for c in chunks for t in c.tokens],
                "stream_text": None if texts[-1] is None else "".join(t or "" for t in texts),
                "chunk_sizes": [len(c.tokens) for c in chunks],
                "result": record(chunks[-1].result)}
    if case.call == "continuous":
        results, stats = ps.decode_continuous(model, case.prompt, **options)
        return {"results": [record(r) for r in results],
                "stats": {k: int(getattr(stats, k)) for k in STATS}}
    raise ValueError(f"unknown call {case.call!r}")


def first_difference(expected, got, path: str = "") -> str | None:
    """The first field (in the stored order) where `got` differs from `expected`, as
    "path: expected ..., got ...", or None when they are equal."""
    if isinstance(expected, dict) and isinstance(got, dict):
        for key in list(expected) + [k for k in got if k not in expected]:
            where = f"{path}.{key}" if path else key
            if key not in got:
                return f"{where}: missing (expected {expected[key]!r})"
            if key not in expected:
                return f"{where}: not in the golden record (got {got[key]!r})"
            diff = first_difference(expected[key], got[key], where)
            if diff is not None:
                return diff
        return None
    if (isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got)
            and any(isinstance(e, (dict, list)) for e in expected)):
        for i, (e, g) in enumerate(zip(expected, got)):
            diff = first_difference(e, g, f"{path}[{i}]")
            if diff is not None:
                return diff
        return None
    if expected != got or type(expected) is not type(got):
        return f"{path}: expected {expected!r}, got {got!r}"
    return None


def read(path: Path = GOLDEN) -> dict:
    return json.loads(path.read_text())


def _dump(data: dict) -> str:
    """One line per case, so that a change shows as the cases it changes."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    cases_ = [f"    {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
              for k, v in data["cases"].items()]
    return "{\n" + "\n".join(lines) + '\n  "cases": {\n' + ",\n".join(cases_) + "\n  }\n}\n"


def _setup() -> None:
    """The test suite's numerics (tests/conftest.py): full-precision float32 matmuls and
    the same XLA flags, set before JAX starts its backend; no persistent cache."""
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                     "--xla_backend_optimization_level=0"]))
    os.environ["PACKED_SS_COMPILE_CACHE"] = "off"
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


def write(path: Path = GOLDEN, log=print) -> dict:
    import jax

    import packed_ss_jax as ps

    if jax.default_backend() != "cpu":
        raise SystemExit("golden decodes are written on the CPU (JAX_PLATFORMS=cpu)")
    out, models, t0 = {}, {}, time.perf_counter()
    for case in CASES:
        if case.model not in models:
            models.clear()
            models[case.model] = load(case.model)
        t = time.perf_counter()
        out[case.id] = {"input": case.describe(), "output": run(case, models[case.model])}
        log(f"{case.id}: {time.perf_counter() - t:.1f} s")
    data = {"about": "python -m tools.golden --write; see tools/golden.py",
            "package": ps.__version__, "jax": jax.__version__, "backend": "cpu",
            "matmul_precision": "highest", "cases": out}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(_dump(data))
    tmp.replace(path)
    log(f"wrote {len(out)} cases to {path} ({path.stat().st_size} bytes) "
        f"in {time.perf_counter() - t0:.0f} s")
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.golden",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="run every case and write the file")
    ap.add_argument("--out", type=Path, default=GOLDEN, help=f"default {GOLDEN.relative_to(ROOT)}")
    ap.add_argument("--list", action="store_true", help="print the case ids")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(c.id for c in CASES))
        return 0
    if not args.write:
        ap.error("nothing to do: pass --write (or --list)")
    _setup()
    write(args.out.absolute())
    return 0


if __name__ == "__main__":
    sys.exit(main())
