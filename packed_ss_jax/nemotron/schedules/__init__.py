"""One pure step per Nemotron schedule (AR, Linear-SS, Quadratic-SS, Packed-SS)."""
