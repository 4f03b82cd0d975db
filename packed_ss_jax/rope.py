"""Rotary position embedding: plain, YaRN, and the Llama-4 query scale.

Frequencies are computed once per config in float64 NumPy and used at every
position (YaRN here is static, as in the Ministral-3 reference: nothing switches
on sequence length). Angles are formed in float32, as the reference does.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig


def inv_freq(c: ModelConfig) -> np.ndarray:
    """[head_dim/2] inverse frequencies, float32."""
    d = c.head_dim
    base = c.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if c.rope_type == "default" or c.rope_factor <= 1.0:
        return base.astype(np.float32)
    orig = c.rope_original_max_position

    def correction_dim(num_rotations):
        return d * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(c.rope_theta))

    low = max(math.floor(correction_dim(c.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(c.rope_beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    # ramp 0 keeps the original (high-frequency) pair, ramp 1 interpolates by `factor`.
    freq = (base / c.rope_factor) * ramp + base * (1.0 - ramp)
    return freq.astype(np.float32)


def attention_factor(c: ModelConfig) -> float:
    """YaRN's multiplier on cos/sin (exactly 1.0 when mscale == mscale_all_dim)."""
    if c.rope_type != "yarn" or c.rope_factor <= 1.0:
        return 1.0

    def mscale(m):
        return 0.1 * m * math.log(c.rope_factor) + 1.0

    return mscale(c.rope_mscale) / mscale(c.rope_mscale_all_dim)


def cos_sin(c: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """[T, head_dim/2] cos and sin for integer positions [T]."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq(c))[None, :]
    scale = attention_factor(c)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def query_scale(c: ModelConfig, positions: jnp.ndarray) -> jnp.ndarray:
    """[T] Llama-4 query multiplier, taken from each row's position id."""
    if not c.llama4_scaling_beta or not c.rope_original_max_position:
        return jnp.ones(positions.shape, jnp.float32)
    blocks = jnp.floor(positions.astype(jnp.float32) / c.rope_original_max_position)
    return 1.0 + c.llama4_scaling_beta * jnp.log1p(blocks)


def apply(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate-half RoPE on x [T, heads, head_dim] (non-interleaved halves)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
