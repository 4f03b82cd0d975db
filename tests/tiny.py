"""Random tiny transformers for property tests.

Weights are scaled so that attention is far from uniform and logits are peaked
(top-1/top-2 gaps of order 1, far above float32 noise), and the vocabulary is
small so that diffusion drafts are accepted often enough to exercise multi-token
acceptance and the cache commits. The draft-only adapter is on by default: the
output must not depend on it. Tests share one config where they can, so the
compiled programs are shared too.
"""

from __future__ import annotations

import functools

import jax

from packed_ss_jax import Model, ModelConfig
from packed_ss_jax import model as model_lib

_SCALE = {"q_proj": 10.0, "k_proj": 10.0, "v_proj": 4.0, "o_proj": 4.0, "head": 40.0, "embed": 20.0}


def tiny_config(vocab: int = 12, layers: int = 2, lora_rank: int = 2, **kw) -> ModelConfig:
    base = dict(family="nemotron", vocab_size=vocab, hidden_size=32, num_layers=layers,
                num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48,
                rms_norm_eps=1e-5, mask_token_id=vocab - 1, eos_token_id=1, bos_token_id=0,
                block_size=4, max_position_embeddings=256, rope_theta=10000.0,
                lora_rank=lora_rank, lora_alpha=2.0 * lora_rank)
    base.update(kw)
    return ModelConfig(**base)


@functools.partial(jax.jit, static_argnums=0)
def _params(c, key):
    params = model_lib.init_params(c, key)

    def scale(path, x):
        name = path[-1].key
        if name == "lora_b":  # zero-initialised; make the adapter actually do something
            return jax.random.normal(jax.random.fold_in(key, 1), x.shape, x.dtype) * 0.5
        return x * _SCALE.get(name, 1.0)

    return jax.tree_util.tree_map_with_path(scale, params)


def tiny_model(seed: int, **kw) -> Model:
    c = tiny_config(**kw)
    return Model(config=c, params=_params(c, jax.random.PRNGKey(seed)), source=f"tiny(seed={seed})")
