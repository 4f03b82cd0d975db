"""Nemotron-Labs-Diffusion's `config.json` -> ModelConfig.

The model is a Ministral-3 backbone with a diffusion head: its config carries every
dimension, RoPE (plain or YaRN, with the Llama-4 query scale) under `rope_parameters`
(transformers >= 5) or `rope_theta` + `rope_scaling` (older writers), and the MASK token
the drafter needs. The field readers (`packed_ss_jax.config`) name the field and the
file in every error.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..config import (ROPE_TYPES, ConfigError, ModelConfig, bool_field, build_config,
                      field_name, first_id, float_field, int_field, read_head_dim,
                      require_object, section, show, where)

MODEL_TYPE = "nemotron_labs_diffusion"  # config.json's model_type

_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps", "mask_token_id": "mask_token_id",
    "eos_token_id": "eos_token_id", "bos_token_id": "bos_token_id", "block_size": "block_size",
    "max_position_embeddings": "max_position_embeddings",
}
_ROPE_KEYS = {
    "rope_type": "rope_type", "rope_factor": "factor",
    "rope_original_max_position": "original_max_position_embeddings",
    "rope_beta_fast": "beta_fast", "rope_beta_slow": "beta_slow", "rope_mscale": "mscale",
    "rope_mscale_all_dim": "mscale_all_dim", "llama4_scaling_beta": "llama_4_scaling_beta",
}


def from_hf(cfg: Mapping[str, Any], dtype: str = "float32", base_config=None) -> ModelConfig:
    """Reads a Nemotron-Labs-Diffusion `config.json` (Ministral-3 backbone)."""
    if base_config is not None:  # the config carries every dimension itself
        raise ConfigError("base_config is only used for SetDLM checkpoints")
    place = where(cfg, "Nemotron-Labs-Diffusion config.json")
    require_object(cfg, place)
    hidden = int_field(cfg, "hidden_size", place, minimum=1)
    heads = int_field(cfg, "num_attention_heads", place, minimum=1)
    # Ministral-3 decouples head_dim from hidden/heads (the 3B model maps 3072 -> 4096).
    head_dim = read_head_dim(cfg, place, hidden, heads)
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = section(cfg, rope_key, place)
    theta_in = rope if rope.get("rope_theta") is not None else cfg
    rope_theta = float_field(theta_in, "rope_theta", place, 1e6, positive=True)
    type_key = "rope_type" if "rope_type" in rope else "type"
    rope_type = rope.get(type_key) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{place}: field {field_name(rope, type_key)!r} must be one of "
                          f"{ROPE_TYPES}, got {show(rope_type)}")
    mask_id = cfg.get("mask_token_id")
    if mask_id is None:
        raise ConfigError(f"{place} has no mask_token_id: the drafter needs a MASK token")
    origin = {f: (place, k) for f, k in _KEYS.items()}
    origin.update({f: (place, field_name(rope, k)) for f, k in _ROPE_KEYS.items()})
    origin["rope_type"] = (place, field_name(rope, type_key))
    origin["rope_theta"] = (place, field_name(theta_in, "rope_theta"))
    return build_config(
        origin, place,
        family="nemotron",
        vocab_size=int_field(cfg, "vocab_size", place, minimum=1),
        hidden_size=hidden,
        num_layers=int_field(cfg, "num_hidden_layers", place, minimum=1),
        num_heads=heads,
        num_kv_heads=int_field(cfg, "num_key_value_heads", place, heads, minimum=1),
        head_dim=head_dim,
        intermediate_size=int_field(cfg, "intermediate_size", place, minimum=1),
        rms_norm_eps=float_field(cfg, "rms_norm_eps", place, 1e-5, positive=True),
        mask_token_id=int_field(cfg, "mask_token_id", place, minimum=0),
        eos_token_id=first_id(cfg, "eos_token_id", place),
        bos_token_id=first_id(cfg, "bos_token_id", place),
        # The default block size of the speculative schedules: B >= 2.
        block_size=int_field(cfg, "block_size", place, 32, minimum=2),
        max_position_embeddings=int_field(cfg, "max_position_embeddings", place, 4096,
                                          minimum=1),
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_factor=float_field(rope, "factor", place, 1.0, positive=True),
        rope_original_max_position=int_field(rope, "original_max_position_embeddings", place,
                                             0, minimum=0),
        rope_beta_fast=float_field(rope, "beta_fast", place, 32.0),
        rope_beta_slow=float_field(rope, "beta_slow", place, 1.0),
        # 0 means unset, as in transformers' YaRN.
        rope_mscale=float_field(rope, "mscale", place, None) or 1.0,
        rope_mscale_all_dim=float_field(rope, "mscale_all_dim", place, None) or 1.0,
        llama4_scaling_beta=float_field(rope, "llama_4_scaling_beta", place, 0.0),
        qk_norm=False,
        tie_embeddings=bool_field(cfg, "tie_word_embeddings", place, False),
        dtype=dtype,
    )
