"""`Shape`: a schedule at a width with k branches, the one value that names what a decode
program speculates with. A `Program` holds one, `schedule="auto"` chooses among them (its
candidates), and a result reports the one it ran."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Shape:
    """A schedule at the family's width, B for Nemotron (1 for AR), W for SetDLM (1 for
    serial); `branches` is Branched-SS's k (1 for every other schedule)."""

    schedule: str
    width: int = 1
    branches: int = 1

    def label(self, family) -> str:
        """As results and the server name it: "ar", "packed B=8", "branched B=8 k=2"."""
        if self.schedule == family.reference:
            return self.schedule
        k = f" k={self.branches}" if self.schedule == "branched" else ""
        return f"{self.schedule} {family.width_symbol}={self.width}{k}"

    def options(self, family) -> dict:
        """The `DecodeOptions` fields that select it (the reference takes no width, and
        only Branched-SS takes branches)."""
        out = {"schedule": self.schedule}
        if self.schedule != family.reference:
            out["width"] = self.width
        if self.schedule == "branched":
            out["branches"] = self.branches
        return out

    def to_json(self) -> list:
        return [self.schedule, self.width, self.branches]

    @classmethod
    def from_json(cls, data) -> Shape:
        schedule, width, branches = data
        if not isinstance(schedule, str) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 1
                for x in (width, branches)):
            raise ValueError(f"not a shape: {data!r}")
        return cls(schedule, width, branches)
