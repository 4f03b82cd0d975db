"""Schedule "auto" in a server: the choice learnt and made again between launches.

The server decodes every slot with one program, so its choice is made for every slot
busy, on caches of `--max-model-len` (a width or branches given keep that width or k).
Each launch then reports its seconds per iteration to the model's
planner beside the prediction before corrections (feedback.py; the first timed launch of
an explored choice as explored), and each finished request its
tokens and iterations (the acceptance model's running tally: the server's own workload,
not the calibration prompts). Every `REPLAN_EVERY` launches the choice is made again;
when another candidate wins (past the planner's margin), the client readies its
programs on a thread of their own while the slots go on decoding, then lets the slots
empty and moves to it (client.py). Every candidate is exact: a greedy request gets the
same tokens whichever decodes it, a sampled one its seed's tokens with the schedule its
result reports.

It explores as a library decode does (feedback.explores: a few early choices, then one
in EXPLORE_EVERY), but a choice here is made every REPLAN_EVERY launches: a close
candidate not observed lately gets REPLAN_EVERY launches, at the price of two moves
(the slots emptied twice) and, the first time, its compile beside the slots.
"""

from __future__ import annotations

from .options import DecodeOptions
from .planner import AUTO, Choice, Planner

REPLAN_EVERY = 32   # launches between two choices


def _choice_options(max_model_len: int, width: dict | None, **sampling) -> DecodeOptions:
    return DecodeOptions(schedule=AUTO, cache_size=max_model_len, max_new_tokens=1,
                         **(width or {}), **sampling)


class ServingAuto:
    """What a server on "auto" learns and chooses (see the module doc). Made with the
    server; told of launches and finished requests on the decoder thread."""

    def __init__(self, model, max_model_len: int, width: dict | None, slots: int):
        self.planner = Planner.of(model)
        self.family = self.planner.family
        self.slots = slots
        # Every exact candidate samples, so a server on auto takes sampled requests: its
        # choices are made for them, and only among candidates that sample.
        self.options = _choice_options(max_model_len, width, temperature=1.0)
        self.choice: Choice = self.planner.choose(self.options, 1, slots, explore=False,
                                                   refilled=True)
        self.launches = 0   # since the last move
        self.timed = 0      # launches timed since the last move

    @property
    def summary(self) -> dict:
        return self.choice.summary(self.family)

    def launched(self, seconds: float, ran: int | None) -> Choice | None:
        """A launch that ran `ran` iterations of every slot took `seconds` (its calls and
        the read-back of its progress): reported (not when `ran` is None or 0: a launch
        beside a compile, or one that found every slot stopped). Every REPLAN_EVERY
        launches, the choice made again (free memory left out: the server's own state
        holds it; a move checks its own), and returned; None between."""
        p = self.choice.prediction
        if ran:
            self.planner.feedback.observe(p.candidate, self.choice.size, p.base_iteration_s,
                                          seconds / ran,
                                          explored=self.choice.explored and not self.timed)
            self.timed += 1
        self.launches += 1
        if self.launches % REPLAN_EVERY:
            return None
        choice = self.planner.choose(self.options, 1, self.slots, fits_now=False,
                                     refilled=True)
        if choice.candidate == self.choice.candidate:
            self.choice = choice   # the same candidate, predicted afresh
        return choice

    def moved(self, choice: Choice) -> None:
        """The slots now decode with `choice`: it gets REPLAN_EVERY launches before the
        next choice."""
        self.choice, self.launches, self.timed = choice, 0, 0

    def finished(self, result) -> None:
        """A request decoded with the current choice ended: its tokens and iterations join
        the acceptance tally of the kind the server chooses for (sampled), greedy or
        not: the server's own mix of requests is what its choice is for."""
        self.planner.acceptance.observe(self.choice.candidate, True, [result])
