"""Model configuration: one frozen, hashable dataclass per checkpoint.

The config is a static argument of every jitted function, so it must be
hashable; it is written down once here, with the readers of each family's Hugging
Face `config.json` (`nemotron_from_hf`, `setdlm_from_hf`; `families.parse_hf_config`
picks one by `model_type`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

NEMOTRON_MODEL_TYPE = "nemotron_labs_diffusion"
SETDLM_MODEL_TYPE = "bd3lm"
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


_INT_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "mask_token_id", "block_size", "max_position_embeddings",
               "rope_original_max_position", "lora_rank")
_OPTIONAL_INT_FIELDS = ("eos_token_id", "bos_token_id")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "rope_factor", "rope_beta_fast", "rope_beta_slow",
                 "rope_mscale", "rope_mscale_all_dim", "llama4_scaling_beta", "lora_alpha")
_BOOL_FIELDS = ("qk_norm", "tie_embeddings")
_STR_FIELDS = ("family", "rope_type", "dtype")


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
        self._normalise_types()
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "block_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config field {name} must be >= 1, got {getattr(self, name)}")
        for name in ("rope_original_max_position", "lora_rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config field {name} must be >= 0, got {getattr(self, name)}")
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

    def _normalise_types(self):
        """Every field of its declared type (NumPy scalars become Python ones): the config
        is hashed into every compiled program, and a string or a bool in a size would
        fail far from here."""
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INT_FIELDS:
                continue
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise ConfigError(f"config field {name} must be an integer, got {value!r}")
            put(name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                             np.floating)):
                raise ConfigError(f"config field {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(f"config field {name} must be finite, got {value!r}")
            put(name, float(value))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ConfigError(f"config field {name} must be true or false, got {value!r}")
            put(name, bool(value))
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"config field {name} must be a string, "
                                  f"got {getattr(self, name)!r}")

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
        if not isinstance(d, Mapping):
            raise ConfigError(f"a ModelConfig is read from a mapping of its fields, got "
                              f"{type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in d and f.default is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"ModelConfig fields missing: {missing}")
        return cls(**d)


# --- reading config.json fields -------------------------------------------------------------
# Each field is read by one of these helpers, which name the field and the file when the
# value is missing, null where a value is needed, or of the wrong type. JSON null (or an
# absent key) takes the default where there is one, as transformers does.

REQUIRED = object()


class ConfigFile(dict):
    """The contents of a config.json, remembering the file it came from (for messages)."""

    file: Path | None = None


class Section(dict):
    """A nested object of a config, remembering its path (for messages)."""

    prefix: str = ""


def _name(cfg: Mapping[str, Any], key: str) -> str:
    return getattr(cfg, "prefix", "") + key


def where(cfg: Mapping[str, Any], label: str) -> str:
    """How messages name a config: its label and, when known, its file."""
    file = getattr(cfg, "file", None)
    return f"{label} ({file})" if file is not None else label


def _show(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _get(cfg: Mapping[str, Any], key: str, place: str, default, kind: str, error):
    value = cfg.get(key)
    if value is None and default is REQUIRED:
        if key in cfg:
            raise error(f"{place}: field {_name(cfg, key)!r} is null; it must be {kind}")
        raise error(f"{place} is missing the field {_name(cfg, key)!r}")
    return value


def int_field(cfg: Mapping[str, Any], key: str, place: str, default: Any = REQUIRED, *,
              minimum: int | None = None, error: type[Exception] = ConfigError):
    """cfg[key] as an int (`default` when absent or null). Integral floats (4096.0, as some
    writers emit) are accepted; fractions, strings and booleans are not."""
    value = _get(cfg, key, place, default, "an integer", error)
    if value is None:
        return default
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{place}: field {_name(cfg, key)!r} must be an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise error(f"{place}: field {_name(cfg, key)!r} must be >= {minimum}, got {value}")
    return int(value)


def float_field(cfg: Mapping[str, Any], key: str, place: str, default: Any = REQUIRED, *,
                positive: bool = False, error: type[Exception] = ConfigError):
    """cfg[key] as a finite float (`default` when absent or null)."""
    value = _get(cfg, key, place, default, "a number", error)
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)) \
            or not math.isfinite(value):
        raise error(f"{place}: field {_name(cfg, key)!r} must be a finite number, "
                    f"got {_show(value)}")
    if positive and value <= 0:
        raise error(f"{place}: field {_name(cfg, key)!r} must be > 0, got {value}")
    return float(value)


def bool_field(cfg: Mapping[str, Any], key: str, place: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{place}: field {_name(cfg, key)!r} must be true or false, "
                          f"got {_show(value)}")
    return value


def section(cfg: Mapping[str, Any], key: str, place: str) -> Section:
    """A nested object (an empty one when absent or null)."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"{place}: field {_name(cfg, key)!r} must be an object, "
                          f"got {_show(value)}")
    out = Section(value or {})
    out.prefix = _name(cfg, key) + "."
    return out


