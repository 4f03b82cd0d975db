"""`load`: a Hugging Face Nemotron-Labs-Diffusion or SetDLM directory, or a converted one -> Model."""

from __future__ import annotations

from pathlib import Path

import jax

from . import families, hub, sharding
from .checkpoints import store
from .checkpoints.errors import CheckpointError
from .config import DTYPES, ConfigError, ModelConfig, read_hf_config
from .model import MATMUL_PRECISIONS, Model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def _tokenizer(path: Path):
    """The tokenizer.json of a checkpoint directory (or the file itself), None if absent."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers binding raises its own exception types
        raise CheckpointError(f"{file} is not a readable tokenizer.json: {e}") from None


def hf_config(path: Path, dtype: str, lora: bool | None, base_config=None) -> ModelConfig:
    """The config of a Hugging Face directory, with its draft-only adapter when used."""
    config = families.parse_hf_config(read_hf_config(path), dtype, base_config)
    family = families.of(config)
    if family.read_adapter is None:
        if lora:
            raise CheckpointError(f"lora=True: {family.title} checkpoints have no draft-only "
                                  "adapter")
        return config
    adapter = family.read_adapter(path)
    if lora and adapter is None:
        raise CheckpointError(f"lora=True but {path} has no {family.adapter_dir}/ adapter")
    if adapter is not None and lora is not False:
        config = config.replace(lora_rank=adapter[0], lora_alpha=adapter[1])
    return config


def read_weights(path: Path, config: ModelConfig, progress: bool = False, place=None) -> dict:
    """The params of a Hugging Face directory in the decoding layout, read one tensor at a
    time by its family's reader: NumPy arrays, or what `place` (e.g. `jax.device_put`)
    makes of each as soon as it is read."""
    return families.of(config).read_weights(path, config, progress=progress, place=place)


EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
EMBEDDED_DEFAULT = "nld-tiny"
EMBEDDED = EMBEDDED_DIR / EMBEDDED_DEFAULT


def embedded_models() -> list[str]:
    """Names of the small models shipped inside the package (`load(name)`)."""
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").is_file())


def resolve(path: str | Path | None, revision: str | None = None) -> Path:
    """A checkpoint directory: `path`, the embedded model it names (None: the default), or
    the local snapshot of the Hugging Face hub checkpoint it names (`ORG/NAME[@REVISION]`,
    hub.py; `revision` applies to those only). An existing directory wins over either."""
    if path is None and revision is None:
        return EMBEDDED
    if isinstance(path, str) and not Path(path).exists():
        if path in embedded_models() and revision is None:
            return EMBEDDED_DIR / path
        if hub.is_hub_name(path):
            return hub.resolve(path, revision)
    if revision is not None:
        raise ConfigError(f"revision {revision!r} applies to a Hugging Face hub name "
                          f"(ORG/NAME), not to {path!r}")
    return Path(path)


def read_config(path: str | Path | None = None, dtype: str = "float32",
                base_config=None) -> ModelConfig:
    """The config of a checkpoint directory (or embedded model), without its weights."""
    path = _directory(path)
    if store.is_converted(path):
        return store.read_config(path).replace(dtype=dtype)
    return hf_config(path, dtype, None, base_config)


def _directory(path, revision: str | None = None) -> Path:
    path = resolve(path, revision)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint path {path} is not a directory")
    return path


def load(path: str | Path | None = None, dtype: str = "float32", lora: bool | None = None,
         progress: bool = False, base_config=None, verify: bool = True,
         tokenizer: str | Path | None = None, matmul_precision: str = "default",
         mesh=None, revision: str | None = None) -> Model:
    """Loads a checkpoint directory.

    path:  None (default) loads the small model shipped inside the package ("nld-tiny",
           trained by `python -m packed_ss_jax.training`); the name of an embedded model
           (`embedded_models()`) loads that one; otherwise a Hugging Face
           Nemotron-Labs-Diffusion directory (config.json + safetensors, optional
           `linear_spec_lora/`), a SetDLM directory (BD3LM-style config.json +
           pytorch_model.bin or safetensors) or a directory written by `convert`; or
           a Hugging Face hub id, "ORG/NAME" or "ORG/NAME@REVISION", when no such local
           directory exists: its files are fetched through huggingface_hub's cache
           (hub.py; offline with HF_HUB_OFFLINE=1) and read as that directory.
    revision: a hub checkpoint's branch, tag or commit (default: the one in the name,
           else "main").
    base_config: SetDLM only: the config.json (path or dict) of the Qwen3 base model that
           `backbone_config.pretrained_model_name_or_path` names, when the checkpoint's
           config.json does not carry the backbone dimensions itself.
    dtype: "float32" (CPU, parity) or "bfloat16" (GPU).
    lora:  None uses the draft-only adapter when the checkpoint has one; True requires
           it; False ignores it. The adapter only ever touches drafting rows.
    verify: converted directories only: compare each array, the config in
           packed_ss_config.json and the copied config.json with the SHA-256 recorded at
           conversion (about 0.6 s per GiB per core, ~10 s single-core for an 8B bfloat16
           checkpoint; arrays are hashed in parallel). False skips it. Hugging Face
           directories are always checked for NaN/Inf while they are read. Either kind's
           config is range-checked whatever `verify` says.
    tokenizer: a tokenizer.json (or a directory holding one) to use instead of the
           checkpoint's, e.g. the base model's for a SetDLM release that ships none.
    matmul_precision: "default" follows `jax.default_matmul_precision` (on GPUs float32
           operands then run as TF32; bfloat16 operands always accumulate in float32);
           "high" or "highest" ask for more (full float32 products: what the paper's
           FP32 SetDLM runs use). Part of the compiled programs' key.
    mesh:  a `jax.sharding.Mesh` with axes ("data", "model") (`sharding.make_mesh`): every
           weight is placed on its shards as it is read (tensor-parallel over "model", see
           sharding.RULES), each device receiving only its slice. Decoding the model then
           runs on the mesh, batches split over "data". From a Hugging Face directory
           each process reads, casts and checks only the slices its own devices hold
           (of safetensors only the file pages holding them; a torch `.bin` storage is
           read whole), so on a mesh spanning several processes a NaN/Inf is reported by
           the process that read it. A converted directory is read whole by every
           process (see `store.restore`), then each places only its devices' slices.
    """
    _check_options(dtype, matmul_precision)
    path = _directory(path, revision)
    if store.is_converted(path):
        config = _converted_config(path, dtype, lora)
        # Called from load itself: its missing-checksum warning (stacklevel) names the
        # caller of load.
        params = store.restore(path, config, verify=verify, progress=progress,
                               place=None if mesh is None else sharding.placer(config, mesh))
    else:
        config, params = _read_hugging_face(path, dtype, lora, base_config, progress, mesh)
    tok = _tokenizer(path) if tokenizer is None else _given_tokenizer(Path(tokenizer))
    config = config.replace(matmul_precision=matmul_precision)
    return Model(config=config, params=params, tokenizer=tok, source=str(path))


def _check_options(dtype: str, matmul_precision: str) -> None:
    """Refuses an unknown dtype or matmul precision before anything is read."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    if matmul_precision not in MATMUL_PRECISIONS:
        raise ConfigError(f"unknown matmul_precision {matmul_precision!r}; expected one of "
                          f"{tuple(MATMUL_PRECISIONS)}")


