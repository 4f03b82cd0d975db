"""packed_ss_jax: self-speculative decoding with diffusion drafting, in JAX.

    model = packed_ss_jax.load("path/to/Nemotron-Labs-Diffusion-8B", dtype="bfloat16")
    result = packed_ss_jax.decode(model, prompt_ids, schedule="packed", block_size=32)
    fn = packed_ss_jax.decoder(model, schedule="packed", block_size=32)  # pure, jittable
"""

from .api import DecodeResult, decode, decode_continuous, decoder, logits
from .checkpoints.errors import CheckpointError
from .compile_cache import set_compile_cache
from .config import ConfigError, ModelConfig
from .conversion import convert
from .engine import NonFiniteError
from .families import FAMILIES
from .loading import load
from .model import Model
from .requests import InputError
from .sharding import make_mesh

__all__ = ["CheckpointError", "ConfigError", "DecodeResult", "FAMILIES", "InputError", "Model",
           "ModelConfig", "NonFiniteError", "convert", "decode", "decode_continuous", "decoder",
           "load", "logits",
           "make_mesh", "set_compile_cache"]
__version__ = "0.1.0"
