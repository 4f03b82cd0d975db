"""`ModelConfig.matmul_precision` reaches every matmul of the forward."""

import jax
import jax.numpy as jnp
import pytest

from packed_ss_jax import ConfigError
from packed_ss_jax import model as model_lib
from tiny import tiny_config


def dots(c, context: str) -> list[str]:
    """The dot_general lines of the forward lowered under jax.default_matmul_precision."""
    params = jax.eval_shape(  # the decoding layout: every layer's matmuls written out
        lambda: model_lib.unstack_layers(model_lib.init_params(c, jax.random.PRNGKey(0))))
    f = lambda p: model_lib.forward(c, p, jnp.zeros(3, jnp.int32), jnp.arange(3),  # noqa: E731
                                    jnp.ones((3, 3), bool), model_lib.empty_cache(c, 4), 2)[0]
    with jax.default_matmul_precision(context):
        text = jax.jit(f).lower(params).as_text()
    return [line for line in text.splitlines() if "dot_general" in line]


def test_highest_overrides_the_global_default():
    lines = dots(tiny_config().replace(matmul_precision="highest"), "bfloat16")
    # q, k, v, o, LoRA a and b, gate, up, down in each of 2 layers, and the head.
    assert len(lines) >= 9 * 2 + 1
    assert all("precision = [HIGHEST, HIGHEST]" in line for line in lines)


def test_default_follows_the_global_setting():
    lines = dots(tiny_config(), "bfloat16")
    assert lines and not any("HIGHEST" in line for line in lines)


def test_unknown_precision_names_the_field():
    with pytest.raises(ConfigError, match="matmul_precision"):
        dots(tiny_config().replace(matmul_precision="tf32"), "default")
