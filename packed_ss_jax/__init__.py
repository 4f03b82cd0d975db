"""packed_ss_jax: self-speculative decoding with diffusion drafting, in JAX.

    model = packed_ss_jax.load("path/to/Nemotron-Labs-Diffusion-8B", dtype="bfloat16")
    result = packed_ss_jax.decode(model, prompt_ids, schedule="packed", block_size=32)
    for chunk in packed_ss_jax.stream(model, messages=[{"role": "user", "content": "Hi"}]):
        print(chunk.text, end="")                                     # as it decodes
    fn = packed_ss_jax.decoder(model, schedule="packed", block_size=32)  # pure, jittable
"""

from .api import (DecodeResult, StreamChunk, auto_planner, decode, decode_continuous, decoder,
                  logits, stream)
from .checkpoints.errors import CheckpointError
from .compile_cache import set_compile_cache
from .config import ConfigError, ModelConfig
from .conversion import convert
from .engine import Engine
from .families import FAMILIES
from .loading import load
from .model import Model
from .options import DecodeOptions
from .validate import InputError
from .results import NonFiniteError
from .sharding import make_mesh

__all__ = ["CheckpointError", "ConfigError", "DecodeOptions", "DecodeResult", "Engine", "FAMILIES", "InputError", "Model",
           "ModelConfig", "NonFiniteError", "StreamChunk", "auto_planner", "convert", "decode",
           "decode_continuous", "decoder", "load", "logits", "make_mesh", "set_compile_cache",
           "stream"]
__version__ = "0.1.0"
