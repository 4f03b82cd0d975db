"""packed_ss_jax: self-speculative decoding with diffusion drafting, in JAX.

    model = packed_ss_jax.load("path/to/Nemotron-Labs-Diffusion-8B", dtype="bfloat16")
    result = packed_ss_jax.decode(model, prompt_ids, schedule="packed", block_size=32)
"""

from .api import DecodeResult, decode, logits
from .config import ConfigError, ModelConfig
from .checkpoints.errors import CheckpointError
from .conversion import convert
from .engine import NonFiniteError
from .loading import Model, load

__all__ = ["CheckpointError", "ConfigError", "DecodeResult", "Model", "ModelConfig",
           "NonFiniteError", "convert", "decode", "load", "logits"]
__version__ = "0.1.0"
