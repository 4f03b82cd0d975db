"""Model configuration: one frozen, hashable dataclass per checkpoint.

The config is a static argument of every jitted function, so it must be
hashable; it is written down once here and read from a Hugging Face
`config.json` by `from_hf_config`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

NEMOTRON_MODEL_TYPE = "nemotron_labs_diffusion"
SETDLM_MODEL_TYPE = "bd3lm"
FAMILIES = ("nemotron", "setdlm")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    mask_token_id: int
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    block_size: int = 32
    max_position_embeddings: int = 4096
    # RoPE. `rope_type` is "default" (plain) or "yarn".
    rope_theta: float = 1e6
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    # Llama-4 query scale 1 + beta * ln(1 + floor(pos / original_max)); 0 disables it.
    llama4_scaling_beta: float = 0.0
    qk_norm: bool = False
    tie_embeddings: bool = False
    # Draft-only LoRA on o_proj (rank 0: no adapter).
    lora_rank: int = 0
    lora_alpha: float = 0.0
    dtype: str = "float32"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"config field {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(f"unsupported rope type {self.rope_type!r}; expected 'default' or 'yarn'")

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {unknown}")
        return cls(**d)


def _first_id(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return int(value)


def _require(cfg: Mapping[str, Any], key: str, where: str):
    if key not in cfg:
        raise ConfigError(f"{where} is missing the field {key!r}")
    return cfg[key]


def nemotron_from_hf(cfg: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """Reads a Nemotron-Labs-Diffusion `config.json` (Ministral-3 backbone)."""
    where = "Nemotron-Labs-Diffusion config.json"
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    # Ministral-3 decouples head_dim from hidden/heads (the 3B model maps 3072 -> 4096).
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 1e6)))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{where}: unsupported rope_type {rope_type!r}")
    mask_id = cfg.get("mask_token_id")
    if mask_id is None:
        raise ConfigError(f"{where} has no mask_token_id: the drafter needs a MASK token")
    return ModelConfig(
        family="nemotron",
        vocab_size=int(_require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        num_layers=int(_require(cfg, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(_require(cfg, "intermediate_size", where)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        mask_token_id=int(mask_id),
        eos_token_id=_first_id(cfg.get("eos_token_id")),
        bos_token_id=_first_id(cfg.get("bos_token_id")),
        block_size=int(cfg.get("block_size") or 32),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings", 0) or 0),
        rope_beta_fast=float(rope.get("beta_fast", 32.0)),
        rope_beta_slow=float(rope.get("beta_slow", 1.0)),
        rope_mscale=float(rope.get("mscale", 1.0) or 1.0),
        rope_mscale_all_dim=float(rope.get("mscale_all_dim", 1.0) or 1.0),
        llama4_scaling_beta=float(rope.get("llama_4_scaling_beta", 0.0) or 0.0),
        qk_norm=False,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype,
    )


def read_hf_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None


def from_hf_config(cfg: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """Dispatches on `model_type`; other families get a clear error."""
    model_type = cfg.get("model_type")
    if model_type == NEMOTRON_MODEL_TYPE:
        return nemotron_from_hf(cfg, dtype)
    raise ConfigError(
        f"unsupported model_type {model_type!r}: expected {NEMOTRON_MODEL_TYPE!r} "
        "(a Nemotron-Labs-Diffusion checkpoint)")