def _first_id(cfg: Mapping[str, Any], key: str, place: str) -> int | None:
    """A token id that may be written as a list of ids (the first is used)."""
    value = cfg.get(key)
    if isinstance(value, (list, tuple)):
        if not value:
            return None
        first = Section({key: value[0]})
        first.prefix = getattr(cfg, "prefix", "")
        return int_field(first, key, place, minimum=0)
    return int_field(cfg, key, place, None, minimum=0)


def require_object(cfg, place: str) -> None:
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{place} must be a JSON object ({{...}}), got {type(cfg).__name__}")


def nemotron_from_hf(cfg: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """Reads a Nemotron-Labs-Diffusion `config.json` (Ministral-3 backbone)."""
    place = where(cfg, "Nemotron-Labs-Diffusion config.json")
    require_object(cfg, place)
    hidden = int_field(cfg, "hidden_size", place, minimum=1)
    heads = int_field(cfg, "num_attention_heads", place, minimum=1)
    # Ministral-3 decouples head_dim from hidden/heads (the 3B model maps 3072 -> 4096).
    head_dim = int_field(cfg, "head_dim", place, None) or hidden // heads
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = section(cfg, rope_key, place)
    rope_theta = float_field(rope, "rope_theta", place, None, positive=True)
    if rope_theta is None:
        rope_theta = float_field(cfg, "rope_theta", place, 1e6, positive=True)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{place}: unsupported rope_type {_show(rope_type)}")
    mask_id = cfg.get("mask_token_id")
    if mask_id is None:
        raise ConfigError(f"{place} has no mask_token_id: the drafter needs a MASK token")
    return ModelConfig(
        family="nemotron",
        vocab_size=int_field(cfg, "vocab_size", place, minimum=1),
        hidden_size=hidden,
        num_layers=int_field(cfg, "num_hidden_layers", place, minimum=1),
        num_heads=heads,
        num_kv_heads=int_field(cfg, "num_key_value_heads", place, None) or heads,
        head_dim=head_dim,
        intermediate_size=int_field(cfg, "intermediate_size", place, minimum=1),
        rms_norm_eps=float_field(cfg, "rms_norm_eps", place, 1e-5, positive=True),
        mask_token_id=int_field(cfg, "mask_token_id", place, minimum=0),
        eos_token_id=_first_id(cfg, "eos_token_id", place),
        bos_token_id=_first_id(cfg, "bos_token_id", place),
        # The default block size of the speculative schedules: B >= 2.
        block_size=int_field(cfg, "block_size", place, None, minimum=2) or 32,
        max_position_embeddings=int_field(cfg, "max_position_embeddings", place, None,
                                          minimum=1) or 4096,
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_factor=float_field(rope, "factor", place, 1.0, positive=True),
        rope_original_max_position=int_field(rope, "original_max_position_embeddings", place,
                                             0, minimum=0),
        rope_beta_fast=float_field(rope, "beta_fast", place, 32.0),
        rope_beta_slow=float_field(rope, "beta_slow", place, 1.0),
        rope_mscale=float_field(rope, "mscale", place, None) or 1.0,
        rope_mscale_all_dim=float_field(rope, "mscale_all_dim", place, None) or 1.0,
        llama4_scaling_beta=float_field(rope, "llama_4_scaling_beta", place, 0.0),
        qk_norm=False,
        tie_embeddings=bool_field(cfg, "tie_word_embeddings", place, False),
        dtype=dtype,
    )


def read_hf_config(path: str | Path) -> ConfigFile:
    """A config.json (the file, or the directory holding it) as a dict; a clear error when
    it is missing, unreadable, not UTF-8, not JSON or not a JSON object."""
    path = Path(path)
    # A directory holds its config.json; one named *.json was meant as the file itself.
    file = path / "config.json" if path.is_dir() and path.suffix != ".json" else path
    if file.is_dir():
        raise ConfigError(f"{file} is a directory, not a config file")
    if not file.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        cfg = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {file}: {e.strerror or e}") from None
    require_object(cfg, str(file))
    out = ConfigFile(cfg)
    out.file = file
    return out


def _base_config(base) -> dict[str, Any]:
    if isinstance(base, Mapping):
        return base
    if not isinstance(base, (str, Path)):
        raise ConfigError(f"base_config must be a dict or the path of a config.json, got "
                          f"{type(base).__name__}")
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
    place = where(cfg, "SetDLM config.json")
    require_object(cfg, place)
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise ConfigError(f"{place}: field 'architectures' must be a list, got {_show(archs)}")
    if archs and not any("setdlm" in str(a).lower() for a in archs):
        raise ConfigError(f"{place}: architectures {cfg.get('architectures')} is not SetDLM "
                          "(other BD3LM-style models are not supported)")
    backbone = section(cfg, "backbone_config", place)
    if base_config is not None:
        qwen = _base_config(base_config)
        bplace = where(qwen, "SetDLM backbone (Qwen3) config")
        require_object(qwen, bplace)
    elif cfg.get("qwen3_config"):
        qwen = section(cfg, "qwen3_config", place)
        bplace = place
    else:
        name = backbone.get("pretrained_model_name_or_path", "<unnamed>")
        raise ConfigError(
            f"{place} names its backbone {name!r} (backbone_config.pretrained_model_name_or_path) "
            "but does not carry its dimensions: pass base_config= the config.json of that model "
            "(a path to the file or its directory, or a dict)")
    if qwen.get("model_type", "qwen3") != "qwen3":
        raise ConfigError(f"{bplace}: model_type {qwen.get('model_type')!r}, expected 'qwen3'")
    rope = section(qwen, "rope_parameters", bplace)
    if qwen.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{bplace}: only plain RoPE is supported (rope_scaling must be null)")
    hidden = int_field(qwen, "hidden_size", bplace, minimum=1)
    heads = int_field(qwen, "num_attention_heads", bplace, minimum=1)
    base_layers = int_field(qwen, "num_hidden_layers", bplace, minimum=1)
    layers = int_field(backbone, "num_layers", place, None) or base_layers
    if not 1 <= layers <= base_layers:
        raise ConfigError(f"{place}: backbone_config.num_layers {layers} must be in "
                          f"[1, {base_layers}] (the base model's layers)")
    if backbone.get("keep_top_layers"):
        raise ConfigError(f"{place}: backbone_config.keep_top_layers is not supported")
    tok = section(cfg, "tokenization_config", place)
    in_cfg = "mask_token_id" in cfg
    mask_id = int_field(cfg if in_cfg else tok, "mask_token_id", place, None, minimum=0)
    if mask_id is None:
        raise ConfigError(f"{place} has no mask_token_id: the drafter needs a MASK token")
    rope_theta = float_field(qwen, "rope_theta", bplace, None, positive=True)
    if rope_theta is None:
        rope_theta = float_field(rope, "rope_theta", bplace, 1e6, positive=True)
    noise = section(cfg, "noise_config", place)
    # The noise schedule's desired block size is the window the checkpoint was tuned for.
    window = int_field(noise, "desired_block_size", place, None, minimum=1) or 8

    def token_id(key):
        if key in cfg:
            return _first_id(cfg, key, place)
        return _first_id(tok, key, place)

    return ModelConfig(
        family="setdlm",
        vocab_size=int_field(qwen, "vocab_size", bplace, minimum=1),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int_field(qwen, "num_key_value_heads", bplace, None) or heads,
        head_dim=int_field(qwen, "head_dim", bplace, None) or hidden // heads,
        intermediate_size=int_field(qwen, "intermediate_size", bplace, minimum=1),
        rms_norm_eps=float_field(qwen, "rms_norm_eps", bplace, 1e-6, positive=True),
        mask_token_id=mask_id,
        eos_token_id=token_id("eos_token_id"),
        bos_token_id=token_id("bos_token_id"),
        block_size=window,
        max_position_embeddings=int_field(qwen, "max_position_embeddings", bplace, None,
                                          minimum=1) or 4096,
        rope_theta=rope_theta,
        rope_type="default",
        qk_norm=True,
        tie_embeddings=bool_field(qwen, "tie_word_embeddings", bplace, True),
        dtype=dtype,
    )
