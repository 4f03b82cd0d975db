"""Schedule "auto" in a server: the choice learnt and made again between launches.

The server decodes every slot with one program, so its choice is made for every slot
busy, on caches of `--max-model-len` (a width or branches given keep that width or k).
Each launch then reports its seconds per iteration to the model's
planner beside the cost model's prediction (feedback.py), and each finished request its
tokens and iterations (the acceptance model's running tally: the server's own workload,
not the calibration prompts). Every `REPLAN_EVERY` launches the choice is made again;
when another candidate wins (past the planner's margin), the client readies its
programs on a thread of their own while the slots go on decoding, then lets the slots
empty and moves to it (client.py). Every candidate is exact, so a request's tokens are
the same whichever decodes it.

It explores as a library decode does (feedback.py), one choice in EXPLORE_EVERY, but a
choice here is made every REPLAN_EVERY launches: a close candidate not observed lately is
tried for REPLAN_EVERY launches in EXPLORE_EVERY x REPLAN_EVERY, at the price of two
movements (the slots emptied twice) and, the first time, its compile beside the slots.
"""

from __future__ import annotations

from .options import DecodeOptions
from .planner import AUTO, Choice, Planner

REPLAN_EVERY = 32   # launches between two choices


def _options(max_model_len: int, width: dict | None, **sampling) -> DecodeOptions:
    return DecodeOptions(schedule=AUTO, cache_size=max_model_len, max_new_tokens=1,
                         **(width or {}), **sampling)


class ServingAuto:
    """What a server on "auto" learns and chooses (see the module doc). Used on the
    decoder thread only."""

    def __init__(self, model, max_model_len: int, width: dict | None, slots: int):
        self.planner = Planner.of(model)
        self.family = self.planner.family
        self.slots, self.width, self.max_model_len = slots, width, max_model_len
        self.options = _options(max_model_len, width)
        self.choice: Choice = self.planner.choose(self.options, 1, slots, explore=False)
        self.launches = 0

    def keep_sampling(self) -> None:
        """The server samples: later choices keep to candidates that sample (the requests
        it takes must not change with the choice)."""
        self.options = _options(self.max_model_len, self.width, temperature=1.0)

    @property
    def summary(self) -> dict:
        return self.choice.summary(self.family)

    def shape(self) -> dict:
        """The chosen candidate's schedule and shape, as the server's defaults hold them."""
        return self.choice.candidate.options(self.family)

    def launched(self, seconds: float, steps: int) -> Choice | None:
        """A launch of `steps` iterations of every slot took `seconds` (its calls and the
        read-back of its progress): reported. Every REPLAN_EVERY launches, the choice
        made again: returned when it is another candidate (None: stay)."""
        if steps <= 0:
            return None
        p = self.choice.prediction
        self.planner.feedback.observe(p.candidate, self.slots, p.base_iteration_s,
                                      seconds / steps)
        self.launches += 1
        if self.launches % REPLAN_EVERY:
            return None
        choice = self.planner.choose(self.options, 1, self.slots)
        if choice.candidate == self.choice.candidate:
            self.choice = choice   # the same candidate, predicted afresh
            return None
        return choice

    def moved(self, choice: Choice) -> None:
        """The slots now decode with `choice`."""
        self.choice = choice

    def finished(self, result, sampled: bool) -> None:
        """A request decoded with the current choice ended: its acceptance is tallied."""
        self.planner.acceptance.observe(self.choice.candidate, sampled, [result])
