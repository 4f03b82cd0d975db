"""One pure `step(state) -> state` per schedule, plus how each starts."""

from . import ar, linear, packed, quadratic
from .prefill import first_call, prefill

# name -> (first call, loop step). AR and Linear-SS start with a plain prefill;
# Packed-SS and Quadratic-SS draft a full block in their first call (App. E.2).
SCHEDULES = {
    "ar": (prefill, ar.step),
    "linear": (prefill, linear.step),
    "quadratic": (first_call, quadratic.step),
    "packed": (first_call, packed.step),
}
