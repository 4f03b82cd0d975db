"""What one decoding call costs on the device at hand, so that a schedule's speed can be
predicted before it is run (tokens per second = tokens per call / seconds per call).

`calibrate` times the model's forward at a grid of row counts and cache sizes;
`CostModel.call_s(rows, positions)` interpolates between the points. The cache size is the
buffer's, not the live length: a call attends over the whole buffer (the committed positions
are masked, not sliced). `load_or_calibrate` keeps one calibration per device kind, JAX
version, dtype and model shape (`calibration_id`) on disk and measures anew whatever it
cannot trust. The grid, the folder and how close the predictions come:
docs/performance.md#predicting-a-calls-cost.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from . import compile_cache
from .calls import causal

ENV = "PACKED_SS_COST_DIR"
ROWS = (1, 8, 32, 128)      # the calibration's row counts
POSITIONS = (256, 2048)     # and cache sizes (capped at the model's context)
MIN_RUN_S = 0.02            # a timed loop of calls lasts about this long
MAX_REPEAT = 4096           # calls in one timed loop at most
RUNS = 5                    # timed loops per point: their median is kept
UNSTABLE = 0.25             # a point whose runs spread past this share of their median
                            # is measured again, longer; if it stays so, the calibration
                            # is unstable, and says so
VERSION = 1                 # of the file's layout
MAX_FILE_BYTES = 1 << 20    # a calibration file holds a few kB: a larger one is not one

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per call at each (cache size, rows) grid point, for one `calibration_id`."""

    calibration_id: str
    rows: tuple[int, ...]
    positions: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]   # [len(positions)][len(rows)]
    calibration_s: float = 0.0               # what measuring it took
    spread: float = 0.0                      # the widest spread of a point's runs
    load: float | None = None                # load average per core when it was measured

    @property
    def unstable(self) -> bool:
        return self.spread > UNSTABLE

    def __post_init__(self):
        rows, positions = list(self.rows), list(self.positions)
        if (rows != sorted(set(rows)) or positions != sorted(set(positions))
                or not rows or not positions or min(rows[0], positions[0]) < 1):
            raise ValueError("rows and positions must be increasing positive integers")
        if (len(self.seconds) != len(self.positions)
                or any(len(r) != len(self.rows) for r in self.seconds)
                or not all(math.isfinite(s) and s > 0 for r in self.seconds for s in r)):
            raise ValueError("seconds must be one positive number per (positions, rows) point")

    def call_s(self, rows: int, positions: int) -> float:
        """Predicted seconds of one call of `rows` rows over a cache of `positions` positions
        (past the grid, between the nearest point's and that scaled by the rows or positions:
        `_between`)."""
        by_positions = [_between(self.rows, r, rows) for r in self.seconds]
        # Extended below the grid a line can fall under zero: no call is cheaper than the
        # cheapest one measured.
        return max(_between(self.positions, by_positions, positions),
                   min(min(r) for r in self.seconds))

    def to_json(self) -> dict:
        # The file names the id "key" (its layout predates the name).
        data = dataclasses.asdict(self)
        return {"version": VERSION, "key": data.pop("calibration_id"), **data}

    @classmethod
    def from_json(cls, data) -> CostModel:
        """A CostModel from `to_json`'s dict; ValueError for anything else."""
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError("not a cost calibration of this version")
        try:
            load = data.get("load")
            return cls(str(data["key"]), tuple(int(x) for x in data["rows"]),
                       tuple(int(x) for x in _kv_positions(data)),
                       tuple(tuple(float(s) for s in r) for r in data["seconds"]),
                       float(data.get("calibration_s", 0.0)), float(data.get("spread", 0.0)),
                       None if load is None else float(load))
        except (KeyError, TypeError, OverflowError) as e:
            raise ValueError(f"a malformed cost calibration: {e}") from None


def _kv_positions(record: dict):
    """A record's KV positions: "positions", or "slots" as files written before the name
    said (read as they are, not measured anew)."""
    return record["positions"] if "positions" in record else record["slots"]


