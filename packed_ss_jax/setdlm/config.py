"""SetDLM's (BD3LM-style) `config.json` -> ModelConfig.

A released SetDLM config describes the denoiser around a Qwen3 backbone it names rather
than describes: the dimensions come from that backbone's own config.json (`base_config`)
or an embedded `qwen3_config`, the layers kept from `backbone_config.num_layers`, the
token ids from the top level or `tokenization_config`, and the window from the noise
schedule. The field readers (`packed_ss_jax.config`) name the field and the file in
every error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..config import (ConfigError, ModelConfig, bool_field, build_config, field_name,
                      first_id, float_field, int_field, read_head_dim, read_hf_config,
                      require_object, section, show, where)

MODEL_TYPE = "bd3lm"  # config.json's model_type


def _base_config(base) -> dict[str, Any]:
    if isinstance(base, Mapping):
        return base
    if not isinstance(base, (str, Path)):
        raise ConfigError(f"base_config must be a dict or the path of a config.json, got "
                          f"{type(base).__name__}")
    return read_hf_config(base)


def _backbone(cfg, place: str, base_config):
    """The Qwen3 config a SetDLM config's dimensions come from, and its label."""
    if base_config is not None:
        qwen = _base_config(base_config)
        bplace = where(qwen, "SetDLM backbone (Qwen3) config")
        require_object(qwen, bplace)
    elif cfg.get("qwen3_config"):
        qwen, bplace = section(cfg, "qwen3_config", place), place
    else:
        backbone = section(cfg, "backbone_config", place)
        name = backbone.get("pretrained_model_name_or_path", "<unnamed>")
        raise ConfigError(
            f"{place} names its backbone {name!r} (backbone_config.pretrained_model_name_or_path) "
            "but does not carry its dimensions: pass base_config= the config.json of that model "
            "(a path to the file or its directory, or a dict)")
    if qwen.get("model_type", "qwen3") != "qwen3":
        raise ConfigError(f"{bplace}: model_type {qwen.get('model_type')!r}, expected 'qwen3'")
    rope = section(qwen, "rope_parameters", bplace)
    if qwen.get("rope_scaling"):
        raise ConfigError(f"{bplace}: field {field_name(qwen, 'rope_scaling')!r} must be null: "
                          "only plain RoPE is supported, got "
                          f"{show(qwen.get('rope_scaling'))}")
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{bplace}: field {field_name(rope, 'rope_type')!r} must be "
                          "'default': only plain RoPE is supported, got "
                          f"{show(rope.get('rope_type'))}")
    return qwen, bplace


def _layers(cfg, place: str, qwen, bplace: str) -> int:
    """The layers kept: backbone_config.num_layers, at most the base model's."""
    base_layers = int_field(qwen, "num_hidden_layers", bplace, minimum=1)
    backbone = section(cfg, "backbone_config", place)
    layers = int_field(backbone, "num_layers", place, base_layers, minimum=1)
    if layers > base_layers:
        raise ConfigError(f"{place}: backbone_config.num_layers {layers} must be in "
                          f"[1, {base_layers}] (the base model's "
                          f"{field_name(qwen, 'num_hidden_layers')!r})")
    if backbone.get("keep_top_layers"):
        raise ConfigError(f"{place}: backbone_config.keep_top_layers is not supported")
    return layers


def _check_architectures(cfg, place: str) -> None:
    """Refuses a BD3LM-style config whose `architectures` name another model."""
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise ConfigError(f"{place}: field 'architectures' must be a list, got {show(archs)}")
    if archs and not any("setdlm" in str(a).lower() for a in archs):
        raise ConfigError(f"{place}: architectures {cfg.get('architectures')} is not SetDLM "
                          "(other BD3LM-style models are not supported)")


_QWEN3_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
}


def from_hf(cfg: Mapping[str, Any], dtype: str = "float32",
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
    _check_architectures(cfg, place)
    qwen, bplace = _backbone(cfg, place, base_config)
    hidden = int_field(qwen, "hidden_size", bplace, minimum=1)
    heads = int_field(qwen, "num_attention_heads", bplace, minimum=1)
    layers = _layers(cfg, place, qwen, bplace)
    tok = section(cfg, "tokenization_config", place)
    # Token ids are read from the top level, else from tokenization_config.
    ids = {key: cfg if key in cfg else tok for key in ("mask_token_id", "eos_token_id",
                                                       "bos_token_id")}
    mask_id = int_field(ids["mask_token_id"], "mask_token_id", place, None, minimum=0)
    if mask_id is None:
        raise ConfigError(f"{place} has no mask_token_id: the drafter needs a MASK token")
    rope = section(qwen, "rope_parameters", bplace)
    theta_in = qwen if qwen.get("rope_theta") is not None else rope
    noise = section(cfg, "noise_config", place)
    origin = {f: (bplace, field_name(qwen, k)) for f, k in _QWEN3_KEYS.items()}
    origin.update({key: (place, field_name(src, key)) for key, src in ids.items()})
    origin.update(num_layers=(place, "backbone_config.num_layers"),
                  block_size=(place, field_name(noise, "desired_block_size")),
                  rope_theta=(bplace, field_name(theta_in, "rope_theta")))
    return build_config(
        origin, place,
        family="setdlm",
        vocab_size=int_field(qwen, "vocab_size", bplace, minimum=1),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int_field(qwen, "num_key_value_heads", bplace, heads, minimum=1),
        head_dim=read_head_dim(qwen, bplace, hidden, heads),
        intermediate_size=int_field(qwen, "intermediate_size", bplace, minimum=1),
        rms_norm_eps=float_field(qwen, "rms_norm_eps", bplace, 1e-6, positive=True),
        mask_token_id=mask_id,
        eos_token_id=first_id(ids["eos_token_id"], "eos_token_id", place),
        bos_token_id=first_id(ids["bos_token_id"], "bos_token_id", place),
        # The noise schedule's desired block size is the window the checkpoint was tuned for.
        block_size=int_field(noise, "desired_block_size", place, 8, minimum=1),
        max_position_embeddings=int_field(qwen, "max_position_embeddings", bplace, 4096,
                                          minimum=1),
        rope_theta=float_field(theta_in, "rope_theta", bplace, 1e6, positive=True),
        rope_type="default",
        qk_norm=True,
        tie_embeddings=bool_field(qwen, "tie_word_embeddings", bplace, True),
        dtype=dtype,
    )