def _converted_config(path: Path, dtype: str, lora: bool | None) -> ModelConfig:
    """The config of a directory written by `convert`. Its adapter was decided at
    conversion, so a `lora` that asks otherwise is refused rather than ignored."""
    config = store.read_config(path).replace(dtype=dtype)
    if lora is False and config.lora_rank:
        raise ConfigError("this converted checkpoint includes its adapter; reconvert with "
                          "lora=False to drop it")
    if lora and not config.lora_rank:
        raise CheckpointError(f"lora=True but {path} was converted without an adapter")
    return config


def _read_hugging_face(path: Path, dtype: str, lora: bool | None, base_config, progress: bool,
                       mesh) -> tuple[ModelConfig, dict]:
    """(config, params) of a Hugging Face directory, each tensor placed on the device (or
    its shards on the mesh) as soon as it is read."""
    config = hf_config(path, dtype, lora, base_config)
    # Each tensor goes to the device as it is read (jax.device_put copies once;
    # jnp.asarray would copy twice), so loading holds one tensor besides the params.
    place = jax.device_put if mesh is None else sharding.placer(config, mesh)
    params = read_weights(path, config, progress=progress, place=place)
    return config, params


def _given_tokenizer(tokenizer: Path):
    """The tokenizer `load(tokenizer=...)` names: a tokenizer.json or a directory holding
    one, which must exist (unlike a checkpoint's own, which is optional)."""
    if not tokenizer.exists():
        raise FileNotFoundError(f"tokenizer {tokenizer} does not exist")
    tok = _tokenizer(tokenizer)
    if tok is None:
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer}")
    return tok
