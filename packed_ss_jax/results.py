"""What a decode gives back: `DecodeResult`, read from a program's outcome, and the
error a loop that met NaN or Inf logits ends with (`NonFiniteError`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from . import stops
from .options import Request


@dataclasses.dataclass
class DecodeResult:
    tokens: list[int]        # generated ids, prompt excluded, EOS / stop marker included
    nfe: int                 # forward passes, prompt processing included
    iterations: int          # decoder iterations, the first call included
    accept_hist: np.ndarray  # accept_hist[k]: iterations that appended (kept) k tokens
    wall_s: float            # decoder wall time (synchronised; compile excluded)
    compile_s: float         # compile time paid by this call (0 when already compiled)
    schedule: str
    prompt_len: int
    drafts: int              # W: draft tokens per iteration (0 for the one-token reference)
    block_size: int | None = None  # Nemotron: the block size B = W + 1 (None for SetDLM)
    window: int | None = None      # SetDLM: the window W (None for Nemotron)
    text: str | None = None
    family: str = "nemotron"
    order: str = "ltr"
    # SetDLM accounting (Table 2): uncached rows evaluated after the prompt call, the most
    # rows in one call; and per iteration the verification order pi_t, A_t, and the
    # accepted tokens left to feed as clean rows next call. None / empty for Nemotron.
    rows: int | None = None
    max_rows: int | None = None
    orders: list = dataclasses.field(default_factory=list)
    accepted: list = dataclasses.field(default_factory=list)
    fed: list = dataclasses.field(default_factory=list)
    # "stop" (EOS, a stop marker or stop string), or "length" (max_new_tokens reached).
    finish_reason: str = "length"
    # Where the stop string that ended the output begins in `text` (None: no text stop);
    # text[:stop_at] is the output without it.
    stop_at: int | None = None
    branches: int = 1        # Branched-SS's k (1 for every other schedule)
    # schedule "auto": what it chose and the tokens/s it predicted (None otherwise).
    auto: dict | None = None

    @property
    def width(self) -> int:
        """The family's width: B for Nemotron, W for SetDLM."""
        return self.block_size if self.block_size is not None else self.window

    @property
    def tokens_per_nfe(self) -> float:
        return len(self.tokens) / self.nfe

    @property
    def time_per_nfe_ms(self) -> float:
        return 1e3 * self.wall_s / self.nfe

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("inf")


class NonFiniteError(FloatingPointError, ValueError):
    """The decode loop read NaN or Inf logits and stopped: the model's weights or the
    prompt's embeddings hold non-finite numbers. `tokens` holds the tokens generated
    before that point (each chosen from finite logits)."""

    def __init__(self, iteration: int, position: int, tokens: list[int]):
        self.iteration, self.position, self.tokens = iteration, position, tokens
        super().__init__(
            f"non-finite logits (NaN or Inf) in decoder iteration {iteration}, at generated "
            f"position {position}: the model's weights or the prompt's embeddings hold NaN "
            f"or Inf, so decoding stopped there ({position} tokens generated before it)")

    def __reduce__(self):
        return type(self), (self.iteration, self.position, self.tokens)


def check_finite(nonfinite_at, iterations, tokens) -> None:
    """Raises NonFiniteError if the loop stopped on non-finite logits (`nonfinite_at`:
    the generated position, -1 when every logits row it read was finite). With a leading
    sample axis (vmapped decodes), for the first sample that stopped."""
    at = np.asarray(nonfinite_at)
    if at.ndim:
        bad = np.flatnonzero(at >= 0)
        if bad.size:
            i = bad[0]
            check_finite(at[i], np.asarray(iterations)[i], np.asarray(tokens)[i])
        return
    if at >= 0:
        raise NonFiniteError(int(iterations), int(at), [int(t) for t in np.asarray(tokens)[:at]])


def _setdlm_trace(out: dict, iters: int) -> dict:
    if "rows" not in out:
        return {}
    return dict(rows=int(out["rows"]), max_rows=int(out["max_rows"]),
                orders=[[int(o) for o in row if o >= 0] for row in out["trace_order"][:iters]],
                accepted=[int(a) for a in out["trace_accepted"][:iters]],
                fed=[int(f) for f in out["trace_fed"][:iters]])


def of_outcome(model, family, request: Request, out: dict, wall_s: float,
               compile_s: float, final: int | None = None) -> DecodeResult:
    """The DecodeResult of one decode's outcome (host arrays), every path's: NonFiniteError
    if the loop met NaN/Inf logits; `final` cuts the output to the tokens handed out so far
    (a decode ended on the host before its loop stopped). Why the loop stopped was decided
    in the loop (`stopped`: a stop marker, EOS among them); a stop given as text may still
    end the output earlier, wherever the decoded text spells it."""
    check_finite(out["nonfinite_at"], out["iterations"], out["tokens"])
    p = request.program
    iters = int(out["iterations"])
    count = int(out["n_tokens"]) if final is None else final
    tokens = np.asarray(out["tokens"])[:count].tolist()
    tokenizer = getattr(model, "tokenizer", None)
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    finish = "stop" if bool(out["stopped"]) else "length"
    stop_at = None
    cut = (stops.cut_text(tokenizer.decode, tokens, request.stop_texts)
           if text and request.stop_texts else None)
    if cut is not None:
        tokens, text, stop_at = cut
        finish = "stop"
    # W, the drafts per iteration: Nemotron's width B counts the verified token x too.
    W = p.width - 1 if family.width_counts_x else p.width
    widths = {family.width_name: p.width}
    return DecodeResult(
        tokens=tokens, nfe=int(out["nfe"]), iterations=iters,
        accept_hist=np.asarray(out["accept_hist"]), wall_s=wall_s, compile_s=compile_s,
        schedule=p.schedule, prompt_len=len(request.prompt), drafts=W, text=text,
        family=family.name, order=p.order, finish_reason=finish, stop_at=stop_at,
        branches=p.branches, auto=request.auto, **widths, **_setdlm_trace(out, iters))
