"""Model configuration: one frozen, hashable dataclass per checkpoint.

The config is a static argument of every jitted function, so it must be hashable; it
is written down once here, with what every family's config reader shares: the field
readers that name the field and the file in their errors (`int_field`, `section`, ...),
`read_hf_config` and `build_config`. Each family reads its own Hugging Face
`config.json` in its folder (`nemotron/config.py`, `setdlm/config.py`);
`families.parse_hf_config` picks the reader by `model_type`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


class FieldError(ConfigError):
    """A ModelConfig field out of its range. `problem` may name other fields as "{0}",
    "{1}", ... (`refs`), so that a config.json reader can say the field names its file
    uses (see `build_config`)."""

    def __init__(self, field: str, problem: str, refs: tuple[str, ...] = ()):
        self.field, self.problem, self.refs = field, problem, refs
        super().__init__(f"config field {field} {self.describe(str)}")

    def describe(self, name) -> str:
        """The problem, each referenced field spelled by `name(field)`."""
        text = self.problem
        for i, ref in enumerate(self.refs):
            text = text.replace(f"{{{i}}}", name(ref))
        return text


# Sizes, token ids and positions are int32 in every program (and in NumPy's shapes long
# before they would overflow int64); a larger integer is refused here, not by XLA.
INT_MAX = 2 ** 31 - 1
# Every float of a config ends up in a float32 computation: beyond this it is Inf.
FLOAT_MAX = float(np.finfo(np.float32).max)
# rms_norm_eps below this rounds to 0 (or a subnormal flushed to 0) in float32, and an
# all-zero row then normalises to NaN.
FLOAT_TINY = float(np.finfo(np.float32).tiny)
# The smallest block (Nemotron: B = W + 1 >= 2) or window (SetDLM: W >= 1) each family's
# schedules run with; `families.Family.min_width` says the same.
MIN_BLOCK = {"nemotron": 2, "setdlm": 1}
ROPE_TYPES = ("default", "yarn")
# The names of `model.MATMUL_PRECISIONS` (which maps them to JAX's precisions).
MATMUL_PRECISION_NAMES = ("default", "high", "highest")


_INT_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "mask_token_id", "block_size", "max_position_embeddings",
               "rope_original_max_position", "lora_rank")
_OPTIONAL_INT_FIELDS = ("eos_token_id", "bos_token_id")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "rope_factor", "rope_beta_fast", "rope_beta_slow",
                 "rope_mscale", "rope_mscale_all_dim", "llama4_scaling_beta", "lora_alpha")
_BOOL_FIELDS = ("qk_norm", "tie_embeddings")
_STR_FIELDS = ("family", "rope_type", "dtype", "matmul_precision")


_NUMBERS = (int, float, np.integer, np.floating)


def _id_in_vocab(c: "ModelConfig", name: str):
    value = getattr(c, name)
    if value is not None and not 0 <= value < c.vocab_size:
        raise FieldError(name, f"{value} is outside the vocabulary of {c.vocab_size} ({{0}})",
                         ("vocab_size",))


def check_token_ids(c: "ModelConfig") -> None:
    """Raises FieldError unless the eos and bos ids are rows of the vocabulary: required of
    a config read from a checkpoint (the MASK id always is: ModelConfig checks it). A
    ModelConfig built in code may name an eos outside it; a decode request then says so
    (see validate.py)."""
    for name in ("eos_token_id", "bos_token_id"):
        _id_in_vocab(c, name)


def _finite(value) -> bool:
    """Whether a number is finite as a float (an int past float64's range is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _in_range(name: str, value: int, minimum: int):
    if not minimum <= value <= INT_MAX:
        raise FieldError(name, f"must be an integer in [{minimum}, {INT_MAX}], got {value}")


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
        if self.family not in MIN_BLOCK:
            raise FieldError("family", f"must be one of {sorted(MIN_BLOCK)}, got {self.family!r}")
        if self.rope_type not in ROPE_TYPES:
            raise FieldError("rope_type", f"must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.matmul_precision not in MATMUL_PRECISION_NAMES:
            raise FieldError("matmul_precision", f"must be one of {MATMUL_PRECISION_NAMES}, "
                             f"got {self.matmul_precision!r}")
        self._check_sizes()
        self._check_token_ids()
        self._check_floats()
        self._check_rope()

    def _check_sizes(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            _in_range(name, getattr(self, name), 1)
        for name in ("rope_original_max_position", "lora_rank"):
            _in_range(name, getattr(self, name), 0)
        if self.num_heads % self.num_kv_heads:
            raise FieldError("num_heads", f"must be a multiple of {{0}} ({self.num_kv_heads}), "
                             f"got {self.num_heads}", ("num_kv_heads",))
        if self.head_dim % 2:
            raise FieldError("head_dim", f"must be even for RoPE, got {self.head_dim}")
        # The schedules run blocks of at least MIN_BLOCK tokens, and a block must fit in
        # the positions the model has.
        _in_range("block_size", self.block_size, MIN_BLOCK[self.family])
        if self.block_size > self.max_position_embeddings:
            raise FieldError("block_size", f"must be <= {{0}} ({self.max_position_embeddings}), "
                             f"got {self.block_size}", ("max_position_embeddings",))

    def _check_token_ids(self):
        _id_in_vocab(self, "mask_token_id")
        for name in ("eos_token_id", "bos_token_id"):
            _in_range(name, getattr(self, name) or 0, 0)

    def _check_floats(self):
        for name in _FLOAT_FIELDS:
            if abs(getattr(self, name)) > FLOAT_MAX:
                raise FieldError(name, f"must be within float32 range (|x| <= {FLOAT_MAX:.7g}), "
                                 f"got {getattr(self, name)!r}")
        if not FLOAT_TINY <= self.rms_norm_eps <= 1:
            # Past 1 the epsilon outweighs the activations' own scale: the norm outputs ~0.
            raise FieldError("rms_norm_eps", f"must be in [{FLOAT_TINY:.7g}, 1] (a positive "
                             f"normal float32, not past 1), got {self.rms_norm_eps!r}")
        # Negative: a query scale that reaches 0 and flips sign at long positions.
        beta = self.llama4_scaling_beta
        if beta < 0:
            raise FieldError("llama4_scaling_beta", f"must be >= 0, got {beta!r}")

    def _check_rope(self):
        # At or below 1 the frequencies theta^(-2i/d) do not decrease, and YaRN divides by
        # log(theta).
        if self.rope_theta <= 1:
            raise FieldError("rope_theta", f"must be > 1, got {self.rope_theta!r}")
        if self.rope_factor <= 0:
            raise FieldError("rope_factor", f"must be > 0, got {self.rope_factor!r}")
        # YaRN takes log(beta * 2 pi): both > 0, and its ramp runs from fast to slow.
        for name in ("rope_beta_fast", "rope_beta_slow"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.rope_beta_fast < self.rope_beta_slow:
            raise FieldError("rope_beta_fast", f"must be >= {{0}} ({self.rope_beta_slow!r}), "
                             f"got {self.rope_beta_fast!r}", ("rope_beta_slow",))
        # YaRN's attention factor divides by 0.1 * mscale_all_dim * log(factor) + 1.
        for name in ("rope_mscale", "rope_mscale_all_dim"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"must be >= 0, got {getattr(self, name)!r}")
        # Both take log(pos / original_max) or floor(pos / original_max): 0 is no length.
        scaled = self.rope_type == "yarn" and self.rope_factor > 1
        if scaled and not self.rope_original_max_position:
            raise FieldError("rope_original_max_position", "must be >= 1 for YaRN scaling "
                             f"({{0}} {self.rope_factor!r}), got 0", ("rope_factor",))
        if self.llama4_scaling_beta and not self.rope_original_max_position:
            raise FieldError("rope_original_max_position", "must be >= 1 for the Llama-4 query "
                             f"scale ({{0}} {self.llama4_scaling_beta!r}), got 0",
                             ("llama4_scaling_beta",))

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
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, _NUMBERS):
                raise ConfigError(f"config field {name} must be a number, got {value!r}")
            if not _finite(value):
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


def field_name(cfg: Mapping[str, Any], key: str) -> str:
    """A key as messages spell it: with the path of the section it sits in."""
    return getattr(cfg, "prefix", "") + key


def where(cfg: Mapping[str, Any], label: str) -> str:
    """How messages name a config: its label and, when known, its file."""
    file = getattr(cfg, "file", None)
    return f"{label} ({file})" if file is not None else label


def show(value) -> str:
    """A value as messages show it: as JSON when it is JSON."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _get(cfg: Mapping[str, Any], key: str, place: str, default, kind: str, error):
    value = cfg.get(key)
    if value is None and default is REQUIRED:
        if key in cfg:
            raise error(f"{place}: field {field_name(cfg, key)!r} is null; it must be {kind}")
        raise error(f"{place} is missing the field {field_name(cfg, key)!r}")
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
        raise error(f"{place}: field {field_name(cfg, key)!r} must be an integer, "
                    f"got {show(value)}")
    if minimum is not None and value < minimum:
        raise error(f"{place}: field {field_name(cfg, key)!r} must be >= {minimum}, got {value}")
    if value > INT_MAX:
        raise error(f"{place}: field {field_name(cfg, key)!r} must be <= {INT_MAX} (int32), "
                    f"got {value}")
    return int(value)


def float_field(cfg: Mapping[str, Any], key: str, place: str, default: Any = REQUIRED, *,
                positive: bool = False, error: type[Exception] = ConfigError):
    """cfg[key] as a finite float within float32 range (`default` when absent or null)."""
    value = _get(cfg, key, place, default, "a number", error)
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, _NUMBERS) \
            or not _finite(value):
        raise error(f"{place}: field {field_name(cfg, key)!r} must be a finite number, "
                    f"got {show(value)}")
    if abs(value) > FLOAT_MAX:
        raise error(f"{place}: field {field_name(cfg, key)!r} must be within float32 range "
                    f"(|x| <= {FLOAT_MAX:.7g}), got {show(value)}")
    if positive and value <= 0:
        raise error(f"{place}: field {field_name(cfg, key)!r} must be > 0, got {value}")
    return float(value)


def bool_field(cfg: Mapping[str, Any], key: str, place: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{place}: field {field_name(cfg, key)!r} must be true or false, "
                          f"got {show(value)}")
    return value


def section(cfg: Mapping[str, Any], key: str, place: str) -> Section:
    """A nested object (an empty one when absent or null)."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"{place}: field {field_name(cfg, key)!r} must be an object, "
                          f"got {show(value)}")
    out = Section(value or {})
    out.prefix = field_name(cfg, key) + "."
    return out


def first_id(cfg: Mapping[str, Any], key: str, place: str) -> int | None:
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
    """Raises ConfigError unless `cfg` is a JSON object."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{place} must be a JSON object ({{...}}), got {type(cfg).__name__}")


def build_config(origin: dict[str, tuple[str, str]], place: str, **fields) -> ModelConfig:
    """ModelConfig(**fields), a field out of its range named as its config.json spells it:
    `origin` maps a ModelConfig field to (the file's label, the key path read)."""
    def spelled(field: str) -> str:
        return repr(origin.get(field, (place, field))[1])

    try:
        config = ModelConfig(**fields)
        check_token_ids(config)
        return config
    except FieldError as e:
        at, key = origin.get(e.field, (place, e.field))
        raise ConfigError(f"{at}: field {key!r} {e.describe(spelled)}") from None


def read_head_dim(cfg, place: str, hidden: int, heads: int) -> int:
    """head_dim, or hidden_size / num_attention_heads when absent (which must divide)."""
    head_dim = int_field(cfg, "head_dim", place, None, minimum=1)
    if head_dim is not None:
        return head_dim
    if hidden % heads:
        raise ConfigError(f"{place}: field {field_name(cfg, 'hidden_size')!r} ({hidden}) must "
                          f"be a multiple of {field_name(cfg, 'num_attention_heads')!r} "
                          f"({heads}) when {field_name(cfg, 'head_dim')!r} is not given")
    return hidden // heads


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
