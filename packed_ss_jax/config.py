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
    # Precision of every matmul (see `model.MATMUL_PRECISIONS`): "default" follows
    # `jax.default_matmul_precision` (TF32 for float32 operands on GPUs), "highest" gives
    # full float32 products.
    matmul_precision: str = "default"

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


def _base_config(base) -> dict[str, Any]:
    if isinstance(base, Mapping):
        return dict(base)
    return read_hf_config(base)


def setdlm_from_hf(cfg: Mapping[str, Any], dtype: str = "float32",
                   base_config: Mapping[str, Any] | str | Path | None = None) -> ModelConfig:
    """Reads a SetDLM (BD3LM-style) `config.json`; the Qwen3 dims come from elsewhere.

    The released configs name their backbone (`backbone_config.pretrained_model_name_or_path`)
    instead of carrying its dimensions, so they come from `base_config` (that model's
    config.json: a dict, a file or a directory) or, failing that, from an embedded
    `qwen3_config`. Only the first `backbone_config.num_layers` layers are kept, as the
    release's loader does. The vocabulary is sized from the backbone (the embedding rows),
    never from the top-level `vocab_size`, which is the tokenizer length.
    """
    where = "SetDLM config.json"
    archs = [str(a).lower() for a in cfg.get("architectures") or []]
    if archs and not any("setdlm" in a for a in archs):
        raise ConfigError(f"{where}: architectures {cfg.get('architectures')} is not SetDLM "
                          "(other BD3LM-style models are not supported)")
    backbone = dict(cfg.get("backbone_config") or {})
    if base_config is not None:
        qwen = _base_config(base_config)
    elif cfg.get("qwen3_config"):
        qwen = dict(cfg["qwen3_config"])
    else:
        name = backbone.get("pretrained_model_name_or_path", "<unnamed>")
        raise ConfigError(
            f"{where} names its backbone {name!r} (backbone_config.pretrained_model_name_or_path) "
            "but does not carry its dimensions: pass base_config= the config.json of that model "
            "(a path to the file or its directory, or a dict)")
    bwhere = "SetDLM backbone (Qwen3) config"
    if qwen.get("model_type", "qwen3") != "qwen3":
        raise ConfigError(f"{bwhere}: model_type {qwen.get('model_type')!r}, expected 'qwen3'")
    if qwen.get("rope_scaling") or (qwen.get("rope_parameters") or {}).get("rope_type",
                                                                          "default") != "default":
        raise ConfigError(f"{bwhere}: only plain RoPE is supported (rope_scaling must be null)")
    hidden = int(_require(qwen, "hidden_size", bwhere))
    heads = int(_require(qwen, "num_attention_heads", bwhere))
    base_layers = int(_require(qwen, "num_hidden_layers", bwhere))
    layers = int(backbone.get("num_layers") or base_layers)
    if not 1 <= layers <= base_layers:
        raise ConfigError(f"{where}: backbone_config.num_layers {layers} must be in "
                          f"[1, {base_layers}] (the base model's layers)")
    if backbone.get("keep_top_layers"):
        raise ConfigError(f"{where}: backbone_config.keep_top_layers is not supported")
    tok = dict(cfg.get("tokenization_config") or {})
    mask_id = cfg.get("mask_token_id", tok.get("mask_token_id"))
    if mask_id is None:
        raise ConfigError(f"{where} has no mask_token_id: the drafter needs a MASK token")
    rope_theta = qwen.get("rope_theta", (qwen.get("rope_parameters") or {}).get("rope_theta"))
    # The noise schedule's desired block size is the window the checkpoint was tuned for.
    window = int((cfg.get("noise_config") or {}).get("desired_block_size") or 8)
    return ModelConfig(
        family="setdlm",
        vocab_size=int(_require(qwen, "vocab_size", bwhere)),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(qwen.get("num_key_value_heads") or heads),
        head_dim=int(qwen.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(qwen, "intermediate_size", bwhere)),
        rms_norm_eps=float(qwen.get("rms_norm_eps", 1e-6)),
        mask_token_id=int(mask_id),
        eos_token_id=_first_id(cfg.get("eos_token_id", tok.get("eos_token_id"))),
        bos_token_id=_first_id(cfg.get("bos_token_id", tok.get("bos_token_id"))),
        block_size=window,
        max_position_embeddings=int(qwen.get("max_position_embeddings") or 4096),
        rope_theta=float(rope_theta if rope_theta is not None else 1e6),
        rope_type="default",
        qk_norm=True,
        tie_embeddings=bool(qwen.get("tie_word_embeddings", True)),
        dtype=dtype,
    )


def from_hf_config(cfg: Mapping[str, Any], dtype: str = "float32",
                   base_config: Mapping[str, Any] | str | Path | None = None) -> ModelConfig:
    """Dispatches on `model_type`; other families get a clear error.

    `base_config` (SetDLM only) supplies the backbone dimensions, see `setdlm_from_hf`.
    """
    model_type = cfg.get("model_type")
    if model_type == NEMOTRON_MODEL_TYPE:
        if base_config is not None:
            raise ConfigError("base_config is only used for SetDLM checkpoints")
        return nemotron_from_hf(cfg, dtype)
    if model_type == SETDLM_MODEL_TYPE:
        return setdlm_from_hf(cfg, dtype, base_config)
    raise ConfigError(
        f"unsupported model_type {model_type!r}: expected {NEMOTRON_MODEL_TYPE!r} "
        f"(a Nemotron-Labs-Diffusion checkpoint) or {SETDLM_MODEL_TYPE!r} (SetDLM)")

