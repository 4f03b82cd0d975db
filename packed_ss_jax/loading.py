"""`load`: a Hugging Face Nemotron-Labs-Diffusion or SetDLM directory, or a converted one -> Model."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from . import model as model_lib
from .checkpoints import nemotron, setdlm, store
from .checkpoints.errors import CheckpointError
from .config import DTYPES, ConfigError, ModelConfig, from_hf_config, read_hf_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A config, its params and (optionally) a tokenizer: what `decode` and `logits` take."""

    config: ModelConfig
    params: Any             # kept in the decoding layout (see `model.unstack_layers`)
    tokenizer: Any = None
    source: str | None = None

    def __post_init__(self):
        # Params arrive in the stored layout (checkpoints, training); the decode programs
        # read each layer's weights from their own buffers, so split them once, here.
        if self.params is not None:
            object.__setattr__(self, "params", model_lib.unstack_layers(self.params))

    @property
    def stored_params(self):
        """The params in the stored layout (`layers` stacked), as checkpoints hold them."""
        return model_lib.stack_layers(self.params)

    @property
    def key(self):
        """Identifies the compiled code: programs depend on the config, not on the weights."""
        return ("transformer", self.config)

    @property
    def mask_id(self) -> int:
        return self.config.mask_token_id

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, params, tokens, positions, mask, cache, cache_len, draft_rows=None,
                out_rows=None):
        return model_lib.forward(self.config, params, tokens, positions, mask, cache, cache_len,
                                 draft_rows, out_rows)

    def empty_cache(self, size: int):
        return model_lib.empty_cache(self.config, size)

    def __repr__(self):
        c = self.config
        n = sum(x.size for x in jax.tree.leaves(self.params))
        return (f"Model({c.family}, {n / 1e6:.2f}M params, {c.num_layers} layers, "
                f"vocab {c.vocab_size}, {c.dtype}, lora={'on' if c.lora_rank else 'off'}, "
                f"source={self.source!r})")


def _tokenizer(path: Path):
    file = path / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def hf_config(path: Path, dtype: str, lora: bool | None, base_config=None) -> ModelConfig:
    config = from_hf_config(read_hf_config(path), dtype, base_config)
    if config.family == "setdlm":
        if lora:
            raise CheckpointError("lora=True: SetDLM checkpoints have no draft-only adapter")
        return config
    adapter = nemotron.lora_config(path)
    if lora and adapter is None:
        raise CheckpointError(f"lora=True but {path} has no {nemotron.LORA_DIR}/ adapter")
    if adapter is not None and lora is not False:
        config = config.replace(lora_rank=adapter[0], lora_alpha=adapter[1])
    return config


def read_weights(path: Path, config: ModelConfig, progress: bool = False) -> dict:
    """The params of a Hugging Face directory of either family, as NumPy arrays."""
    reader = setdlm if config.family == "setdlm" else nemotron
    return reader.read(path, config, progress=progress)


EMBEDDED = Path(__file__).resolve().parent / "embedded" / "nld-tiny"


def load(path: str | Path | None = None, dtype: str = "float32", lora: bool | None = None,
         progress: bool = False, base_config=None, verify: bool = True) -> Model:
    """Loads a checkpoint directory.

    path:  None (default) loads the small model shipped inside the package (`EMBEDDED`,
           trained by `python -m packed_ss_jax.training`); otherwise a Hugging Face
           Nemotron-Labs-Diffusion directory (config.json + safetensors, optional
           `linear_spec_lora/`), a SetDLM directory (BD3LM-style config.json +
           pytorch_model.bin or safetensors) or a directory written by `convert`.
    base_config: SetDLM only: the config.json (path or dict) of the Qwen3 base model that
           `backbone_config.pretrained_model_name_or_path` names, when the checkpoint's
           config.json does not carry the backbone dimensions itself.
    dtype: "float32" (CPU, parity) or "bfloat16" (GPU).
    lora:  None uses the draft-only adapter when the checkpoint has one; True requires
           it; False ignores it. The adapter only ever touches drafting rows.
    verify: converted directories only: compare each array with the SHA-256 recorded at
           conversion (about 0.6 s per GiB per core, ~10 s single-core for an 8B bfloat16
           checkpoint; arrays are hashed in parallel). False skips it. Hugging Face
           directories are always checked for NaN/Inf while they are read.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    path = EMBEDDED if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint path {path} is not a directory")
    if store.is_converted(path):
        config = store.read_config(path).replace(dtype=dtype)
        if lora is False and config.lora_rank:
            raise ConfigError("this converted checkpoint includes its adapter; reconvert with "
                              "lora=False to drop it")
        if lora and not config.lora_rank:
            raise CheckpointError(f"lora=True but {path} was converted without an adapter")
        params = store.restore(path, config, verify=verify)
    else:
        config = hf_config(path, dtype, lora, base_config)
        params = jax.tree.map(jnp.asarray, read_weights(path, config, progress=progress))
    return Model(config=config, params=params, tokenizer=_tokenizer(path), source=str(path))
