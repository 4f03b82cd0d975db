"""The model families: the one table the loader, the API, the CLI, the bench and the
evaluator ask.

A family is its config parser, its checkpoint reader, its schedules and the decode
program that runs them, the name of its width argument and the request options it
takes. Adding a family (or a schedule) means its own folder plus one entry here; every
entry point and the shared test matrix pick it up from `FAMILIES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from . import config as config_lib
from .nemotron import checkpoint as nemotron_checkpoint
from .nemotron import config as nemotron_config
from .nemotron import layouts as nemotron_layouts
from .nemotron import program as nemotron_program
from .setdlm import checkpoint as setdlm_checkpoint
from .setdlm import config as setdlm_config
from .setdlm import layouts as setdlm_layouts
from .setdlm import program as setdlm_program
from .setdlm import schedules as setdlm_schedules


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                  # ModelConfig.family
    title: str                 # for messages
    model_type: str            # config.json's model_type
    schedules: tuple[str, ...]
    reference: str             # one token per call: the output every exact schedule reproduces
    inexact: tuple[str, ...]   # schedules whose greedy output may differ from the reference
    sampled: tuple[str, ...]   # the schedules that sample (temperature > 0)
    orders: tuple[str, ...]    # verification orders; the first is the default
    orderless: tuple[str, ...]  # schedules that verify nothing, so take no order
    width_name: str            # the request argument that sets the width ("block_size", "window")
    width_symbol: str          # the paper's letter for it ("B", "W")
    min_width: int
    # The width B = W + 1 counts x with the W drafts (Nemotron); a window counts W alone.
    width_counts_x: bool
    parse_config: Callable[..., config_lib.ModelConfig]  # (cfg, dtype, base_config)
    read_weights: Callable[..., dict]  # (path, config, progress) -> params
    # The draft-only adapter's folder and reader (path -> (rank, alpha) or None), if any.
    adapter_dir: str | None
    read_adapter: Callable | None
    # (model, program) -> Loop (loop.py): run(params, prompt, prompt_len, limits, key) ->
    # outcome, and its parts the batched paths run (init, step, outcome, progress).
    build: Callable[[Any, Any], Any]
    # (tokens [T], config) -> (Call, rows [T]): one verifier forward over a whole sequence
    # whose row rows[i] gives the left-to-right distribution of token i (i >= 1), to score
    # it (log-probabilities, the same under every schedule).
    score: Callable[[Any, Any], Any]
    # (schedule, width, branches) -> the rows of each call of one loop iteration.
    iteration_rows: Callable[..., tuple[int, ...]]

    def width(self, schedule: str, requested: int) -> int:
        """The program's width: the request's, or 1 for the one-token reference."""
        return 1 if schedule == self.reference else requested


NEMOTRON = Family(
    name="nemotron", title="Nemotron-Labs-Diffusion", model_type=nemotron_config.MODEL_TYPE,
    schedules=tuple(nemotron_program.SCHEDULES), reference="ar", inexact=(),
    sampled=tuple(nemotron_program.SCHEDULES), orders=("ltr",), orderless=("ar",),
    width_name="block_size", width_symbol="B", min_width=2, width_counts_x=True,
    parse_config=nemotron_config.from_hf, read_weights=nemotron_checkpoint.read,
    adapter_dir=nemotron_checkpoint.LORA_DIR, read_adapter=nemotron_checkpoint.lora_config,
    build=nemotron_program.build, score=lambda tokens, c: nemotron_layouts.score(tokens),
    iteration_rows=nemotron_program.iteration_rows)

SETDLM = Family(
    name="setdlm", title="SetDLM", model_type=setdlm_config.MODEL_TYPE,
    schedules=tuple(setdlm_schedules.SCHEDULES), reference="serial",
    inexact=("native",),  # the release's threshold decoder: not a speculative schedule
    sampled=setdlm_schedules.SAMPLED, orders=setdlm_program.ORDERS,
    orderless=("serial", "native"), width_name="window", width_symbol="W", min_width=1, width_counts_x=False,
    parse_config=setdlm_config.from_hf,
    read_weights=setdlm_checkpoint.read, adapter_dir=None, read_adapter=None,
    build=setdlm_program.build,
    score=lambda tokens, c: setdlm_layouts.score(tokens, c.mask_token_id),
    iteration_rows=setdlm_program.iteration_rows)

FAMILIES: dict[str, Family] = {f.name: f for f in (NEMOTRON, SETDLM)}


def of(config) -> Family:
    """The family of a ModelConfig (or of anything with a `.config`)."""
    name = getattr(getattr(config, "config", config), "family", None)
    if name not in FAMILIES:
        raise config_lib.ConfigError(f"unknown model family {name!r}; expected one of "
                                     f"{sorted(FAMILIES)}")
    return FAMILIES[name]


def parse_hf_config(cfg, dtype: str = "float32", base_config=None) -> config_lib.ModelConfig:
    """A Hugging Face config.json (a dict from `config.read_hf_config`) -> ModelConfig,
    read by the family its `model_type` names; other model types get a clear error.

    `base_config` (SetDLM only) supplies the backbone dimensions, see `setdlm.config.from_hf`.
    """
    config_lib.require_object(cfg, config_lib.where(cfg, "config.json"))
    model_type = cfg.get("model_type")
    family = next((f for f in FAMILIES.values() if f.model_type == model_type), None)
    if family is None:
        expected = ", ".join(f"{f.model_type!r} ({f.name})" for f in FAMILIES.values())
        raise config_lib.ConfigError(f"unsupported model_type {model_type!r}: expected {expected}")
    return family.parse_config(cfg, dtype, base_config)


def all_schedules() -> list[str]:
    """Every schedule name of every family, each once, in table order."""
    return list(dict.fromkeys(s for f in FAMILIES.values() for s in f.schedules))
