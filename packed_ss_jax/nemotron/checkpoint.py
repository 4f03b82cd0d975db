"""Nemotron-Labs-Diffusion Hugging Face checkpoints -> params.

Layout: `config.json`, `model.safetensors` or shards with `model.safetensors.index.json`,
names under `encoder.` with an untied `diffusion_head`, and an optional PEFT adapter in
`linear_spec_lora/` (o_proj only) that the drafter uses and the verifier never does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import model as model_lib
from ..checkpoints.assemble import Entry, assemble, decoder_table, merge
from ..checkpoints.errors import CheckpointError
from ..checkpoints.safetensors_io import SafetensorsDir
from ..config import ConfigError, ModelConfig, float_field, int_field, read_hf_config

LORA_DIR = "linear_spec_lora"
LORA_PREFIX = "base_model.model.encoder.layers.{i}.self_attn.o_proj"


def table(c: ModelConfig) -> list[Entry]:
    return decoder_table(c, "encoder.embed_tokens.weight", "encoder.layers.{i}.",
                         "encoder.norm.weight", "diffusion_head.weight")


def _ignored(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # a recomputed buffer some exports keep


def lora_config(path: Path) -> tuple[int, float] | None:
    """(rank, alpha) of a `linear_spec_lora/` adapter, or None when there is none."""
    cfg_file = path / LORA_DIR / "adapter_config.json"
    if not cfg_file.exists():
        return None
    try:
        cfg = read_hf_config(cfg_file)
    except ConfigError as e:
        raise CheckpointError(f"adapter config: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    targets = cfg.get("target_modules") or []
    if targets != ["o_proj"]:
        raise CheckpointError(f"{cfg_file}: target_modules {targets} unsupported; expected ['o_proj']")
    if cfg.get("use_dora") or cfg.get("use_rslora"):
        raise CheckpointError(f"{cfg_file}: DoRA / rsLoRA adapters are not supported")
    rank = int_field(cfg, "r", str(cfg_file), minimum=1, error=CheckpointError)
    alpha = float_field(cfg, "lora_alpha", str(cfg_file), error=CheckpointError)
    return rank, alpha


def _lora_table() -> list[Entry]:
    return [Entry(("layers", "attn", "lora_a"), LORA_PREFIX + ".lora_A.weight", True, layer=True),
            Entry(("layers", "attn", "lora_b"), LORA_PREFIX + ".lora_B.weight", True, layer=True)]


def _np_dtype(c: ModelConfig):
    import ml_dtypes
    return ml_dtypes.bfloat16 if c.dtype == "bfloat16" else np.float32


def read(path: str | Path, c: ModelConfig, progress: bool = False, place=None) -> dict:
    """Reads the base weights (and the adapter when `c.lora_rank`) into a params tree in
    the decoding layout, one tensor at a time; `place` (e.g. `jax.device_put`) takes
    each array as it is read (see `assemble`)."""
    path = Path(path)
    abstract = model_lib.abstract_params(c)
    params = assemble(table(c), abstract, c.num_layers, SafetensorsDir(path), _np_dtype(c),
                      ignore=_ignored, label="weights", progress=progress, place=place)
    if c.lora_rank:
        adapter = SafetensorsDir(path / LORA_DIR, "adapter_model.safetensors")
        merge(params, assemble(_lora_table(), abstract, c.num_layers, adapter, _np_dtype(c),
                               label="adapter", progress=progress, place=place))
    return params