def _between(xs: tuple[int, ...], ys, x: float) -> float:
    """Piecewise-linear interpolation of ys over xs at x, extended along the end
    segments; a single point is a constant. Past the points a call costs at least what
    the nearest measured one did and at most that scaled by x (more rows or positions never
    cost less, nor more than in proportion): a line through two noisy points cannot
    carry a prediction further off than that."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    if x > xs[-1]:
        return min(max(y, ys[-1]), ys[-1] * x / xs[-1])
    if x < xs[0]:
        return min(max(y, ys[0] * x / xs[0]), ys[0])
    return y


def calibration_id(model) -> str:
    """What a calibration is valid for: the device kind and count, the JAX version, the
    matmul precision, the model's shape and its params' shapes and dtypes (a draft
    adapter, another dtype: another id)."""
    c = model.config
    shape = {k: v for k, v in dataclasses.asdict(c).items()
             if isinstance(v, (int, float, str, bool, type(None)))}
    params = sorted(f"{jax.tree_util.keystr(p)}:{x.shape}:{x.dtype}"
                    for p, x in jax.tree_util.tree_leaves_with_path(model.params))
    text = json.dumps({"device": jax.devices()[0].device_kind, "devices": jax.device_count(),
                       "jax": jax.__version__,
                       "precision": str(jax.config.jax_default_matmul_precision),
                       "shape": shape, "params": params}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def seconds_per_call(call, params, tokens, cache, repeat: int = 1) -> float:
    """Seconds per `call(params, tokens, cache) -> logits`: the median of `run_times`."""
    return statistics.median(run_times(call, params, tokens, cache, repeat))


def run_times(call, params, tokens, cache, repeat: int = 1, runs: int = RUNS) -> list:
    """Seconds per `call(params, tokens, cache) -> logits` in each of `runs` timed runs of
    one jitted loop of calls: at least `repeat` calls, and as many as make a run last
    about MIN_RUN_S (a small model's call takes microseconds, too short to time alone;
    a large one's a run of one). A first run compiles, untimed. Each call's input
    depends on the previous output, so XLA cannot hoist the call out of the loop."""

    @jax.jit
    def run(params, tokens, cache, n):
        def body(i, carry):
            tokens, acc = carry
            first = call(params, tokens, cache).reshape(-1)[0]
            flag = (first > 1e30).astype(tokens.dtype)
            return tokens.at[(0,) * tokens.ndim].add(flag), acc + first
        return jax.lax.fori_loop(0, n, body, (tokens, jnp.float32(0)))

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, tokens, cache, n))
        return time.perf_counter() - t0

    timed(repeat)   # compiles
    n, took = repeat, timed(repeat)
    while took < MIN_RUN_S / 2 and n < MAX_REPEAT:   # a run too short to time: longer
        n = min(MAX_REPEAT, math.ceil(n * MIN_RUN_S / max(took, 1e-6)))
        took = timed(n)
    return [took / n] + [timed(n) / n for _ in range(runs - 1)]


def time_call(model, rows: int, size: int, repeat: int = 1, runs: int = RUNS) -> list:
    """Seconds per call of `rows` causal rows after `size - rows` cached ones, over a
    cache of `size` positions (what a decoding call of that many rows costs), in each of
    `runs` timed runs."""
    live = size - rows
    positions = live + jnp.arange(rows, dtype=jnp.int32)
    mask, draft_rows = jnp.asarray(causal(rows)), jnp.zeros(rows, bool)

    def call(params, tokens, cache):
        return model.forward(params, tokens, positions, mask, cache, live, draft_rows)[0]

    return run_times(call, model.params, jnp.zeros(rows, jnp.int32), model.empty_cache(size),
                     repeat, runs)


def calibrate(model, rows=ROWS, positions=POSITIONS, repeat: int = 1) -> CostModel:
    """Times the model's call at every (cache size, rows) point: cache sizes are capped at
    the model's context, and row counts that do not fit the smallest size left out. Each
    point keeps the median of its runs; a point whose runs spread past UNSTABLE is
    measured again with twice the runs, and if it still does, one warning says so."""
    context = model.config.max_position_embeddings
    sizes = sorted({min(s, context) for s in positions})
    rows = sorted({r for r in rows if r < sizes[0]})
    if not rows:
        raise ValueError(f"no calibration row count fits a cache of {sizes[0]} positions")
    load, t0 = load_per_core(), time.perf_counter()
    points = {}
    for s in sizes:
        for r in rows:
            points[s, r] = _median_and_spread(time_call(model, r, s, repeat))
            if points[s, r][1] > UNSTABLE:
                points[s, r] = _median_and_spread(time_call(model, r, s, repeat, 2 * RUNS))
    (s, r), (_, spread) = max(points.items(), key=lambda p: p[1][1])
    measured = CostModel(calibration_id(model), tuple(rows), tuple(sizes),
                         tuple(tuple(points[s, r][0] for r in rows) for s in sizes),
                         time.perf_counter() - t0, spread, load)
    if measured.unstable:
        busy = "" if load is None else f"; load average {load:.2f} per core"
        log.warning(f"packed_ss_jax: the cost calibration is unstable (its timings of "
                    f"{r} rows over {s} positions spread {spread:.0%}{busy}): schedule auto "
                    "corrects it from the decodes that follow")
    return measured


def _median_and_spread(times: list) -> tuple[float, float]:
    """The runs' median, and their spread over it: from the second fastest to the second
    slowest (one stray run either way is not instability)."""
    times = sorted(times)
    inner = times[1:-1] if len(times) > 3 else times
    median = statistics.median(times)
    return median, (inner[-1] - inner[0]) / median


def load_per_core() -> float | None:
    """The 1-minute load average over the cores (None where the system has none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "packed_ss_jax" / "cost"


def folder(directory: str | os.PathLike | None = "default") -> Path | None:
    """Where calibrations are kept: `directory` ("default": `$PACKED_SS_COST_DIR`, else
    `default_dir()`), made if missing, when no other user can write to it (the checks
    of the compilation cache, compile_cache.trusted: else one warning); None: neither
    read nor written."""
    if directory == "default":
        directory = os.environ.get(ENV) or default_dir()
    if directory is None:
        return None
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass   # said by `trusted`, which cannot check it either
    return compile_cache.trusted(path, "the calibration folder", f"${ENV}",
                                 "measuring without keeping the measurement")


def read_json(path: Path):
    """The JSON in the calibration file `path` (None: there is none). ValueError naming
    why a file there is not read: not a regular file this user alone can write, larger
    than MAX_FILE_BYTES, or not JSON (RecursionError: nested past any use)."""
    try:   # a FIFO would block a plain open; a link is not followed
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"cannot be opened: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        try:
            info = os.fstat(f.fileno())
            if (problem := compile_cache.file_problem(info)) is not None:
                raise ValueError(problem)
            data = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise ValueError(f"cannot be read: {e.strerror or e}") from None
    if max(len(data), info.st_size) > MAX_FILE_BYTES:
        raise ValueError(f"{max(len(data), info.st_size)} bytes, over the bound of "
                         f"{MAX_FILE_BYTES}")
    return json.loads(data)


def load_or_calibrate(model, directory: str | os.PathLike | None = "default",
                      **calibration) -> CostModel:
    """The model's cost calibration from `directory` (see `folder`; None: neither read
    nor written), measured and stored when there is none for its id that can be
    trusted. `calibration`: `calibrate`'s keyword arguments, for a new measurement (a
    kept calibration is returned whatever grid it was measured at)."""
    wanted = calibration_id(model)
    where = folder(directory)
    path = None if where is None else where / f"{wanted}.json"
    try:
        data = None if path is None else read_json(path)
        if data is not None:
            found = CostModel.from_json(data)
            if found.calibration_id == wanted:
                return found
            log.warning("%s holds another model's calibration; measuring anew", path)
    except (ValueError, OverflowError, RecursionError) as e:   # JSONDecodeError is a
        # ValueError; a hostile file may nest or size its numbers past any use
        log.warning("%s is not a readable cost calibration (%s); measuring anew", path,
                    type(e).__name__ if isinstance(e, RecursionError) else e)
    measured = calibrate(model, **calibration)
    if path is not None:
        try:
            write_json(path, measured.to_json())
        except OSError as e:   # the measurement still serves this process
            log.warning("could not keep the cost calibration in %s: %s", path.parent, e)
    return measured


def write_json(path: Path, data) -> None:
    """Writes `data` as JSON atomically (a temporary file in the same folder, then
    renamed): an interrupted write leaves the old file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def predicted_tokens_per_s(cost: CostModel, tokens_per_call: float, rows: int,
                           positions: int) -> float:
    """Tokens per second of a schedule making `tokens_per_call` tokens per call of
    `rows` rows over `positions` cache positions."""
    return tokens_per_call / cost.call_s(rows, positions)

